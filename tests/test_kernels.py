"""The pure-torch kernel module against the paper's closed forms, the spec's table, the family formula, its calculus
at W = 1, its boundary conditions, and hostile inputs. Each test names the bug it would catch."""

import dataclasses
import math

import numpy as np
import pytest
import torch

from respo_trl import kernels as K

SPEC_W = [1e-4, 0.01, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 20.0]
SPEC_TABLE = {  # spec section 2, rounded to the digits printed there
    "pos": [1.36, 1.36, 1.35, 1.32, 1.24, 1, 0.552, 0.0549, 5.9e-8],
    "neg": [0.0724, 0.605, 1.24, 1.36, 1.27, 1, 0.618, 0.189, 0.0043],
}


def phi_pos_paper(w):
    return (1 + w) / 2 * np.exp(1 - w)


def phi_neg_paper(w):
    return np.sqrt(w) * np.exp(2 * (1 - np.sqrt(w)))


def family_reference(w, alpha, beta, lam):
    """The spec's formula, written directly in numpy float64 (no log-space tricks)."""
    if alpha == 1.0:
        phi0 = w**beta
    else:
        phi0 = ((1 - beta) + beta * w ** (alpha - 1)) ** (1 / (alpha - 1))
    return phi0 * np.exp(lam * (1 - phi0))


def test_paper_constants_give_the_closed_forms_on_random_log_weights():
    """Catches: a wrong default, a swapped branch, a dropped tilt, alpha=1 not handled as W^beta."""
    gen = torch.Generator().manual_seed(1234)
    log_w = (torch.rand(2000, generator=gen, dtype=torch.float64) * 40 - 20)
    adv = torch.randn(2000, generator=gen, dtype=torch.float64)
    phi = K.respo_kernel(log_w, adv).double().numpy()
    w = np.exp(log_w.numpy())
    expected = np.where(adv.numpy() >= 0, phi_pos_paper(w), phi_neg_paper(w))
    np.testing.assert_allclose(phi, expected, rtol=1e-5, atol=1e-30)


def test_kernel_reproduces_spec_table():
    log_w = torch.log(torch.tensor(SPEC_W, dtype=torch.float64))
    for sign, row in SPEC_TABLE.items():
        adv = torch.full_like(log_w, 1.0 if sign == "pos" else -1.0)
        for got, want in zip(K.respo_kernel(log_w, adv).tolist(), row):
            assert got == pytest.approx(want, rel=0.02), (sign, got, want)


def test_family_at_random_constants_matches_the_formula():
    """Catches: a wrong power-mean exponent, beta weighting the wrong term, a mis-signed tilt."""
    gen = np.random.default_rng(7)
    log_w = np.linspace(-6, 4, 301)
    w = np.exp(log_w)
    for _ in range(40):
        alpha = float(gen.choice([gen.uniform(0.1, 0.99), gen.uniform(1.01, 4.0), 1.0]))
        beta, lam = float(gen.uniform(0, 1)), float(gen.uniform(0, 4))
        for sign in (1.0, -1.0):
            constants = dict(alpha_pos=alpha, beta_pos=beta, lam_pos=lam) if sign > 0 else dict(
                alpha_neg=alpha, beta_neg=beta, lam_neg=lam
            )
            phi = K.respo_kernel(torch.tensor(log_w), torch.full((len(w),), sign, dtype=torch.float64), **constants)
            np.testing.assert_allclose(phi.double().numpy(), family_reference(w, alpha, beta, lam), rtol=2e-5, atol=1e-12)


