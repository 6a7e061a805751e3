"""recipes/eval_math.py and respo_trl.grading: metric math on hand-made numbers, grading identical to the training
reward, dataset schema mapping, and end-to-end runs (known completions; the tiny model from a local Hub snapshot)."""

import json
import math
import os
import shutil
from pathlib import Path

import pytest

from respo_trl.builtin.task import ArithmeticTask
from respo_trl.grading import (
    aggregate,
    default_ks,
    gold_solution,
    grade,
    length_bin_index,
    length_bins,
    majority_vote,
    parse_prediction,
    pass_at_k,
    problem_metrics,
    results_table,
)

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "tests" / "data" / "math500_sample.jsonl"
OLYMPIAD = ROOT / "tests" / "data" / "olympiadbench_sample.jsonl"  # hand-made rows in math-ai/olympiadbench's layout
MINERVA = ROOT / "tests" / "data" / "minervamath_sample.jsonl"  # hand-made rows in math-ai/minervamath's layout


@pytest.fixture(scope="module")
def eval_math():
    import respo_trl.recipe.eval_math

    return respo_trl.recipe.eval_math


# -- metric math ------------------------------------------------------------------------------------------------------------


def test_pass_at_k_hand_numbers_and_binomial_definition():
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    assert pass_at_k(10, 3, 5) == pytest.approx(1 - 21 / 252)  # 1 - C(7,5)/C(10,5)
    assert pass_at_k(4, 2, 2) == pytest.approx(1 - 1 / 6)  # 1 - C(2,2)/C(4,2)
    assert pass_at_k(8, 0, 8) == 0.0
    assert pass_at_k(8, 1, 8) == 1.0
    assert pass_at_k(8, 6, 3) == 1.0  # fewer than k wrong samples: any k contain a correct one
    for n in (1, 5, 16):
        for c in range(n + 1):
            for k in range(1, n + 1):
                exact = 1 - math.comb(n - c, k) / math.comb(n, k)
                assert pass_at_k(n, c, k) == pytest.approx(exact, abs=1e-12)
        assert pass_at_k(n, 1, 1) == pytest.approx(1 / n)  # pass@1 is the mean accuracy
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)


def test_default_ks():
    assert default_ks(1) == [1]
    assert default_ks(4) == [1, 2, 4]
    assert default_ks(6) == [1, 2, 4, 6]
    assert default_ks(64) == [1, 2, 4, 8, 16, 32, 64]


def test_majority_vote_counts_ties_and_abstentions():
    assert majority_vote(["a", "a", "b"], [True, True, False]) == 1.0
    assert majority_vote(["a", "b", "b"], [True, False, False]) == 0.0
    # A two-way tie scores the share of correct winners, whatever the sample order.
    assert majority_vote(["a", "b", "a", "b"], [True, False, True, False]) == 0.5
    assert majority_vote(["b", "a", "b", "a"], [False, True, False, True]) == 0.5
    assert majority_vote(["a", "b", "c"], [False, True, False]) == pytest.approx(1 / 3)
    # Samples without an answer do not vote: one correct answer beats three blanks.
    assert majority_vote([None, None, None, "a"], [False, False, False, True]) == 1.0
    assert majority_vote([None, None], [False, False]) == 0.0
    # Equivalent spellings merge into one answer when `same` says so.
    same = lambda x, y: {x, y} == {"0.5", "1/2"}
    answers, correct = ["0.5", "1/2", "3", "3"], [True, True, False, False]
    assert majority_vote(answers, correct) == 0.0  # '3' has 2 votes, '0.5' and '1/2' one each
    assert majority_vote(answers + ["1/2"], correct + [True], same) == 1.0  # 3 votes against 2
    assert majority_vote(answers, correct, same) == 0.5  # 2 against 2: a tie


