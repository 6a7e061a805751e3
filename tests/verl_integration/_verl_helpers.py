"""Helpers shared by the verl tests (a plain module, so test files import it without clashing with conftest names)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
PYTHON = sys.executable
VERL_SKIP_REASON = (
    "verl is not installed here: the verl tests run in their own environment (bash tests/verl_integration/run.sh)"
)


def respo_overrides(*extra: str) -> list[str]:
    """Hydra overrides selecting ReSPO the way docs/verl.md tells users to."""
    return [
        "actor_rollout_ref.rollout.n=8",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.actor.policy_loss.loss_mode=respo",
        "actor_rollout_ref.actor.policy_loss._target_=respo_trl.integrations.verl.ReSPOPolicyLossConfig",
        *extra,
    ]


def subprocess_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env
