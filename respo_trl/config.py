"""``ReSPOConfig``: TRL's ``GRPOConfig`` plus the ReSPO kernel and rollout-reuse settings."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from trl import GRPOConfig

from .kernels import NORM_MODES
from .routing_replay import config_problems

TOKEN_IS_MODES = ("token_truncate", "token_mask")


@dataclass
class ReSPOConfig(GRPOConfig):
    r"""
    Configuration for [`ReSPOTrainer`]: every [`~trl.GRPOConfig`] field, with ``loss_type="respo"`` as default, plus
    the fields below. Invalid values raise a ``ValueError`` that names the field at construction time.

    Parameters:
        > ReSPO kernel ``phi(w) = w^alpha * exp(lambda * (1 - w))`` applied to the normalised sequence weight

        respo_alpha_pos (`float`, defaults to `0.5`):
            Power ``alpha`` of the branch for positive advantages. Values in [0, 0.5] keep the kernel concave at low
            weight, so correct rollouts the policy has drifted away from keep receiving gradient.
        respo_lambda_pos (`float`, defaults to `0.5`):
            Exponential tilt ``lambda`` of the positive branch; damps positives the policy already over-weights.
        respo_alpha_neg (`float`, defaults to `2.0`):
            Power of the branch for negative advantages (typically in [1, 3]).
        respo_lambda_neg (`float`, defaults to `2.0`):
            Tilt of the negative branch (typically in [1.5, 3]); damps high-weight negatives ("gradient shock").
        respo_norm (`str`, defaults to `"sqrt"`):
            Sequence-level variance normalisation ``s_i = l_i / T_i``: ``"none"`` (product ratio), ``"mean"``
            (geometric mean, GSPO), ``"sqrt"`` (``T_i = sqrt(L_i)``) or ``"ess"`` (one ``T`` per micro-batch that keeps
            the effective sample size above ``respo_rho_min``).
        respo_rho_min (`float`, defaults to `0.5`):
            ESS floor in (0, 1] used by ``respo_norm="ess"``.

        > Rollout reuse

        respo_reuse (`int`, defaults to `1`):
            Optimizer passes ``R`` over each generation batch. It is TRL's ``num_iterations`` under another name: set
            either one (setting both to different values is an error). ``R=4`` samples a quarter of the tokens per
            optimizer step.
        respo_reshuffle (`bool`, defaults to `True`):
            Draw a new minibatch composition of the generation batch on every reuse pass.
        respo_min_ess (`float`, *optional*):
            Refresh floor in (0, 1]: before each reuse pass, the normalised ESS of the buffered batch under the current
            policy is measured (one extra no-grad forward); below this floor fresh completions are sampled for the
            same prompts instead of reusing the stale ones.
        respo_buffer_device (`str`, defaults to `"auto"`):
            ``"auto"`` keeps buffered rollouts on the training device; ``"cpu"`` parks them in host memory between
            uses (long contexts).

        > Diagnostics

        respo_log_diagnostics (`bool`, defaults to `True`):
            Log the starvation and off-policy metrics (``starvation/*``, ``offpolicy/*``, ``respo/*``) on every step,
            for every ``loss_type``. They cost one small all-gather and elementwise work per micro-batch (measured in
            ``docs/diagnostics.md``); the reuse metrics (``reuse/*``) are always logged.

        > Mixture-of-Experts

        respo_routing_replay (`bool`, defaults to `False`):
            Rollout Routing Replay (R3) for Qwen3-MoE models: record the experts each MoE layer chose for every token
            during generation and make every log-prob forward (old log-probs and the loss) route each token to those
            experts, with gating weights recomputed from the current router. Needs transformers generation
            (``use_vllm=False``); a dense model is rejected when the trainer is built. Logs ``routing/drift``.
            See ``docs/moe.md``.
    """

    loss_type: str = field(
        default="respo",
        metadata={
            "help": "Policy loss. 'respo' (default) is ReSPO's sequence-level two-branch kernel; every TRL loss type "
            "('dapo', 'grpo', 'bnpo', 'dr_grpo', 'cispo', 'sapo', 'luspo', 'vespo') also runs for comparison."
        },
    )
    vllm_importance_sampling_mode: str = field(
        default="token_truncate",
        metadata={
            "help": "vLLM sampler-mismatch correction (see GRPOConfig). ReSPO folds the token ratio into its sequence "
            "weight, so it needs a token mode: 'token_truncate' (default here) or 'token_mask'."
        },
    )
    respo_alpha_pos: float = field(
        default=0.5,
        metadata={"help": "Power alpha of the ReSPO kernel for positive advantages (>= 0; [0, 0.5] keeps it concave)."},
    )
    respo_lambda_pos: float = field(
        default=0.5,
        metadata={"help": "Exponential tilt lambda of the ReSPO kernel for positive advantages (>= 0)."},
    )
    respo_alpha_neg: float = field(
        default=2.0,
        metadata={"help": "Power alpha of the ReSPO kernel for negative advantages (>= 0; typically 1-3)."},
    )
    respo_lambda_neg: float = field(
        default=2.0,
        metadata={"help": "Exponential tilt lambda of the ReSPO kernel for negative advantages (>= 0; typically 1.5-3)."},
    )
    respo_norm: str = field(
        default="sqrt",
        metadata={
            "help": "Sequence-level variance normalisation of the log-weight: 'none', 'mean', 'sqrt' or 'ess'.",
            "choices": list(NORM_MODES),
        },
    )
    respo_rho_min: float = field(
        default=0.5,
        metadata={"help": "ESS floor in (0, 1] that respo_norm='ess' guarantees under a log-normal model."},
    )
    respo_reuse: int = field(
        default=1,
        metadata={
            "help": "Optimizer passes R over each generation batch (>= 1). Alias of TRL's num_iterations; set one of "
            "them."
        },
    )
    respo_reshuffle: bool = field(
        default=True,
        metadata={"help": "Reshuffle the minibatch composition of a reused generation batch on every pass."},
    )
    respo_min_ess: float | None = field(
        default=None,
        metadata={
            "help": "Optional ESS floor in (0, 1]: a reused batch whose normalised ESS under the current policy falls "
            "below it is refreshed with new completions for the same prompts."
        },
    )
    respo_buffer_device: str = field(
        default="auto",
        metadata={"help": "Where buffered rollouts live between passes: 'auto' (training device) or 'cpu'."},
    )

    respo_log_diagnostics: bool = field(
        default=True,
        metadata={"help": "Log the starvation/off-policy diagnostics on every step (one small all-gather per micro-batch)."},
    )

    respo_routing_replay: bool = field(
        default=False,
        metadata={
            "help": "Routing Replay (R3) for Qwen3-MoE: replay the experts chosen at generation time in every "
            "log-prob forward (needs use_vllm=False; see docs/moe.md)."
        },
    )

    def __post_init__(self):
        super().__post_init__()
        self._reconcile_reuse()
        self.validate_respo()

    def _reconcile_reuse(self) -> None:
        reuse, iterations = self.respo_reuse, self.num_iterations
        for name, value in (("respo_reuse", reuse), ("num_iterations", iterations)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} (optimizer passes per generation batch) must be an integer >= 1, got {value!r}")
        if reuse != 1 and iterations != 1 and reuse != iterations:
            raise ValueError(
                f"respo_reuse={reuse} and num_iterations={iterations} disagree: they are the same setting (optimizer "
                "passes per generation batch). Set only one of them."
            )
        self.respo_reuse = self.num_iterations = max(reuse, iterations)

    def validate_respo(self) -> None:
        """Check the ReSPO fields (also used when a plain ``GRPOConfig`` is upgraded)."""
        for name in ("respo_alpha_pos", "respo_lambda_pos", "respo_alpha_neg", "respo_lambda_neg"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if self.respo_norm not in NORM_MODES:
            raise ValueError(f"respo_norm must be one of {NORM_MODES}, got {self.respo_norm!r}")
        if not (isinstance(self.respo_rho_min, (int, float)) and 0.0 < self.respo_rho_min <= 1.0):
            raise ValueError(f"respo_rho_min must be in (0, 1], got {self.respo_rho_min!r}")
        if not isinstance(self.respo_reuse, int) or isinstance(self.respo_reuse, bool) or self.respo_reuse < 1:
            raise ValueError(f"respo_reuse (num_iterations) must be an integer >= 1, got {self.respo_reuse!r}")
        if self.respo_min_ess is not None and not 0.0 < self.respo_min_ess <= 1.0:
            raise ValueError(f"respo_min_ess must be in (0, 1] or None, got {self.respo_min_ess!r}")
        if self.respo_buffer_device not in ("auto", "cpu"):
            raise ValueError(f"respo_buffer_device must be 'auto' or 'cpu', got {self.respo_buffer_device!r}")
        if self.respo_routing_replay and config_problems(self):
            raise ValueError("respo_routing_replay=True: " + "; ".join(config_problems(self)))
        if self.loss_type == "respo":
            if self.importance_sampling_level != "token":
                raise ValueError(
                    "importance_sampling_level must be 'token' with loss_type='respo': ReSPO builds its sequence "
                    f"weight itself (see respo_norm); got {self.importance_sampling_level!r}."
                )
            if (
                self.use_vllm
                and self.vllm_importance_sampling_correction
                and self.vllm_importance_sampling_mode not in TOKEN_IS_MODES
            ):
                raise ValueError(
                    f"vllm_importance_sampling_mode={self.vllm_importance_sampling_mode!r} is incompatible with "
                    f"loss_type='respo': ReSPO folds the vLLM ratio into its sequence weight token by token. Use one "
                    f"of {TOKEN_IS_MODES}, or set vllm_importance_sampling_correction=False."
                )

    @classmethod
    def from_grpo_config(cls, args: GRPOConfig, **overrides) -> "ReSPOConfig":
        """Upgrade an already-built ``GRPOConfig`` to a ``ReSPOConfig`` with ReSPO defaults (``loss_type='respo'``).

        ``GRPOConfig.__post_init__`` has already resolved derived fields (batch arithmetic, distributed state), so
        re-running it would reject them; the values are copied as they are and only the ReSPO checks run.
        """
        upgraded = cls.__new__(cls)
        upgraded.__dict__.update(args.__dict__)
        for f in cls.__dataclass_fields__.values():
            if f.name not in upgraded.__dict__ and f.init:
                upgraded.__dict__[f.name] = f.default
        upgraded.loss_type = "respo"
        if args.vllm_importance_sampling_mode not in TOKEN_IS_MODES and not (args.use_vllm and args.vllm_importance_sampling_correction):
            upgraded.vllm_importance_sampling_mode = "token_truncate"
        upgraded.respo_reuse = args.num_iterations
        upgraded.__dict__.update(overrides)
        upgraded.validate_respo()
        return upgraded
