"""The ablation lab at smoke size: JSON schema, the R = 1 identity, the decision rule's mechanics, the CLI."""

import json
import pathlib

import pytest
import torch

BENCH_PATH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "ablation_lab.py"


@pytest.fixture(scope="module")
def abl(load_script):
    return load_script("benchmarks/ablation_lab.py")


@pytest.fixture(scope="module")
def result(abl):
    torch.set_num_threads(1)
    cfg = abl.lab.LabConfig(**abl.QUICK)
    variants = abl.make_variants(levels=abl.QUICK_LEVELS)
    return abl.run_ablation(abl.lab_runner(cfg, log=lambda line: None), variants, log=lambda line: None)


def test_variants_one_factor_at_a_time(abl):
    variants = abl.make_variants()
    assert variants["ppo_clip"]["registry"] == "ppo" and variants["respo"]["overrides"] == {}
    for label, v in variants.items():
        if v["factor"] in ("norm", "pos", "neg"):
            assert v["overrides"], label  # a level equal to the default is not run twice
            assert abl.variant_label(v["overrides"]) == label
            prefixes = {"norm": ("respo_norm", "respo_rho_min"), "pos": ("respo_alpha_pos", "respo_lambda_pos"),
                        "neg": ("respo_alpha_neg", "respo_lambda_neg")}[v["factor"]]
            assert set(v["overrides"]) <= set(prefixes), label  # one factor at a time
    assert {"norm=none", "norm=mean", "norm=ess(0.3)", "norm=ess(0.5)", "norm=ess(0.8)"} <= set(variants)
    assert {"pos=(2,3)", "neg=(0.5,0.5)", "neg=(3,3)"} <= set(variants)
    assert variants["neg=(0.5,0.5)"]["in_regime"] is False and variants["pos=(1,1)"]["in_regime"] is False
    assert variants["neg=(1,1.5)"]["in_regime"] is True


def test_json_schema(abl, result, tmp_path):
    assert set(result["regimes"]) == {"moderate", "stress"}
    for regime in result["regimes"].values():
        assert set(regime["results"]) == set(result["variants"])
        for label, by_r in regime["results"].items():
            assert set(by_r) == {"R=1", "R=4"}
            for cell in by_r.values():
                for key in ("final_reward", "reward_at_quarter", "grad_throughput_pos", "grad_throughput_neg",
                            "starved_frac_pos"):
                    assert set(cell[key]) == {"mean", "std", "per_seed"} and len(cell[key]["per_seed"]) == 2
                assert cell["max_drop"] >= 0 and cell["finite"]
                assert len(cell["mean_reward_curve"]) == abl.QUICK["batches"] + 1
                assert set(cell["vs_ppo_points"]) == {"mean", "std", "se", "per_seed"}
        assert regime["results"]["respo"]["R=4"]["vs_default_points"]["mean"] == 0.0
        assert regime["results"]["ppo_clip"]["R=4"]["vs_ppo_points"]["mean"] == 0.0
    dec = result["decision"]
    assert {"table", "factor_leaders", "passing", "winner", "changes_default", "recommended"} <= set(dec)
    assert set(dec["recommended"]) == set(abl.DEFAULT)
    assert dec["winner"] in result["variants"]
    for label, row in dec["table"].items():
        assert isinstance(row["reasons"], list) and "worst_vs_ppo_points" in row, label
    path = abl.write(result, str(tmp_path))
    assert json.loads(pathlib.Path(path).read_text())["criteria"] == abl.CRITERIA
    assert "| variant |" in abl.markdown(result)


def test_r1_every_variant_is_the_on_policy_run(result):
    # phi(1) = 1 for every normalisation and (alpha, lambda), and clipped PPO's coefficient is 1 at w = 1:
    # on-policy all variants follow the same trajectory (same task, same samples)
    for regime in result["regimes"].values():
        ref = torch.tensor(regime["results"]["ppo_clip"]["R=1"]["final_reward"]["per_seed"])
        curve = torch.tensor(regime["results"]["ppo_clip"]["R=1"]["mean_reward_curve"])
        for label, by_r in regime["results"].items():
            cell = by_r["R=1"]
            torch.testing.assert_close(torch.tensor(cell["final_reward"]["per_seed"]), ref, atol=1e-4, rtol=0)
            torch.testing.assert_close(torch.tensor(cell["mean_reward_curve"]), curve, atol=1e-4, rtol=0)
            assert cell["grad_throughput_pos"]["mean"] == pytest.approx(1.0, abs=1e-5), label
            assert cell["grad_throughput_neg"]["mean"] == pytest.approx(1.0, abs=1e-5), label
    for check in result["on_policy_check"].values():
        assert check["max_abs_reward_deviation"] < 1e-4
    # off-policy the variants do differ (so the identity above is not vacuous)
    r4 = result["regimes"]["moderate"]["results"]
    assert len({round(v["R=4"]["final_reward"]["mean"], 6) for v in r4.values()}) > 2


