"""The rollout-reuse buffer: one generation batch served for ``R`` optimizer passes, with provenance.

Each process holds its own slice of the generation batch (what TRL's ``_generate_and_score_completions`` returns on
that process). A pass splits the slice into ``steps_per_generation`` micro-batches; with ``reshuffle`` every pass after
the first draws a new composition from a generator seeded by ``(seed, generation index, pass)``, so the order is
reproducible across a checkpoint/resume without saving any RNG state. With ``group_size`` (whole GRPO groups per
micro-batch) the permutation moves groups of ``group_size`` contiguous rows, in every pass including the first: a
micro-batch is then a whole number of groups, each of a group's rows at the same staleness.

Every rollout carries ``rollout_step``, the optimizer step (policy version) it was sampled at, and every served
micro-batch its rows' staleness at the step that serves it. The buffer counts the micro-batches it serves (so it knows
which one starts an optimizer step), the completion tokens ever sampled (the sampling compute) and the early
refreshes, and reports them as metrics (:meth:`RolloutBuffer.reuse_metrics`, :meth:`RolloutBuffer.step_summary`).

The state is saved as ``rollout_buffer-rank{r}.safetensors`` (tensors) + ``.json`` (everything else): no pickle.
Each file is written to a temporary name and renamed into place, so a kill mid-save never leaves a half-written file
under the real name. :func:`respo_trl.checkpoints.checkpoint_status` tells a complete trainer checkpoint from an
interrupted one; :meth:`RolloutBuffer.restore` is the resume policy (a checkpoint without buffer files starts a new
cycle, as TRL's own resume does).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

if TYPE_CHECKING:
    from .diagnostics import DriftSignals

Batch = dict[str, Any]

FORMAT_VERSION = 1
VERSION_KEY = "rollout_step"  # (B,) int64: optimizer step at which each rollout was sampled
# With track_first_weight: each row's index in the stored batch (it follows the row through reshuffled passes) and the
# log W it had on its first pass (NaN until then), which ReSPO keeps on its later passes (respo_epoch_weight).
ROW_KEY = "respo_row"
FIRST_LOG_W_KEY = "respo_first_log_w"
STALENESS_KEY = "respo_staleness"  # (B,) int64, served only: optimizer steps since each row was sampled


# Everything that decides which rows a resumed batch serves, and the setting each comes from: a mismatch would serve
# some rollouts twice and others never, silently. The last two decide it only when the stored batch is permuted: the
# group order (every pass, with whole groups) and each reshuffled pass after the first are drawn from the seed.
RESUME_FIELDS = {
    "reuse": "num_iterations (R)",
    "steps_per_generation": "steps_per_generation (N x gradient_accumulation_steps)",
    "num_processes": "the number of processes",
    "group_size": "respo_whole_groups (with num_generations)",
    "seed": "seed",
    "reshuffle": "respo_reshuffle",
}
PERMUTATION_FIELDS = ("seed", "reshuffle")

def buffer_files(checkpoint_dir: str, rank: int) -> tuple[str, str]:
    stem = os.path.join(checkpoint_dir, f"rollout_buffer-rank{rank}")
    return stem + ".safetensors", stem + ".json"


def has_buffer_files(checkpoint_dir: str) -> bool:
    """Whether any process saved a rollout buffer into ``checkpoint_dir`` (plain GRPOTrainer checkpoints have none)."""
    return any(name.startswith("rollout_buffer-rank") and name.endswith(".json") for name in os.listdir(checkpoint_dir))


def _write_atomically(path: str, write) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    write(tmp)
    os.replace(tmp, path)


def _batch_size(batch: Batch) -> int:
    for value in batch.values():
        if isinstance(value, torch.Tensor) and value.ndim > 0:
            return value.shape[0]
        if isinstance(value, list):
            return len(value)
    raise ValueError("cannot infer the batch size: the batch holds no tensor with a batch dimension and no list")


def _select(value: Any, index: torch.Tensor) -> Any:
    if isinstance(value, torch.Tensor) and value.ndim > 0:
        return value[index.to(value.device)]
    if isinstance(value, list):
        return [value[i] for i in index.tolist()]
    return value  # None and 0-dim tensors (e.g. num_items_in_batch) are shared by the whole batch


def _has_rows(value: Any) -> bool:
    return isinstance(value, list) or value.ndim > 0


def _own(value: Any) -> Any:
    """A slice of the stored batch as a copy of its own (a list's tensors too)."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    return [v.clone() if isinstance(v, torch.Tensor) else v for v in value]


def _to(value: Any, device: torch.device | str | None) -> Any:
    if device is not None and isinstance(value, torch.Tensor):
        return value.to(device)
    return value


def check_contiguous_groups(batch: Batch, group_size: int) -> None:
    """Raise (one line) unless every block of ``group_size`` consecutive rows shares one prompt: what whole-group
    mini-batches assume of TRL's generation batch (its sampler repeats each prompt ``num_generations`` times in a
    row). Compares ``prompt_ids`` under ``prompt_mask``."""
    ids, mask = batch["prompt_ids"], batch["prompt_mask"].bool()
    if ids.shape[0] % group_size:
        raise ValueError(f"generation slice of {ids.shape[0]} rows is not whole groups of num_generations={group_size}")
    prompts = torch.where(mask, ids, -1).reshape(-1, group_size, ids.shape[-1])
    split = (prompts != prompts[:, :1]).any(-1).any(-1)
    if split.any():
        first = int(split.nonzero()[0])
        raise ValueError(
            f"respo_whole_groups: rows {first * group_size}-{(first + 1) * group_size - 1} of the generation batch are "
            f"not one prompt's num_generations={group_size} completions (groups are not contiguous); use TRL's "
            "RepeatSampler order or set respo_whole_groups=False"
        )


# What makes the trainer sample before a batch has served its ``R`` passes (``RolloutBuffer.adaptive``): the mean
# per-token KL(pi_old || pi_theta) of the batch above the threshold, or the ESS of its sequence weights below it.
ADAPTIVE_SIGNALS = ("kl", "ess")


def _concat(values: list):
    """Rows of several micro-batches as one: tensors along dim 0, lists joined, shared scalars kept."""
    first = values[0]
    if isinstance(first, torch.Tensor) and first.ndim > 0:
        return torch.cat(values)
    if isinstance(first, list):
        return [item for value in values for item in value]
    return first


@dataclass(frozen=True)
class Served:
    """One micro-batch as the schedule served it, and what happened before it was served."""

    batch: Batch
    generation: int  # which stored batch it comes from (RolloutBuffer.generation_index)
    pass_index: int  # that batch's own pass over its rollouts (0: fresh)
    signals: DriftSignals | None  # the drift measured before it; None: nothing was checked
    sampled: str | None  # why a batch was sampled for it: "cycle", "refresh" (ESS floor) or "stop" (adaptive)

    def metrics(self) -> dict[str, float]:
        """``reuse/*_before_pass``: the drift the schedule measured before serving it (none when it checked nothing)."""
        return {} if self.signals is None else self.signals.metrics()


class RolloutBuffer:
    """The reuse schedule and the rollouts it serves: one stored generation batch, ``steps_per_generation``
    micro-batches per pass, ``reuse`` passes (one *cycle*), then a new batch.

    :meth:`next_micro_batch` is the whole schedule; the trainer gives it two functions, one that samples a fresh
    generation batch and one that measures how far the current policy has drifted from the one that sampled the
    stored rows (a forward pass), and serves what it returns. Two things sample before a cycle ends:

    * ``min_ess`` (a refresh): where rollouts are stale (before each reuse pass: the whole batch; under the paper's
      ``N``, before each optimizer step inside a pass: that step's micro-batches), an ESS of ``W`` below the floor
      replaces the batch for the same cycle; the fresh batch serves the cycle's remaining micro-batches.
    * ``adaptive`` (an early stop): before each reuse pass, a drift above ``threshold`` drops the batch's remaining
      passes and starts a new cycle on a fresh batch, which may serve all ``reuse`` passes. ``"kl"``: the mean
      per-token KL(pi_old || pi_theta) over the batch's tokens (the ``target_kl`` early stop of PPO implementations,
      with their ``1.5 x target_kl`` as ``threshold``); ``"ess"``: the normalised ESS of the sequence weights ``W``
      below ``threshold``.
    """

    def __init__(
        self,
        reuse: int,
        steps_per_generation: int,
        reshuffle: bool = True,
        seed: int = 0,
        storage_device: str | torch.device | None = None,
        num_processes: int = 1,
        group_size: int | None = None,
        track_first_weight: bool = False,
        accumulation: int = 1,
        min_ess: float | None = None,
        adaptive: str | None = None,
        threshold: float | None = None,
    ):
        if reuse < 1:
            raise ValueError(f"reuse must be >= 1, got {reuse}")
        if group_size is not None and group_size < 1:
            raise ValueError(f"group_size must be >= 1 or None, got {group_size}")
        if adaptive is not None and (adaptive not in ADAPTIVE_SIGNALS or threshold is None):
            raise ValueError(f"adaptive must be one of {ADAPTIVE_SIGNALS} with a threshold, got {adaptive!r}, {threshold!r}")
        self.reuse = reuse
        self.steps_per_generation = steps_per_generation
        self.reshuffle = reshuffle
        self.seed = seed
        self.storage_device = storage_device  # None: keep tensors where they were produced
        self.num_processes = num_processes  # each process holds its own slice: a resume needs the same number
        self.group_size = group_size  # None: rows are the unit of the shuffle; else whole groups of this many rows
        self.track_first_weight = track_first_weight  # store ROW_KEY / FIRST_LOG_W_KEY with every batch
        self.accumulation = accumulation  # micro-batches per optimizer step: the ESS floor's unit inside a pass
        self.min_ess, self.adaptive, self.threshold = min_ess, adaptive, threshold
        self.batch: Batch | None = None
        self.generation_index = 0  # how many batches were stored (fresh or refreshed)
        self.generated_tokens = 0  # completion tokens sampled so far, summed over processes
        self.refreshes = 0  # batches sampled before their cycle ended (ESS floor refreshes and adaptive stops)
        self.position = 0  # micro-batches served in the current cycle; 0: the next one starts a new cycle
        # The pass of the cycle in which the stored batch was stored: 0 for a batch sampled at the start of a cycle,
        # later for one that replaced a stale batch mid-cycle (the ESS floor). The batch's own pass over its rollouts
        # is the cycle's pass minus this.
        self.first_pass = 0
        self.step_passes: list[tuple[int, int]] = []  # (generation, pass) of each micro-batch of the optimizer step
        self.served = 0  # training micro-batches served so far: every ``accumulation``-th starts an optimizer step
        self._tokens_at_step_start = 0
        self._step_tokens: int | None = None  # tokens sampled for the current optimizer step, until reported
        self._fresh_grad_norm: tuple[int, float] | None = None  # (generation, grad_norm of its fresh pass)
        self._permutation: tuple[int, torch.Tensor] | None = None

    @classmethod
    def from_config(cls, args, num_processes: int) -> "RolloutBuffer":
        """The schedule a ``ReSPOConfig`` asks for, on ``num_processes`` processes."""
        return cls(
            reuse=args.num_iterations,
            steps_per_generation=args.steps_per_generation,
            reshuffle=args.respo_reshuffle_active,
            seed=args.seed,
            storage_device="cpu" if args.respo_buffer_device == "cpu" else None,
            num_processes=num_processes,
            group_size=args.num_generations if args.respo_whole_groups else None,
            track_first_weight=args.respo_first_pass_weight,
            accumulation=args.gradient_accumulation_steps,
            min_ess=args.respo_min_ess,
            adaptive=args.respo_adaptive_reuse,
            threshold=args.respo_adaptive_threshold_active,
        )

    def prompt_repeat_count(self) -> int | None:
        """How many consecutive micro-batches TRL's prompt sampler should repeat each generation batch's prompts for,
        or None for TRL's own count (all ``num_iterations`` passes). Under adaptive reuse a batch the drift check
        stops is followed by a fresh one, which should see new prompts (as PPO's early stop is followed by new
        episodes), not the same ones again: the prompts move on after every pass, and those of the passes a batch
        does serve are simply not sampled."""
        return self.steps_per_generation if self.adaptive is not None else None

    def samples_next(self, measure: Callable[[Batch], DriftSignals | None]) -> bool:
        """Whether the next micro-batch will sample a fresh batch: a cycle ended (or nothing is stored), or the drift
        check before it stops or refreshes the stored batch (``measure`` as for :meth:`next_micro_batch`, on the policy
        that will serve it; the check is made again, with the same result, when the micro-batch is served)."""
        if self.position == 0 or self.batch is None:
            return True
        rows = self._rows_to_check(*divmod(self.position, self.steps_per_generation))
        return rows is not None and self._decision(measure(rows)) is not None

    @property
    def cycle_length(self) -> int:
        """Micro-batches one batch serves when nothing stops it early: ``steps_per_generation x reuse``."""
        return self.steps_per_generation * self.reuse

    # -- the schedule ----------------------------------------------------------------------------------------------

    def next_micro_batch(
        self,
        step: int,
        sample: Callable[[], Batch],
        measure: Callable[[Batch], DriftSignals | None],
        device: torch.device | str | None = None,
    ) -> Served:
        """The next micro-batch of the schedule, at optimizer step ``step`` (the policy version of what is sampled
        now), with its rows' staleness (:data:`STALENESS_KEY`). ``sample()`` returns a fresh generation batch (this
        process's slice); ``measure(rows)`` returns the drift of the current policy from the sampling one on
        ``rows`` (the same on every process), or None when it cannot be measured."""
        new_step = self.served % self.accumulation == 0
        if new_step:
            self.step_passes = []
        cycle_pass, micro = divmod(self.position, self.steps_per_generation)
        signals, sampled = None, None
        if self.position == 0:
            self.store(sample(), step)
            sampled = "cycle"
        elif self.batch is None:  # mid-cycle with nothing stored: resampling here would silently change the run
            raise RuntimeError(
                f"No buffered rollouts to reuse at micro-batch {micro} of pass {cycle_pass + 1} of {self.reuse}; "
                "resume from a checkpoint that holds its rollout buffer."
            )
        elif (rows := self._rows_to_check(cycle_pass, micro)) is not None:
            signals = measure(rows)
            sampled = self._decision(signals)
            if sampled == "stop":  # the batch's remaining passes are dropped: a new cycle on a fresh batch
                self.store(sample(), step)
                self.position, cycle_pass, micro = 0, 0, 0
            elif sampled == "refresh":  # same cycle: the fresh batch serves its remaining micro-batches
                self.store(sample(), step, first_pass=cycle_pass)
            if sampled:
                self.refreshes += 1
        pass_index = cycle_pass - self.first_pass
        self.step_passes.append((self.generation_index, pass_index))
        batch = self.micro_batch(pass_index, micro, device)
        batch[STALENESS_KEY] = self.staleness(batch, step)
        self.position = (self.position + 1) % self.cycle_length
        self.served += 1
        if new_step:  # the sampling cost of this optimizer step, reported with its first micro-batch
            self._step_tokens = self.generated_tokens - self._tokens_at_step_start
            self._tokens_at_step_start = self.generated_tokens
        else:
            self._step_tokens = None
        return Served(batch, self.generation_index, pass_index, signals, sampled)

    def _rows_to_check(self, cycle_pass: int, micro: int) -> Batch | None:
        """What the drift is measured on before micro-batch ``micro`` of pass ``cycle_pass`` (never the first
        micro-batch of a cycle): the whole batch before a reuse pass; with the ESS floor, before each optimizer step
        inside a pass, that step's micro-batches (they stand or fall together). None: no check here."""
        if self.min_ess is None and self.adaptive is None:
            return None
        if micro == 0:
            return self.batch
        if self.min_ess is None or micro % self.accumulation:
            return None
        pass_index = cycle_pass - self.first_pass
        rows = [self.micro_batch(pass_index, micro + i) for i in range(self.accumulation)]
        return {key: _concat([row[key] for row in rows]) for key in rows[0]}

    def _decision(self, signals: DriftSignals | None) -> str | None:
        """``"stop"``, ``"refresh"`` or None for the measured drift (a NaN signal decides nothing)."""
        if signals is None:
            return None
        if self.adaptive == "kl" and signals.kl > self.threshold:
            return "stop"
        if self.adaptive == "ess" and signals.policy_ess < self.threshold:  # the policy's drift alone
            return "stop"
        if self.min_ess is not None and signals.ess < self.min_ess:
            return "refresh"
        return None

    def step_summary(self, grad_norm: float) -> dict[str, float]:
        """What an optimizer step's log adds (empty before any training micro-batch): ``reuse/pass``, which pass over
        its batch the step was (the mean when one step spans several passes, as with ``steps_per_generation <
        gradient_accumulation_steps``) and, for a step inside one reuse pass, ``reuse/grad_norm_vs_fresh``, its
        ``grad_norm`` relative to that same batch's fresh pass. Under reuse the failure to watch is a loss that keeps
        taking full steps on stale rollouts: the clipped loss's gradient norm falls several-fold on reuse passes, a
        sequence kernel's need not (docs/method.md, section 6)."""
        if not self.step_passes:
            return {}
        summary = {"reuse/pass": sum(p + 1 for _, p in self.step_passes) / len(self.step_passes)}
        ratio = self.grad_norm_vs_fresh(grad_norm)
        if ratio is not None:
            summary["reuse/grad_norm_vs_fresh"] = ratio
        return summary

    def grad_norm_vs_fresh(self, grad_norm: float) -> float | None:
        """For an optimizer step inside one pass over one batch: its ``grad_norm`` over that batch's fresh pass (the
        fresh pass's norm is remembered here); None for a fresh pass, a step spanning passes or batches, or a batch
        whose fresh pass was not seen (with ``logging_steps > 1`` it may not have been logged)."""
        if len(set(self.step_passes)) != 1:
            return None
        generation, pass_index = self.step_passes[0]
        if pass_index == 0:
            self._fresh_grad_norm = (generation, grad_norm)
            return None
        if self._fresh_grad_norm and self._fresh_grad_norm[0] == generation and self._fresh_grad_norm[1]:
            return grad_norm / self._fresh_grad_norm[1]
        return None

    def reuse_metrics(self, staleness: torch.Tensor) -> dict[str, float]:
        """``reuse/*`` of the micro-batch served last, from its rows' staleness (over all processes); the tokens
        sampled for an optimizer step are reported on its first micro-batch."""
        metrics = {"reuse/staleness_mean": staleness.mean().item(), "reuse/staleness_max": staleness.max().item()}
        if self._step_tokens is not None:
            metrics["reuse/generated_tokens_per_step"] = float(self._step_tokens)
        metrics["reuse/generated_tokens"] = float(self.generated_tokens)
        metrics["reuse/refreshes"] = float(self.refreshes)
        return metrics

    def finish_micro_batch(self, served: Batch, log_w: torch.Tensor | None, staleness: torch.Tensor) -> dict[str, float]:
        """After the loss of the training micro-batch ``served`` (as :meth:`next_micro_batch` served it): keep the
        ``log W`` the loss applied (None: a loss without ReSPO's weights) as the first-pass weight of its rows on their
        first pass (``respo_epoch_weight="first_pass"``), and return its :meth:`reuse_metrics`."""
        kept = served.get(FIRST_LOG_W_KEY)
        if log_w is not None and kept is not None and torch.isnan(kept).any():
            self.remember_first_weight(served[ROW_KEY], log_w)
        return self.reuse_metrics(staleness)

    def count_generated(self, tokens: int) -> None:
        """Add completion tokens sampled (summed over processes): the sampling cost reuse saves."""
        self.generated_tokens += int(tokens)

    def resume_without_files(self, micro_steps: int) -> int:
        """A resume from a checkpoint without a buffer (written by plain ``GRPOTrainer``) after ``micro_steps``
        micro-batches: nothing is stored, so the next micro-batch starts a new cycle, as TRL's own resume does.
        Returns how many micro-batches of the interrupted cycle that loses (0 at a cycle's end)."""
        self.batch, self.position, self._permutation, self.served = None, 0, None, 0
        return (self.cycle_length - micro_steps % self.cycle_length) % self.cycle_length

    def restore(self, checkpoint_dir: str, rank: int, device, micro_steps: int, logger) -> int:
        """The resume policy: this process's buffer from ``checkpoint_dir`` (:meth:`load`) or, for a checkpoint
        written by plain ``GRPOTrainer`` (no buffer files), a new cycle as TRL's own resume starts one, with a warning
        (``logger``) when that loses the rest of an interrupted batch. ``micro_steps``: micro-batches trained before
        the checkpoint. Returns TRL's micro-step counter (``_step``) to resume with."""
        if has_buffer_files(checkpoint_dir):
            return self.load(checkpoint_dir, rank, device=device)["step"]
        lost = self.resume_without_files(micro_steps)
        if lost:
            logger.warning(
                f"{checkpoint_dir} has no rollout buffer (written by plain GRPOTrainer?) and ends mid-cycle: the {lost} "
                "remaining micro-batches of its rollout batch are replaced by fresh rollouts, as TRL's resume does. "
                "The sampled-token counter restarts at 0."
            )
        else:
            logger.info(f"{checkpoint_dir} has no rollout buffer; it ends a generation cycle, so nothing is lost.")
        return 0

    # -- storing and serving ---------------------------------------------------------------------------------------

    def store(self, batch: Batch, version: int, first_pass: int = 0) -> None:
        """Keep ``batch`` (this process's generation slice) sampled by the policy of optimizer step ``version``, in
        pass ``first_pass`` of the reuse cycle (0 unless it replaces a stale batch mid-cycle)."""
        size = _batch_size(batch)
        batch = {key: _to(value, self.storage_device) for key, value in batch.items()}
        device = next((v.device for v in batch.values() if isinstance(v, torch.Tensor)), torch.device("cpu"))
        batch[VERSION_KEY] = torch.full((size,), int(version), dtype=torch.long, device=device)
        if self.track_first_weight:
            batch[ROW_KEY] = torch.arange(size, device=device)
            batch[FIRST_LOG_W_KEY] = torch.full((size,), float("nan"), device=device)
        if size % self.steps_per_generation:
            raise ValueError(
                f"generation batch of {size} rollouts cannot be split into {self.steps_per_generation} equal micro-batches"
            )
        if self.group_size is not None and (size // self.steps_per_generation) % self.group_size:
            raise ValueError(
                f"micro-batches of {size // self.steps_per_generation} rollouts are not whole groups of "
                f"{self.group_size}: make per_device_train_batch_size a multiple of num_generations"
            )
        self.batch = batch
        self.generation_index += 1
        self.first_pass = first_pass
        self._permutation = None

    @property
    def is_empty(self) -> bool:
        return self.batch is None

    def permutation(self, pass_index: int) -> torch.Tensor:
        """Order of the stored rollouts in pass ``pass_index``. Rows: identity for pass 0 or without reshuffling.
        Groups: a seeded permutation of whole groups in every pass (pass 0's again without reshuffling)."""
        size = _batch_size(self.batch)
        if self.group_size is None and (pass_index == 0 or not self.reshuffle):
            return torch.arange(size)
        draw = pass_index if self.reshuffle else 0
        generator = torch.Generator().manual_seed((self.seed * 1_000_003 + self.generation_index * 9_973 + draw) % (2**63))
        if self.group_size is None:
            return torch.randperm(size, generator=generator)
        groups = torch.randperm(size // self.group_size, generator=generator)
        return (groups[:, None] * self.group_size + torch.arange(self.group_size)).reshape(-1)

    def micro_batch(self, pass_index: int, micro_index: int, device: torch.device | str | None = None) -> Batch:
        """Micro-batch ``micro_index`` of the batch's own pass ``pass_index``, as tensors of its own: an in-place edit
        of what is served (by the trainer, TRL or a user's hook) never reaches the stored batch or a later pass. Only
        this micro-batch's rows are copied, never the whole batch (with Routing Replay at 30B geometry the routes
        alone are ~1.8 GB per GPU): the identity order (the first pass, or no reshuffling) copies its slice, a
        reshuffled pass gathers its rows."""
        if self.batch is None:
            raise RuntimeError("the rollout buffer is empty: store a generation batch first")
        size = _batch_size(self.batch)
        width = size // self.steps_per_generation
        if self.group_size is None and (pass_index == 0 or not self.reshuffle):
            rows = slice(micro_index * width, (micro_index + 1) * width)
            chunk = {k: _own(v[rows]) if isinstance(v, (torch.Tensor, list)) and _has_rows(v) else v
                     for k, v in self.batch.items()}  # fmt: skip
        else:
            if self._permutation is None or self._permutation[0] != pass_index:
                self._permutation = (pass_index, self.permutation(pass_index))
            index = self._permutation[1][micro_index * width : (micro_index + 1) * width]
            chunk = {k: _select(v, index) for k, v in self.batch.items()}
        return {key: _to(value, device) for key, value in chunk.items()}

    def remember_first_weight(self, rows: torch.Tensor, log_w: torch.Tensor) -> None:
        """Keep ``log_w`` as the first-pass weight of the stored ``rows`` that have none yet (their first pass)."""
        stored = self.batch[FIRST_LOG_W_KEY]
        rows = rows.to(stored.device)
        fresh = torch.isnan(stored[rows])
        stored[rows[fresh]] = log_w.detach().to(stored)[fresh.to(log_w.device)]

    def staleness(self, micro_batch: Batch, step: int) -> torch.Tensor:
        """Optimizer steps since each rollout of ``micro_batch`` was sampled."""
        return step - micro_batch[VERSION_KEY]

    # -- checkpointing -----------------------------------------------------------------------------------------------

    def save(self, checkpoint_dir: str, rank: int, extra: dict | None = None, include_batch: bool = True) -> None:
        """Write this process's buffer into ``checkpoint_dir`` (tensors as safetensors, the rest as JSON).

        ``include_batch=False`` (the batch has no pass left) writes the counters only.
        """
        os.makedirs(checkpoint_dir, exist_ok=True)
        tensor_path, meta_path = buffer_files(checkpoint_dir, rank)
        tensors, values = {}, {}
        batch = self.batch if include_batch else None
        for key, value in (batch or {}).items():
            if isinstance(value, torch.Tensor):
                tensors[key] = value.detach().to("cpu").contiguous()
            else:
                try:
                    json.dumps(value)
                except TypeError:
                    raise TypeError(
                        f"buffer field {key!r} of type {type(value).__name__} cannot be checkpointed as JSON"
                    ) from None
                values[key] = value
        meta = {
            "format_version": FORMAT_VERSION,
            "reuse": self.reuse,
            "steps_per_generation": self.steps_per_generation,
            "num_processes": self.num_processes,
            "reshuffle": self.reshuffle,
            "group_size": self.group_size,
            "seed": self.seed,
            "has_batch": batch is not None,
            "generation_index": self.generation_index,
            "generated_tokens": self.generated_tokens,
            "refreshes": self.refreshes,
            "first_pass": self.first_pass,
            "position": self.position,
            "tokens_at_step_start": self._tokens_at_step_start,
            "served": self.served,
            "track_first_weight": self.track_first_weight,
            "tensor_keys": sorted(tensors),
            "values": values,
            "extra": extra or {},
        }
        _write_atomically(tensor_path, lambda tmp: save_file(tensors, tmp))

        def write_meta(tmp):
            with open(tmp, "w") as f:
                json.dump(meta, f, indent=1)

        _write_atomically(meta_path, write_meta)  # last: its presence means this rank's buffer is complete

    def load(self, checkpoint_dir: str, rank: int, device: torch.device | str | None = None) -> dict:
        """Restore the buffer saved by :meth:`save`; returns its ``extra`` dict. Raises with the file named."""
        tensor_path, meta_path = buffer_files(checkpoint_dir, rank)
        for path in (meta_path, tensor_path):
            if not os.path.isfile(path):
                raise FileNotFoundError(
                    f"rollout buffer file {path} is missing: this checkpoint cannot resume the rollouts it was "
                    "training on (was it saved by respo_trl with the same number of processes? On several nodes, "
                    "output_dir must be on a filesystem every node shares: each rank writes and reads its own file)"
                )
        try:
            with open(meta_path) as f:
                meta = json.load(f)
            tensors = load_file(tensor_path)
        except (OSError, ValueError, SafetensorError) as error:
            raise ValueError(f"rollout buffer file in {checkpoint_dir} (rank {rank}) is corrupt: {error}") from error
        if meta.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"{meta_path}: unsupported format_version {meta.get('format_version')!r}")
        missing = set(meta["tensor_keys"]) - set(tensors)
        if missing:
            raise ValueError(f"{tensor_path} is corrupt: tensors {sorted(missing)} listed in {meta_path} are missing")
        groups = self.group_size is not None or meta.get("group_size") is not None
        permuted = meta["has_batch"] and (groups or (self.reuse > 1 and (self.reshuffle or meta.get("reshuffle"))))
        for name, setting in RESUME_FIELDS.items():
            if name in PERMUTATION_FIELDS and not permuted:
                continue  # the rest of the batch is served in its stored order (or nothing of it is left)
            # a file that does not name them was saved by one process, with rows as the unit of the shuffle
            saved = meta.get(name, {"num_processes": 1, "group_size": None}.get(name))
            if saved != getattr(self, name):
                raise ValueError(
                    f"{meta_path} was saved with {name}={saved} but this run has {name}={getattr(self, name)}; resume "
                    f"with {setting} as it was ({name}={saved}): it decides which rollouts the rest of the batch serves"
                )
        saved_first = bool(meta.get("track_first_weight", False))  # a file that does not say kept none
        if meta["has_batch"] and saved_first != self.track_first_weight:
            said = {True: "'first_pass' (or 'auto' under epochs)", False: "'current'"}
            raise ValueError(
                f"{meta_path} was saved mid-batch with respo_epoch_weight {said[saved_first]} but this run has "
                f"{said[self.track_first_weight]}; resume with respo_epoch_weight as it was: it decides the weights "
                "of the rest of the batch"
            )
        self.generation_index = meta["generation_index"]
        self.generated_tokens = meta["generated_tokens"]
        self.refreshes = meta["refreshes"]
        self.first_pass = meta.get("first_pass", 0)
        extra = meta["extra"]
        # where the cycle stands; files that do not say were written by trainers whose cycle was their micro-step
        # counter (``extra["step"]``) modulo the cycle's length
        self.position = meta.get("position", extra.get("step", 0) % self.cycle_length)
        self._tokens_at_step_start = meta.get("tokens_at_step_start", extra.get("tokens_at_step_start", 0))
        self.served = meta.get("served", extra.get("step", 0))  # files that do not say: the trainer's micro-step counter
        if meta["has_batch"]:
            target = self.storage_device if self.storage_device is not None else device
            self.batch = {key: _to(value, target) for key, value in tensors.items()}
            self.batch.update(meta["values"])
        else:
            self.batch = None
        self._permutation = None
        return extra
