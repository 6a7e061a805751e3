"""``AsyncReSPOTrainer``: TRL's ``AsyncGRPOTrainer`` with ReSPO's (or VESPO's) sequence loss, ReSPO's diagnostics
and per-sample staleness.

TRL's async trainer is where TRL users meet stale rollouts: a vLLM server generates while the trainer trains, each
sample carries the policy version that sampled it, and samples more than ``max_staleness`` versions old are dropped.
Its loss is a token clip with no hook, so this seam takes the forward TRL's ``compute_loss`` makes through a forward
hook on the model (one forward, TRL's), lets TRL compute and log everything it logs, and, for ``loss_type`` "respo"
or "vespo", returns the sequence loss of :func:`respo_trl.packed.packed_policy_loss` on the same log-probabilities in
place of TRL's. ``loss_type="clip"`` returns TRL's own loss untouched. The TRL names this module relies on are
declared in :mod:`respo_trl.trl_surface` (``ASYNC_*``) and checked when a trainer is built.

``W`` is taken against the log-probabilities the sampler returned (TRL's ``old_log_probs``), so it holds the policy's
movement since the sampled version *and* the sampler's numerical gap to the trainer (docs/async.md). On a machine
without CUDA, :mod:`respo_trl.integrations.async_cpu` makes TRL's trainer run (it does nothing on a GPU).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from accelerate.logging import get_logger

from .async_config import ASYNC_LOSSES, AsyncReSPOConfig
from .diagnostics import SAMPLER_GAP_STD, step_metrics
from .integrations import async_cpu
from .kernels import LossParams
from .packed import packed_policy_loss, unpack_terms
from .paper import ARXIV_ID, RESPO_CITATION, TITLE, TRAINER_TAGS
from .trl_surface import check_async_batch, check_async_state, check_async_surface

from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer  # noqa: E402  (async_config silenced it)
from trl.trainer.utils import pad  # noqa: E402

logger = get_logger(__name__)

PADDED_VERSION = -2  # "no sample here" in the collated batch's sample_version (a real version is >= 0)


class AsyncReSPOTrainer(AsyncGRPOTrainer):
    """Drop-in replacement for ``trl.experimental.async_grpo.AsyncGRPOTrainer`` that trains with ReSPO.

    Same arguments as TRL's. ``args`` may be an :class:`~respo_trl.async_config.AsyncReSPOConfig` (``loss_type``
    "respo", "vespo" or "clip") or a plain ``AsyncGRPOConfig``, which is upgraded to ReSPO at the paper's constants
    (logged once). On a CPU with no ``weight_transfer`` and no PEFT adapter, weights reach the server through
    :class:`~respo_trl.integrations.async_cpu.DiskWeightTransfer` (TRL's default sync needs NCCL).
    """

    _tag_names = [*TRAINER_TAGS, "async-grpo"]
    _name = "AsyncReSPO"
    _paper = {"title": TITLE, "id": ARXIV_ID, "citation": RESPO_CITATION}

    def __init__(self, model, reward_funcs=None, args=None, train_dataset=None, processing_class=None,
                 callbacks=None, optimizers=(None, None), peft_config=None, tools=None, environment_factory=None,
                 rollout_worker=None, weight_transfer=None):  # fmt: skip
        check_async_surface()
        cpu = async_cpu.prepare()  # no-op (and says so) where CUDA is available
        args = _respo_args(args, model)
        if cpu and weight_transfer is None and peft_config is None:
            weight_transfer = async_cpu.DiskWeightTransfer(args.vllm_server_base_url, model)
        super().__init__(model, reward_funcs, args, train_dataset, processing_class, callbacks, optimizers,
                         peft_config, tools, environment_factory, rollout_worker, weight_transfer)  # fmt: skip
        check_async_state(self)
        self.loss_params = LossParams.from_config(args)
        self._loss_name = ASYNC_LOSSES[args.loss_type]
        self._group_versions: dict[int, int] = {}  # group_id -> the policy version that sampled it (main process)
        self._sampler_gap_warned = False
        self._batch_checked = False
        if self.rollout_queue is not None:
            self.rollout_queue = _VersionTap(self.rollout_queue, self)
        logger.warning(_describe(args), main_process_only=True)

    def get_train_dataloader(self):
        # TRL's collator packs rows; the wrapper adds each packed sample's policy version (by its group), in the
        # order of its segment ids, so the loss knows how stale each sample is when it is used.
        loader = super().get_train_dataloader()
        base = getattr(loader, "base_dataloader", loader)  # accelerate's adapter iterates the DataLoader it wraps
        collate, versions = base.collate_fn, self._group_versions

        def collate_with_versions(examples):
            batch = collate(examples)
            (rows,) = examples
            per_row = [torch.tensor([versions.get(s["group_id"], -1) for s in row.samples], dtype=torch.long)
                       for row in rows]  # fmt: skip
            batch["sample_version"] = pad(per_row, padding_value=PADDED_VERSION)
            return batch

        base.collate_fn = collate_with_versions
        return loader

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if not self._batch_checked:
            check_async_batch(inputs)
            self._batch_checked = True
        captured = {}
        hook = model.register_forward_hook(lambda module, args, output: captured.setdefault("output", output))
        try:  # TRL's forward, loss and metrics, exactly as TRL computes them
            trl_loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        finally:
            hook.remove()
        output = captured["output"]
        selected = inputs["token_index"] >= 0
        log_probs = output.log_probs.flatten()[inputs["token_index"][selected]]  # TRL's indexing of its forward
        versions = inputs["sample_version"][0]
        versions = versions[versions != PADDED_VERSION]
        terms = (log_probs, inputs["old_log_probs"][selected], inputs["advantages"][selected],
                 inputs["segment_id"][selected])  # fmt: skip
        if self._loss_name == "ppo":
            loss = trl_loss
        else:
            accumulation = self.current_gradient_accumulation_steps
            tokens_per_rank = (inputs["global_n_tokens"][0] / self.accelerator.num_processes).clamp(min=1.0)
            result = packed_policy_loss(*terms, self._loss_name, self.loss_params, normalizer=tokens_per_rank.float(),
                                        num_sequences=len(versions))  # fmt: skip
            loss = result.loss / accumulation
            if self.aux_loss_enabled:  # as TRL adds it
                loss = loss + self.router_aux_loss_coef * output.aux_loss / accumulation
        self._log_sequence_metrics(log_probs.detach(), terms[1:], versions)
        return loss

    def _gather_rows(self, table: torch.Tensor) -> torch.Tensor:
        """All ranks' rows of a per-sequence table (ranks hold different numbers of samples)."""
        padded = self.accelerator.pad_across_processes(table, dim=0, pad_index=math.nan)
        gathered = self.accelerator.gather(padded)
        return gathered[~torch.isnan(gathered).all(-1)]

    def _log_sequence_metrics(self, log_probs, terms, versions) -> None:
        """ReSPO's diagnostics on this micro-batch's samples (their terms laid out as (S, T)) and each sample's
        staleness when used."""
        metrics = {}
        versions = versions.float().to(log_probs.device)
        if self.args.respo_log_diagnostics:
            sequences = unpack_terms(log_probs, *terms, num_sequences=len(versions))
            metrics, versions = step_metrics(
                sequences.log_probs, sequences.old_log_probs, sequences.advantages, sequences.mask, self.loss_params,
                self._loss_name, staleness=versions, gather=self._gather_rows,
            )  # fmt: skip  (the staleness column carries the versions; staleness is read on the main process)
        else:
            versions = self._gather_rows(versions.unsqueeze(-1)).squeeze(-1)
        if not self.accelerator.is_main_process:
            return
        known = versions[versions >= 0]
        staleness = self.model_version - known  # in versions: one per sync, every weight_sync_steps updates
        if staleness.numel():
            # a (sum, count) pair: TRL's log reduces it per sample over the window, whatever each micro-batch holds
            metrics["staleness/at_use_mean"] = (staleness.sum().item(), float(staleness.numel()))
            metrics["staleness/at_use_max"] = staleness.max().item()
        for key, value in metrics.items():
            self._metrics["train"][key].append(value)
        self._warn_sampler_gap(staleness, metrics.get("offpolicy/log_weight/std"))

    def _warn_sampler_gap(self, staleness, log_weight_std) -> None:
        """Once per run: on a micro-batch of samples used at staleness 0, a spread of ``log W`` above the alarm's line
        means the sampler's log-probabilities, not policy movement, are moving ``W``."""
        # staleness 0 means "sampled by the weights in use" only when every update is synced
        fresh = staleness.numel() > 0 and staleness.max().item() == 0 and self.args.weight_sync_steps == 1
        if self._sampler_gap_warned or not fresh or log_weight_std is None or not math.isfinite(log_weight_std):
            return
        if self._loss_name == "ppo" or log_weight_std <= SAMPLER_GAP_STD:
            return
        logger.warning(
            f"offpolicy/log_weight/std is {log_weight_std:.2f} on samples used at staleness 0 (above {SAMPLER_GAP_STD}):"
            " the sampler's log-probabilities differ from the trainer's enough to move W before the policy has moved "
            "(docs/async.md). Serve in float32 with --logprobs-mode processed_logprobs and keep the trainer's LM head "
            "in float32."
        )
        self._sampler_gap_warned = True


class _VersionTap:
    """TRL's rollout queue as TRL's dataset reads it: notes each sample's policy version by group, and counts the
    completion tokens received and the ones TRL's ``max_staleness`` rule is about to drop (the same rule, read at the
    same moment as TRL's dataset reads it)."""

    def __init__(self, queue, trainer: AsyncReSPOTrainer):
        self._queue, self._trainer = queue, trainer

    def get(self, *args, **kwargs):
        sample = self._queue.get(*args, **kwargs)
        trainer = self._trainer
        versions = trainer._group_versions
        versions[sample.group_id] = sample.model_version
        if len(versions) > 4096:  # groups older than any sample TRL still trains on
            floor = trainer.model_version - trainer.args.max_staleness - 1
            for group in [g for g, v in versions.items() if v < floor]:
                del versions[group]
        tokens = float(np.asarray(sample.completion_mask).sum())
        metrics = trainer._metrics["train"]
        metrics["async/received_tokens_total"].append(tokens)
        if trainer.model_version - sample.model_version > trainer.args.max_staleness:
            metrics["async/dropped_stale_tokens_total"].append(tokens)
        return sample

    def __getattr__(self, name):
        return getattr(self._queue, name)


def _respo_args(args, model) -> AsyncReSPOConfig:
    if args is None:
        name = str(model).rstrip("/").split("/")[-1]
        return AsyncReSPOConfig(f"{name}-AsyncReSPO")
    if isinstance(args, AsyncReSPOConfig):
        return args
    if not isinstance(args, AsyncGRPOConfig):
        raise TypeError(f"args must be an AsyncReSPOConfig or AsyncGRPOConfig, got {type(args).__name__}")
    logger.warning(
        "AsyncReSPOTrainer received a plain AsyncGRPOConfig: training with ReSPO at the paper's constants. Pass "
        "AsyncReSPOConfig(loss_type='clip') to train with TRL's async loss instead.",
        main_process_only=True,
    )
    return AsyncReSPOConfig.from_async_config(args)


def _describe(args: AsyncReSPOConfig) -> str:
    if args.loss_type == "clip":
        return f"AsyncReSPOTrainer: loss_type='clip', TRL's async token clip (epsilon {args.epsilon:g}), TRL's code."
    if args.loss_type == "vespo":
        return (f"AsyncReSPOTrainer: loss_type='vespo', VESPO's W^k exp(lambda (1 - W)) with (k, lambda) pos=("
                f"{args.vespo_k_pos:g}, {args.vespo_lambda_pos:g}) neg=({args.vespo_k_neg:g}, {args.vespo_lambda_neg:g})"
                f"; W against the sampler's log-probs, max_staleness={args.max_staleness}.")  # fmt: skip
    return (f"AsyncReSPOTrainer: ReSPO kernel (alpha, beta, lambda) pos=({args.respo_alpha_pos:g}, "
            f"{args.respo_beta_pos:g}, {args.respo_lambda_pos:g}) neg=({args.respo_alpha_neg:g}, {args.respo_beta_neg:g}, "
            f"{args.respo_lambda_neg:g}) on the raw sequence ratio W against the sampler's log-probs; "
            f"max_staleness={args.max_staleness}.")  # fmt: skip