def test_aggregate_and_table_on_hand_made_problems():
    problems = [
        {"n": 4, "correct": 4, "pass_at_k": {"1": 1.0, "4": 1.0}, "maj": 1.0},
        {"n": 4, "correct": 1, "pass_at_k": {"1": 0.25, "4": 1.0}, "maj": 0.0},
        {"n": 4, "correct": 0, "pass_at_k": {"1": 0.0, "4": 0.0}, "maj": 0.0},
    ]
    summary = aggregate(problems)
    assert summary["avg_at_n"] == pytest.approx(1.25 / 3)
    accuracies = [1.0, 0.25, 0.0]
    mean = sum(accuracies) / 3
    std = math.sqrt(sum((a - mean) ** 2 for a in accuracies) / 2)
    assert summary["avg_at_n_stderr"] == pytest.approx(std / math.sqrt(3))
    assert summary["pass_at_k"] == {"1": pytest.approx(1.25 / 3), "4": pytest.approx(2 / 3)}
    assert summary["maj_at_n"] == pytest.approx(1 / 3)
    table = results_table({"results": [{"benchmark": "toy", **summary}]})
    assert table.splitlines()[0] == "| benchmark | problems | n | avg@n | pass@4 | maj@n |"
    assert "| toy | 3 | 4 | 41.7 ± 30.0 | 66.7 | 33.3 |" in table


# -- grading is the training reward -----------------------------------------------------------------------------------------

COMPLETIONS = [
    "So the answer is $\\boxed{\\frac{1}{2}}$.",
    "It is \\boxed{0.5}",
    "The answer is 1/2",  # no anchor: the training reward extracts nothing
    "\\boxed{3} then \\boxed{1/2}",  # first boxed answer counts
    "$x = \\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}$",
    "",
]


def test_grade_is_trl_accuracy_reward_and_shares_its_extraction():
    from trl.rewards import accuracy_reward

    gold = gold_solution("\\frac{1}{2}")
    logged = {}
    expected = accuracy_reward(
        [[{"role": "assistant", "content": c}] for c in COMPLETIONS],
        [gold] * len(COMPLETIONS),
        log_extra=lambda k, v: logged.__setitem__(k, v),
    )
    grades = grade(COMPLETIONS, [gold] * len(COMPLETIONS))
    assert [g.reward for g in grades] == expected == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert [g.answer for g in grades] == logged["answer_parsed"]
    # The extraction used for majority voting is the one inside the reward.
    for completion, answer in zip(COMPLETIONS, logged["answer_parsed"]):
        parsed = parse_prediction(completion)
        assert (str(parsed) if parsed else "[unparseable]") == answer


def test_gold_answers_are_boxed_so_math_answers_parse_as_written():
    from trl.rewards import accuracy_reward

    for answer, completion in [
        ("4 - 7i", "\\boxed{4-7i}"),
        ("3\\sqrt{13}", "\\boxed{3\\sqrt{13}}"),
        ("1,-2", "\\boxed{-2, 1}"),
    ]:
        assert gold_solution(answer) == f"\\boxed{{{answer}}}"
        assert grade([completion], [gold_solution(answer)])[0].correct, answer
        # The bare string is mis-parsed by math-verify's default gold parse (why gold_solution exists).
        assert accuracy_reward([[{"content": completion}]], [answer])[0] == 0.0, answer
    assert gold_solution(27.0) == "\\boxed{27}" and gold_solution("\\boxed{5}") == "\\boxed{5}"
    assert grade(["\\boxed{\\text{(C)}}"], [gold_solution("\\text{(C)}")])[0].correct


def test_problem_metrics_votes_on_equivalent_answers():
    texts = ["\\boxed{0.5}", "\\boxed{\\frac{1}{2}}", "\\boxed{3}", "no answer"]
    grades = grade(texts, [gold_solution("\\frac12")] * 4)
    metrics = problem_metrics(grades, texts, [1, 2, 4])
    assert metrics["correct"] == 2 and metrics["n"] == 4
    assert metrics["pass_at_k"] == {"1": 0.5, "2": pytest.approx(5 / 6), "4": 1.0}
    assert metrics["maj"] == 1.0  # 0.5 and 1/2 are one answer with 2 votes; 3 has 1; the blank abstains


