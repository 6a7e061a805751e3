"""The keep-or-drop study (benchmarks.async_staleness): one smoke run records what the rule reads, the rule's sizing
simulation behaves as its definition says, and the rule reads synthetic records as written on the page."""

from __future__ import annotations

import pytest

from benchmarks import async_staleness as study
from benchmarks.common import stored_record


def record(loss, bound, seed, after, fall=0.0, dropped=0.0):
    return {"name": study.run_name(loss, bound, seed), "loss": loss, "bound": bound, "seed": seed, "after": after,
            "largest_fall": fall, "dropped_share": dropped, "peak": 100 * after, "updates": 50,
            "generated_tokens": 100_000}  # fmt: skip


def test_margin_and_detectable_deficit_follow_their_definitions():
    margin = study.simulate_margin(7.0, 10, trials=4000)
    assert 6.0 < margin < 8.0  # about (t_9 + z_0.8) sd / sqrt(10) = 6.9
    assert study.simulate_margin(7.0, 6, trials=4000) > margin  # fewer seeds, wider margin
    deficit = study.detectable_deficit(7.0, 10, margin, trials=4000)
    assert 3.0 < deficit < 5.5


def test_the_rule_reads_records_as_the_page_says():
    records = {}
    for seed in range(1, 7):
        records.update({r["name"]: r for r in [
            record("clip", 4, seed, 0.90 + 0.01 * (seed % 3), dropped=0.17),
            record("respo", 16, seed, 0.90 + 0.01 * (seed % 3) - 0.002 * seed),          # equal within noise
            record("vespo", 16, seed, 0.70, fall=20.0 if seed == 2 else 0.0),             # far worse, one fall
            record("clip", 16, seed, 0.91 + 0.01 * (seed % 3), fall=20.0),                # falls, the baseline never
            record("respo", 4, seed, 0.90 + 0.01 * (seed % 3), dropped=0.17),             # wastes as much
            record("vespo", 4, seed, 0.89 + 0.01 * (seed % 3), dropped=0.17),
        ]})  # fmt: skip
    reading = study.reading(records, margin=3.0, fall=15.0)
    assert reading["respo@16"]["loses_nothing"] and reading["respo@16"]["wastes_less"]
    assert not reading["vespo@16"]["loses_nothing"] and reading["vespo@16"]["unmatched_falls"] == [2]
    assert not reading["clip@16"]["loses_nothing"] and len(reading["clip@16"]["unmatched_falls"]) == 6
    assert not reading["respo@4"]["wastes_less"]


@pytest.mark.slow
def test_a_smoke_run_records_what_the_rule_reads(tmp_path):
    args = study.parse(["pilot", "--smoke", "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work")])
    (spec,) = [s for s in study.specs_for(args, "pilot", [("respo", 4)], (1,))]
    spec["lags"] = {int(k): p for k, p in spec["lags"].items()}
    study.warm_start("dense", 1, spec["extra"], spec["warm_path"])
    run = study.run_one(spec)
    assert run["generated_tokens"] >= spec["budget"] and run["updates"] > 0
    assert 0 <= run["dropped_tokens"] <= run["received_tokens"] <= run["generated_tokens"]
    assert run["curve"][0]["generated_tokens"] == 0 and run["heldout_n"] == 8
    assert run["dropped_share"] == pytest.approx(run["dropped_tokens"] / run["generated_tokens"])
    assert stored_record(tmp_path / "out" / "pilot" / f"{spec['name']}.json").exists()
