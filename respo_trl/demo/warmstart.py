"""Warm start (a short supervised fine-tune) and held-out accuracy for the tiny demo and the recipes.

Why: RL from verifiable rewards only learns from prompts where some sampled completions are right. A randomly
initialised model is never right, so the embedded default first imitates reference completions for a few hundred
steps (a plain torch loop: on a model of a few hundred thousand parameters TRL's ``SFTTrainer`` would spend most of its
time in per-step overhead), deliberately stopping while the model is still often wrong. ReSPO then has something to
improve, and the improvement is measured on a held-out split with the same math-verify grading as the reward.

Everything here is seeded; the same seed gives the same warm-started weights on the same torch build.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence

import torch

from ..grading import accuracy_scores


def _prompt_ids(tokenizer, prompt) -> list[int]:
    if isinstance(prompt, str):
        return tokenizer(prompt, add_special_tokens=False)["input_ids"]
    encoded = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def sft_examples(tokenizer, prompts: Sequence, completions: Sequence[str]) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, completion ids + EOS) pairs, tokenised exactly as TRL's GRPO trainer tokenises prompts."""
    out = []
    for prompt, completion in zip(prompts, completions, strict=True):
        target = tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        out.append((_prompt_ids(tokenizer, prompt), target))
    return out


def left_padded(tokenizer, prompts) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) of ``prompts`` tokenised as TRL does, left-padded for batched generation."""
    chunk = [_prompt_ids(tokenizer, p) for p in prompts]
    width = max(len(ids) for ids in chunk)
    input_ids = torch.full((len(chunk), width), tokenizer.pad_token_id, dtype=torch.long)
    attention = torch.zeros((len(chunk), width), dtype=torch.long)
    for row, ids in enumerate(chunk):
        input_ids[row, width - len(ids) :] = torch.tensor(ids)
        attention[row, width - len(ids) :] = 1
    return input_ids, attention


def _collate(examples, pad_id: int):
    width = max(len(p) + len(c) for p, c in examples)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    attention = torch.zeros((len(examples), width), dtype=torch.long)
    for row, (p, c) in enumerate(examples):
        ids = p + c
        input_ids[row, : len(ids)] = torch.tensor(ids)
        labels[row, len(p) : len(ids)] = torch.tensor(c)
        attention[row, : len(ids)] = 1
    return input_ids, attention, labels


def supervised_warm_start(
    model,
    tokenizer,
    prompts: Sequence,
    completions: Sequence[str],
    *,
    steps: int,
    batch_size: int = 64,
    learning_rate: float = 3e-3,
    warmup_steps: int = 20,
    weight_decay: float = 0.0,
    seed: int = 0,
    on_step: Callable[[int, float], None] | None = None,
) -> list[float]:
    """Train ``model`` on (prompt, completion) pairs with a completion-only cross-entropy; returns the loss per step.

    AdamW with linear warmup then cosine decay to 10% of ``learning_rate``; batches drawn with a seeded RNG.
    """
    if steps <= 0:
        return []
    examples = sft_examples(tokenizer, prompts, completions)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=weight_decay, betas=(0.9, 0.98))

    def lr_at(step: int) -> float:
        if step < warmup_steps:
            return learning_rate * (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, steps - warmup_steps)
        return learning_rate * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    model.train()
    device = next(model.parameters()).device
    losses = []
    for step in range(steps):
        batch = [examples[rng.randrange(len(examples))] for _ in range(batch_size)]
        input_ids, attention, labels = (t.to(device) for t in _collate(batch, tokenizer.pad_token_id))
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        if on_step is not None:
            on_step(step, losses[-1])
    model.eval()
    return losses


@torch.no_grad()
def generate(
    model,
    tokenizer,
    prompts: Sequence,
    *,
    max_new_tokens: int,
    batch_size: int = 128,
    do_sample: bool = False,
    temperature: float = 1.0,
    seed: int = 0,
) -> tuple[list[str], list[int]]:
    """Completions (decoded without special tokens) and their token counts, batched with left padding."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    texts, lengths = [], []
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        for start in range(0, len(prompts), batch_size):
            input_ids, attention = left_padded(tokenizer, prompts[start : start + batch_size])
            width = input_ids.shape[1]
            kwargs = {"do_sample": do_sample, "max_new_tokens": max_new_tokens}
            kwargs.update(temperature=temperature, top_p=1.0, top_k=0) if do_sample else kwargs.update(
                temperature=None, top_p=None, top_k=None
            )
            output = model.generate(
                input_ids=input_ids.to(device),
                attention_mask=attention.to(device),
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
                **kwargs,
            )
            for row in output[:, width:].tolist():
                n = next((i + 1 for i, t in enumerate(row) if t == tokenizer.eos_token_id), len(row))
                lengths.append(n)
                texts.append(tokenizer.decode(row[:n], skip_special_tokens=True))
    finally:
        torch.random.set_rng_state(generator_state)
        model.train(was_training)
    return texts, lengths