def test_phi_is_one_at_w_one_with_slope_beta_one_minus_lambda():
    """On-policy ReSPO is exactly the policy gradient (phi(1) = 1), and the spec's slope phi'(1) = beta (1 - lam)."""
    gen = np.random.default_rng(0)
    for _ in range(25):
        alpha, beta, lam = float(gen.uniform(0.2, 4)), float(gen.uniform(0, 1)), float(gen.uniform(0, 4))
        w = torch.ones(1, dtype=torch.float64, requires_grad=True)
        phi = K.branch_phi(torch.log(w), alpha, beta, lam)
        (slope,) = torch.autograd.grad(phi.sum(), w)
        assert phi.item() == pytest.approx(1.0, abs=1e-12)
        assert slope.item() == pytest.approx(beta * (1 - lam), abs=1e-9)
        detached = K.respo_kernel(torch.zeros(2), torch.tensor([1.0, -1.0]), alpha, beta, lam, alpha, beta, lam)
        torch.testing.assert_close(detached, torch.ones(2))
    # the paper set lambda- so that both branches have slope -1/2 at W = 1
    for alpha, beta, lam in ((2.0, 0.5, 2.0), (1.0, 0.5, 2.0)):
        w = torch.ones(1, dtype=torch.float64, requires_grad=True)
        (slope,) = torch.autograd.grad(K.branch_phi(torch.log(w), alpha, beta, lam).sum(), w)
        assert slope.item() == pytest.approx(-0.5)


def test_the_four_boundary_conditions_at_the_paper_constants():
    """phi+(0) > 0 (no starvation, = e/2), phi+(inf) = 0, phi-(0) = 0, phi-(inf) = 0; maxima e/2 where the spec says."""
    tails = torch.tensor([-40.0, -20.0, 20.0, 40.0])
    pos = K.respo_kernel(tails, torch.ones(4))
    neg = K.respo_kernel(tails, -torch.ones(4))
    assert pos[0].item() == pytest.approx(math.e / 2, rel=1e-6) and pos[1].item() == pytest.approx(math.e / 2, rel=1e-6)
    assert pos[2].item() < 1e-6 and pos[3].item() < 1e-6
    assert neg[0].item() < 1e-3 and neg[2].item() < 1e-6
    w = torch.logspace(-6, 3, 90_001, dtype=torch.float64)
    phi_pos = K.respo_kernel(torch.log(w), torch.ones_like(w)).double()
    phi_neg = K.respo_kernel(torch.log(w), -torch.ones_like(w)).double()
    assert phi_pos.max().item() == pytest.approx(math.e / 2, rel=1e-5) and w[phi_pos.argmax()].item() < 1e-5
    assert phi_neg.max().item() == pytest.approx(math.e / 2, rel=1e-6)
    assert w[phi_neg.argmax()].item() == pytest.approx(0.25, rel=1e-3)


def test_starvation_contrast_with_vespo_and_clipped_ppo():
    """The method's point: low-weight positives keep their gradient where VESPO and clipped PPO give ~W."""
    low = torch.log(torch.tensor([1e-4, 1e-2]))
    respo = K.respo_kernel(low, torch.ones(2))
    vespo = K.gamma_kernel(low, torch.ones(2), 2.0, 3.0, 3.0, 2.0)
    assert (respo > 1.3).all() and (vespo < 0.01).all() and (respo > 100 * torch.exp(low)).all()
    high = torch.log(torch.tensor([5.0, 20.0]))
    assert (K.respo_kernel(high, -torch.ones(2)) < 0.04 * torch.exp(high)).all()  # no gradient shock


@pytest.mark.parametrize("delta", [1e-9, 1e-6, 1e-4, 1e-3])
def test_alpha_one_is_continuous(delta):
    """Catches: alpha near 1 computed as 0/0 or with catastrophic cancellation (the naive formula loses every digit
    at alpha = 1 + 1e-9). Near alpha = 1, d log phi / d alpha stays below ~5 for |log W| <= 3."""
    log_w = torch.linspace(-3, 3, 61, dtype=torch.float64)
    adv = -torch.ones_like(log_w)
    at_one = K.respo_kernel(log_w, adv, alpha_neg=1.0).double()
    for alpha in (1 - delta, 1 + delta):
        near = K.respo_kernel(log_w, adv, alpha_neg=alpha).double()
        torch.testing.assert_close(near, at_one, rtol=10 * delta + 1e-6, atol=1e-12)
        if delta >= 1e-4:  # where the direct formula is still accurate in float64
            reference = family_reference(np.exp(log_w.numpy()), alpha, 0.5, 2.0)
            np.testing.assert_allclose(near.numpy(), reference, rtol=1e-6)


