"""What the benchmarks share: the machine record saved with their numbers, the worker and recipe set-up of the LM
benchmarks, and the statistics of a run's logged history.

Not a benchmark (it has no command line): the benchmarks import it, ``from benchmarks.common import machine_info``,
and run as modules from the repository root, ``python -m benchmarks.<name>``.
"""

from __future__ import annotations

import math
import os
import platform
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context
from pathlib import Path

# ---------------------------------------------------------------------------------------------------------------------
# The machine: timings mean little without the machine, threads and load
# ---------------------------------------------------------------------------------------------------------------------

# The trainer settings every CPU benchmark run shares: no GPU, fp32, no checkpointing, no loggers, saves or progress bars.
QUIET_CPU_TRAINING = dict(
    use_cpu=True, bf16=False, activation_checkpointing=False, report_to="none", save_strategy="no", disable_tqdm=True
)


def cpu_name() -> str:
    """The CPU model (``/proc/cpuinfo``'s first ``model name``), or what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def machine_info(device: str = "cpu") -> dict:
    """Device, CPU, core count, load average (a busy machine stretches every timing), torch and its thread count."""
    import torch

    info = {
        "device": device,
        "device_name": torch.cuda.get_device_name() if device == "cuda" else cpu_name(),
        "processor": cpu_name(),
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
    }
    return info


def command(name: str, argv: list[str]) -> str:
    """The command line that reproduces a run of benchmark ``name``, as the docs write it (saved with its numbers)."""
    return f"python -m benchmarks.{name} " + " ".join(argv)


# ---------------------------------------------------------------------------------------------------------------------
# The LM benchmarks' runs: worker processes, the arms' loss arguments, the shared warm start
# ---------------------------------------------------------------------------------------------------------------------

# The arms' loss settings: gspo is TRL's grpo loss with a sequence-level ratio and the clip range of the GSPO paper,
# as TRL documents it (the paper presets' --algorithm gspo does the same).
LOSS_ARGS = {
    "dapo": ["--loss_type", "dapo"],
    "gspo": ["--loss_type", "grpo", "--importance_sampling_level", "sequence", "--epsilon", "3e-4", "--epsilon_high", "4e-4"],
    "vespo": ["--loss_type", "vespo"],
    "respo": ["--loss_type", "respo"],
    # the paper's kernel without the directional token trust mask, which the default (respo_trust_mask="auto") turns on
    # under epochs
    "respo_nomask": ["--loss_type", "respo", "--respo_trust_mask", "none"],
    # the directional token trust mask forced on when each sample is used once (the default turns it on for epochs only)
    "respo_mask": ["--loss_type", "respo", "--respo_trust_mask", "directional"],
    # MoE Routing Replay (R3): the sampler's expert routing replayed in the loss forward
    "respo_r3": ["--loss_type", "respo", "--respo_routing_replay", "true"],
    # beta_pos = 0 makes phi+ = 1: no correction at all on positives (the lab's ablation found it at least as good)
    "respo_pos1": ["--loss_type", "respo", "--respo_beta_pos", "0"],
    # beta_neg = 0 makes phi- = 1: negatives weighted as on-policy whatever W (reuse_lm.md 2.7's mechanism arms)
    "respo_neg1": ["--loss_type", "respo", "--respo_beta_neg", "0"],
    # both: phi = 1, only the trust mask (under epochs) remains of ReSPO's loss
    "respo_flat": ["--loss_type", "respo", "--respo_beta_pos", "0", "--respo_beta_neg", "0"],
    # under epochs: phi at each sample's first-pass W (respo_epoch_weight), or at the current W (the default)
    "respo_first": ["--loss_type", "respo", "--respo_epoch_weight", "first_pass"],
    "respo_current": ["--loss_type", "respo", "--respo_epoch_weight", "current"],
}


def init_worker():
    """A benchmark worker process: one torch thread, offline."""
    os.environ.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    import torch

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)


def warm_start(model_kind: str, seed: int, extra: list[str], path: str) -> str:
    """Build the tiny model, imitate the task's teacher as the recipe does, save it where the arms load it from."""
    from transformers import set_seed

    if os.path.exists(os.path.join(path, "config.json")):
        return path
    from respo_trl import recipe

    # no RL runs here: parsed as TRL's dapo, so ReSPO's epochs warning does not speak for arms that may not run ReSPO
    script_args, _, _ = recipe.parse_args(["--tiny_model", model_kind, "--seed", str(seed), *extra, "--loss_type", "dapo"])
    set_seed(seed)
    model, tokenizer = recipe.build_tiny(script_args, seed=seed)
    train, _ = recipe.build_datasets(script_args)
    recipe.warm_start(model, tokenizer, train, script_args, seed=seed)
    tmp = path + ".tmp"
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, path)  # a crash never leaves a half-written warm start behind
    return path


