"""The starvation lab at smoke size: on-policy identities, the instability it must show, the JSON schema, the CLI."""

import dataclasses
import json
import math
import pathlib
import sys

import pytest
import torch

from respo_trl.kernels import LossParams

LAB_PATH = pathlib.Path(__file__).resolve().parents[1] / "recipes" / "starvation_lab.py"


@pytest.fixture(scope="module")
def lab(load_script):
    return load_script("benchmarks/starvation_lab.py")


@pytest.fixture(scope="module")
def result(lab):
    torch.set_num_threads(1)
    cfg = lab.LabConfig(**lab.QUICK)
    return lab.run_lab(cfg, log=lambda line: None)


def test_json_schema_per_kernel_and_reuse(lab, result):
    assert set(result["kernels"]) == set(lab.KERNELS)
    assert list(result["regimes"]) == ["moderate"]
    results = result["regimes"]["moderate"]["results"]
    for label in lab.KERNELS:
        assert set(results[label]) == {"R=1", "R=4"}
        for run in results[label].values():
            for key in ("final_reward", "grad_throughput_pos", "grad_throughput_neg", "starved_frac_pos"):
                assert set(run[key]) == {"mean", "std", "per_seed"}
                assert len(run[key]["per_seed"]) == 2
            assert len(run["curves"]["reward"]) == 2 and len(run["curves"]["reward"][0]) == lab.QUICK["batches"] + 1
            assert all(run["finite"])
    summary = result["regimes"]["moderate"]["summary"]
    assert {"R=1", "R=4"} == set(summary["per_R"]) and len(summary["statements"]) == 2
    json.loads(json.dumps(result))  # serialisable as written


def test_on_policy_every_kernel_is_the_plain_policy_gradient(lab, result):
    results = result["regimes"]["moderate"]["results"]
    reference = torch.tensor(results["ppo_clip"]["R=1"]["curves"]["reward"])
    for label in lab.KERNELS:
        run = results[label]["R=1"]
        assert run["grad_throughput_pos"]["mean"] == pytest.approx(1.0, abs=1e-5), label
        assert run["grad_throughput_neg"]["mean"] == pytest.approx(1.0, abs=1e-5), label
        assert run["starved_frac_pos"]["mean"] == 0.0
        # identical coefficients on-policy -> identical training, whatever the kernel
        torch.testing.assert_close(torch.tensor(run["curves"]["reward"]), reference, atol=2e-3, rtol=0)


def test_reuse_shows_starvation_and_sequence_is_instability(result):
    results = result["regimes"]["moderate"]["results"]
    r4 = {label: results[label]["R=4"] for label in results}
    # exact sequence importance sampling: weights of long completions at the e^20 clamp
    assert r4["is_seq"]["grad_throughput_pos"]["mean"] > 100
    # raw-product / tight-clip sequence kernels starve positives that ReSPO's normalised kernel keeps
    for label in ("vespo", "gspo"):
        assert r4[label]["grad_throughput_pos"]["mean"] < 0.6 * r4["respo"]["grad_throughput_pos"]["mean"]
        assert r4[label]["starved_frac_pos"]["mean"] > r4["respo"]["starved_frac_pos"]["mean"]
    # off-policy drift actually happened, and the clipped loss lost some of its gradient to it
    assert r4["ppo_clip"]["grad_throughput_pos"]["mean"] < 0.99


def test_phi_curves_match_the_kernels(lab, result):
    w = torch.tensor(result["phi"]["w"], dtype=torch.float64)
    assert w[0] == pytest.approx(1e-4) and w[-1] == pytest.approx(20.0) and (w == 1.0).any()
    curves = result["phi"]["curves"]
    at = lambda x: int((w - x).abs().argmin())  # noqa: E731
    for label, c in curves.items():
        assert c["pos"][at(1.0)] == pytest.approx(1.0, abs=1e-6), label  # phi(1) = 1: on-policy = plain PG
        assert c["neg"][at(1.0)] == pytest.approx(1.0, abs=1e-6), label
    assert curves["respo"]["pos"][0] == pytest.approx(0.0165, rel=0.03)  # spec table, w = 1e-4
    assert curves["vespo"]["pos"][0] == pytest.approx(2.0e-7, rel=0.05)
    assert curves["ppo_clip"]["pos"][at(2.0)] == 0.0  # clipped above 1 + eps for A > 0
    assert curves["ppo_clip"]["neg"][-1] == pytest.approx(20.0, rel=1e-4)  # unbounded w for A < 0
    assert curves["ppo_clip"]["neg"][at(0.5)] == 0.0


def test_ess_normalisation_runs_per_seed(lab):
    cfg = lab.LabConfig(**{**lab.QUICK, "batches": 2, "reuse": (2,)})
    task = lab.Task(cfg, cfg.seeds)
    params = dataclasses.replace(LossParams(), respo_norm="ess")
    run = lab.train(task, cfg, "respo", params, 2)
    assert all(run["finite"]) and all(math.isfinite(v) for v in run["early"]["pos"])


def test_cli_writes_json_and_figures(lab, tmp_path):
    lab.main(["--quick", "--kernels", "ppo_clip", "respo", "--reuse", "1", "2", "--params", "respo_norm=mean",
              "--out", str(tmp_path)])
    data = json.loads((tmp_path / "starvation_lab.json").read_text())
    assert data["config"]["loss_params"]["respo_norm"] == "mean"
    assert set(data["regimes"]["moderate"]["results"]) == {"ppo_clip", "respo"}
    for name in ("reward_curves.png", "throughput.png", "phi_by_sign.png"):
        assert (tmp_path / name).stat().st_size > 10_000
