"""The starvation lab at smoke size: the reuse schedules, on-policy identities, the kernels' closed forms, the
positive-branch diagnostic as the trainer logs it, the JSON schema and the CLI."""

import json
import math

import pytest
import torch

from benchmarks import starvation_lab as lab
from benchmarks import starvation_sim as sim
from respo_trl.diagnostics import positive_low_weight_stats
from respo_trl.kernels import LossParams, gradient_coefficients, kish_ess, respo_kernel


@pytest.fixture(scope="module")
def result():
    torch.set_num_threads(1)
    cfg = sim.LabConfig(**lab.QUICK)
    return lab.run_lab(cfg, log=lambda line: None)


def phi_pos(w):  # the paper's positive branch (2, 0.5, 2)
    return (1 + w) / 2 * torch.exp(1 - w)


def phi_neg(w):  # the paper's negative branch (1, 0.5, 2)
    return torch.sqrt(w) * torch.exp(2 * (1 - torch.sqrt(w)))


# -- the two kinds of reuse -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 4, 8, 16, 32])
def test_staleness_schedule_each_sample_once_minibatch_k_is_k_stale(n):
    cfg = sim.LabConfig()
    plan = sim.schedule(cfg, sim.Reuse("staleness", n))
    updates = [u for _, ups in plan for u in ups]
    assert len(updates) == cfg.batches * cfg.prompts // cfg.minibatch_prompts  # the same number for every N
    assert sum(draws for draws, _ in plan) == cfg.batches * cfg.prompts  # equal generated tokens
    for draws, ups in plan:
        assert [u.staleness for u in ups] == list(range(len(ups)))  # mini-batch k is k updates stale
        assert [(u.lo, u.hi) for u in ups] == [(k * 8, (k + 1) * 8) for k in range(len(ups))]  # disjoint: used once
        assert ups[-1].hi == draws
    assert max(u.staleness for u in updates) == n - 1
    assert all(len(ups) == n for _, ups in plan)  # 96 updates divide by every N here: no cut rollout
    batches = [u.budget_batch for u in updates]
    assert batches == sorted(batches) and set(batches) == set(range(cfg.batches))


@pytest.mark.parametrize("r", [1, 2, 8])
def test_epoch_schedule_each_sample_r_times(r):
    cfg = sim.LabConfig()
    plan = sim.schedule(cfg, sim.Reuse("epochs", r))
    assert len(plan) == cfg.batches and all(draws == cfg.prompts for draws, _ in plan)
    for b, (_, ups) in enumerate(plan):
        assert [(u.lo, u.hi, u.staleness, u.budget_batch) for u in ups] == [(0, 32, k, b) for k in range(r)]


def test_staleness_schedule_cuts_the_last_rollout_at_the_budget():
    cfg = sim.LabConfig(batches=3)  # 12 updates of 8 prompts
    plan = sim.schedule(cfg, sim.Reuse("staleness", 8))
    assert [len(ups) for _, ups in plan] == [8, 4] and [d for d, _ in plan] == [64, 32]
    assert sim.Reuse.parse("N=8") == sim.Reuse("staleness", 8) and sim.Reuse("epochs", 4).key == "R=4"
    with pytest.raises(ValueError):
        sim.Reuse.parse("K=2")


def test_training_follows_the_schedule_and_fresh_minibatches_are_on_policy():
    torch.set_num_threads(1)
    cfg = sim.LabConfig(**{**lab.QUICK, "early_frac": 1.0})  # diagnose every update
    task = sim.Task(cfg, cfg.seeds)
    run = sim.train(task, cfg, "ppo", LossParams(), sim.Reuse("staleness", 4))
    expected = [u.staleness for _, ups in sim.schedule(cfg, sim.Reuse("staleness", 4)) for u in ups]
    assert run["staleness"] == expected == run["diag_staleness"] and run["updates"] == 12
    for s in range(len(cfg.seeds)):
        for k, pos, neg, share in zip(run["diag_staleness"], run["diag"]["pos"][s], run["diag"]["neg"][s],
                                      run["diag"]["low_share"][s]):
            if k == 0:  # sampled by the current policy: exactly on-policy
                assert pos == 1.0 and neg == 1.0 and share == 0.0
        stale = [abs(p - 1) for k, p in zip(run["diag_staleness"], run["diag"]["pos"][s]) if k > 0]
        assert max(stale) > 1e-3  # ... and the stale ones are not
    assert len(run["reward"][0]) == cfg.batches + 1  # one evaluation per budget batch


def test_prompt_stream_is_a_sequence_of_permutations():
    take = sim.prompt_stream(3, 8, torch.Generator().manual_seed(0))
    draws = torch.cat([take(5), take(11), take(8)], dim=1)  # 24 = 3 blocks of 8
    for s in range(3):
        for block in draws[s].view(3, 8):
            assert sorted(block.tolist()) == list(range(8))


