"""Adaptive reuse (``respo_adaptive_reuse``): a batch stops being served, and a fresh one starts a new cycle, once the
policy has drifted past the threshold; otherwise reuse is exactly TRL's fixed ``num_iterations``."""

import json

import pytest
import torch
from conftest import CPU_ARGS, StopAt, params_of

from respo_trl import ReSPOConfig
from respo_trl.buffer import RolloutBuffer
from respo_trl.diagnostics import DriftSignals

from benchmarks.common import read_record_text

def serve(buffer, drifts, steps):
    """``steps`` micro-batches from ``buffer``, the drift of each check read from ``drifts`` in turn."""
    drifts, checked = iter(drifts), []

    def measure(rows):
        checked.append(rows is buffer.batch)
        return next(drifts)

    served = [buffer.next_micro_batch(step, lambda: {"x": torch.arange(4.0)}, measure) for step in range(steps)]
    return served, checked


@pytest.mark.parametrize("signal, key, stop, go", [("kl", "kl", 0.5, 0.1), ("ess", "policy_ess", 0.1, 0.9)])
def test_a_batch_is_cut_short_when_its_drift_passes_the_threshold(signal, key, stop, go):
    buffer = RolloutBuffer(reuse=4, steps_per_generation=1, adaptive=signal, threshold=0.3)
    # the signals not in use never decide: "ess" (W with the engine's sampler correction) is the ESS floor's, and
    # adaptive "ess" reads the policy's own drift, "policy_ess"
    other = {"kl": 0.0, "ess": 0.0 if signal == "ess" else 1.0, "policy_ess": 1.0}
    drift = lambda value: DriftSignals(**{**other, key: value})  # noqa: E731
    served, checked = serve(buffer, [drift(go), drift(stop), drift(go), drift(go), drift(stop), drift(go)], 7)
    assert [s.pass_index for s in served] == [0, 1, 0, 1, 2, 0, 1]
    assert [s.sampled for s in served] == ["cycle", None, "stop", None, None, "stop", None]
    assert [s.generation for s in served] == [1, 1, 2, 2, 2, 3, 3] and buffer.refreshes == 2
    assert checked == [True] * 6  # measured before every reuse pass, on the whole batch; never before a fresh one


def test_a_batch_that_does_not_drift_serves_all_its_passes():
    buffer = RolloutBuffer(reuse=2, steps_per_generation=2, adaptive="kl", threshold=0.3)
    served, checked = serve(buffer, [DriftSignals(kl=0.0, ess=1.0, policy_ess=1.0)] * 2, 8)
    assert [s.pass_index for s in served] == [0, 0, 1, 1] * 2
    assert [s.sampled for s in served] == ["cycle", None, None, None] * 2
    assert len(checked) == 2 and buffer.refreshes == 0  # only at the start of each reuse pass


def test_an_unmeasurable_drift_decides_nothing():
    buffer = RolloutBuffer(reuse=2, steps_per_generation=1, adaptive="ess", threshold=0.9)
    served, _ = serve(buffer, [None, DriftSignals(*[float("nan")] * 3)], 4)
    assert [s.sampled for s in served] == ["cycle", None, "cycle", None]


def test_the_report_counts_batches_refreshes_and_passes_per_batch():
    """Issue 52, item 8: report.json's ``training.reuse`` (the recipe's summary table prints it) takes the batches and
    refreshes from the buffer's counters and the passes per batch from the micro-batches served; None without reuse."""
    from types import SimpleNamespace

    from respo_trl.recipe.report import reuse_summary

    def config(reuse, steps_per_generation, signal=None, threshold=None):
        return SimpleNamespace(num_iterations=reuse, gradient_accumulation_steps=1,
                               steps_per_generation=steps_per_generation, respo_adaptive_reuse=signal,
                               respo_adaptive_threshold=threshold)  # fmt: skip

    buffer = RolloutBuffer(reuse=4, steps_per_generation=1, adaptive="kl", threshold=0.3)
    go, stop = DriftSignals(kl=0.1, ess=1.0, policy_ess=1.0), DriftSignals(kl=0.5, ess=1.0, policy_ess=1.0)
    served, _ = serve(buffer, [go, stop, go, go, stop, go], 7)  # batches of 2, 3 and 2 passes: two stops
    fresh = sum(s.pass_index == 0 for s in served)
    assert reuse_summary(buffer, config(4, 1, "kl", 0.3), global_step=7) == {
        "adaptive_reuse": "kl", "adaptive_threshold": 0.3, "batches": 3, "refreshes": 2,
        "passes_per_batch": pytest.approx(len(served) / fresh)}  # fmt: skip
    fixed = RolloutBuffer(reuse=2, steps_per_generation=2)  # two micro-batches (optimizer steps) per pass
    serve(fixed, [], 8)
    summary = reuse_summary(fixed, config(2, 2), global_step=8)
    assert (summary["batches"], summary["refreshes"], summary["passes_per_batch"]) == (2, 0, 2.0)
    assert reuse_summary(RolloutBuffer(reuse=1, steps_per_generation=1), config(1, 1), global_step=8) is None


