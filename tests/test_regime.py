"""benchmarks/regime.py (and regime_runs.py, the runs it shares with regime_mechanism.py): the decision rule, the
gate's statistics on known histories, and smoke runs of both stages."""

import json
import math
import os
import subprocess
import sys

import pytest
from conftest import ROOT

from benchmarks import common, regime, regime_runs
from benchmarks.common import next_ready, record_names
from respo_trl.builtin.task import ArithmeticTask


def test_t_quantiles_are_the_tables():
    assert common.t_quantile(4) == pytest.approx(2.776)  # 5 paired seeds
    assert common.t_quantile(2) == pytest.approx(4.303)
    assert common.t_quantile(60) == pytest.approx(2.000, abs=2e-3)  # the expansion beyond the table
    assert math.isinf(common.t_quantile(0))


def test_paired_differences_and_interval():
    a = {0: 0.30, 1: 0.32, 2: 0.28, 3: 0.31, 4: 0.29}
    b = {0: 0.25, 1: 0.27, 2: 0.26, 3: 0.25, 4: 0.27, 5: 0.9}  # seed 5 has no partner: not paired
    d = common.paired(a, b)
    assert d["seeds"] == [0, 1, 2, 3, 4] and d["per_seed"][0] == pytest.approx(5.0)
    diffs = [5.0, 5.0, 2.0, 6.0, 2.0]
    mean, sd = sum(diffs) / 5, (sum((x - 4.0) ** 2 for x in diffs) / 4) ** 0.5
    assert d["mean"] == pytest.approx(mean) and d["sd"] == pytest.approx(sd)
    half = 2.776 * sd / 5**0.5
    assert d["ci"] == pytest.approx([mean - half, mean + half])


def scores(respo, best, pos1, seeds=5, other=0.20):
    return {
        "respo": {s: respo[s % len(respo)] for s in range(seeds)},
        "dapo": {s: best[s % len(best)] for s in range(seeds)},
        "vespo": {s: other for s in range(seeds)},
        "respo_pos1": {s: pos1 for s in range(seeds)},
    }


def test_the_decision_rule():
    holds = regime.verdict(True, scores([0.30, 0.31, 0.29, 0.30, 0.32], [0.25, 0.25, 0.26, 0.24, 0.25], pos1=0.28))
    assert holds["verdict"] == "holds" and holds["best_baseline"] == "dapo"
    # the same gain without beating phi+ = 1 does not hold
    no_pos1 = regime.verdict(True, scores([0.30, 0.31, 0.29, 0.30, 0.32], [0.25, 0.25, 0.26, 0.24, 0.25], pos1=0.35))
    assert no_pos1["verdict"] == "inconclusive"
    fails = regime.verdict(True, scores([0.250, 0.245, 0.255, 0.250, 0.248], [0.26, 0.25, 0.26, 0.255, 0.25], pos1=0.2))
    assert fails["verdict"] == "fails" and fails["vs_best"]["ci"][1] < 1.0
    # the gate not passed: whatever the numbers, nothing is concluded
    assert regime.verdict(False, scores([0.5], [0.1], pos1=0.1))["verdict"] == "inconclusive"
    # four seeds are not enough, and the seeds that would settle it are reported
    few = regime.verdict(True, scores([0.30, 0.27, 0.33, 0.29], [0.25, 0.26, 0.24, 0.26], pos1=0.2, seeds=4))
    assert few["verdict"] == "inconclusive" and "4 paired seeds" in few["reason"]
    noisy = regime.verdict(True, scores([0.35, 0.22, 0.36, 0.24, 0.33], [0.25, 0.25, 0.26, 0.24, 0.25], pos1=0.2))
    assert noisy["verdict"] == "inconclusive" and noisy["seeds_to_resolve"]["to_hold"] > 5
    assert noisy["seeds_to_resolve"]["to_fail"] is None  # a mean above +1 never "fails" with more seeds
    # the best baseline is chosen on ReSPO's seeds: VESPO's extra seed (ReSPO has not run it) does not count
    ahead = scores([0.30], [0.25], pos1=0.2, seeds=2, other=0.24)
    ahead["vespo"][2] = 0.90
    assert regime.verdict(True, ahead)["best_baseline"] == "dapo"