# -- the lab's result ------------------------------------------------------------------------------------------------


def test_json_schema_per_kernel_and_setting(result):
    assert set(result["kernels"]) == set(lab.KERNELS)
    assert result["config"]["settings"] == ["R=1", "R=4", "N=1", "N=4"]
    results = result["regimes"]["moderate"]["results"]
    for label in lab.KERNELS:
        assert set(results[label]) == {"R=1", "R=4", "N=1", "N=4"}
        for key, run in results[label].items():
            for k in ("final_reward", "grad_throughput_pos", "grad_throughput_neg", "starved_frac_pos", "pos_length"):
                assert set(run[k]) == {"mean", "std", "per_seed"} and len(run[k]["per_seed"]) == 2
            low = run["low_weight_pos"]
            assert set(low) == {"share", "mass_share", "mass_ratio", "mass_ratio_stepmean"}
            assert len(run["curves"]["reward"]) == 2 and len(run["curves"]["reward"][0]) == lab.QUICK["batches"] + 1
            assert all(run["finite"])
            assert run["updates"] == (6 * int(key[2:]) if key[0] == "R" else 12)
            assert run["max_staleness"] == int(key[2:]) - 1
    same = results["respo"]["N=4"]["low_weight_same_batch"]
    assert set(same) == set(lab.KERNELS)
    assert "low_weight_same_batch" not in results["ppo_clip"]["N=4"]
    summary = result["regimes"]["moderate"]["summary"]
    assert set(summary["per_setting"]) == {"R=1", "R=4", "N=1", "N=4"} and len(summary["statements"]) == 4
    assert {"wins", "losses"} <= set(summary)
    json.loads(json.dumps(result))  # serialisable as written
    assert "| respo |" in lab.markdown(result)


@pytest.mark.parametrize("key", ["R=1", "N=1"])
def test_on_policy_every_kernel_is_the_plain_policy_gradient(result, key):
    results = result["regimes"]["moderate"]["results"]
    reference = torch.tensor(results["ppo_clip"][key]["curves"]["reward"])
    for label in lab.KERNELS:
        run = results[label][key]
        assert run["grad_throughput_pos"]["mean"] == pytest.approx(1.0, abs=1e-5), label
        assert run["grad_throughput_neg"]["mean"] == pytest.approx(1.0, abs=1e-5), label
        assert run["starved_frac_pos"]["mean"] == 0.0
        assert run["low_weight_pos"]["share"]["mean"] == 0.0  # log W = 0 for every response
        # identical coefficients on-policy -> identical training, whatever the kernel
        torch.testing.assert_close(torch.tensor(run["curves"]["reward"]), reference, atol=2e-3, rtol=0)
    # off-policy the kernels do differ, so the identity is not vacuous
    assert len({round(results[k]["R=4"]["final_reward"]["mean"], 5) for k in lab.KERNELS}) > 3


def test_reuse_shows_starvation_and_sequence_is_instability(result):
    r4 = {label: res["R=4"] for label, res in result["regimes"]["moderate"]["results"].items()}
    # exact sequence importance sampling: weights of long completions at the e^20 clamp
    assert r4["is_seq"]["grad_throughput_pos"]["mean"] > 100
    # raw-product (VESPO) and tight-clip (GSPO) sequence kernels starve more positives than ReSPO
    for label in ("vespo", "gspo"):
        assert r4[label]["starved_frac_pos"]["mean"] > r4["respo"]["starved_frac_pos"]["mean"], label
    # off-policy drift actually happened, and the clipped loss lost some of its gradient to it
    assert r4["ppo_clip"]["grad_throughput_pos"]["mean"] < 0.99


def test_respo_never_gives_low_weight_positives_less_than_their_share(result):
    # phi+(W) = (1 + W)/2 e^(1 - W) decreases in W, so positives with log W < -1 always get more than the average
    # positive: ratio >= 1 whenever it is defined (a swapped or VESPO-like positive branch breaks this)
    for key, run in result["regimes"]["moderate"]["results"]["respo"].items():
        ratio = run["low_weight_pos"]["mass_ratio"]
        if ratio == ratio:
            assert ratio >= 1.0, key
        for step_ratio in run["low_weight_pos"]["mass_ratio_stepmean"]["per_seed"]:
            assert step_ratio != step_ratio or step_ratio >= 1.0, key