def test_finite_for_every_input_and_nan_gets_zero():
    log_w = torch.tensor([float("inf"), float("-inf"), float("nan"), 1e30, -1e30, 0.0])
    for sign in (1.0, -1.0):
        phi = K.respo_kernel(log_w, torch.full((6,), sign))
        assert torch.isfinite(phi).all()
        assert phi[2].item() == 0.0  # a NaN sequence never gets full weight
    assert K.respo_kernel(log_w, torch.ones(6))[1].item() == pytest.approx(math.e / 2, rel=1e-5)  # W = 0 limit
    bf16 = K.respo_kernel(torch.zeros(3, dtype=torch.bfloat16), torch.ones(3))
    assert bf16.dtype == torch.float32 and torch.equal(bf16, torch.ones(3))


def test_shape_mismatch_is_an_error_not_broadcasting():
    with pytest.raises(ValueError, match="same shape"):
        K.respo_kernel(torch.zeros(4), torch.zeros(4, 1))
    with pytest.raises(ValueError, match="same shape"):
        K.respo_kernel(torch.zeros(4), torch.zeros(3))


@pytest.mark.parametrize(
    "name,value",
    [("alpha_pos", 0.0), ("alpha_neg", -1.0), ("beta_pos", 1.5), ("beta_neg", -0.1), ("lam_pos", -0.5),
     ("lam_neg", float("nan")), ("alpha_pos", float("inf")), ("beta_pos", True), ("lam_neg", "2")],
)
def test_out_of_domain_constants_raise_naming_the_field(name, value):
    with pytest.raises(ValueError, match=name):
        K.respo_kernel(torch.zeros(2), torch.ones(2), **{name: value})


def test_sequence_log_weight_sums_masked_tokens_then_clamps_and_keeps_nan():
    log_ratio = torch.tensor([[0.1, -0.3, 0.2, float("nan")], [15.0, 15.0, 0.0, 0.0], [0.5, float("nan"), 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 0, 0]])
    l = K.sequence_log_weight(log_ratio, mask)
    assert l[0].item() == pytest.approx(0.0, abs=1e-7)  # a masked NaN never contributes
    assert l[1].item() == 20.0  # the sum (30) is clamped, not each token
    assert math.isnan(l[2].item())  # an unmasked NaN poisons the sequence: the kernel then gives it phi = 0
    assert K.respo_kernel(l, torch.ones(3))[2].item() == 0.0