def code_commit() -> str:
    """The commit the benchmarks' code is at (``-dirty`` when ``respo_trl/`` or ``benchmarks/`` differ from it): every
    run record names it."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def git(*cmd):
        return subprocess.run(["git", *cmd], cwd=root, capture_output=True, text=True).stdout.strip()

    sha = git("rev-parse", "HEAD") or "unknown"
    return sha + ("-dirty" if git("status", "--porcelain", "--untracked-files=no", "--", "respo_trl", "benchmarks") else "")


# A run's record is named ``<name>.json`` and stored gzip-compressed as ``<name>.json.gz`` (:func:`save_run`): the
# records are most of docs/benchmarks, and compressed they take a fifth of the room. Records written before 0.8 are
# plain ``<name>.json`` until ``python -m benchmarks.compact_records`` converts them; both read alike.
RECORD_GZ = ".gz"
ANSWERS_SUFFIX = ".answers.json.gz"  # a run's graded answers beside its record (reuse_lm): not a record


def stored_record(path) -> Path:
    """Where the record named ``path`` (``<name>.json``) is stored: ``<name>.json.gz``."""
    path = Path(path)
    return path if path.name.endswith(RECORD_GZ) else path.with_name(path.name + RECORD_GZ)


def read_record_text(path) -> str:
    """The JSON text of the record named ``path``: its compressed file, else a plain ``.json`` written before 0.8."""
    import gzip

    stored = stored_record(path)
    if stored.exists():
        return gzip.decompress(stored.read_bytes()).decode()
    return Path(str(path).removesuffix(RECORD_GZ)).read_text()


def write_record_text(path, text: str) -> Path:
    """Store a record's JSON ``text`` compressed at :func:`stored_record` of ``path`` (the same bytes for the same text:
    no time stamp in the gzip header), atomically, and remove a plain ``.json`` of the same name."""
    import gzip

    stored = stored_record(path)
    tmp = stored.with_name(stored.name + ".tmp")
    tmp.write_bytes(gzip.compress(text.encode(), compresslevel=9, mtime=0))
    tmp.replace(stored)
    Path(str(stored).removesuffix(RECORD_GZ)).unlink(missing_ok=True)
    return stored


def load_run(path) -> dict:
    """One run's record as every reader expects it, from its name (``<name>.json``) or its file: a history stored as
    columns (:func:`compact_history`) comes back as one dict per logged step; a record written before histories were
    compact (rows) comes back as it is. Readers go through here, never ``json.loads``, so that every form reads
    alike."""
    import json

    run = json.loads(read_record_text(path))
    if isinstance(run.get("history"), dict):
        run["history"] = history_rows(run["history"])
    return run


def record_names(folder) -> dict[str, Path]:
    """The records in ``folder`` by run name, compressed or (written before 0.8) plain, sorted by name."""
    folder = Path(folder)
    if not folder.exists():
        return {}
    found = {p.name.removesuffix(".json"): p for p in folder.glob("*.json")}
    found.update({p.name.removesuffix(".json" + RECORD_GZ): p for p in folder.glob("*.json" + RECORD_GZ)
                  if not p.name.endswith(ANSWERS_SUFFIX)})  # fmt: skip
    return dict(sorted(found.items()))


def load_runs(folder) -> dict[str, dict]:
    """The finished runs' records in ``folder`` (:func:`load_run`), by run name, sorted (the summaries' order does
    not depend on the disk); empty when the folder does not exist."""
    return {name: load_run(path) for name, path in record_names(folder).items()}


def record_json(record: dict) -> str:
    """A record's text: one line of JSON without spaces (a record is read by code, and diffs of it say little)."""
    import json

    return json.dumps(record, separators=(",", ":"))


