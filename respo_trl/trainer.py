"""``ReSPOTrainer``: TRL's ``GRPOTrainer`` with the ReSPO loss, the rollout-reuse buffer and per-step diagnostics.

This module is the one seam between respo_trl and TRL. Every ``GRPOTrainer`` (or ``transformers.Trainer``) method the
trainer changes is overridden here, once, with TRL's exact signature and kind (:data:`OVERRIDDEN`), and translates
between TRL and the module that owns the work: the reuse schedule to :mod:`respo_trl.buffer`, ReSPO's loss to
:mod:`respo_trl.trl_loss` (a function of tensors), the math to :mod:`respo_trl.kernels`, the metrics to
:mod:`respo_trl.diagnostics`, checkpoints to :mod:`respo_trl.checkpoints`, MoE Routing Replay to
:mod:`respo_trl.routing_replay`. Every TRL name the seam reads or writes is declared in :mod:`respo_trl.trl_surface`
and checked when a trainer is built. Every other ``loss_type`` runs TRL's code unchanged.

One micro-batch's loss is one call, :func:`respo_trl.trl_loss.micro_batch_loss`, with the micro-batch and TRL's side
of it (:class:`~respo_trl.trl_loss.TrlContext`); it returns a frozen result (loss, weights, metrics) and the buffer
gets the weights and reports its own metrics. Values pass between the overrides as arguments and return values, with
one exception TRL forces: its own loss types run their forward inside TRL's ``_compute_loss``, so the rows to count as
0 in that forward, and the log-probabilities the diagnostics need, travel through one :class:`_TrlForward` record
that :meth:`ReSPOTrainer._trls_loss` opens before TRL's call and closes after it;
``_get_per_token_logps_and_entropies`` cleans and records the first forward only while it is open.
"""

from __future__ import annotations

import os
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial

import torch
from accelerate.logging import get_logger
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl import GRPOConfig, GRPOTrainer
from trl.trainer.utils import shuffle_sequence_dict, split_pixel_values_by_grid, unsplit_pixel_values_by_grid