def test_sampler_correction_is_folded_in_log_space_token_and_sequence_level():
    """Catches: a dropped sampler ratio, a sequence-level ratio added once per token, a masked token kept as -20."""
    log_ratio = torch.tensor([[0.2, 0.1, 0.0], [0.0, 0.3, -0.1]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    token_ratio = torch.tensor([[2.0, 0.5, 7.0], [1.5, 0.0, 1.0]])  # 0 = masked by token_mask
    log_c, kept = K.fold_sampler_ratio(token_ratio, mask)
    assert kept.tolist() == [[True, True, False], [True, False, True]]
    l = K.sequence_log_weight(log_ratio, kept, log_c)
    expected = torch.tensor([0.3 + math.log(2.0) + math.log(0.5), 0.0 - 0.1 + math.log(1.5)])
    torch.testing.assert_close(l, expected)
    seq_ratio = torch.tensor([[3.0], [0.0]])  # sequence modes: (B, 1); 0 = sequence masked
    log_c, kept = K.fold_sampler_ratio(seq_ratio, mask)
    assert kept.tolist() == [[True, True, False], [False, False, False]]
    l = K.sequence_log_weight(log_ratio, kept, log_c)
    assert l[0].item() == pytest.approx(0.3 + math.log(3.0))  # added once, not once per token
    coef = K.respo_weights(log_ratio, torch.tensor([1.0, 1.0]), mask, sampler_ratio=seq_ratio).coefficients
    assert coef[1].abs().sum().item() == 0.0  # the masked sequence gets no gradient at all


def test_directional_trust_mask_zeroes_exactly_the_tokens_clipped_ppo_stops():
    """Catches: a symmetric mask (starves low-weight positives), a wrong epsilon, the sign of A ignored."""
    gen = torch.Generator().manual_seed(5)
    log_ratio = torch.randn(64, 10, generator=gen) * 0.5
    adv = torch.randn(64, generator=gen)
    mask = (torch.rand(64, 10, generator=gen) < 0.9).long()
    params = K.LossParams(epsilon_low=0.2, epsilon_high=0.28)
    trust = K.directional_trust_mask(log_ratio, adv, mask, params.epsilon_low, params.epsilon_high)
    ppo_zero = (K.gradient_coefficients("ppo", log_ratio, adv, mask, params) == 0) & mask.bool()
    assert torch.equal(trust == 0, ppo_zero | ~mask.bool())
    assert ppo_zero.any() and (trust[ppo_zero.logical_not() & mask.bool()] == 1).all()
    # tokens of low-weight positives (ratio < 1 - epsilon) keep their gradient; PPO keeps them too, with coefficient r
    low_pos = (adv > 0).unsqueeze(-1) & (torch.exp(log_ratio) < 0.8) & mask.bool()
    assert low_pos.any() and (trust[low_pos] == 1).all()


@pytest.mark.parametrize("epsilons", [(0.2, 0.2), (0.2, 0.28), (0.1, 0.3)])
def test_trust_mask_zero_set_is_clipped_ppos_with_trls_two_sided_delta(epsilons):
    """Catches: TRL's delta ignored (A < 0 tokens above delta keep their gradient where TRL's loss gives none: 168
    tokens of this batch with 0.2's mask), delta applied to positives, the bounds swapped."""
    gen = torch.Generator().manual_seed(11)
    log_ratio = torch.randn(128, 12, generator=gen) * 0.6
    adv = torch.randn(128, generator=gen)
    mask = (torch.rand(128, 12, generator=gen) < 0.9).long()
    params = K.LossParams(epsilon_low=epsilons[0], epsilon_high=epsilons[1], delta=1.5)
    trust = K.directional_trust_mask(log_ratio, adv, mask, *params.trust_bounds())
    ppo_zero = (K.gradient_coefficients("ppo", log_ratio, adv, mask, params) == 0) & mask.bool()
    assert torch.equal(trust == 0, ppo_zero | ~mask.bool())
    capped = (adv < 0).unsqueeze(-1) & (torch.exp(log_ratio) > 1.5) & mask.bool()
    assert capped.sum() > 50 and (trust[capped] == 0).all()  # the delta cap is exercised, on negatives only
    assert (trust[(adv > 0).unsqueeze(-1) & (torch.exp(log_ratio) > 1.5) & mask.bool()] == 0).all()  # clipped anyway


def test_trust_bounds_fall_back_to_the_losss_epsilons_and_can_be_set_apart():
    params = K.LossParams(epsilon_low=0.1, epsilon_high=0.3, delta=2.0)
    assert params.trust_bounds() == (0.1, 0.3, 2.0)
    own = K.LossParams(epsilon_low=3e-4, epsilon_high=4e-4, trust_epsilon_low=0.2, trust_epsilon_high=0.25,
                       trust_delta=math.inf)  # fmt: skip
    assert own.trust_bounds() == (0.2, 0.25, None)


def test_respo_weights_are_phi_times_trust_mask():
    gen = torch.Generator().manual_seed(11)
    log_ratio = torch.randn(32, 6, generator=gen) * 0.4
    adv = torch.randn(32, generator=gen)
    mask = torch.ones(32, 6)
    phi = K.respo_kernel(K.sequence_log_weight(log_ratio, mask), adv)
    plain = K.respo_weights(log_ratio, adv, mask, K.LossParams(respo_trust_mask=False)).coefficients
    torch.testing.assert_close(plain, phi.unsqueeze(-1).expand(-1, 6))
    masked = K.respo_weights(log_ratio, adv, mask, K.LossParams(respo_trust_mask=True)).coefficients
    trust = K.directional_trust_mask(log_ratio, adv, mask, 0.2, 0.2)
    torch.testing.assert_close(masked, plain * trust)
    assert (masked == 0).any() and not (plain == 0).any()


def test_per_token_advantages_take_the_branch_per_token():
    log_ratio = torch.full((2, 3), -0.5)
    mask = torch.ones(2, 3)
    adv = torch.tensor([[1.0, -1.0, 1.0], [-1.0, -1.0, 2.0]])
    coef = K.respo_weights(log_ratio, adv, mask).coefficients
    log_w = torch.full((2, 3), -1.5)
    torch.testing.assert_close(coef, K.respo_kernel(log_w, adv))


def test_log_weight_is_the_raw_sequence_ratio_whatever_the_length():
    """Catches: a length normalisation of log W creeping back (the paper uses the raw ratio; the ablation's mean,
    sqrt and ess divisors were removed from the library and live in the lab)."""
    log_ratio = torch.tensor([[-1.0, 0.0, 0.0, 0.0], [-0.25, -0.25, -0.25, -0.25], [-6.0, -6.0, -6.0, -6.0]])
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1]])
    adv = torch.ones(3)
    coef = K.respo_weights(log_ratio, adv, mask).coefficients
    expected = K.respo_kernel(torch.tensor([-1.0, -1.0, -20.0]), adv)  # same l = -1 at lengths 1 and 4; -24 clamps
    torch.testing.assert_close(coef.sum(-1) / mask.sum(-1), expected)
    assert not {"respo_norm", "respo_rho_min"} & {f.name for f in dataclasses.fields(K.LossParams)}


