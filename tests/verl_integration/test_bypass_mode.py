"""verl's bypass mode, the default of its async trainers (fully_async_policy, one_step_off_policy): verl's own
``apply_bypass_mode`` overwrites the actor's ``loss_mode`` with ``bypass_mode`` (PPO-clip); with the plugin loaded,
``loss_mode=respo`` survives it and trains against the rollout log-probs, and verl's rejection sampling drops what its
own bypass loss drops."""

from __future__ import annotations

import os

import pytest

from _verl_helpers import VERL_SKIP_REASON  # noqa: E402  (plain module, no verl import)

pytest.importorskip("verl", reason=VERL_SKIP_REASON)

import torch  # noqa: E402
from _verl_helpers import respo_overrides  # noqa: E402

ASYNC_TRAINERS = {  # verl's experimental trainer folder -> its Hydra config
    "fully_async_policy": "fully_async_ppo_trainer",
    "one_step_off_policy": "one_step_off_ppo_trainer",
}


def compose_async(trainer, *extra):
    """verl's own config for an async trainer, as its entry point composes it, with ReSPO selected."""
    from hydra import compose, initialize_config_dir

    import verl

    config_dir = os.path.join(os.path.dirname(verl.__file__), "experimental", trainer, "config")
    # one_step_off's searchpath is relative to verl's source checkout (file://verl/trainer/config): point it at the
    # installed package, as fully_async's own config does
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose(config_name=ASYNC_TRAINERS[trainer],
                       overrides=["hydra.searchpath=[pkg://verl.trainer.config]", *respo_overrides(*extra)])


def rollout_batch(seed=0, batch_size=6, length=5):
    """A DataProto as verl's trainers hold it before the actor update: rollout log-probs, no old log-probs yet."""
    from verl import DataProto

    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([5, 2, 4, 1, 3, 5])[:batch_size]
    mask = (torch.arange(length)[None] < lengths[:, None]).float()
    rollout = (-torch.rand(batch_size, length, generator=g) * 2 - 0.1) * mask
    current = (rollout + torch.randn(batch_size, length, generator=g) * 0.4) * mask  # the policy moved since
    advantages = torch.tensor([1.0, -0.5, 0.8, -1.2, 0.3, -0.7])[:batch_size, None] * mask
    batch = DataProto.from_dict(tensors={"rollout_log_probs": rollout, "response_mask": mask, "advantages": advantages})
    return batch, current


def closed_form_phi(log_w, advantage):
    w = log_w.clamp(-20, 20).exp()
    pos = (1 + w) / 2 * torch.exp(1 - w)
    neg = w.sqrt() * torch.exp(2 * (1 - w.sqrt()))
    return torch.where(advantage >= 0, pos, neg)


def actor_update_inputs(config, batch, current):
    """What the actor's loss receives after ``apply_bypass_mode``: verl's ActorConfig built from the (mutated) config."""
    from verl.utils.config import omega_conf_to_dataclass

    actor = omega_conf_to_dataclass(config.actor_rollout_ref.actor)
    log_prob = current.clone().double().requires_grad_(True)
    return actor, dict(old_log_prob=batch.batch["old_log_probs"].double(), log_prob=log_prob,
                       advantages=batch.batch["advantages"].double(), response_mask=batch.batch["response_mask"].bool())


