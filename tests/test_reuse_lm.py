"""The tiny-LM reuse benchmark: its summary arithmetic on known curves, and a smoke-size run of the real script."""

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT

from benchmarks import reuse_lm as bench
from benchmarks.common import (
    REUSE_LM_KEYS,
    compact_history,
    history_rows,
    load_runs,
    read_record_text,
    record_names,
    tokens_to_reach,
)


def test_tokens_to_reach_interpolates_and_says_never():
    curve = [(0, 0.2), (100, 0.6), (200, 0.9)]
    assert tokens_to_reach(curve, 0.2) == 0
    assert tokens_to_reach(curve, 0.4) == pytest.approx(50)
    assert tokens_to_reach(curve, 0.75) == pytest.approx(150)
    assert tokens_to_reach(curve, 0.95) is None


def test_a_compact_history_reads_back_as_the_logged_rows_to_six_digits(tmp_path):
    history = [{"step": 1, "loss": 0.123456789, "reward": 0.5}, {"step": 2, "loss": -1.0e-7 / 3, "grad_norm": 2.0}]
    columns = compact_history(history, ("loss", "reward", "grad_norm", "never_logged"))
    assert columns == {"step": [1, 2], "loss": [0.123457, -3.33333e-08], "reward": [0.5, None],
                       "grad_norm": [None, 2.0]}  # fmt: skip
    rows = history_rows(columns)
    assert rows == [{"step": 1, "loss": 0.123457, "reward": 0.5}, {"step": 2, "loss": -3.33333e-08, "grad_norm": 2.0}]
    (tmp_path / "run.json").write_text(json.dumps({"name": "run", "history": columns}))
    assert load_runs(tmp_path)["run"]["history"] == rows  # readers see rows whichever way the record was written


def run(seed, loss, setting, after, pos, curve, model="dense", low=(0.25, 0.5)):
    staleness = int(setting[1:]) if setting.startswith("N") else 1
    reuse = int(setting[1:]) if setting.startswith("R") else 1
    return {
        "name": f"{model}-{loss}-{setting}-seed{seed}", "model": model, "loss": loss, "reuse": reuse,
        "staleness": staleness, "setting": setting, "seed": seed, "before": curve[0][1], "after": after,
        "max_drop": 0.0, "generated_tokens": curve[-1][0], "global_step": 10,
        "curve": [{"step": i, "generated_tokens": t, "accuracy": a, "n": 10} for i, (t, a) in enumerate(curve)],
        "early": {"grad_throughput_pos": pos, "grad_throughput_neg": 1.0, "starved_frac_pos": 0.0,
                  "low_weight_pos_share": low[0], "low_weight_pos_mass_share": low[1]},
        "wall_s": 1.0,
    }  # fmt: skip


def test_claims_pair_seeds_and_use_the_clipped_r1_final_accuracy():
    results = [
        run(0, "dapo", "R1", 0.6, 1.0, [(0, 0.2), (1000, 0.6)]),
        run(1, "dapo", "R1", 0.8, 1.0, [(0, 0.2), (1000, 0.8)]),
        run(0, "dapo", "R4", 0.5, 0.5, [(0, 0.2), (1000, 0.5)], low=(0.2, 0.1)),
        run(1, "dapo", "R4", 0.6, 0.4, [(0, 0.2), (1000, 0.6)], low=(0.2, 0.1)),
        run(0, "respo", "R4", 0.7, 1.0, [(0, 0.2), (500, 0.7), (1000, 0.7)]),
        run(1, "respo", "R4", 0.9, 1.0, [(0, 0.2), (500, 0.7), (1000, 0.9)]),
        run(0, "respo", "N8", 0.1, 1.0, [(0, 0.2), (250, 0.1)]),
        run(0, "dapo", "N8", 0.3, 1.0, [(0, 0.2), (250, 0.3)]),
    ]
    summary = bench.summarize(results)
    claims = summary["claims"]
    table = bench.markdown(summary)
    assert "| dense | respo | R4 | 10 | 1 | 20.0 ± 0.0 | 80.0 ± 14.1 |" in table  # before, after: mean ± std over seeds
    assert "| dense respo R4 | 20.0 @ 0k | 70.0 @ 0k | 80.0 @ 1k |" in table  # the seed-mean curve
    r4 = claims["dense-R4"]
    assert r4["early_pos_throughput_ratio_vs_clipped"]["mean"] == pytest.approx((2.0 + 2.5) / 2)
    assert r4["respo_minus_dapo_points"]["mean"] == pytest.approx(25.0)  # +20 and +30 points
    assert r4["respo_low_weight_pos_mass_ratio"]["mean"] == pytest.approx(2.0)  # 50% of the mass for 25%
    assert r4["dapo_low_weight_pos_mass_ratio"]["mean"] == pytest.approx(0.5)
    n8 = claims["dense-N8"]
    assert n8["respo_minus_dapo_points"]["mean"] == pytest.approx(-20.0) and n8["respo_ended_below_start"] == 1
    tokens = claims["fraction_of_clipped_R1_tokens_to_its_final_accuracy"]
    assert tokens["clipped_R1_final_accuracy"] == pytest.approx(0.7)  # mean of 0.6 and 0.8
    assert tokens["R4"]["respo"] == pytest.approx(0.5)  # the seed-mean curve reaches 0.7 at 500 of 1000 tokens
    assert tokens["R4"]["dapo"] is None  # clipped R=4 never reaches 0.7
    assert list(summary["arms"]) == ["dense-dapo-R1", "dense-dapo-R4", "dense-respo-R4", "dense-dapo-N8",
                                     "dense-respo-N8"]  # settings ordered R before N


