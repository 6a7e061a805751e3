"""The pure-torch kernel module against closed forms, the spec's table, and hostile inputs."""

import math

import numpy as np
import pytest
import torch

from respo_trl import kernels as K

SPEC_W = [1e-4, 0.01, 0.1, 0.5, 1.0, 2.0, 5.0, 20.0]
SPEC_TABLE = {  # spec section 2, rounded to the digits printed there
    (0.5, 0.5): [0.0165, 0.164, 0.496, 0.908, 1, 0.858, 0.303, 3.4e-4],
    (2.0, 2.0): [7.4e-8, 7.2e-4, 0.0605, 0.68, 1, 0.541, 0.0084, 1.3e-14],
    (2.0, 3.0): [2.0e-7, 0.00195, 0.149, 1.12, 1, 0.199, 1.5e-4, 0.0],
}


def phi_closed_form(w, alpha, lam):
    return w**alpha * np.exp(lam * (1.0 - w))


def test_kernel_matches_closed_form_on_random_inputs():
    gen = torch.Generator().manual_seed(1234)
    s = torch.randn(500, generator=gen, dtype=torch.float64) * 3
    adv = torch.randn(500, generator=gen)
    a_pos, l_pos, a_neg, l_neg = (torch.rand(4, generator=gen) * 3).tolist()
    phi = K.respo_kernel(s, adv, a_pos, l_pos, a_neg, l_neg).double().numpy()
    w = np.exp(s.numpy())
    expected = np.where(adv.numpy() >= 0, phi_closed_form(w, a_pos, l_pos), phi_closed_form(w, a_neg, l_neg))
    np.testing.assert_allclose(phi, expected, rtol=1e-4, atol=1e-30)


@pytest.mark.parametrize("params", list(SPEC_TABLE))
def test_kernel_reproduces_spec_table(params):
    alpha, lam = params
    s = torch.log(torch.tensor(SPEC_W, dtype=torch.float64))
    phi = K.respo_kernel(s, torch.ones(len(SPEC_W)), alpha, lam, 9.0, 9.0)
    for got, want in zip(phi.tolist(), SPEC_TABLE[params]):
        if want == 0.0:
            assert got < 1e-20
        else:
            assert got == pytest.approx(want, rel=0.03)


def test_phi_at_one_is_one_for_any_parameters():
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        a_pos, l_pos, a_neg, l_neg = (torch.rand(4, generator=gen) * 5).tolist()
        phi = K.respo_kernel(torch.zeros(2), torch.tensor([1.0, -1.0]), a_pos, l_pos, a_neg, l_neg)
        torch.testing.assert_close(phi, torch.ones(2))


@pytest.mark.parametrize("alpha,lam", [(0.5, 0.5), (2.0, 2.0), (2.0, 3.0), (0.3, 1.7), (3.0, 1.5)])
def test_supremum_matches_formula(alpha, lam):
    w = torch.logspace(-4, 2, 200_001, dtype=torch.float64)
    phi = K.respo_kernel(torch.log(w), torch.ones_like(w), alpha, lam, 0.0, 0.0).double()
    sup, argmax = K.kernel_sup(alpha, lam)
    assert phi.max().item() == pytest.approx(sup, rel=1e-6)
    assert w[phi.argmax()].item() == pytest.approx(argmax, rel=1e-3)
    if alpha == lam:
        assert phi.max().item() <= 1 + 1e-12


def test_tails_positive_branch_keeps_gradient_negative_branch_damps():
    low, high = torch.log(torch.tensor([1e-4, 1e-2])), torch.log(torch.tensor([5.0, 20.0]))
    respo_pos = K.respo_kernel(low, torch.ones(2), 0.5, 0.5, 2.0, 2.0)
    vespo_pos = K.respo_kernel(low, torch.ones(2), 2.0, 3.0, 3.0, 2.0)
    # Concave positive branch: phi ~ sqrt(w) at low weight, orders of magnitude above VESPO's w^2 and PPO's w.
    assert (respo_pos > 50 * vespo_pos).all() and (respo_pos > torch.exp(low)).all()
    # Negative branch: high-weight negatives are damped far below clipped PPO's coefficient w.
    respo_neg = K.respo_kernel(high, -torch.ones(2), 0.5, 0.5, 2.0, 2.0)
    assert (respo_neg < 0.01 * torch.exp(high)).all()


