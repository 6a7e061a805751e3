"""``ReSPOTrainer``: TRL's ``GRPOTrainer`` with the ReSPO loss, the rollout-reuse buffer and per-step diagnostics.

This module is the one seam between respo_trl and TRL. Every ``GRPOTrainer`` (or ``transformers.Trainer``) method the
trainer changes is overridden here, once, with TRL's exact signature and kind, and hands its work to the module that
owns it: ReSPO's loss to :mod:`respo_trl.trl_loss`, the math to :mod:`respo_trl.kernels`, the metrics to
:mod:`respo_trl.diagnostics`, the reuse logic to :mod:`respo_trl.buffer`, MoE Routing Replay to
:mod:`respo_trl.routing_replay`. Every TRL name the seam reads or writes is declared in :mod:`respo_trl.trl_loss`
(``TRL_METHODS``, ``TRL_STATE``, ``GENERATE_FIELDS``) and checked when a trainer is built. Every other ``loss_type``
runs TRL's code unchanged.

Values pass between the overrides as arguments and return values, with one exception TRL forces: its own loss types
run their forward inside TRL's ``_compute_loss``, so the log-probabilities the diagnostics need (and the rows to count
as 0 in that forward) travel through one :class:`LossForward` record that ``_compute_loss`` opens before the call and
closes after it; ``_get_per_token_logps_and_entropies`` fills it only while it is open.
"""

from __future__ import annotations

import inspect
import os
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from accelerate.logging import get_logger
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl import GRPOConfig, GRPOTrainer
from trl.trainer.utils import shuffle_sequence_dict, split_pixel_values_by_grid, unsplit_pixel_values_by_grid

from .buffer import FIRST_LOG_W_KEY, ROW_KEY, VERSION_KEY, RolloutBuffer, check_contiguous_groups, has_buffer_files
from .checkpoints import checkpoint_status, finished_at, last_complete_checkpoint
from .config import ReSPOConfig, describe_kernel, respo_notes
from .diagnostics import (
    COLUMNS,
    LOW_WEIGHT_PREFIX,
    LOW_WEIGHT_SUMS,
    pooled_low_weight,
    sampler_gap_warning,
    sequence_stats,
    summarize,
)
from .integrations.vllm import check_colocated_weight_sync
from .kernels import (
    FOLDS_SAMPLER_RATIO,
    LossParams,
    fold_sampler_ratio,
    kish_ess,
    registered_loss_for,
    sequence_log_weight,
)
from .paper import ARXIV_ID, RESPO_CITATION, TITLE, TRAINER_TAGS
from .routing_replay import ROUTES_KEY, attach_routing_replay
from .trl_loss import (
    MULTIMODAL_KEYS,
    check_generate_output,
    check_trl_hooks,
    check_trl_loop_state,
    check_trl_state,
    gamma_weights,
    respo_loss,
)

logger = get_logger(__name__)


def drop_nonfinite(inputs: dict) -> tuple[dict, torch.Tensor]:
    """``(inputs, dropped)``: every sequence whose advantage, stored log-probs or sampler ratio is NaN/inf on a loss
    token is masked out of the loss (through TRL's loss-only ``tool_mask``, keeping its tool-call zeros), and the
    non-finite values of the kept rows (padding) are filled, so the loss is never NaN; ``dropped`` is (B,) bool."""
    mask = inputs["completion_mask"].bool()
    advantages = inputs["advantages"]
    bad = ~torch.isfinite(advantages.reshape(advantages.shape[0], -1)).all(-1)
    fills = {"old_per_token_logps": 0.0, "ref_per_token_logps": 0.0, "importance_sampling_ratio": 1.0}
    for key in fills:
        value = inputs.get(key)
        if value is not None:
            bad = bad | (~torch.isfinite(value) & mask).any(-1)
    if not bad.any():
        return inputs, bad
    inputs = dict(inputs)
    keep = ~bad
    inputs["advantages"] = torch.where(keep.reshape(-1, *[1] * (advantages.dim() - 1)), advantages, 0.0)
    for key, fill in fills.items():
        if inputs.get(key) is not None:
            value = inputs[key]
            inputs[key] = torch.where(keep.unsqueeze(-1) & torch.isfinite(value), value, fill)
    loss_mask = inputs.get("tool_mask", torch.ones_like(inputs["completion_mask"]))
    inputs["tool_mask"] = loss_mask * keep.unsqueeze(-1).to(loss_mask.dtype)  # TRL's loss-only mask
    return inputs, bad


