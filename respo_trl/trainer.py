"""``ReSPOTrainer``: TRL's ``GRPOTrainer`` with the ReSPO loss, the rollout-reuse buffer and per-step diagnostics.

This file only wires pieces into TRL's hooks; the math lives in :mod:`respo_trl.kernels`, the metrics in
:mod:`respo_trl.diagnostics` and the reuse logic in :mod:`respo_trl.buffer`.

How ReSPO enters TRL's loss: TRL 1.16's ``vespo`` branch already computes ``-phi_i * A_i * log pi`` with a detached
sequence weight, skips the extra vLLM ratio multiply, and aggregates like ``dapo`` (token sum over the global token
count), keeping the KL, entropy, MoE auxiliary and off-policy-mask terms. That is exactly spec section 2, so for
``loss_type="respo"`` the trainer runs that branch with ``phi`` from :func:`respo_trl.kernels.respo_phi` instead of the
VESPO gamma weight. Every other ``loss_type`` runs TRL's code unchanged.
"""

from __future__ import annotations

import os
import textwrap
from contextlib import contextmanager

import torch
from accelerate.logging import get_logger
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl import GRPOConfig, GRPOTrainer
from trl.trainer.utils import shuffle_sequence_dict, split_pixel_values_by_grid, unsplit_pixel_values_by_grid

from .buffer import VERSION_KEY, RolloutBuffer
from .config import ReSPOConfig
from .diagnostics import COLUMNS, sequence_stats, summarize
from .hub import hub_failure
from .kernels import LOG_RATIO_CLAMP, LossParams, kish_ess, registered_loss_for, respo_phi, sequence_log_weights
from .model_card import write_trainer_card
from .routing_replay import RoutingReplayMixin

logger = get_logger(__name__)

RESPO_CITATION = textwrap.dedent("""\
    @article{respo2026,
        title        = {{ReSPO: Reshaped Sequence Policy Optimization for Gradient Starvation in Off-Policy Learning}},
        year         = 2026,
        eprint       = {arXiv:2609.35433},
    }""")