def save_run(path, record: dict) -> dict:
    """Writes a run's ``record`` (its history already :func:`compact_history`) as :func:`record_json`, compressed
    (:func:`write_record_text`; ``path`` names it ``<name>.json``), and returns it as :func:`load_run` reads it back:
    a run just finished and the same run loaded later look alike to every reader (the same keys, the same rounded
    values)."""
    write_record_text(path, record_json(record))
    if isinstance(record.get("history"), dict):
        return {**record, "history": history_rows(record["history"])}
    return record


SIGNIFICANT_DIGITS = 6  # a logged metric kept in a record: more than any table prints, a third of float64's text


def record_precision(value):
    """``value`` as a record keeps it: a float to :data:`SIGNIFICANT_DIGITS` significant digits. Whole numbers (counts,
    token totals), zero, non-finite values and non-floats stay as they are (no shorter, and a count is exact). Rounding
    a rounded value changes nothing, so converting a record twice gives the same record."""
    if isinstance(value, float) and math.isfinite(value) and not value.is_integer():
        return float(f"{value:.{SIGNIFICANT_DIGITS}g}")
    return value


def compact_history(history, keys) -> dict[str, list]:
    """Per-step metrics as columns: ``step`` and each of ``keys`` that some step logged (not as None), one list entry
    per step (None where that step did not log the key), values to :func:`record_precision`. ``history`` is the log's
    rows or a compact history already (compacting again keeps it as it is). A run's record stores its history so;
    :func:`load_run` gives it back as rows."""
    if isinstance(history, dict):
        history = history_rows(history)
    present = [k for k in keys if any(h.get(k) is not None for h in history)]
    columns = {k: [record_precision(h.get(k)) for h in history] for k in present}
    return {"step": [h["step"] for h in history], **columns}


def history_rows(columns: dict[str, list]) -> list[dict]:
    """The rows of a :func:`compact_history` (a key a step did not log is absent from its row, as in the log)."""
    keys = [k for k in columns if k != "step"]
    return [{"step": step, **{k: columns[k][i] for k in keys if columns[k][i] is not None}}
            for i, step in enumerate(columns["step"])]  # fmt: skip


# The per-step metrics a study's records keep: every key that some reader of that study reads (its summaries, the
# commands its page names, the checks that pair new runs with stored ones) and no other; the rest of a run's report
# stays in its record. `python -m benchmarks.compact_records` brings records written before to this form.
_LOW_WEIGHT_POS = tuple(f"starvation/low_weight_pos/{k}" for k in ("n", "n_low", "mass", "mass_low", "respo_mass",
                                                                  "respo_mass_low", "vespo_mass", "vespo_mass_low"))
# reuse_lm: the safety rule's learning rate and by_pass (PASS_KEYS by reuse/pass), --passes-from's columns, the
# summaries' pos_length_growth, and adaptive_reuse's pilot (offpolicy/kl and offpolicy/ess by pass)
REUSE_LM_KEYS = (
    "learning_rate", "reuse/pass", "grad_norm", "reuse/grad_norm_vs_fresh", "respo/trust_masked_frac",
    "starvation/zero_coef_token_frac", "starvation/grad_throughput/pos", "starvation/grad_throughput/neg",
    "respo/phi_mean/pos", "respo/phi_mean/neg", "offpolicy/kl", "offpolicy/log_weight/mean", "clip_ratio/region_mean",
    "offpolicy/log_weight/min", "entropy", "starvation/pos_length_mean", "offpolicy/ess",
)  # fmt: skip
# regime and regime_mechanism (engine regime_runs): run_stats and the statistics of a run below, the gate's pooled
# positive branch, the comparison plot (reward and generated tokens per window), the pairing on the step-1 reward
REGIME_KEYS = (
    "reward", "reuse/staleness_mean", "reuse/generated_tokens", "offpolicy/kl", "completions/mean_length",
    "starvation/grad_throughput/pos", "starvation/grad_throughput/neg", "starvation/pos_length_mean", "grad_norm",
    "clip_ratio/region_mean", "offpolicy/log_weight/mean", *_LOW_WEIGHT_POS,
)  # fmt: skip
# smollm2_staleness: run_row (late mean, positive branch pooled and per cycle, frac_reward_zero_std, cycle KL, the
# positive/negative weight ratio), the gate's first cycle, the plot (reward against updates and generated tokens)
SMOLLM2_KEYS = (
    "reward", "reuse/staleness_mean", "reuse/generated_tokens", "offpolicy/kl", "completions/mean_length",
    "starvation/grad_throughput/pos", "starvation/grad_throughput/neg", "frac_reward_zero_std", *_LOW_WEIGHT_POS,
)  # fmt: skip
# The studies whose records hold histories, by their folder in docs/benchmarks/. archive/ holds retired versions'
# records, which nothing reads: they keep every logged key (None), to the same precision.
RECORD_KEYS = {"reuse_lm": REUSE_LM_KEYS, "regime": REGIME_KEYS, "regime_mechanism": REGIME_KEYS,
               "smollm2_staleness": SMOLLM2_KEYS, "archive": None}  # fmt: skip


