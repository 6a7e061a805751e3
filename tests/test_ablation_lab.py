"""The ablation lab at smoke size: the variants, the symmetric mask it registers, the R = 1 identity, the decision
rules' mechanics on constructed results, the JSON schema and the CLI."""

import json
import pathlib

import pytest
import torch

from benchmarks import ablation_lab as abl
from benchmarks.starvation_sim import LabConfig
from respo_trl.kernels import LossParams, gradient_coefficients


@pytest.fixture(scope="module")
def result():
    torch.set_num_threads(1)
    cfg = LabConfig(**abl.QUICK)
    variants = abl.make_variants(levels=abl.QUICK_LEVELS)
    return abl.run_ablation(abl.lab_runner(cfg, abl.QUICK_SETTINGS, log=lambda line: None), variants,
                            log=lambda line: None)


def test_variants_one_factor_at_a_time():
    variants = abl.make_variants()
    assert variants["ppo_clip"]["registry"] == "ppo"
    assert variants["respo"]["overrides"] == {"respo_trust_mask": False}  # the paper: no mask, whatever the setting
    keys = {"norm": set(), "mask": {"respo_trust_mask"},
            "pos": {"respo_alpha_pos", "respo_beta_pos", "respo_lambda_pos"},
            "neg": {"respo_alpha_neg", "respo_beta_neg", "respo_lambda_neg"}}
    for label, v in variants.items():
        if v["factor"] in keys:
            changed = {k for k, x in v["overrides"].items() if abl.DEFAULT.get(k) != x}
            assert changed <= keys[v["factor"]], label  # one factor at a time
            assert changed or v["registry"] != "respo", label  # a level equal to the default is not rerun
            assert abl.variant_label({k: v["overrides"][k] for k in changed}, v["registry"]) == label
    assert {"norm=mean", "norm=sqrt", "norm=ess(0.5)", "mask=directional", "mask=symmetric", "pos=(2,0.5,1)",
            "pos=(2,0.5,3)", "pos=(2,0.25,2)", "pos=(1,0.5,2)", "pos=(2,0,2)", "neg=(1,0.5,1)", "neg=(1,0.5,3)",
            "neg=(1,0.25,2)", "neg=(1,0,2)"} == set(variants) - {"ppo_clip", "respo"}
    assert variants["mask=directional"]["overrides"]["respo_trust_mask"] is True
    # the normalisations are the starvation lab's lab-only losses (the library has none)
    assert {k: v["registry"] for k, v in variants.items() if v["factor"] == "norm"} == {
        "norm=mean": "respo_mean", "norm=sqrt": "respo_sqrt", "norm=ess(0.5)": "respo_ess"}
    assert {k for k, v in variants.items() if v["contrast"]} == {"pos=(1,0.5,2)", "pos=(2,0,2)", "neg=(1,0,2)",
                                                                  "mask=symmetric"}


def test_symmetric_mask_zeroes_out_of_band_tokens_of_both_signs():
    # token ratios 0.5, 1.0, 1.5 on two responses of opposite sign
    log_ratio = torch.log(torch.tensor([[0.5, 1.0, 1.5], [0.5, 1.0, 1.5]]))
    mask = torch.ones(2, 3)
    adv = torch.tensor([1.0, -1.0])
    params = LossParams()
    sym = gradient_coefficients("respo_symmetric", log_ratio, adv, mask, params)
    directional = gradient_coefficients("respo", log_ratio, adv, mask, LossParams(respo_trust_mask=True))
    plain = gradient_coefficients("respo", log_ratio, adv, mask, params)
    w = torch.tensor(0.75)  # product of the token ratios
    phi = {1: (1 + w) / 2 * torch.exp(1 - w), -1: w.sqrt() * torch.exp(2 * (1 - w.sqrt()))}
    torch.testing.assert_close(plain, torch.stack([phi[1].expand(3), phi[-1].expand(3)]), rtol=1e-5, atol=0)
    torch.testing.assert_close(sym, torch.tensor([[0, 1, 0], [0, 1, 0]]) * plain, rtol=1e-6, atol=0)
    # the directional mask keeps the low-ratio token of the positive and the high-ratio token of the negative
    torch.testing.assert_close(directional, torch.tensor([[1, 1, 0], [0, 1, 1]]) * plain, rtol=1e-6, atol=0)


