"""``AsyncReSPOConfig``: TRL's ``AsyncGRPOConfig`` plus the loss choice and ReSPO's kernel constants.

TRL's async trainer has one loss, its token clip. This config adds ``loss_type`` (``"respo"`` by default,
``"vespo"``, or ``"clip"``: TRL's own loss, untouched) and the constants of the two kernels. The ReSPO constants and
their help are ``ReSPOConfig``'s and the VESPO ones ``GRPOConfig``'s (declared once, read here). Everything
``AsyncGRPOConfig`` accepts stays accepted.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields

from trl import GRPOConfig

from .config import LOSS_TYPES, ReSPOConfig
from .kernels import CONSTANT_KEYS, check_constant, with_respo_constants

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # respo_trl names the experimental trainer it builds on itself
from trl.experimental.async_grpo import AsyncGRPOConfig  # noqa: E402

# loss_type -> the registered loss of respo_trl.kernels whose coefficient it applies ("clip" is TRL's own code)
ASYNC_LOSSES = {"respo": "respo", "vespo": "vespo", "clip": "ppo"}


def _same_as(config_cls, name: str):
    """A field declared like ``config_cls``'s ``name`` (default and help), so a constant is declared once."""
    declared = config_cls.__dataclass_fields__[name]
    return field(default=declared.default, metadata=dict(declared.metadata))


@dataclass
@with_respo_constants  # respo_alpha_pos ... respo_lambda_neg, declared once (respo_trl.kernels.RESPO_CONSTANTS)
class AsyncReSPOConfig(AsyncGRPOConfig):
    """``AsyncGRPOConfig`` for :class:`~respo_trl.async_trainer.AsyncReSPOTrainer`.

    Parameters (beyond TRL's):
        loss_type: ``"respo"`` (default: ReSPO's two-branch sequence kernel at the paper's constants), ``"vespo"``
            (VESPO's gamma kernel, as TRL's synchronous trainer computes it) or ``"clip"`` (TRL's async token clip,
            exactly TRL's code). All three use TRL's async aggregation: a token sum over the global trained-token count.
        respo_alpha_pos ... respo_lambda_neg: ReSPO's constants (``ReSPOConfig``'s fields, same defaults).
        vespo_k_pos ... vespo_lambda_neg: VESPO's constants (``GRPOConfig``'s fields, same defaults).
        respo_log_diagnostics: log ReSPO's per-step diagnostics (``respo/*``, ``offpolicy/*``) for every loss.
    """

    loss_type: str = field(
        default="respo",
        metadata={
            "help": "Policy loss: 'respo' (ReSPO's sequence kernel, default), 'vespo' (VESPO's) or 'clip' (TRL's "
            "async token clip, TRL's own code).",
            "choices": list(ASYNC_LOSSES),
        },
    )
    vespo_k_pos: float = _same_as(GRPOConfig, "vespo_k_pos")
    vespo_lambda_pos: float = _same_as(GRPOConfig, "vespo_lambda_pos")
    vespo_k_neg: float = _same_as(GRPOConfig, "vespo_k_neg")
    vespo_lambda_neg: float = _same_as(GRPOConfig, "vespo_lambda_neg")
    respo_log_diagnostics: bool = _same_as(ReSPOConfig, "respo_log_diagnostics")

    def __post_init__(self):
        if self.loss_type not in ASYNC_LOSSES:
            hint = " (TRL's synchronous loss types train with respo_trl.ReSPOTrainer)" if self.loss_type in LOSS_TYPES else ""
            raise ValueError(f"loss_type must be one of {list(ASYNC_LOSSES)} for the async trainer, got "
                             f"{self.loss_type!r}{hint}")  # fmt: skip
        for name, arg in CONSTANT_KEYS.items():
            setattr(self, name, check_constant(name, getattr(self, name), arg.split("_")[0]))
        for name in ("vespo_k_pos", "vespo_k_neg"):
            setattr(self, name, check_constant(name, getattr(self, name), "lam"))  # k >= 0
        for name in ("vespo_lambda_pos", "vespo_lambda_neg"):
            setattr(self, name, check_constant(name, getattr(self, name), "lam"))
        super().__post_init__()

    @classmethod
    def from_async_config(cls, args: AsyncGRPOConfig, **overrides) -> "AsyncReSPOConfig":
        """An ``AsyncReSPOConfig`` with every field of ``args`` (a plain ``AsyncGRPOConfig``) and ``overrides``."""
        values = {f.name: getattr(args, f.name) for f in fields(AsyncGRPOConfig) if f.init}
        return cls(**{**values, **overrides})