def history(updates=64, n=32, low_at=lambda k: k >= 16):
    """A dapo-like log: staleness k = step mod n, 4 positives per step, low-weight ones at the given staleness."""
    rows = []
    for step in range(1, updates + 1):
        k = (step - 1) % n
        low = 1.0 if low_at(k) else 0.0
        row = {"step": step, "reuse/staleness_mean": float(k), "offpolicy/kl": 0.001 * k,
               "completions/mean_length": 100.0, "starvation/low_weight_pos/n": 4.0,
               "starvation/low_weight_pos/n_low": low, "starvation/low_weight_pos/mass": 4.0,
               "starvation/low_weight_pos/mass_low": 0.5 * low}  # fmt: skip
        for name in ("respo", "vespo"):
            row[f"starvation/low_weight_pos/{name}_mass"] = 4.0
            row[f"starvation/low_weight_pos/{name}_mass_low"] = 1.5 * low if name == "respo" else 0.2 * low
        if k == 0:
            row["reward"] = 0.1 + step / 1000
        rows.append(row)
    return {"history": rows, "updates": updates, "N": n, "generated_tokens": 1, "wall_s": 1.0}


def test_gate_statistics_pool_by_staleness_and_over_the_first_half():
    run = history()
    stats = regime_runs.low_weight_by_staleness(run)
    assert stats["per_k"][0]["share"] == 0.0 and stats["per_k"][20]["share"] == pytest.approx(0.25)
    assert stats["bins"]["16-23"]["share"] == pytest.approx(0.25) and stats["bins"]["0-7"]["share"] == 0.0
    pooled = regime_runs.run_stats(run)["positive_branch"]  # first half: steps 1-32, half of them stale >= 16
    assert pooled["share"] == pytest.approx(16 / 128) and pooled["mass_share"] == pytest.approx(8 / 128)
    assert pooled["respo_mass_ratio"] == pytest.approx((24 / 128) / (16 / 128))  # the same-batch counterfactual
    assert common.per_update_kl(run)["per_token"] == pytest.approx(0.001)  # staleness 1 only
    assert common.per_update_kl(run)["per_response"] == pytest.approx(0.1)
    assert common.per_update_kl(run)["cycle"] == pytest.approx(0.0275)  # staleness 24-31, after the first cycle
    assert common.late_mean(run) == pytest.approx(0.1 + 33 / 1000)  # the one rollout batch sampled after update 32


def test_runs_start_in_the_comparisons_order_as_workers_free_up(tmp_path, monkeypatch):
    """The rule's 5-seed arms come first, seed by seed; a 3-seed arm's run whose warm start happens to be ready earlier
    does not jump ahead of them once a worker is free (the pool runs what it is given first-in first-out)."""
    args = regime.parse(["compare", "--work", str(tmp_path)])
    specs = regime.compare_specs(args, "long-nuisance", 1e-4)
    names = [s["name"] for s in specs]
    assert len(names) == 29 and names[:4] == ["dapo-N32-seed0", "vespo-N32-seed0", "respo-N32-seed0",
                                              "respo_pos1-N32-seed0"]  # fmt: skip
    assert max(names.index(f"respo_pos1-N32-seed{s}") for s in range(5)) < min(
        names.index(n) for n in names if n.startswith(("gspo", "onpolicy", "dapo_clip_higher")))
    assert "onpolicy-N1-seed2" in names
    # the situation the old queueing got wrong: seed 0's warm start lands first, seed 2's (needed by the rule) later
    queue = [s for s in specs if s["name"] in ("respo_pos1-N32-seed2", "gspo-N32-seed0", "onpolicy-N1-seed0",
                                               "dapo_clip_higher-N32-seed0")]  # fmt: skip
    seed0, seed2 = ("long-nuisance", 0), ("long-nuisance", 2)
    assert [s["name"] for s in next_ready(queue, {seed0}, 2)] == ["gspo-N32-seed0", "onpolicy-N1-seed0"]
    assert [s["name"] for s in next_ready(queue, {seed0, seed2}, 1)] == ["respo_pos1-N32-seed2"]
    assert next_ready(queue, {seed0, seed2}, 0) == []

    # and run_all dispatches that way: a pool that runs each task when submitted, warm starts landing seed 0 first
    from concurrent.futures import Future

    started = []

    class Pool:
        def __init__(self, *a, **k):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def submit(self, fn, *a):
            future = Future()
            future.set_result(fn(*a))
            # completion order: warm starts by seed (seed 0's lands first), then runs as submitted
            future.rank = (0, a[1]) if fn is profile else (1, len(started))
            return future

    def profile(setting, seed, *rest):
        t1 = {"accuracy": 0.1, "entropy_per_token": 0.3, "entropy_per_response": 40.0, "mean_length": 140}
        return {"setting": setting, "seed": seed, "train_t1": t1}

    def run(spec):
        started.append(spec["name"])
        return {"name": spec["name"], "stage": "compare", "wall_s": 0.0}

    monkeypatch.setattr(common, "ProcessPoolExecutor", Pool)  # the benchmarks' one runner (common.run_pool)
    monkeypatch.setattr(common, "as_completed", lambda fs: iter(sorted(fs, key=lambda f: f.rank)))
    monkeypatch.setattr(regime_runs, "profile_warm_start", profile)
    monkeypatch.setattr(regime_runs, "run_one", run)
    monkeypatch.setattr(regime_runs, "run_stats", lambda r: {"late_mean": None, "positive_branch": {"share": math.nan}})
    args.workers = 2
    regime_runs.run_all(args, queue, tmp_path / "runs")
    assert started == ["gspo-N32-seed0", "onpolicy-N1-seed0", "respo_pos1-N32-seed2", "dapo_clip_higher-N32-seed0"]