def _closed_form_coefficients(name, log_ratio, adv, mask, p):
    w = torch.exp(log_ratio)
    pos = (adv >= 0).unsqueeze(-1)
    m = mask.float()
    if name == "ppo":
        inside = torch.where(pos, w <= 1 + p.epsilon_high, w >= 1 - p.epsilon_low)
        return torch.where(inside, w, 0.0)
    if name == "gspo":
        w_seq = torch.exp((log_ratio * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True)).expand_as(w)
        inside = torch.where(pos, w_seq <= 1 + p.epsilon_high, w_seq >= 1 - p.epsilon_low)
        return torch.where(inside, w_seq, 0.0)
    if name == "cispo":
        return w.clamp(max=p.epsilon_high)
    if name == "sapo":
        tau = torch.where(pos, p.sapo_temperature_pos, p.sapo_temperature_neg)
        g = torch.sigmoid(tau * (w - 1))
        return 4 * g * (1 - g) * w
    W = torch.exp((log_ratio * m).sum(-1))
    if name == "vespo":
        k = torch.where(adv >= 0, p.vespo_k_pos, p.vespo_k_neg)
        lam = torch.where(adv >= 0, p.vespo_lambda_pos, p.vespo_lambda_neg)
        phi = W**k * torch.exp(lam * (1 - W))
    else:  # respo at the paper's constants, no trust mask
        phi = torch.where(adv >= 0, (1 + W) / 2 * torch.exp(1 - W), W.sqrt() * torch.exp(2 * (1 - W.sqrt())))
    return phi.unsqueeze(-1).expand_as(w)


@pytest.mark.parametrize("name", ["ppo", "gspo", "cispo", "sapo", "vespo", "respo"])
def test_registry_gradient_coefficients_match_closed_forms(name):
    gen = torch.Generator().manual_seed(3)
    log_ratio = torch.randn(16, 12, generator=gen, dtype=torch.float64) * 0.4
    adv = torch.randn(16, generator=gen, dtype=torch.float64)
    mask = (torch.rand(16, 12, generator=gen) < 0.85).long()
    mask[:, 0] = 1
    params = K.LossParams(epsilon_high=0.28 if name != "cispo" else 1.5)
    c = K.gradient_coefficients(name, log_ratio, adv, mask, params)
    expected = _closed_form_coefficients(name, log_ratio.float(), adv, mask, params) * mask
    torch.testing.assert_close(c.double(), expected.double(), rtol=1e-4, atol=1e-6)


