"""verl's ``loss_mode="respo"``: loss and gradient against ReSPO's closed forms and the library kernel, aggregation
through verl's ``agg_loss`` and ``global_batch_info``, sampler weights folded in log space, metrics."""

from __future__ import annotations

import math

import pytest

from _verl_helpers import VERL_SKIP_REASON  # noqa: E402  (plain module, no verl import)

pytest.importorskip("verl", reason=VERL_SKIP_REASON)

import torch  # noqa: E402
from verl.trainer.ppo.core_algos import get_policy_loss_fn  # noqa: E402
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_weights  # noqa: E402

import respo_trl.integrations.verl as respo_verl  # noqa: E402
from respo_trl.kernels import respo_kernel, sequence_log_weight  # noqa: E402  (the library's kernel)

torch.set_default_dtype(torch.float64)
# respo_trl.kernels sums log W in float32 (as the TRL trainer does) and evaluates phi in float64: agreement with the
# float64 closed forms is to float32 round-off of log W.
REL = 1e-6
CLOSE = dict(rtol=1e-6, atol=1e-9)


def phi_pos(w):  # the paper's positive branch, (alpha, beta, lam) = (2, 0.5, 2)
    return (1 + w) / 2 * torch.exp(1 - w)


def phi_neg(w):  # the paper's negative branch, (1, 0.5, 2)
    return w.sqrt() * torch.exp(2 * (1 - w.sqrt()))


def closed_form_phi(log_w, advantage):
    w = log_w.clamp(-20, 20).exp()
    return torch.where(advantage >= 0, phi_pos(w), phi_neg(w))