def logs_of(trainer):
    return [h for h in trainer.state.log_history if "loss" in h]


@pytest.mark.parametrize("loss", ["respo", "dapo", "vespo"])
def test_a_threshold_every_drift_passes_samples_a_fresh_batch_every_step(make_trainer, loss):
    """Catches a stop that never fires (the check unread, the decision ignored): at lr 1e-2 any reuse pass drifts."""
    trainer = make_trainer(loss_type=loss, num_iterations=4, max_steps=4, respo_adaptive_reuse="kl",
                           respo_adaptive_threshold=1e-12)  # fmt: skip
    trainer.train()
    logs = logs_of(trainer)
    assert [h["reuse/pass"] for h in logs] == [1, 1, 1, 1]
    assert [h["reuse/refreshes"] for h in logs] == [0, 1, 2, 3] and trainer.rollouts.refreshes == 3
    from respo_trl.recipe.report import reuse_summary  # what report.json and the recipe's table say of this run

    summary = reuse_summary(trainer.rollouts, trainer.args, trainer.state.global_step)
    assert (summary["batches"], summary["refreshes"], summary["passes_per_batch"]) == (4, 3, 1.0)
    assert all(h["reuse/generated_tokens_per_step"] > 0 for h in logs)
    assert all(h["reuse/kl_before_pass"] > 0 for h in logs[1:]) and "reuse/kl_before_pass" not in logs[0]


def test_a_threshold_no_drift_passes_trains_exactly_as_fixed_epochs(make_trainer):
    """Catches a stop that fires every step, and a check that changes the run (RNG, model state) by being made. The
    fixed run is given adaptive reuse's sampler (new prompts every pass, the next test), so both sample the same
    prompts at each cycle's start."""
    fixed = make_trainer(num_iterations=4, max_steps=5)
    trl_sampler = fixed._get_train_sampler

    def one_pass_sampler(dataset=None):
        sampler = trl_sampler(dataset)
        sampler.repeat_count = fixed.args.steps_per_generation
        return sampler

    fixed._get_train_sampler = one_pass_sampler
    fixed.train()
    adaptive = make_trainer(num_iterations=4, max_steps=5, respo_adaptive_reuse="ess", respo_adaptive_threshold=1e-9)
    adaptive.train()
    got, expected = params_of(adaptive.model), params_of(fixed.model)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=0, msg=name)
    assert [h["reuse/pass"] for h in logs_of(adaptive)] == [1, 2, 3, 4, 1]
    assert [h["loss"] for h in logs_of(adaptive)] == [h["loss"] for h in logs_of(fixed)]
    checks = [h["reuse/ess_before_pass"] for h in logs_of(adaptive) if "reuse/ess_before_pass" in h]
    assert len(checks) == 3 and all(0 < ess < 1 for ess in checks) and adaptive.rollouts.refreshes == 0


def test_resume_keeps_the_cycle_position_and_the_batch_the_drift_is_measured_against(make_trainer, tmp_path):
    """6 steps straight == 5 steps, checkpoint, resume, 1 step. At lr 1e-2 with threshold 0.1 the straight run stops
    its batch before steps 2, 3 and 4 and serves its fourth batch's second and third passes at steps 5 and 6, so the
    checkpoint after step 5 falls inside a cycle: the resumed run must measure step 6's drift (0.075) against the
    stored batch and serve its third pass as the straight run did."""
    setup = dict(num_iterations=3, per_device_train_batch_size=4, gradient_accumulation_steps=1, max_steps=6,
                 respo_adaptive_reuse="kl", respo_adaptive_threshold=0.1)  # fmt: skip
    straight = make_trainer(**setup)
    straight.train()
    straight_logs = logs_of(straight)
    assert [h["reuse/pass"] for h in straight_logs] == [1, 1, 1, 1, 2, 3]  # both decisions are exercised

    first = make_trainer(**setup, save_strategy="steps", save_steps=5, output_dir=str(tmp_path / "run"))
    first.add_callback(StopAt(5))
    first.train()
    meta = json.loads((tmp_path / "run" / "checkpoint-5" / "rollout_buffer-rank0.json").read_text())
    assert meta["has_batch"] and meta["position"] == 2 and meta["refreshes"] == 3
    resumed = make_trainer(**setup, output_dir=str(tmp_path / "run"))
    resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-5"))
    last = logs_of(resumed)[-1]
    for key in ("reuse/pass", "reuse/refreshes", "reuse/kl_before_pass", "reuse/generated_tokens", "loss"):
        assert last[key] == pytest.approx(straight_logs[-1][key], rel=1e-5), key
    got, expected = params_of(resumed.model), params_of(straight.model)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize("threshold", [1e-12, 1e9])