# -- datasets -----------------------------------------------------------------------------------------------------------------


def test_benchmark_names_resolve(eval_math):
    label, spec = eval_math.resolve_benchmark("math500")
    assert (label, spec.dataset, spec.split) == ("math500", "HuggingFaceH4/MATH-500", "test")
    assert {"math500", "aime24", "aime25", "amc23"} <= set(eval_math.BENCHMARKS)
    label, spec = eval_math.resolve_benchmark("opencompass/AIME2025:AIME2025-I@test")
    assert (spec.dataset, spec.config, spec.split) == ("opencompass/AIME2025", "AIME2025-I", "test")
    label, spec = eval_math.resolve_benchmark(str(SAMPLE))
    assert label == "math500_sample" and spec.dataset == str(SAMPLE)
    with pytest.raises(ValueError, match="unknown benchmark"):
        eval_math.resolve_benchmark("not-a-benchmark")
    with pytest.raises(eval_math.RecipeError, match="does not exist"):  # one line on the command line, not a traceback
        eval_math.resolve_benchmark("missing.jsonl")


def test_the_evaluators_error_is_the_recipes(eval_math):
    """One error type for bad input in the recipe and the evaluator (the evaluator's own UsageError is gone)."""
    from respo_trl.recipe import RecipeError

    assert eval_math.RecipeError is RecipeError and not hasattr(eval_math, "UsageError")


def test_local_files_map_to_the_common_schema(eval_math, tmp_path):
    problems = eval_math.load_problems(eval_math.BenchmarkSpec(str(SAMPLE)))
    rows = [json.loads(line) for line in SAMPLE.read_text().splitlines()]
    assert [p.problem for p in problems] == [r["problem"] for r in rows]
    assert [p.answer for p in problems] == [r["answer"] for r in rows]
    assert [p.uid for p in problems] == [r["unique_id"] for r in rows]
    # AMC-style columns (question, numeric answers) from parquet; AIME-style capitalised columns from JSONL.
    from datasets import Dataset

    amc = tmp_path / "amc.parquet"
    Dataset.from_dict({"id": [0, 1], "question": ["q0", "q1"], "answer": [27.0, 0.5], "url": ["u", "u"]}).to_parquet(
        amc
    )
    loaded = eval_math.load_problems(eval_math.BenchmarkSpec(str(amc)))
    assert [(p.uid, p.problem, p.answer) for p in loaded] == [("0", "q0", "27"), ("1", "q1", "0.5")]
    aime = tmp_path / "aime.jsonl"
    aime.write_text(json.dumps({"ID": "2024-I-1", "Problem": "p", "Solution": "s", "Answer": 204}) + "\n")
    assert [(p.uid, p.problem, p.answer) for p in eval_math.load_problems(eval_math.BenchmarkSpec(str(aime)))] == [
        ("2024-I-1", "p", "204")
    ]
    odd = tmp_path / "odd.jsonl"
    odd.write_text(json.dumps({"text": "p", "target": "1"}) + "\n")
    with pytest.raises(ValueError, match="no problem column"):
        eval_math.load_problems(eval_math.BenchmarkSpec(str(odd)))
    mapped = eval_math.load_problems(eval_math.BenchmarkSpec(str(odd)), problem_column="text", answer_column="target")
    assert (mapped[0].problem, mapped[0].answer) == ("p", "1")


# -- end to end ---------------------------------------------------------------------------------------------------------------


