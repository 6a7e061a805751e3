"""Front ends of the ReSPO kernel for RL frameworks other than TRL.

Each integration is a thin adapter around the pure-torch kernel in :mod:`respo_trl.kernels` (one kernel, several
front ends); none of them holds math of its own. Importing this package imports nothing: each integration is loaded
explicitly (``import respo_trl.integrations.verl``) or by its framework's plugin mechanism, and needs that framework
installed.

* :mod:`respo_trl.integrations.verl`: ``loss_mode="respo"`` for verl (``docs/verl.md``).
"""
