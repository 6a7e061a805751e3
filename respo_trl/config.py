"""``ReSPOConfig``: TRL's ``GRPOConfig`` plus the ReSPO kernel constants and the rollout-reuse settings.

Everything TRL accepts stays accepted: ReSPO handles every ``vllm_importance_sampling_mode`` and ignores (with a note)
``importance_sampling_level``, and a baseline ``loss_type`` keeps TRL's own defaults, so ``ReSPOConfig(loss_type=
"dapo")`` trains exactly as ``GRPOConfig(loss_type="dapo")`` does. :func:`respo_notes` says, in one line each, what
ReSPO does with the settings it reinterprets; the trainer logs them once.
"""

from __future__ import annotations

import difflib
import math
import warnings
from dataclasses import dataclass, field

from trl import GRPOConfig

from ._compat import RENAMED_OPTIONS, refuse_renamed
from .batching import steps_from_updates
from .kernels import BRANCH_KINDS, CONSTANT_KEYS, RESPO_DEFAULTS, TRL_LOSS_TYPES, check_constant, with_respo_constants
from .routing_replay import config_problems

TRUST_MASK_MODES = ("auto", "directional", "none")
ADAPTIVE_SIGNALS = ("kl", "ess")  # respo_adaptive_reuse: the drift that cuts a batch's passes short (buffer.py)
EPOCH_WEIGHT_MODES = ("auto", "first_pass", "current")
# TRL's token-level clip defaults (GRPOConfig.epsilon; epsilon_high defaults to epsilon): the trust mask's bounds when
# TRL's own epsilons are sequence-level (GSPO-style configs), where they mean something else entirely.
TRL_TOKEN_EPSILON = GRPOConfig.__dataclass_fields__["epsilon"].default
LOSS_TYPES = tuple(TRL_LOSS_TYPES)  # what ReSPOTrainer trains: every TRL 1.16 loss_type and ReSPO
SAMPLER_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")  # TRL 1.16's vLLM IS modes
# Where epochs (num_iterations = R > 1) were measured safe for ReSPO's defaults: R at most 4 at learning rates up to
# 3e-5, on the recipe's tiny model (docs/benchmarks/reuse_lm.md, section 2.7.2: the rule of 2.7 held there on seeds
# 201-208, not on 101-108, so the bound is fragile; at lr 1e-4 it failed at R = 2 and R = 4 on both seed sets).
EPOCHS_SAFE_ITERATIONS, EPOCHS_SAFE_LR = 4, 3e-5


def check_loss_type(loss_type) -> None:
    """Refuse an unknown ``loss_type`` with the config, before a model loads (TRL would only fail in the trainer)."""
    if loss_type not in LOSS_TYPES:
        close = difflib.get_close_matches(str(loss_type), LOSS_TYPES, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"loss_type={loss_type!r} is not a registered loss{hint}: use one of {', '.join(LOSS_TYPES)}")