def test_end_to_end_metrics_with_known_completions(eval_math, tiny_model_dir, tmp_path):
    """The model call is replaced by known completions, so every number in the report can be checked by hand."""
    canned = {
        "5": ["\\boxed{5}"] * 4,  # 4/4
        "\\frac{1}{2}": ["\\boxed{0.5}", "\\boxed{\\frac{1}{2}}", "\\boxed{2}", "\\boxed{3}"],  # 2/4, maj right
        "\\left( 3, \\frac{\\pi}{2} \\right)": ["\\boxed{(3, \\pi/2)}", "\\boxed{(3,0)}", "\\boxed{(3,0)}", ""],  # 1/4
        "1,-2": ["\\boxed{1}", "\\boxed{-2}", "\\boxed{7}", "\\boxed{8}"],  # 0/4
        "4 - 7i": ["\\boxed{4-7i}", "\\boxed{4+7i}", "\\boxed{4+7i}", "\\boxed{4 - 7i}"],  # 2/4, tie
        "3\\sqrt{13}": ["\\boxed{\\sqrt{117}}", "", "", ""],  # 1/4, the only vote
    }
    rows = [json.loads(line) for line in SAMPLE.read_text().splitlines()]
    seen = {}

    def generate(prompts, sampling):
        seen["prompts"], seen["sampling"] = prompts, sampling
        return [canned[row["answer"]] for row in rows]

    out = tmp_path / "eval"
    argv = [
        "--model",
        tiny_model_dir,
        "--benchmarks",
        str(SAMPLE),
        "--n",
        "4",
        "--output_dir",
        str(out),
        "--save_samples",
    ]
    report = eval_math.main(argv, generate=generate)

    assert seen["sampling"].n == 4 and seen["sampling"].temperature == 0.6 and seen["sampling"].top_p == 0.95
    assert "\\boxed{}" in seen["prompts"][0] and rows[0]["problem"] in seen["prompts"][0]
    (result,) = report["results"]
    correct = [4, 2, 1, 0, 2, 1]
    assert result["problems"] == 6 and result["n"] == 4 and result["skipped"] == []
    assert result["avg_at_n"] == pytest.approx(sum(c / 4 for c in correct) / 6)
    assert result["pass_at_k"]["2"] == pytest.approx(sum(pass_at_k(4, c, 2) for c in correct) / 6)
    assert result["pass_at_k"]["4"] == pytest.approx(5 / 6)
    assert result["maj_at_n"] == pytest.approx((1 + 1 + 0 + 0 + 0.5 + 1) / 6)

    on_disk = json.loads((out / "eval_math.json").read_text())
    assert on_disk["results"] == json.loads(json.dumps(report["results"]))
    assert on_disk["generation"]["n"] == 4 and on_disk["command"].startswith("python recipes/eval_math.py --model")
    assert on_disk["weights_sha256"]  # the evaluated weights, for the model card's check
    assert results_table(report) in (out / "eval_math.md").read_text()
    samples = [json.loads(line) for line in (out / "eval_math_samples.jsonl").read_text().splitlines()]
    assert len(samples) == 24 and sum(s["correct"] for s in samples) == sum(correct)


def make_hub_cache(model_dir, cache, repo_id="respo/tiny-demo", commit="0123456789abcdef0123456789abcdef01234567"):
    """Lay out `model_dir` the way `hf download` / `from_pretrained` leave a Hub checkpoint in the cache."""
    repo = Path(cache) / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    shutil.copytree(model_dir, snapshot)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    return snapshot


