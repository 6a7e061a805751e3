"""Adaptive reuse (``respo_adaptive_reuse``): a batch stops being served, and a fresh one starts a new cycle, once the
policy has drifted past the threshold; otherwise reuse is exactly TRL's fixed ``num_iterations``."""

import json

import pytest
import torch
from conftest import CPU_ARGS, StopAt, params_of

from respo_trl import ReSPOConfig
from respo_trl.buffer import RolloutBuffer


def serve(buffer, drifts, steps):
    """``steps`` micro-batches from ``buffer``, the drift of each check read from ``drifts`` in turn."""
    drifts, checked = iter(drifts), []

    def measure(rows):
        checked.append(rows is buffer.batch)
        return next(drifts)

    served = [buffer.next_micro_batch(step, lambda: {"x": torch.arange(4.0)}, measure) for step in range(steps)]
    return served, checked


@pytest.mark.parametrize("signal, stop, go", [("kl", 0.5, 0.1), ("ess", 0.1, 0.9)])
def test_a_batch_is_cut_short_when_its_drift_passes_the_threshold(signal, stop, go):
    buffer = RolloutBuffer(reuse=4, steps_per_generation=1, adaptive=signal, threshold=0.3)
    other = {"kl": 0.0, "ess": 1.0}  # the signal not in use never decides
    drift = lambda value: {**other, signal: value}  # noqa: E731
    served, checked = serve(buffer, [drift(go), drift(stop), drift(go), drift(go), drift(stop), drift(go)], 7)
    assert [s.pass_index for s in served] == [0, 1, 0, 1, 2, 0, 1]
    assert [s.sampled for s in served] == ["cycle", None, "stop", None, None, "stop", None]
    assert [s.generation for s in served] == [1, 1, 2, 2, 2, 3, 3] and buffer.refreshes == 2
    assert checked == [True] * 6  # measured before every reuse pass, on the whole batch; never before a fresh one


def test_a_batch_that_does_not_drift_serves_all_its_passes():
    buffer = RolloutBuffer(reuse=2, steps_per_generation=2, adaptive="kl", threshold=0.3)
    served, checked = serve(buffer, [{"kl": 0.0, "ess": 1.0}] * 2, 8)
    assert [s.pass_index for s in served] == [0, 0, 1, 1] * 2
    assert [s.sampled for s in served] == ["cycle", None, None, None] * 2
    assert len(checked) == 2 and buffer.refreshes == 0  # only at the start of each reuse pass


def test_an_unmeasurable_drift_decides_nothing():
    buffer = RolloutBuffer(reuse=2, steps_per_generation=1, adaptive="ess", threshold=0.9)
    served, _ = serve(buffer, [None, {"kl": float("nan"), "ess": float("nan")}], 4)
    assert [s.sampled for s in served] == ["cycle", None, "cycle", None]


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
    assert all(h["reuse/generated_tokens_per_step"] > 0 for h in logs)
    assert all(h["reuse/kl_before_pass"] > 0 for h in logs[1:]) and "reuse/kl_before_pass" not in logs[0]


def test_a_threshold_no_drift_passes_trains_exactly_as_fixed_epochs(make_trainer):
    """Catches a stop that fires every step, and a check that changes the run (RNG, model state) by being made."""
    fixed = make_trainer(num_iterations=4, max_steps=5)
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
    """6 steps straight == 5 steps, checkpoint, resume, 1 step. At lr 1e-2 with threshold 0.05 the straight run stops
    its batch before steps 2, 3, 4 and 6 and serves a second pass at step 5, so the checkpoint after step 5 falls
    inside a cycle: the resumed run must measure step 6's drift against the stored batch and stop as the straight run
    did."""
    setup = dict(num_iterations=3, per_device_train_batch_size=4, gradient_accumulation_steps=1, max_steps=6,
                 respo_adaptive_reuse="kl", respo_adaptive_threshold=0.05)  # fmt: skip
    straight = make_trainer(**setup)
    straight.train()
    straight_logs = logs_of(straight)
    assert [h["reuse/pass"] for h in straight_logs] == [1, 1, 1, 1, 2, 1]  # both decisions are exercised

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
    ],
)
def test_bad_adaptive_settings_are_refused_in_one_line(tmp_path, fields, message):
    with pytest.raises(ValueError, match=message) as error:
        ReSPOConfig(**{**CPU_ARGS, "output_dir": str(tmp_path), "learning_rate": 3e-5, **fields})
    assert "\n" not in str(error.value)
