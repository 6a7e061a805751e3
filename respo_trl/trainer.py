"""``ReSPOTrainer``: TRL's ``GRPOTrainer`` with the ReSPO loss, the rollout-reuse buffer and per-step diagnostics.

This module is the one seam between respo_trl and TRL. Every ``GRPOTrainer`` (or ``transformers.Trainer``) method the
trainer changes is overridden here, once, with TRL's exact signature and kind (:data:`OVERRIDDEN`), and translates
between TRL and the module that owns the work: the reuse schedule to :mod:`respo_trl.buffer`, ReSPO's loss to
:mod:`respo_trl.trl_loss` (a function of tensors), the math to :mod:`respo_trl.kernels`, the metrics to
:mod:`respo_trl.diagnostics`, checkpoints to :mod:`respo_trl.checkpoints`, MoE Routing Replay to
:mod:`respo_trl.routing_replay`. Every TRL name the seam reads or writes is declared in :mod:`respo_trl.trl_surface`
and checked when a trainer is built. Every other ``loss_type`` runs TRL's code unchanged.

Values pass between the overrides as arguments and return values, with one exception TRL forces: its own loss types
run their forward inside TRL's ``_compute_loss``, so the log-probabilities the diagnostics need (and the rows to count
as 0 in that forward) travel through one :class:`~respo_trl.trl_loss.LossForward` record that ``_compute_loss`` opens
before the call and closes after it; ``_get_per_token_logps_and_entropies`` fills it only while it is open.
"""

from __future__ import annotations

import inspect
import os
from contextlib import nullcontext

import torch
from accelerate.logging import get_logger
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl import GRPOConfig, GRPOTrainer
from trl.trainer.utils import shuffle_sequence_dict, split_pixel_values_by_grid, unsplit_pixel_values_by_grid

from .buffer import FIRST_LOG_W_KEY, ROW_KEY, VERSION_KEY, RolloutBuffer, check_contiguous_groups, has_buffer_files
from .checkpoints import checkpoint_status, finished_at, latest_complete_checkpoint
from .config import ReSPOConfig, describe_kernel, respo_notes
from .diagnostics import drift_rows, drift_signals, pool_low_weight_window, sampler_gap_warning, step_metrics
from .integrations.vllm import check_colocated_weight_sync
from .kernels import FOLDS_SAMPLER_RATIO, LossParams, registered_loss_for
from .paper import ARXIV_ID, RESPO_CITATION, TITLE, TRAINER_TAGS
from .routing_replay import ROUTES_KEY, attach_routing_replay, drift_metrics
from .trl_loss import LossForward, drop_nonfinite, respo_grpo_loss, trl_entropy_bonus
from .trl_surface import (
    MULTIMODAL_KEYS,
    TRL_METHODS,
    check_generate_output,
    check_trl_hooks,
    check_trl_loop_state,
    check_trl_state,
)