@pytest.fixture
def batch():
    """6 responses of different lengths, both advantage signs, log W spread over both tails."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([7, 3, 5, 1, 6, 4])
    B, L = len(lengths), 7
    mask = (torch.arange(L)[None] < lengths[:, None]).float()
    log_prob = (-torch.rand(B, L, generator=g) * 3 - 0.1) * mask
    target_log_w = torch.tensor([-3.0, -0.7, 0.4, 1.6, -1.5, 3.0])  # sum_t (logp - old) per response
    noise = torch.randn(B, L, generator=g) * 0.3 * mask
    noise = noise - (noise.sum(-1, keepdim=True) / lengths[:, None]) * mask  # keep the per-response sums exact
    old_log_prob = (log_prob - (target_log_w / lengths)[:, None] * mask + noise) * mask
    adv_seq = torch.tensor([1.2, 0.5, -0.8, 0.9, -1.1, -0.3])
    return dict(old_log_prob=old_log_prob, log_prob=log_prob.clone().requires_grad_(True),
                advantages=adv_seq[:, None] * mask, response_mask=mask.bool(), adv_seq=adv_seq, mask=mask,
                log_w=target_log_w)


def respo_loss(batch, **kwargs):
    fn = get_policy_loss_fn("respo")
    return fn(old_log_prob=batch["old_log_prob"], log_prob=batch["log_prob"], advantages=batch["advantages"],
              response_mask=batch["response_mask"], **kwargs)


def grad_of(loss, batch):
    (grad,) = torch.autograd.grad(loss, batch["log_prob"])
    return grad


def test_registered_function_is_ours():
    assert get_policy_loss_fn("respo") is respo_verl.compute_policy_loss_respo


def test_token_mean_loss_and_gradient_equal_closed_forms_and_library_kernel(batch, actor_config):
    config = actor_config()
    loss, _ = respo_loss(batch, loss_agg_mode="token-mean", config=config)
    m, lp, A = batch["mask"], batch["log_prob"], batch["advantages"]

    phi = closed_form_phi(batch["log_w"], batch["adv_seq"])
    expected = -(phi[:, None] * A * lp * m).sum() / m.sum()  # TRL `dapo` aggregation: token sum / token count
    assert loss.item() == pytest.approx(expected.item(), rel=REL)
    torch.testing.assert_close(grad_of(loss, batch), grad_of(expected, batch), **CLOSE)

    # The same numbers through respo_trl.kernels, the TRL trainer's path.
    log_w = sequence_log_weight((lp - batch["old_log_prob"]).detach(), m)
    torch.testing.assert_close(log_w, batch["log_w"], check_dtype=False, **CLOSE)  # float32 sum, as in TRL
    phi_lib = respo_kernel(log_w, batch["adv_seq"])
    torch.testing.assert_close(phi_lib, phi, check_dtype=False, **CLOSE)
    # phi is a stop-gradient coefficient: d loss / d logp_it = -phi_i A_i m_it / N exactly.
    torch.testing.assert_close(grad_of(respo_loss(batch, config=config)[0], batch), -(phi[:, None] * A * m) / m.sum(),
                               **CLOSE)


def test_config_none_uses_paper_defaults_and_local_token_count(batch):
    loss, _ = respo_loss(batch, config=None)
    m = batch["mask"]
    phi = closed_form_phi(batch["log_w"], batch["adv_seq"])
    assert loss.item() == pytest.approx((-(phi[:, None] * batch["advantages"] * batch["log_prob"] * m).sum()
                                         / m.sum()).item(), rel=REL)


def test_seq_mean_token_mean(batch, actor_config):
    loss, _ = respo_loss(batch, loss_agg_mode="seq-mean-token-mean", config=actor_config())
    m = batch["mask"]
    phi = closed_form_phi(batch["log_w"], batch["adv_seq"])
    per_seq = (-(phi[:, None] * batch["advantages"] * batch["log_prob"] * m)).sum(-1) / m.sum(-1)
    assert loss.item() == pytest.approx(per_seq.mean().item(), rel=1e-7)  # verl adds 1e-8 to each length


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_micro_batches_with_global_batch_info_sum_to_the_full_batch(batch, actor_config, mode):
    """verl sets config.global_batch_info per micro-batch; the micro-batch losses must add up to the full loss."""
    full_config = actor_config()
    full, _ = respo_loss(batch, loss_agg_mode=mode, config=full_config)
    full_grad = grad_of(full, batch)

    config = actor_config()
    config.global_batch_info.update(dp_size=1, batch_num_tokens=int(batch["mask"].sum()),
                                    global_batch_size=len(batch["mask"]), loss_scale_factor=None)
    rel = 1e-7 if mode.startswith("seq") else REL
    total, grads = 0.0, []
    for rows in (slice(0, 2), slice(2, 6)):
        part = {k: (v[rows] if torch.is_tensor(v) else v) for k, v in batch.items()}
        part["log_prob"] = batch["log_prob"][rows].detach().clone().requires_grad_(True)
        loss, _ = respo_loss(part, loss_agg_mode=mode, config=config)
        total += loss.item()
        grads.append(grad_of(loss, part))
    assert total == pytest.approx(full.item(), rel=rel)
    torch.testing.assert_close(torch.cat(grads), full_grad, **CLOSE)

    # dp_size scales the per-rank loss exactly as verl's other losses do (gradients are averaged across ranks).
    config.global_batch_info["dp_size"] = 2
    doubled, _ = respo_loss(batch, loss_agg_mode=mode, config=config)
    assert doubled.item() == pytest.approx(2 * full.item(), rel=rel)


def _sampler_weights(batch, level, threshold=2.0):
    """verl's own rollout correction weights for a rollout policy that differs from pi_old."""
    g = torch.Generator().manual_seed(3)
    rollout_log_ratio = torch.randn(batch["mask"].shape, generator=g) * 0.4 * batch["mask"]  # log pi_old/pi_rollout
    weights, _ = compute_rollout_correction_weights(log_ratio=rollout_log_ratio, response_mask=batch["response_mask"],
                                                    rollout_is=level, rollout_is_threshold=threshold)
    return weights, rollout_log_ratio


@pytest.mark.parametrize("respo_rollout_is", ["token", "auto"])
def test_token_level_sampler_weights_fold_into_log_w_and_do_not_scale_the_loss(batch, actor_config,
                                                                               respo_rollout_is):
    weights, raw = _sampler_weights(batch, "token")
    m = batch["mask"]
    assert (weights[m.bool()] != weights[m.bool()][0]).any()  # genuinely per-token
    config = actor_config(f"+actor_rollout_ref.actor.policy_loss.respo_rollout_is={respo_rollout_is}")
    loss, _ = respo_loss(batch, config=config, rollout_is_weights=weights)

    log_w = batch["log_w"] + (torch.log(weights.clamp_min(1e-300)) * m).sum(-1)  # sum_t m_it log r_it
    phi = closed_form_phi(log_w, batch["adv_seq"])
    expected = -(phi[:, None] * batch["advantages"] * batch["log_prob"] * m).sum() / m.sum()  # no extra r factor
    assert loss.item() == pytest.approx(expected.item(), rel=REL)
    torch.testing.assert_close(grad_of(loss, batch), grad_of(expected, batch), **CLOSE)
    # The weights really mattered here (truncation at 2 included).
    assert not math.isclose(loss.item(), respo_loss(batch, config=config)[0].item(), rel_tol=1e-3)


