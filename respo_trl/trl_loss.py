"""ReSPO's loss in TRL's shape, and the TRL surface the seam (:mod:`respo_trl.trainer`) relies on, checked once.

TRL 1.16 has no loss hook (its refactors of ``GRPOTrainer._compute_loss`` were closed unmerged), so ReSPO's loss is
reached through ``ReSPOTrainer._compute_loss``, the trainer's one override of it. For ``loss_type="respo"`` that
override calls :func:`respo_loss`, which computes what TRL's ``vespo`` branch computes with ReSPO's coefficient in
place of VESPO's: the per-token loss ``-c_it * A_i * log pi_theta(y_it)`` with a detached ``c``
(:func:`respo_trl.kernels.respo_coefficients`, the sampler correction folded into ``W`` and never multiplied again),
TRL's off-policy and entropy masks, its KL term, its ``dapo`` aggregation (a token sum over the accumulation window's
token count), its entropy bonus and MoE auxiliary loss, and its metrics. ``tests/test_gradients.py`` holds it to
TRL: a ReSPO loss whose branches are both VESPO's trains exactly as ``trl.GRPOTrainer(loss_type="vespo")`` in every
combination of those terms, so a TRL release that changes its loss shows up there. Every other ``loss_type`` runs
TRL's ``_compute_loss`` untouched.

The seam's TRL surface is declared here: :data:`TRL_METHODS` (every method it overrides or calls, with TRL 1.16's
parameters and kind), :data:`TRL_STATE` and :data:`TRL_LOOP_STATE` (every attribute it reads or writes) and
:data:`GENERATE_FIELDS` (the length of ``_generate``'s tuple, whose first three fields it reads).
:func:`check_trl_hooks` refuses, in one line naming what moved, a TRL whose methods differ; :func:`check_trl_state`,
:func:`check_trl_loop_state` and :func:`check_generate_output` the same for the state and the tuple when they are
first there (after ``__init__``, on the first training micro-batch, on the first generation).
"""

from __future__ import annotations

import functools
import inspect

import torch
import trl
from accelerate.logging import get_logger

from .kernels import respo_coefficients

logger = get_logger(__name__)

SUPPORTED_TRL = "1.16"  # the TRL minor version whose GRPOTrainer the seam was written against
_FORWARD = (
    "self", "model", "input_ids", "attention_mask", "logits_to_keep", "batch_size", "compute_entropy",
    "compute_aux_loss", "pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes",
    "num_tiles", "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids",
)  # fmt: skip
# Every GRPOTrainer (or transformers.Trainer) method the seam overrides or calls: its parameters in TRL 1.16 and
# whether it is static (an override keeps the kind). ``__init__`` is checked on the parameters the seam passes by
# position; the rest go through as they come.
TRL_METHODS = {
    # overridden by ReSPOTrainer, once each
    "__init__": (("self", "model", "reward_funcs", "args"), False),
    "_prepare_inputs": (("self", "generation_batch"), False),
    "_generate": (("self", "prompts"), False),
    "_generate_and_score_completions": (("self", "inputs"), False),
    "_get_per_token_logps_and_entropies": (_FORWARD, False),
    "_compute_loss": (("self", "model", "inputs"), False),
    "log": (("self", "logs", "start_time"), False),
    "train": (("self", "resume_from_checkpoint", "trial", "ignore_keys_for_eval"), False),
    "_save_checkpoint": (("self", "model", "trial"), False),
    "_load_optimizer_and_scheduler": (("self", "checkpoint"), False),
    "create_model_card": (("self", "model_name", "dataset_name", "tags"), False),
    # called by the seam or by ReSPO's loss
    "get_high_entropy_mask": (("self", "entropies", "mask", "threshold"), False),
    "get_off_policy_mask": (
        ("advantages", "per_token_logps", "sampling_per_token_logps", "mask", "off_policy_threshold"), True
    ),
    "_get_output_dir": (("self", "trial"), False),
    "is_world_process_zero": (("self",), False),
}  # fmt: skip
# The ones listed first above: what ReSPOTrainer overrides (tests/test_trainer.py checks the class against it).
OVERRIDDEN = tuple(list(TRL_METHODS)[:11])
# GRPOTrainer state the seam and ReSPO's loss read or write (set in TRL's and transformers' __init__), checked once a
# trainer is built. ``_step`` (the micro-step counter the buffer follows and restores on resume) and ``_metrics``
# (where every diagnostic is appended) are written; the rest are read.
TRL_STATE = (
    "loss_type", "beta", "router_aux_loss_coef", "top_entropy_quantile", "off_policy_mask_threshold", "importance_sampling_level",
    "aux_loss_enabled", "_entropy_bonus_enabled", "use_adaptive_entropy", "entropy_coef", "_last_world_entropy",
    "_entropy_window_stats", "_step", "_metrics", "num_iterations", "use_vllm", "vllm_importance_sampling_correction",
    "tools", "rollout_func", "accelerator", "state",
)  # fmt: skip
# Set by transformers' training loop, not by __init__: checked on the first training micro-batch.
TRL_LOOP_STATE = ("current_gradient_accumulation_steps",)
# Read only when ``use_vllm`` is on: the engine mode, and the colocated engine whose weights the seam inspects.
TRL_VLLM_STATE = ("vllm_mode", "vllm_generation")
# ``GRPOTrainer._generate`` returns (prompt_ids, completion_ids, tool_mask, completions, logprobs, extra_fields, images,
# tool_images) in TRL 1.16; the seam reads the first three.
GENERATE_FIELDS = 8
# The multimodal inputs TRL's loss forwards (the last ten parameters of the forward helper).
MULTIMODAL_KEYS = _FORWARD[8:]