def test_gamma_kernel_and_vespo_weight_equal_trls():
    """Our VESPO (used for its diagnostics and the lab) is TRL's get_gamma_weights, sampler ratio included."""
    from trl import GRPOTrainer

    gen = torch.Generator().manual_seed(4)
    log_ratio = torch.randn(12, 9, generator=gen) * 0.3
    mask = (torch.rand(12, 9, generator=gen) < 0.8).float()
    adv = torch.randn(12, generator=gen)
    ratio = torch.rand(12, 9, generator=gen) * 2
    ratio[0, 0] = 0.0  # token_mask zero: TRL floors its log at log(1e-8)
    trl_phi = GRPOTrainer.get_gamma_weights(adv.unsqueeze(-1), log_ratio, mask, ratio)
    ours = K.vespo_phi(log_ratio, adv, mask, K.LossParams(), ratio)
    torch.testing.assert_close(ours, trl_phi)


@pytest.mark.parametrize("name", sorted(K.POLICY_LOSSES))
def test_losses_finite_on_extreme_ratios_empty_masks_and_zero_advantages(name):
    log_ratio = torch.tensor([[1e4, -1e4, 0.0], [-1e4, -1e4, -1e4], [1e4, 1e4, 1e4], [0.5, float("nan"), 0.1]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 1], [0, 0, 0], [1, 0, 1]])
    for adv in (torch.tensor([1.0, -1.0, 1.0, -2.0]), torch.zeros(4)):
        c = K.gradient_coefficients(name, log_ratio, adv, mask)
        assert torch.isfinite(c).all(), c
    params = K.LossParams(respo_trust_mask=True)
    coef = K.respo_weights(log_ratio, torch.tensor([1.0, -1.0, 0.0, 1.0]), mask, params).coefficients
    assert torch.isfinite(coef).all() and (coef[2] == 0).all()


def test_on_policy_coefficients_are_one_for_every_loss():
    mask = torch.ones(4, 5)
    params = K.LossParams(epsilon_high=5.0, respo_trust_mask=True)  # CISPO's cap is epsilon_high (ScaleRL: 5)
    for name in K.POLICY_LOSSES:
        c = K.gradient_coefficients(name, torch.zeros(4, 5), torch.tensor([1.0, -1.0, 0.5, -0.5]), mask, params)
        torch.testing.assert_close(c, torch.ones(4, 5), msg=name)


def test_registry_rejects_duplicates_and_unknown_names():
    with pytest.raises(ValueError, match="already registered"):
        K.register_policy_loss("respo")(lambda *a, **k: None)
    with pytest.raises(ValueError, match="Unknown policy loss"):
        K.get_policy_loss("nope")
    assert K.registered_loss_for("dapo") == "ppo" and K.registered_loss_for("respo") == "respo"
    with pytest.raises(ValueError, match="loss_type"):
        K.registered_loss_for("not_a_loss")


def test_kish_ess():
    assert K.kish_ess(torch.zeros(10)).item() == pytest.approx(1.0)
    assert K.kish_ess(torch.tensor([0.0, -1e4, -1e4, -1e4])).item() == pytest.approx(0.25)
    assert torch.isfinite(K.kish_ess(torch.tensor([1e4, -1e4])))


def test_kernels_module_does_not_import_trl():
    import subprocess
    import sys

    code = "import sys, respo_trl, respo_trl.kernels, respo_trl.diagnostics, respo_trl.buffer; print('trl' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_every_name_the_package_exports_resolves():
    import respo_trl

    for name in respo_trl.__all__:
        assert getattr(respo_trl, name) is not None, name