@pytest.mark.parametrize("respo_rollout_is", ["sequence", "auto"])
def test_sequence_level_sampler_weight_is_counted_once(batch, actor_config, respo_rollout_is):
    weights, raw = _sampler_weights(batch, "sequence")
    m = batch["mask"]
    config = actor_config(f"+actor_rollout_ref.actor.policy_loss.respo_rollout_is={respo_rollout_is}")
    loss, _ = respo_loss(batch, config=config, rollout_is_weights=weights)

    r_seq = torch.exp(raw.sum(-1)).clamp(max=2.0)  # verl: prod_t ratio, truncated, broadcast to every token
    log_w = batch["log_w"] + torch.log(r_seq)  # once
    phi = closed_form_phi(log_w, batch["adv_seq"])
    expected = -(phi[:, None] * batch["advantages"] * batch["log_prob"] * m).sum() / m.sum()
    assert loss.item() == pytest.approx(expected.item(), rel=REL)
    torch.testing.assert_close(grad_of(loss, batch), grad_of(expected, batch), **CLOSE)

    # Summing the broadcast copies (L_i log r_i, as a per-token sum does) is a different, wrong loss.
    log_w_l_times = batch["log_w"] + m.sum(-1) * torch.log(r_seq)
    wrong = -(closed_form_phi(log_w_l_times, batch["adv_seq"])[:, None] * batch["advantages"] * batch["log_prob"]
              * m).sum() / m.sum()
    assert abs(wrong.item() - expected.item()) > 1e-3


def test_icepop_rejected_response_gets_no_gradient(batch, actor_config):
    """A zero weight is verl's rejection (IcePop): the response leaves the loss; it is not read as log W = -inf."""
    weights, raw = _sampler_weights(batch, "sequence", threshold="0.5_2.0")
    m = batch["mask"]
    rejected = (weights * m).sum(-1) == 0
    assert rejected.any() and (~rejected).any()
    loss, _ = respo_loss(batch, config=actor_config(), rollout_is_weights=weights)
    grad = grad_of(loss, batch)
    assert (grad[rejected] == 0).all()

    kept = (~rejected).double()
    log_w = batch["log_w"] + torch.log(torch.exp(raw.sum(-1)).clamp_min(1e-300))
    phi = closed_form_phi(log_w, batch["adv_seq"]) * kept
    expected = -(phi[:, None] * batch["advantages"] * batch["log_prob"] * m).sum() / m.sum()  # verl's denominator
    assert loss.item() == pytest.approx(expected.item(), rel=REL)


def test_constants_from_verl_config_reach_the_kernel(batch, actor_config):
    config = actor_config("+actor_rollout_ref.actor.policy_loss.respo_alpha_pos=3.0",
                          "+actor_rollout_ref.actor.policy_loss.respo_beta_pos=0.25",
                          "+actor_rollout_ref.actor.policy_loss.respo_lambda_neg=0.5")
    assert type(config.policy_loss).__name__ == "ReSPOPolicyLossConfig"
    assert config.policy_loss.respo_alpha_pos == 3.0 and config.policy_loss.respo_alpha_neg == 1.0
    loss, _ = respo_loss(batch, config=config)
    w = batch["log_w"].exp()
    phi0_pos = ((1 - 0.25) + 0.25 * w ** 2) ** 0.5  # power mean of order alpha - 1 = 2
    phi0_neg = w ** 0.5
    phi = torch.where(batch["adv_seq"] >= 0, phi0_pos * torch.exp(2.0 * (1 - phi0_pos)),
                      phi0_neg * torch.exp(0.5 * (1 - phi0_neg)))
    m = batch["mask"]
    expected = -(phi[:, None] * batch["advantages"] * batch["log_prob"] * m).sum() / m.sum()
    assert loss.item() == pytest.approx(expected.item(), rel=REL)