def test_same_batch_counterfactual_agrees_with_the_run_it_is_computed_on(result):
    run = result["regimes"]["moderate"]["results"]["respo"]["N=4"]
    own, same = run["low_weight_pos"], run["low_weight_same_batch"]["respo"]
    for k in ("share", "mass_share"):
        assert same[k]["per_seed"] == pytest.approx(own[k]["per_seed"], abs=1e-6)
    # the share of low-weight positives is a property of the batch: the same for every kernel's coefficients
    for label, cf in run["low_weight_same_batch"].items():
        assert cf["share"]["per_seed"] == pytest.approx(own["share"]["per_seed"], abs=1e-6), label


def test_step_metrics_are_the_paper_diagnostic_of_the_closed_form():
    # one seed, 6 responses with known sequence log-weights (uniform per token), advantages of both signs
    log_w = torch.tensor([-3.0, -1.5, -0.5, 0.7, -2.0, 1.0], dtype=torch.float64)
    lengths = torch.tensor([4, 6, 3, 5, 2, 6])
    T = 6
    mask = (torch.arange(T) < lengths.unsqueeze(-1)).float()
    log_ratio = (log_w / lengths).unsqueeze(-1).float() * mask
    adv = torch.tensor([1.0, 0.5, 2.0, 1.0, -1.0, -0.5])
    (row,) = sim.step_metrics(log_ratio.unsqueeze(0), adv.unsqueeze(0), mask.unsqueeze(0), LossParams(), "respo")
    w = torch.exp(log_ratio.double().sum(-1))
    phi = phi_pos(w)[:4]
    low = torch.tensor([True, True, False, False])
    assert row["low_share"] == pytest.approx(0.5)
    assert row["low_mass_share"] == pytest.approx((phi[low].sum() / phi.sum()).item(), rel=1e-5)
    assert row["low_ratio"] == pytest.approx(row["low_mass_share"] / 0.5, rel=1e-6)
    expected = positive_low_weight_stats(torch.log(w), torch.cat([phi, phi_neg(w)[4:]]), adv)
    assert row["low_mass_share"] == pytest.approx(expected["mass_share"], rel=1e-5)
    assert row["low_ratio"] > 1.0
    pos_tp = (adv[:4] * lengths[:4] * phi.float()).sum() / (adv[:4] * lengths[:4]).sum()
    assert row["pos"] == pytest.approx(pos_tp.item(), rel=1e-5)
    assert row["pos_length"] == pytest.approx(lengths[:4].float().mean().item())


def test_phi_curves_match_the_closed_forms(result):
    w = torch.tensor(result["phi"]["w"], dtype=torch.float64)
    assert w[0] == pytest.approx(1e-4) and w[-1] == pytest.approx(20.0) and (w == 1.0).any()
    c = {label: {s: torch.tensor(v[s], dtype=torch.float64) for s in ("pos", "neg")}
         for label, v in result["phi"]["curves"].items()}
    at = lambda x: int((w - x).abs().argmin())  # noqa: E731
    for label, curve in c.items():
        assert curve["pos"][at(1.0)] == pytest.approx(1.0, abs=1e-6), label  # phi(1) = 1: on-policy = plain PG
        assert curve["neg"][at(1.0)] == pytest.approx(1.0, abs=1e-6), label
    torch.testing.assert_close(c["respo"]["pos"], phi_pos(w), rtol=2e-5, atol=1e-12)
    torch.testing.assert_close(c["respo"]["neg"], phi_neg(w), rtol=2e-5, atol=1e-12)
    assert c["respo"]["pos"][0] == pytest.approx(1.359, abs=1e-3)  # e/2: low-weight positives are not starved
    # VESPO (TRL defaults): W^2 e^(3(1-W)) for A >= 0, W^3 e^(2(1-W)) for A < 0
    torch.testing.assert_close(c["vespo"]["pos"], w**2 * torch.exp(3 * (1 - w)), rtol=1e-4, atol=1e-12)
    torch.testing.assert_close(c["vespo"]["neg"], w**3 * torch.exp(2 * (1 - w)), rtol=1e-4, atol=1e-12)
    # clipped PPO on one token: W inside the clip's direction, 0 past it; unbounded W for A < 0
    torch.testing.assert_close(c["ppo_clip"]["pos"], torch.where(w <= 1.2, w, 0.0), rtol=1e-5, atol=1e-12)
    torch.testing.assert_close(c["ppo_clip"]["neg"], torch.where(w >= 0.8, w, 0.0), rtol=1e-5, atol=1e-12)
    # the directional trust mask zeroes exactly where the clip would, and keeps phi elsewhere
    torch.testing.assert_close(c["respo_mask"]["pos"], torch.where(w <= 1.2, phi_pos(w), 0.0), rtol=2e-5, atol=1e-12)
    torch.testing.assert_close(c["respo_mask"]["neg"], torch.where(w >= 0.8, phi_neg(w), 0.0), rtol=2e-5, atol=1e-12)
    torch.testing.assert_close(c["is_seq"]["pos"], w, rtol=1e-5, atol=1e-12)