def test_zero_positive_beta_is_no_correction_and_zero_advantage_takes_the_positive_branch():
    """Catches: log(0) taken for beta = 0 (the `respo_pos1` ablation, phi+ = 1) and A = 0 sent to the negative branch
    (the authors' code branches on A >= 0; it only shows in the logged phi statistics)."""
    log_w = torch.linspace(-5.0, 5.0, 11, dtype=torch.float64)
    phi = K.respo_kernel(log_w, torch.ones(11, dtype=torch.float64), beta_pos=0.0)
    torch.testing.assert_close(phi, torch.ones_like(phi))
    at_zero = K.respo_kernel(log_w, torch.zeros(11, dtype=torch.float64))
    torch.testing.assert_close(at_zero, K.respo_kernel(log_w, torch.ones(11, dtype=torch.float64)))


def test_trust_mask_takes_per_token_advantages():
    """Catches: (B, T) advantages reshaped to the wrong width (TRL lets subclasses produce per-token advantages)."""
    torch.manual_seed(0)
    log_ratio, mask = 0.5 * torch.randn(4, 6), torch.ones(4, 6)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    per_sequence = K.directional_trust_mask(log_ratio, adv, mask, 0.2, 0.28)
    per_token = K.directional_trust_mask(log_ratio, adv[:, None].expand(4, 6), mask, 0.2, 0.28)
    torch.testing.assert_close(per_token, per_sequence)
    assert 0 < per_sequence.sum() < per_sequence.numel()  # the case is not trivial


def test_ppo_delta_caps_the_ratio_of_negatives():
    """Catches: TRL's two-sided cap `delta` ignored (r = 3 on a negative must count as delta = 1.5, not 3)."""
    log_ratio, mask, adv = torch.full((1, 1), math.log(3.0)), torch.ones(1, 1), torch.tensor([-1.0])
    loss = K.get_policy_loss("ppo")(log_ratio, adv, mask, K.LossParams(delta=1.5))
    torch.testing.assert_close(loss, torch.full((1, 1), 1.5))
    uncapped = K.get_policy_loss("ppo")(log_ratio, adv, mask, K.LossParams())
    torch.testing.assert_close(uncapped, torch.full((1, 1), 3.0))


def test_a_sequence_the_sampler_mask_dropped_is_not_counted_as_on_policy():
    """vLLM sequence_mask gives a dropped sequence the ratio 0: it has no W, so it must not enter the log-weight
    statistics, the ESS, phi_mean or the positive-branch diagnostic as log W = 0 / phi = 1 (0.2 did that)."""
    from respo_trl.diagnostics import sequence_stats, summarize

    log_ratio = torch.tensor([[-0.9, -0.8, 0.0], [0.0, 0.0, 0.0], [0.1, 0.0, 0.0]])
    adv = torch.tensor([1.0, 1.0, -1.0])
    mask = torch.ones(3, 3)
    ratio = torch.tensor([[1.0], [0.0], [1.0]])  # the middle sequence dropped by the sampler mask
    metrics = summarize(sequence_stats(log_ratio, adv, mask, K.LossParams(), "respo", sampler_ratio=ratio))
    assert metrics["starvation/low_weight_pos/n"] == 1.0 and metrics["starvation/low_weight_pos/share"] == 1.0
    assert metrics["offpolicy/log_weight/max"] == pytest.approx(0.1) and metrics["offpolicy/log_weight/min"] == pytest.approx(-1.7)
    assert metrics["respo/phi_mean/pos"] == pytest.approx(K.respo_kernel(torch.tensor([-1.7]), torch.tensor([1.0])).item())
    assert metrics["starvation/grad_throughput/pos"] < 0.8  # the dropped positive still counts: it gets no gradient


def test_kernel_runs_in_float32_for_float32_input_and_stays_accurate():
    """MPS and some accelerators have no float64: a float32 log W is computed in float32 (0.2 always cast to float64),
    within float32 accuracy of the float64 result over the whole clamped range, both branches."""
    log_w = torch.linspace(-20, 20, 4001)
    for adv in (torch.ones(4001), -torch.ones(4001)):
        phi32 = K.respo_kernel(log_w, adv)
        phi64 = K.respo_kernel(log_w.double(), adv.double())
        assert phi32.dtype == torch.float32 and phi64.dtype == torch.float64
        big = phi64 > 1e-30
        torch.testing.assert_close(phi32[big].double(), phi64[big], rtol=2e-5, atol=0)
        assert (phi32[~big] < 1e-30).all()
    real_double = torch.Tensor.double
    try:  # no float64 tensor is made on the way
        torch.Tensor.double = lambda self: (_ for _ in ()).throw(AssertionError("cast to float64"))
        K.respo_kernel(log_w, torch.ones(4001))
    finally:
        torch.Tensor.double = real_double


