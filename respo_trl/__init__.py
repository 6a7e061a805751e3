"""respo_trl: ReSPO (Reshaped Sequence Policy Optimization) for Hugging Face TRL.

``from respo_trl import ReSPOConfig, ReSPOTrainer`` imports TRL (seconds); ``respo_trl.kernels`` is pure torch and
loads instantly, so the kernel can be used without TRL.
"""

from importlib import import_module

__version__ = "0.6.0"

_LAZY = {
    "ReSPOConfig": "respo_trl.config",
    "ReSPOTrainer": "respo_trl.trainer",
    "AsyncReSPOConfig": "respo_trl.async_config",
    "AsyncReSPOTrainer": "respo_trl.async_trainer",
    "RolloutBuffer": "respo_trl.buffer",
    "respo_kernel": "respo_trl.kernels",
    "respo_weights": "respo_trl.kernels",
    "sequence_log_weight": "respo_trl.kernels",
}

__all__ = [*_LAZY, "__version__"]


def __getattr__(name):
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    if name == "respo_coefficients":  # removed in 0.8: refused in one line naming what replaces it
        return getattr(import_module("respo_trl.kernels"), name)
    raise AttributeError(f"module 'respo_trl' has no attribute {name!r}")