def test_json_schema(result, tmp_path):
    assert set(result["regimes"]) == {"moderate", "stress"}
    for regime in result["regimes"].values():
        assert set(regime["results"]) == set(result["variants"])
        for label, by_s in regime["results"].items():
            assert set(by_s) == set(abl.QUICK_SETTINGS)
            for cell in by_s.values():
                for key in ("final_reward", "reward_at_quarter", "grad_throughput_pos", "grad_throughput_neg",
                            "starved_frac_pos"):
                    assert set(cell[key]) == {"mean", "std", "per_seed"} and len(cell[key]["per_seed"]) == 2
                assert set(cell["low_weight_pos"]) == {"share", "mass_share", "mass_ratio"}
                assert cell["max_drop"] >= 0 and cell["finite"]
                assert len(cell["mean_reward_curve"]) == abl.QUICK["batches"] + 1
                assert set(cell["vs_ppo_points"]) == {"mean", "std", "se", "n", "per_seed"}
        assert regime["results"]["respo"]["R=4"]["vs_default_points"]["mean"] == 0.0
        assert regime["results"]["ppo_clip"]["N=8"]["vs_ppo_points"]["mean"] == 0.0
    dec = result["decision"]
    assert {"table", "constants", "passing", "winner", "changes_default", "normalisation", "trust_mask",
            "recommended"} <= set(dec)
    assert set(dec["recommended"]) == set(abl.DEFAULT)
    assert set(dec["normalisation"]) == {"norm=sqrt"}
    assert {"epochs", "staleness"} == set(dec["trust_mask"])
    path = abl.write(result, str(tmp_path))
    assert json.loads(pathlib.Path(path).read_text())["criteria"] == abl.CRITERIA
    assert "| variant |" in abl.markdown(result)


def test_r1_every_variant_is_the_on_policy_run(result):
    # phi(1) = 1 for every normalisation and constant, the masks keep every token at r = 1, and clipped PPO's
    # coefficient is 1 there: on-policy all variants follow the same trajectory (same task, same samples)
    for regime in result["regimes"].values():
        ref = torch.tensor(regime["results"]["ppo_clip"]["R=1"]["final_reward"]["per_seed"])
        curve = torch.tensor(regime["results"]["ppo_clip"]["R=1"]["mean_reward_curve"])
        for label, by_s in regime["results"].items():
            cell = by_s["R=1"]
            torch.testing.assert_close(torch.tensor(cell["final_reward"]["per_seed"]), ref, atol=1e-4, rtol=0)
            torch.testing.assert_close(torch.tensor(cell["mean_reward_curve"]), curve, atol=1e-4, rtol=0)
            assert cell["grad_throughput_pos"]["mean"] == pytest.approx(1.0, abs=1e-5), label
            assert cell["grad_throughput_neg"]["mean"] == pytest.approx(1.0, abs=1e-5), label
    for check in result["on_policy_check"].values():
        assert check["max_abs_reward_deviation"] < 1e-4
    # off-policy the variants do differ (so the identity above is not vacuous)
    r4 = result["regimes"]["moderate"]["results"]
    assert len({round(v["R=4"]["final_reward"]["mean"], 6) for v in r4.values()}) > 2


def test_max_drop():
    assert abl.max_drop([0.1, 0.2, 0.2, 0.3]) == 0.0
    assert abl.max_drop([0.1, 0.5, 0.3, 0.4, 0.2]) == pytest.approx(0.3)


def _fake(finals: dict, noise=(0.0, 0.02, -0.02), drops=None):
    """A result with the decision's inputs: ``finals[label] = {(regime, key): mean final reward}`` (missing cells
    take the label's ``"*"`` entry); per-seed values are mean + noise."""
    regimes, keys = ("moderate", "stress"), ("R=4", "R=8", "N=8", "N=32")
    variants = {k: v for k, v in abl.make_variants().items() if k in finals}

    def cell(mean, drop):
        per = [mean + n for n in noise]
        return {"final_reward": {"mean": mean, "std": 0.02, "per_seed": per},
                "reward_at_quarter": {"mean": mean / 2, "std": 0.0, "per_seed": per},
                "grad_throughput_pos": {"mean": 1.0, "std": 0.0, "per_seed": [1.0] * len(noise)},
                "finite": True, "max_drop": drop}

    raw = {g: {label: {k: cell(f.get((g, k), f["*"]), (drops or {}).get(label, 0.0)) for k in keys}
               for label, f in finals.items()} for g in regimes}
    for g in regimes:
        for label, by_k in raw[g].items():
            for k, c in by_k.items():
                for name, other in (("vs_ppo_points", "ppo_clip"), ("vs_default_points", "respo")):
                    diffs = [100 * (a - b) for a, b in zip(c["final_reward"]["per_seed"],
                                                           raw[g][other][k]["final_reward"]["per_seed"])]
                    c[name] = {**abl._stats(diffs), "per_seed": diffs}
    return {"variants": variants, "regimes": {g: {"results": raw[g]} for g in regimes}}