@torch.no_grad()
def sampling_profile(
    model,
    tokenizer,
    prompts: Sequence,
    solutions: Sequence[str],
    *,
    max_new_tokens: int,
    samples_per_prompt: int = 1,
    temperature: float = 1.0,
    batch_size: int = 64,
    seed: int = 0,
    reward_fn=None,
) -> dict:
    """What a policy looks like where RL will sample it: accuracy and entropy of completions at ``temperature``.

    Samples ``samples_per_prompt`` completions per prompt, grades them, and re-scores each with one forward pass to get
    the entropy of the policy's next-token distribution (at ``temperature``) at every completion token. Returns the
    accuracy (``avg@samples``), mean completion length, mean per-token entropy (nats, pooled over tokens) and mean
    entropy per response (nats summed over a completion: what a sequence log-weight ``log W`` can move with).
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    repeated = [p for p in prompts for _ in range(samples_per_prompt)]
    answers = [a for a in solutions for _ in range(samples_per_prompt)]
    texts, entropies, lengths = [], [], []
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        for start in range(0, len(repeated), batch_size):
            input_ids, attention = left_padded(tokenizer, repeated[start : start + batch_size])
            width = input_ids.shape[1]
            output = model.generate(
                input_ids=input_ids.to(device), attention_mask=attention.to(device), do_sample=True,
                temperature=temperature, top_p=1.0, top_k=0, max_new_tokens=max_new_tokens,
                pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
            )  # fmt: skip
            completion = output[:, width:]
            is_eos = completion == tokenizer.eos_token_id
            first_eos = torch.where(is_eos.any(-1), is_eos.int().argmax(-1), completion.shape[1])
            keep = torch.arange(completion.shape[1], device=device)[None, :] <= first_eos[:, None]
            full_mask = torch.cat([attention.to(device), keep.long()], dim=1)
            positions = (full_mask.cumsum(-1) - 1).clamp(min=0)  # as generate numbers left-padded rows
            logits = model(input_ids=output, attention_mask=full_mask, position_ids=positions).logits
            logits = logits[:, width - 1 : -1].float() / temperature
            logp = torch.log_softmax(logits, -1)
            token_entropy = -(logp.exp() * logp).sum(-1) * keep
            for row in range(completion.shape[0]):
                n = int(keep[row].sum())
                lengths.append(n)
                entropies.append(token_entropy[row].sum().item())
                texts.append(tokenizer.decode(completion[row, :n].tolist(), skip_special_tokens=True))
    finally:
        torch.random.set_rng_state(generator_state)
        model.train(was_training)
    correct = accuracy_scores(texts, answers, reward_fn)
    tokens = sum(lengths)
    return {
        "accuracy": sum(correct) / max(len(correct), 1),
        "n_prompts": len(prompts),
        "samples_per_prompt": samples_per_prompt,
        "temperature": temperature,
        "mean_length": tokens / max(len(lengths), 1),
        "entropy_per_token": sum(entropies) / max(tokens, 1),
        "entropy_per_response": sum(entropies) / max(len(entropies), 1),
        "truncated_share": sum(n >= max_new_tokens for n in lengths) / max(len(lengths), 1),
        "per_prompt_accuracy": [
            sum(correct[i : i + samples_per_prompt]) / samples_per_prompt
            for i in range(0, len(correct), samples_per_prompt)
        ],
    }
