"""Rollout reuse with vLLM generation: the paper's staleness N and TRL's epochs R generate once per cycle, with the
weights of the cycle's start, and a checkpoint written mid-cycle resumes exactly (the buffered vLLM rollouts, not new
ones). The engine runs in float32 here, so "the weights of the cycle's start" is checked to float32 precision."""

from __future__ import annotations

import copy

import pytest
import torch
from _vllm_helpers import trainer_logps, unpadded


@pytest.mark.parametrize("reuse", [{"respo_updates_per_rollout": 2}, {"num_iterations": 2}], ids=["N=2", "R=2"])
def test_reuse_generates_once_per_cycle_with_the_cycle_start_weights(make_trainer, float32_engine, reuse):
    """Each cycle (2 optimizer steps) calls vLLM once, at its first step; every micro-batch of the cycle carries the
    log-probs vLLM returned then, which equal the policy snapshotted at the cycle's start and no longer the policy
    of a step inside the cycle. Catches: a generation per step (reuse silently off), a sync that lags a cycle,
    rows served with log-probs of another cycle."""
    trainer = make_trainer(max_steps=4, vllm_importance_sampling_correction=True, **reuse)
    model = trainer.accelerator.unwrap_model(trainer.model)
    # a fresh module, not a deepcopy: TRL patches `forward` on the policy's instance, and a copied patch would keep
    # calling the policy's own (updated) layers
    snapshot_model = type(model)(copy.deepcopy(model.config)).eval()
    generate, compute_loss = trainer.vllm_generation.generate, trainer._compute_loss
    generations, served = [], []

    def generate_and_snapshot(prompts, images, num_generations, profiler=None):
        generations.append((trainer.state.global_step, copy.deepcopy(model.state_dict())))
        return generate(prompts, images, num_generations, profiler)

    def loss_and_check(model_, inputs):
        snapshot_model.load_state_dict(generations[-1][1])
        for row in range(inputs["completion_ids"].shape[0]):
            prompt = unpadded(inputs["prompt_ids"][row], inputs["prompt_mask"][row])
            mask = inputs["completion_mask"][row].bool()
            completion = unpadded(inputs["completion_ids"][row], mask)
            stored = inputs["sampling_per_token_logps"][row][mask]
            served.append((trainer.state.global_step,
                           (stored - trainer_logps(snapshot_model, prompt, completion)).abs().max().item(),
                           (stored - trainer_logps(model, prompt, completion)).abs().max().item()))  # fmt: skip
        return compute_loss(model_, inputs)

    trainer.vllm_generation.generate = generate_and_snapshot
    trainer._compute_loss = loss_and_check
    trainer.train()
    assert [step for step, _ in generations] == [0, 2]
    assert {step for step, _, _ in served} == {0, 1, 2, 3}
    for step, to_cycle_start, to_current in served:
        assert to_cycle_start < 1e-4, f"step {step}: stored vLLM log-probs are not the cycle-start policy's"
        if step % 2 == 1:  # one update after the cycle started: the policy has moved away from those log-probs
            assert to_current > 1e-2, f"step {step}: the policy did not move; the test cannot tell cycles apart"
    staleness = [h["reuse/staleness_max"] for h in trainer.state.log_history if "reuse/staleness_max" in h]
    assert staleness == [0, 1, 0, 1]


def test_mid_cycle_checkpoint_resumes_exactly_with_vllm(make_trainer, tmp_path):
    """N = 2: a checkpoint after the cycle's first update holds the vLLM rollouts of the cycle; resuming from it
    serves them to the second update without calling vLLM and ends on the uninterrupted run's weights, bit for bit.
    Catches: the buffer not saved or not restored (the resumed run would sample anew), the wrong rows served."""
    counts = {}

    def counted(trainer, name):
        generate = trainer.vllm_generation.generate
        counts[name] = 0

        def generate_and_count(*args, **kwargs):
            counts[name] += 1
            return generate(*args, **kwargs)

        trainer.vllm_generation.generate = generate_and_count
        return trainer

    fields = {"respo_updates_per_rollout": 2, "max_steps": 2, "vllm_importance_sampling_correction": True}
    whole = counted(make_trainer(**fields, output_dir=str(tmp_path / "whole"), save_strategy="steps", save_steps=1),
                    "whole")  # fmt: skip
    whole.train()
    resumed = counted(make_trainer(**fields, output_dir=str(tmp_path / "resumed")), "resumed")
    resumed.train(resume_from_checkpoint=str(tmp_path / "whole" / "checkpoint-1"))
    assert counts == {"whole": 1, "resumed": 0}
    assert resumed.state.global_step == 2
    final, again = whole.model.state_dict(), resumed.model.state_dict()
    assert all(torch.equal(final[name], again[name]) for name in final)
    from safetensors.torch import load_file

    at_checkpoint = load_file(tmp_path / "whole" / "checkpoint-1" / "model.safetensors")
    assert any(not torch.equal(at_checkpoint[n], final[n]) for n in at_checkpoint)  # the resumed step did something