def test_download_call_and_evaluation_from_a_local_snapshot(eval_math, tiny_model_dir, tmp_path, capfd):
    """The documented `from_pretrained("owner/name")` resolves a downloaded checkpoint offline, and eval_math runs the
    real transformers generation on the snapshot directory."""
    from huggingface_hub import snapshot_download
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cache = tmp_path / "hub"
    make_hub_cache(tiny_model_dir, cache)
    model = AutoModelForCausalLM.from_pretrained("respo/tiny-demo", cache_dir=cache)
    tokenizer = AutoTokenizer.from_pretrained("respo/tiny-demo", cache_dir=cache)
    assert model.config.vocab_size == len(tokenizer)
    snapshot = snapshot_download("respo/tiny-demo", cache_dir=cache)  # offline: the local snapshot directory

    out = tmp_path / "eval"
    argv = [
        "--model",
        snapshot,
        "--benchmarks",
        str(SAMPLE),
        "--limit",
        "2",
        "--n",
        "3",
        "--max_new_tokens",
        "6",
        "--batch_size",
        "4",
        "--backend",
        "transformers",
        "--output_dir",
        str(out),
        "--save_samples",
    ]
    report = eval_math.main(argv)
    assert report["backend"] == "transformers" and report["model"] == snapshot
    (result,) = report["results"]
    assert result["problems"] == 2 and result["n"] == 3 and set(result["pass_at_k"]) == {"1", "2", "3"}
    assert 0.0 <= result["avg_at_n"] <= 1.0
    samples = [json.loads(line) for line in (out / "eval_math_samples.jsonl").read_text().splitlines()]
    assert len(samples) == 6 and all(isinstance(s["completion"], str) for s in samples)
    assert all(isinstance(s["tokens"], int) and 1 <= s["tokens"] <= 6 for s in samples)  # generated, EOS included
    assert sum(row["samples"] for row in report["length_bins"]["all"]) == 6
    assert (out / "eval_math.md").is_file()
    assert "generating" in capfd.readouterr().err  # the progress bar


def test_backend_auto_uses_transformers_without_vllm(eval_math):
    try:
        import vllm
    except ImportError:
        assert not eval_math.vllm_available()
    else:  # pragma: no cover - GPU machines
        pytest.skip("vLLM installed")


def test_default_output_dir(eval_math, tmp_path):
    trained = tmp_path / "run"
    trained.mkdir()
    assert eval_math.default_output_dir(str(trained)) == os.path.join("eval_math", "run")
    (trained / "training_args.bin").write_bytes(b"")
    assert eval_math.default_output_dir(str(trained)) == str(trained)  # results next to the model card
    assert eval_math.default_output_dir("Qwen/Qwen3-1.7B") == os.path.join("eval_math", "Qwen3-1.7B")


# -- the paper's protocol: loaders, settings, accuracy by response length --------------------------------------------------


def test_olympiadbench_and_minervamath_loaders_read_the_hub_layouts(eval_math):
    from dataclasses import replace

    spec = eval_math.BENCHMARKS["olympiadbench"]
    assert (spec.dataset, spec.split, spec.problem_column, spec.answer_column) == (
        "math-ai/olympiadbench", "test", "question", "final_answer"
    )
    problems = eval_math.load_problems(replace(spec, dataset=str(OLYMPIAD)))
    rows = [json.loads(line) for line in OLYMPIAD.read_text().splitlines()]
    assert [p.problem for p in problems] == [r["question"] for r in rows]
    # final_answer is a list of $...$ strings: delimiters removed, several answers joined
    assert [p.answer for p in problems] == ["4", "\\frac{1}{2}", "2, 3"]
    assert [p.uid for p in problems] == ["1606", "1607", "1608"]
    # the gold strings parse as written: a right answer is graded right, a wrong one wrong
    golds = [gold_solution(p.answer) for p in problems]
    assert [g.correct for g in grade(["\\boxed{4}", "\\boxed{0.5}", "\\boxed{3, 2}"], golds)] == [True, True, True]
    assert [g.correct for g in grade(["\\boxed{5}", "\\boxed{1/3}", "\\boxed{2}"], golds)] == [False, False, False]
    spec = eval_math.BENCHMARKS["minervamath"]
    assert (spec.dataset, spec.split, spec.problem_column, spec.answer_column) == (
        "math-ai/minervamath", "test", "question", "answer"
    )
    problems = eval_math.load_problems(replace(spec, dataset=str(MINERVA)))
    assert [(p.uid, p.answer) for p in problems] == [("0", "75"), ("1", "2"), ("2", "0.125")]
    assert problems[0].problem.startswith("A car travels 150 km")


