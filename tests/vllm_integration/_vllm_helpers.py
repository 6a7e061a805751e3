"""Log-probabilities of fixed token sequences under the trainer's model and under TRL's vLLM engine, and ReSPO's
coefficient written out from docs/method.md (so the tests recompute it without the package's kernel)."""

from __future__ import annotations

import math

import torch


@torch.no_grad()
def trainer_logps(model, prompt_ids: list[int], completion_ids: list[int]) -> torch.Tensor:
    """Per-token ``log pi(y_t | ...)`` of ``completion_ids`` under ``model`` (temperature 1), float32, shape (T,)."""
    ids = torch.tensor([list(prompt_ids) + list(completion_ids)])
    logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion_ids)[:, None])[:, 0]


def engine_logps(llm, prompt_ids: list[int], completion_ids: list[int]) -> torch.Tensor:
    """The same log-probs from the vLLM engine itself (its prompt log-probs of prompt + completion), shape (T,)."""
    from vllm import SamplingParams, TokensPrompt

    request = TokensPrompt(prompt_token_ids=list(prompt_ids) + list(completion_ids))
    output = llm.generate([request], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    scored = output.prompt_logprobs[len(prompt_ids) :]
    return torch.tensor([step[token].logprob for step, token in zip(scored, completion_ids)])


def unpadded(row_ids: torch.Tensor, row_mask: torch.Tensor) -> list[int]:
    return row_ids[row_mask.bool()].tolist()


def respo_phi(log_w: float, advantage: float, beta: float = 0.5, lam: float = 2.0) -> float:
    """``phi = phi0 exp(lambda (1 - phi0))`` with ``phi0 = (1 - beta) + beta W`` (alpha = 2) for ``A >= 0`` and
    ``phi0 = W^beta`` (alpha = 1, the limit) for ``A < 0``: the paper's constants (docs/method.md)."""
    w = math.exp(log_w)
    phi0 = (1 - beta) + beta * w if advantage >= 0 else w**beta
    return phi0 * math.exp(lam * (1 - phi0))