@pytest.mark.parametrize("pos,neg", [("respo", "vespo"), ("vespo", "respo"), ("vespo", "vespo")])
def test_a_branch_set_to_vespo_takes_vespos_gamma_kernel_for_its_sign_only(pos, neg):
    """The ablation of docs/benchmarks/regime_mechanism.md 5.5: catches the gamma kernel applied to the wrong sign (a swapped
    `where`), VESPO's positive constants on the negative branch, and a branch option that silently changes the other
    branch."""
    gen = torch.Generator().manual_seed(7)
    log_w = torch.rand(400, generator=gen, dtype=torch.float64) * 12 - 8
    adv = torch.randn(400, generator=gen, dtype=torch.float64)
    params = K.LossParams(respo_pos_branch=pos, respo_neg_branch=neg)
    got = K.two_branch_phi(log_w, adv, params).numpy()
    w = np.exp(log_w.numpy())
    gamma_pos, gamma_neg = w**2 * np.exp(3 * (1 - w)), w**3 * np.exp(2 * (1 - w))  # TRL's (k, lambda): (2, 3) / (3, 2)
    expected = np.where(adv.numpy() >= 0, gamma_pos if pos == "vespo" else phi_pos_paper(w),
                        gamma_neg if neg == "vespo" else phi_neg_paper(w))  # fmt: skip
    np.testing.assert_allclose(got, expected, rtol=2e-5, atol=1e-12)
    assert K.two_branch_phi(log_w, adv, K.LossParams()).equal(K.respo_kernel(log_w, adv))  # default: the paper's
    flat = K.two_branch_phi(log_w, adv, K.LossParams(respo_beta_pos=0.0, respo_neg_branch="vespo")).numpy()
    np.testing.assert_allclose(flat, np.where(adv.numpy() >= 0, 1.0, gamma_neg), rtol=2e-5, atol=1e-12)  # "vespo_pos1"


def test_the_papers_constants_are_declared_once_for_every_config_and_the_old_name_is_refused():
    """Issue 52, item 1: the six constants (default and help) come from ``kernels.RESPO_CONSTANTS`` in every config
    that carries them, and no module spells a declaration of its own (a copy would drift: a default changed in one
    place and not another). ``respo_coefficients`` is gone: ``respo_weights`` is every engine's one coefficient, and
    the old name is refused in one line that says so."""
    import inspect
    from pathlib import Path

    import respo_trl
    from respo_trl.async_config import AsyncReSPOConfig
    from respo_trl.config import ReSPOConfig

    for cls in (ReSPOConfig, AsyncReSPOConfig, K.LossParams):
        declared = {f.name: f for f in dataclasses.fields(cls)}
        for name, (default, help_text) in K.RESPO_CONSTANTS.items():
            assert declared[name].default == default and declared[name].metadata["help"] == help_text, (cls, name)
    assert K.RESPO_DEFAULTS == {"alpha_pos": 2.0, "beta_pos": 0.5, "lam_pos": 2.0, "alpha_neg": 1.0, "beta_neg": 0.5,
                                "lam_neg": 2.0}  # the paper's, under the kernel's argument names
    assert inspect.signature(K.respo_kernel).parameters.keys() >= set(K.RESPO_DEFAULTS)
    package = Path(respo_trl.__file__).parent
    for path in package.rglob("*.py"):
        assert "respo_alpha_pos: float" not in path.read_text(), path  # verl's config included (its own environment)
    with pytest.raises(AttributeError, match=r"respo_coefficients was renamed respo_weights .*refused since respo_trl 0\.8"):
        respo_trl.respo_coefficients  # noqa: B018
    assert respo_trl.respo_weights is K.respo_weights
