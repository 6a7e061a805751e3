"""Rollouts for TRL's async trainer without a server: sampled with transformers in the trainer's process, on demand,
from a policy a controlled number of versions back.

:class:`InProcessRollouts` is both a ``RolloutWorkerProtocol`` and a ``WeightTransferProtocol`` (pass it as
``rollout_worker`` and ``weight_transfer``): every weight sync stores a snapshot of the trainer's weights under the
version TRL then announces, and when TRL's dataset asks for a sample and none is queued, one prompt's group is
sampled from the snapshot ``k`` versions behind the current one, ``k`` drawn from ``lag_probabilities`` (seeded). The
samples carry that version, so TRL's ``max_staleness`` rule and its metrics see them as they would see a server's.

Why it exists: tests need no server, and a study of "keep or drop stale samples" needs every arm to meet the same
staleness distribution, which a real server's timing cannot promise (docs/async.md). Log-probabilities come from the
full softmax at the sampling temperature (``generate``'s default top-k would truncate them), so at staleness 0 a
sample's ratio is 1 up to attention kernels' rounding. Not a production worker: generation is sequential and slow.
"""

from __future__ import annotations

import collections
import math
import queue
import random

import numpy as np
import torch


class _OnDemandQueue:
    """The queue TRL's dataset drains: ``get`` samples a new group when it is empty (never blocks, never waits)."""

    def __init__(self, fill):
        self._items, self._fill = collections.deque(), fill

    def get(self, block=True, timeout=None):
        while not self._items:
            self._items.extend(self._fill())
        return self._items.popleft()

    def put_nowait(self, item):
        self._items.append(item)

    def qsize(self) -> int:
        return len(self._items)