logger = get_logger(__name__)


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
        # the reuse schedule (passes, refreshes, adaptive stops) and its rollouts
        self.rollouts = RolloutBuffer.from_config(args, self.accelerator.num_processes)
        if args.respo_adaptive_reuse is not None and not hasattr(self.train_dataset, "__len__"):
            raise ValueError(  # a stream is TRL's to repeat (see _get_train_sampler): a stop would meet old prompts
                f"respo_adaptive_reuse={args.respo_adaptive_reuse!r} needs a map-style train_dataset (a stream repeats "
                "each batch's prompts for every pass): load the dataset without streaming, or unset respo_adaptive_reuse"
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
            self._metrics["train"]["reuse/policy_ess_before_pass"].append(served.signals["policy_ess"])
        return unsplit_pixel_values_by_grid(served.batch)

    def samples_next(self) -> bool:
        """Whether the next training micro-batch will sample fresh rollouts (where a sampling budget can stop a run
        without cutting a batch short): the buffer's schedule, with the drift check it would make."""
        return self.rollouts.samples_next(self._drift)

    def _get_train_sampler(self, dataset=None):
        # TRL's sampler repeats each generation batch's prompts for all num_iterations passes. Under adaptive reuse a
        # batch the drift check stops is followed by a fresh one, which should see new prompts (as PPO's early stop is
        # followed by new episodes), not the same ones again: the prompts move on after every pass, and those of the
        # passes a batch does serve are simply not sampled.
        sampler = super()._get_train_sampler(dataset)
        if self.args.respo_adaptive_reuse is not None:  # (a streamed dataset is refused in __init__)
            sampler.repeat_count = self.args.steps_per_generation
        return sampler

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
        self, model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False,
        compute_aux_loss=False, pixel_values=None, image_grid_thw=None, num_images=None, pixel_attention_mask=None,
        spatial_shapes=None, num_tiles=None, image_sizes=None, token_type_ids=None, mm_token_type_ids=None,
        image_position_ids=None,
    ):  # fmt: skip
        # every log-prob forward (old log-probs, reference, the loss, the drift check) replays the routes of its rows
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
        """How far the current policy has moved from the one that sampled ``batch``, over all processes
        (:func:`respo_trl.diagnostics.drift_signals`: the ESS of ``W`` and the per-token KL). One no-grad forward;
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
        rows = drift_rows(logps, old, _loss_mask(batch), self._sampler_ratio(batch))
        return drift_signals(self.accelerator.gather(rows))

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
        # respo_epoch_weight="first_pass": each row's first-pass log W (NaN on its first pass); the buffer serves copies,
        # so writing the stored batch after the loss leaves this one as it was
        kept_log_w = inputs[FIRST_LOG_W_KEY] if self.model.training and FIRST_LOG_W_KEY in inputs else None
        self._loss_forward = forward  # closed below, whatever happens (the one exception, module docstring)
        try:
            with self._routes(inputs):  # MoE Routing Replay: the micro-batch's recorded routes
                if self.loss_type == "respo":
                    loss = self._respo_loss(model, inputs, forward, kept_log_w)
                else:
                    loss = super()._compute_loss(model, inputs)  # TRL's loss, its forward recorded in `forward`
        finally:
            self._loss_forward = None
        if self.routing_replay is not None:
            self._log_routing_drift()
        self._log_step_metrics(inputs, forward, kept_log_w)
        if kept_log_w is not None and forward.weights is not None and torch.isnan(kept_log_w).any():
            self.rollouts.remember_first_weight(inputs[ROW_KEY], forward.weights.log_w)  # rows on their first pass
        return loss

    def _respo_loss(self, model, inputs, forward: LossForward, kept_log_w) -> torch.Tensor:
        """ReSPO's loss (:func:`respo_trl.trl_loss.respo_grpo_loss`) on the loss forward of ``inputs``, with TRL's
        masks, normaliser, entropy bonus, auxiliary loss and metrics around it, as TRL's ``vespo`` branch has them."""
        prompt_ids, completion_ids = inputs["prompt_ids"], inputs["completion_ids"]
        logps, entropies, aux_loss = self._get_per_token_logps_and_entropies(
            model, torch.cat([prompt_ids, completion_ids], dim=1),
            torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1), completion_ids.size(1),
            compute_entropy=True, compute_aux_loss=self.aux_loss_enabled,
            **{key: inputs.get(key) for key in MULTIMODAL_KEYS},
        )  # fmt: skip
        mode = "train" if self.model.training else "eval"
        mask = _loss_mask(inputs)
        entropy_mask, forward.token_weight = self._trl_token_masks(inputs, logps, entropies)
        # TRL's dapo aggregation: `num_items_in_batch` spans the generation batch, rescaled to one accumulation window
        normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
        if mode == "train":
            normalizer = normalizer * self.current_gradient_accumulation_steps / self.args.steps_per_generation
        result = respo_grpo_loss(
            logps, inputs.get("old_per_token_logps"), inputs["advantages"], mask, self.loss_params,
            normalizer=normalizer, sampler_ratio=inputs.get("importance_sampling_ratio"), kept_log_w=kept_log_w,
            token_weight=forward.token_weight, beta=self.beta, ref_logps=inputs.get("ref_per_token_logps"),
            kl_correction=self.importance_sampling_level if self.args.use_bias_correction_kl else None,
        )  # fmt: skip
        forward.weights = result.weights
        loss = result.loss + self._entropy_bonus(entropies, mask, entropy_mask, result.loss.detach(), mode)
        if self.aux_loss_enabled:  # scaled for gradient accumulation like the policy loss
            accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1.0
            loss = loss + self.router_aux_loss_coef * aux_loss / accumulation
            self._metrics[mode]["aux_loss"].append(self.accelerator.gather_for_metrics(aux_loss).mean().item())
        if self.beta != 0.0:
            self._metrics[mode]["kl"].append(self._global_masked_mean(result.per_token_kl, mask))
        self._metrics[mode]["entropy"].append(self._global_masked_mean(entropies, mask))
        return loss

    def _global_masked_mean(self, values, mask) -> float:
        totals = self.accelerator.reduce(torch.stack([(values * mask).sum(), mask.sum().float()]), reduction="sum")
        return (totals[0] / totals[1].clamp(min=1.0)).item()

    def _entropy_bonus(self, entropies, mask, entropy_mask, policy_loss, mode):
        """TRL's entropy bonus (:func:`respo_trl.trl_loss.trl_entropy_bonus`; 0 when off), with TRL's adaptive
        coefficient state, which TRL keeps on the trainer, passed in and stored back."""
        if not self._entropy_bonus_enabled:
            return 0.0
        train, accelerator = mode == "train", self.accelerator
        self._metrics[mode]["policy_loss"].append(accelerator.gather(policy_loss).nanmean().item())
        term, self.entropy_coef, self._entropy_window_stats, self._last_world_entropy = trl_entropy_bonus(
            entropies, mask, entropy_mask, coef=self.entropy_coef, window=self._entropy_window_stats,
            last_world_entropy=self._last_world_entropy, args=self.args, adaptive=self.use_adaptive_entropy,
            train=train, accumulation=self.current_gradient_accumulation_steps if train else 1.0,
            sync_gradients=accelerator.sync_gradients, reduce=lambda t: accelerator.reduce(t, reduction="sum"),
        )  # fmt: skip
        if train and accelerator.sync_gradients:
            self._metrics[mode]["entropy_coef"].append(self.entropy_coef)
        return term

    def _trl_token_masks(self, inputs, logps, entropies):
        """TRL's masks besides the importance weight, with TRL's own helpers: ``(entropy mask, product of the entropy
        and off-policy masks)``, each None when off. ReSPO's loss multiplies them in; the diagnostics reuse them."""
        mask = _loss_mask(inputs)
        entropy_mask = weight = None
        if self.top_entropy_quantile < 1.0:
            entropy_mask = self.get_high_entropy_mask(entropies, mask, 1 - self.top_entropy_quantile)
            weight = entropy_mask.float()
        if self.off_policy_mask_threshold is not None:
            advantages, old = inputs["advantages"], inputs.get("old_per_token_logps")
            old = logps.detach() if old is None else old
            kept = self.get_off_policy_mask(
                advantages=advantages.unsqueeze(1) if advantages.dim() == 1 else advantages, per_token_logps=logps,
                sampling_per_token_logps=inputs.get("sampling_per_token_logps", old), mask=mask,
                off_policy_threshold=self.off_policy_mask_threshold,
            ).float()  # fmt: skip
            weight = kept if weight is None else weight * kept
        return entropy_mask, weight

    def _log_routing_drift(self) -> None:
        stats = self.accelerator.reduce(self.routing_replay.last_stats.to(self.accelerator.device), "sum").float()
        for key, value in drift_metrics(stats).items():
            self._metrics["train" if self.model.training else "eval"][key].append(value)

    # -- metrics ---------------------------------------------------------------------------------------------------------

    def _log_step_metrics(self, inputs, forward: LossForward, kept_log_w=None) -> None:
        mode = "train" if self.model.training else "eval"
        staleness = self.rollouts.staleness(inputs, self.state.global_step) if VERSION_KEY in inputs else None
        metrics = {}
        if self.args.respo_log_diagnostics:  # from the loss's own forward and, under ReSPO, its weights
            if forward.weights is None:  # TRL's own loss: its masks, recomputed once with TRL's helpers
                forward.token_weight = self._trl_token_masks(inputs, forward.logps, forward.entropies)[1]
            metrics, staleness = step_metrics(
                forward.logps, inputs.get("old_per_token_logps"), inputs["advantages"], _loss_mask(inputs),
                self.loss_params, self._loss_name, sampler_ratio=self._sampler_ratio(inputs),
                token_weight=forward.token_weight, kept_log_w=kept_log_w, weights=forward.weights,
                staleness=staleness, dropped=forward.dropped, gather=self.accelerator.gather,
            )  # fmt: skip
        elif mode == "train":
            staleness = self.accelerator.gather(staleness.float())
        if mode == "train":
            metrics.update(self.rollouts.reuse_metrics(staleness, self._step % self.current_gradient_accumulation_steps == 0))
            self._warn_sampler_gap(inputs, staleness, metrics.get("offpolicy/log_weight/std"))
        for key, value in metrics.items():
            self._metrics[mode][key].append(value)

    def _warn_sampler_gap(self, inputs, staleness, log_weight_std) -> None:
        """Once per run: on a step where every row is fresh and TRL's sampler correction enters a sequence weight
        (ReSPO, VESPO), warn when the spread of ``log W`` says the engine's rounding is what moves it."""
        fresh = staleness.numel() > 0 and staleness.max().item() == 0
        if self._sampler_gap_warned or log_weight_std is None or not fresh or self._loss_name not in FOLDS_SAMPLER_RATIO:
            return
        warning = sampler_gap_warning(log_weight_std) if self._sampler_ratio(inputs) is not None else None
        if warning is not None:
            logger.warning(warning, main_process_only=True)
            self._sampler_gap_warned = True

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        pool_low_weight_window(self._metrics["train" if self.model.training else "eval"])
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

    # -- checkpointing -------------------------------------------------------------------------------------------------

    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None):
        """``Trainer.train``, resuming only from complete checkpoints (:mod:`respo_trl.checkpoints`): with
        ``resume_from_checkpoint=True`` the latest complete one (interrupted saves skipped with a warning); an explicit
        incomplete path, or one already at ``max_steps`` (transformers would train one update past it), is an error."""
        processes = self.accelerator.num_processes
        if resume_from_checkpoint is True:
            resume_from_checkpoint = latest_complete_checkpoint(self.args.output_dir, processes, logger.warning)
        if isinstance(resume_from_checkpoint, str) and os.path.isdir(resume_from_checkpoint):
            problem = checkpoint_status(resume_from_checkpoint, processes) or finished_at(
                resume_from_checkpoint, self.args.max_steps
            )
            if problem:
                raise ValueError(f"cannot resume from {resume_from_checkpoint}: {problem}")
        return super().train(
            resume_from_checkpoint=resume_from_checkpoint, trial=trial, ignore_keys_for_eval=ignore_keys_for_eval
        )

    def _save_checkpoint(self, model, trial):
        # The buffer goes in first so that a checkpoint pushed to the Hub by super() carries it too; super() writes
        # trainer_state.json last, which is what marks a checkpoint complete (checkpoints.checkpoint_status).
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
        if has_buffer_files(checkpoint):
            extra = self.rollouts.load(checkpoint, self.accelerator.process_index, device=self.accelerator.device)
            self._step = extra["step"]
            return
        # written by plain GRPOTrainer: a new generation cycle starts, as TRL's own resume does
        lost = self.rollouts.resume_without_files(self.state.global_step * self.args.gradient_accumulation_steps)
        if lost:
            logger.warning(
                f"{checkpoint} has no rollout buffer (written by plain GRPOTrainer?) and ends mid-cycle: the {lost} "
                "remaining micro-batches of its rollout batch are replaced by fresh rollouts, as TRL's resume does. "
                "The sampled-token counter restarts at 0."
            )
        else:
            logger.info(f"{checkpoint} has no rollout buffer; it ends a generation cycle, so nothing is lost.")
        self._step = 0

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


def _loss_mask(inputs: dict) -> torch.Tensor:
    """The tokens a loss counts: TRL's completion mask times its loss-only tool mask (tool-call tokens, dropped rows)."""
    return inputs["completion_mask"] * inputs.get("tool_mask", 1)


# What ReSPOTrainer overrides of TRL's surface, read off the class (the rest of TRL_METHODS it only calls).
OVERRIDDEN = tuple(name for name in TRL_METHODS if name in vars(ReSPOTrainer))
