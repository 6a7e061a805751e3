"""Deprecated (0.6): use :mod:`respo_trl.builtin.tiny_model` (same names). Removed in 0.7."""

import warnings

from respo_trl.builtin.tiny_model import *  # noqa: F403
from respo_trl.builtin.tiny_model import __all__  # noqa: F401

warnings.warn("respo_trl.demo.tiny moved to respo_trl.builtin.tiny_model (0.6); the old path goes in 0.7",
              DeprecationWarning, stacklevel=2)  # fmt: skip
