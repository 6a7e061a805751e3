"""ReSPO's math as pure torch functions, and the policy losses it is compared with.

Nothing here imports TRL: the functions take tensors and numbers and can be used from any RL framework or notebook
(the verl plugin in :mod:`respo_trl.integrations.verl` calls the same functions). Symbols follow ``docs/method.md``:

* ``r_it = pi_theta(y_it) / pi_old(y_it)``                       token ratio against the policy that sampled
* ``l_i = sum_t m_it log r_it (+ sum_t m_it log c_it)``          sequence log-weight; ``c`` is a sampler correction
* ``log W_i = clamp(l_i, -20, 20)``                              the raw sequence ratio: no length normalisation
* ``phi0(W) = [(1 - beta) + beta W^(alpha-1)]^(1/(alpha-1))``    power mean of 1 and ``W`` (``W^beta`` at alpha = 1)
* ``phi(W) = phi0(W) exp(lam (1 - phi0(W)))``                     variance-control tilt; branch by the sign of ``A``

Every policy loss in :data:`POLICY_LOSSES` returns a per-token loss ``ell_it`` with the convention

    d (sum_t m_it ell_it) / d log pi_theta(y_it) = -A_i * c_it,     c_it = 1 on-policy,

so ``c_it`` is the loss's *effective coefficient* on ``A_i * grad log pi_theta(y_it)`` relative to the plain policy
gradient. :func:`gradient_coefficients` recovers ``c`` from any registered loss by autograd; the starvation
diagnostics are built on it. Trainers apply their own aggregation (TRL ``dapo`` / verl ``token-mean``: a token sum
over the global token count) on top of these per-token losses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Callable, NamedTuple

import torch

from ._compat import REMOVED_NAMES, renamed_message

Tensor = torch.Tensor

LOG_W_CLAMP = 20.0  # |log W| is clamped here (spec section 2; the authors' code clamps the same)

# The paper's six kernel constants, declared here once for every config that carries them (ReSPOConfig,
# AsyncReSPOConfig, LossParams and verl's ReSPOPolicyLossConfig, through :func:`with_respo_constants`), under their
# one spelling (the configs' field and verl's ``policy_loss`` key), with the default every reported run used
# (positive (2, 0.5, 2), negative (1, 0.5, 2)) and the help the command line prints.
RESPO_CONSTANTS = {
    "respo_alpha_pos": (2.0, "Power-mean order alpha (> 0) of the positive-advantage branch (paper: 2)."),
    "respo_beta_pos": (0.5, "Power-mean weight beta in [0, 1] of the positive-advantage branch (paper: 0.5)."),
    "respo_lambda_pos": (2.0, "Variance-control tilt lambda (>= 0) of the positive-advantage branch (paper: 2)."),
    "respo_alpha_neg": (1.0, "Power-mean order alpha (> 0) of the negative-advantage branch (paper: 1, i.e. W^beta)."),
    "respo_beta_neg": (0.5, "Power-mean weight beta in [0, 1] of the negative-advantage branch (paper: 0.5)."),
    "respo_lambda_neg": (2.0, "Variance-control tilt lambda (>= 0) of the negative-advantage branch (paper: 2)."),
}
# Config name -> the kernel's argument (:func:`respo_kernel`); the part before "_" is the kind :func:`check_constant`
# checks.
CONSTANT_KEYS = {name: name.removeprefix("respo_").replace("lambda_", "lam_") for name in RESPO_CONSTANTS}
RESPO_DEFAULTS = {arg: RESPO_CONSTANTS[name][0] for name, arg in CONSTANT_KEYS.items()}  # under the kernel's names
# What each branch of the two-branch kernel can be: the paper's power mean with its tilt ("respo", the default), or
# VESPO's gamma kernel ``W^k exp(lam (1 - W))`` with the ``vespo_*`` constants ("vespo"). The second exists to take
# the two kernels apart one branch at a time (docs/benchmarks/regime_mechanism.md 5.5); it is not the paper's method.
BRANCH_KINDS = ("respo", "vespo")


# --------------------------------------------------------------------------------------------------------------------
# Constants
# --------------------------------------------------------------------------------------------------------------------


def check_constant(name: str, value, kind: str) -> float:
    """Validate one kernel constant; ``kind`` is ``alpha`` (> 0), ``beta`` (in [0, 1]) or ``lam`` (>= 0).

    Raises a ``ValueError`` that names ``name`` (the caller's field name) and the allowed range.
    """
    domains = {"alpha": ("> 0", lambda v: v > 0), "beta": ("in [0, 1]", lambda v: 0 <= v <= 1), "lam": (">= 0", lambda v: v >= 0)}
    text, ok = domains[kind]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not ok(value):
        raise ValueError(f"{name} must be a finite number {text}, got {value!r}")
    return float(value)


def validate_respo_constants(**constants) -> dict[str, float]:
    """Check ``alpha_pos, beta_pos, lam_pos, alpha_neg, beta_neg, lam_neg`` (any subset); returns them as floats."""
    unknown = set(constants) - set(RESPO_DEFAULTS)
    if unknown:
        raise ValueError(f"unknown ReSPO constant(s) {sorted(unknown)}; expected some of {list(RESPO_DEFAULTS)}")
    return {name: check_constant(name, value, name.split("_")[0]) for name, value in constants.items()}


# --------------------------------------------------------------------------------------------------------------------
# Sequence log-weights
# --------------------------------------------------------------------------------------------------------------------


def fold_sampler_ratio(sampler_ratio: Tensor | None, mask: Tensor) -> tuple[Tensor | None, Tensor]:
    """Turn a sampler-correction ratio ``c = pi_old / pi_sampler`` into ``(log c, kept mask)``.

    ``sampler_ratio`` is TRL's vLLM ``importance_sampling_ratio`` after its truncation or masking: (B, T) in the token
    modes, (B, 1) in the sequence modes, or verl's token-level ``rollout_is_weights`` (B, T) (the verl plugin reads
    verl's broadcast sequence-level layout itself, adding it once). A ratio of exactly 0 means "masked
    by the correction": in a token mode that token is dropped (no gradient, not in ``l``); in a sequence mode the
    whole sequence is dropped. The returned mask is ``mask`` with those tokens removed; ``log c`` is 0 where dropped.
    """
    mask = mask.bool()
    if sampler_ratio is None:
        return None, mask
    ratio = sampler_ratio.detach().float()
    kept = ratio > 0
    mask = mask & kept  # (B, 1) broadcasts over the row: a masked sequence loses every token
    log_c = torch.where(kept, torch.log(ratio.clamp(min=torch.finfo(torch.float32).tiny)), 0.0)
    return log_c, mask


def sequence_log_weight(log_ratio: Tensor, mask: Tensor, log_sampler_ratio: Tensor | None = None) -> Tensor:
    """``l_i = sum_t m_it log r_it (+ sampler correction)``, clamped to [-20, 20]; shape (B,), detached.

    ``log_sampler_ratio`` of shape (B, T) is added token by token inside the mask; of shape (B, 1) (a sequence-level
    correction) it is added once. Masked positions never contribute, even when they hold NaN or inf. An unmasked NaN
    keeps ``l_i`` NaN, so the kernel gives that sequence ``phi = 0`` (never full weight); ``+-inf`` clamp to +-20.
    """
    with torch.no_grad():
        mask = mask.bool()
        rho = torch.where(mask, log_ratio.detach().float(), 0.0)
        l = rho.sum(-1)
        if log_sampler_ratio is not None:
            log_c = log_sampler_ratio.detach().float()
            if log_c.shape[-1] == 1 and mask.shape[-1] != 1:
                l = l + log_c.squeeze(-1)
            else:
                l = l + torch.where(mask, log_c, 0.0).sum(-1)
        return l.clamp(-LOG_W_CLAMP, LOG_W_CLAMP)


# --------------------------------------------------------------------------------------------------------------------
# The two-branch kernel
# --------------------------------------------------------------------------------------------------------------------


def log_power_mean(log_w: Tensor, alpha: float, beta: float) -> Tensor:
    """``log phi0(W) = log([(1 - beta) + beta W^(alpha-1)]^(1/(alpha-1)))``, ``log(W^beta)`` at ``alpha = 1``.

    With ``x = (alpha - 1) log W``: ``log phi0 = log(1 + beta expm1(x)) / (alpha - 1)`` for ``|x| <= 1`` (accurate as
    ``alpha -> 1``, where it tends to ``beta log W``: the function is continuous in ``alpha``) and
    ``logaddexp(log(1 - beta), log beta + x) / (alpha - 1)`` beyond (no overflow for large ``|x|``).
    """
    if alpha == 1.0:
        return beta * log_w
    x = (alpha - 1.0) * log_w
    near = torch.log1p(beta * torch.expm1(x.clamp(-1.0, 1.0)))
    log_1mb = math.log(1.0 - beta) if beta < 1.0 else -math.inf
    log_b = math.log(beta) if beta > 0.0 else -math.inf
    far = torch.logaddexp(torch.full_like(x, log_1mb), log_b + x)
    return torch.where(x.abs() <= 1.0, near, far) / (alpha - 1.0)


def branch_phi(log_w: Tensor, alpha: float, beta: float, lam: float) -> Tensor:
    """One branch: ``phi = phi0 exp(lam (1 - phi0))``, computed as ``exp(log phi0 + lam (1 - phi0))``."""
    log_phi0 = log_power_mean(log_w, alpha, beta)
    return torch.exp(log_phi0 + lam * (1.0 - torch.exp(log_phi0)))


def respo_kernel(
    log_w: Tensor,
    advantages: Tensor,
    alpha_pos: float = RESPO_DEFAULTS["alpha_pos"],
    beta_pos: float = RESPO_DEFAULTS["beta_pos"],
    lam_pos: float = RESPO_DEFAULTS["lam_pos"],
    alpha_neg: float = RESPO_DEFAULTS["alpha_neg"],
    beta_neg: float = RESPO_DEFAULTS["beta_neg"],
    lam_neg: float = RESPO_DEFAULTS["lam_neg"],
) -> Tensor:
    """ReSPO's detached coefficient ``phi_i`` (same shape as ``log_w``), branch ``A >= 0`` / ``A < 0``.

    ``log_w`` is the sequence log-weight ``log W_i`` (clamped to [-20, 20] here too) and ``advantages`` must have the
    same shape (one advantage per entry: for per-token advantages expand ``log_w`` to (B, T) first). ``phi`` is finite
    for every input: ``log W = +-inf`` gives the tail limits, NaN gives 0. The defaults are the paper's constants:
    ``phi+(W) = (1 + W)/2 exp(1 - W)`` and ``phi-(W) = sqrt(W) exp(2 (1 - sqrt(W)))``.

    Computed in the input's precision, at least float32 (float64 inputs stay float64): ``log W`` is clamped to +-20,
    so float32 is accurate to ~1e-6 relative, and MPS and some accelerators have no float64.
    """
    c = validate_respo_constants(
        alpha_pos=alpha_pos, beta_pos=beta_pos, lam_pos=lam_pos, alpha_neg=alpha_neg, beta_neg=beta_neg, lam_neg=lam_neg
    )
    if log_w.shape != advantages.shape:
        raise ValueError(
            f"log_w {tuple(log_w.shape)} and advantages {tuple(advantages.shape)} must have the same shape "
            "(one advantage per sequence weight); reshape them explicitly"
        )
    with torch.no_grad():
        out_dtype = torch.promote_types(log_w.dtype, torch.float32)
        s = log_w.detach().to(out_dtype).clamp(-LOG_W_CLAMP, LOG_W_CLAMP)
        phi_pos = branch_phi(s, c["alpha_pos"], c["beta_pos"], c["lam_pos"])
        phi_neg = branch_phi(s, c["alpha_neg"], c["beta_neg"], c["lam_neg"])
        phi = torch.where(advantages.detach().to(s.device) >= 0, phi_pos, phi_neg)
        return phi.nan_to_num(0.0, posinf=0.0, neginf=0.0).to(out_dtype)


def gamma_kernel(log_w: Tensor, advantages: Tensor, k_pos: float, lam_pos: float, k_neg: float, lam_neg: float) -> Tensor:
    """VESPO's weight as TRL 1.16 computes it: ``phi(W) = W^k exp(lam (1 - W))`` per sign (detached, float32)."""
    with torch.no_grad():
        positive = advantages >= 0
        k = torch.where(positive, k_pos, k_neg)
        lam = torch.where(positive, lam_pos, lam_neg).clamp(min=1e-4)
        s = log_w.float()
        return torch.exp(lam + k * s - lam * torch.exp(s)).nan_to_num(0.0, posinf=0.0, neginf=0.0)


def vespo_branch(advantages: Tensor, params: "LossParams") -> Tensor:
    """Where the branch of each advantage's sign (``A >= 0``: positive) is set to VESPO's kernel (boolean)."""
    positive = advantages.detach() >= 0
    return torch.where(positive, params.respo_pos_branch == "vespo", params.respo_neg_branch == "vespo")


def two_branch_phi(log_w: Tensor, advantages: Tensor, params: "LossParams") -> Tensor:
    """``phi_{sign A}(W)`` with each branch the kind ``params.respo_{pos,neg}_branch`` names (detached).

    Both "respo": :func:`respo_kernel` at ``params``' constants (the paper's method). A "vespo" branch takes
    :func:`gamma_kernel` at ``params.vespo_*`` on the same ``log W`` for the advantages of its sign, so a ReSPO loss
    whose two branches are "vespo" applies VESPO's coefficient.
    """
    phi = respo_kernel(log_w, advantages, **params.respo_constants())
    kinds = (params.respo_pos_branch, params.respo_neg_branch)
    if "vespo" not in kinds:
        return phi
    with torch.no_grad():
        gamma = gamma_kernel(log_w.clamp(-LOG_W_CLAMP, LOG_W_CLAMP), advantages, params.vespo_k_pos,
                             params.vespo_lambda_pos, params.vespo_k_neg, params.vespo_lambda_neg)  # fmt: skip
        return torch.where(vespo_branch(advantages.to(phi.device), params), gamma.to(phi.dtype), phi)


def directional_trust_mask(
    log_ratio: Tensor,
    advantages: Tensor,
    mask: Tensor,
    epsilon_low: float,
    epsilon_high: float,
    delta: float | None = None,
) -> Tensor:
    """1 where a token keeps its gradient, 0 exactly where clipped PPO would zero it (in its advantage's direction).

    Clipped PPO (TRL's ``dapo``/``grpo`` at token level) stops a token's gradient when ``A > 0`` and
    ``r_it > 1 + epsilon_high`` (already pushed up), when ``A < 0`` and ``r_it < 1 - epsilon_low`` (already pushed
    down) and, with TRL's two-sided cap ``delta``, when ``A < 0`` and ``r_it > delta`` (TRL caps the ratio there, so
    the surrogate is constant). Everything else passes, in particular every token of a low-weight positive sequence,
    which is what ReSPO protects. The bounds are *token*-ratio bounds. ``advantages`` is (B,) or (B, T).
    """
    with torch.no_grad():
        a = advantages.reshape(advantages.shape[0], -1) if advantages.dim() > 1 else advantages.unsqueeze(-1)
        r = torch.exp(log_ratio.detach().float())
        stop = ((a > 0) & (r > 1 + epsilon_high)) | ((a < 0) & (r < 1 - epsilon_low))
        if delta is not None:
            stop = stop | ((a < 0) & (r > delta))
        return (~stop & mask.bool()).float()


# --------------------------------------------------------------------------------------------------------------------
# Policy losses behind one registry
# --------------------------------------------------------------------------------------------------------------------


def with_respo_constants(cls):
    """Give the dataclass-to-be ``cls`` the six fields of :data:`RESPO_CONSTANTS` (default and help); apply it under
    ``@dataclass``. It is how every config that carries the constants declares them: in one place."""
    annotations = cls.__dict__.get("__annotations__")
    if annotations is None:
        annotations = cls.__annotations__ = {}
    for name, (default, help_text) in RESPO_CONSTANTS.items():
        annotations[name] = "float"
        setattr(cls, name, field(default=default, metadata={"help": help_text}))
    return cls


@dataclass(frozen=True)
@with_respo_constants
class LossParams:
    """Hyper-parameters of every registered loss, named as in TRL's ``GRPOConfig`` / ``ReSPOConfig``."""

    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    delta: float | None = None
    importance_sampling_level: str = "token"
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    # respo_alpha_pos ... respo_lambda_neg: the paper's constants (with_respo_constants)
    respo_pos_branch: str = "respo"
    respo_neg_branch: str = "respo"
    respo_trust_mask: bool = False
    # the trust mask's own token-ratio bounds (ReSPOConfig.respo_trust_bounds); None: epsilon_low / epsilon_high /
    # delta (math.inf: no cap)
    trust_epsilon_low: float | None = None
    trust_epsilon_high: float | None = None
    trust_delta: float | None = None

    @classmethod
    def from_config(cls, args, **overrides) -> "LossParams":
        """Read the fields from a ``GRPOConfig``-like object (``epsilon`` is TRL's name for ``epsilon_low``)."""
        values = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        if hasattr(args, "epsilon"):
            values["epsilon_low"] = args.epsilon
        if getattr(args, "epsilon_high", None) is None:
            values["epsilon_high"] = values.get("epsilon_low", cls.epsilon_low)
        if hasattr(args, "respo_trust_mask_active"):  # ReSPOConfig resolves "auto" against the reuse settings
            values["respo_trust_mask"] = args.respo_trust_mask_active
        bounds = getattr(args, "respo_trust_bounds", None)  # the mask's token bounds, whatever TRL's epsilons mean
        if bounds is not None:
            values["trust_epsilon_low"], values["trust_epsilon_high"], values["trust_delta"] = bounds
        return cls(**{**values, **overrides})

    def trust_bounds(self) -> tuple[float, float, float | None]:
        """``(epsilon_low, epsilon_high, delta)`` of the directional token trust mask (token-ratio bounds)."""
        low = self.epsilon_low if self.trust_epsilon_low is None else self.trust_epsilon_low
        high = self.epsilon_high if self.trust_epsilon_high is None else self.trust_epsilon_high
        delta = self.delta if self.trust_delta is None else self.trust_delta
        return low, high, None if delta == math.inf else delta

    def respo_constants(self) -> dict[str, float]:
        """The six kernel constants under :func:`respo_kernel`'s argument names."""
        return {arg: getattr(self, key) for key, arg in CONSTANT_KEYS.items()}


PolicyLoss = Callable[..., Tensor]
POLICY_LOSSES: dict[str, PolicyLoss] = {}


def register_policy_loss(name: str) -> Callable[[PolicyLoss], PolicyLoss]:
    """Register ``fn(log_ratio, advantages, mask, params, *, sampler_ratio=None) -> per_token_loss``.

    ``log_ratio`` is ``log pi_theta - log pi_old`` (B, T) and carries the gradient; ``advantages`` is (B,) or (B, T);
    ``sampler_ratio`` is the correction ratio described in :func:`fold_sampler_ratio`. A loss that folds
    ``sampler_ratio`` into its own weight says so by being listed in :data:`FOLDS_SAMPLER_RATIO`; for the others the
    trainer multiplies the per-token loss by the ratio afterwards (TRL's convention).
    """

    def decorator(fn: PolicyLoss) -> PolicyLoss:
        if name in POLICY_LOSSES:
            raise ValueError(f"policy loss {name!r} is already registered")
        POLICY_LOSSES[name] = fn
        return fn

    return decorator


def get_policy_loss(name: str) -> PolicyLoss:
    try:
        return POLICY_LOSSES[name]
    except KeyError:
        raise ValueError(f"Unknown policy loss {name!r}; registered: {sorted(POLICY_LOSSES)}") from None


def _column(advantages: Tensor) -> Tensor:
    return advantages.reshape(-1, 1) if advantages.dim() == 1 else advantages


def _level_log_weights(log_ratio: Tensor, mask: Tensor, level: str) -> Tensor:
    """Token log-ratios (B, T) or, at ``sequence`` level, their masked mean broadcast to (B, T) (GSPO)."""
    if level == "token":
        return log_ratio
    if level == "sequence":
        mask = mask.to(log_ratio.dtype)
        mean = (log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)
        return mean.expand_as(log_ratio)
    raise ValueError(f"Unknown importance_sampling_level {level!r}; expected 'token' or 'sequence'")


def _ppo_clip(log_ratio: Tensor, advantages: Tensor, params: LossParams) -> Tensor:
    # PPO surrogate, as TRL's grpo/dapo: -min(r A, clip(r, 1-eps_low, 1+eps_high) A); optional two-sided cap `delta`.
    a = _column(advantages)
    r = torch.exp(log_ratio)
    r_clipped = torch.clamp(r, 1 - params.epsilon_low, 1 + params.epsilon_high)
    if params.delta is not None:
        r = torch.clamp(r, max=params.delta)
    return -torch.min(r * a, r_clipped * a)


@register_policy_loss("ppo")
def ppo_loss(log_ratio, advantages, mask, params, *, sampler_ratio=None):
    """Clipped PPO/GRPO at ``params.importance_sampling_level`` (TRL ``grpo``/``bnpo``/``dr_grpo``/``dapo``/``luspo``;
    GSPO is this loss at ``importance_sampling_level='sequence'``)."""
    return _ppo_clip(_level_log_weights(log_ratio, mask, params.importance_sampling_level), advantages, params)


@register_policy_loss("gspo")
def gspo_loss(log_ratio, advantages, mask, params, *, sampler_ratio=None):
    """GSPO: the PPO clip on the geometric-mean sequence ratio, repeated on each token (TRL ``grpo`` with
    ``importance_sampling_level='sequence'``); summed over the ``L_i`` tokens the mean's ``1 / L_i`` cancels."""
    return _ppo_clip(_level_log_weights(log_ratio, mask, "sequence"), advantages, params)


@register_policy_loss("cispo")
def cispo_loss(log_ratio, advantages, mask, params, *, sampler_ratio=None):
    """CISPO (MiniMax-M1): ``-min(r, eps_high).detach() * A * log pi``; the clipped weight scales, never zeroes."""
    weights = _level_log_weights(log_ratio, mask, params.importance_sampling_level)
    clamped = torch.clamp(torch.exp(weights), max=params.epsilon_high).detach()
    return -clamped * _column(advantages) * log_ratio


@register_policy_loss("sapo")
def sapo_loss(log_ratio, advantages, mask, params, *, sampler_ratio=None):
    """SAPO: a sigmoid gate ``4/tau * sigmoid(tau (r - 1))`` instead of the hard clip (TRL ``sapo``)."""
    a = _column(advantages)
    r = torch.exp(_level_log_weights(log_ratio, mask, params.importance_sampling_level))
    tau = torch.where(a > 0, params.sapo_temperature_pos, params.sapo_temperature_neg)
    return -torch.sigmoid(tau * (r - 1)) * 4 / tau * a


def vespo_phi(log_ratio, advantages, mask, params: LossParams, sampler_ratio: Tensor | None = None) -> Tensor:
    """VESPO's sequence weight as in TRL 1.16 (``get_gamma_weights``): raw product ratio, token log-ratios clamped to
    +-20, the log of the sampler ratio floored at ``log 1e-8`` and summed over *all* positions, then ``log W`` clamped
    to ``[log 1e-8, 20]``. Shape (B, 1), or (B, T) for per-token advantages."""
    with torch.no_grad():
        m = mask.to(torch.float32)
        l = (log_ratio.detach().float().clamp(-LOG_W_CLAMP, LOG_W_CLAMP) * m).sum(-1, keepdim=True)
        if sampler_ratio is not None:
            l = l + torch.log(sampler_ratio.float()).clamp(math.log(1e-8), LOG_W_CLAMP).sum(-1, keepdim=True)
        log_w = l.clamp(math.log(1e-8), LOG_W_CLAMP)
        a = _column(advantages)  # (B, T) advantages: each token's sign picks its constants, as TRL's torch.where
        return gamma_kernel(
            log_w, a, params.vespo_k_pos, params.vespo_lambda_pos, params.vespo_k_neg, params.vespo_lambda_neg
        )


@register_policy_loss("vespo")
def vespo_loss(log_ratio, advantages, mask, params, *, sampler_ratio=None):
    """VESPO: ``-phi(W_i).detach() * A_i * log pi`` with the gamma kernel on the sequence product ratio."""
    return -vespo_phi(log_ratio, advantages, mask, params, sampler_ratio) * _column(advantages) * log_ratio


class ReSPOWeights(NamedTuple):
    """Everything ReSPO's coefficient on a batch is made of, computed once (:func:`respo_weights`)."""

    coefficients: Tensor  # (B, T) detached c_it: phi on kept tokens, 0 elsewhere, times the trust mask when on
    log_w: Tensor  # (B,) the current sequence log-weight log W_i (sampler correction folded, clamped to +-20)
    phi: Tensor  # (B, 1) or (B, T): phi_{sign A}(W) at the weight the kernel evaluated (a kept first-pass W)
    kept: Tensor  # (B, T) bool: loss tokens the sampler correction did not drop
    trust_kept: Tensor | None  # (B, T) float: tokens the trust mask lets through (None when the mask is off)


def respo_weights(
    log_ratio: Tensor,
    advantages: Tensor,
    mask: Tensor,
    params: LossParams = LossParams(),
    *,
    sampler_ratio: Tensor | None = None,
    log_w: Tensor | None = None,
    log_sampler_ratio: Tensor | None = None,
) -> ReSPOWeights:
    """ReSPO's detached per-token coefficient and what it is made of, each computed once; every engine assembles it
    here (the TRL trainers through :mod:`respo_trl.trl_loss` and :mod:`respo_trl.packed`, verl's plugin directly):

    1. The sampler correction is folded in log space (:func:`fold_sampler_ratio`): tokens or sequences it masks are
       dropped, never turned into a large negative log-weight.
    2. ``log W_i = clamp(l_i, -20, 20)`` over the kept tokens (:func:`sequence_log_weight`): the raw sequence ratio,
       as in the paper (no length normalisation).
    3. ``phi_i`` from :func:`respo_kernel` with the branch of each advantage (per token if advantages are (B, T)).
       A branch set to "vespo" is TRL's VESPO coefficient exactly (:func:`vespo_phi`, on every token of ``mask``):
       VESPO floors a masked token's sampler ratio at 1e-8 instead of dropping it, so one masked token takes the
       whole sequence's weight to ~0 there, and only then does an ablation arm differ from VESPO by one branch.
    4. With ``params.respo_trust_mask``, tokens clipped PPO would stop in their advantage's direction get 0
       (:func:`directional_trust_mask`); ``phi`` itself is unchanged.

    ``log_w`` (B,), where finite, is the ``log W_i`` the kernel evaluates instead of step 2's: the weight a sample had
    on its first pass, which ``respo_epoch_weight="first_pass"`` keeps for its later passes (docs/method.md, section 6);
    the returned ``log_w`` is always the current one (how far the policy has moved).

    ``log_sampler_ratio``: a sampler correction already folded and laid out as :func:`sequence_log_weight` adds it
    (verl's plugin reads verl's two layouts itself), instead of ``sampler_ratio``; ``mask`` then holds only kept tokens.
    """
    if sampler_ratio is not None and log_sampler_ratio is not None:
        raise ValueError("pass the sampler correction once: sampler_ratio or log_sampler_ratio, not both")
    with torch.no_grad():
        log_c, kept = fold_sampler_ratio(sampler_ratio, mask)
        log_c = log_c if log_sampler_ratio is None else log_sampler_ratio
        current = sequence_log_weight(log_ratio, kept, log_c)
        evaluated = current if log_w is None else torch.where(torch.isfinite(log_w), log_w.to(current), current)
        a = _column(advantages).detach()
        phi = two_branch_phi(evaluated.unsqueeze(-1).expand(-1, a.shape[-1]), a.float(), params)  # (B, 1) or (B, T)
        coef = phi * kept.float()
        if "vespo" in (params.respo_pos_branch, params.respo_neg_branch):
            gamma = vespo_phi(log_ratio, a, mask, params, sampler_ratio)
            phi = torch.where(vespo_branch(a, params), gamma.to(phi.dtype), phi)
            coef = torch.where(vespo_branch(a, params), (gamma * mask.float()).to(coef.dtype), coef)
        trust_kept = None
        if params.respo_trust_mask:
            trust_kept = directional_trust_mask(log_ratio, advantages, kept, *params.trust_bounds())
            coef = coef * trust_kept
        return ReSPOWeights(coef, current, phi, kept, trust_kept)


@register_policy_loss("respo")
def respo_loss(log_ratio, advantages, mask, params, *, sampler_ratio=None, log_w=None):
    """ReSPO: ``-c_it * A_i * log pi_theta(y_it)`` with the detached coefficient of :func:`respo_weights`
    (``log_w``: the first-pass weight it keeps, where given)."""
    coef = respo_weights(log_ratio, advantages, mask, params, sampler_ratio=sampler_ratio, log_w=log_w).coefficients
    return -coef * _column(advantages) * log_ratio


# Losses that fold the sampler correction into their own sequence weight (TRL skips its extra multiply for these).
FOLDS_SAMPLER_RATIO = ("vespo", "respo")

# TRL `loss_type` -> registered loss whose per-token coefficient it applies. (TRL's aggregation differs between
# grpo/bnpo/dr_grpo/dapo, but the importance-weight coefficient relative to on-policy is the same.)
TRL_LOSS_TYPES = {
    "grpo": "ppo",
    "bnpo": "ppo",
    "dr_grpo": "ppo",
    "dapo": "ppo",
    "luspo": "ppo",
    "cispo": "cispo",
    "sapo": "sapo",
    "vespo": "vespo",
    "respo": "respo",
}


def registered_loss_for(loss_type: str) -> str:
    """The registry name implementing TRL's ``loss_type`` coefficient (``ppo`` for the clipped family)."""
    if loss_type in POLICY_LOSSES:
        return loss_type
    try:
        return TRL_LOSS_TYPES[loss_type]
    except KeyError:
        raise ValueError(f"No registered policy loss for loss_type {loss_type!r}") from None


def gradient_coefficients(
    name: str,
    log_ratio: Tensor,
    advantages: Tensor,
    mask: Tensor,
    params: LossParams = LossParams(),
    *,
    sampler_ratio: Tensor | None = None,
    log_w: Tensor | None = None,
) -> Tensor:
    """Effective coefficients ``c_it`` (B, T) of a registered loss, by differentiating it w.r.t. ``log pi_theta``.

    ``c_it = -(d sum_t m_it ell_it / d log pi_it) / sign(A_it)``, evaluated with unit advantages of the same sign
    (every registered loss is linear in ``|A|`` within a sign), so ``c`` is defined for ``A = 0`` too (positive
    branch). Losses outside :data:`FOLDS_SAMPLER_RATIO` are multiplied by ``sampler_ratio`` afterwards, as TRL does.
    Masked positions get 0. ``log_w`` is passed to ReSPO's loss only (its kept first-pass weight).
    """
    loss_fn = get_policy_loss(name)
    extra = {"log_w": log_w} if name == "respo" and log_w is not None else {}
    sign = torch.where(_column(advantages) >= 0, 1.0, -1.0).to(log_ratio.device)
    sign = sign.squeeze(-1) if advantages.dim() == 1 else sign
    with torch.enable_grad():
        rho = torch.where(mask.bool(), log_ratio.detach().float(), 0.0).requires_grad_(True)
        per_token = loss_fn(rho, sign, mask, params, sampler_ratio=sampler_ratio, **extra)
        if sampler_ratio is not None and name not in FOLDS_SAMPLER_RATIO:
            per_token = per_token * sampler_ratio.float()
        total = (per_token * mask.to(per_token.dtype)).sum()
        (grad,) = torch.autograd.grad(total, rho)
    return (-grad / _column(sign)).nan_to_num(0.0) * mask.to(grad.dtype)


def kish_ess(log_w: Tensor) -> Tensor:
    """Normalised Kish effective sample size ``(sum w)^2 / (n sum w^2)`` in ``(0, 1]``, stable in log space."""
    log_w = log_w.float().reshape(-1)
    if log_w.numel() == 0:
        return torch.tensor(float("nan"))
    shifted = log_w - log_w.max()
    return torch.exp(2 * torch.logsumexp(shifted, 0) - torch.logsumexp(2 * shifted, 0)) / log_w.numel()


def __getattr__(name: str):
    if name in REMOVED_NAMES:  # a name an earlier release exported: refused in one line that says what replaces it
        raise AttributeError(f"respo_trl.kernels.{renamed_message(name, REMOVED_NAMES[name])}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