class InProcessRollouts:
    """Rollout worker and weight transfer for ``AsyncGRPOTrainer`` in one object, sampling with transformers.

    ``model`` is the path the trainer loads (the sampler starts from the same weights); ``dataset`` has a
    conversational ``prompt`` column, its other columns go to the reward functions as TRL's worker passes them;
    ``lag_probabilities`` maps a lag ``k >= 0`` (versions behind the current policy) to its probability (default: all
    samples fresh); one lag is drawn per call, which samples ``groups_per_call`` prompts' groups in one batch. The
    version a group is sampled from is never below the first synced one. ``dtype``: the sampler's, the trainer's by
    default (float32). Sampling seeds torch's global generator once per call (deterministic runs).
    """

    def __init__(self, model, processing_class, dataset, reward_funcs, *, num_generations: int, max_tokens: int,
                 temperature: float = 1.0, lag_probabilities: dict[int, float] | None = None, seed: int = 0,
                 groups_per_call: int = 1, dtype: str = "float32"):  # fmt: skip
        from transformers import AutoModelForCausalLM

        # the trainer's dtype (float32 unless its config says otherwise), not the checkpoint's: a bf16 sampler would
        # give every sample a sampler gap the trainer does not have
        self.sampler = (AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)) if isinstance(model, str)
                        else model).eval()  # fmt: skip
        self.tokenizer = processing_class
        self.dataset = dataset
        self.reward_funcs = reward_funcs if isinstance(reward_funcs, list) else [reward_funcs]
        self.num_generations, self.max_tokens, self.temperature = num_generations, max_tokens, temperature
        lags = lag_probabilities or {0: 1.0}
        if any(int(k) != k or k < 0 for k in lags) or any(p < 0 for p in lags.values()) or sum(lags.values()) <= 0:
            raise ValueError(f"lag_probabilities must map lags >= 0 to probabilities summing to > 0, got {lags}")
        self.lags, self.lag_weights = [int(k) for k in lags], [float(p) for p in lags.values()]
        self.max_lag = max(self.lags)
        self.rollout_buffer = _OnDemandQueue(self._sample_groups)
        self.metrics_queue = queue.Queue()
        self.snapshots: dict[int, dict[str, torch.Tensor]] = {}
        self.model_version = 0
        self.generated_tokens = 0  # completion tokens sampled, dropped ones included
        self.groups = 0
        self._pending = None
        self._loaded = None
        self.seed, self.calls, self.groups_per_call = seed, 0, groups_per_call
        self._rng = random.Random(seed)
        self._order: list[int] = []

    # -- WeightTransferProtocol: a sync stores a snapshot, named by the version TRL announces next ----------------------

    def init_weight_transfer(self) -> None:
        pass

    def pause(self) -> None:
        pass

    def send_weights(self, iterator) -> None:
        self._pending = {name: tensor.detach().to("cpu").clone() for name, tensor in iterator}

    def resume(self) -> None:
        pass

    def destroy(self) -> None:
        pass

    # -- RolloutWorkerProtocol -----------------------------------------------------------------------------------------

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def check_health(self, stale_after_s: float) -> None:
        pass

    def update_model_version(self, model_version: int) -> None:
        if self._pending is not None:
            self.snapshots[model_version] = self._pending
            self._pending = None
        self.model_version = model_version
        for version in [v for v in self.snapshots if v < model_version - self.max_lag]:
            del self.snapshots[version]

    # -- sampling --------------------------------------------------------------------------------------------------

    def _next_row(self) -> dict:
        if not self._order:
            self._order = list(range(len(self.dataset)))
            self._rng.shuffle(self._order)
        return self.dataset[self._order.pop()]

    def _policy(self, lag: int) -> int:
        """Load the snapshot ``lag`` versions back (the oldest kept one if fewer exist); returns its version."""
        if not self.snapshots:
            return self.model_version
        version = max(self.model_version - lag, min(self.snapshots))
        version = max(v for v in self.snapshots if v <= version)
        if self._loaded != version:
            unexpected = self.sampler.load_state_dict(self.snapshots[version], strict=False).unexpected_keys
            if unexpected:  # names the sampler does not have would be silently ignored: the weights would not move
                raise RuntimeError(f"the synced weights have names the sampler lacks: {unexpected[:3]}")
            self._loaded = version
        return version

    @torch.no_grad()
    def _sample_groups(self) -> list:
        """``groups_per_call`` prompts' groups, sampled in one batch from the policy one drawn lag back."""
        from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

        lag = self._rng.choices(self.lags, weights=self.lag_weights)[0]
        version = self._policy(lag)
        rows = [self._next_row() for _ in range(self.groups_per_call)]
        prompts = [list(self.tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True,
                                                           return_dict=False)) for row in rows]  # fmt: skip
        eos, pad = self.tokenizer.eos_token_id, self.tokenizer.pad_token_id
        ids, attention = _left_padded(prompts, pad)
        torch.manual_seed(self.seed * 1_000_003 + self.calls)  # generate draws from the global RNG
        self.calls += 1
        out = self.sampler.generate(
            ids, attention_mask=attention, do_sample=True, temperature=self.temperature, top_k=0, top_p=1.0,
            max_new_tokens=self.max_tokens, num_return_sequences=self.num_generations, pad_token_id=pad,
            eos_token_id=eos,
        )  # fmt: skip
        g = self.num_generations
        completions = []
        for row_ids in out[:, ids.shape[1]:].tolist():
            end = row_ids.index(eos) + 1 if eos in row_ids else len(row_ids)
            completions.append(row_ids[:end])
        logps = self._log_probs([prompts[i // g] for i in range(len(completions))], completions)
        texts = self.tokenizer.batch_decode(completions, skip_special_tokens=True)
        names = [getattr(func, "__name__", type(func).__name__) for func in self.reward_funcs]
        samples = []
        for j, row in enumerate(rows):
            span = range(j * g, (j + 1) * g)
            messages = [[{"role": "assistant", "content": texts[i]}] for i in span]
            extra = {key: [value] * g for key, value in row.items() if key != "prompt"}
            columns = [func(prompts=[row["prompt"]] * g, completions=messages,
                            completion_ids=[completions[i] for i in span], **extra) for func in self.reward_funcs]  # fmt: skip
            rewards, advantages, reward_std = _group_advantages(columns)
            n_prompt = len(prompts[j])
            for k, i in enumerate(span):
                metrics = {"reward": float(rewards[k]), "reward_std": reward_std,
                           **{f"rewards/{name}": _float(column[k]) for name, column in zip(names, columns)}}  # fmt: skip
                samples.append(RolloutSample(
                    prompt=row["prompt"], completion=messages[k],
                    input_ids=np.asarray(prompts[j] + completions[i], dtype=np.int64),
                    completion_mask=np.asarray([0] * n_prompt + [1] * len(completions[i]), dtype=np.int64),
                    old_log_probs=np.asarray([0.0] * n_prompt + logps[i], dtype=np.float32),
                    advantage=float(advantages[k]), model_version=version, group_id=self.groups, metrics=metrics,
                ))  # fmt: skip
                self.generated_tokens += len(completions[i])
            self.groups += 1
        return samples

    def _log_probs(self, prompts: list[list[int]], completions: list[list[int]]) -> list[list[float]]:
        """Each completion token's log-probability under the sampler, from the full softmax at the temperature (one
        left-padded batch, positions counted from each sequence's first token, as the trainer counts them)."""
        ids, attention = _left_padded([p + c for p, c in zip(prompts, completions)], self.tokenizer.pad_token_id)
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        logits = self.sampler(input_ids=ids, attention_mask=attention, position_ids=positions).logits.float()
        logps = torch.log_softmax(logits[:, :-1] / self.temperature, dim=-1)
        chosen = logps.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
        return [chosen[i, chosen.shape[1] - len(c):].tolist() if c else [] for i, c in enumerate(completions)]


def _left_padded(sequences: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in sequences)
    ids = torch.tensor([[pad] * (width - len(s)) + s for s in sequences])
    attention = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in sequences])
    return ids, attention


def _float(value) -> float:
    return math.nan if value is None else float(value)


def _group_advantages(columns: list[list]) -> tuple[np.ndarray, np.ndarray, float]:
    """TRL's async worker's group advantage: rewards summed over functions (None skipped; all None: unscorable, NaN),
    then ``(r - mean) / (std + 1e-8)`` with the population std over the scorable samples, 0 for the unscorable."""
    arr = np.array([[_float(v) for v in column] for column in columns], dtype=float)
    unscorable = np.all(np.isnan(arr), axis=0)
    rewards = np.nansum(arr, axis=0)
    rewards[unscorable] = np.nan
    advantages = np.zeros_like(rewards)
    scored = rewards[~unscorable]
    if scored.size:
        advantages[~unscorable] = (scored - scored.mean()) / (scored.std() + 1e-8)
        return rewards, advantages, float(scored.std())
    return rewards, advantages, math.nan