def test_a_run_waiting_for_a_preparation_nobody_gave_is_refused_not_skipped():
    with pytest.raises(ValueError, match=r"^runs need preparation jobs nobody gave: warm-b$"):
        common.run_pool([{"name": "a"}, {"name": "b", "needs": "warm-b"}], print, workers=1, done={}, prepare={})


def test_a_comparison_away_from_the_gates_choice_gets_no_verdict(tmp_path, capsys):
    """A post-hoc run (another learning rate) reuses the committed gate through --gate-dir; the decision rule, written
    for the gated configuration, is not applied to it. At the gate's own choice it is."""
    gate_dir = tmp_path / "regime" / "gate"
    gate_dir.mkdir(parents=True)
    gate_run = {**history(low_at=lambda k: k >= 8), "setting": "long-nuisance", "lr": 1e-4}  # 18.75% low-W: passes
    (gate_dir / "long-nuisance-lr0.0001.json").write_text(json.dumps(gate_run))

    def summarise(lr, *extra):
        out = tmp_path / f"posthoc-{lr:g}"
        (out / "arms").mkdir(parents=True, exist_ok=True)
        for arm, bump in (("respo", 0.0), ("vespo", 0.05)):
            run = history()
            for h in run["history"]:
                if "reward" in h:
                    h["reward"] += bump
            run.update(arm=arm, seed=0, lr=lr, setting="long-nuisance", loss_args=[], name=f"{arm}-N32-seed0")
            (out / "arms" / f"{arm}-N32-seed0.json").write_text(json.dumps(run))
        args = regime.parse(["summary", "--out", str(out), "--work", str(tmp_path / "work"), "--gate-dir", str(gate_dir),
                             *extra])  # fmt: skip
        return out, regime.write_summary(args, out)

    out, posthoc = summarise(7e-5)
    assert posthoc["gate"]["chosen"] == {"setting": "long-nuisance", "lr": 1e-4}
    assert posthoc["verdict"] is None and "lr 7e-05 is not the gate's choice" in posthoc["posthoc"]
    assert "Verdict: none (post-hoc" in capsys.readouterr().out
    assert (out / "regime_comparison.png").is_file() and not (out / "regime_gate.png").exists()  # gate plotted at home
    _, gated = summarise(1e-4)
    assert gated["posthoc"] is None and gated["verdict"]["best_baseline"] == "vespo"
    # read against the gated comparison, seed by seed: VESPO there scored 5 points more than ReSPO here
    rows = summarise(7e-5, "--against", str(tmp_path / "posthoc-0.0001"))[1]["against"]["rows"]
    by_pair = {(r["arm"], r["reference"]): r for r in rows}
    assert set(by_pair) == {("respo", "respo"), ("respo", "vespo"), ("vespo", "respo"), ("vespo", "vespo")}
    assert by_pair["respo", "vespo"]["per_seed"] == {0: pytest.approx(-5.0)}
    assert by_pair["vespo", "respo"]["mean"] == pytest.approx(5.0) and by_pair["respo", "respo"]["mean"] == 0.0
    assert by_pair["respo", "vespo"]["per_update_kl"][0] == pytest.approx(0.001)  # k = 1 rows: offpolicy/kl = 0.001
    table = regime.markdown(json.loads((tmp_path / "posthoc-7e-05" / "regime.json").read_text()))
    assert "| respo | vespo | 0 | -5.0 | -5.0 | n/a | 27.5 / 27.5 |" in table  # one seed: no interval; KL at k = 24-31
    assert regime.posthoc_reason({"chosen": None}, "long", 7e-5) is None  # no gate choice: the rule says so itself


