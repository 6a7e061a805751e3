"""ReSPO's gradient through the real trainer: equal to TRL's dapo on-policy, equal to phi*A*grad logp off-policy,
and every TRL loss type's coefficient equal to the registry's (which the diagnostics rely on)."""

import copy
import math

import pytest
import torch

from respo_trl.builtin.tiny_model import tiny_qwen3


def make_batch(tokenizer, batch=8, prompt_len=5, completion_len=7, seed=0):
    gen = torch.Generator().manual_seed(seed)
    low = len(tokenizer.all_special_ids) + 2
    prompt_ids = torch.randint(low, len(tokenizer), (batch, prompt_len), generator=gen)
    completion_ids = torch.randint(low, len(tokenizer), (batch, completion_len), generator=gen)
    lengths = torch.randint(2, completion_len + 1, (batch,), generator=gen)
    completion_mask = (torch.arange(completion_len) < lengths.unsqueeze(-1)).long()
    completion_ids = torch.where(completion_mask.bool(), completion_ids, tokenizer.pad_token_id)
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": torch.ones_like(prompt_ids),
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": torch.randn(batch, generator=gen),
        "num_items_in_batch": completion_mask.sum(),
    }


def current_logps(trainer, inputs):
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model,
            torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1),
            torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1),
            inputs["completion_ids"].size(1),
        )
    return logps


def prepare(trainer):
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    return trainer


def loss_and_grads(trainer, inputs):
    trainer.model.zero_grad()
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}


def assert_same_grads(a, b):
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("with_old_logps", [True, False])
def test_on_policy_respo_gradient_equals_trl_dapo(make_trainer, tokenizer, with_old_logps):
    model = tiny_qwen3(tokenizer)
    respo = prepare(make_trainer(model=model))
    dapo = prepare(make_trainer(model=copy.deepcopy(model), loss_type="dapo"))
    inputs = make_batch(tokenizer)
    if with_old_logps:  # behaviour log-probs equal to the current ones: every ratio is exactly 1
        inputs["old_per_token_logps"] = current_logps(respo, inputs)
    loss_r, grads_r = loss_and_grads(respo, inputs)
    loss_d, grads_d = loss_and_grads(dapo, inputs)
    assert_same_grads(grads_r, grads_d)
    assert loss_r.item() == pytest.approx(-((inputs["advantages"][:, None] * current_logps(respo, inputs)) * inputs["completion_mask"]).sum().item() / inputs["num_items_in_batch"].item(), rel=1e-5)


@pytest.mark.parametrize("trust_mask", ["none", "directional"])
def test_off_policy_respo_gradient_is_phi_times_advantage_times_grad_logp(make_trainer, tokenizer, trust_mask):
    """Through the real trainer, off-policy: catches swapped branches, a dropped tilt, a length normalisation of W,
    not asked for, a trust mask on the wrong tokens (the on-policy equality above cannot see any of these)."""
    trainer = prepare(make_trainer(respo_trust_mask=trust_mask))
    inputs = make_batch(tokenizer, seed=1)
    gen = torch.Generator().manual_seed(5)
    inputs["old_per_token_logps"] = current_logps(trainer, inputs) + 0.4 * torch.randn(8, 7, generator=gen)
    _, grads = loss_and_grads(trainer, inputs)

    # By hand, straight from the paper: l = sum_t m (logp - old), phi+(W) = (1+W)/2 e^(1-W), phi-(W) = sqrt(W)
    # e^(2(1 - sqrt W)), the PPO-style directional mask, loss = -sum phi A logp / N
    trainer.model.zero_grad()
    m = inputs["completion_mask"].float()
    logps, _, _ = trainer._get_per_token_logps_and_entropies(
        trainer.model,
        torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1),
        torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1),
        7,
    )
    rho = logps.detach() - inputs["old_per_token_logps"]
    W = torch.exp((rho * m).sum(-1).clamp(-20, 20))  # the raw sequence ratio: no length normalisation
    adv = inputs["advantages"]
    phi = torch.where(adv >= 0, (1 + W) / 2 * torch.exp(1 - W), W.sqrt() * torch.exp(2 * (1 - W.sqrt())))
    assert not torch.allclose(phi, torch.ones_like(phi), atol=0.05)  # genuinely off-policy
    coef = phi[:, None] * m
    if trust_mask == "directional":
        r = torch.exp(rho)
        stop = ((adv[:, None] > 0) & (r > 1.2)) | ((adv[:, None] < 0) & (r < 0.8))
        assert stop.any() and (~stop & (m > 0)).any()
        coef = coef * (~stop)
    loss = -(coef * adv[:, None] * logps).sum() / m.sum()
    loss.backward()
    expected = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    assert_same_grads(grads, expected)