def test_decision_constants_need_every_primary_cell_and_confirmation():
    base = {"ppo_clip": {"*": 0.7}, "respo": {"*": 0.75}}
    # better than the paper in all four primary cells, clearly (SE ~ 0 with identical noise): adopted
    res = _fake({**base, "pos=(2,0.5,1)": {"*": 0.78}, "neg=(1,0,2)": {"*": 0.9}})
    dec = abl.decide(res)
    assert dec["winner"] == "pos=(2,0.5,1)" and dec["changes_default"]
    assert dec["recommended"]["respo_lambda_pos"] == 1.0 and dec["recommended"]["respo_lambda_neg"] == 2.0
    assert "neg=(1,0,2)" not in dec["passing"]  # a contrast is never a default, however good
    assert dec["best_overall_by_primary_score"] == "neg=(1,0,2)"
    # worse in one primary cell (stress, N = 8): not adopted
    res = _fake({**base, "pos=(2,0.5,1)": {"*": 0.78, ("stress", "N=8"): 0.74}})
    dec = abl.decide(res)
    assert dec["winner"] == "respo" and not dec["changes_default"]
    assert "stress N=8 -1.0" in dec["table"]["pos=(2,0.5,1)"]["bar"][0]
    # better in every primary cell but clearly worse at a check cell: not adopted
    res = _fake({**base, "pos=(2,0.5,1)": {"*": 0.78, ("moderate", "N=32"): 0.70}})
    assert abl.decide(res)["winner"] == "respo"
    # unstable (drops more than clipped PPO and 0.02): not adopted
    res = _fake({**base, "pos=(2,0.5,1)": {"*": 0.78}}, drops={"pos=(2,0.5,1)": 0.05})
    assert abl.decide(res)["winner"] == "respo"
    # passes, but fails to replicate on fresh seeds: not adopted
    res = _fake({**base, "pos=(2,0.5,1)": {"*": 0.78}})
    failed = _fake({**base, "pos=(2,0.5,1)": {"*": 0.74}})
    res["confirmation"] = {"seeds": [8, 9, 10], "settings": ["R=4", "N=8"], "regimes": failed["regimes"]}
    dec = abl.decide(res)
    assert dec["passing"] == ["pos=(2,0.5,1)"] and dec["confirmation_ran"]
    assert dec["table"]["pos=(2,0.5,1)"]["confirmation"]["confirmed"] is False
    assert dec["winner"] == "respo"


def test_decision_normalisation_and_mask():
    base = {"ppo_clip": {"*": 0.7}, "respo": {"*": 0.75}}
    res = _fake({**base, "norm=sqrt": {"*": 0.70, ("stress", "R=8"): 0.80}, "norm=mean": {"*": 0.74},
                      "mask=directional": {"*": 0.75, ("moderate", "R=4"): 0.8, ("stress", "R=8"): 0.77,
                                           ("moderate", "N=8"): 0.70}})
    dec = abl.decide(res)
    assert dec["normalisation"]["norm=sqrt"]["earns_its_place"]  # clearly better in one cell
    assert dec["normalisation"]["norm=sqrt"]["better_than_none_beyond_2se"] == ["stress R=8"]
    assert not dec["normalisation"]["norm=mean"]["earns_its_place"]  # never better: recommended for removal
    assert not dec["normalisation"]["norm=sqrt"]["becomes_default"] and dec["winner"] == "respo"
    mask = dec["trust_mask"]
    assert mask["epochs"]["mask_default_for_R_gt_1"] and mask["epochs"]["mean_gap_points"] == pytest.approx(1.75)
    assert not mask["staleness"]["mask_default_for_N"]  # worse at N = 8: the paper-pure default stays
    res = _fake({**base, "mask=directional": {"*": 0.76, ("stress", "R=4"): 0.70}})
    assert not abl.decide(res)["trust_mask"]["epochs"]["mask_default_for_R_gt_1"]  # one epoch cell clearly worse


def test_cli_quick_writes_json_png_and_markdown(tmp_path, capsys):
    abl.main(["--quick", "--factors", "mask", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "ablation_lab.json").read_text())
    assert {"config", "variants", "regimes", "criteria", "decision", "runtime_s", "cpu_s", "command",
            "machine"} <= set(data)
    assert set(data["variants"]) == {"ppo_clip", "respo", "mask=directional", "mask=symmetric"}
    assert data["config"]["settings"] == abl.QUICK_SETTINGS
    assert (tmp_path / "ablation_lab.png").stat().st_size > 10_000
    abl.main(["--markdown-from", str(tmp_path / "ablation_lab.json")])
    assert "**Decision: constants" in capsys.readouterr().out
    # the committed result (written while respo_norm was a library option) still renders, under the same labels
    abl.main(["--markdown-from", str(pathlib.Path(abl.__file__).parents[1] / "docs/benchmarks/ablation_lab/ablation_lab.json")])
    out = capsys.readouterr().out
    assert "| norm=ess(0.5) | nowhere | moderate N=8, moderate N=32 | no |" in out
