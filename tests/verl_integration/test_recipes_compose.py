"""The launchers' overrides against verl 0.9.1's real config: every key exists (Hydra refuses unknown keys without
'+'), the actor config builds with ReSPO's typed policy-loss config, and the staleness arithmetic survives."""

from __future__ import annotations

import os
import subprocess

import pytest
from _verl_helpers import ROOT, VERL_SKIP_REASON

pytest.importorskip("verl", reason=VERL_SKIP_REASON)


CONFIG_DIRS = {"fully_async_": "experimental/fully_async_policy/config",  # verl's async trainers keep their configs
               "one_step_off_": "experimental/one_step_off_policy/config"}  # next to their entry points


def compose_launch(config_name, overrides):
    """verl's config as the launcher's entry point composes it (main_ppo or an async trainer's main)."""
    from hydra import compose, initialize_config_dir

    import verl

    folder = next((d for prefix, d in CONFIG_DIRS.items() if config_name.startswith(prefix)), "trainer/config")
    with initialize_config_dir(config_dir=os.path.join(os.path.dirname(verl.__file__), folder), version_base=None):
        return compose(config_name=config_name, overrides=overrides)


def launcher_overrides(script, *args):
    result = subprocess.run(["bash", str(ROOT / "recipes" / "verl" / script), *args, "--dry-run"], capture_output=True,
                            text=True, timeout=60, env={"PATH": "/usr/bin:/bin", "HOME": "/tmp"})
    assert result.returncode == 0, result.stderr
    argv = result.stdout.splitlines()[3:]  # after "python3 -m verl.trainer.main_ppo"
    config_name = "ppo_trainer"
    if argv and argv[0].startswith("--config-name="):
        config_name = argv.pop(0).split("=", 1)[1]
    return config_name, argv


@pytest.mark.parametrize("script, expected_config", [("train_qwen3_1_7b.sh", "ppo_trainer"),
                                                     ("train_qwen3_30b_a3b.sh", "ppo_megatron_trainer")])
def test_launcher_overrides_compose_against_verls_config(compose_verl, script, expected_config):
    from omegaconf import OmegaConf

    config_name, overrides = launcher_overrides(script, "--N", "16",
                                                "+actor_rollout_ref.actor.policy_loss.respo_beta_neg=0.4")
    assert config_name == expected_config
    config = compose_launch(config_name, overrides)
    assert config.data.train_batch_size == 16 * 32 and config.trainer.total_training_steps == 64
    assert config.actor_rollout_ref.actor.policy_loss.loss_mode == "respo"
    OmegaConf.resolve(config)  # as main_ppo does; respo_rollout_is resolves to null (no sampler correction)
    assert config.actor_rollout_ref.actor.policy_loss.respo_rollout_is is None

    if expected_config == "ppo_trainer":  # the Megatron actor config needs Megatron installed to be built
        from verl.utils.config import omega_conf_to_dataclass

        actor = omega_conf_to_dataclass(config.actor_rollout_ref.actor)
        assert type(actor.policy_loss).__name__ == "ReSPOPolicyLossConfig"
        assert actor.policy_loss.respo_beta_neg == 0.4 and actor.policy_loss.respo_alpha_pos == 2.0
        assert actor.optim.clip_grad == 1.0 and actor.optim.weight_decay == 0.1 and actor.ppo_epochs == 1


@pytest.mark.parametrize("script, trainer, expected_config", [
    ("train_qwen3_1_7b.sh", "fully_async", "fully_async_ppo_trainer"),
    ("train_qwen3_1_7b.sh", "one_step_off", "one_step_off_ppo_trainer"),
    ("train_qwen3_30b_a3b.sh", "one_step_off", "one_step_off_ppo_megatron_trainer"),
])
def test_async_launchers_compose_against_verls_async_configs(script, trainer, expected_config):
    """The async trainers' own configs (bypass mode on), the GPU split, and the actor config the workers build: ReSPO
    with verl's rollout correction attached, so bypass mode reaches the loss on a Ray worker too."""
    from omegaconf import OmegaConf

    config_name, overrides = launcher_overrides(script, "--N", "16", "--trainer", trainer)
    assert config_name == expected_config
    config = compose_launch(config_name, overrides)
    assert config.algorithm.rollout_correction.bypass_mode is True and not config.actor_rollout_ref.hybrid_engine
    assert config.trainer.n_gpus_per_node + config.rollout.n_gpus_per_node == 8
    assert config.actor_rollout_ref.actor.policy_loss.loss_mode == "respo"
    if trainer == "fully_async":  # new weights reach the rollout every N updates of 32 prompts
        assert config.async_training.trigger_parameter_sync_step == 16 and config.async_training.require_batches == 1
        assert config.data.train_batch_size == 0 and config.actor_rollout_ref.actor.ppo_mini_batch_size == 32
    else:  # the sync batch arithmetic, one step behind
        assert config.data.train_batch_size == 16 * 32 and config.trainer.total_training_steps == 64
    OmegaConf.resolve(config)
    if "megatron" not in config_name:
        from verl.utils.config import omega_conf_to_dataclass

        actor = omega_conf_to_dataclass(config.actor_rollout_ref.actor)
        assert type(actor.policy_loss).__name__ == "ReSPOPolicyLossConfig"
        assert actor.policy_loss.rollout_correction["bypass_mode"] is True