def test_plain_policy_loss_config_means_paper_defaults(batch, compose_verl):
    from verl.utils.config import omega_conf_to_dataclass

    composed = compose_verl(["actor_rollout_ref.rollout.n=8", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
                             "actor_rollout_ref.actor.policy_loss.loss_mode=respo"])
    config = omega_conf_to_dataclass(composed.actor_rollout_ref.actor)
    assert type(config.policy_loss).__name__ == "PolicyLossConfig"
    assert respo_verl.respo_constants(config)[0] == respo_verl.RESPO_DEFAULTS
    loss, _ = respo_loss(batch, config=config)
    assert loss.item() == pytest.approx(respo_loss(batch, config=None)[0].item(), rel=1e-12)


def test_empty_response_and_extreme_ratios_stay_finite(actor_config):
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 1, 1]]).bool()
    log_prob = torch.tensor([[-0.1, -0.2, 0.0], [0.0, 0.0, 0.0], [-1.0, -2.0, -3.0]], requires_grad=True)
    old = torch.tensor([[-60.0, -60.0, 0.0], [0.0, 0.0, 0.0], [40.0, 40.0, 40.0]])  # log W far beyond +-20
    adv = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [-1.0, -1.0, -1.0]])
    loss, metrics = get_policy_loss_fn("respo")(old, log_prob, adv, mask, config=actor_config())
    (grad,) = torch.autograd.grad(loss, log_prob)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert all(math.isfinite(v) for v in metrics.values())
    # log W clamps at +20 for the positive response and at -20 for the negative one: phi = phi+-(e^+-20).
    phi = closed_form_phi(torch.tensor([20.0, 0.0, -20.0]), torch.tensor([1.0, 0.0, -1.0]))
    assert phi[0] < 1e-7 and phi[2] < 1e-3
    torch.testing.assert_close(grad, -(phi[:, None] * adv * mask) / mask.sum(), **CLOSE)


def test_metrics_are_per_response_averages_of_the_kernel(batch, actor_config):
    _, metrics = respo_loss(batch, config=actor_config())
    phi = closed_form_phi(batch["log_w"], batch["adv_seq"])
    pos, n = batch["adv_seq"] >= 0, len(phi)
    low = pos & (batch["log_w"] < -1)  # responses 0 (log W = -3) only; response 4 is negative
    assert metrics["respo/frac/pos"] == pytest.approx(pos.sum().item() / n)
    assert metrics["respo/phi_mass/pos"] == pytest.approx(phi[pos].sum().item() / n)
    assert metrics["respo/phi_mass/neg"] == pytest.approx(phi[~pos].sum().item() / n)
    assert metrics["respo/low_weight_pos/frac"] == pytest.approx(low.sum().item() / n)
    assert metrics["respo/low_weight_pos/phi_mass"] == pytest.approx(phi[low].sum().item() / n)
    assert metrics["respo/phi_mean"] == pytest.approx(phi.mean().item())
    # the paper's diagnostic within this micro-batch: share of positives with log W < -1 and their mass share
    share = low.sum().item() / pos.sum().item()
    mass_share = phi[low].sum().item() / phi[pos].sum().item()
    assert metrics["respo/low_weight_pos/share"] == pytest.approx(share)
    assert metrics["respo/low_weight_pos/mass_share"] == pytest.approx(mass_share)
    assert metrics["respo/low_weight_pos/mass_ratio"] == pytest.approx(mass_share / share)


def test_verls_coefficient_is_the_one_every_engine_assembles(batch, actor_config, monkeypatch):
    """One ReSPO coefficient for every engine: verl's loss takes its per-token coefficient from
    ``kernels.respo_weights`` (the TRL trainers' function) and applies exactly that."""
    import respo_trl.kernels as kernels

    seen = []

    def recording(*args, **kwargs):
        weights = kernels.respo_weights(*args, **kwargs)
        seen.append(weights.coefficients)
        return weights

    monkeypatch.setattr(respo_verl, "respo_weights", recording)
    loss, _ = respo_loss(batch, config=actor_config())
    (coefficients,) = seen
    A, lp, m = batch["advantages"], batch["log_prob"], batch["mask"]
    torch.testing.assert_close(grad_of(loss, batch), -(coefficients.to(lp.dtype) * A * m) / m.sum(), **CLOSE)