def _positive_int(name: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return value


@dataclass
@with_respo_constants  # respo_alpha_pos ... respo_lambda_neg, declared once (respo_trl.kernels.RESPO_CONSTANTS)
class ReSPOConfig(GRPOConfig):
    r"""
    Configuration for [`ReSPOTrainer`]: every [`~trl.GRPOConfig`] field, with ``loss_type="respo"`` as default, plus
    the fields below. Invalid values raise a ``ValueError`` that names the field at construction time.

    Parameters:
        > ReSPO kernel (arXiv:2609.35433). Per response, ``W`` is the sequence importance ratio pi_theta / pi_old (times
        > the sampler correction when one is on); ``phi0(W) = [(1 - beta) + beta W^(alpha-1)]^(1/(alpha-1))``,
        > ``phi(W) = phi0 exp(lambda (1 - phi0))``; one branch per advantage sign. Defaults are the paper's constants.

        respo_alpha_pos (`float`, defaults to `2.0`):
            Order ``alpha`` (> 0) of the power mean for ``A >= 0``. The paper's 2 gives ``phi0 = (1 + W)/2``.
        respo_beta_pos (`float`, defaults to `0.5`):
            Weight ``beta`` in [0, 1] of ``W`` in the power mean for ``A >= 0`` (0: ``phi = 1``; 1: ``phi0 = W``).
        respo_lambda_pos (`float`, defaults to `2.0`):
            Variance-control tilt ``lambda`` (>= 0) for ``A >= 0``; with (2, 0.5, 2) ``phi+(0) = e/2`` (low-weight
            correct responses keep, even slightly gain, their gradient) and ``phi+(W) -> 0`` for large ``W``.
        respo_alpha_neg (`float`, defaults to `1.0`):
            Order of the power mean for ``A < 0``; 1 is the limit ``phi0 = W^beta``.
        respo_beta_neg (`float`, defaults to `0.5`):
            Weight of ``W`` for ``A < 0``.
        respo_lambda_neg (`float`, defaults to `2.0`):
            Tilt for ``A < 0``; with (1, 0.5, 2) ``phi-`` is 0 at both tails and peaks at ``e/2`` at ``W = 1/4``.
        respo_pos_branch (`str`, defaults to `"respo"`):
            The ``A >= 0`` branch: ``"respo"`` (the paper's kernel above) or ``"vespo"`` (VESPO's gamma kernel
            ``W^k exp(lambda (1 - W))`` at ``vespo_k_pos`` / ``vespo_lambda_pos``). An ablation, not the paper's method.
        respo_neg_branch (`str`, defaults to `"respo"`):
            The ``A < 0`` branch, as ``respo_pos_branch`` (``"vespo"`` takes ``vespo_k_neg`` / ``vespo_lambda_neg``:
            TRL's ``W^3 exp(2 (1 - W))``, which damps stale negatives where the paper's branch keeps them near 1).
        respo_trust_mask (`str`, defaults to `"auto"`):
            Directional token trust mask: zero a token's gradient exactly where clipped PPO would (``A > 0`` and token
            ratio above ``1 + epsilon_high``, or ``A < 0`` and below ``1 - epsilon_low``), keeping ``phi``. ``"auto"``
            turns it on when samples are used more than once (``num_iterations > 1``) and off when each sample is used
            once (the paper's setting, paper-pure); ``"directional"`` always; ``"none"`` never. Not in the paper: see
            docs/method.md for the evidence behind ``"auto"``.
        respo_epoch_weight (`str`, defaults to `"current"`):
            Under epochs (``num_iterations > 1``), the ``W`` at which a sample's ``phi`` is evaluated on its later
            passes: ``"first_pass"`` keeps the ``W`` it had on its first pass (the staleness and sampler mismatch it
            arrived with; the movement the trainer makes on the batch itself is left to the trust mask),
            ``"current"`` takes the current policy's ``W``, ``"auto"`` is ``"first_pass"`` when ``num_iterations >
            1``. Each sample used once: the two are the same. A branch set to ``"vespo"`` keeps VESPO's own weight of the
            current policy. Not in the paper (docs/reuse.md).
        respo_trust_epsilon (`float`, *optional*):
            Lower token-ratio bound of the trust mask (``A < 0`` tokens below ``1 - respo_trust_epsilon`` are stopped).
            Unset: TRL's ``epsilon`` when ``importance_sampling_level="token"``; TRL's token default (0.2) when TRL's
            epsilons are sequence-level (a GSPO-style ``epsilon=3e-4`` would stop nearly every token).
        respo_trust_epsilon_high (`float`, *optional*):
            Upper token-ratio bound (``A > 0`` tokens above ``1 + respo_trust_epsilon_high`` are stopped). Unset:
            ``respo_trust_epsilon`` if set, else as above with TRL's ``epsilon_high``. TRL's two-sided ``delta`` also
            applies (``A < 0`` tokens above ``delta``) when TRL's epsilons are token-level.

        > Rollout reuse (docs/reuse.md maps these to the paper's N and to verl)

        respo_updates_per_rollout (`int`, *optional*):
            The paper's ``N``: optimizer updates fed by one rollout batch, each sample used once (mini-batch ``k`` is
            ``k`` updates stale). Sets ``steps_per_generation = N x gradient_accumulation_steps``; leave unset to use
            TRL's ``steps_per_generation`` / ``generation_batch_size`` directly.
        respo_reshuffle (`bool`, *optional*):
            Draw a new mini-batch composition on every reuse pass. Unset: on for ``loss_type="respo"``, off for TRL's
            losses (TRL replays the same mini-batches, and a baseline must train exactly as TRL trains it).
        respo_min_ess (`float`, *optional*):
            Refresh floor in (0, 1] on the normalised Kish ESS of the raw sequence weights ``W`` under the current
            policy, measured where rollouts are stale: before each reuse pass (epochs, the whole batch) and, under the
            paper's ``N``, before each optimizer step inside a pass (that step's mini-batch); one extra no-grad forward
            per check. Below the floor fresh completions are sampled for the same prompts and serve the rest of the
            cycle.
        respo_adaptive_reuse (`str`, *optional*):
            Reuse that adapts to the learning rate: under epochs (``num_iterations = R > 1``), before each reuse pass
            the trainer measures how far the policy has moved from the one that sampled the batch (one no-grad
            forward over the batch) and, past ``respo_adaptive_threshold``, drops the batch's remaining passes and
            samples a fresh batch on new prompts (the prompt sampler moves on after every pass), which may again
            serve up to ``R`` passes. ``"kl"``: the mean per-token
            KL(pi_old || pi_theta) above the threshold (PPO's ``target_kl`` early stop, whose ``1.5 x target_kl`` is
            the threshold here); ``"ess"``: the normalised ESS of the policy ratios ``pi_theta / pi_old`` of the
            sequences below it (vLLM's sampler correction left out: it is there on the fresh pass already). Every
            ``loss_type``; needs ``max_steps`` and a map-style dataset. Unset: every batch serves ``R`` passes, as in
            TRL. Logged: ``reuse/kl_before_pass``, ``reuse/policy_ess_before_pass``, ``reuse/ess_before_pass``,
            ``reuse/refreshes``, ``reuse/pass`` (docs/reuse.md). Measured on the tiny model (``"kl"``, 5e-4, 8
            seeds): at lr 3e-5 its median saving of generated tokens equals fixed ``R = 4``'s; at 1e-4 its mean final
            accuracy is about 2 points below ``R = 1``'s where fixed ``R = 4``'s is about 20 below, but it failed the
            pre-registered safety rule at 1e-4, so it is not a default; its reuse steps took about 1.3x fixed
            ``R = 4``'s there (docs/benchmarks/adaptive_reuse.md).
        respo_adaptive_threshold (`float`, *optional*):
            The drift at which ``respo_adaptive_reuse`` stops a batch: a KL in nats per token (> 0) or an ESS in
            (0, 1). 5e-4 is the measured ``"kl"`` value (chosen on the tiny model; none is a default).
        respo_buffer_device (`str`, defaults to `"auto"`):
            ``"auto"`` keeps buffered rollouts on the training device; ``"cpu"`` parks them in host memory.
        respo_whole_groups (`bool`, defaults to `False`):
            Cut each rollout batch into mini-batches of whole GRPO groups (all ``num_generations`` completions of a
            prompt in the same optimizer step), the groups shuffled with a generator seeded by ``seed``, the
            generation and the pass; every loss type. Off: TRL's row shuffle, which spreads a group over up to
            ``num_generations`` updates at different staleness. Needs ``per_device_train_batch_size`` to be a
            multiple of ``num_generations``. Off by default on the evidence: at ``N = 32`` whole groups gained no
            kernel anything measurable (docs/benchmarks/regime_mechanism.md 5.6, H3); docs/reuse.md says what the paper's verl
            runs did.

        > Diagnostics

        respo_log_diagnostics (`bool`, defaults to `True`):
            Log the starvation, off-policy and positive-branch metrics (``starvation/*``, ``offpolicy/*``,
            ``respo/*``) on every step, for every ``loss_type``; the reuse metrics (``reuse/*``) are always logged.

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
            "help": "Policy loss. 'respo' (default) is ReSPO's two-branch sequence kernel; every TRL loss type "
            "('dapo', 'grpo', 'bnpo', 'dr_grpo', 'cispo', 'sapo', 'luspo', 'vespo') runs exactly as in TRL."
        },
    )
    respo_pos_branch: str = field(
        default="respo",
        metadata={
            "help": "Kernel of the A >= 0 branch: 'respo' (the paper's) or 'vespo' (VESPO's gamma kernel at "
            "vespo_k_pos / vespo_lambda_pos; an ablation).",
            "choices": list(BRANCH_KINDS),
        },
    )
    respo_neg_branch: str = field(
        default="respo",
        metadata={
            "help": "Kernel of the A < 0 branch: 'respo' (the paper's) or 'vespo' (VESPO's gamma kernel at "
            "vespo_k_neg / vespo_lambda_neg; an ablation).",
            "choices": list(BRANCH_KINDS),
        },
    )
    respo_trust_mask: str = field(
        default="auto",
        metadata={
            "help": "Directional token trust mask (zero a token's gradient where clipped PPO would, keep phi): "
            "'auto' (on when num_iterations > 1, off when each sample is used once), 'directional' or 'none'.",
            "choices": list(TRUST_MASK_MODES),
        },
    )
    respo_epoch_weight: str = field(
        default="current",
        metadata={
            "help": "Under epochs (num_iterations > 1): the W a sample's phi is evaluated at on its later passes. "
            "'first_pass': the W it had on its first pass (its staleness and sampler mismatch; the trainer's own "
            "movement on the batch is left to the trust mask); 'current': the W of the current policy; 'auto': "
            "first_pass when num_iterations > 1.",
            "choices": list(EPOCH_WEIGHT_MODES),
        },
    )
    resume_from_checkpoint: str | None = field(
        default=None,
        metadata={
            "help": "Resume training: 'true' takes the latest complete checkpoint-N in output_dir (interrupted saves "
            "are skipped), or give a checkpoint folder. The rollout-reuse buffer is restored with it."
        },
    )
    respo_trust_epsilon: float | None = field(
        default=None,
        metadata={
            "help": "Trust mask: lower token-ratio bound (stop A < 0 tokens below 1 - this). Unset: TRL's epsilon at "
            "token level, TRL's token default 0.2 when the epsilons are sequence-level (GSPO-style)."
        },
    )
    respo_trust_epsilon_high: float | None = field(
        default=None,
        metadata={
            "help": "Trust mask: upper token-ratio bound (stop A > 0 tokens above 1 + this). Unset: "
            "respo_trust_epsilon if set, else TRL's epsilon_high at token level, 0.2 when sequence-level."
        },
    )
    respo_updates_per_rollout: int | None = field(
        default=None,
        metadata={
            "help": "The paper's N: optimizer updates per rollout batch, each sample used once. Sets "
            "steps_per_generation = N x gradient_accumulation_steps."
        },
    )
    respo_reshuffle: bool | None = field(
        default=None,
        metadata={
            "help": "Reshuffle mini-batches on every reuse pass. Unset: on for loss_type='respo', off for TRL's "
            "losses (TRL's own order)."
        },
    )
    respo_min_ess: float | None = field(
        default=None,
        metadata={
            "help": "Optional ESS floor in (0, 1]: stale rollouts (before a reuse pass, and under staleness N before "
            "each optimizer step) whose normalised ESS of W under the current policy falls below it are refreshed "
            "with new completions for the same prompts."
        },
    )
    respo_adaptive_reuse: str | None = field(
        default=None,
        metadata={
            "help": "Under epochs (num_iterations > 1): stop serving a batch and sample afresh once the policy has "
            "drifted past respo_adaptive_threshold, measured before each reuse pass: 'kl' (mean per-token KL from "
            "the sampling policy above it, PPO's target_kl early stop) or 'ess' (ESS of the policy's own sequence "
            "ratios pi_theta/pi_old below it). Unset: every batch serves num_iterations passes. Measured on the tiny "
            "model, not a default: it failed its pre-registered safety rule at lr 1e-4 (docs/benchmarks/adaptive_reuse.md)."
        },
    )
    respo_adaptive_threshold: float | None = field(
        default=None,
        metadata={"help": "respo_adaptive_reuse's stop: a per-token KL in nats (> 0) or an ESS in (0, 1); 5e-4 is the "
                  "measured 'kl' value (tiny model)."},
    )
    respo_buffer_device: str = field(
        default="auto",
        metadata={"help": "Where buffered rollouts live between passes: 'auto' (training device) or 'cpu'."},
    )
    respo_whole_groups: bool = field(
        default=False,
        metadata={
            "help": "Cut rollout batches into mini-batches of whole GRPO groups (shuffled by group, seeded) instead of "
            "TRL's row shuffle; needs per_device_train_batch_size to be a multiple of num_generations."
        },
    )
    respo_log_diagnostics: bool = field(
        default=True,
        metadata={"help": "Log the starvation/off-policy/positive-branch diagnostics on every step."},
    )

    respo_routing_replay: bool = field(
        default=False,
        metadata={
            "help": "Routing Replay (R3) for Qwen3-MoE: replay the experts chosen at generation time in every "
            "log-prob forward (needs use_vllm=False; see docs/moe.md)."
        },
    )

    def __new__(cls, *args, **kwargs):
        # A renamed field (respo_trl._compat) is refused with its new name before the dataclass's __init__ would
        # refuse it as an "unexpected keyword argument".
        refuse_renamed(kwargs, RENAMED_OPTIONS)
        return super().__new__(cls)

    def __post_init__(self):
        # ReSPO's own checks first: a bad ReSPO value is reported even where TRL/transformers would fail first on
        # something else (e.g. bf16 on a CPU).
        check_loss_type(self.loss_type)
        self._apply_updates_per_rollout()
        self.validate_respo()
        super().__post_init__()
        self.check_adaptive_batching()  # needs TRL's resolved steps_per_generation

    def _apply_updates_per_rollout(self) -> None:
        n = self.respo_updates_per_rollout
        if n is None:
            return
        _positive_int("respo_updates_per_rollout", n)
        steps = steps_from_updates(n, self.gradient_accumulation_steps)  # the one conversion (batching.py)
        if self.generation_batch_size is not None:
            raise ValueError(
                f"respo_updates_per_rollout={n} and generation_batch_size={self.generation_batch_size} both size the "
                "rollout batch: set only one of them."
            )
        if self.steps_per_generation is not None and self.steps_per_generation != steps:
            raise ValueError(
                f"respo_updates_per_rollout={n} means steps_per_generation = {n} x gradient_accumulation_steps "
                f"({self.gradient_accumulation_steps}) = {steps}, but steps_per_generation={self.steps_per_generation}"
                " was also set: set only one of them."
            )
        self.steps_per_generation = steps

    def validate_respo(self) -> None:
        """Check the ReSPO fields (also used when a plain ``GRPOConfig`` is upgraded)."""
        for name, arg in CONSTANT_KEYS.items():
            setattr(self, name, check_constant(name, getattr(self, name), arg.split("_")[0]))
        for name in ("respo_pos_branch", "respo_neg_branch"):
            if getattr(self, name) not in BRANCH_KINDS:
                raise ValueError(f"{name} must be one of {BRANCH_KINDS}, got {getattr(self, name)!r}")
        if not isinstance(self.respo_whole_groups, bool):
            raise ValueError(f"respo_whole_groups must be True or False, got {self.respo_whole_groups!r}")
        if self.respo_whole_groups and self.per_device_train_batch_size % self.num_generations:
            raise ValueError(
                f"respo_whole_groups=True needs per_device_train_batch_size ({self.per_device_train_batch_size}) to be "
                f"a multiple of num_generations ({self.num_generations}): each micro-batch holds whole groups"
            )
        if self.respo_trust_mask not in TRUST_MASK_MODES:
            raise ValueError(f"respo_trust_mask must be one of {TRUST_MASK_MODES}, got {self.respo_trust_mask!r}")
        if self.respo_epoch_weight not in EPOCH_WEIGHT_MODES:
            raise ValueError(f"respo_epoch_weight must be one of {EPOCH_WEIGHT_MODES}, got {self.respo_epoch_weight!r}")
        for name in ("respo_trust_epsilon", "respo_trust_epsilon_high"):
            value = getattr(self, name)
            upper = 1.0 if name == "respo_trust_epsilon" else math.inf
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not 0.0 < value < upper):  # fmt: skip
                raise ValueError(f"{name} must be in (0, {upper:g}) or unset, got {value!r}")
        _positive_int("num_iterations", self.num_iterations)
        if self.respo_min_ess is not None and not (
            isinstance(self.respo_min_ess, (int, float)) and 0.0 < self.respo_min_ess <= 1.0
        ):
            raise ValueError(f"respo_min_ess must be in (0, 1] or None, got {self.respo_min_ess!r}")
        self._validate_adaptive()
        if self.respo_buffer_device not in ("auto", "cpu"):
            raise ValueError(f"respo_buffer_device must be 'auto' or 'cpu', got {self.respo_buffer_device!r}")
        if self.respo_routing_replay and config_problems(self):
            raise ValueError("respo_routing_replay=True: " + "; ".join(config_problems(self)))
        if self.respo_reshuffle is not None and not isinstance(self.respo_reshuffle, bool):
            raise ValueError(f"respo_reshuffle must be True, False or unset, got {self.respo_reshuffle!r}")
        bound = epochs_bound_warning(self)
        if bound:  # the same text warns once per process (Python's default warning filter)
            warnings.warn(bound, UserWarning, stacklevel=4)

    def _validate_adaptive(self) -> None:
        """``respo_adaptive_reuse`` and its threshold: one line naming what to change."""
        signal, threshold = self.respo_adaptive_reuse, self.respo_adaptive_threshold
        if signal is None:
            if threshold is not None:
                raise ValueError(
                    f"respo_adaptive_threshold={threshold!r} needs respo_adaptive_reuse ('kl' or 'ess'): set it, or "
                    "unset the threshold"
                )
            return
        if signal not in ADAPTIVE_SIGNALS:
            raise ValueError(f"respo_adaptive_reuse must be one of {ADAPTIVE_SIGNALS} or unset, got {signal!r}")
        if self.num_iterations == 1:
            raise ValueError(
                f"respo_adaptive_reuse={signal!r} cuts a batch's epochs short, but num_iterations=1 uses each sample "
                "once: set num_iterations > 1 (e.g. 4), or unset respo_adaptive_reuse"
            )
        if self.respo_min_ess is not None:
            raise ValueError(
                f"respo_adaptive_reuse={signal!r} and respo_min_ess={self.respo_min_ess} both resample stale "
                "batches: keep one of them"
            )
        if threshold is None:
            raise ValueError(
                f"respo_adaptive_reuse={signal!r} needs respo_adaptive_threshold (a per-token KL > 0 for 'kl', an "
                "ESS in (0, 1) for 'ess')"
            )
        ok = isinstance(threshold, (int, float)) and not isinstance(threshold, bool) and math.isfinite(threshold)
        ok = ok and (threshold > 0 if signal == "kl" else 0 < threshold < 1)
        if not ok:
            domain = "a per-token KL > 0 (e.g. 1e-3)" if signal == "kl" else "an ESS in (0, 1) (e.g. 0.95)"
            raise ValueError(f"respo_adaptive_threshold for respo_adaptive_reuse={signal!r} must be {domain}, got {threshold!r}")

    def check_adaptive_batching(self) -> None:
        """Once the batch fields are resolved: adaptive reuse is for epochs over rollout batches used within one
        optimizer step per pass; under the paper's staleness ``N`` (several optimizer steps per pass) it is refused."""
        if self.respo_adaptive_reuse is None or self.steps_per_generation is None:
            return
        if self.steps_per_generation > self.gradient_accumulation_steps:
            updates = self.steps_per_generation // self.gradient_accumulation_steps
            raise ValueError(
                f"respo_adaptive_reuse={self.respo_adaptive_reuse!r} was measured for epochs only, but this config "
                f"also reuses by staleness (steps_per_generation={self.steps_per_generation} = {updates} optimizer "
                "steps per pass): set respo_updates_per_rollout=1 (steps_per_generation = "
                "gradient_accumulation_steps), or unset respo_adaptive_reuse (respo_min_ess refreshes under staleness)"
            )
        if self.max_steps is None or self.max_steps <= 0:  # an epoch of the prompts is not TRL's under adaptive reuse
            raise ValueError(
                f"respo_adaptive_reuse={self.respo_adaptive_reuse!r} moves the prompt sampler on after every pass, so "
                "num_train_epochs would give about num_iterations times fewer updates than TRL's epochs: set max_steps"
            )

    # -- resolved settings (what the trainer uses) --------------------------------------------------------------------

    @property
    def respo_adaptive_threshold_active(self) -> float | None:
        """The stop threshold of ``respo_adaptive_reuse`` (None when reuse is fixed)."""
        return None if self.respo_adaptive_reuse is None else float(self.respo_adaptive_threshold)

    @property
    def respo_trust_mask_active(self) -> bool:
        """Whether the directional token trust mask is on: ``"auto"`` resolves to on iff ``num_iterations > 1``."""
        if self.respo_trust_mask == "auto":
            return self.num_iterations > 1
        return self.respo_trust_mask == "directional"

    @property
    def respo_first_pass_weight(self) -> bool:
        """Whether ReSPO keeps each sample's first-pass ``W`` for its later passes (``respo_epoch_weight``; ``"auto"``
        resolves to on iff ``num_iterations > 1``). Each sample used once: the two are the same."""
        if self.loss_type != "respo" or self.num_iterations == 1:
            return False
        return self.respo_epoch_weight in ("auto", "first_pass")

    @property
    def respo_trust_bounds(self) -> tuple[float, float, float]:
        """``(epsilon_low, epsilon_high, delta)`` of the trust mask on *token* ratios (``delta = inf``: no cap).

        TRL's ``epsilon``/``epsilon_high``/``delta`` are reused only when they are token-level bounds; GSPO-style
        sequence-level epsilons (3e-4 / 4e-4) would stop 74-98% of the tokens on reuse passes, so the mask then
        falls back to TRL's token default. ``respo_trust_epsilon(_high)`` override either way."""
        token_level = self.importance_sampling_level == "token"
        low = self.epsilon if token_level else TRL_TOKEN_EPSILON
        high = (self.epsilon_high if self.epsilon_high is not None else self.epsilon) if token_level else TRL_TOKEN_EPSILON
        if self.respo_trust_epsilon is not None:
            low = high = self.respo_trust_epsilon
        if self.respo_trust_epsilon_high is not None:
            high = self.respo_trust_epsilon_high
        delta = self.delta if token_level and self.delta is not None else math.inf
        return float(low), float(high), float(delta)

    @property
    def respo_reshuffle_active(self) -> bool:
        """Whether reuse passes draw new mini-batches: unset resolves to on for ReSPO only (TRL replays its order)."""
        if self.respo_reshuffle is None:
            return self.loss_type == "respo"
        return self.respo_reshuffle

    @property
    def kernel_constants(self) -> dict[str, float]:
        """The six kernel constants under :func:`respo_trl.kernels.respo_kernel`'s argument names."""
        return {arg: getattr(self, name) for name, arg in CONSTANT_KEYS.items()}

    @classmethod
    def from_grpo_config(cls, args: GRPOConfig, **overrides) -> "ReSPOConfig":
        """Upgrade an already-built ``GRPOConfig`` to a ``ReSPOConfig`` training ReSPO (``loss_type='respo'``).

        ``GRPOConfig.__post_init__`` has already resolved derived fields (batch arithmetic, distributed state), so
        re-running it would reject them; the values are copied as they are and only the ReSPO checks run. Nothing
        TRL accepts is refused: see :func:`respo_notes` for what ReSPO does with TRL's importance-sampling settings.
        """
        refuse_renamed(overrides, RENAMED_OPTIONS)
        upgraded = cls.__new__(cls)
        upgraded.__dict__.update(args.__dict__)  # ReSPO's own fields keep their class defaults (no default_factory)
        upgraded.loss_type = "respo"
        upgraded.__dict__.update(overrides)
        upgraded.validate_respo()
        upgraded.check_adaptive_batching()
        return upgraded


def describe_kernel(args: ReSPOConfig) -> str:
    """One line naming the kernel constants (on the raw sequence ratio ``W``) and the trust mask in use."""
    c = args.kernel_constants
    paper = all(c[k] == RESPO_DEFAULTS[k] for k in c)
    if args.respo_trust_mask_active:
        low, high, delta = args.respo_trust_bounds
        cap = "" if delta == math.inf else f", A < 0 above {delta:g}"
        mask = f"directional token trust mask ON (token ratio bounds [1 - {low:g}, 1 + {high:g}]{cap})"
    else:
        mask = "no token trust mask"
    branches = []
    for sign, kind, k, lam in (("pos", args.respo_pos_branch, args.vespo_k_pos, args.vespo_lambda_pos),
                               ("neg", args.respo_neg_branch, args.vespo_k_neg, args.vespo_lambda_neg)):  # fmt: skip
        if kind == "vespo":
            branches.append(f"{sign}=VESPO's W^{k:g} exp({lam:g} (1 - W))")
        else:
            branches.append(f"{sign}=({c[f'alpha_{sign}']:g}, {c[f'beta_{sign}']:g}, {c[f'lam_{sign}']:g})")
    paper = paper and args.respo_pos_branch == args.respo_neg_branch == "respo"
    groups = "; mini-batches of whole groups" if args.respo_whole_groups else ""
    return (
        f"ReSPO kernel (alpha, beta, lambda) {' '.join(branches)} on the raw sequence ratio W"
        f"{' (the paper)' if paper else ''}; {mask} (respo_trust_mask={args.respo_trust_mask!r}, "
        f"num_iterations={args.num_iterations}){groups}"
        + ("; on a sample's later passes phi keeps its first-pass W (respo_epoch_weight)" if args.respo_first_pass_weight else "")
    )


# What respo_adaptive_reuse was measured to do (docs/benchmarks/adaptive_reuse.md 4.2: the tiny model, num_iterations
# = 4, "kl" 5e-4, 8 seeds), for the epochs warning to name when the option is on: it saved at lr 3e-5 and was not safe
# at 1e-4 by the pre-registered rule (paired 95% lower ends below its -3-point bar).
ADAPTIVE_MEASURED = (
    "respo_adaptive_reuse was measured (the tiny model, num_iterations=4, 'kl' 5e-4, 8 seeds; "
    "docs/benchmarks/adaptive_reuse.md) to save at learning_rate 3e-5 (a median 0.19 of num_iterations=1's generated "
    "tokens to reach its mean final accuracy minus 2 points) but not to be safe at 1e-4: mean final 1.8 (dapo) and "
    "2.5 points (respo) below num_iterations=1's, paired 95% lower ends -4.7 and -5.4 against the rule's -3, so it "
    "is not shown to make this setting safe"
)


def epochs_bound_warning(args) -> str | None:
    """One line when ReSPO runs epochs outside the setting where they were measured safe (``None`` inside it); with
    ``respo_adaptive_reuse`` on, it also says what that option was measured to do."""
    if args.loss_type != "respo" or args.num_iterations == 1 or not isinstance(args.learning_rate, (int, float)):
        return None  # a learning rate that is not a number is TRL's to refuse
    if args.num_iterations <= EPOCHS_SAFE_ITERATIONS and args.learning_rate <= EPOCHS_SAFE_LR:
        return None
    adaptive = f"; {ADAPTIVE_MEASURED}" if args.respo_adaptive_reuse is not None else ""
    return (
        f"ReSPO with num_iterations={args.num_iterations} at learning_rate={args.learning_rate:g} is outside "
        f"num_iterations <= {EPOCHS_SAFE_ITERATIONS} at learning_rate <= {EPOCHS_SAFE_LR:g}: epochs were measured safe "
        f"for ReSPO at one point only (num_iterations={EPOCHS_SAFE_ITERATIONS}, learning_rate={EPOCHS_SAFE_LR:g}, "
        f"the tiny model, on one seed set of two), and at 1e-4 every loss fell on some seeds{adaptive}: lower "
        "learning_rate, or reuse by staleness instead (num_iterations=1, respo_updates_per_rollout=N); see "
        "docs/reuse.md"
    )


def respo_notes(args: ReSPOConfig) -> list[str]:
    """What ReSPO does with TRL settings it reinterprets, one line each (empty for TRL's own losses)."""
    if args.loss_type != "respo":
        return []
    notes = []
    if args.respo_trust_mask_active and args.importance_sampling_level != "token" and args.respo_trust_epsilon is None:
        low, high, _ = args.respo_trust_bounds
        seq_high = args.epsilon if args.epsilon_high is None else args.epsilon_high  # TRL: unset high = epsilon
        notes.append(
            f"the token trust mask uses token-ratio bounds {low:g} / {high:g} (TRL's token default), not the "
            f"sequence-level epsilon {args.epsilon:g} / {seq_high:g} of this config; set "
            "respo_trust_epsilon / respo_trust_epsilon_high to choose them."
        )
    if args.importance_sampling_level != "token":
        notes.append(
            f"importance_sampling_level={args.importance_sampling_level!r} does not apply to loss_type='respo': "
            "ReSPO uses the raw sequence ratio W, as the paper does (no length normalisation). For GSPO itself use "
            "loss_type='grpo' with importance_sampling_level='sequence'."
        )
    if args.use_vllm and args.vllm_importance_sampling_correction:
        mode = args.vllm_importance_sampling_mode
        bounds = f"[{args.vllm_importance_sampling_clip_min}, {args.vllm_importance_sampling_clip_max}]"
        action = {
            "token_truncate": f"each token's ratio pi_old/pi_vllm, truncated to {bounds}, is multiplied into W",
            "token_mask": f"tokens whose ratio pi_old/pi_vllm leaves {bounds} are dropped (no gradient, not in W); "
            "the others' ratios are multiplied into W",
            "sequence_truncate": f"the sequence ratio pi_old/pi_vllm, truncated to {bounds}, is multiplied into W",
            "sequence_mask": f"sequences whose ratio pi_old/pi_vllm leaves {bounds} are dropped (phi = 0); the "
            "others' ratios are multiplied into W",
        }.get(mode, f"TRL does not know this mode (expected one of {SAMPLER_MODES})")
        notes.append(
            f"vllm_importance_sampling_mode={mode!r}: {action}, so phi sees pi_theta/pi_vllm; the loss is not "
            "multiplied by the ratio again."
        )
    return notes
