"""Deprecated (0.6): use :mod:`respo_trl.builtin.task` (same names). Removed in 0.7."""

import warnings

from respo_trl.builtin.task import *  # noqa: F403
from respo_trl.builtin.task import __all__, main  # noqa: F401

warnings.warn("respo_trl.demo.tasks moved to respo_trl.builtin.task (0.6); the old path goes in 0.7",
              DeprecationWarning, stacklevel=2)  # fmt: skip

if __name__ == "__main__":
    main()