def _incompatible(missing: list[str]) -> RuntimeError:
    return RuntimeError(
        f"respo_trl hooks ReSPO into TRL {SUPPORTED_TRL}'s GRPOTrainer, but the installed trl {trl.__version__} "
        f"no longer has {missing}. Install a supported TRL (pip install 'trl>={SUPPORTED_TRL},<1.17') or a "
        "respo_trl release that supports this TRL. TRL's own loss types would still train, but ReSPO cannot run "
        "safely."
    )


def _parameters(helper) -> tuple[str, ...] | None:
    function = helper.__func__ if isinstance(helper, staticmethod) else helper
    try:
        return tuple(inspect.signature(function).parameters) if function is not None else None
    except (TypeError, ValueError):
        return None


@functools.cache  # once per process: the check reads TRL's signatures
def check_trl_hooks(grpo_trainer_cls=None) -> None:
    """Fail early, in one line with what to do, if the installed TRL no longer has the methods the seam overrides or
    calls, with the parameters and kind it uses."""
    if grpo_trainer_cls is None:
        from trl import GRPOTrainer as grpo_trainer_cls
    missing = []
    for name, (parameters, static) in TRL_METHODS.items():
        helper = inspect.getattr_static(grpo_trainer_cls, name, None)
        found = _parameters(helper)
        if name == "__init__" and found is not None:
            found = found[: len(parameters)]
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
    """After TRL's ``__init__``: the attributes the seam reads or writes are there (a TRL that renamed one is refused)."""
    names = TRL_STATE + (TRL_VLLM_STATE if getattr(trainer, "use_vllm", False) else ())
    missing = [f"GRPOTrainer.{name}" for name in names if not hasattr(trainer, name)]
    if missing:
        raise _incompatible(missing)


def check_trl_loop_state(trainer) -> None:
    """Inside the training loop: the attributes transformers sets there and the seam reads are there."""
    missing = [f"Trainer.{name}" for name in TRL_LOOP_STATE if not hasattr(trainer, name)]
    if missing:
        raise _incompatible(missing)


def check_generate_output(output: tuple) -> None:
    """The tuple ``_generate`` returned has TRL 1.16's fields (the seam reads ids, completion ids and tool mask)."""
    if not isinstance(output, tuple) or len(output) != GENERATE_FIELDS:
        got = len(output) if isinstance(output, tuple) else type(output).__name__
        raise _incompatible([f"GRPOTrainer._generate returning {GENERATE_FIELDS} fields (got {got})"])


def gamma_weights(params, advantages, log_ratio_per_token, mask, importance_sampling_ratio, log_w=None):
    """ReSPO's detached per-token coefficient, where TRL's vespo branch calls ``get_gamma_weights``."""
    return respo_coefficients(log_ratio_per_token, advantages, mask, params, sampler_ratio=importance_sampling_ratio,
                              log_w=log_w)  # fmt: skip


