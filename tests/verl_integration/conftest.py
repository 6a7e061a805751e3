"""Fixtures for the verl tests. Import-safe without verl: the main environment collects this folder and skips it.

The verl tests run in their own virtual environment (verl 0.9.1's pins clash with TRL 1.16's);
``tests/verl_integration/run.sh`` builds it and runs them. Each test module starts with
``pytest.importorskip("verl")``.
"""

from __future__ import annotations

import os

import pytest
from _verl_helpers import VERL_SKIP_REASON, respo_overrides


@pytest.fixture(scope="session")
def compose_verl():
    """Compose verl's own ``ppo_trainer`` config with Hydra overrides, as ``python -m verl.trainer.main_ppo`` does."""
    verl = pytest.importorskip("verl", reason=VERL_SKIP_REASON)
    from hydra import compose, initialize_config_dir

    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer/config")

    def _compose(overrides):
        with initialize_config_dir(config_dir=config_dir, version_base=None):
            return compose(config_name="ppo_trainer", overrides=list(overrides))

    return _compose


@pytest.fixture(scope="session")
def actor_config(compose_verl):
    """A factory: verl's ``ActorConfig`` dataclass built from overrides (what ``validate_config`` builds at start)."""
    from verl.utils.config import omega_conf_to_dataclass

    def _build(*extra):
        return omega_conf_to_dataclass(compose_verl(respo_overrides(*extra)).actor_rollout_ref.actor)

    return _build
