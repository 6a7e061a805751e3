"""respo_trl.diagnostics on hand-built batches: every logged number recomputed by hand, edge cases included.

The batch has what a real micro-batch can have and the trainer tests rarely combine: unequal lengths (one of a single
token), a sequence with no loss token, one the sampler correction dropped whole, a kept sequence with a sampler ratio
that is not 1, an advantage of exactly 0, non-default kernel constants and per-token advantages. Each assertion names
the bug it catches. (Mutation testing of diagnostics.py found these gaps: docs/testing.md.)
"""

import dataclasses
import math

import pytest
import torch

from respo_trl import kernels as K
from respo_trl.diagnostics import LOW_WEIGHT_SUMS, pooled_low_weight, sequence_stats, summarize

# rows: 0 long positive (low W), 1 one-token positive, 2 three-token negative, 3 positive with no loss token,
#       4 negative dropped by the sampler, 5 advantage exactly 0, 6 positive with sampler ratio 0.5
LENGTHS = [6, 1, 3, 0, 4, 5, 4]
ADV = torch.tensor([1.0, 0.5, -1.0, 2.0, -0.5, 0.0, 0.7])


def batch(seed=0):
    gen = torch.Generator().manual_seed(seed)
    width = max(LENGTHS)
    mask = (torch.arange(width)[None, :] < torch.tensor(LENGTHS)[:, None]).float()
    log_ratio = 0.4 * torch.randn(len(LENGTHS), width, generator=gen)
    log_ratio[0, :6] = -0.3  # log W = -1.8: a low-weight positive
    ratio = torch.ones(len(LENGTHS), 1)
    ratio[4] = 0.0  # sequence_mask dropped it
    ratio[6] = 0.5  # kept, its sampler correction moves W
    return log_ratio, mask, ratio