def respo_loss(trainer, inputs: dict, per_token_logps, entropies, aux_loss, kept_log_w=None):
    """TRL 1.16's ``_compute_loss`` on its ``vespo`` branch, with ReSPO's coefficient (spec section 2), on the loss
    forward's ``per_token_logps``, ``entropies`` and ``aux_loss`` (``kept_log_w``: the first-pass ``log W`` of each
    row under ``respo_epoch_weight="first_pass"``). Appends TRL's metrics to ``trainer._metrics``."""
    mode = "train" if trainer.model.training else "eval"
    completion_mask = inputs["completion_mask"]
    mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
    per_token_logps = torch.where(torch.isfinite(per_token_logps), per_token_logps, 0.0)  # never a NaN loss
    entropy_mask = None
    if trainer.top_entropy_quantile < 1.0:
        entropy_mask = trainer.get_high_entropy_mask(entropies, mask, 1 - trainer.top_entropy_quantile)
    advantages = inputs["advantages"]
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    old_per_token_logps = inputs.get("old_per_token_logps")
    old_per_token_logps = per_token_logps.detach() if old_per_token_logps is None else old_per_token_logps
    log_ratio = per_token_logps - old_per_token_logps

    # the policy term: -c_it * A_i * log pi(y_it), c = phi_{sign A}(W_i) detached, W with the sampler ratio folded
    ratio = inputs.get("importance_sampling_ratio")
    if kept_log_w is None:  # (the call keeps TRL's four arguments when there is nothing to keep)
        coefficient = trainer._respo_gamma_weights(advantages, log_ratio, mask, ratio)
    else:
        coefficient = trainer._respo_gamma_weights(advantages, log_ratio, mask, ratio, log_w=kept_log_w)
    per_token_loss = -coefficient * advantages * per_token_logps
    if trainer.off_policy_mask_threshold is not None:
        per_token_loss = per_token_loss * trainer.get_off_policy_mask(
            advantages=advantages, per_token_logps=per_token_logps,
            sampling_per_token_logps=inputs.get("sampling_per_token_logps", old_per_token_logps), mask=mask,
            off_policy_threshold=trainer.off_policy_mask_threshold,
        )  # fmt: skip
    if entropy_mask is not None:
        per_token_loss = per_token_loss * entropy_mask
    if trainer.beta != 0.0:
        ref = inputs["ref_per_token_logps"]
        per_token_kl = torch.exp(ref - per_token_logps) - (ref - per_token_logps) - 1
        if trainer.args.use_bias_correction_kl:  # TRL's token or sequence importance weight
            if trainer.importance_sampling_level == "sequence":
                level = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
            else:
                level = log_ratio
            per_token_kl = per_token_kl * torch.exp(level)
        per_token_loss = per_token_loss + trainer.beta * per_token_kl

    # TRL's dapo aggregation: `num_items_in_batch` spans the generation batch, rescaled to one accumulation window
    accelerator = trainer.accelerator
    normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / accelerator.num_processes
    if mode == "train":
        normalizer = normalizer * trainer.current_gradient_accumulation_steps / trainer.args.steps_per_generation
    loss = (per_token_loss * mask).sum() / normalizer
    loss = loss + trl_entropy_bonus(trainer, entropies, mask, entropy_mask, loss.detach(), mode)
    if trainer.aux_loss_enabled:  # scaled for gradient accumulation like the policy loss
        accumulation = trainer.current_gradient_accumulation_steps if mode == "train" else 1.0
        loss = loss + trainer.router_aux_loss_coef * aux_loss / accumulation
        trainer._metrics[mode]["aux_loss"].append(accelerator.gather_for_metrics(aux_loss).mean().item())

    def global_masked_mean(x):
        totals = accelerator.reduce(torch.stack([(x * mask).sum(), mask.sum().float()]), reduction="sum")
        return (totals[0] / totals[1].clamp(min=1.0)).item()

    if trainer.beta != 0.0:
        trainer._metrics[mode]["kl"].append(global_masked_mean(per_token_kl))
    trainer._metrics[mode]["entropy"].append(global_masked_mean(entropies))
    return loss


def trl_entropy_bonus(trainer, entropies, mask, entropy_mask, policy_loss, mode):
    """TRL 1.16's entropy bonus (static or adaptive coefficient) as a term to add to the loss; 0 when off. Updates
    TRL's adaptive coefficient state as TRL does."""
    if not trainer._entropy_bonus_enabled:
        return 0.0
    args, accelerator = trainer.args, trainer.accelerator
    effective_mask = mask if entropy_mask is None else mask * entropy_mask
    accumulation = trainer.current_gradient_accumulation_steps if mode == "train" else 1.0
    entropy_loss = (entropies * effective_mask).sum() / effective_mask.sum().clamp(min=1.0) / accumulation
    if trainer.use_adaptive_entropy:  # the coefficient from the end of the previous optimizer step
        apply_coef = trainer.entropy_coef if trainer._last_world_entropy <= args.entropy_target else 0.0
    else:
        apply_coef = trainer.entropy_coef
    trainer._metrics[mode]["policy_loss"].append(accelerator.gather(policy_loss).nanmean().item())
    if trainer.use_adaptive_entropy and mode == "train":  # the window-global entropy updates the next step's
        stats = torch.stack([(entropies * effective_mask).sum(), effective_mask.sum()]).detach()
        window = trainer._entropy_window_stats
        trainer._entropy_window_stats = stats if window is None else window + stats
        if accelerator.sync_gradients:
            window = accelerator.reduce(trainer._entropy_window_stats, reduction="sum")
            world_entropy = (window[0] / window[1].clamp(min=1.0)).item()
            if world_entropy <= args.entropy_target:
                trainer.entropy_coef = min(trainer.entropy_coef + args.entropy_coef_delta, args.entropy_coef_max)
            else:
                trainer.entropy_coef = max(trainer.entropy_coef - args.entropy_coef_delta, args.entropy_coef_min)
            trainer._last_world_entropy = world_entropy
            trainer._entropy_window_stats = None
    if mode == "train" and accelerator.sync_gradients:
        trainer._metrics[mode]["entropy_coef"].append(trainer.entropy_coef)
    return -apply_coef * entropy_loss