# How each TRL loss type normalises sum_t ell_it (B = 8 sequences, GA = 1, one process).
AGGREGATION = {
    "dapo": lambda m: m.sum(),
    "bnpo": lambda m: m.sum(),
    "cispo": lambda m: m.sum(),
    "vespo": lambda m: m.sum(),
    "respo": lambda m: m.sum(),
    "grpo": lambda m: m.sum(-1, keepdim=True) * m.shape[0],
    "sapo": lambda m: m.sum(-1, keepdim=True) * m.shape[0],
    "dr_grpo": lambda m: torch.tensor(m.shape[0] * 8.0),  # max_completion_length = 8
    "luspo": lambda m: torch.tensor(float(m.shape[0])),
}


MASKS = {
    "none": {},
    "entropy": {"top_entropy_quantile": 0.2},  # TRL keeps the gradient of the 20% highest-entropy tokens only
    "off_policy": {"off_policy_mask_threshold": -0.05},  # DeepSeek-V3.2 sequence mask: drops 1 of the 2 negatives
    "both": {"top_entropy_quantile": 0.2, "off_policy_mask_threshold": -0.05},  # their product, not the last one
    "tools": {},  # tool-call tokens (TRL's tool_mask) are outside the loss and outside the diagnostics
}


@pytest.mark.parametrize("masks", sorted(MASKS))
@pytest.mark.parametrize("loss_type", sorted(AGGREGATION))
def test_diagnostics_report_the_coefficients_of_the_loss_trl_really_computes(
    make_trainer, tokenizer, loss_type, masks, monkeypatch
):
    """Differentiate TRL's real loss w.r.t. the per-token log-probs, c_it = -dLoss/dlogp * norm / A_i, and check the
    registry's coefficients (without masks) and the logged throughput (always) against it. Catches diagnostics that
    ignore TRL's entropy or off-policy masks (top_entropy_quantile=0.2 would otherwise still report 1.0)."""
    from respo_trl.kernels import LossParams, gradient_coefficients, registered_loss_for

    extra = {"epsilon_high": 3.0} if loss_type == "cispo" else {}
    trainer = prepare(make_trainer(loss_type=loss_type, **extra, **MASKS[masks]))
    inputs = make_batch(tokenizer, seed=2)
    gen = torch.Generator().manual_seed(9)
    if masks == "tools":
        inputs["tool_mask"] = (torch.rand(8, 7, generator=gen) > 0.3).long()
    m = (inputs["completion_mask"] * inputs.get("tool_mask", 1)).float()
    inputs["num_items_in_batch"] = m.sum()  # TRL counts the loss mask's tokens (tool tokens excluded)
    logps = (-2 + 0.3 * torch.randn(8, 7, generator=gen)).requires_grad_(True)
    inputs["old_per_token_logps"] = logps.detach() + 0.5 * torch.randn(8, 7, generator=gen)
    entropies = torch.rand(8, 7, generator=gen)

    def fake_logps(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        return logps, entropies, None

    from trl import GRPOTrainer  # TRL's forward, under the trainer's own overrides (the loss reads it there too)

    monkeypatch.setattr(GRPOTrainer, "_get_per_token_logps_and_entropies", fake_logps)
    loss = trainer._compute_loss(trainer.model, inputs)
    (grad,) = torch.autograd.grad(loss, logps)
    adv = inputs["advantages"].unsqueeze(-1)
    from_trainer = -grad * AGGREGATION[loss_type](m) / adv * m

    if masks in ("none", "tools"):
        params = LossParams.from_config(trainer.args)
        registry = gradient_coefficients(
            registered_loss_for(loss_type), logps.detach() - inputs["old_per_token_logps"], inputs["advantages"], m, params
        )
        torch.testing.assert_close(from_trainer, registry, rtol=1e-4, atol=1e-6)
        assert not torch.allclose(registry, m)  # the batch is off-policy enough to matter
    else:
        assert (from_trainer[m > 0] == 0).any()  # the mask removed gradient the unmasked loss would have
    for sign, selected in (("pos", adv[:, 0] > 0), ("neg", adv[:, 0] < 0)):
        weight = adv[selected, 0].abs()
        expected = (weight * from_trainer[selected].sum(-1)).sum() / (weight * m[selected].sum(-1)).sum()
        logged = trainer._metrics["train"][f"starvation/grad_throughput/{sign}"][-1]
        assert logged == pytest.approx(expected.item(), rel=1e-4, abs=1e-6), sign


def test_dropping_a_nonfinite_row_keeps_the_tool_mask_and_cleans_padding(make_trainer, tokenizer):
    """A dropped row leaves the loss through TRL's tool_mask, which may already hold tool-call zeros: they stay. A kept
    row's padding may hold -inf log-probs (never read by the mask, but inf * 0 is NaN in the loss): it is filled."""
    from respo_trl.trl_loss import drop_nonfinite

    trainer = prepare(make_trainer())
    inputs = make_batch(tokenizer, seed=3)
    m = inputs["completion_mask"]
    inputs["old_per_token_logps"] = current_logps(trainer, inputs)
    inputs["tool_mask"] = torch.ones_like(m)
    inputs["tool_mask"][4, 0] = 0  # a tool-call token of a kept row
    inputs["advantages"][0] = float("nan")
    row = next(i for i in range(1, 8) if i != 4 and (m[i] == 0).any())  # a kept row with padding
    pad = int((m[row] == 0).nonzero()[0])
    inputs["old_per_token_logps"][row, pad] = float("-inf")
    out, dropped = drop_nonfinite(inputs)
    assert out["tool_mask"][0].sum() == 0 and out["tool_mask"][4, 0] == 0 and out["tool_mask"][4, 1:].eq(1).all()
    assert out["tool_mask"][1:4].eq(1).all() and torch.isfinite(out["old_per_token_logps"]).all()
    assert dropped.tolist() == [True] + [False] * 7  # padding does not make a row bad

    # vLLM's sampler ratio is checked like the log-probs: an inf in a real token drops its row, and it is filled
    inputs["importance_sampling_ratio"] = torch.ones_like(m, dtype=torch.float)
    inputs["importance_sampling_ratio"][6, 0] = float("inf")
    out, dropped = drop_nonfinite(inputs)
    assert dropped.tolist() == [True] + [False] * 5 + [True, False]
    assert torch.isfinite(out["importance_sampling_ratio"]).all() and out["tool_mask"][6].sum() == 0


def test_nonfinite_inputs_are_masked_not_propagated(make_trainer, tokenizer, tiny_model_dir):
    trainer = prepare(make_trainer(model=tiny_model_dir, beta=0.1))  # beta > 0 loads a reference model by path
    inputs = make_batch(tokenizer, seed=3)
    old = current_logps(trainer, inputs)
    inputs["old_per_token_logps"] = old.clone()
    inputs["ref_per_token_logps"] = old.clone()
    inputs["advantages"][0] = float("nan")
    inputs["old_per_token_logps"][1, 0] = float("-inf")
    inputs["ref_per_token_logps"][2, 1] = float("nan")
    loss, grads = loss_and_grads(trainer, inputs)
    assert math.isfinite(loss.item())
    assert all(torch.isfinite(g).all() for g in grads.values())
    assert trainer._metrics["train"]["respo/nonfinite_seqs"][-1] == 3

    # The surviving sequences train exactly as if the bad ones were absent from the loss.
    clean = {k: (v[3:] if torch.is_tensor(v) and v.dim() > 0 else v) for k, v in inputs.items()}
    clean["num_items_in_batch"] = inputs["num_items_in_batch"]
    _, grads_clean = loss_and_grads(trainer, clean)
    assert_same_grads(grads, grads_clean)

    # Per-token advantages (B, T): a NaN in one token drops that row, and the rest train as without it.
    per_token = dict(inputs, old_per_token_logps=old.clone(), ref_per_token_logps=old.clone())
    advantages = make_batch(tokenizer, seed=3)["advantages"]
    per_token["advantages"] = advantages.unsqueeze(-1).expand_as(old).clone()
    per_token["advantages"][1, 2] = float("nan")
    loss, grads = loss_and_grads(trainer, per_token)
    assert math.isfinite(loss.item()) and trainer._metrics["train"]["respo/nonfinite_seqs"][-1] == 1
    rest = {k: (torch.cat([v[:1], v[2:]]) if torch.is_tensor(v) and v.dim() > 0 else v) for k, v in per_token.items()}
    rest["num_items_in_batch"] = per_token["num_items_in_batch"]
    _, grads_rest = loss_and_grads(trainer, rest)
    assert_same_grads(grads, grads_rest)


# TRL's loss terms around the policy term, each of which ReSPO's loss (trl_loss.py) computes as TRL's vespo branch does
TRL_TERMS = {
    "plain": {},
    "kl": {"beta": 0.1},  # the reference model's KL, with TRL's default importance-weight bias correction
    "kl_sequence": {"beta": 0.1, "importance_sampling_level": "sequence"},  # VESPO refuses it; compared with grpo's KL
    "entropy_mask": {"top_entropy_quantile": 0.5},
    "off_policy_mask": {"off_policy_mask_threshold": 0.05},
    "entropy_bonus": {"entropy_coef": 0.01},
    "adaptive_entropy": {"use_adaptive_entropy": True, "entropy_target": 5.0, "entropy_coef": 0.02},
    "moe_aux": {"router_aux_loss_coef": 0.01},
}


@pytest.mark.parametrize("terms", sorted(TRL_TERMS))
def test_respo_loss_is_trls_vespo_branch_in_every_term(make_trainer, tokenizer, tiny_model_dir, terms):
    """The seam's promise, against TRL's own loss: with both branches VESPO's, ReSPO's loss (trl_loss.respo_grpo_loss) gives
    TRL's ``vespo`` loss, gradients and logged metrics for every term TRL adds around the policy term (KL and its bias
    correction, entropy and off-policy masks, static and adaptive entropy bonus, MoE auxiliary loss). A TRL release
    that changes one of them fails here. (For ``importance_sampling_level="sequence"``, which VESPO refuses, the KL's
    sequence-level correction is compared through ``dapo``, whose coefficient is ReSPO's on-policy.)"""
    from trl import GRPOConfig, GRPOTrainer

    fields = dict(TRL_TERMS[terms])
    moe = terms == "moe_aux"
    model = tiny_model_dir if fields.get("beta") else tiny_qwen3(tokenizer, moe=moe)
    copy_of = (lambda m: m) if isinstance(model, str) else copy.deepcopy
    baseline = "dapo" if terms == "kl_sequence" else "vespo"
    branches = {} if baseline == "dapo" else {"respo_pos_branch": "vespo", "respo_neg_branch": "vespo"}
    ours = prepare(make_trainer(model=copy_of(model), **branches, **fields))
    theirs = prepare(make_trainer(model=copy_of(model), loss_type=baseline, config_cls=GRPOConfig,
                                  trainer_cls=GRPOTrainer, **fields))  # fmt: skip
    inputs = make_batch(tokenizer, seed=5)
    gen = torch.Generator().manual_seed(2)
    fresh = current_logps(ours, inputs)
    off_policy = 0.0 if baseline == "dapo" else 0.3  # dapo equals ReSPO only on-policy
    inputs["old_per_token_logps"] = fresh + off_policy * torch.randn(8, 7, generator=gen)
    if fields.get("beta"):
        inputs["ref_per_token_logps"] = fresh + 0.2 * torch.randn(8, 7, generator=gen)
    for step in range(2):  # the adaptive coefficient moves after the first step
        loss_o, grads_o = loss_and_grads(ours, inputs)
        loss_t, grads_t = loss_and_grads(theirs, inputs)
        if baseline == "vespo":
            assert loss_o.item() == pytest.approx(loss_t.item(), rel=1e-5, abs=1e-7), step
        assert_same_grads(grads_o, grads_t)
    for key in ("entropy", "kl", "entropy_coef", "policy_loss", "aux_loss"):
        theirs_logged = theirs._metrics["train"].get(key)
        if theirs_logged:
            if key == "policy_loss" and baseline == "dapo":
                continue  # dapo's surrogate value differs from -phi A log pi; only its gradient is ReSPO's
            assert ours._metrics["train"][key] == pytest.approx(theirs_logged, rel=1e-5, abs=1e-7), key


@pytest.mark.parametrize("sampler", [None, "token_truncate", "token_mask"])
def test_respo_with_both_branches_vespo_trains_exactly_as_trls_vespo(make_trainer, tokenizer, sampler):
    """The branch option reuses TRL's VESPO weight, off-policy, through the real trainer, against TRL's own
    ``GRPOTrainer(loss_type="vespo")``: so an ablation arm that swaps one branch differs from ReSPO (or VESPO) by that
    branch only, in every sampler-correction mode VESPO accepts. Catches constants read from the wrong config fields,
    a coefficient that is not VESPO's on either sign, and a token the sampler masked (ratio 0) dropped from ``W`` as
    ReSPO does, where VESPO floors its ratio at 1e-8 and so gives the whole sequence a weight near 0."""
    from trl import GRPOConfig, GRPOTrainer

    model = tiny_qwen3(tokenizer)
    both = prepare(make_trainer(model=model, respo_pos_branch="vespo", respo_neg_branch="vespo"))
    vespo = prepare(make_trainer(model=copy.deepcopy(model), loss_type="vespo", config_cls=GRPOConfig,
                                 trainer_cls=GRPOTrainer))  # fmt: skip
    respo = prepare(make_trainer(model=copy.deepcopy(model)))
    inputs = make_batch(tokenizer, seed=3)
    gen = torch.Generator().manual_seed(9)
    inputs["old_per_token_logps"] = current_logps(both, inputs) + 0.3 * torch.randn(8, 7, generator=gen)
    if sampler is not None:  # what TRL's vLLM correction leaves in the batch: truncated ratios, and 0 where masked
        ratio = torch.empty(8, 7).uniform_(0.5, 1.5, generator=gen)
        ratio = torch.where(inputs["completion_mask"].bool(), ratio, 1.0)  # padding: exp(0), as TRL computes it
        if sampler == "token_mask":
            ratio[2, 1] = ratio[5, 0] = 0.0
        inputs["importance_sampling_ratio"] = ratio
    loss_b, grads_b = loss_and_grads(both, inputs)
    loss_v, grads_v = loss_and_grads(vespo, inputs)
    _, grads_r = loss_and_grads(respo, inputs)
    assert loss_b.item() == pytest.approx(loss_v.item(), rel=1e-5)
    assert_same_grads(grads_b, grads_v)
    assert any(not torch.allclose(grads_r[n], grads_v[n], rtol=1e-3) for n in grads_v)  # the kernels do differ here


def test_the_sampler_gap_alarm_fires_once_on_fresh_rollouts_and_stays_quiet_below_its_threshold(
    make_trainer, tokenizer, caplog
):
    """With TRL's vLLM correction on, ``log W`` of a fresh rollout is the engine's rounding only
    (docs/benchmarks/real_stack.md, section 7): past ``SAMPLER_GAP_STD`` the trainer says what to set, once. Catches an
    alarm that never fires, fires on stale steps (where policy movement is the point of W), fires without the
    correction, or fires every step."""
    import logging

    from respo_trl.diagnostics import SAMPLER_GAP_STD

    trainer = prepare(make_trainer())
    trainer.use_vllm = trainer.vllm_importance_sampling_correction = True  # a fake engine: only its ratios are read
    inputs = make_batch(tokenizer, seed=4)
    inputs["old_per_token_logps"] = current_logps(trainer, inputs)  # fresh: pi_theta = pi_old
    gen = torch.Generator().manual_seed(0)

    def step(token_sd, staleness=0, correction=True):
        trainer.vllm_importance_sampling_correction = correction
        noise = token_sd * torch.randn(8, 7, generator=gen)
        ratio = torch.where(inputs["completion_mask"].bool(), noise.exp(), 1.0)
        batch = dict(inputs, importance_sampling_ratio=ratio, respo_staleness=torch.full((8,), staleness))  # as served
        with caplog.at_level(logging.WARNING, logger="respo_trl.trainer"):
            caplog.clear()
            trainer._compute_loss(trainer.model, batch)
        return [r.getMessage() for r in caplog.records if "offpolicy/log_weight/std is" in r.getMessage()]

    assert step(0.01) == []  # a float32-like engine: std ~0.03
    assert trainer._metrics["train"]["offpolicy/log_weight/std"][-1] < SAMPLER_GAP_STD
    assert step(1.0, staleness=1) == []  # stale rows: W is meant to move
    assert step(1.0, correction=False) == []  # no correction, no sampler ratio in W
    loud = step(1.0)
    assert trainer._metrics["train"]["offpolicy/log_weight/std"][-1] > SAMPLER_GAP_STD
    assert len(loud) == 1 and "vllm_importance_sampling_correction: false" in loud[0]
    assert "cast_lm_head_to_fp32: true" in loud[0] and "\n" not in loud[0]
    assert step(1.0) == []  # once per run


@pytest.mark.parametrize("loss_type", ["respo", "dapo", "vespo"])
def test_a_dropped_row_with_an_extreme_forward_adds_no_nan_through_the_kl(make_trainer, tokenizer, tiny_model_dir,
                                                                          monkeypatch, loss_type):
    """A row dropped for a NaN reference log-prob (its reference becomes 0) whose current log-probs are very low would
    give exp(ref - log pi) = inf in the KL term and inf * 0 = NaN in the masked sum; the loss forward counts a dropped
    row as log-prob 0, for every loss type (as 0.4 did). Catches a NaN loss from one bad row."""
    from trl import GRPOTrainer

    trainer = prepare(make_trainer(model=tiny_model_dir, beta=0.1, loss_type=loss_type))
    inputs = make_batch(tokenizer, seed=6)
    forward = GRPOTrainer._get_per_token_logps_and_entropies

    def extreme(self, *args, **kwargs):
        logps, entropies, aux = forward(self, *args, **kwargs)
        return torch.cat([logps[:2], logps[2:3] - 120.0, logps[3:]]), entropies, aux  # row 2: ~e^-120 per token

    monkeypatch.setattr(GRPOTrainer, "_get_per_token_logps_and_entropies", extreme)
    old = current_logps(trainer, inputs)
    inputs["old_per_token_logps"] = old.clone()
    inputs["ref_per_token_logps"] = old.clone()
    inputs["ref_per_token_logps"][2, 0] = float("nan")
    loss, grads = loss_and_grads(trainer, inputs)
    assert math.isfinite(loss.item()) and all(torch.isfinite(g).all() for g in grads.values())
    assert trainer._metrics["train"]["respo/nonfinite_seqs"][-1] == 1 and math.isfinite(trainer._metrics["train"]["kl"][-1])


def test_vespo_branches_with_per_token_advantages_follow_each_tokens_sign(make_trainer, tokenizer):
    """TRL picks VESPO's constants per token (``torch.where(advantages >= 0, ...)``): with (B, T) advantages whose sign
    changes inside a sequence, ReSPO with both branches VESPO's trains as ``trl.GRPOTrainer(loss_type="vespo")``.
    Catches constants taken from the first token's sign."""
    from trl import GRPOConfig, GRPOTrainer

    model = tiny_qwen3(tokenizer)
    both = prepare(make_trainer(model=model, respo_pos_branch="vespo", respo_neg_branch="vespo"))
    vespo = prepare(make_trainer(model=copy.deepcopy(model), loss_type="vespo", config_cls=GRPOConfig,
                                 trainer_cls=GRPOTrainer))  # fmt: skip
    inputs = make_batch(tokenizer, seed=8)
    gen = torch.Generator().manual_seed(3)
    inputs["old_per_token_logps"] = current_logps(both, inputs) + 0.3 * torch.randn(8, 7, generator=gen)
    inputs["advantages"] = torch.randn(8, 7, generator=gen)  # mixed signs within a sequence
    loss_b, grads_b = loss_and_grads(both, inputs)
    loss_v, grads_v = loss_and_grads(vespo, inputs)
    assert loss_b.item() == pytest.approx(loss_v.item(), rel=1e-5)
    assert_same_grads(grads_b, grads_v)


@pytest.mark.parametrize("loss_type", ["respo", "dapo"])
def test_one_call_computes_the_loss_its_metrics_and_a_frozen_result(make_trainer, tokenizer, loss_type):
    """Issue 52, items 2-3: ``trl_loss.micro_batch_loss`` is the whole micro-batch loss: called directly with the
    trainer's TRL context it gives the loss, gradient and metrics the trainer returns and logs (the trainer adds
    nothing but the buffer's reuse metrics), the ReSPO branch cleans the forward's log-probs itself (a dropped row
    whose forward underflows to -inf gives no NaN, and the trainer's TRL-forward record is never opened for it), and
    the result cannot be changed after the fact. Catches: aggregation, masks or entropy left in the trainer, a clean
    that only happens inside the trainer's hook, a result a later step could edit."""
    from respo_trl.trl_loss import LossResult, micro_batch_loss

    trainer = prepare(make_trainer(loss_type=loss_type, entropy_coef=0.01, top_entropy_quantile=0.5))
    inputs = make_batch(tokenizer, seed=6)
    gen = torch.Generator().manual_seed(3)
    inputs["old_per_token_logps"] = current_logps(trainer, inputs) + 0.3 * torch.randn(8, 7, generator=gen)
    inputs["respo_staleness"] = torch.ones(8, dtype=torch.long)
    inputs["advantages"][2] = float("nan")  # row 2 leaves the loss
    opened = []
    forward = trainer._get_per_token_logps_and_entropies

    def underflowing(model, *args, **kwargs):  # TRL's forward, with row 2's log-probs at -inf
        opened.append(trainer._trl_forward is not None)
        logps, entropies, aux = forward(model, *args, **kwargs)
        return logps.index_fill(0, torch.tensor([2]), float("-inf")), entropies, aux

    trainer._get_per_token_logps_and_entropies = underflowing
    context = trainer._trl_context(trainer.model, training=True)
    trainer.model.zero_grad()
    result = micro_batch_loss(inputs, context)
    result.loss.backward()
    direct = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    assert isinstance(result, LossResult) and math.isfinite(result.loss.item())
    with pytest.raises(AttributeError):
        result.loss = torch.tensor(0.0)  # frozen
    assert opened and not any(opened) if loss_type == "respo" else all(opened)  # TRL's own forward only for TRL's loss
    assert (result.weights is not None) == (loss_type == "respo")
    for key in ("respo/nonfinite_seqs", "offpolicy/log_weight/mean"):
        assert key in result.metrics
    assert result.metrics["respo/nonfinite_seqs"] == 1
    if loss_type == "respo":  # TRL's metrics come back from the loss, not from the trainer
        assert {"entropy", "policy_loss", "entropy_coef"} <= result.metrics.keys()
    trainer._metrics["train"].clear()
    loss, grads = loss_and_grads(trainer, inputs)
    assert loss.item() == result.loss.item()
    assert_same_grads(direct, grads)
    logged = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    for key, value in result.metrics.items():
        if key in logged:  # (TRL's own loss logs its metrics itself)
            assert logged[key] == pytest.approx(value, nan_ok=True), key
    assert {"reuse/staleness_mean", "reuse/refreshes"} <= logged.keys() and logged["reuse/staleness_mean"] == 1.0


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_trls_own_losses_keep_trls_adaptive_entropy(make_trainer, tokenizer, loss_type):
    """TRL's own loss types run TRL's ``_compute_loss``, which moves TRL's adaptive entropy coefficient on the trainer:
    through ``ReSPOTrainer`` it moves exactly as in ``trl.GRPOTrainer``, step after step, with the same gradients.
    Catches the state read before the loss being written back over TRL's update (0.8's first version: the coefficient
    never moved and the bonus was never applied; found by a side-by-side review against 0.7)."""
    from trl import GRPOConfig, GRPOTrainer

    fields = {"loss_type": loss_type, "use_adaptive_entropy": True, "entropy_target": 5.0, "entropy_coef": 0.02,
              "entropy_coef_delta": 0.05}  # fmt: skip
    model = tiny_qwen3(tokenizer)
    ours = prepare(make_trainer(model=model, **fields))
    theirs = prepare(make_trainer(model=copy.deepcopy(model), config_cls=GRPOConfig, trainer_cls=GRPOTrainer, **fields))
    inputs = make_batch(tokenizer, seed=8)
    inputs["old_per_token_logps"] = current_logps(ours, inputs)
    coefficients = []
    for step in range(3):  # the coefficient applied from the second step on is the one the first moved
        loss_o, grads_o = loss_and_grads(ours, inputs)
        loss_t, grads_t = loss_and_grads(theirs, inputs)
        assert loss_o.item() == pytest.approx(loss_t.item(), rel=1e-6, abs=1e-8), step
        assert_same_grads(grads_o, grads_t)
        assert (ours.entropy_coef, ours._last_world_entropy) == (theirs.entropy_coef, theirs._last_world_entropy)
        coefficients.append(ours.entropy_coef)
    assert coefficients[0] != coefficients[-1]  # it moved: the test can tell a frozen coefficient apart
