"""Drop-in for TRL GRPO scripts: TRL's own example configurations build and train through ReSPOTrainer, every
loss type x vLLM sampler-correction mode trains with an in-process vLLM stand-in, the sampler ratio reaches ReSPO's
coefficient and the diagnostics, baselines equal TRL's GRPOTrainer step for step, and a TRL whose internals moved is
refused with instructions."""

import logging
import math

import pytest
import torch
from conftest import CPU_ARGS
from vllm_standin import use_fake_vllm

from respo_trl.builtin.tiny_model import tiny_qwen3
from respo_trl.rewards import crc_reward

MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def snapshot(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def train_logs(trainer):
    return [h for h in trainer.state.log_history if "loss" in h]


@pytest.fixture
def build(tokenizer, toy_dataset, tmp_path):
    """``build(config_cls, trainer_cls=ReSPOTrainer, model=None, vllm=False, **fields)`` -> trainer."""
    from respo_trl import ReSPOConfig, ReSPOTrainer
    def make(config_cls=ReSPOConfig, trainer_cls=ReSPOTrainer, model=None, vllm=False, peft_config=None, **fields):
        base = {**CPU_ARGS, "output_dir": str(tmp_path / "out"), "max_steps": 2}
        if vllm:
            base.update(use_vllm=True, vllm_mode="colocate")
        args = config_cls(**{**base, **fields})
        torch.manual_seed(0)
        model = model if model is not None else tiny_qwen3(tokenizer)
        kwargs = {"peft_config": peft_config} if peft_config is not None else {}
        with use_fake_vllm():
            return trainer_cls(
                model=model, reward_funcs=crc_reward, args=args, train_dataset=toy_dataset, processing_class=tokenizer,
                **kwargs,
            )

    return make


# TRL's example configurations (trl/examples/scripts and the TRL docs), as a user would pass them.
TRL_EXAMPLES = {
    "default": {},
    "vllm_colocate": {"use_vllm": True, "vllm_mode": "colocate"},
    "vllm_server": {"use_vllm": True, "vllm_mode": "server"},
    "gspo": {"importance_sampling_level": "sequence", "loss_type": "grpo", "epsilon": 3e-4, "epsilon_high": 4e-4,
             "beta": 0.0, "steps_per_generation": 4},
    "dapo": {"loss_type": "dapo", "epsilon_high": 0.28, "mask_truncated_completions": True, "beta": 0.0},
    "dr_grpo": {"loss_type": "dr_grpo", "scale_rewards": "none"},
    "luspo": {"loss_type": "luspo", "importance_sampling_level": "sequence"},
    "multi_iteration": {"num_iterations": 2},
}


@pytest.mark.parametrize("name", sorted(TRL_EXAMPLES))
def test_trl_example_configs_train_respo_through_the_drop_in(build, name, caplog):
    from trl import GRPOConfig

    fields = TRL_EXAMPLES[name]
    with caplog.at_level(logging.WARNING):
        trainer = build(config_cls=GRPOConfig, **fields)
    messages = [r.getMessage() for r in caplog.records]
    assert sum("plain GRPOConfig" in m for m in messages) == 1
    assert sum("ReSPO kernel (alpha, beta, lambda)" in m for m in messages) == 1
    if fields.get("use_vllm"):  # TRL's default sequence_mask: one line says what ReSPO does with it
        assert sum("vllm_importance_sampling_mode='sequence_mask'" in m for m in messages) == 1
    if fields.get("importance_sampling_level") == "sequence":
        assert sum("importance_sampling_level='sequence'" in m for m in messages) == 1
    assert trainer.loss_type == "respo"
    before = snapshot(trainer.model)
    with use_fake_vllm():
        trainer.train()
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
    assert all(math.isfinite(h["loss"]) for h in train_logs(trainer))


def test_lora_example_config_trains_adapters_only(build):
    from peft import LoraConfig
    from trl import GRPOConfig

    trainer = build(config_cls=GRPOConfig, peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"]),
                    learning_rate=5e-2, num_iterations=2)
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    before = snapshot(trainer.model)
    trainer.train()
    changed = {n for n, p in trainer.model.named_parameters() if not torch.equal(before[n], p.detach())}
    assert changed and changed <= trainable and all("lora" in n for n in trainable)


LOSS_TYPES = {
    "respo": {},
    "dapo": {},
    "grpo": {},
    "bnpo": {},
    "dr_grpo": {},
    "cispo": {"epsilon_high": 5.0},
    "sapo": {},
    "luspo": {"importance_sampling_level": "sequence"},
    "gspo": {"loss_type": "grpo", "importance_sampling_level": "sequence"},
    "vespo": {},
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("loss", sorted(LOSS_TYPES))
def test_every_loss_type_trains_with_every_sampler_correction_mode(build, loss, mode):
    fields = {"loss_type": loss, **LOSS_TYPES[loss]}
    if loss == "vespo" and mode.startswith("sequence"):
        from trl import GRPOTrainer  # TRL itself refuses these: ReSPOTrainer must refuse them the same way

        with pytest.raises(ValueError, match="VESPO loss requires"):
            build(trainer_cls=GRPOTrainer, vllm=True, vllm_importance_sampling_mode=mode, **fields)
        with pytest.raises(ValueError, match="VESPO loss requires"):
            build(vllm=True, vllm_importance_sampling_mode=mode, **fields)
        return
    trainer = build(vllm=True, vllm_importance_sampling_mode=mode, num_iterations=2, max_steps=2, **fields)
    with use_fake_vllm():
        trainer.train()
    logs = train_logs(trainer)
    assert all(math.isfinite(h["loss"]) for h in logs)
    assert "sampling/importance_sampling_ratio/mean" in logs[0]
    # the sampler ratio reaches the diagnostics: on the fresh pass pi_theta == pi_old, yet W = pi_theta / pi_vllm != 1
    assert logs[0]["offpolicy/log_weight/std"] > 1e-3


@pytest.mark.parametrize("mode", MODES)
def test_sampler_ratio_reaches_respo_coefficient(build, mode, monkeypatch):
    """Catches: the vLLM ratio dropped from phi, a sequence ratio added per token, token_mask kept as log-ratio -20."""
    import respo_trl.trl_loss as loss_module
    from respo_trl.kernels import respo_kernel

    records, real = [], loss_module.respo_weights

    def recording(log_ratio, advantages, mask, params, *, sampler_ratio=None, log_w=None):  # what phi was built from
        weights = real(log_ratio, advantages, mask, params, sampler_ratio=sampler_ratio, log_w=log_w)
        records.append((advantages, log_ratio, mask, sampler_ratio, log_w, weights.coefficients))
        return weights

    monkeypatch.setattr(loss_module, "respo_weights", recording)
    low, high = (0.9, 1.1) if mode.startswith("token") else (0.6, 1.2)
    trainer = build(vllm=True, vllm_importance_sampling_mode=mode,
                    vllm_importance_sampling_clip_min=low, vllm_importance_sampling_clip_max=high, max_steps=1)
    with use_fake_vllm():
        trainer.train()
    advantages, log_ratio, mask, ratio, kept_log_w, coef = records[0]
    assert kept_log_w is None  # each sample used once: W is this pass's ratio times the sampler's, never a kept one
    assert ratio is not None and ratio.shape == ((mask.shape[0], 1) if mode.startswith("sequence") else mask.shape)
    assert torch.equal(log_ratio, torch.zeros_like(log_ratio))  # fresh pass: pi_theta == pi_old exactly
    dropped = ratio == 0
    if mode.endswith("mask"):
        assert dropped.any() and (ratio[~dropped] != 1).any(), "the stand-in must produce masked and kept ratios"
    else:
        assert not dropped.any() and ((ratio - 1).abs() > 0.05).any() and (ratio <= high).all()
    kept = mask.bool() & ~dropped
    log_c = torch.where(~dropped, torch.log(ratio.clamp(min=1e-30)), 0.0)
    log_w = log_c.squeeze(-1) if mode.startswith("sequence") else (log_c * kept).sum(-1)
    expected = respo_kernel(log_w.clamp(-20, 20), advantages.squeeze(-1)).unsqueeze(-1) * kept
    torch.testing.assert_close(coef, expected)
    assert not torch.allclose(coef, mask.float())  # the ratio changed phi (dropping it would give 1 everywhere)


@pytest.mark.parametrize("loss,vllm", [("dapo", False), ("dapo", True), ("grpo", False), ("vespo", True)])
def test_baseline_through_respo_trainer_equals_trls_grpo_trainer(build, loss, vllm):
    """Same GRPOConfig fields, same seed: TRL's GRPOTrainer and ReSPOTrainer(ReSPOConfig(loss_type=...)) end with the
    same parameters after epochs of reuse (the buffer must replay TRL's order for TRL's losses)."""
    from trl import GRPOConfig, GRPOTrainer

    fields = dict(loss_type=loss, num_iterations=2, steps_per_generation=2, gradient_accumulation_steps=1,
                  per_device_train_batch_size=4, max_steps=4)
    if vllm:
        fields["vllm_importance_sampling_mode"] = "token_truncate"
    trainers = []
    for kwargs in (dict(config_cls=GRPOConfig, trainer_cls=GRPOTrainer), {}):  # built and trained one after the other:
        trainers.append(build(vllm=vllm, **kwargs, **fields))  # each seeds the global RNG when it is built
        with use_fake_vllm():
            trainers[-1].train()
    trl_trainer, ours = trainers
    theirs = snapshot(trl_trainer.model)
    for name, value in snapshot(ours.model).items():
        torch.testing.assert_close(value, theirs[name], rtol=0, atol=1e-7, msg=name)
    assert [h["loss"] for h in train_logs(ours)] == pytest.approx([h["loss"] for h in train_logs(trl_trainer)])


@pytest.mark.parametrize("moved", ["signature", "kind", "state", "class attribute"])
def test_a_trl_whose_helpers_moved_is_refused_in_one_line(build, monkeypatch, moved):
    """The seam calls TRL's helpers with TRL 1.16's signatures, reads its loss state and sets its class attributes
    (trl_surface.py): a TRL that changed a helper's shape, made a static helper an instance method, renamed a piece of
    state or a class attribute is refused when the trainer is built, in one line naming what moved and what to
    install."""
    from trl import GRPOTrainer

    import respo_trl.trl_surface as seam

    if moved == "signature":  # a future TRL whose off-policy mask takes another argument
        def get_off_policy_mask(advantages, per_token_logps, sampling_per_token_logps, mask, threshold, level):
            raise AssertionError("never called")

        monkeypatch.setattr(GRPOTrainer, "get_off_policy_mask", staticmethod(get_off_policy_mask))
        expected = "static GRPOTrainer.get_off_policy_mask(advantages, per_token_logps"
    elif moved == "kind":
        monkeypatch.setattr(GRPOTrainer, "get_off_policy_mask", lambda advantages, per_token_logps,
                            sampling_per_token_logps, mask, off_policy_threshold: None)  # fmt: skip
        expected = "static GRPOTrainer.get_off_policy_mask"
    elif moved == "state":
        monkeypatch.setattr(seam, "TRL_STATE", (*seam.TRL_STATE, "entropy_bonus_schedule"))  # renamed in a future TRL
        expected = "GRPOTrainer.entropy_bonus_schedule"
    else:  # a future TRL that names its paper differently: ReSPO's card and Hub metadata would not reach it
        for cls in GRPOTrainer.__mro__:  # TRL's base trainer reads it for the card
            if "_paper" in vars(cls):
                monkeypatch.delattr(cls, "_paper")
        expected = "GRPOTrainer._paper"
    seam.check_trl_hooks.cache_clear()
    try:
        with pytest.raises(RuntimeError, match=r"pip install 'trl>=1\.16,<1\.17'") as error:
            build()
    finally:
        seam.check_trl_hooks.cache_clear()  # the real TRL is checked again by the next trainer
    assert expected in str(error.value) and "\n" not in str(error.value)