def test_max_drop_and_gate(abl):
    assert abl.max_drop([0.1, 0.2, 0.2, 0.3]) == 0.0
    assert abl.max_drop([0.1, 0.5, 0.3, 0.4, 0.2]) == pytest.approx(0.3)

    def cell(final, drop=0.0, pattern=(0.0, 0.02, -0.02)):
        per = [final + p for p in pattern]
        return {"final_reward": {"mean": final, "std": 0.02, "per_seed": per},
                "reward_at_quarter": {"mean": final / 2, "std": 0.0, "per_seed": per},
                "grad_throughput_pos": {"mean": 1.0, "std": 0.0, "per_seed": [1.0] * 3},
                "finite": [True] * 3, "max_drop": drop}

    def fake(values, patterns=None):  # label -> (moderate R=4, stress R=4, moderate R=8, stress R=8)
        res, patterns = {}, patterns or {}
        for regime, i in (("moderate", 0), ("stress", 1)):
            raw = {lab_: {f"R={r}": cell(v[i + j], **({"pattern": patterns[lab_]} if lab_ in patterns else {}))
                          for r, j in ((4, 0), (8, 2))} for lab_, v in values.items()}
            res[regime] = {"results": {lab_: {k: {**c, **{
                "vs_ppo_points": abl._stats([100 * (a - b) for a, b in zip(c["final_reward"]["per_seed"],
                                                                            raw["ppo_clip"][k]["final_reward"]["per_seed"])]),
                "vs_default_points": abl._stats([100 * (a - b) for a, b in zip(
                    c["final_reward"]["per_seed"], raw["respo"][k]["final_reward"]["per_seed"])])}}
                for k, c in by_r.items()} for lab_, by_r in raw.items()}}
        variants = abl.make_variants(levels={"norm": [], "pos": [{"respo_alpha_pos": 0.25,
                                                                  "respo_lambda_pos": 0.25}],
                                             "neg": [{"respo_alpha_neg": 0.5, "respo_lambda_neg": 0.5}]})
        variants["pos=(0.25,0.25) neg=(3,2)"] = {
            "registry": "respo", "factor": "combined", "in_regime": True, "note": "",
            "overrides": {"respo_alpha_pos": 0.25, "respo_lambda_pos": 0.25, "respo_alpha_neg": 3.0,
                          "respo_lambda_neg": 2.0}}
        return {"variants": {k: v for k, v in variants.items() if k in values}, "regimes": res}

    # pos=(0.25,0.25) better in both regimes (clearly in one) -> adopted; neg=(0.5,0.5) better but out of regime
    result = fake({"ppo_clip": (0.8, 0.6, 0.8, 0.6), "respo": (0.7, 0.8, 0.7, 0.8),
                   "pos=(0.25,0.25)": (0.75, 0.81, 0.7, 0.8), "neg=(0.5,0.5)": (0.9, 0.9, 0.9, 0.9)})
    dec = abl.decide(result)
    assert dec["winner"] == "pos=(0.25,0.25)" and dec["changes_default"]
    assert dec["recommended"]["respo_alpha_pos"] == 0.25 and dec["recommended"]["respo_alpha_neg"] == 2.0
    assert dec["best_overall_by_primary_score"] == "neg=(0.5,0.5)"
    assert "outside the spec's regime" in dec["table"]["neg=(0.5,0.5)"]["reasons"]
    # phase 3: a passing candidate that fails to replicate on fresh seeds is not adopted
    failed = fake({"ppo_clip": (0.8, 0.6, 0.8, 0.6), "respo": (0.7, 0.8, 0.7, 0.8),
                   "pos=(0.25,0.25)": (0.69, 0.81, 0.7, 0.8), "neg=(0.5,0.5)": (0.6, 0.6, 0.6, 0.6)})
    result["confirmation"] = {"seeds": [8, 9, 10], "regimes": failed["regimes"]}
    dec = abl.decide(result)
    assert dec["passing"] == ["pos=(0.25,0.25)"] and dec["confirmation_ran"]
    assert dec["table"]["pos=(0.25,0.25)"]["confirmation"]["confirmed"] is False
    assert dec["winner"] == "respo" and not dec["changes_default"]
    # parsimony: the combined setting ranks first, but its negative-branch change adds nothing beyond seed noise
    values = {"ppo_clip": (0.8, 0.6, 0.8, 0.6), "respo": (0.7, 0.8, 0.7, 0.8),
              "pos=(0.25,0.25)": (0.75, 0.81, 0.7, 0.8), "pos=(0.25,0.25) neg=(3,2)": (0.753, 0.812, 0.7, 0.8)}
    dec = abl.decide(fake(values, {"pos=(0.25,0.25) neg=(3,2)": (0.03, -0.01, -0.02)}))
    assert dec["ranked_winner"] == "pos=(0.25,0.25) neg=(3,2)" and dec["winner"] == "pos=(0.25,0.25)"
    assert dec["parsimony"][0]["factor"] == "neg" and dec["recommended"]["respo_alpha_neg"] == 2.0
    # ... and is kept when its gain is consistent across seeds (SE ~ 0)
    values["pos=(0.25,0.25) neg=(3,2)"] = (0.78, 0.83, 0.7, 0.8)
    dec = abl.decide(fake(values))
    assert dec["winner"] == "pos=(0.25,0.25) neg=(3,2)" and dec["parsimony"] == []
    # better in one regime only -> the default stays
    result = fake({"ppo_clip": (0.8, 0.6, 0.8, 0.6), "respo": (0.7, 0.8, 0.7, 0.8),
                   "pos=(0.25,0.25)": (0.75, 0.7, 0.7, 0.8), "neg=(0.5,0.5)": (0.6, 0.6, 0.6, 0.6)})
    dec = abl.decide(result)
    assert dec["winner"] == "respo" and not dec["changes_default"] and dec["passing"] == []


def test_cli_quick_writes_json_png_and_markdown(abl, tmp_path, capsys):
    abl.main(["--quick", "--factors", "neg", "--no-combine", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "ablation_lab.json").read_text())
    assert {"config", "variants", "regimes", "criteria", "decision", "runtime_s", "command", "machine"} <= set(data)
    assert set(data["variants"]) == {"ppo_clip", "respo", "neg=(1,1.5)"}
    assert (tmp_path / "ablation_lab.png").stat().st_size > 10_000
    abl.main(["--markdown-from", str(tmp_path / "ablation_lab.json")])
    assert "**Decision**" in capsys.readouterr().out