def next_ready(queue: list[dict], ready: set, free: int) -> list[dict]:
    """The first ``free`` specs of ``queue``, in its order, that need nothing or whose ``needs`` is in ``ready``."""
    return [s for s in queue if s.get("needs") is None or s["needs"] in ready][: max(free, 0)]


def run_pool(specs: list[dict], run, *, workers: int, done: dict[str, dict], prepare: dict | None = None,
             on_prepared=None, on_result=None) -> dict[str, dict]:  # fmt: skip
    """The benchmarks' one resumable runner: every spec whose ``name`` is not in ``done`` runs as ``run(spec)`` (a
    module-level function returning the run's record) in ``workers`` spawned processes with one torch thread each.

    Resumable: what is in ``done`` (the records already on disk, :func:`load_runs`) is never rerun, and ``run`` itself
    resumes a run cut mid-way from its checkpoint when it has one. ``prepare`` maps a key to ``(function, args)``
    jobs that must finish first (warm starts); a spec naming one in ``needs`` waits for it. Runs start in the specs'
    order (the most useful partial result first), one per free worker, each as soon as what it needs is ready; a spec
    with a ``log`` path says where its progress goes when it starts (a run can be an hour of silence otherwise).
    ``on_prepared(key, result)`` and ``on_result(index, total, record, seconds)`` report; the default says one line
    per finished run. Returns ``done`` with the new records added."""
    import time

    todo = [s for s in specs if s["name"] not in done]
    unprepared = sorted({str(s["needs"]) for s in todo if s.get("needs") is not None and s["needs"] not in (prepare or {})})
    if unprepared:  # such a run would wait for ever and never run
        raise ValueError(f"runs need preparation jobs nobody gave: {', '.join(unprepared)}")
    prepare = {key: job for key, job in (prepare or {}).items() if any(s.get("needs") == key for s in todo)}
    start, finished = time.time(), 0
    on_result = on_result or (lambda i, n, record, t: print(f"  [{i}/{n}] {record['name']} ({t:.0f} s)", flush=True))
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn"), initializer=init_worker) as pool:
        pending = {pool.submit(function, *job_args): ("prepare", key) for key, (function, job_args) in prepare.items()}
        queue, ready = list(todo), set()

        def submit_ready():
            running = sum(kind == "run" for kind, _ in pending.values())
            for spec in next_ready(queue, ready, workers - running):
                queue.remove(spec)
                pending[pool.submit(run, spec)] = ("run", spec["name"])
                if spec.get("log"):
                    print(f"  started {spec['name']}: progress in {spec['log']}", flush=True)

        submit_ready()
        while pending:
            future = next(as_completed(pending))
            kind, key = pending.pop(future)
            result = future.result()
            if kind == "prepare":
                ready.add(key)
                if on_prepared:
                    on_prepared(key, result)
            else:
                finished += 1
                done[result["name"]] = result
                on_result(finished, len(todo), result, time.time() - start)
            submit_ready()
    return done


def resume_state(output_dir: str, updates: int) -> tuple[str | None, dict | None]:
    """Where a run started again stands: the checkpoint to resume from (``None``: start afresh or nothing to train)
    and, when it had trained all ``updates`` and was cut while being scored, its ``report.json`` (only the scoring
    reruns: the trainer refuses to resume a checkpoint at ``max_steps``). Stops in one line when the run trained to
    the end but was cut before its report was written."""
    import json

    from respo_trl.checkpoints import finished_at, last_complete_checkpoint

    resume, _ = last_complete_checkpoint(output_dir, num_processes=1)
    if resume is None or finished_at(resume, updates) is None:
        return resume, None
    report_path = os.path.join(output_dir, "report.json")
    report = json.load(open(report_path)) if os.path.exists(report_path) else None
    if report is None or report["training"]["global_step"] != updates:
        raise SystemExit(f"{output_dir} trained all {updates} updates but holds no report of them (cut while the "
                         "recipe evaluated or saved): delete the folder to rerun that run")  # fmt: skip
    return None, report


