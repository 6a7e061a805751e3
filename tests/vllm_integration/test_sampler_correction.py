"""vLLM's own sampler log-probs reach ReSPO's W, for each of TRL's ``vllm_importance_sampling_mode`` values, and TRL's
baselines (``dapo``, VESPO) run TRL's own loss through the same vLLM path.

The engine runs in bf16 (TRL passes vLLM no dtype), the trainer in float32, so the sampler ratio pi_old / pi_vllm is
the real precision gap, not a stand-in's noise. The test picks the correction's bounds from the batch vLLM returned
(between two observed ratios), so each mode truncates or masks some tokens or sequences and keeps others."""

from __future__ import annotations

import math

import pytest
import torch
from _vllm_helpers import respo_phi, trainer_logps, unpadded

MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def bounds_between(values: list[float], low_q: float = 0.25, high_q: float = 0.75) -> tuple[float, float]:
    """Two bounds that each fall midway between consecutive observed values (so float noise of 1e-6 between two
    forwards of the same weights cannot move a ratio across a bound), near the given quantiles."""
    ordered = sorted(set(values))
    assert len(ordered) >= 4, "vLLM's ratios are all equal: no precision gap to correct"

    def between(q):
        i = min(max(int(q * (len(ordered) - 1)), 0), len(ordered) - 2)
        return (ordered[i] + ordered[i + 1]) / 2

    return between(low_q), between(high_q)


@pytest.mark.parametrize("mode", MODES)
def test_vllm_sampler_logprobs_reach_w_and_the_logged_weights(make_trainer, mode):
    """Per sequence: ``d_t = log pi_theta(y_t) - log pi_vllm(y_t)`` from vLLM's returned log-probs, the mode's
    truncation or masking with TRL's bounds, ``log W`` and ReSPO's phi; then the coefficient the loss applied and the
    logged ``offpolicy/log_weight/*`` equal that recompute. Catches: the sampler ratio dropped (W = 1 at staleness 0),
    a sequence ratio added per token, masked tokens or sequences kept, the wrong rows' log-probs."""
    trainer = make_trainer(max_steps=1, vllm_importance_sampling_correction=True, vllm_importance_sampling_mode=mode)
    model = trainer.accelerator.unwrap_model(trainer.model)
    sampled, coefficients, losses_inputs = {}, [], []
    import respo_trl.trl_loss as loss_module

    generate, weights, compute_loss = trainer.vllm_generation.generate, loss_module.respo_weights, trainer._compute_loss

    def generate_and_record(prompts, images, num_generations, profiler=None):
        output = generate(prompts, images, num_generations, profiler)
        diffs = []
        for prompt, completion, logprobs in zip(output[0], output[1], output[2]):
            vllm_side = torch.tensor([step[0] for step in logprobs])
            diff = trainer_logps(model, prompt, completion) - vllm_side
            sampled[(tuple(prompt), tuple(completion))] = diff
            diffs.append(diff)
        # the correction's bounds from this batch's ratios, read by TRL right after generation
        ratios = [v for d in diffs for v in d.exp().tolist()] if mode.startswith("token") else [
            d.sum().exp().item() for d in diffs]  # fmt: skip
        trainer.vllm_importance_sampling_clip_min, trainer.vllm_importance_sampling_clip_max = bounds_between(ratios)
        return output

    def weights_and_record(*args, **kwargs):  # what ReSPO's loss computed its coefficient with
        result = weights(*args, **kwargs)
        coefficients.append(result.coefficients)
        return result

    def loss_and_record(model_, inputs):
        losses_inputs.append(inputs)
        return compute_loss(model_, inputs)

    trainer.vllm_generation.generate = generate_and_record
    trainer._compute_loss = loss_and_record
    loss_module.respo_weights = weights_and_record
    try:
        trainer.train()
    finally:
        loss_module.respo_weights = weights

    inputs, coef = losses_inputs[0], coefficients[0]
    low, high = trainer.vllm_importance_sampling_clip_min, trainer.vllm_importance_sampling_clip_max
    expected, log_weights, dropped_any, kept_any = torch.zeros_like(coef), [], False, False
    for row in range(coef.shape[0]):
        prompt = unpadded(inputs["prompt_ids"][row], inputs["prompt_mask"][row])
        mask = inputs["completion_mask"][row].bool()
        d = sampled[(tuple(prompt), tuple(unpadded(inputs["completion_ids"][row], mask)))]
        advantage = inputs["advantages"][row].item()
        if mode == "token_truncate":
            kept, log_w = torch.ones_like(d, dtype=torch.bool), d.exp().clamp(low, high).log().sum().item()
        elif mode == "token_mask":
            kept = (d.exp() >= low) & (d.exp() <= high)
            log_w = d[kept].sum().item()
        elif mode == "sequence_truncate":
            kept, log_w = torch.ones_like(d, dtype=torch.bool), min(max(d.sum().item(), math.log(low)), math.log(high))
        else:
            inside = low <= math.exp(d.sum().item()) <= high
            kept, log_w = torch.full_like(d, inside, dtype=torch.bool), d.sum().item()
        dropped_any |= not kept.all().item()
        kept_any |= kept.any().item()
        expected[row, : len(d)] = respo_phi(log_w, advantage) * kept.float()
        if kept.any():  # a sequence the correction dropped whole has no W (not in the weight statistics)
            log_weights.append(log_w)
    torch.testing.assert_close(coef, expected, rtol=0, atol=2e-5)
    if mode.endswith("mask"):
        assert dropped_any and kept_any, "the bounds must drop some and keep some"
    else:
        assert not dropped_any
    log_weights = torch.tensor(log_weights)
    # |phi - 1| ~ |log W| / 2 here, far above the tolerance: a dropped sampler ratio (phi = 1) would fail above
    assert log_weights.abs().max() > 1e-3, "W is 1 everywhere: nothing distinguishes a dropped sampler ratio"
    logged = trainer.state.log_history[0]
    for key, value in {"mean": log_weights.mean(), "std": log_weights.std(), "min": log_weights.min(),
                       "max": log_weights.max()}.items():  # fmt: skip
        assert logged[f"offpolicy/log_weight/{key}"] == pytest.approx(value.item(), abs=2e-5), key


