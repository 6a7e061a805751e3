"""The tiny-LM reuse benchmark: its summary arithmetic on known curves, and a smoke-size run of the real script."""

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT


@pytest.fixture(scope="module")
def bench(load_script):
    return load_script("benchmarks/reuse_lm.py")


def test_tokens_to_reach_interpolates_and_says_never(bench):
    curve = [(0, 0.2), (100, 0.6), (200, 0.9)]
    assert bench.tokens_to_reach(curve, 0.2) == 0
    assert bench.tokens_to_reach(curve, 0.4) == pytest.approx(50)
    assert bench.tokens_to_reach(curve, 0.75) == pytest.approx(150)
    assert bench.tokens_to_reach(curve, 0.95) is None


def run(seed, loss, reuse, after, pos, curve, model="dense"):
    return {
        "name": bench_name(model, loss, reuse, seed), "model": model, "loss": loss, "reuse": reuse, "seed": seed,
        "before": curve[0][1], "after": after, "max_drop": 0.0, "generated_tokens": curve[-1][0],
        "curve": [{"step": i, "generated_tokens": t, "accuracy": a, "n": 10} for i, (t, a) in enumerate(curve)],
        "early": {"grad_throughput_pos": pos, "grad_throughput_neg": 1.0, "starved_frac_pos": 0.0},
        "wall_s": 1.0,
    }  # fmt: skip


def bench_name(model, loss, reuse, seed):
    return f"{model}-{loss}-R{reuse}-seed{seed}"


def test_claims_pair_seeds_and_use_the_clipped_r1_final_accuracy(bench):
    results = [
        run(0, "dapo", 1, 0.6, 1.0, [(0, 0.2), (1000, 0.6)]),
        run(1, "dapo", 1, 0.8, 1.0, [(0, 0.2), (1000, 0.8)]),
        run(0, "dapo", 4, 0.5, 0.5, [(0, 0.2), (1000, 0.5)]),
        run(1, "dapo", 4, 0.6, 0.4, [(0, 0.2), (1000, 0.6)]),
        run(0, "respo", 4, 0.7, 1.0, [(0, 0.2), (500, 0.7), (1000, 0.7)]),
        run(1, "respo", 4, 0.9, 1.0, [(0, 0.2), (500, 0.7), (1000, 0.9)]),
    ]
    summary = bench.summarize(results)
    claims = summary["claims"]
    table = bench.markdown(summary)
    assert "| dense | respo | 4 | 20.0 ± 0.0 | 80.0 ± 14.1 |" in table  # before, after: mean ± std over seeds
    assert "| dense respo R=4 | 20.0 | 70.0 | 80.0 |" in table  # the seed-mean curve
    assert claims["early_pos_throughput_ratio_R4"]["mean"] == pytest.approx((2.0 + 2.5) / 2)
    assert claims["respo_minus_clipped_R4_points"]["mean"] == pytest.approx(25.0)  # +20 and +30 points
    tokens = claims["respo_R4_tokens_to_clipped_R1_final"]
    assert tokens["clipped_R1_final_accuracy"] == pytest.approx(0.7)  # mean of 0.6 and 0.8
    assert tokens["respo_R4_tokens"] == pytest.approx(500)  # the seed-mean curve reaches 0.7 at 500 tokens
    assert tokens["fraction_of_clipped_R1_tokens"] == pytest.approx(0.5)
    by_loss = claims["R4_fraction_of_clipped_R1_tokens_by_loss"]
    assert by_loss["respo"] == pytest.approx(0.5) and by_loss["dapo"] is None  # clipped R=4 never reaches 0.7


def test_smoke_run_of_the_script(tmp_path):
    """Every arm runs the real recipe from a shared warm start; equal sampling budgets; JSON, plots and resume."""
    out, work = tmp_path / "out", tmp_path / "work"
    command = [
        sys.executable, str(ROOT / "benchmarks" / "reuse_lm.py"), "--smoke", "--out", str(out), "--work", str(work),
        "--seeds", "0", "--losses", "dapo", "respo", "--reuse", "1", "4", "--moe_losses", "respo", "--moe_reuse", "2",
        "--generations", "2", "--eval_every", "1", "--workers", "1",
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((out / "reuse_lm.json").read_text())
    assert set(summary["arms"]) == {
        "dense-dapo-R1",
        "dense-dapo-R4",
        "dense-respo-R1",
        "dense-respo-R4",
        "moe-respo-R2",
    }
    arms = {path.stem: json.loads(path.read_text()) for path in (out / "arms").glob("*.json")}
    for name, arm in arms.items():
        assert arm["global_step"] == 2 * arm["reuse"]  # the same 2 generation batches, R optimizer steps each
        assert [p["step"] for p in arm["curve"]] == [0, arm["reuse"], 2 * arm["reuse"]]  # a point per generation
        assert arm["generated_tokens"] > 0 and 0 <= arm["after"] <= 1
    assert {"early_pos_throughput_ratio_R4", "respo_minus_clipped_R4_points"} <= set(summary["claims"])
    for png in ("reuse_lm.png", "reuse_lm_moe.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    assert (work / "warm" / "dense-seed0" / "config.json").is_file()  # one warm start shared by the seed's arms

    again = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert again.returncode == 0 and "5 arms, 5 already done, 0 to run" in again.stdout  # resumes, reruns nothing


def test_per_pass_groups_steps_by_their_pass_over_the_batch(bench):
    # R = 2: steps 1, 3 are fresh passes, steps 2, 4 reuse; step 5 lies beyond the window
    history = [{"step": s, "grad_norm": g} for s, g in ((1, 1.0), (2, 0.2), (3, 3.0), (4, 0.4), (5, 100.0))]
    table = bench.per_pass({"reuse": 2, "history": history}, steps=4)
    assert [row["grad_norm"] for row in table] == [pytest.approx(2.0), pytest.approx(0.3)]