def write_record(record: dict, spec: dict, output_dir: str, start: float, train_s: float, resume, finished) -> dict:
    """A finished run's record, written to ``runs_dir`` (:func:`save_run`, its history compact already): its scratch
    folder removed, this process's times, and where it took over (``resumed_from_step``) or that it was only scored
    (``scored_only``: trained by an earlier process)."""
    import shutil
    import time

    shutil.rmtree(output_dir, ignore_errors=True)
    record["wall_s"], record["train_s"] = time.time() - start, train_s
    if resume:
        record["resumed_from_step"] = int(resume.rsplit("-", 1)[1])
    if finished:
        record["scored_only"] = True
    return save_run(os.path.join(spec["runs_dir"], spec["name"] + ".json"), record)


def train_logged(recipe_args: tuple, resume: str | None, report: dict | None, log) -> dict:
    """``recipe.main`` on ``recipe_args`` with its output in ``log``, or the finished run's ``report`` as it is."""
    import contextlib

    from respo_trl import recipe

    if report is not None:
        print("training finished before; scoring only", file=log, flush=True)
        return report
    if resume:
        print(f"resuming from {resume}", file=log, flush=True)
    with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):  # one log per run: a readable console
        return recipe.main(*recipe_args)


# ---------------------------------------------------------------------------------------------------------------------
# Statistics of runs
# ---------------------------------------------------------------------------------------------------------------------

def largest_fall(curve: list[dict]) -> tuple[float, float, int | None]:
    """(peak, largest fall below the running peak, in points; the step where that fall is reached) of a held-out
    curve (the step-0 point included)."""
    peak, fall, at, best = -1.0, 0.0, None, -1.0
    for point in curve:
        best = max(best, 100 * point["accuracy"])
        if best - 100 * point["accuracy"] > fall:
            fall, at = best - 100 * point["accuracy"], point["step"]
        peak = best
    return peak, fall, at


def tokens_to_reach(curve: list[tuple[float, float]], target: float) -> float | None:
    """First generated-token count at which the (linearly interpolated) curve of (tokens, accuracy) reaches
    ``target``; None if never."""
    import itertools

    for (t0, a0), (t1, a1) in itertools.pairwise(curve):
        if a0 >= target:
            return t0
        if a1 >= target:
            return t0 + (t1 - t0) * (target - a0) / (a1 - a0)
    return curve[-1][0] if curve and curve[-1][1] >= target else None