@pytest.mark.parametrize("loss,mode", [("dapo", "sequence_mask"), ("vespo", "token_truncate")])
def test_baselines_compute_trls_own_loss_on_vllm_rollouts(make_trainer, loss, mode):
    """On the same vLLM batch (with its sampler ratio), ReSPOTrainer's loss for a TRL loss type is TRL's
    GRPOTrainer._compute_loss to the last bit. Catches: ReSPO's kernel or a sampler fold leaking into a baseline."""
    import copy

    from trl import GRPOTrainer

    trainer = make_trainer(loss_type=loss, max_steps=2, vllm_importance_sampling_correction=True,
                           vllm_importance_sampling_mode=mode)  # fmt: skip
    pairs, compute_loss = [], trainer._compute_loss

    def both_losses(model, inputs):
        metrics = copy.deepcopy(trainer._metrics)
        with torch.no_grad():
            reference = GRPOTrainer._compute_loss(trainer, model, inputs)
        trainer._metrics = metrics  # the reference call must not double the logged metrics
        ours = compute_loss(model, inputs)
        pairs.append((ours.detach(), reference, inputs.get("importance_sampling_ratio")))
        return ours

    trainer._compute_loss = both_losses
    trainer.train()
    assert len(pairs) == 2
    for ours, reference, ratio in pairs:
        assert ratio is not None and not torch.all(ratio == 1)  # the sampler correction is in the batch
        assert torch.isfinite(ours) and torch.equal(ours, reference)


def test_vespo_with_trls_default_sequence_mask_says_what_to_change(make_trainer, monkeypatch):
    """TRL's VESPO accepts only the token modes; ReSPOConfig(loss_type='vespo') with TRL's default mode is refused in
    one line that names the setting and the values to use, before a vLLM engine is built."""
    import trl.generation.vllm_generation as generation

    from respo_trl import ReSPOConfig

    engines = []
    monkeypatch.setattr(generation, "LLM", lambda *args, **kwargs: engines.append(kwargs))
    assert ReSPOConfig(output_dir="x", use_cpu=True, bf16=False).vllm_importance_sampling_mode == "sequence_mask"
    with pytest.raises(ValueError) as refused:
        make_trainer(loss_type="vespo", max_steps=1, vllm_importance_sampling_correction=True)
    message = str(refused.value)
    assert "\n" not in message and "vllm_importance_sampling_mode" in message
    assert "'token_truncate' or 'token_mask'" in message and "sequence_mask" in message
    assert engines == []