def test_every_metric_by_hand():
    log_ratio, mask, ratio = batch()
    params = K.LossParams(respo_beta_pos=0.25, respo_lambda_neg=1.0, vespo_k_pos=1.5)  # not the defaults
    table = sequence_stats(log_ratio, ADV, mask, params, "respo", sampler_ratio=ratio)
    m = summarize(table)

    kept = mask.bool() & (ratio > 0)
    log_c = torch.where(ratio > 0, torch.log(ratio.clamp(min=1e-30)), 0.0)
    log_w = ((log_ratio * kept).sum(-1) + log_c.squeeze(-1)).clamp(-20, 20)
    assert log_w[6] == pytest.approx((log_ratio[6, :4]).sum().item() + math.log(0.5), abs=1e-5)  # correction in W
    phi = K.respo_kernel(log_w, ADV, **params.respo_constants())  # the config's constants, not the paper's
    c = K.gradient_coefficients("respo", log_ratio, ADV, mask, params, sampler_ratio=ratio) * mask
    lengths = mask.sum(-1)
    valid = lengths > 0  # row 3 has no loss token: left out everywhere
    has_w = valid & kept.any(-1)  # row 4 was dropped by the sampler: no W
    cbar = c.sum(-1) / lengths.clamp(min=1)

    clip = K.gradient_coefficients("ppo", log_ratio, ADV, mask, params, sampler_ratio=ratio) * mask
    clip_bar = clip.sum(-1) / lengths.clamp(min=1)
    for sign, sel in (("pos", valid & (ADV > 0)), ("neg", valid & (ADV < 0))):  # A = 0 is neither
        w = ADV[sel].abs()
        assert m[f"starvation/grad_throughput/{sign}"] == pytest.approx(
            ((w * c[sel].sum(-1)).sum() / (w * lengths[sel]).sum()).item(), rel=1e-5)  # fmt: skip
        assert m[f"starvation/starved_frac/{sign}"] == pytest.approx((cbar[sel] < 0.1).float().mean().item())
        assert m[f"starvation/clip_starved_frac/{sign}"] == pytest.approx((clip_bar[sel] < 0.1).float().mean().item())
        phi_sel = has_w & (ADV > 0 if sign == "pos" else ADV < 0)
        assert m[f"respo/phi_mean/{sign}"] == pytest.approx(phi[phi_sel].mean().item(), rel=1e-5)
    # the clipped counterfactual is token-level PPO on the same batch, times the sampler ratio as TRL applies it
    sel = valid & (ADV < 0)
    assert m["starvation/clip_grad_throughput/neg"] == pytest.approx(
        ((ADV[sel].abs() * clip[sel].sum(-1)).sum() / (ADV[sel].abs() * lengths[sel]).sum()).item(), rel=1e-5)  # fmt: skip

    # positive-branch diagnostic: positives with W (rows 0, 1, 6), low = log W < -1 (row 0)
    pos = has_w & (ADV > 0)
    low = pos & (log_w < -1)
    assert (m["starvation/low_weight_pos/n"], m["starvation/low_weight_pos/n_low"]) == (pos.sum().item(), 1.0)
    assert m["starvation/low_weight_pos/mass"] == pytest.approx(cbar[pos].sum().item(), rel=1e-5)  # mean coefficient
    assert m["starvation/low_weight_pos/mass_low"] == pytest.approx(cbar[low].sum().item(), rel=1e-5)
    assert m["starvation/low_weight_pos/respo_mass_low"] == pytest.approx(phi[low].sum().item(), rel=1e-5)
    vespo = K.vespo_phi(log_ratio, ADV, kept, params, ratio).reshape(-1)
    assert m["starvation/low_weight_pos/vespo_mass"] == pytest.approx(vespo[pos].sum().item(), rel=1e-5)
    assert m["starvation/low_weight_pos/vespo_mass"] != pytest.approx(m["starvation/low_weight_pos/respo_mass"])
    assert m["starvation/low_weight_pos/share"] == pytest.approx(1 / 3)
    assert m["starvation/pos_length_mean"] == pytest.approx(lengths[pos].mean().item())

    tokens = lengths[valid].sum()
    assert m["starvation/zero_coef_token_frac"] == pytest.approx((((c == 0) & mask.bool()).sum() / tokens).item())
    rho = log_ratio[has_w][kept[has_w]]
    assert m["offpolicy/kl"] == pytest.approx((torch.expm1(rho) - rho).mean().item(), rel=1e-5)  # k3, kept tokens
    assert m["offpolicy/log_weight/mean"] == pytest.approx(log_w[has_w].mean().item(), rel=1e-5)
    assert m["offpolicy/log_weight/std"] == pytest.approx(log_w[has_w].std().item(), rel=1e-5)
    assert m["offpolicy/log_weight/min"] == pytest.approx(log_w[has_w].min().item())
    assert m["offpolicy/log_weight/max"] == pytest.approx(log_w[has_w].max().item())
    assert m["offpolicy/ess"] == pytest.approx(K.kish_ess(log_w[has_w]).item(), rel=1e-5)
    assert m["respo/trust_masked_frac"] == 0.0  # no mask in this config


def test_trust_mask_share_is_respos_only_and_the_clipped_counterfactual_is_token_level():
    log_ratio, mask, _ = batch(1)
    params = K.LossParams(respo_trust_mask=True, importance_sampling_level="sequence", epsilon_low=3e-4,
                          epsilon_high=4e-4, trust_epsilon_low=0.2, trust_epsilon_high=0.2)  # fmt: skip
    respo = summarize(sequence_stats(log_ratio, ADV, mask, params, "respo"))
    dapo = summarize(sequence_stats(log_ratio, ADV, mask, params, "ppo"))  # a baseline whose config reuses samples
    stopped = (K.directional_trust_mask(log_ratio, ADV, mask, 0.2, 0.2) == 0) & mask.bool()
    assert stopped.any() and respo["respo/trust_masked_frac"] == pytest.approx((stopped.sum() / mask.sum()).item())
    assert dapo["respo/trust_masked_frac"] == 0.0  # the mask is ReSPO's: a TRL loss never reports it
    token = dataclasses.replace(params, importance_sampling_level="token")
    clip = K.gradient_coefficients("ppo", log_ratio, ADV, mask, token) * mask
    sel = (mask.sum(-1) > 0) & (ADV > 0)
    expected = (ADV[sel] * clip[sel].sum(-1)).sum() / (ADV[sel] * mask.sum(-1)[sel]).sum()
    assert respo["starvation/clip_grad_throughput/pos"] == pytest.approx(expected.item(), rel=1e-5)


