"""The supervised warm start: a short fine-tune on reference completions before RL (``--warmstart_steps``).

Why: RL from verifiable rewards only learns from prompts where some sampled completions are right. A randomly
initialised model (the embedded demo's) is never right, so it first imitates reference completions for a few hundred
steps (a plain torch loop: on a model of a few hundred thousand parameters TRL's ``SFTTrainer`` would spend most of its
time in per-step overhead), deliberately stopping while the model is still often wrong; any dataset with a
``completion`` column can warm-start a real model the same way. Seeded: the same seed gives the same weights on the
same torch build.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence

import torch

from .generation import prompt_ids


def sft_examples(tokenizer, prompts: Sequence, completions: Sequence[str]) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, completion ids + EOS) pairs, tokenised exactly as TRL's GRPO trainer tokenises prompts."""
    out = []
    for prompt, completion in zip(prompts, completions, strict=True):
        target = tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        out.append((prompt_ids(tokenizer, prompt), target))
    return out


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
