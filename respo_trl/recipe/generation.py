"""Batched generation and sampling profiles for the recipe's models (the tiny demo's and real ones): the one helper
the held-out evaluator (:mod:`.heldout`), the benchmark evaluation (:mod:`.eval_math`), the warm start and the
benchmarks use to sample a model outside TRL's trainer.

Prompts are tokenised exactly as TRL's GRPO trainer tokenises them (the chat template with the generation prompt), so
what is measured here is what the trainer would sample. Everything is seeded.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..grading import accuracy_scores


def prompt_ids(tokenizer, prompt) -> list[int]:
    if isinstance(prompt, str):
        return tokenizer(prompt, add_special_tokens=False)["input_ids"]
    encoded = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def left_pad(rows: Sequence[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) of token-id rows, left-padded for batched generation."""
    width = max(len(ids) for ids in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    for row, ids in enumerate(rows):
        input_ids[row, width - len(ids) :] = torch.tensor(ids)
        attention[row, width - len(ids) :] = 1
    return input_ids, attention


def left_padded(tokenizer, prompts) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) of ``prompts`` tokenised as TRL does, left-padded for batched generation."""
    return left_pad([prompt_ids(tokenizer, p) for p in prompts], tokenizer.pad_token_id)


def end_tokens(model, tokenizer) -> list[int]:
    """The tokens that end a completion: the tokenizer's and the model's generation config's (Qwen3 has two)."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    eos = eos if isinstance(eos, list) else [] if eos is None else [eos]
    return sorted({*eos, tokenizer.eos_token_id} - {None})


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
    top_p: float = 1.0,
    top_k: int = 0,
    samples_per_prompt: int = 1,
    seed: int = 0,
    longest_first: bool = False,
    progress: bool = False,
) -> tuple[list[str], list[int]]:
    """``samples_per_prompt`` completions of each prompt, decoded without special tokens, and their token counts up to
    and including the end token (``max_new_tokens`` when cut off), prompt-major: sample ``j`` of prompt ``i`` is at
    ``i * samples_per_prompt + j``.

    Prompts are chat messages or text, tokenised as TRL tokenises them and left-padded in batches of ``batch_size``
    sequences; ``longest_first`` batches the longest prompts together (less padding, same returned order);
    ``progress`` shows a bar counting sequences. Greedy unless ``do_sample``. Seeded with ``seed``; the caller's torch
    RNG state is restored afterwards.
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    ids = [prompt_ids(tokenizer, p) for p in prompts]
    jobs = [(i, j) for i in range(len(prompts)) for j in range(samples_per_prompt)]
    if longest_first:
        jobs.sort(key=lambda job: -len(ids[job[0]]))
    eos = end_tokens(model, tokenizer)
    kwargs = {"do_sample": do_sample, "max_new_tokens": max_new_tokens}
    if do_sample:
        kwargs.update(temperature=temperature, top_p=top_p, top_k=top_k)
    else:  # greedy: neutralise sampling defaults a checkpoint's generation_config may carry
        kwargs.update(temperature=None, top_p=None, top_k=None)
    texts: list[str] = [""] * len(jobs)
    lengths: list[int] = [0] * len(jobs)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(jobs), desc="generating", unit="seq")
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        for start in range(0, len(jobs), batch_size):
            chunk = jobs[start : start + batch_size]
            input_ids, attention = left_pad([ids[i] for i, _ in chunk], tokenizer.pad_token_id)
            output = model.generate(
                input_ids=input_ids.to(device), attention_mask=attention.to(device),
                pad_token_id=tokenizer.pad_token_id, eos_token_id=eos if len(eos) > 1 else eos[0], **kwargs,
            )  # fmt: skip
            for (i, j), row in zip(chunk, output[:, input_ids.shape[1] :].tolist()):
                n = next((k + 1 for k, t in enumerate(row) if t in eos), len(row))
                texts[i * samples_per_prompt + j] = tokenizer.decode(row[:n], skip_special_tokens=True)
                lengths[i * samples_per_prompt + j] = n
            if bar is not None:
                bar.update(len(chunk))
    finally:
        torch.random.set_rng_state(generator_state)
        model.train(was_training)
        if bar is not None:
            bar.close()
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
    keep_completions: bool = False,
) -> dict:
    """What a policy looks like where RL will sample it: accuracy and entropy of completions at ``temperature``.

    Samples ``samples_per_prompt`` completions per prompt, grades them, and re-scores each with one forward pass to get
    the entropy of the policy's next-token distribution (at ``temperature``) at every completion token. Returns the
    accuracy (``avg@samples``), mean completion length, mean per-token entropy (nats, pooled over tokens) and mean
    entropy per response (nats summed over a completion: what a sequence log-weight ``log W`` can move with).
    ``keep_completions`` adds the decoded completions and their grades, in prompt-major order, so what was learnt can
    be read from the answers themselves.
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
        **({"completions": texts, "correct": list(correct)} if keep_completions else {}),
    }