def spread(values: list[float]) -> dict:
    values = [v for v in values if v is not None]
    if not values:
        return {"mean": None, "std": None, "min": None, "max": None, "n": 0}
    return {
        "mean": statistics.fmean(values),
        "std": statistics.stdev(values) if len(values) > 1 else 0.0,
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


def pos_length_growth(run: dict) -> float | None:
    """The paper's length signature: mean length of positive responses over the last quarter of the updates divided
    by the first quarter's, minus 1 (the paper: +43% under ReSPO, +10% under VESPO)."""
    lengths = [h.get("starvation/pos_length_mean") for h in run.get("history", [])]
    lengths = [v for v in lengths if v is not None]
    quarter = len(lengths) // 4
    if quarter == 0:
        return None
    return statistics.fmean(lengths[-quarter:]) / statistics.fmean(lengths[:quarter]) - 1


def pooled_positive_branch(rows: list[dict]) -> dict:
    """The positive-branch diagnostic pooled over ``rows`` (logged steps): sums, then ratios (diagnostics.py)."""
    from respo_trl.diagnostics import LOW_WEIGHT_SUMS, pooled_low_weight

    sums = {k: sum(r.get(f"starvation/low_weight_pos/{k}", 0.0) or 0.0 for r in rows) for k in LOW_WEIGHT_SUMS}
    return {**pooled_low_weight(sums), "n": sums["n"], "n_low": sums["n_low"]}


def late_mean(run: dict) -> float | None:
    """The paper's late-mean training score: mean training reward of the rollout batches sampled in the second half
    of the updates (each batch counts once; under N = 1 every update is a batch of M x G)."""
    rewards = [h["reward"] for h in run["history"] if "reward" in h and h["step"] > run["updates"] // 2]
    return statistics.fmean(rewards) if rewards else None


def steady_rows(run: dict) -> list[dict]:
    """The logged updates of every reuse cycle but the first: the first holds the lr = 0 step and the warm-up (12
    updates), so movement measured there is not the run's movement at its learning rate."""
    return [h for h in run["history"] if h["step"] > run["N"]]


def kl_by_staleness(run: dict) -> dict[int, float]:
    """Mean ``offpolicy/kl`` (per token, k3, against the policy that sampled the batch) by staleness position ``k``,
    over :func:`steady_rows`: how far the policy has moved ``k`` updates into a cycle. Empty under N = 1."""
    by_k: dict[int, list[float]] = {}
    for h in steady_rows(run):
        if h.get("offpolicy/kl") is not None:
            by_k.setdefault(int(round(h.get("reuse/staleness_mean", 0))), []).append(h["offpolicy/kl"])
    return {k: statistics.fmean(v) for k, v in sorted(by_k.items()) if k > 0}


def per_update_kl(run: dict) -> dict:
    """Policy movement, per token (k3 ``offpolicy/kl``) and per response (times the run's mean completion length):
    ``per_token`` after one update (staleness 1), ``cycle`` over a cycle's last quarter (staleness 24-31 at N = 32),
    both over :func:`steady_rows`. Only ``cycle`` is measured where kernels differ: at staleness 1 every kernel's
    weight is 1, so the one-step figure says nothing about how a kernel moves the policy on stale rollouts. None under
    N = 1 (nothing is stale)."""
    kl = kl_by_staleness(run)
    last = [kl[k] for k in kl if k >= run["N"] - max(1, run["N"] // 4)]
    # TRL logs the completion length on sampling steps only: the run's mean completion length
    lengths = [h["completions/mean_length"] for h in run["history"] if "completions/mean_length" in h]
    length = statistics.fmean(lengths) if lengths else None
    per_token, cycle = kl.get(1), statistics.fmean(last) if last else None
    return {"per_token": per_token, "per_response": None if per_token is None or length is None else per_token * length,
            "cycle": cycle, "cycle_per_response": None if cycle is None or length is None else cycle * length}  # fmt: skip


def pos_neg_weight_ratio(run: dict) -> float | None:
    """Mean coefficient per token on positives over negatives on mini-batches at least N / 2 updates stale (steady
    cycles): how a kernel weighs stale correct answers against stale wrong ones (1 for clipped PPO on average)."""
    rows = [h for h in steady_rows(run) if h.get("reuse/staleness_mean", 0) >= run["N"] / 2]
    pos = [h["starvation/grad_throughput/pos"] for h in rows if h.get("starvation/grad_throughput/pos") is not None]
    neg = [h["starvation/grad_throughput/neg"] for h in rows if h.get("starvation/grad_throughput/neg") is not None]
    return statistics.fmean(pos) / statistics.fmean(neg) if pos and neg and statistics.fmean(neg) > 0 else None


# Two-sided 95% Student t quantiles t_{0.975, df} (standard tables); beyond df 30 the Cornish-Fisher expansion.
T_975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t_quantile(df: int) -> float:
    """``t_{0.975, df}``: the half-width factor of a two-sided 95% interval (scipy is not a dependency)."""
    if df < 1:
        return math.inf
    if df <= len(T_975):
        return T_975[df - 1]
    z = statistics.NormalDist().inv_cdf(0.975)
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def paired(a: dict[int, float], b: dict[int, float]) -> dict:
    """Paired differences ``a - b`` (points) over the seeds both have: per seed, mean, sd and the t interval."""
    seeds = sorted(set(a) & set(b))
    diffs = {s: 100 * (a[s] - b[s]) for s in seeds}
    values = list(diffs.values())
    out = {"seeds": seeds, "per_seed": diffs, "mean": None, "sd": None, "ci": None}
    if not values:
        return out
    out["mean"] = statistics.fmean(values)
    if len(values) > 1:
        sd = statistics.stdev(values)
        half = t_quantile(len(values) - 1) * sd / math.sqrt(len(values))
        out.update(sd=sd, ci=[out["mean"] - half, out["mean"] + half])
    return out