class ReSPOTrainer(RoutingReplayMixin, GRPOTrainer):
    """Drop-in replacement for ``trl.GRPOTrainer`` that trains with ReSPO.

    Accepts the same arguments. ``args`` may be a :class:`ReSPOConfig` (any ``loss_type`` works, so baselines run
    through the same plumbing) or a plain ``GRPOConfig``, which is upgraded to ReSPO at its defaults (logged once).
    """

    _tag_names = ["trl", "grpo", "respo", "rlvr", "reinforcement-learning"]
    _name = "ReSPO"
    _paper = {
        "title": "ReSPO: Reshaped Sequence Policy Optimization for Gradient Starvation in Off-Policy Learning",
        "id": "2609.35433",
        "citation": RESPO_CITATION,
    }

    def __init__(self, model, reward_funcs=None, args: GRPOConfig | None = None, *rest, **kwargs):
        if args is None:
            name = model if isinstance(model, str) else model.config._name_or_path
            args = ReSPOConfig(f"{str(name).rstrip('/').split('/')[-1]}-ReSPO")
        elif not isinstance(args, ReSPOConfig):
            if not isinstance(args, GRPOConfig):
                raise TypeError(f"args must be a ReSPOConfig or GRPOConfig, got {type(args).__name__}")
            previous = args.loss_type
            args = ReSPOConfig.from_grpo_config(args)
            logger.warning(
                f"ReSPOTrainer received a plain GRPOConfig (loss_type={previous!r}): training with ReSPO at its "
                f"defaults (alpha/lambda pos={args.respo_alpha_pos}/{args.respo_lambda_pos}, "
                f"neg={args.respo_alpha_neg}/{args.respo_lambda_neg}, norm={args.respo_norm!r}). Pass "
                f"ReSPOConfig(loss_type={previous!r}) to train with TRL's loss instead.",
                main_process_only=True,
            )
        super().__init__(model, reward_funcs, args, *rest, **kwargs)
        self.loss_params = LossParams.from_config(args)
        self._loss_name = registered_loss_for(self.loss_type)
        self.rollouts = RolloutBuffer(
            reuse=args.respo_reuse,
            steps_per_generation=args.steps_per_generation,
            reshuffle=args.respo_reshuffle,
            seed=args.seed,
            storage_device="cpu" if args.respo_buffer_device == "cpu" else None,
        )
        self._respo_kernel_active = False  # True while TRL's vespo branch must use the ReSPO weight
        self._capture_logps = False
        self._captured_logps = None
        self._nonfinite_rows = None
        self._nonfinite_total = 0
        self._tokens_at_step_start = 0
        self._fresh_grad_norm = (None, None)  # (generation batch index, grad_norm of its fresh pass)
        if args.respo_routing_replay:  # MoE Routing Replay (R3): respo_trl/routing_replay.py
            self.routing_replay = self.attach_routing_replay(self)

    # -- rollout reuse -----------------------------------------------------------------------------------------------

    def _prepare_inputs(self, generation_batch):
        if not self.model.training:
            return super()._prepare_inputs(generation_batch)  # evaluation: TRL's path, no buffering
        per_pass = self.args.steps_per_generation
        pass_index, micro_index = divmod(self._step % (per_pass * self.num_iterations), per_pass)
        if pass_index == 0 and micro_index == 0:
            self._fill_buffer(generation_batch)
        elif self.rollouts.is_empty:  # mid-cycle with nothing stored: resampling here would silently change the run
            raise RuntimeError(
                f"No buffered rollouts to reuse at micro-step {self._step} (pass {pass_index + 1} of "
                f"{self.num_iterations}); resume from a checkpoint that holds its rollout buffer."
            )
        elif micro_index == 0 and self.args.respo_min_ess is not None and self._below_ess_floor():
            self._fill_buffer(generation_batch)  # same prompts (the sampler repeats them for every pass)
            self.rollouts.refreshes += 1
        inputs = self.rollouts.micro_batch(pass_index, micro_index, device=self.accelerator.device)
        return unsplit_pixel_values_by_grid(inputs)

    def _fill_buffer(self, generation_batch) -> None:
        batch = self._generate_and_score_completions(generation_batch)
        batch = shuffle_sequence_dict(split_pixel_values_by_grid(batch))  # first-pass composition, as TRL does
        self.rollouts.store(batch, version=self.state.global_step)

    def _generate(self, prompts):
        output = super()._generate(prompts)
        if self.model.training:
            completion_ids, tool_mask = output[1], output[2]
            if tool_mask is not None:  # count model-generated tokens only, as TRL's length metrics do
                local = sum(sum(mask) for mask in tool_mask)
            else:
                local = sum(len(ids) for ids in completion_ids)
            total = self.accelerator.reduce(torch.tensor(float(local), device=self.accelerator.device), "sum")
            self.rollouts.generated_tokens += int(total.item())
        return output

    @torch.no_grad()
    def _below_ess_floor(self) -> bool:
        """Normalised ESS of the whole buffered batch under the current policy (all processes), vs the floor."""
        batch = {k: v.to(self.accelerator.device) if torch.is_tensor(v) else v for k, v in self.rollouts.batch.items()}
        old = batch.get("old_per_token_logps")
        if old is None:
            return False
        completion_ids = batch["completion_ids"]
        with self.routing_batch(batch):  # MoE Routing Replay: the buffered rows' recorded routes
            logps, _, _ = self._get_per_token_logps_and_entropies(
                self.model,
                torch.cat([batch["prompt_ids"], completion_ids], dim=1),
                torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1),
                completion_ids.size(1),
                batch_size=self.args.per_device_train_batch_size,
            )
        mask = batch["completion_mask"] * batch.get("tool_mask", 1)
        s = sequence_log_weights(
            logps - old, mask, self.args.respo_norm, self.args.respo_rho_min, gather=self.accelerator.gather
        )
        valid = self.accelerator.gather((mask.sum(-1) > 0).float()) > 0
        ess = kish_ess(self.accelerator.gather(s)[valid]).item()
        self._metrics["train"]["reuse/ess_before_pass"].append(ess)
        return ess < self.args.respo_min_ess

    # -- loss ----------------------------------------------------------------------------------------------------------

    def _compute_loss(self, model, inputs):
        inputs = self._drop_nonfinite(inputs)
        self._capture_logps = True
        try:
            with self._respo_through_vespo_branch():
                loss = super()._compute_loss(model, inputs)
        finally:
            self._capture_logps = False
        self._log_step_metrics(inputs)
        return loss

    @contextmanager
    def _respo_through_vespo_branch(self):
        if self.loss_type != "respo":
            yield
            return
        self.loss_type, self._respo_kernel_active = "vespo", True
        try:
            yield
        finally:
            self.loss_type, self._respo_kernel_active = "respo", False
            mode = "train" if self.model.training else "eval"
            self._metrics[mode].pop("vespo/phi_seq_mean", None)  # it held ReSPO's phi; respo/phi_mean/* reports it

    def get_gamma_weights(self, advantages, log_ratio_per_token, mask, importance_sampling_ratio, **vespo_params):
        if not self._respo_kernel_active:
            return GRPOTrainer.get_gamma_weights(
                advantages, log_ratio_per_token, mask, importance_sampling_ratio, **vespo_params
            )
        log_is = None
        if importance_sampling_ratio is not None:
            log_is = torch.log(importance_sampling_ratio).clamp(min=-LOG_RATIO_CLAMP)
        phi = respo_phi(
            log_ratio_per_token, advantages, mask, self.loss_params, log_is, gather=self.accelerator.gather
        )
        return phi.unsqueeze(-1)

    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        logps, entropies, aux_loss = super()._get_per_token_logps_and_entropies(*args, **kwargs)
        if self._capture_logps:
            # Rows dropped by `_drop_nonfinite` (and any non-finite value the forward produced) become a constant 0,
            # so log-ratio and KL vanish there and no NaN reaches the loss.
            bad = ~torch.isfinite(logps)
            if self._nonfinite_rows is not None:
                bad = bad | self._nonfinite_rows.unsqueeze(-1)
            if bad.any():
                logps = torch.where(bad, torch.zeros_like(logps), logps)
            self._captured_logps = logps.detach()
        return logps, entropies, aux_loss

    def _drop_nonfinite(self, inputs):
        """Mask out of the loss every sequence whose advantage or stored log-probs are NaN/inf (never a NaN loss)."""
        mask = inputs["completion_mask"].bool()
        advantages = inputs["advantages"]
        bad = ~torch.isfinite(advantages.reshape(advantages.shape[0], -1)).all(-1)
        fills = {"old_per_token_logps": 0.0, "ref_per_token_logps": 0.0, "importance_sampling_ratio": 1.0}
        for key in fills:
            value = inputs.get(key)
            if value is not None:
                bad = bad | (~torch.isfinite(value) & mask).any(-1)
        self._nonfinite_rows = bad
        if not bad.any():
            return inputs
        self._nonfinite_total += int(bad.sum())
        inputs = dict(inputs)
        keep = ~bad
        inputs["advantages"] = torch.where(keep.reshape(-1, *[1] * (advantages.dim() - 1)), advantages, 0.0)
        for key, fill in fills.items():
            if inputs.get(key) is not None:
                value = inputs[key]
                inputs[key] = torch.where(keep.unsqueeze(-1) & torch.isfinite(value), value, fill)
        loss_mask = inputs.get("tool_mask", torch.ones_like(inputs["completion_mask"]))
        inputs["tool_mask"] = loss_mask * keep.unsqueeze(-1).to(loss_mask.dtype)  # TRL's loss-only mask
        return inputs

    # -- metrics ---------------------------------------------------------------------------------------------------------

    def _log_step_metrics(self, inputs) -> None:
        mode = "train" if self.model.training else "eval"
        if not self.args.respo_log_diagnostics:
            if mode == "train":
                self._log_reuse_metrics(inputs, mode)
            return
        logps = self._captured_logps
        mask = inputs["completion_mask"] * inputs.get("tool_mask", 1)
        old = inputs.get("old_per_token_logps")
        log_ratio = torch.zeros_like(logps) if old is None else logps - old
        is_ratio = None
        if self.use_vllm and self.vllm_importance_sampling_correction:
            is_ratio = inputs.get("importance_sampling_ratio")
        table = sequence_stats(
            log_ratio,
            inputs["advantages"],
            mask,
            self.loss_params,
            self._loss_name,
            is_ratio=is_ratio,
            gather=self.accelerator.gather,
        )
        versions = inputs.get(VERSION_KEY)
        staleness = (self.state.global_step - versions).float() if versions is not None else torch.zeros(len(table))
        nonfinite = self._nonfinite_rows.float()
        table = torch.cat([table, staleness.to(table).unsqueeze(-1), nonfinite.to(table).unsqueeze(-1)], dim=-1)
        table = self.accelerator.gather(table)  # one collective: every process logs the same global numbers

        metrics = summarize(table[:, : len(COLUMNS)])
        staleness, nonfinite = table[:, len(COLUMNS)], table[:, len(COLUMNS) + 1]
        metrics["respo/nonfinite_seqs"] = nonfinite.sum().item()
        for key, value in metrics.items():
            self._metrics[mode][key].append(value)
        if mode == "train":
            self._log_reuse_metrics(inputs, mode, staleness)

    def _log_reuse_metrics(self, inputs, mode, staleness=None) -> None:
        if staleness is None:  # diagnostics off: gather the staleness alone
            staleness = self.accelerator.gather((self.state.global_step - inputs[VERSION_KEY]).float())
        metrics = {"reuse/staleness_mean": staleness.mean().item(), "reuse/staleness_max": staleness.max().item()}
        if self._step % self.current_gradient_accumulation_steps == 0:  # first micro-batch of an optimizer step
            generated = self.rollouts.generated_tokens
            metrics["reuse/generated_tokens_per_step"] = float(generated - self._tokens_at_step_start)
            self._tokens_at_step_start = generated
        metrics["reuse/generated_tokens"] = float(self.rollouts.generated_tokens)
        metrics["reuse/refreshes"] = float(self.rollouts.refreshes)
        for key, value in metrics.items():
            self._metrics[mode][key].append(value)

    def log(self, logs: dict, start_time: float | None = None) -> None:
        # Under reuse the failure to watch is a loss that keeps taking full steps on stale rollouts: the clipped loss's
        # gradient norm falls several-fold on reuse passes, ReSPO's need not (docs/method.md, section 6). Log which pass
        # over its batch this optimizer step was and its grad_norm relative to the batch's fresh pass.
        if "grad_norm" in logs and self.model.training and self.state.global_step > 0:
            steps_per_pass = max(1, self.args.steps_per_generation // self.args.gradient_accumulation_steps)
            batch_index, step_in_batch = divmod(self.state.global_step - 1, steps_per_pass * self.num_iterations)
            pass_index = step_in_batch // steps_per_pass
            logs["reuse/pass"] = float(pass_index + 1)
            if pass_index == 0:
                self._fresh_grad_norm = (batch_index, logs["grad_norm"])
            elif self._fresh_grad_norm[0] == batch_index and self._fresh_grad_norm[1]:
                # only against this batch's own fresh pass (with logging_steps > 1 it may not have been logged)
                logs["reuse/grad_norm_vs_fresh"] = logs["grad_norm"] / self._fresh_grad_norm[1]
        super().log(logs, start_time)

    # -- checkpointing -------------------------------------------------------------------------------------------------

    def _save_checkpoint(self, model, trial):
        # The buffer goes in first so that a checkpoint pushed to the Hub by super() carries it too.
        checkpoint_dir = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        passes_left = self._step % (self.args.steps_per_generation * self.num_iterations) != 0
        self.rollouts.save(
            checkpoint_dir,
            self.accelerator.process_index,
            extra={"step": self._step, "tokens_at_step_start": self._tokens_at_step_start},
            include_batch=passes_left,  # a fully used batch is never served again: keep the checkpoint small
        )
        super()._save_checkpoint(model, trial)

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        extra = self.rollouts.load(checkpoint, self.accelerator.process_index, device=self.accelerator.device)
        self._step = extra["step"]
        self._tokens_at_step_start = extra["tokens_at_step_start"]

    # -- model card and Hub (logic in respo_trl/model_card.py and respo_trl/hub.py) -------------------------------------

    def create_model_card(self, model_name=None, dataset_name=None, tags=None):
        """Write ReSPO's card (method, kernel, reuse, versions, eval table, curves) to ``output_dir/README.md``."""
        if self.is_world_process_zero():
            write_trainer_card(self, model_name=model_name, dataset_name=dataset_name, tags=tags)

    def init_hf_repo(self, token=None, private=None):
        with hub_failure(self, "create the Hub repository"):
            super().init_hf_repo(token=token, private=private)

    def push_to_hub(self, *args, **kwargs):
        """transformers' push; if the Hub is unusable, a ``HubPushError`` that says why, with the model saved locally."""
        with hub_failure(self, "push to the Hub repository", save_if_unsaved=True):
            return super().push_to_hub(*args, **kwargs)