def test_a_token_budget_stops_where_the_next_batch_would_be_sampled(make_trainer, threshold):
    """The recipe's --max_generated_tokens under adaptive reuse: where every check stops its batch (threshold 1e-12)
    the run stops right after the budget, not where a batch happens to serve all its passes (which never comes); where
    none does (1e9) it stops at a cycle's end, as fixed epochs do. Either way it overshoots by less than a batch."""
    from respo_trl.recipe.heldout import token_budget

    trainer = make_trainer(num_iterations=4, max_steps=200, respo_adaptive_reuse="kl", respo_adaptive_threshold=threshold)
    trainer.add_callback(token_budget(trainer, 300))
    trainer.train()
    logs = logs_of(trainer)
    tokens, steps = trainer.rollouts.generated_tokens, trainer.state.global_step
    per_batch = max(h["reuse/generated_tokens_per_step"] for h in logs)
    assert 300 <= tokens < 300 + per_batch and steps < 200
    assert (steps % 4 == 0) if threshold > 1 else logs[-1]["reuse/pass"] == 1


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(respo_adaptive_reuse="kl", respo_adaptive_threshold=1e-3), "needs num_iterations > 1|set num_iterations"),
        (dict(num_iterations=4, respo_adaptive_reuse="kl"), "needs respo_adaptive_threshold"),
        (dict(num_iterations=4, respo_adaptive_threshold=0.9), "needs respo_adaptive_reuse"),
        (dict(num_iterations=4, respo_adaptive_reuse="kl", respo_adaptive_threshold=-1.0), "must be a per-token KL > 0"),
        (dict(num_iterations=4, respo_adaptive_reuse="ess", respo_adaptive_threshold=1.0), r"must be an ESS in \(0, 1\)"),
        (dict(num_iterations=4, respo_adaptive_reuse="drift", respo_adaptive_threshold=0.1), "must be one of"),
        (dict(num_iterations=4, respo_adaptive_reuse="ess", respo_adaptive_threshold=0.9, respo_min_ess=0.5),
         "keep one of them"),
        (dict(num_iterations=4, respo_adaptive_reuse="kl", respo_adaptive_threshold=1e-3, respo_updates_per_rollout=2),
         "measured for epochs only.*set respo_updates_per_rollout=1"),
        (dict(num_iterations=4, respo_adaptive_reuse="kl", respo_adaptive_threshold=1e-3, max_steps=-1),
         "epochs.*: set max_steps"),
    ],
)
def test_bad_adaptive_settings_are_refused_in_one_line(tmp_path, fields, message):
    with pytest.raises(ValueError, match=message) as error:
        ReSPOConfig(**{**CPU_ARGS, "output_dir": str(tmp_path), "learning_rate": 3e-5, **fields})
    assert "\n" not in str(error.value)


# -- the benchmark's rule and chooser (benchmarks/adaptive_reuse.py), on made-up records ------------------------------


def record(setting, loss, lr, seed, final, curve=None, fall=0.0, tokens=100_000):
    """A run's record as the benchmark writes it: the final accuracy, a curve of (tokens, accuracy %)."""
    curve = curve or [(0, 20.0), (tokens, 100 * final)]
    return {"setting": setting, "loss": loss, "lr": lr, "seed": seed, "after": final, "largest_fall": fall,
            "generated_tokens": tokens, "updates": 60, "batches": 60, "signal": None, "reuse": 1,
            "curve": [{"step": i, "generated_tokens": t, "accuracy": a / 100} for i, (t, a) in enumerate(curve)]}


