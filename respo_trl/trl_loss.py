"""The one seam between ReSPO and TRL's loss: ``_compute_loss`` for ``loss_type="respo"``, declared once.

TRL 1.16 has no loss hook (its refactors of ``GRPOTrainer._compute_loss`` were closed unmerged), so the seam is a
subclass override with TRL's exact signature. Every TRL ``loss_type`` runs TRL's ``_compute_loss`` untouched. For
``loss_type="respo"``, :meth:`ReSPOLoss._compute_loss` computes what TRL's ``vespo`` branch computes, with ReSPO's
coefficient in place of VESPO's: the per-token loss ``-c_it * A_i * log pi_theta(y_it)`` with a detached ``c``
(:func:`respo_trl.kernels.respo_coefficients`, the sampler correction folded into ``W`` and never multiplied again),
TRL's off-policy and entropy masks, its KL term, its ``dapo`` aggregation (a token sum over the accumulation window's
token count), its entropy bonus and MoE auxiliary loss, and its metrics. ``tests/test_gradients.py`` holds it to
TRL: a ReSPO loss whose branches are both VESPO's trains exactly as ``trl.GRPOTrainer(loss_type="vespo")`` in every
combination of those terms, so a TRL release that changes its loss shows up there.

The diagnostics need the log-probabilities of the loss's forward for every loss type; :class:`ReSPOLoss` keeps the
last forward's (:attr:`ReSPOLoss.last_forward`), which inside ``_compute_loss`` is the loss's own (TRL computes it
once per call).

:func:`check_trl_hooks` checks, when a trainer is built, that the installed TRL still has the helpers this module
calls with the signatures it calls them with, and refuses another in one line.
"""

from __future__ import annotations

import functools
import inspect

import torch
import trl
from accelerate.logging import get_logger

from .kernels import respo_coefficients

logger = get_logger(__name__)

SUPPORTED_TRL = "1.16"  # the TRL minor version whose GRPOTrainer this module was written against
# The GRPOTrainer helpers ReSPO's loss calls, with the parameters it passes (TRL 1.16's signatures), and whether TRL
# declares the helper static (an override keeps the kind).
TRL_HELPERS = {
    "_compute_loss": (("self", "model", "inputs"), False),
    "_get_per_token_logps_and_entropies": (
        ("self", "model", "input_ids", "attention_mask", "logits_to_keep", "batch_size", "compute_entropy",
         "compute_aux_loss", "pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes",
         "num_tiles", "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids"),
        False,
    ),
    "get_high_entropy_mask": (("self", "entropies", "mask", "threshold"), False),
    "get_off_policy_mask": (
        ("advantages", "per_token_logps", "sampling_per_token_logps", "mask", "off_policy_threshold"), True
    ),
}  # fmt: skip
# GRPOTrainer state the loss reads (set in TRL's __init__), checked once a trainer is built.
TRL_STATE = (
    "loss_type", "beta", "router_aux_loss_coef", "top_entropy_quantile", "off_policy_mask_threshold", "importance_sampling_level",
    "aux_loss_enabled", "_entropy_bonus_enabled", "use_adaptive_entropy", "entropy_coef", "_last_world_entropy",
    "_entropy_window_stats",
)  # fmt: skip
# The multimodal inputs TRL's loss forwards (the last ten parameters of the forward helper).
MULTIMODAL_KEYS = TRL_HELPERS["_get_per_token_logps_and_entropies"][0][8:]


def _incompatible(missing: list[str]) -> RuntimeError:
    return RuntimeError(
        f"respo_trl hooks ReSPO into TRL {SUPPORTED_TRL}'s GRPOTrainer, but the installed trl {trl.__version__} "
        f"no longer has {missing}. Install a supported TRL (pip install 'trl>={SUPPORTED_TRL},<1.17') or a "
        "respo_trl release that supports this TRL. TRL's own loss types would still train, but ReSPO cannot run "
        "safely."
    )


@functools.cache  # once per process: the check reads TRL's signatures
def check_trl_hooks(grpo_trainer_cls=None) -> None:
    """Fail early, in one line with what to do, if the installed TRL no longer has what ReSPO's loss calls."""
    if grpo_trainer_cls is None:
        from trl import GRPOTrainer as grpo_trainer_cls
    missing = []
    for name, (parameters, static) in TRL_HELPERS.items():
        helper = inspect.getattr_static(grpo_trainer_cls, name, None)
        function = helper.__func__ if isinstance(helper, staticmethod) else helper
        try:
            found = tuple(inspect.signature(function).parameters) if function is not None else None
        except (TypeError, ValueError):
            found = None
        if found != parameters or isinstance(helper, staticmethod) != static:
            kind = "static " if static else ""
            missing.append(f"{kind}GRPOTrainer.{name}({', '.join(parameters)})")
    if missing:
        raise _incompatible(missing)
    if not trl.__version__.startswith(SUPPORTED_TRL + "."):
        logger.warning(
            f"respo_trl was tested with trl {SUPPORTED_TRL}.x; trl {trl.__version__} still has the helpers ReSPO "
            "calls, but results are not verified."
        )