def test_sequence_log_weights_modes():
    log_ratio = torch.tensor([[0.1, -0.3, 0.2, 0.0], [1.0, 1.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    l = torch.tensor([0.0, 2.0])  # masked sums
    torch.testing.assert_close(K.sequence_log_weights(log_ratio, mask, norm="none"), l)
    torch.testing.assert_close(K.sequence_log_weights(log_ratio, mask, norm="mean"), l / torch.tensor([3.0, 2.0]))
    torch.testing.assert_close(K.sequence_log_weights(log_ratio, mask, norm="sqrt"), l / torch.tensor([3.0, 2.0]).sqrt())
    # ess: std(l) = sqrt(2) over two sequences; budget sqrt(-log 0.5)
    expected_T = max(1.0, math.sqrt(2.0) / math.sqrt(-math.log(0.5)))
    torch.testing.assert_close(K.sequence_log_weights(log_ratio, mask, norm="ess", rho_min=0.5), l / expected_T)


def test_token_log_ratio_is_clamped_before_summing():
    log_ratio = torch.tensor([[50.0, -50.0, 5.0]])
    s = K.sequence_log_weights(log_ratio, torch.ones(1, 3), norm="none")
    assert s.item() == pytest.approx(20.0 - 20.0 + 5.0)


def test_ess_normalization_keeps_effective_sample_size_above_floor():
    gen = torch.Generator().manual_seed(7)
    for sigma, rho_min in [(4.0, 0.5), (2.0, 0.8), (6.0, 0.2)]:
        l = torch.randn(20_000, generator=gen, dtype=torch.float64) * sigma
        log_ratio = torch.stack([l, torch.zeros_like(l)], dim=-1)
        s = K.sequence_log_weights(log_ratio, torch.ones_like(log_ratio), norm="ess", rho_min=rho_min)
        assert K.kish_ess(l).item() < rho_min  # raw weights are degenerate...
        assert K.kish_ess(s).item() == pytest.approx(rho_min, abs=0.03)  # ...normalised ones sit at the floor


def test_ess_normalization_is_identity_when_already_within_budget_or_single_sequence():
    log_ratio = torch.tensor([[0.01], [-0.02], [0.015]])
    mask = torch.ones_like(log_ratio)
    torch.testing.assert_close(K.sequence_log_weights(log_ratio, mask, norm="ess"), log_ratio[:, 0])
    assert K.sequence_log_weights(torch.tensor([[3.0]]), torch.ones(1, 1), norm="ess").item() == 3.0


def test_ess_uses_gathered_statistics():
    log_ratio = torch.tensor([[0.0], [0.0]])
    other_process = torch.tensor([[10.0, 1.0], [-10.0, 1.0]])  # (l, valid) rows from another rank
    gather = lambda t: torch.cat([t, other_process])  # noqa: E731
    s = K.sequence_log_weights(torch.tensor([[4.0], [-4.0]]), torch.ones_like(log_ratio), norm="ess", gather=gather)
    expected_T = torch.tensor([4.0, -4.0, 10.0, -10.0]).std() / math.sqrt(-math.log(0.5))
    torch.testing.assert_close(s, torch.tensor([4.0, -4.0]) / expected_T)


def test_unknown_normalization_raises():
    with pytest.raises(ValueError, match="normalization"):
        K.sequence_log_weights(torch.zeros(1, 2), torch.ones(1, 2), norm="median")


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
    if name == "is":
        return w
    l = (log_ratio * m).sum(-1)
    if name == "is_seq":
        return torch.exp(l).unsqueeze(-1).expand_as(w)
    if name == "vespo":
        s, a, lam = l, torch.where(adv >= 0, p.vespo_k_pos, p.vespo_k_neg), torch.where(adv >= 0, p.vespo_lambda_pos, p.vespo_lambda_neg)
    else:  # respo, sqrt normalisation
        s = l / m.sum(-1).sqrt()
        a = torch.where(adv >= 0, p.respo_alpha_pos, p.respo_alpha_neg)
        lam = torch.where(adv >= 0, p.respo_lambda_pos, p.respo_lambda_neg)
    return (torch.exp(s) ** a * torch.exp(lam * (1 - torch.exp(s)))).unsqueeze(-1).expand_as(w)


@pytest.mark.parametrize("name", ["ppo", "gspo", "cispo", "sapo", "is", "is_seq", "vespo", "respo"])
def test_registry_gradient_coefficients_match_closed_forms(name):
    gen = torch.Generator().manual_seed(3)
    log_ratio = (torch.randn(16, 12, generator=gen, dtype=torch.float64) * 0.4)
    adv = torch.randn(16, generator=gen, dtype=torch.float64)
    mask = (torch.rand(16, 12, generator=gen) < 0.85).long()
    mask[:, 0] = 1
    params = K.LossParams(epsilon_high=0.28 if name != "cispo" else 1.5)
    c = K.gradient_coefficients(name, log_ratio, adv, mask, params)
    expected = _closed_form_coefficients(name, log_ratio.float(), adv, mask, params) * mask
    torch.testing.assert_close(c.double(), expected.double(), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name", sorted(K.POLICY_LOSSES))
def test_losses_finite_on_extreme_ratios_empty_masks_and_zero_advantages(name):
    log_ratio = torch.tensor([[1e4, -1e4, 0.0], [-1e4, -1e4, -1e4], [1e4, 1e4, 1e4], [0.5, float("nan"), 0.1]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 1], [0, 0, 0], [1, 0, 1]])
    for adv in (torch.tensor([1.0, -1.0, 1.0, -2.0]), torch.zeros(4)):
        c = K.gradient_coefficients(name, log_ratio, adv, mask)
        assert torch.isfinite(c).all(), c
        per_token = K.get_policy_loss(name)(log_ratio.nan_to_num().clamp(-20, 20), adv, mask, K.LossParams())
        assert torch.isfinite(per_token * mask).all()
    for norm in K.NORM_MODES:
        s = K.sequence_log_weights(log_ratio, mask, norm=norm)
        assert torch.isfinite(s).all() and s[2] == 0.0
        assert torch.isfinite(K.respo_kernel(s, torch.tensor([1.0, -1.0, 0.0, 1.0]))).all()


def test_on_policy_coefficients_are_one_for_every_loss():
    mask = torch.ones(4, 5)
    params = K.LossParams(epsilon_high=5.0)  # CISPO's cap is epsilon_high (ScaleRL recommends 5); PPO is unaffected
    for name in K.POLICY_LOSSES:
        c = K.gradient_coefficients(name, torch.zeros(4, 5), torch.tensor([1.0, -1.0, 0.5, -0.5]), mask, params)
        torch.testing.assert_close(c, torch.ones(4, 5), msg=name)


def test_registry_rejects_duplicates_and_unknown_names():
    with pytest.raises(ValueError, match="already registered"):
        K.register_policy_loss("respo")(lambda *a, **k: None)
    with pytest.raises(ValueError, match="Unknown policy loss"):
        K.get_policy_loss("nope")
    assert K.registered_loss_for("dapo") == "ppo" and K.registered_loss_for("respo") == "respo"


def test_kish_ess():
    assert K.kish_ess(torch.zeros(10)).item() == pytest.approx(1.0)
    assert K.kish_ess(torch.tensor([0.0, -1e4, -1e4, -1e4])).item() == pytest.approx(0.25)
    assert torch.isfinite(K.kish_ess(torch.tensor([1e4, -1e4])))


def test_kernels_module_does_not_import_trl():
    import subprocess
    import sys

    code = "import sys, respo_trl.kernels, respo_trl.diagnostics, respo_trl.buffer; print('trl' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
