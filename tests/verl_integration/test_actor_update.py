"""One real verl actor update (verl's FSDP2 engine + actor loss) with loss_mode=respo on a tiny Qwen3, on CPU."""

from __future__ import annotations

import json
import subprocess

import pytest

from _verl_helpers import VERL_SKIP_REASON  # noqa: E402  (plain module, no verl import)

pytest.importorskip("verl", reason=VERL_SKIP_REASON)

from _verl_helpers import HERE, PYTHON, subprocess_env  # noqa: E402


@pytest.fixture(scope="module")
def update():
    result = subprocess.run([PYTHON, str(HERE / "actor_update.py")], capture_output=True, text=True, timeout=600,
                            env=subprocess_env())
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_engine_step_equals_closed_form_step(update):
    """SGD step of verl's engine == -lr * gradient of the closed-form ReSPO loss (sampler weight counted once)."""
    assert update["policy_loss_config"] == "ReSPOPolicyLossConfig"
    assert update["respo_rollout_is"] == "sequence"  # interpolated from algorithm.rollout_correction.rollout_is
    assert update["max_abs_step"] > 1e-3
    assert update["max_abs_err"] < 1e-4 * update["max_abs_step"]  # float32 round-off only (measured 2e-6)
    assert update["metrics"]["actor/pg_loss"] == pytest.approx(update["expected_loss"], rel=1e-5)


def test_metrics_survive_verl_micro_batch_averaging(update):
    """Two micro-batches of 2 responses (both positive, then both negative): the linear metrics are exact."""
    phi = update["expected_phi"]
    metrics = update["metrics"]
    assert metrics["respo/frac/pos"] == pytest.approx(0.5)
    assert metrics["respo/phi_mass/pos"] == pytest.approx((phi[0] + phi[1]) / 4, rel=1e-5)
    assert metrics["respo/phi_mass/neg"] == pytest.approx((phi[2] + phi[3]) / 4, rel=1e-5)
    assert metrics["respo/low_weight_pos/frac"] == pytest.approx(0.25)  # response 0: log W = -3 + log 1.35 < -1
    assert metrics["respo/low_weight_pos/phi_mass"] == pytest.approx(phi[0] / 4, rel=1e-5)