def test_respo_paper_protocol_settings_and_recorded_changes(eval_math, tiny_model_dir):
    args = eval_math.parse_args(["--model", tiny_model_dir, "--protocol", "respo-paper"])
    assert args.benchmarks == ["aime24", "aime25", "amc23", "math500", "olympiadbench", "minervamath"]
    assert args.samples == {"aime24": 16, "aime25": 16, "amc23": 16, "math500": 4, "olympiadbench": 4, "minervamath": 4}
    assert (args.temperature, args.top_p, args.max_new_tokens, args.system_prompt) == (1.0, 0.7, 16384, "")
    assert args.prompt_template == "{problem} Please reason step by step, and put your final answer within \\boxed{}."
    assert args.protocol_report["name"] == "respo-paper" and args.protocol_report["changed"] == []
    assert args.length_bins == 30
    # explicit options override the protocol and are recorded
    args = eval_math.parse_args(
        ["--model", tiny_model_dir, "--protocol", "respo-paper", "--benchmarks", "aime24", "math500", "--top_p", "0.95",
         "--max_new_tokens", "64", "--limit", "2"]
    )  # fmt: skip
    assert args.samples == {"aime24": 16, "math500": 4} and args.top_p == 0.95
    assert args.protocol_report["changed"] == [
        "top_p=0.95", "max_new_tokens=64", "benchmarks=aime24 math500", "limit=2"
    ]  # fmt: skip
    with pytest.raises(SystemExit):  # a file outside the protocol needs its own --n
        eval_math.parse_args(["--model", tiny_model_dir, "--protocol", "respo-paper", "--benchmarks", str(SAMPLE)])
    # without a protocol nothing changes: one n for every benchmark, the old defaults
    args = eval_math.parse_args(["--model", tiny_model_dir, "--benchmarks", "math500", "aime24"])
    assert args.samples == {"math500": 4, "aime24": 4} and args.protocol_report is None
    assert (args.temperature, args.top_p, args.max_new_tokens) == (0.6, 0.95, 4096)