from .buffer import RolloutBuffer, check_contiguous_groups
from .checkpoints import resume_target
from .config import ReSPOConfig, describe_kernel, respo_notes
from .diagnostics import DriftSignals, drift_rows, drift_signals, pool_low_weight_window
from .hub.cards import write_model_card
from .integrations.vllm import check_colocated_weight_sync
from .kernels import LossParams, registered_loss_for
from .paper import ARXIV_ID, RESPO_CITATION, TITLE, TRAINER_TAGS
from .routing_replay import ROUTES_KEY, attach_routing_replay, drift_metrics
from .trl_loss import EntropyState, TrlContext, clean_logps, loss_mask, micro_batch_loss
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
    _trl_forward: _TrlForward | None = None  # open only inside _trls_loss (the one exception, module docstring)

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
        )
        self._log_metrics(served.metrics())
        return unsplit_pixel_values_by_grid(served.batch)

    def samples_next(self) -> bool:
        """Whether the next training micro-batch will sample fresh rollouts (where a sampling budget can stop a run
        without cutting a batch short): the buffer's schedule, with the drift check it would make."""
        return self.rollouts.samples_next(self._drift)

    def _get_train_sampler(self, dataset=None):
        sampler = super()._get_train_sampler(dataset)
        repeats = self.rollouts.prompt_repeat_count()  # (a streamed dataset under adaptive reuse is refused in __init__)
        if repeats is not None:
            sampler.repeat_count = repeats
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
        record = self._trl_forward
        if record is not None and record.logps is None:  # TRL's loss forward (the first inside its _compute_loss)
            logps = clean_logps(logps, record.dropped)
            record.logps, record.entropies = logps.detach(), None if entropies is None else entropies.detach()
        return logps, entropies, aux_loss

    @torch.no_grad()
    def _drift(self, batch) -> DriftSignals | None:
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
        ratio = batch.get("importance_sampling_ratio") if self._sampler_correction else None
        return drift_signals(self.accelerator.gather(drift_rows(logps, old, loss_mask(batch), ratio)))

    @property
    def _sampler_correction(self) -> bool:
        """TRL's vLLM importance-sampling correction is on: its ratio then enters every loss."""
        return bool(self.use_vllm and self.vllm_importance_sampling_correction)

    # -- loss ----------------------------------------------------------------------------------------------------------

    def _compute_loss(self, model, inputs):
        training = self.model.training
        if training:
            check_trl_loop_state(self)
        with self._routes(inputs):  # MoE Routing Replay: the micro-batch's recorded routes
            result = micro_batch_loss(inputs, self._trl_context(model, training))
        if self.routing_replay is not None:
            self._log_routing_drift()
        if result.entropy is not None:  # TRL keeps its adaptive entropy state on the trainer
            self.entropy_coef, self._entropy_window_stats, self._last_world_entropy = result.entropy
        metrics = result.metrics
        if training:
            log_w = None if result.weights is None else result.weights.log_w
            metrics = {**metrics, **self.rollouts.finish_micro_batch(inputs, log_w, result.staleness)}
            if result.sampler_gap is not None and not self._sampler_gap_warned:  # once per run
                logger.warning(result.sampler_gap, main_process_only=True)
                self._sampler_gap_warned = True
        self._log_metrics(metrics)
        return result.loss

    def _trl_context(self, model, training: bool) -> TrlContext:
        """TRL's side of this micro-batch's loss, as the trainer holds it now."""
        args = self.args
        return TrlContext(
            loss_type=self.loss_type, params=self.loss_params, loss_name=self._loss_name,
            forward=partial(self._get_per_token_logps_and_entropies, model),
            trl_loss=partial(self._trls_loss, model), training=training,
            accumulation=self.current_gradient_accumulation_steps if training else 1.0,
            steps_per_generation=args.steps_per_generation, num_processes=self.accelerator.num_processes,
            beta=self.beta, kl_correction=self.importance_sampling_level if args.use_bias_correction_kl else None,
            high_entropy_mask=partial(_high_entropy_mask, self.get_high_entropy_mask, 1 - self.top_entropy_quantile)
            if self.top_entropy_quantile < 1.0 else None,
            off_policy_mask=partial(self.get_off_policy_mask, off_policy_threshold=self.off_policy_mask_threshold)
            if self.off_policy_mask_threshold is not None else None,
            entropy=EntropyState(self.entropy_coef, self._entropy_window_stats, self._last_world_entropy)
            if self._entropy_bonus_enabled else None,
            adaptive_entropy=self.use_adaptive_entropy, args=args,
            aux_coef=self.router_aux_loss_coef if self.aux_loss_enabled else None,
            sampler_correction=self._sampler_correction, diagnostics=args.respo_log_diagnostics,
            multimodal_keys=MULTIMODAL_KEYS, collectives=self.accelerator,
        )  # fmt: skip

    def _trls_loss(self, model, inputs, dropped) -> tuple:
        """TRL's own ``_compute_loss`` (every loss type but ReSPO's), with its forward's log-probabilities cleaned
        (``dropped`` rows and non-finite values: 0) and recorded for the diagnostics (module docstring)."""
        self._trl_forward = _TrlForward(dropped)
        try:
            loss = super()._compute_loss(model, inputs)
            return loss, self._trl_forward.logps, self._trl_forward.entropies
        finally:
            self._trl_forward = None

    def _log_routing_drift(self) -> None:
        stats = self.accelerator.reduce(self.routing_replay.last_stats.to(self.accelerator.device), "sum").float()
        self._log_metrics(drift_metrics(stats))

    # -- metrics ---------------------------------------------------------------------------------------------------------

    def _log_metrics(self, metrics: dict[str, float]) -> None:
        mode = "train" if self.model.training else "eval"
        for key, value in metrics.items():
            self._metrics[mode][key].append(value)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        pool_low_weight_window(self._metrics["train" if self.model.training else "eval"])
        if "grad_norm" in logs and self.model.training:  # the optimizer step's pass and its grad norm vs the fresh one
            logs.update(self.rollouts.step_summary(logs["grad_norm"]))
        super().log(logs, start_time)

    # -- checkpointing -------------------------------------------------------------------------------------------------

    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None):
        """``Trainer.train``, resuming only from complete checkpoints (:func:`respo_trl.checkpoints.resume_target`)."""
        resume_from_checkpoint = resume_target(resume_from_checkpoint, self.args.output_dir,
                                               self.accelerator.num_processes, self.args.max_steps, logger.warning)  # fmt: skip
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
        if checkpoint is not None:  # the buffer's resume policy (RolloutBuffer.restore); TRL's micro-step counter
            self._step = self.rollouts.restore(checkpoint, self.accelerator.process_index, self.accelerator.device,
                                               self.state.global_step * self.args.gradient_accumulation_steps,
                                               logger)  # fmt: skip

    def create_model_card(self, model_name=None, dataset_name=None, tags=None):
        """The card ``card_writer`` writes (``respo_trl.hub.card.write_trainer_card`` in the recipe), else TRL's
        (:func:`respo_trl.hub.cards.write_model_card`)."""
        write_model_card(self, super().create_model_card, model_name=model_name, dataset_name=dataset_name, tags=tags)


@dataclass
class _TrlForward:
    """TRL's loss forward for one ``_compute_loss`` call: the rows its loss counts as 0, and the forward's (log-probs,
    entropies), cleaned and detached once."""

    dropped: torch.Tensor
    logps: torch.Tensor | None = None
    entropies: torch.Tensor | None = None


def _high_entropy_mask(helper, threshold, entropies, mask):
    return helper(entropies, mask, threshold)


# What ReSPOTrainer overrides of TRL's surface, read off the class (the rest of TRL_METHODS it only calls).
OVERRIDDEN = tuple(name for name in TRL_METHODS if name in vars(ReSPOTrainer))