def test_smoke_run_of_the_script(tmp_path):
    """Every arm runs the real recipe from a shared warm start; equal sampling budgets; JSON, plots and resume."""
    out, work = tmp_path / "out", tmp_path / "work"
    command = [
        sys.executable, "-m", "benchmarks.reuse_lm", "--smoke", "--out", str(out), "--work", str(work),
        "--seeds", "0", "--losses", "dapo", "respo", "--reuse", "1", "4", "--staleness", "2", "--moe_losses", "respo",
        "--generations", "2", "--eval_every", "1", "--updates", "4", "--eval_updates", "2", "--workers", "1",
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((out / "reuse_lm.json").read_text())
    dense = {f"dense-{loss}-{s}" for loss in ("dapo", "respo") for s in ("R4", "N2")} | {"dense-dapo-R1"}
    assert set(summary["arms"]) == dense | {"moe-respo-R1", "moe-respo-R4", "moe-respo-N2"}  # R1: one run for all
    arms = {name: json.loads(read_record_text(path)) for name, path in record_names(out / "arms").items()}  # as stored
    for name, arm in arms.items():
        if arm["staleness"] == 1:  # epochs: the same 2 generation batches, R optimizer steps each
            assert arm["global_step"] == 2 * arm["reuse"]
            assert [p["step"] for p in arm["curve"]] == [0, arm["reuse"], 2 * arm["reuse"]]  # a point per generation
        else:  # staleness: the same 4 policy updates, N = 2 per rollout batch, so 2 generation batches
            assert arm["global_step"] == 4 and [p["step"] for p in arm["curve"]] == [0, 2, 4]
        assert arm["generated_tokens"] > 0 and 0 <= arm["after"] <= 1
        assert set(arm["history"]) <= {"step", *REUSE_LM_KEYS}  # written compact: columns of the kept keys
    n2, r1 = arms["dense-respo-N2-seed0"], arms["dense-dapo-R1-seed0"]
    # each sample used once: the same sampled tokens per update as on-policy (2 rollout batches of 2 mini-batches)
    assert n2["generated_tokens"] / n2["global_step"] == pytest.approx(r1["generated_tokens"] / r1["global_step"], rel=0.5)
    assert {"dense-R4", "dense-N2", "moe-R4"} <= set(summary["claims"])
    for png in ("reuse_lm.png", "reuse_lm_staleness.png", "reuse_lm_moe.png", "reuse_lm_moe_staleness.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    assert (work / "warm" / "dense-seed0" / "config.json").is_file()  # one warm start shared by the seed's arms

    again = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert again.returncode == 0 and "8 arms, 8 already done, 0 to run" in again.stdout  # resumes, reruns nothing


def test_per_pass_groups_steps_by_their_pass_over_the_batch():
    # R = 2: steps 1, 3 are fresh passes, steps 2, 4 reuse; step 5 lies beyond the window
    history = [{"step": s, "grad_norm": g} for s, g in ((1, 1.0), (2, 0.2), (3, 3.0), (4, 0.4), (5, 100.0))]
    table = bench.per_pass({"reuse": 2, "history": history}, steps=4)
    assert [row["grad_norm"] for row in table] == [pytest.approx(2.0), pytest.approx(0.3)]


def epochs_run(loss, seed, after, accuracies, lr=1e-4, reuse=4):
    """A record of section 2.7's shape: the held-out curve, the final accuracy and the logged learning rates."""
    curve = [{"step": 48 * i, "accuracy": a} for i, a in enumerate(accuracies)]
    history = [{"step": s, "learning_rate": lr * min(1.0, s / 10), "reuse/pass": (s - 1) % reuse + 1}
               for s in range(1, 21)]  # fmt: skip
    return {"loss": loss, "seed": seed, "setting": f"R{reuse}", "reuse": reuse, "before": accuracies[0],
            "after": after, "curve": curve, "history": history}  # fmt: skip


def test_epochs_rule_reads_falls_against_dapo_and_the_paired_interval():
    curves = {1: (0.1, 0.8, 0.5), 2: (0.1, 0.8, 0.8), 3: (0.1, 0.7, 0.7)}  # respo on seed 1 falls 30 from its peak
    runs = [epochs_run("dapo", s, c[-1], c) for s, c in curves.items()]
    runs += [epochs_run("respo", 1, 0.5, (0.1, 0.8, 0.5)), epochs_run("respo", 2, 0.79, (0.1, 0.8, 0.79)),
             epochs_run("respo", 3, 0.68, (0.1, 0.7, 0.68))]  # fmt: skip
    runs += [epochs_run("dapo", 1, 0.9, (0.1, 0.9), lr=3e-5)]  # another learning rate: its own setting
    reading = bench.safety(runs)
    assert set(reading) == {"R4 lr1e-4", "R4 lr3e-5"}
    decaying = epochs_run("dapo", 1, 0.9, (0.1, 0.9), lr=3.5e-5)
    decaying["history"] = [{**h, "learning_rate": 3.5e-5 * (1 - (h["step"] - 1) / 40)} for h in decaying["history"]]
    assert bench.run_setting(decaying) == "R4 lr3.5e-5"  # the schedule's peak, its digits kept
    assert bench.run_setting({**decaying, "history": [{"step": 1}]}) == "R4"  # no learning rate logged
    arm = reading["R4 lr1e-4"]["arms"]["respo"]
    assert arm["per_seed"][1]["fall"] == pytest.approx(30.0) and arm["per_seed"][1]["peak"] == pytest.approx(80.0)
    assert arm["falls_where_reference_does_not"] == []  # dapo falls by 30 on seed 1 as well
    assert arm["minus_reference"]["per_seed"] == pytest.approx({1: 0.0, 2: -1.0, 3: -2.0})
    assert arm["level_holds"] is False and arm["safe"] is False  # 3 seeds, sd 1: the lower end is below -3

    runs[0] = epochs_run("dapo", 1, 0.79, (0.1, 0.8, 0.79))  # dapo holds on seed 1: respo's fall now counts
    assert bench.safety(runs)["R4 lr1e-4"]["arms"]["respo"]["falls_where_reference_does_not"] == [1]


def test_confirmation_adopts_the_candidate_only_when_both_settings_say_so():
    def arms(lr, gains):
        return [r for s, g in enumerate(gains, 201) for r in (
            epochs_run("respo_current", s, 0.5, (0.1, 0.5), lr=lr), epochs_run("respo_first", s, 0.5 + g, (0.1, 0.5), lr=lr))]

    high = arms(1e-4, (0.05, 0.06, 0.04, 0.05))  # +5 points, tight: a gain with its interval above 0
    assert bench.confirmation(bench.safety(high))["gain_at_R4_lr1e-4"] and not bench.confirmation(bench.safety(high))["adopt_auto"]  # 3e-5 missing
    assert bench.confirmation(bench.safety(high + arms(3e-5, (-0.02, -0.03, -0.01, -0.02))))["adopt_auto"]
    assert not bench.confirmation(bench.safety(high + arms(3e-5, (-0.04, -0.03, -0.05, -0.04))))["adopt_auto"]  # -4 at 3e-5
    wide = arms(1e-4, (0.30, -0.20, 0.25, -0.15)) + arms(3e-5, (0.0, 0.0, 0.01, 0.0))  # +5 with an interval across 0
    assert bench.confirmation(bench.safety(wide))["first_minus_current"]["R4 lr1e-4"]["mean"] == pytest.approx(5.0)
    assert not bench.confirmation(bench.safety(wide))["gain_at_R4_lr1e-4"]
    small = arms(1e-4, (0.02, 0.03, 0.02, 0.03)) + arms(3e-5, (0.0, 0.0, 0.01, 0.0))  # +2.5 at 1e-4: not enough
    assert not bench.confirmation(bench.safety(small))["adopt_auto"] and bench.confirmation(bench.safety(small))["no_loss_at_R4_lr3e-5"]
    assert bench.confirmation(bench.safety([epochs_run("dapo", 1, 0.5, (0.1, 0.5))])) is None