# -- the ablation's normalised ReSPO (lab-only since the library dropped respo_norm) -----------------------------------


def test_normalised_respo_divides_the_clamped_log_weight():
    """Catches: the moved mean/sqrt divisors drifting from the removed library option (l clamped, divided, clamped)."""
    log_ratio = torch.tensor([[0.1, -0.3, 0.2, 0.0], [1.0, 1.0, 0.0, 0.0], [-15.0, -15.0, -15.0, -15.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    adv = torch.tensor([1.0, -1.0, 1.0])
    l, lengths = torch.tensor([0.0, 2.0, -20.0]), torch.tensor([3.0, 2.0, 4.0])  # -60 is clamped before dividing
    for norm, divisor in (("mean", lengths), ("sqrt", lengths.sqrt())):
        c = gradient_coefficients(f"respo_{norm}", log_ratio, adv, mask, LossParams())
        torch.testing.assert_close(c.sum(-1) / lengths, respo_kernel(l / divisor, adv), msg=norm)
    with pytest.raises(ValueError, match="sampler correction"):
        gradient_coefficients("respo_mean", log_ratio, adv, mask, LossParams(), sampler_ratio=torch.ones(3, 4))


def test_ess_normalisation_keeps_effective_sample_size_at_the_floor():
    gen = torch.Generator().manual_seed(7)
    for sigma in (2.0, 4.0, 6.0):
        l = torch.randn(20_000, generator=gen, dtype=torch.float64) * sigma
        log_w = l / sim.log_weight_divisor(l, torch.ones_like(l), "ess")
        assert kish_ess(l.clamp(-20, 20)).item() < sim.ESS_RHO_MIN  # raw weights are degenerate...
        assert kish_ess(log_w).item() == pytest.approx(sim.ESS_RHO_MIN, abs=0.03)  # ...normalised ones at the floor
    assert (sim.log_weight_divisor(torch.tensor([0.1, -0.1]), torch.ones(2), "ess") == 1).all()  # never sharpens


@pytest.mark.parametrize("norm", ["mean", "sqrt", "ess"])
def test_normalised_respo_is_finite_and_on_policy_one(norm):
    log_ratio = torch.tensor([[1e4, -1e4, 0.0], [-1e4, -1e4, -1e4], [1e4, 1e4, 1e4], [0.5, float("nan"), 0.1]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 1], [0, 0, 0], [1, 0, 1]])
    params = LossParams(respo_trust_mask=True)
    c = gradient_coefficients(f"respo_{norm}", log_ratio, torch.tensor([1.0, -1.0, 0.0, 1.0]), mask, params)
    assert torch.isfinite(c).all() and (c[2] == 0).all()
    on_policy = gradient_coefficients(f"respo_{norm}", torch.zeros(4, 5), torch.tensor([1.0, -1.0, 0.5, -0.5]),
                                      torch.ones(4, 5), params)
    torch.testing.assert_close(on_policy, torch.ones(4, 5))


def test_ess_normalisation_runs_per_seed():
    """The seeds are stacked in one batch: the ess scale must come from each seed's own batch."""
    assert sim.seed_slices("respo_ess", 3) == [slice(0, 1), slice(1, 2), slice(2, 3)]
    assert sim.seed_slices("respo_mean", 3) == [slice(0, 3)]
    cfg = sim.LabConfig(**{**lab.QUICK, "batches": 2})
    task = sim.Task(cfg, cfg.seeds)
    run = sim.train(task, cfg, "respo_ess", LossParams(), sim.Reuse("epochs", 2))
    assert all(run["finite"]) and all(math.isfinite(v) for v in run["early"]["pos"])


def test_cli_writes_json_and_figures(tmp_path):
    lab.main(["--quick", "--kernels", "ppo_clip", "respo", "respo_mean", "--reuse", "1", "2", "--staleness", "2",
              "--params", "epsilon_high=0.28", "respo_trust_mask=true", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "starvation_lab.json").read_text())
    assert data["config"]["loss_params"]["epsilon_high"] == 0.28
    assert data["kernels"]["respo"]["overrides"] == {"respo_trust_mask": False}  # the label's own override wins
    assert data["config"]["settings"] == ["R=1", "R=2", "N=2"]
    assert set(data["regimes"]["moderate"]["results"]) == {"ppo_clip", "respo", "respo_mean"}
    assert data["command"].startswith("python -m benchmarks.starvation_lab --quick")
    for name in ("reward_curves.png", "throughput.png", "phi_by_sign.png", "positive_branch.png"):
        assert (tmp_path / name).stat().st_size > 10_000
