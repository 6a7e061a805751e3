"""benchmarks/smollm2_answers.py (docs/vllm.md): the answer shapes it tells apart and the run's own problems, rebuilt
from a committed report (the vLLM part runs in the vLLM environment only)."""

import json

from conftest import ROOT

from benchmarks.smollm2_answers import run_datasets, shape

REPORT = ROOT / "docs" / "benchmarks" / "smollm2_cpu_vllm" / "last_integer_accuracy" / "report.json"


def test_answer_shapes():
    assert shape("34") == shape(" 34.\n") == "number only"
    assert shape("6 + 28 = 34") == shape("6+28=34.") == "a + b = c"
    assert shape("6 + 28 = 34\n\nThis is a classic example") == "a + b = c, then text"
    assert shape("To calculate 6+28, we add them: 34") == "other"


def test_the_runs_held_out_problems_are_rebuilt_from_its_report():
    """The analysis grades the problems the run was measured on: the same count and, in order, the same prompts."""
    report = json.loads(REPORT.read_text())
    heldout, train = run_datasets(report, train_problems=5)
    assert len(heldout) == report["heldout"]["n"] == 89 and len(train) == 5
    shown = [e["prompt"] for e in report["heldout"]["before_detail"]["examples"]]
    assert [p[-1]["content"] for p in heldout["prompt"][: len(shown)]] == shown
    assert set(heldout["prompt"][i][-1]["content"] for i in range(89)).isdisjoint(
        p[-1]["content"] for p in train["prompt"]
    )