@dataclass
class LossForward:
    """The loss forward of one ``_compute_loss`` call: rows it counts as 0 (``dropped``, with any non-finite value:
    TRL's loss still multiplies a dropped row's terms by 0, and a forward that underflowed would make that NaN), and
    the (log-probs, entropies) it returned, detached, for the diagnostics."""

    dropped: torch.Tensor
    logps: torch.Tensor | None = None
    entropies: torch.Tensor | None = None

    def clean(self, logps: torch.Tensor) -> torch.Tensor:
        if self.dropped.shape[0] != logps.shape[0]:
            return logps
        return torch.where(~torch.isfinite(logps) | self.dropped.unsqueeze(-1).to(logps.device), 0.0, logps)


class ReSPOTrainer(GRPOTrainer):
    """Drop-in replacement for ``trl.GRPOTrainer`` that trains with ReSPO.

    Accepts the same arguments. ``args`` may be a :class:`ReSPOConfig` (any ``loss_type`` works, so baselines run
    through the same plumbing, exactly as TRL runs them) or a plain ``GRPOConfig``, which is upgraded to ReSPO at the
    paper's defaults (logged once).
    """

    _tag_names = list(TRAINER_TAGS)
    _name = "ReSPO"
    _paper = {"title": TITLE, "id": ARXIV_ID, "citation": RESPO_CITATION}
    # What writes output_dir/README.md when TRL asks for a card (at every checkpoint save and push). None: TRL's own
    # card, named ReSPO with the paper's citation and tags. The recipe sets respo_trl.hub.card.write_trainer_card
    # (kernel, reuse, measured numbers) on the instance; the trainer never imports the card code.
    card_writer = None
    # MoE Routing Replay (R3; respo_routing_replay=True): the engine on the model, or None
    routing_replay = None
    _loss_forward: LossForward | None = None  # open only inside _compute_loss (the one exception, module docstring)

    def __init__(self, model, reward_funcs=None, args: GRPOConfig | None = None, *rest, **kwargs):
        check_trl_hooks()
        if args is None:
            name = model if isinstance(model, str) else model.config._name_or_path
            args = ReSPOConfig(f"{str(name).rstrip('/').split('/')[-1]}-ReSPO")
        elif not isinstance(args, ReSPOConfig):
            if not isinstance(args, GRPOConfig):
                raise TypeError(f"args must be a ReSPOConfig or GRPOConfig, got {type(args).__name__}")
            previous = args.loss_type
            args = ReSPOConfig.from_grpo_config(args)
            logger.warning(
                f"ReSPOTrainer received a plain GRPOConfig (loss_type={previous!r}): training with ReSPO at the "
                f"paper's defaults. Pass ReSPOConfig(loss_type={previous!r}) to train with TRL's loss instead.",
                main_process_only=True,
            )
        super().__init__(model, reward_funcs, args, *rest, **kwargs)
        check_trl_state(self)
        if self.use_vllm and self.vllm_mode == "colocate":  # an engine TRL cannot sync into stops here, in one line
            check_colocated_weight_sync(self.vllm_generation)
        if self.loss_type == "respo":
            for line in [describe_kernel(args), *respo_notes(args)]:
                logger.warning(line, main_process_only=True)
        self.loss_params = LossParams.from_config(args)
        self._loss_name = registered_loss_for(self.loss_type)
        self.rollouts = RolloutBuffer(  # the reuse schedule (passes, refreshes, adaptive stops) and its rollouts
            reuse=args.num_iterations,
            steps_per_generation=args.steps_per_generation,
            reshuffle=args.respo_reshuffle_active,
            seed=args.seed,
            storage_device="cpu" if args.respo_buffer_device == "cpu" else None,
            num_processes=self.accelerator.num_processes,
            group_size=args.num_generations if args.respo_whole_groups else None,
            track_first_weight=args.respo_first_pass_weight,
            accumulation=args.gradient_accumulation_steps,
            min_ess=args.respo_min_ess,
            adaptive=args.respo_adaptive_reuse,
            threshold=args.respo_adaptive_threshold_active,
        )
        self._sampler_gap_warned = False  # the sampler-gap alarm fires once per run
        if args.respo_routing_replay:  # MoE Routing Replay (R3): respo_trl/routing_replay.py
            self.routing_replay = attach_routing_replay(self)

    # -- rollout reuse -----------------------------------------------------------------------------------------------

    def _prepare_inputs(self, generation_batch):
        if not self.model.training:
            return super()._prepare_inputs(generation_batch)  # evaluation: TRL's path, no buffering
        served = self.rollouts.next_micro_batch(
            self.state.global_step,
            sample=lambda: self._sample(generation_batch),  # the sampler repeats the cycle's prompts until it ends
            measure=self._drift,
            device=self.accelerator.device,
            new_step=self._step % self.current_gradient_accumulation_steps == 0,
        )
        if served.signals is not None:
            self._metrics["train"]["reuse/ess_before_pass"].append(served.signals["ess"])
            self._metrics["train"]["reuse/kl_before_pass"].append(served.signals["kl"])
        return unsplit_pixel_values_by_grid(served.batch)

    def _sample(self, generation_batch) -> dict:
        """A fresh generation batch for the buffer: TRL's generation and scoring, in TRL's row order or whole groups."""
        batch = split_pixel_values_by_grid(self._generate_and_score_completions(generation_batch))
        if self.rollouts.group_size is None:
            batch = shuffle_sequence_dict(batch)  # first-pass composition, as TRL does
        else:  # whole groups: the buffer shuffles groups (seeded), so the rows must still sit in TRL's group order
            check_contiguous_groups(batch, self.rollouts.group_size)
        return batch

    def _routes(self, inputs: dict):
        """Context in which log-prob forwards replay the routes stored in ``inputs`` (no-op without Routing Replay)."""
        return self.routing_replay.batch(inputs) if self.routing_replay is not None else nullcontext()

    def _generate(self, prompts):
        replay = self.routing_replay
        with replay.recording() if replay is not None else nullcontext():
            output = super()._generate(prompts)
        check_generate_output(output)
        if replay is not None:
            replay.finish(output[0], output[1])  # prompt_ids, completion_ids (lists)
        if self.model.training:
            completion_ids, tool_mask = output[1], output[2]
            if tool_mask is not None:  # count model-generated tokens only, as TRL's length metrics do
                local = sum(sum(mask) for mask in tool_mask)
            else:
                local = sum(len(ids) for ids in completion_ids)
            total = self.accelerator.reduce(torch.tensor(float(local), device=self.accelerator.device), "sum")
            self.rollouts.count_generated(int(total.item()))
        return output

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        if self.routing_replay is not None:  # the routes follow the rows through shuffling, buffer and checkpoints
            output[ROUTES_KEY] = self.routing_replay.take_layout(output["prompt_ids"], output["completion_ids"])
        return output

    def _get_per_token_logps_and_entropies(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        pixel_values=None,
        image_grid_thw=None,
        num_images=None,
        pixel_attention_mask=None,
        spatial_shapes=None,
        num_tiles=None,
        image_sizes=None,
        token_type_ids=None,
        mm_token_type_ids=None,
        image_position_ids=None,
    ):
        # every log-prob forward (old log-probs, reference, the loss, the ESS check) replays the routes of its rows
        replay = self.routing_replay
        replaying = replay is not None and replay.replaying(input_ids, replay.forward_routes(input_ids, logits_to_keep))
        with replaying or nullcontext():
            logps, entropies, aux_loss = super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size,
                compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss, pixel_values=pixel_values,
                image_grid_thw=image_grid_thw, num_images=num_images, pixel_attention_mask=pixel_attention_mask,
                spatial_shapes=spatial_shapes, num_tiles=num_tiles, image_sizes=image_sizes,
                token_type_ids=token_type_ids, mm_token_type_ids=mm_token_type_ids,
                image_position_ids=image_position_ids,
            )  # fmt: skip
        record = self._loss_forward
        if record is not None and record.logps is None:  # the loss's own forward (the first inside _compute_loss)
            logps = record.clean(logps)
            record.logps, record.entropies = logps.detach(), None if entropies is None else entropies.detach()
        return logps, entropies, aux_loss

    @torch.no_grad()
    def _drift(self, batch) -> dict[str, float] | None:
        """How far the current policy has moved from the one that sampled ``batch``, over all processes: the
        normalised Kish ESS of the raw sequence weights ``W`` (sampler correction included) and the mean per-token
        KL(pi_old || pi_theta) (k3 estimator, sampler correction excluded, as ``offpolicy/kl``). One no-grad forward;
        None without stored old log-probabilities (nothing is stale)."""
        batch = unsplit_pixel_values_by_grid(dict(batch))
        batch = {k: v.to(self.accelerator.device) if torch.is_tensor(v) else v for k, v in batch.items()}
        old = batch.get("old_per_token_logps")
        if old is None:
            return None
        completion_ids = batch["completion_ids"]
        with self._routes(batch):  # MoE Routing Replay: the buffered rows' recorded routes
            logps, _, _ = self._get_per_token_logps_and_entropies(
                self.model,
                torch.cat([batch["prompt_ids"], completion_ids], dim=1),
                torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1),
                completion_ids.size(1),
                batch_size=self.args.per_device_train_batch_size,
                **{key: batch.get(key) for key in MULTIMODAL_KEYS},
            )
        mask = batch["completion_mask"] * batch.get("tool_mask", 1)
        log_c, kept = fold_sampler_ratio(self._sampler_ratio(batch), mask)
        log_w = sequence_log_weight(logps - old, kept, log_c)
        valid = kept.any(-1) & torch.isfinite(log_w)
        rho = torch.where(kept, (logps - old).float(), 0.0)
        kl = torch.where(kept, torch.expm1(rho) - rho, 0.0).sum(-1)  # k3 per sequence, summed over its kept tokens
        rows = torch.stack([log_w, valid.float(), kl, kept.float().sum(-1)], dim=-1)
        gathered = self.accelerator.gather(rows)
        ess = kish_ess(gathered[:, 0][gathered[:, 1] > 0]).item()
        return {"ess": ess, "kl": (gathered[:, 2].sum() / gathered[:, 3].sum().clamp(min=1.0)).item()}

    def _sampler_ratio(self, inputs):
        """TRL's vLLM importance-sampling ratio when the correction is on (it then enters every loss), else None."""
        if self.use_vllm and self.vllm_importance_sampling_correction:
            return inputs.get("importance_sampling_ratio")
        return None

    # -- loss ----------------------------------------------------------------------------------------------------------

    def _compute_loss(self, model, inputs):
        if self.model.training:
            check_trl_loop_state(self)
        inputs, dropped = drop_nonfinite(inputs)
        forward = LossForward(dropped)
        kept_log_w = self._kept_log_w(inputs)  # respo_epoch_weight="first_pass": the W a sample's phi keeps
        self._loss_forward = forward  # closed below, whatever happens (the one exception, module docstring)
        try:
            with self._routes(inputs):  # MoE Routing Replay: the micro-batch's recorded routes
                if self.loss_type == "respo":
                    loss = self._respo_loss(model, inputs, kept_log_w)
                else:
                    loss = super()._compute_loss(model, inputs)  # TRL's loss, its forward recorded in `forward`
        finally:
            self._loss_forward = None
        if self.routing_replay is not None:
            self._log_routing_drift()
        self._log_step_metrics(inputs, forward, kept_log_w)
        if kept_log_w is not None:
            self._remember_first_weight(inputs, forward, kept_log_w)
        return loss

    def _kept_log_w(self, inputs) -> torch.Tensor | None:
        """Under ``respo_epoch_weight="first_pass"`` (training): each row's first-pass ``log W``, NaN on its first pass
        (where the current one is used); else None."""
        if not (self.model.training and self.args.respo_first_pass_weight) or FIRST_LOG_W_KEY not in inputs:
            return None
        return inputs[FIRST_LOG_W_KEY].clone()  # a copy: the stored batch is written right after the loss

    def _remember_first_weight(self, inputs, forward: LossForward, kept_log_w: torch.Tensor) -> None:
        """The rows on their first pass keep the ``log W`` of this loss forward for their later passes."""
        old = inputs.get("old_per_token_logps")
        if forward.logps is None or old is None or not torch.isnan(kept_log_w).any():
            return
        mask = inputs["completion_mask"] * inputs.get("tool_mask", 1)
        log_c, kept = fold_sampler_ratio(self._sampler_ratio(inputs), mask)
        self.rollouts.remember_first_weight(inputs[ROW_KEY], sequence_log_weight(forward.logps - old, kept, log_c))

    def _respo_loss(self, model, inputs, kept_log_w=None):
        """ReSPO's loss (:func:`respo_trl.trl_loss.respo_loss`) on the loss forward of ``inputs``."""
        prompt_ids, completion_ids = inputs["prompt_ids"], inputs["completion_ids"]
        logps, entropies, aux_loss = self._get_per_token_logps_and_entropies(
            model, torch.cat([prompt_ids, completion_ids], dim=1),
            torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1), completion_ids.size(1),
            compute_entropy=True, compute_aux_loss=self.aux_loss_enabled,
            **{key: inputs.get(key) for key in MULTIMODAL_KEYS},
        )  # fmt: skip
        return respo_loss(self, inputs, logps, entropies, aux_loss, kept_log_w)

    def _respo_gamma_weights(self, advantages, log_ratio_per_token, mask, importance_sampling_ratio, log_w=None):
        """ReSPO's detached per-token coefficient, where TRL's vespo branch calls ``get_gamma_weights`` (``log_w``:
        the first-pass weight to keep, where finite)."""
        return gamma_weights(self.loss_params, advantages, log_ratio_per_token, mask, importance_sampling_ratio,
                             log_w=log_w)  # fmt: skip

    def _log_routing_drift(self) -> None:
        """``routing/drift``: share of replayed token-layer slots whose free top-k would differ from the replayed one;
        ``routing/drift_tokens``: share of tokens that differ in at least one MoE layer (summed over processes)."""
        stats = self.accelerator.reduce(self.routing_replay.last_stats.to(self.accelerator.device), "sum").float()
        mode = "train" if self.model.training else "eval"
        self._metrics[mode]["routing/drift"].append((stats[0] / stats[1].clamp(min=1)).item())
        self._metrics[mode]["routing/drift_tokens"].append((stats[2] / stats[3].clamp(min=1)).item())

    def _applied_token_weight(self, inputs, logps, entropies):
        """What TRL's loss multiplied the per-token loss by besides the importance weight (its entropy and off-policy
        masks), recomputed with TRL's own helpers from the loss forward; None when neither is on."""
        mask = inputs["completion_mask"] * inputs.get("tool_mask", 1)
        weight = None
        if self.top_entropy_quantile < 1.0:
            weight = self.get_high_entropy_mask(entropies, mask, 1 - self.top_entropy_quantile).float()
        if self.off_policy_mask_threshold is not None:
            advantages, old = inputs["advantages"], inputs.get("old_per_token_logps")
            old = logps if old is None else old
            kept = self.get_off_policy_mask(
                advantages=advantages.unsqueeze(1) if advantages.dim() == 1 else advantages, per_token_logps=logps,
                sampling_per_token_logps=inputs.get("sampling_per_token_logps", old), mask=mask,
                off_policy_threshold=self.off_policy_mask_threshold,
            ).float()  # fmt: skip
            weight = kept if weight is None else weight * kept
        return weight

    # -- metrics ---------------------------------------------------------------------------------------------------------

    def _log_step_metrics(self, inputs, forward: LossForward, kept_log_w=None) -> None:
        mode = "train" if self.model.training else "eval"
        if not self.args.respo_log_diagnostics:
            if mode == "train":
                self._log_reuse_metrics(inputs, mode)
            return
        # the loss's own forward; dropped rows, and any non-finite value of the forward, count as log-ratio 0
        logps, entropies = forward.clean(forward.logps), forward.entropies
        mask = inputs["completion_mask"] * inputs.get("tool_mask", 1)
        old = inputs.get("old_per_token_logps")
        log_ratio = torch.zeros_like(logps) if old is None else logps - old
        token_weight = self._applied_token_weight(inputs, logps, entropies)
        table = sequence_stats(
            log_ratio,
            inputs["advantages"],
            mask,
            self.loss_params,
            self._loss_name,
            sampler_ratio=self._sampler_ratio(inputs),
            token_weight=token_weight,
            kept_log_w=kept_log_w,
        )
        versions = inputs.get(VERSION_KEY)
        staleness = (self.state.global_step - versions).float() if versions is not None else torch.zeros(len(table))
        nonfinite = forward.dropped.float()
        table = torch.cat([table, staleness.to(table).unsqueeze(-1), nonfinite.to(table).unsqueeze(-1)], dim=-1)
        table = self.accelerator.gather(table)  # one collective: every process logs the same global numbers

        metrics = summarize(table[:, : len(COLUMNS)])
        staleness, nonfinite = table[:, len(COLUMNS)], table[:, len(COLUMNS) + 1]
        metrics["respo/nonfinite_seqs"] = nonfinite.sum().item()
        for key, value in metrics.items():
            self._metrics[mode][key].append(value)
        if mode == "train":
            self._log_reuse_metrics(inputs, mode, staleness)
            self._check_sampler_gap(inputs, staleness, metrics["offpolicy/log_weight/std"])

    def _check_sampler_gap(self, inputs, staleness, log_weight_std: float) -> None:
        """Once per run: on a step where every row is fresh and TRL's sampler correction enters a sequence weight
        (ReSPO, VESPO), warn when the spread of ``log W`` says the engine's rounding is what moves it."""
        if self._sampler_gap_warned or self._loss_name not in FOLDS_SAMPLER_RATIO:
            return
        if self._sampler_ratio(inputs) is None or staleness.numel() == 0 or staleness.max().item() > 0:
            return
        warning = sampler_gap_warning(log_weight_std)
        if warning is not None:
            logger.warning(warning, main_process_only=True)
            self._sampler_gap_warned = True

    def _log_reuse_metrics(self, inputs, mode, staleness=None) -> None:
        if staleness is None:  # diagnostics off: gather the staleness alone
            staleness = self.accelerator.gather((self.state.global_step - inputs[VERSION_KEY]).float())
        metrics = {"reuse/staleness_mean": staleness.mean().item(), "reuse/staleness_max": staleness.max().item()}
        if self._step % self.current_gradient_accumulation_steps == 0:  # first micro-batch of an optimizer step
            metrics["reuse/generated_tokens_per_step"] = float(self.rollouts.tokens_since_last_step())
        metrics["reuse/generated_tokens"] = float(self.rollouts.generated_tokens)
        metrics["reuse/refreshes"] = float(self.rollouts.refreshes)
        for key, value in metrics.items():
            self._metrics[mode][key].append(value)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        self._pool_low_weight_metrics()
        # Under reuse the failure to watch is a loss that keeps taking full steps on stale rollouts: the clipped loss's
        # gradient norm falls several-fold on reuse passes, a sequence kernel's need not (docs/method.md, section 6).
        # Log which pass over its batch the last optimizer step was (the mean when one step spans several passes, as
        # with steps_per_generation < gradient_accumulation_steps) and, for a step inside one reuse pass, its
        # grad_norm relative to that same batch's fresh pass.
        passes = self.rollouts.step_passes
        if "grad_norm" in logs and self.model.training and passes:
            logs["reuse/pass"] = sum(p + 1 for _, p in passes) / len(passes)
            ratio = self.rollouts.grad_norm_vs_fresh(logs["grad_norm"])
            if ratio is not None:
                logs["reuse/grad_norm_vs_fresh"] = ratio
        super().log(logs, start_time)

    def _pool_low_weight_metrics(self) -> None:
        """The paper's positive-branch diagnostic, pooled over the logging window: TRL averages every metric over the
        window's micro-batches, which would average ratios; here the counts and masses (already summed over processes)
        are summed over the window and the share, mass share and ratios are formed once from those sums."""
        mode = "train" if self.model.training else "eval"
        metrics = self._metrics[mode]
        keys = [LOW_WEIGHT_PREFIX + key for key in LOW_WEIGHT_SUMS]
        if not all(key in metrics for key in keys):
            return
        sums = {key: sum(metrics[LOW_WEIGHT_PREFIX + key]) for key in LOW_WEIGHT_SUMS}
        for key, value in {**sums, **pooled_low_weight(sums)}.items():
            metrics[LOW_WEIGHT_PREFIX + key] = [value]

    # -- checkpointing -------------------------------------------------------------------------------------------------

    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None):
        """``Trainer.train``, resuming only from complete checkpoints: with ``resume_from_checkpoint=True`` the latest
        complete one (interrupted saves are skipped with a warning); an explicit incomplete path is an error.

        A checkpoint already at ``max_steps`` is refused too (:func:`~respo_trl.buffer.finished_at`): transformers
        would train one update past it."""
        if resume_from_checkpoint is True:
            resume_from_checkpoint = self._last_complete_checkpoint()
        if isinstance(resume_from_checkpoint, str) and os.path.isdir(resume_from_checkpoint):
            problem = checkpoint_status(resume_from_checkpoint, self.accelerator.num_processes) or finished_at(
                resume_from_checkpoint, self.args.max_steps
            )
            if problem:
                raise ValueError(f"cannot resume from {resume_from_checkpoint}: {problem}")
        return super().train(
            resume_from_checkpoint=resume_from_checkpoint, trial=trial, ignore_keys_for_eval=ignore_keys_for_eval
        )

    def _last_complete_checkpoint(self) -> str:
        path, skipped = last_complete_checkpoint(self.args.output_dir, self.accelerator.num_processes)
        for folder, problem in skipped:
            logger.warning(f"Skipping {folder}: {problem}")
        if path is None:
            raise ValueError(f"No valid checkpoint found in output directory ({self.args.output_dir})")
        return path

    def _save_checkpoint(self, model, trial):
        # The buffer goes in first so that a checkpoint pushed to the Hub by super() carries it too; super() writes
        # trainer_state.json last, which is what marks a checkpoint complete (buffer.checkpoint_status).
        checkpoint_dir = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        self.rollouts.save(
            checkpoint_dir,
            self.accelerator.process_index,
            extra={"step": self._step},  # TRL's micro-step counter, which transformers does not checkpoint
            include_batch=self.rollouts.position != 0,  # a fully used batch is never served again: keep it small
        )
        super()._save_checkpoint(model, trial)

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        if not has_buffer_files(checkpoint):
            self._resume_without_buffer(checkpoint)
            return
        self._step = self.rollouts.load(checkpoint, self.accelerator.process_index, device=self.accelerator.device)["step"]

    def _resume_without_buffer(self, checkpoint) -> None:
        """A checkpoint written by plain ``GRPOTrainer`` (no rollout buffer): start a new generation cycle, as TRL's own
        resume does, and say whether anything of the interrupted batch is lost."""
        cycle = self.rollouts.cycle_length
        micro_steps = self.state.global_step * self.args.gradient_accumulation_steps
        if micro_steps % cycle == 0:
            logger.info(f"{checkpoint} has no rollout buffer; it ends a generation cycle, so nothing is lost.")
        else:
            left = cycle - micro_steps % cycle
            logger.warning(
                f"{checkpoint} has no rollout buffer (written by plain GRPOTrainer?) and ends mid-cycle: the "
                f"{left} remaining micro-batches of its rollout batch are replaced by fresh rollouts, as TRL's resume "
                "does. The sampled-token counter restarts at 0."
            )
        self._step = 0
        self.rollouts.discard()

    # -- model card ------------------------------------------------------------------------------------------------

    def create_model_card(self, model_name=None, dataset_name=None, tags=None):
        """The card ``card_writer`` writes (``respo_trl.hub.card.write_trainer_card`` in the recipe), else TRL's."""
        # the writer as it was set, on the instance or on a subclass, never bound (a function set on a class would
        # otherwise receive the trainer twice)
        writer = inspect.getattr_static(self, "card_writer")
        writer = writer.__func__ if isinstance(writer, (staticmethod, classmethod)) else writer
        if writer is None:
            return super().create_model_card(model_name=model_name, dataset_name=dataset_name, tags=tags)
        if self.is_world_process_zero():
            writer(self, model_name=model_name, dataset_name=dataset_name, tags=tags)