def test_per_token_advantages_are_summarised_by_their_masked_mean():
    log_ratio, mask, _ = batch(2)
    per_token = ADV[:, None] * (1 + torch.arange(mask.shape[1]))[None, :] * mask  # varies along the sequence
    table = sequence_stats(log_ratio, per_token, mask, K.LossParams(), "ppo")
    expected = (per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    torch.testing.assert_close(table[:, 2], expected)  # the advantage column


def test_empty_groups_are_nan_not_zero_or_an_error():
    mask = torch.ones(1, 4)
    m = summarize(sequence_stats(torch.zeros(1, 4), torch.tensor([-1.0]), mask, K.LossParams(), "respo"))
    assert math.isnan(m["starvation/grad_throughput/pos"]) and math.isnan(m["respo/phi_mean/pos"])
    assert math.isnan(m["starvation/low_weight_pos/share"]) and m["starvation/low_weight_pos/n"] == 0.0
    assert math.isnan(m["offpolicy/log_weight/std"])  # one weight has no spread
    assert m["offpolicy/log_weight/min"] == m["offpolicy/log_weight/max"] == 0.0
    empty = summarize(sequence_stats(torch.zeros(1, 4), torch.tensor([1.0]), torch.zeros(1, 4), K.LossParams(), "respo"))
    for key in ("offpolicy/log_weight/mean", "offpolicy/log_weight/min", "offpolicy/ess", "offpolicy/kl",
                "starvation/zero_coef_token_frac", "starvation/pos_length_mean"):  # fmt: skip
        assert math.isnan(empty[key]), key


def test_pooled_ratios_from_sums_and_missing_parts():
    sums = {"n": 10.0, "n_low": 2.0, "mass": 8.0, "mass_low": 4.0, "respo_mass": 12.0, "respo_mass_low": 3.0}
    out = pooled_low_weight(sums)
    assert out["share"] == 0.2 and out["mass_share"] == 0.5 and out["mass_ratio"] == pytest.approx(2.5)
    assert out["respo_mass_share"] == 0.25 and out["respo_mass_ratio"] == pytest.approx(1.25)
    assert math.isnan(out["vespo_mass_share"])  # no VESPO sums: undefined, not 0
    none = pooled_low_weight({})
    assert all(math.isnan(v) for v in none.values())
    no_low = pooled_low_weight({"n": 4.0, "n_low": 0.0, "mass": 4.0, "mass_low": 0.0})
    assert no_low["share"] == 0.0 and no_low["mass_share"] == 0.0 and math.isnan(no_low["mass_ratio"])
    assert set(LOW_WEIGHT_SUMS) >= {"n", "n_low", "mass", "mass_low", "respo_mass", "vespo_mass_low"}


def test_edge_values_of_the_positive_branch_and_the_throughput():
    """log W exactly -1 is not low weight (the paper: log W < -1); a one-token positive's mean coefficient is its
    coefficient; two weights have a spread; a starved positive under clipped PPO counts, an A = 0 response does not;
    a throughput whose on-policy mass is below 1 is still a ratio."""
    log_ratio = torch.tensor([[-1.0, 0.0, 0.0], [0.6, 0.0, 0.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [1.0, 1.0, 0.0]])
    adv = torch.tensor([0.01, 0.02, 0.0])
    m = summarize(sequence_stats(log_ratio, adv, mask, K.LossParams(), "ppo"))
    assert m["starvation/low_weight_pos/n"] == 2.0 and m["starvation/low_weight_pos/n_low"] == 0.0  # -1 is not < -1
    c = K.gradient_coefficients("ppo", log_ratio, adv, mask, K.LossParams()) * mask
    assert c[1, 0] == 0  # r = e^0.6 > 1.2 with A > 0: clipped, the one-token positive is starved
    assert m["starvation/starved_frac/pos"] == 0.5 and m["starvation/clip_starved_frac/pos"] == 0.5
    expected = (0.01 * c[0].sum() + 0.02 * c[1].sum()) / (0.01 * 3 + 0.02 * 1)  # on-policy mass 0.05 < 1
    assert m["starvation/grad_throughput/pos"] == pytest.approx(expected.item(), rel=1e-5)
    assert m["starvation/low_weight_pos/mass"] == pytest.approx((c[0].sum() / 3 + c[1].sum()).item(), rel=1e-5)
    two = summarize(sequence_stats(log_ratio[:2], adv[:2], mask[:2], K.LossParams(), "ppo"))
    assert two["offpolicy/log_weight/std"] == pytest.approx(torch.tensor([-1.0, 0.6]).std().item())


def test_per_token_advantages_on_two_token_rows():
    log_ratio, mask = torch.zeros(3, 2), torch.ones(3, 2)
    per_token = torch.tensor([[1.0, 3.0], [-1.0, -3.0], [2.0, 2.0]])
    table = sequence_stats(log_ratio, per_token, mask, K.LossParams(), "ppo")
    torch.testing.assert_close(table[:, 2], torch.tensor([2.0, -2.0, 2.0]))


def test_pooled_ratios_with_parts_missing_or_small():
    small = pooled_low_weight({"n": 1.0, "n_low": 1.0, "mass": 0.5, "mass_low": 0.5})
    assert small["share"] == 1.0 and small["mass_share"] == 1.0 and small["mass_ratio"] == 1.0
    partial = pooled_low_weight({"n": 4.0, "mass": 2.0})  # sums logged before any low-weight count exists
    assert partial["share"] == 0.0 and partial["mass_share"] == 0.0
    assert math.isnan(pooled_low_weight({"n": 0.0, "mass": 1.0, "mass_low": 1.0})["mass_share"])


def test_positive_low_weight_stats_is_the_pooled_diagnostic_of_one_batch():
    from respo_trl.diagnostics import positive_low_weight_stats

    log_w = torch.tensor([-3.0, -0.5, 0.2, -2.0, -4.0])
    coefficient = torch.tensor([1.3, 1.0, 0.8, 1.2, 0.7])
    adv = torch.tensor([1.0, 1.0, 0.5, -1.0, 0.0])
    valid = torch.tensor([True, True, True, True, False])
    adv = adv.clone()
    adv[4] = 1.0  # an invalid positive (no loss token): left out when valid is given
    out = positive_low_weight_stats(log_w, coefficient, adv, valid)
    assert out["share"] == pytest.approx(1 / 3) and out["mass_share"] == pytest.approx(1.3 / 3.1)
    assert out["mass_ratio"] == pytest.approx((1.3 / 3.1) * 3)
    assert positive_low_weight_stats(log_w, coefficient, adv, valid, threshold=-0.4)["share"] == pytest.approx(2 / 3)
    assert math.isnan(positive_low_weight_stats(log_w, coefficient, -adv.abs() - 1)["share"])  # no positives
    assert positive_low_weight_stats(log_w, coefficient, adv)["share"] == pytest.approx(2 / 4)  # without valid: all
    adv[4] = 0.0
    assert positive_low_weight_stats(log_w, coefficient, adv)["share"] == pytest.approx(1 / 3)  # A = 0 is no positive


def test_a_partly_clipped_positive_is_starved_by_its_mean_coefficient():
    """The mean coefficient divides by the length (0.05 here: starved), also for one-token rows (0.15: not starved)."""
    log_ratio = torch.tensor([[1.0, 1.0, -1.9], [-1.9, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    m = summarize(sequence_stats(log_ratio, torch.tensor([1.0, 1.0]), mask, K.LossParams(), "ppo"))
    c = K.gradient_coefficients("ppo", log_ratio, torch.tensor([1.0, 1.0]), mask, K.LossParams()) * mask
    assert c[0].sum() / 3 < 0.1 < c[1, 0]  # r = e^-1.9 = 0.15 on the one unclipped token of each row
    assert m["starvation/clip_starved_frac/pos"] == 0.5 and m["starvation/starved_frac/pos"] == 0.5


def test_an_ablation_arms_logged_phi_is_the_coefficient_its_loss_applies_under_token_mask():
    """With VESPO's negative branch and vLLM's token_mask correction, the loss gives a sequence with a masked token
    VESPO's weight (the masked ratio floored at 1e-8: ~0); the logged phi must say so, not ReSPO's log W over the kept
    tokens (which would read ~1). Catches a diagnostic that describes another kernel than the one trained."""
    from respo_trl.diagnostics import COLUMNS

    params = K.LossParams(respo_neg_branch="vespo")
    log_ratio = torch.zeros(2, 4)
    advantages = torch.tensor([-1.0, -1.0])
    mask = torch.ones(2, 4)
    ratio = torch.ones(2, 4)
    ratio[0, 1] = 0.0  # row 0: one token masked by the sampler correction
    table = sequence_stats(log_ratio, advantages, mask, params, "respo", sampler_ratio=ratio)
    col = {name: table[:, i] for i, name in enumerate(COLUMNS)}
    applied = col["mass"] / col["length"]  # the loss's mean coefficient per token
    assert col["phi"][0] < 1e-6 and col["phi"][0] == pytest.approx(col["vespo_phi"][0])
    assert applied[0] < 1e-6 and col["phi"][1] == pytest.approx(1.0) and applied[1] == pytest.approx(1.0)


def test_kept_first_pass_weight_drives_the_logged_coefficients_not_the_current_w():
    """Under respo_epoch_weight="first_pass" the loss applies phi(kept W): the diagnostics' mass and phi columns are
    that coefficient's, while log_weight stays the current W (how far the policy moved). Catches the diagnostics
    reporting the current-W coefficient the loss no longer applies."""
    import torch

    from respo_trl.diagnostics import COLUMNS, sequence_stats
    from respo_trl.kernels import LossParams, respo_kernel

    gen = torch.Generator().manual_seed(0)
    log_ratio, mask = 0.3 * torch.randn(4, 5, generator=gen), torch.ones(4, 5)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    kept = torch.tensor([-1.5, 1.0, float("nan"), 0.0])  # row 2 on its first pass: its current W is used
    table = sequence_stats(log_ratio, adv, mask, LossParams(), "respo", kept_log_w=kept)
    col = {name: table[:, i] for i, name in enumerate(COLUMNS)}
    current = log_ratio.sum(-1)
    used = torch.where(torch.isfinite(kept), kept, current)
    torch.testing.assert_close(col["log_weight"], current)
    torch.testing.assert_close(col["phi"], respo_kernel(used, adv))
    torch.testing.assert_close(col["mass"], respo_kernel(used, adv) * 5)
    assert not torch.allclose(col["phi"], respo_kernel(current, adv))


@pytest.mark.parametrize("delta", [None, 1.5])
def test_the_closed_form_clip_is_the_clipped_losss_derivative(delta):
    """The clipped counterfactual (starvation/clip_*) in closed form equals the derivative of the registered ``ppo``
    loss, including a zero advantage (the positive side), TRL's two-sided cap, the sampler ratio and (B, T) advantages."""
    from respo_trl.diagnostics import clipped_coefficients

    gen = torch.Generator().manual_seed(4)
    log_ratio, mask = 0.4 * torch.randn(6, 9, generator=gen), (torch.rand(6, 9, generator=gen) > 0.2).float()
    params = K.LossParams(epsilon_low=0.2, epsilon_high=0.28, delta=delta)
    ratio = torch.rand(6, 9, generator=gen) + 0.5
    for advantages in (torch.tensor([1.0, -1.0, 0.0, 2.0, -0.5, 0.0]), torch.randn(6, 9, generator=gen)):
        for sampler in (None, ratio):
            expected = K.gradient_coefficients("ppo", log_ratio, advantages, mask, params, sampler_ratio=sampler)
            got = clipped_coefficients(log_ratio, advantages, mask, params, sampler)
            torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)
            assert (got == 0).sum() > (mask == 0).sum()  # the clip does stop some tokens here