def runs_for(settings: dict, seeds=(1, 2, 3, 4)):
    """``settings``: name -> (offset of the final from R = 1's in points, the curve of a seed, fall of seed 1)."""
    from benchmarks import adaptive_reuse as bench

    runs = {}
    for seed in seeds:
        for lr in bench.LRS:
            base = 0.90 + 0.01 * seed
            runs[f"R1 {lr} {seed}"] = record("R1", "dapo", lr, seed, base, curve=[(0, 20), (50_000, 80), (100_000, 100 * base)])
            for name, (offset, curve, fall) in settings.items():
                for loss in bench.LOSSES:
                    final = base + offset / 100
                    runs[f"{name} {loss} {lr} {seed}"] = record(
                        name, loss, lr, seed, final, curve=curve(final) if curve else None, fall=fall if seed == 1 else 0.0)
    return runs


def test_the_rule_reads_level_falls_and_saving_against_r1():
    from benchmarks import adaptive_reuse as bench

    early = lambda final: [(0, 20), (20_000, 100 * final), (100_000, 100 * final)]  # noqa: E731
    runs = runs_for({"R4-kl0.001": (0.0, early, 0.0), "R2": (-6.0, early, 0.0), "R4": (0.0, None, 30.0)})
    pays = bench.reading(runs, "R4-kl0.001")
    cell = pays["cells"][f"respo lr{bench.SAFE_LR:g}"]
    assert cell["level"]["mean"] == pytest.approx(0.0) and cell["falls"] == [] and cell["safe"]
    assert cell["token_fraction"] == pytest.approx(0.2, abs=0.01) and pays["pays"]
    assert not bench.reading(runs, "R2")["safe"]  # 6 points below R = 1 on every seed
    falls = bench.reading(runs, "R4")
    assert falls["cells"][f"dapo lr{bench.HARSH_LR:g}"]["falls"] == [1] and not falls["safe"]
    assert not falls["saves"]  # its curve reaches R = 1's final - 2 only at the end: a fraction near 1


def test_the_chooser_takes_the_most_saving_qualifying_candidate_and_breaks_ties_toward_kl():
    from benchmarks import adaptive_reuse as bench

    fast = lambda final: [(0, 20), (20_000, 100 * final), (100_000, 100 * final)]  # noqa: E731
    faster = lambda final: [(0, 20), (10_000, 100 * final), (100_000, 100 * final)]  # noqa: E731
    runs = runs_for({"R4-kl0.001": (0.0, fast, 0.0), "R4-ess0.97": (0.0, fast, 0.0), "R4-kl0.0005": (-5.0, faster, 0.0),
                     "R4-ess0.99": (0.0, faster, 20.0)})  # fmt: skip
    candidates = (("kl", 5e-4), ("kl", 1e-3), ("ess", 0.97), ("ess", 0.99))
    result = bench.choose(runs, candidates)
    rows = {r["setting"]: r for r in result["candidates"]}
    assert not rows["R4-kl0.0005"]["qualifies"] and not rows["R4-ess0.99"]["qualifies"]  # too low; a fall
    assert result["qualified"] and result["chosen"]["setting"] == "R4-kl0.001"  # tied with ess 0.97: kl wins
    # none qualifies: the safest worst cell among those without unmatched falls
    runs = runs_for({"R4-kl0.001": (-8.0, fast, 0.0), "R4-ess0.97": (-4.0, fast, 0.0), "R4-ess0.99": (0.0, fast, 20.0)})
    result = bench.choose(runs, (("kl", 1e-3), ("ess", 0.97), ("ess", 0.99)))
    assert not result["qualified"] and result["chosen"]["setting"] == "R4-ess0.97"