def test_length_bins_are_equal_width_over_the_budget():
    assert [length_bin_index(n, 16384, 30) for n in (0, 546, 547, 16383, 16384, 40000)] == [0, 0, 1, 29, 29, 29]
    rows = length_bins([0, 10, 49, 50, 99, 100], [True, False, True, True, False, True], max_tokens=100, bins=2)
    assert [(r["lo"], r["hi"], r["samples"], r["correct"], r["at_cap"]) for r in rows] == [
        (0.0, 50.0, 3, 2, 0),
        (50.0, 100.0, 3, 2, 1),
    ]
    assert rows[0]["accuracy"] == pytest.approx(2 / 3)
    rows = length_bins([5], [True], max_tokens=30, bins=3)
    assert [r["samples"] for r in rows] == [1, 0, 0] and rows[1]["accuracy"] is None
    with pytest.raises(ValueError):
        length_bins([1], [True, False], max_tokens=10)
    with pytest.raises(ValueError):
        length_bins([-1], [True], max_tokens=10)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_respo_paper_protocol_end_to_end_with_length_bins_and_card(eval_math, tiny_model_dir, tmp_path):
    """All six benchmarks from local copies, canned completions with known lengths: every number is checked by hand,
    and the model card of the evaluated checkpoint names the protocol."""
    out = tmp_path / "run"
    shutil.copytree(tiny_model_dir, out)  # an output_dir holding the weights, as after training
    local = {
        "aime24": write_jsonl(tmp_path / "aime24.jsonl", [{"id": "a", "problem": "p", "answer": "204"}]),
        "aime25": write_jsonl(tmp_path / "aime25.jsonl", [{"id": "b", "problem": "p", "answer": "70"}]),
        "amc23": write_jsonl(tmp_path / "amc23.jsonl", [{"id": 0, "question": "q", "answer": 27.0}]),
        "math500": SAMPLE,
        "olympiadbench": OLYMPIAD,
        "minervamath": MINERVA,
    }
    seen = []

    def generate(prompts, sampling):
        seen.append((len(prompts), sampling))
        # sample j of every problem: length 600 * j tokens, correct ("\\boxed{204}", ...) for even j on aime24 only
        return [
            [("\\boxed{204}" if j % 2 == 0 else "\\boxed{0}", 600 * j) for j in range(sampling.n)] for _ in prompts
        ]

    argv = ["--model", str(out), "--protocol", "respo-paper", "--output_dir", str(out), "--save_samples",
            "--local_data", *[f"{name}={path}" for name, path in local.items()]]  # fmt: skip
    report = eval_math.main(argv, generate=generate)

    assert [s.n for _, s in seen] == [16, 16, 16, 4, 4, 4]
    assert all((s.temperature, s.top_p, s.max_new_tokens) == (1.0, 0.7, 16384) for _, s in seen)
    assert report["protocol"] == {"name": "respo-paper", "description": eval_math.PROTOCOLS["respo-paper"].description,
                                  "changed": []}  # fmt: skip
    assert report["generation"]["n"] == {"aime24": 16, "aime25": 16, "amc23": 16, "math500": 4, "olympiadbench": 4,
                                         "minervamath": 4}  # fmt: skip
    by_name = {row["benchmark"]: row for row in report["results"]}
    assert by_name["aime24"]["avg_at_n"] == 0.5 and by_name["aime25"]["avg_at_n"] == 0.0
    assert by_name["math500"]["problems"] == 6 and by_name["olympiadbench"]["problems"] == 3
    # lengths 0, 600, ..., 600 * 15 tokens with a 16,384 budget in 30 bins of 546.13 tokens
    bins = report["length_bins"]
    assert (bins["bins"], bins["max_new_tokens"]) == (30, 16384) and len(bins["all"]) == 30
    total = 3 * 16 + (6 + 3 + 3) * 4
    assert sum(r["samples"] for r in bins["all"]) == total
    aime = bins["by_benchmark"]["aime24"]
    for j in range(16):
        row = aime[length_bin_index(600 * j, 16384, 30)]
        assert row["samples"] == 1 and row["correct"] == (j % 2 == 0)
    assert bins["all"][0]["samples"] == 3 + 12 and bins["all"][0]["correct"] == 1  # j = 0 everywhere; right on aime24
    on_disk = json.loads((out / "eval_math.json").read_text())
    assert on_disk["length_bins"]["all"] == bins["all"] and on_disk["length_bins"]["plot"] == "eval_math_length_bins.png"
    assert (out / "eval_math_length_bins.png").stat().st_size > 10_000
    markdown = (out / "eval_math.md").read_text()
    assert "Protocol `respo-paper` (the ReSPO paper's evaluation" in markdown
    assert "## Accuracy by response length" in markdown and "| 1 | 0-546 | 15 | 1 | 6.7 |" in markdown
    samples = [json.loads(line) for line in (out / "eval_math_samples.jsonl").read_text().splitlines()]
    assert len(samples) == total and {s["tokens"] for s in samples if s["benchmark"] == "math500"} == {0, 600, 1200, 1800}

    from respo_trl.hub.card import render_card

    card = str(render_card(output_dir=out, model_name="tiny", args={}, log_history=[], citation=""))
    assert "Protocol `respo-paper` (the ReSPO paper's evaluation" in card
    assert "| aime24 | 1 | 16 | 50.0" in card and "| math500 | 6 | 4 |" in card