def test_bad_task_settings_and_an_unpassed_gate_are_refused(tmp_path, capsys):
    with pytest.raises(ValueError, match="min_terms"):
        ArithmeticTask(operators="+", min_terms=2, max_terms=4, nuisance=True)  # no separator to choose
    with pytest.raises(ValueError, match="operators='\\+'"):
        ArithmeticTask(operators="+-", nuisance=True)
    with pytest.raises(SystemExit):
        regime.parse(["compare", "--setting", "nonsense"])
    assert "--setting must be one of" in capsys.readouterr().err
    for flag, folder in (("--gate-dir", tmp_path / "nowhere"), ("--against", tmp_path)):  # tmp_path has no regime.json
        with pytest.raises(SystemExit):
            regime.parse(["summary", flag, str(folder)])
        assert f"{flag} {str(folder)!r}" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="no task setting passed the regime gate"):
        regime.main(["compare", "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work")])


@pytest.mark.slow
def test_smoke_runs_of_the_gate_and_the_comparison(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    base = [sys.executable, "-m", "benchmarks.regime"]
    flags = ["--smoke", "--out", str(out), "--work", str(work), "--workers", "1"]
    subprocess.run([*base, "gate", *flags], cwd=ROOT, env=env, check=True, capture_output=True, timeout=600)
    compare = subprocess.run([*base, "compare", *flags, "--override-gate", "--setting", "short", "--lr", "1e-4",
                              "--arms", "dapo", "respo", "onpolicy"], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=600)  # fmt: skip
    assert compare.returncode == 0, compare.stderr[-2000:]
    summary = json.loads((out / "regime.json").read_text())
    assert summary["gate"]["map"][0]["setting"] == "short" and summary["gate"]["passed"] in (True, False)
    assert set(summary["comparison"]["arms"]) == {"dapo", "respo", "onpolicy"}
    assert summary["comparison"]["arms"]["onpolicy"]["N"] == 1
    assert summary["verdict"]["verdict"] in ("holds", "fails", "inconclusive")
    assert (out / "regime_gate.png").is_file() and (out / "regime_comparison.png").is_file()
    first = sorted(record_names(out / "arms"))
    again = subprocess.run([*base, "compare", *flags, "--override-gate", "--setting", "short", "--lr", "1e-4",
                            "--arms", "dapo", "respo", "onpolicy"], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=600)  # fmt: skip
    assert "3 runs, 3 done, 0 to run" in again.stdout  # resumed: finished runs are never rerun
    assert sorted(record_names(out / "arms")) == first
    table = subprocess.run([*base, "summary", "--markdown", "--out", str(out), "--work", str(work)], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=120, check=True).stdout  # fmt: skip
    per_seed = table[table.index("Per seed:") :].splitlines()
    assert "n/a%" not in table  # a missing number (no clipping in ReSPO's kernel, no staleness on-policy) has no unit
    seed0 = summary["comparison"]["arms"]["respo"]["per_seed"]["0"]
    # each arm's row shows that seed's own late-mean score and low-weight share (not a pooled number)
    assert f"| respo | {100 * seed0['late_mean']:.1f} / " in "\n".join(per_seed)


@pytest.mark.slow
def test_a_run_cut_mid_way_resumes_from_its_last_cycle_with_the_same_record(tmp_path, monkeypatch):
    """A session that ends mid-run loses at most the cycle in progress: the run is checkpointed every N updates and,
    started again, resumes from there and writes the record an uninterrupted run writes."""
    from respo_trl.recipe.cli import Interrupted
    from respo_trl.trainer import ReSPOTrainer

    args = regime.parse(["compare", "--smoke", "--work", str(tmp_path / "work"), "--out", str(tmp_path / "out")])

    def spec(name):
        s = regime_runs.base_spec(args, "short", 1)
        s.update(name=name, stage="compare", arm="respo", lr=1e-4, loss_args=regime.ARMS["respo"][0], evaluate=True,
                 runs_dir=str(tmp_path / "out" / name))  # fmt: skip
        for d in (s["runs_dir"], s["scratch"], s["logs_dir"]):
            os.makedirs(d, exist_ok=True)
        return s

    s = spec("whole")
    regime_runs.profile_warm_start("short", 1, [*s["setting_args"], *s["extra"]], s["warm_path"], 8, 2)
    whole = regime_runs.run_one(s)
    assert s["N"] == 2 and whole["global_step"] == 4 and "resumed_from_step" not in whole

    step = ReSPOTrainer.training_step

    def cut_at_update_4(self, *a, **k):
        if self.state.global_step == 3:  # update 3 done, the checkpoint of update 2 (the first cycle's end) on disk
            raise KeyboardInterrupt("session over")
        return step(self, *a, **k)

    cut = spec("cut")
    monkeypatch.setattr(ReSPOTrainer, "training_step", cut_at_update_4)
    with pytest.raises(Interrupted, match="interrupted at step 3 of 4"):  # Ctrl-C, as the recipe reports it
        regime_runs.run_one(cut)
    assert sorted(os.listdir(os.path.join(cut["scratch"], "cut"))).count("checkpoint-2") == 1
    monkeypatch.setattr(ReSPOTrainer, "training_step", step)
    resumed = regime_runs.run_one(cut)
    assert resumed["resumed_from_step"] == 2
    assert [h["step"] for h in resumed["history"]] == [1, 2, 3, 4]  # every update once, the first cycle's from disk
    assert resumed["history"] == whole["history"]
    assert resumed["heldout"] == whole["heldout"] and resumed["generated_tokens"] == whole["generated_tokens"]


def test_a_run_cut_while_scoring_is_scored_again_not_trained_again(tmp_path, monkeypatch):
    """Catches: a run trained to max_steps and cut while being scored was resumed from its final checkpoint, which
    trained one update too many (the trainer now refuses it, so the runner must not ask): with its report written,
    only the scoring reruns; a report of fewer updates is not taken for a finished run; with no report, one line."""
    from respo_trl import recipe

    calls = []
    monkeypatch.setattr(recipe, "main", lambda *args: calls.append(args) or {"training": {"global_step": 4,
                                                                                          "generated_tokens": 9}})
    spec = dict(N=2, scratch=str(tmp_path / "scratch"), name="r", setting_args=[], extra=[], loss_args=[], seed=0,
                updates=4, lr=1e-5, evaluate=False, warm_path=str(tmp_path), logs_dir=str(tmp_path), stage="s",
                arm="a", setting="x", runs_dir=str(tmp_path))  # fmt: skip
    out = tmp_path / "scratch" / "r"

    def leave(step, report_step):
        (out / f"checkpoint-{step}").mkdir(parents=True)
        (out / f"checkpoint-{step}" / "trainer_state.json").write_text(json.dumps({"global_step": step}))
        (out / "trainer_state.json").write_text(json.dumps({"log_history": [{"step": 1, "loss": 0.1}]}))
        if report_step:
            (out / "report.json").write_text(json.dumps({"training": {"global_step": report_step,
                                                                      "generated_tokens": 7}}))  # fmt: skip

    leave(4, 4)  # trained to the end, report written, cut while scoring
    record = regime_runs.run_one(spec)
    assert calls == [] and record["scored_only"] and record["generated_tokens"] == 7 and not out.exists()
    leave(2, 4)  # a report left by an earlier run, a checkpoint short of the end: resumed, trained
    record = regime_runs.run_one(spec)
    assert len(calls) == 1 and calls[0][1].resume_from_checkpoint.endswith("checkpoint-2")
    assert "scored_only" not in record and record["generated_tokens"] == 9
    leave(4, None)  # trained to the end, cut before the recipe wrote its report
    with pytest.raises(SystemExit, match="trained all 4 updates but holds no report of them"):
        regime_runs.run_one(spec)
