"""The plugin reaches verl without a fork: entry-point discovery in a fresh process, and config errors at start."""

from __future__ import annotations

import json
import subprocess
from importlib.metadata import entry_points

import pytest

from _verl_helpers import VERL_SKIP_REASON  # noqa: E402  (plain module, no verl import)

pytest.importorskip("verl", reason=VERL_SKIP_REASON)

from _verl_helpers import PYTHON, respo_overrides, subprocess_env  # noqa: E402

PROBE = """
import json, sys
import verl  # nothing else: verl's __init__ must find and import the plugin itself
from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY, get_policy_loss_fn
fn = POLICY_LOSS_REGISTRY.get("respo")
print(json.dumps({"registered": fn is not None, "module": getattr(fn, "__module__", None),
                  "same": fn is get_policy_loss_fn("respo") if fn else False,
                  "plugin_loaded": "respo_trl.integrations.verl" in sys.modules}))
"""


def probe(**env):
    result = subprocess.run([PYTHON, "-c", PROBE], capture_output=True, text=True, timeout=300,
                            env={**subprocess_env(), **env})
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_entry_point_is_declared():
    declared = {ep.name: ep.value for ep in entry_points(group="verl.plugins")}
    assert declared.get("respo") == "respo_trl.integrations.verl"


def test_fresh_process_discovers_the_plugin_through_the_entry_point():
    found = probe(VERL_USE_EXTERNAL_PLUGINS="auto")
    assert found == {"registered": True, "module": "respo_trl.integrations.verl", "same": True,
                     "plugin_loaded": True}
    # Naming only our entry point works too; disabling discovery removes it: the registration comes from the entry
    # point, not from an import somewhere else.
    assert probe(VERL_USE_EXTERNAL_PLUGINS="respo")["registered"]
    assert probe(VERL_USE_EXTERNAL_PLUGINS="none") == {"registered": False, "module": None, "same": False,
                                                        "plugin_loaded": False}
    # verl's explicit route still works with discovery off.
    assert probe(VERL_USE_EXTERNAL_PLUGINS="none",
                 VERL_USE_EXTERNAL_MODULES="respo_trl.integrations.verl")["registered"]


def _validate(compose_verl, *extra):
    """verl's own start-up check (main_ppo runs it before Ray starts any worker)."""
    from verl.utils.config import validate_config

    config = compose_verl(respo_overrides("data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
                                          "trainer.n_gpus_per_node=1",
                                          "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1", *extra))
    validate_config(config, use_reference_policy=False, use_critic=False)
    from verl.utils.config import omega_conf_to_dataclass

    return omega_conf_to_dataclass(config.actor_rollout_ref.actor)


def test_valid_constants_pass_verl_start_up_validation(compose_verl):
    actor = _validate(compose_verl, "+actor_rollout_ref.actor.policy_loss.respo_beta_neg=1.0",
                      "+actor_rollout_ref.actor.policy_loss.respo_lambda_pos=0")
    assert actor.policy_loss.respo_beta_neg == 1.0 and actor.policy_loss.respo_lambda_pos == 0.0


@pytest.mark.parametrize(
    "override, field",
    [
        ("respo_beta_pos=1.5", "respo_beta_pos"),
        ("respo_beta_neg=-0.1", "respo_beta_neg"),
        ("respo_alpha_neg=0", "respo_alpha_neg"),
        ("respo_alpha_pos=-2", "respo_alpha_pos"),
        ("respo_lambda_pos=-1", "respo_lambda_pos"),
        ("respo_lambda_neg=nan", "respo_lambda_neg"),
        ("respo_lam_pos=0.5", "was renamed actor_rollout_ref.actor.policy_loss.respo_lambda_pos"),  # renamed key
        ("respo_rollout_is=geometric", "respo_rollout_is"),
        ("respo_alpah_pos=2", "respo_alpah_pos"),  # misspelt: unknown key
    ],
)
def test_bad_constants_fail_at_start_naming_the_field(compose_verl, override, field):
    with pytest.raises(Exception) as info:
        _validate(compose_verl, f"+actor_rollout_ref.actor.policy_loss.{override}")
    assert field in str(info.value)


def test_respo_keys_without_our_target_fail_naming_the_key(compose_verl):
    """verl's PolicyLossConfig rejects extra keys; the message names the key (docs/verl.md says to set _target_)."""
    from verl.utils.config import omega_conf_to_dataclass

    config = compose_verl(["actor_rollout_ref.rollout.n=8", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
                           "actor_rollout_ref.actor.policy_loss.loss_mode=respo",
                           "+actor_rollout_ref.actor.policy_loss.respo_alpha_pos=3"])
    with pytest.raises(Exception, match="respo_alpha_pos"):
        omega_conf_to_dataclass(config.actor_rollout_ref.actor)


def test_unknown_respo_key_in_a_plain_dict_config_is_rejected():
    from respo_trl.integrations.verl import respo_constants

    with pytest.raises(ValueError, match="respo_lambda_pos_x"):
        respo_constants({"policy_loss": {"loss_mode": "respo", "respo_lambda_pos_x": 2.0}})
    constants, level = respo_constants({"policy_loss": {"respo_beta_pos": 0.75, "respo_lambda_neg": 1.5}})
    assert constants["beta_pos"] == 0.75 and constants["lam_neg"] == 1.5 and constants["alpha_pos"] == 2.0
    assert level == "auto"


def test_the_constants_have_one_spelling_and_the_renamed_verl_keys_say_the_new_one(actor_config):
    """ReSPOConfig's names (respo_lambda_*) are the keys in TRL and verl; the renamed verl keys (respo_lam_*) are
    refused in one line naming the key to set, through Hydra's _target_ and in a plain dict config."""
    import dataclasses

    from respo_trl.integrations.verl import ReSPOPolicyLossConfig, respo_constants
    from respo_trl.kernels import CONSTANT_KEYS  # ReSPOConfig's fields (tests/test_config.py checks that side)

    fields = {f.name for f in dataclasses.fields(ReSPOPolicyLossConfig)}
    assert set(CONSTANT_KEYS) <= fields and not {"respo_lam_pos", "respo_lam_neg"} & fields
    with pytest.raises(Exception, match=r"policy_loss.respo_lam_pos=0.5 was renamed .*policy_loss.respo_lambda_pos .*"
                                        r"set actor_rollout_ref.actor.policy_loss.respo_lambda_pos=0.5 instead"):
        actor_config("+actor_rollout_ref.actor.policy_loss.respo_lam_pos=0.5")
    with pytest.raises(ValueError, match=r"policy_loss.respo_lam_neg was renamed .*policy_loss.respo_lambda_neg"):
        respo_constants({"policy_loss": {"respo_lam_neg": 0.25}})
    assert respo_constants({"policy_loss": {"respo_lambda_neg": 0.25}})[0]["lam_neg"] == 0.25