def check_trl_state(trainer) -> None:
    """After TRL's ``__init__``: the attributes ReSPO's loss reads are there (a TRL that renamed one is refused)."""
    missing = [f"GRPOTrainer.{name}" for name in TRL_STATE if not hasattr(trainer, name)]
    if missing:
        raise _incompatible(missing)


class ReSPOLoss:
    """``GRPOTrainer``'s loss with ReSPO's coefficient for ``loss_type="respo"``; TRL's own for every other type.

    A mixin placed right before ``GRPOTrainer`` in the bases (so MoE Routing Replay's overrides wrap it like TRL's
    loss). Both overrides keep TRL 1.16's exact signatures.
    """

    last_forward: tuple[torch.Tensor, torch.Tensor | None] | None = None  # (log-probs, entropies) of the last forward
    # Set by the trainer for one loss call: rows (B,) whose log-probs the loss forward counts as 0, with any non-finite
    # value (the rows it dropped for a non-finite advantage or stored log-prob; TRL's loss still multiplies their terms
    # by 0, and a dropped row whose forward underflowed would turn exp(ref - log pi) or A * log pi into inf * 0 = NaN).
    rows_out_of_loss: torch.Tensor | None = None

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
        logps, entropies, aux_loss = super()._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size, compute_entropy=compute_entropy,
            compute_aux_loss=compute_aux_loss, pixel_values=pixel_values, image_grid_thw=image_grid_thw,
            num_images=num_images, pixel_attention_mask=pixel_attention_mask, spatial_shapes=spatial_shapes,
            num_tiles=num_tiles, image_sizes=image_sizes, token_type_ids=token_type_ids,
            mm_token_type_ids=mm_token_type_ids, image_position_ids=image_position_ids,
        )  # fmt: skip
        dropped = self.rows_out_of_loss
        if dropped is not None and dropped.shape[0] == logps.shape[0]:  # the loss forward of a batch with dropped rows
            logps = torch.where(~torch.isfinite(logps) | dropped.unsqueeze(-1).to(logps.device), 0.0, logps)
        self.last_forward = (logps.detach(), None if entropies is None else entropies.detach())
        return logps, entropies, aux_loss

    def _compute_loss(self, model, inputs):
        if self.loss_type != "respo":
            return super()._compute_loss(model, inputs)
        return self._respo_loss(model, inputs)

    def _respo_gamma_weights(self, advantages, log_ratio_per_token, mask, importance_sampling_ratio):
        """ReSPO's detached per-token coefficient, where TRL's vespo branch calls ``get_gamma_weights``."""
        return respo_coefficients(
            log_ratio_per_token, advantages, mask, self.loss_params, sampler_ratio=importance_sampling_ratio
        )

    def _respo_loss(self, model, inputs):
        """TRL 1.16's ``_compute_loss`` on its ``vespo`` branch, with ReSPO's coefficient (spec section 2)."""
        mode = "train" if self.model.training else "eval"
        prompt_ids, completion_ids = inputs["prompt_ids"], inputs["completion_ids"]
        completion_mask = inputs["completion_mask"]
        mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
        per_token_logps, entropies, aux_loss = self._get_per_token_logps_and_entropies(
            model, torch.cat([prompt_ids, completion_ids], dim=1),
            torch.cat([inputs["prompt_mask"], completion_mask], dim=1), completion_ids.size(1), compute_entropy=True,
            compute_aux_loss=self.aux_loss_enabled, **{key: inputs.get(key) for key in MULTIMODAL_KEYS},
        )  # fmt: skip
        per_token_logps = torch.where(torch.isfinite(per_token_logps), per_token_logps, 0.0)  # never a NaN loss
        entropy_mask = None
        if self.top_entropy_quantile < 1.0:
            entropy_mask = self.get_high_entropy_mask(entropies, mask, 1 - self.top_entropy_quantile)
        advantages = inputs["advantages"]
        if advantages.dim() == 1:
            advantages = advantages.unsqueeze(1)
        old_per_token_logps = inputs.get("old_per_token_logps")
        old_per_token_logps = per_token_logps.detach() if old_per_token_logps is None else old_per_token_logps
        log_ratio = per_token_logps - old_per_token_logps

        # the policy term: -c_it * A_i * log pi(y_it), c = phi_{sign A}(W_i) detached, W with the sampler ratio folded
        coefficient = self._respo_gamma_weights(advantages, log_ratio, mask, inputs.get("importance_sampling_ratio"))
        per_token_loss = -coefficient * advantages * per_token_logps
        if self.off_policy_mask_threshold is not None:
            per_token_loss = per_token_loss * self.get_off_policy_mask(
                advantages=advantages, per_token_logps=per_token_logps,
                sampling_per_token_logps=inputs.get("sampling_per_token_logps", old_per_token_logps), mask=mask,
                off_policy_threshold=self.off_policy_mask_threshold,
            )  # fmt: skip
        if entropy_mask is not None:
            per_token_loss = per_token_loss * entropy_mask
        if self.beta != 0.0:
            ref = inputs["ref_per_token_logps"]
            per_token_kl = torch.exp(ref - per_token_logps) - (ref - per_token_logps) - 1
            if self.args.use_bias_correction_kl:  # TRL's token or sequence importance weight
                if self.importance_sampling_level == "sequence":
                    level = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
                else:
                    level = log_ratio
                per_token_kl = per_token_kl * torch.exp(level)
            per_token_loss = per_token_loss + self.beta * per_token_kl

        # TRL's dapo aggregation: `num_items_in_batch` spans the generation batch, rescaled to one accumulation window
        normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
        if mode == "train":
            normalizer = normalizer * self.current_gradient_accumulation_steps / self.args.steps_per_generation
        loss = (per_token_loss * mask).sum() / normalizer
        loss = loss + self._trl_entropy_bonus(entropies, mask, entropy_mask, loss.detach(), mode)
        if self.aux_loss_enabled:  # scaled for gradient accumulation like the policy loss
            accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1.0
            loss = loss + self.router_aux_loss_coef * aux_loss / accumulation
            self._metrics[mode]["aux_loss"].append(self.accelerator.gather_for_metrics(aux_loss).mean().item())

        def global_masked_mean(x):
            totals = self.accelerator.reduce(torch.stack([(x * mask).sum(), mask.sum().float()]), reduction="sum")
            return (totals[0] / totals[1].clamp(min=1.0)).item()

        if self.beta != 0.0:
            self._metrics[mode]["kl"].append(global_masked_mean(per_token_kl))
        self._metrics[mode]["entropy"].append(global_masked_mean(entropies))
        return loss

    def _trl_entropy_bonus(self, entropies, mask, entropy_mask, policy_loss, mode):
        """TRL 1.16's entropy bonus (static or adaptive coefficient) as a term to add to the loss; 0 when off."""
        if not self._entropy_bonus_enabled:
            return 0.0
        effective_mask = mask if entropy_mask is None else mask * entropy_mask
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1.0
        entropy_loss = (entropies * effective_mask).sum() / effective_mask.sum().clamp(min=1.0) / accumulation
        if self.use_adaptive_entropy:  # the coefficient from the end of the previous optimizer step
            apply_coef = self.entropy_coef if self._last_world_entropy <= self.args.entropy_target else 0.0
        else:
            apply_coef = self.entropy_coef
        self._metrics[mode]["policy_loss"].append(self.accelerator.gather(policy_loss).nanmean().item())
        if self.use_adaptive_entropy and mode == "train":  # the window-global entropy updates the next step's
            stats = torch.stack([(entropies * effective_mask).sum(), effective_mask.sum()]).detach()
            self._entropy_window_stats = stats if self._entropy_window_stats is None else self._entropy_window_stats + stats
            if self.accelerator.sync_gradients:
                window = self.accelerator.reduce(self._entropy_window_stats, reduction="sum")
                world_entropy = (window[0] / window[1].clamp(min=1.0)).item()
                if world_entropy <= self.args.entropy_target:
                    self.entropy_coef = min(self.entropy_coef + self.args.entropy_coef_delta, self.args.entropy_coef_max)
                else:
                    self.entropy_coef = max(self.entropy_coef - self.args.entropy_coef_delta, self.args.entropy_coef_min)
                self._last_world_entropy = world_entropy
                self._entropy_window_stats = None
        if mode == "train" and self.accelerator.sync_gradients:
            self._metrics[mode]["entropy_coef"].append(self.entropy_coef)
        return -apply_coef * entropy_loss