@pytest.mark.parametrize("trainer", sorted(ASYNC_TRAINERS))
def test_respo_survives_verls_apply_bypass_mode_in_the_async_trainers_default_config(trainer):
    """Catches: the wrapper dropped (loss_mode becomes 'bypass_mode', PPO-clip), old_log_probs not the rollout's."""
    from verl.trainer.ppo.core_algos import get_policy_loss_fn
    from verl.trainer.ppo.rollout_corr_helper import apply_bypass_mode  # imported as verl's trainers import it

    config = compose_async(trainer)
    assert config.algorithm.rollout_correction.bypass_mode is True  # the async trainers' default: the premise
    batch, current = rollout_batch()
    apply_bypass_mode(batch=batch, rollout_corr_config=config.algorithm.rollout_correction,
                      policy_loss_config=config.actor_rollout_ref.actor.policy_loss)
    assert config.actor_rollout_ref.actor.policy_loss.loss_mode == "respo"
    assert torch.equal(batch.batch["old_log_probs"], batch.batch["rollout_log_probs"])

    actor, inputs = actor_update_inputs(config, batch, current)
    assert type(actor.policy_loss).__name__ == "ReSPOPolicyLossConfig"
    assert actor.policy_loss.rollout_correction["bypass_mode"]  # attached by verl's apply_bypass_mode
    loss_fn = get_policy_loss_fn(actor.policy_loss.loss_mode)
    assert loss_fn.__module__ == "respo_trl.integrations.verl"
    loss, metrics = loss_fn(**inputs, loss_agg_mode="token-mean", config=actor)
    m, A = inputs["response_mask"].double(), inputs["advantages"]
    log_w = ((current - batch.batch["rollout_log_probs"]) * m).sum(-1)  # W = pi_theta / pi_rollout
    phi = closed_form_phi(log_w.double(), A[:, 0])
    (grad,) = torch.autograd.grad(loss, inputs["log_prob"])
    torch.testing.assert_close(grad, -phi[:, None] * A * m / m.sum(), rtol=1e-5, atol=1e-9)  # token-mean
    assert "respo/phi_mean" in metrics


def test_other_loss_modes_still_get_verls_bypass_loss():
    from verl.trainer.ppo.rollout_corr_helper import apply_bypass_mode

    config = compose_async("one_step_off_policy", "actor_rollout_ref.actor.policy_loss.loss_mode=vanilla")
    batch, _ = rollout_batch()
    apply_bypass_mode(batch=batch, rollout_corr_config=config.algorithm.rollout_correction,
                      policy_loss_config=config.actor_rollout_ref.actor.policy_loss)
    assert config.actor_rollout_ref.actor.policy_loss.loss_mode == "bypass_mode"


def test_bypass_rejection_sampling_drops_what_verls_bypass_loss_drops():
    """Catches: rollout_rs ignored in bypass mode (rejected tokens keep their gradient), or applied outside it."""
    from verl.trainer.ppo.core_algos import get_policy_loss_fn
    from verl.trainer.ppo.rollout_corr_helper import apply_bypass_mode, compute_rollout_correction_and_rejection_mask

    rs = ["algorithm.rollout_correction.rollout_rs=token_k1", "algorithm.rollout_correction.rollout_rs_threshold=0.7_1.4"]
    config = compose_async("fully_async_policy", *rs)
    batch, current = rollout_batch(seed=1)
    apply_bypass_mode(batch=batch, rollout_corr_config=config.algorithm.rollout_correction,
                      policy_loss_config=config.actor_rollout_ref.actor.policy_loss)
    actor, inputs = actor_update_inputs(config, batch, current)
    loss, metrics = get_policy_loss_fn("respo")(**inputs, loss_agg_mode="token-mean", config=actor)
    (grad,) = torch.autograd.grad(loss, inputs["log_prob"])
    _, kept, _ = compute_rollout_correction_and_rejection_mask(
        old_log_prob=current.double(), rollout_log_prob=inputs["old_log_prob"], response_mask=inputs["response_mask"],
        rollout_rs="token_k1", rollout_rs_threshold="0.7_1.4")
    mask = inputs["response_mask"]
    rejected = mask & ~kept.bool()
    assert rejected.any() and (mask & kept.bool()).any(), "the batch must have rejected and kept tokens"
    assert torch.all(grad[rejected] == 0) and torch.all(grad[mask & kept.bool()] != 0)
    assert any(key.startswith("rollout_corr/") for key in metrics)  # verl's rejection metrics, as its bypass logs

    # the same tensors in decoupled mode: verl applies the rejection to response_mask on the driver, not in the loss
    actor.policy_loss.rollout_correction["bypass_mode"] = False
    loss, _ = get_policy_loss_fn("respo")(**inputs, loss_agg_mode="token-mean", config=actor)
    (grad,) = torch.autograd.grad(loss, inputs["log_prob"])
    assert torch.all(grad[mask] != 0)