@pytest.mark.slow
def test_smoke_run_of_the_benchmark(tmp_path, tiny_model_dir):
    """tune -> evaluate -> summary at smoke size: every run stops at the token budget and records its trace; the
    evaluation is refused before a setting is chosen, and a second tune reruns nothing."""
    import os
    import subprocess
    import sys

    from conftest import ROOT

    out, work = tmp_path / "out", tmp_path / "work"
    common = ["--smoke", "--out", str(out), "--work", str(work), "--workers", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def stage(name, ok=True):
        done = subprocess.run([sys.executable, "-m", "benchmarks.adaptive_reuse", name, *common], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=900)  # fmt: skip
        assert (done.returncode == 0) is ok, done.stderr[-3000:]
        return done

    assert "run the tune stage first" in stage("evaluate", ok=False).stderr
    stage("tune")
    tuning = json.loads((out / "tuning.json").read_text())
    assert tuning["chosen"]["setting"] == "R4-kl0.001" and "6 runs, 6 done" in stage("tune").stdout
    stage("evaluate")
    result = json.loads((out / "evaluation.json").read_text())
    assert set(result["readings"]) == {"R2", "R4", "R4-kl0.001"} and result["runs"] == 2 * 2 * 7
    run = json.loads(read_record_text(out / "evaluation" / "R4-kl0.001-respo-lr0.0001-s1.json"))
    assert run["generated_tokens"] >= 600 and run["updates"] <= 4 * run["batches"] and run["commit"]
    assert "reuse/kl_before_pass" in run["history"] and (out / "adaptive_reuse.png").is_file()
    common[common.index("--workers") + 1] = "1"
    common += ["--smollm2_model", tiny_model_dir]  # the SmolLM2 stage's code path, on the tiny model
    stage("smollm2")
    demo = json.loads((out / "smollm2" / "smollm2.json").read_text())["runs"]
    assert set(demo) == {"R4", "R4-kl0.001"} and demo["R4"]["batches"] == 1 and (out / "smollm2" / "smollm2.png").is_file()


def test_a_batch_sampled_after_a_stop_sees_new_prompts(make_trainer):
    """TRL's sampler repeats a generation batch's prompts for all num_iterations passes; under adaptive reuse the
    batch that follows a stopped one must not sample the same prompts again (catches the sampler left as TRL's), while
    fixed epochs keep TRL's sampler exactly."""
    prompts = {}

    def record(trainer):
        sample = trainer._sample

        def sample_and_record(generation_batch):
            batch = sample(generation_batch)
            prompts.setdefault(id(trainer), []).append(tuple(map(tuple, batch["prompt_ids"].tolist())))
            return batch

        trainer._sample = sample_and_record
        return trainer

    adaptive = record(make_trainer(num_iterations=4, max_steps=4, respo_adaptive_reuse="kl", respo_adaptive_threshold=1e-12))
    adaptive.train()
    seen = prompts[id(adaptive)]
    assert len(seen) == 4 and len({frozenset(p) for p in seen}) == 4  # four batches, four sets of prompts
    fixed = make_trainer(num_iterations=4, max_steps=4)
    assert fixed._get_train_sampler().repeat_count == 4 * fixed.args.steps_per_generation  # TRL's own
    assert adaptive._get_train_sampler().repeat_count == adaptive.args.steps_per_generation


def test_drift_signals_skip_a_bad_log_prob_and_leave_the_sampler_gap_out():
    from respo_trl.diagnostics import drift_rows, drift_signals

    torch.manual_seed(0)
    logps, mask = -torch.rand(4, 6), torch.ones(4, 6)
    old = logps - 0.05 * torch.randn(4, 6)
    clean = drift_signals(drift_rows(logps, old, mask))
    old[1, 2] = float("nan")  # one non-finite old log-prob
    signals = drift_signals(drift_rows(logps, old, mask))
    assert torch.isfinite(torch.tensor(signals.kl)) and signals.kl == pytest.approx(clean.kl, rel=0.3)
    # a sampler correction as large as a fresh vLLM batch's moves the floor's ESS, not the policy's drift
    gap = torch.exp(torch.tensor([[-1.5], [0.0], [1.5], [-0.5]]))
    assert drift_signals(drift_rows(logps, logps, mask, gap)).policy_ess == pytest.approx(1.0)
    assert drift_signals(drift_rows(logps, logps, mask, gap)).ess < 0.8


def test_a_streamed_dataset_is_refused_in_one_line(tokenizer, toy_dataset, tmp_path):
    from respo_trl import ReSPOTrainer
    from respo_trl.builtin.tiny_model import tiny_qwen3
    from respo_trl.rewards import crc_reward

    args = ReSPOConfig(**{**CPU_ARGS, "output_dir": str(tmp_path), "max_steps": 2, "num_iterations": 2,
                          "respo_adaptive_reuse": "kl", "respo_adaptive_threshold": 1e-3})  # fmt: skip
    with pytest.raises(ValueError, match="needs a map-style train_dataset") as error:
        ReSPOTrainer(model=tiny_qwen3(tokenizer), reward_funcs=crc_reward, args=args,
                     train_dataset=toy_dataset.to_iterable_dataset(), processing_class=tokenizer)  # fmt: skip
    assert "\n" not in str(error.value)