def test_bad_model_path_and_malformed_jsonl_fail_in_one_line(tmp_path, tiny_model_dir):
    """Run as a user would: a missing model folder, a folder that is no model, a broken JSONL line and an unknown
    benchmark each end the command with one line naming the problem (no traceback) and the training recipe's exit
    status for bad input (2; 0.5's evaluator had its own error class and exited 1)."""
    import subprocess
    import sys

    from conftest import ROOT

    from respo_trl.recipe.cli import EXIT_BAD_INPUT

    good = tmp_path / "ok.jsonl"
    good.write_text('{"problem": "1+1", "answer": "2"}\n')
    bad = tmp_path / "broken.jsonl"
    bad.write_text('{"problem": "1+1", "answer": "2"}\n{"problem": "2+2", "answer": 4\n')
    cases = [
        (["--model", str(tmp_path / "nope"), "--benchmarks", str(good)], "no such directory"),
        (["--model", str(tmp_path), "--benchmarks", str(good)], "not a model folder (no config.json)"),
        (["--model", tiny_model_dir, "--benchmarks", str(bad), "--backend", "transformers"], "broken.jsonl, line 2"),
        (["--model", tiny_model_dir, "--benchmarks", "not-a-benchmark"], "unknown benchmark 'not-a-benchmark'"),
    ]
    for argv, message in cases:
        done = subprocess.run([sys.executable, str(ROOT / "recipes" / "eval_math.py"), *argv], capture_output=True,
                              text=True, timeout=300, env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})
        assert done.returncode == EXIT_BAD_INPUT == 2, done.stderr[-2000:]
        lines = [line for line in done.stderr.splitlines() if line.strip() and not line.startswith(("INFO", "WARNING"))]
        assert "Traceback" not in done.stderr and len(lines) == 1 and message in lines[0], done.stderr[-2000:]
        assert lines[0].startswith("error: ")  # the recipe's format (respo_trl.recipe.cli.one_line_errors)


def test_a_recipe_output_dir_is_evaluated_as_it_trained_offline_and_keeps_earlier_results(eval_math, tiny_model_dir,
                                                                                          tmp_path, monkeypatch):
    """The newcomer path: `eval_math.py --model outputs/qwen3-tiny-respo` with no other option. 0.2 defaulted to
    MATH-500 from the Hub (a 20-line ConnectionError offline), added a system prompt the model never saw (0.0%), and
    replaced the earlier evaluation in the model directory without a word."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    run = tmp_path / "qwen3-tiny-respo"
    shutil.copytree(tiny_model_dir, run)
    (run / "training_args.bin").write_bytes(b"")  # a training output_dir: results stay in it
    script = {"dataset_name": "builtin:arithmetic", "eval_dataset_name": None, "task_min_terms": 3,
              "task_max_terms": 5, "task_max_operand": 9, "task_operators": "+", "task_nuisance": False,
              "task_seed": 0, "heldout_size": 12, "system_prompt": None, "prompt_template": "{problem}"}  # fmt: skip
    (run / "report.json").write_text(json.dumps({
        "task": "builtin:arithmetic", "args": {"script": script},
        "prompt_format": {"system_prompt": None, "prompt_template": "{problem}"},
        "sampling": {"max_completion_length": 48, "temperature": 1.0},
    }))  # fmt: skip
    seen = {}

    def generate(prompts, sampling):
        seen.setdefault("prompts", prompts)
        seen["sampling"] = sampling
        return [["\\boxed{0}"] * sampling.n for _ in prompts]

    report = eval_math.main(["--model", str(run)], generate=generate)
    (result,) = report["results"]
    assert result["problems"] == 12 and (run / "heldout.jsonl").is_file()  # the run's own held-out split
    expected = ArithmeticTask(min_terms=3, max_terms=5, max_operand=9, operators="+").expressions("test", 12, 0)
    assert [json.loads(line)["problem"] for line in (run / "heldout.jsonl").read_text().splitlines()] == expected
    assert "\\boxed{}" not in seen["prompts"][0] and "<|im_start|>s:" not in seen["prompts"][0]  # no system turn
    assert seen["sampling"].max_new_tokens == 48 and seen["sampling"].temperature == 1.0
    assert report["defaults_from_run"]["max_new_tokens"] == 48
    first = (run / "eval_math.json").read_text()
    eval_math.main(["--model", str(run), "--n", "2"], generate=generate)
    assert (run / "eval_math.previous-1.json").read_text() == first  # kept, not replaced
    # a Hub benchmark offline is one line that says what to do, not a ConnectionError traceback
    with pytest.raises(eval_math.RecipeError, match="cannot load benchmark 'HuggingFaceH4/MATH-500'.*--local_data"):
        eval_math.main(["--model", str(run), "--benchmarks", "math500"], generate=generate)
