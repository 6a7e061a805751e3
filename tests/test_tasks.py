"""The built-in arithmetic task (respo_trl.builtin.task), the warm-start helpers and the recipes' rewards (respo_trl.rewards).

The task is what the embedded default of recipes/qwen3_respo.py learns; these tests pin its correctness (answers,
disjoint splits, the imperfect teacher) so that the demo's numbers mean what docs/recipes.md says they mean.
"""

import random

import pytest

from respo_trl.builtin.task import (
    ArithmeticTask,
    answer_balance,
    canonical,
    check_answer_balance,
    check_disjoint,
    main,
)
from respo_trl.builtin.tiny_model import tiny_qwen3


def brute_force_answer(expression):
    return eval(expression)  # only digits, '+' and '-' (generated here)


@pytest.mark.parametrize("operators", ["+-", "+"])
def test_answers_and_steps_are_right(operators):
    task = ArithmeticTask(min_terms=2, max_terms=6, max_operand=99, operators=operators)
    rng = random.Random(0)
    for _ in range(500):
        expression = task.sample_expression(rng)
        assert set(expression) <= set("0123456789" + operators)
        assert task.answer(expression) == brute_force_answer(expression)
        steps = task.steps(expression)
        assert len(steps) == expression.count("+") + expression.count("-")
        for lhs, value in steps:
            assert brute_force_answer(lhs) == value


def test_splits_are_disjoint_deterministic_and_distinct():
    task = ArithmeticTask()
    for seed in (0, 1):
        train = task.expressions("train", 3000, seed)
        test = task.expressions("test", 300, seed)
        assert len(set(train)) == 3000 and len(set(test)) == 300
        assert not set(train) & set(test)
        assert all(task.split_of(e) == "test" for e in test)
    assert task.expressions("test", 50, seed=3) == task.expressions("test", 50, seed=3)
    assert task.expressions("test", 50, seed=3) != task.expressions("test", 50, seed=4)
    # The held-out bucket is about test_fraction of the expression space.
    rng = random.Random(1)
    sample = [task.sample_expression(rng) for _ in range(5000)]
    assert 0.07 < sum(task.split_of(e) == "test" for e in sample) / 5000 < 0.13


def test_canonical_split_keeps_every_reordered_twin_in_one_split():
    """The pretrained-model study's split (docs/benchmarks/smollm2_staleness.md): train, validation and test share no
    problem and no re-ordered twin of one. Catches: a split by the expression string (b+a held out, a+b trained)."""
    assert canonical("7+7+1") == canonical("1+7+7") == canonical("7+1+7") != canonical("7+7+2")
    assert canonical("47-8+25") == canonical("25-8+47") != canonical("8-47+25")  # the sign goes with its term
    task = ArithmeticTask(min_terms=3, max_terms=3, min_operand=1, max_operand=9, operators="+", scratchpad=False,
                          split_by="canonical", validation_fraction=0.2, test_fraction=0.2)  # fmt: skip
    splits = {name: task.expressions(name, None, seed=0) for name in ("train", "validation", "test")}
    assert sum(len(v) for v in splits.values()) == 9**3  # every ordered problem, each in exactly one split
    forms = {name: {canonical(e) for e in v} for name, v in splits.items()}
    assert not (forms["train"] & forms["validation"] or forms["train"] & forms["test"] or forms["validation"] & forms["test"])
    assert all(100 <= len(v) <= 200 for name, v in splits.items() if name != "train")  # ~20% each of 729
    check_disjoint(splits)
    by_expression = ArithmeticTask(min_terms=3, max_terms=3, min_operand=1, max_operand=9, operators="+",
                                   validation_fraction=0.2, test_fraction=0.2)  # fmt: skip
    leaky = {name: by_expression.expressions(name, None, seed=0) for name in ("train", "test")}
    with pytest.raises(ValueError, match=r"^split overlap: train has '.*' and test has '.*', the same problem re-ordered"):
        check_disjoint(leaky)
    # without a validation split, the test buckets are the ones the demo always had
    demo, three_way = ArithmeticTask(), ArithmeticTask(validation_fraction=0.3)
    rng = random.Random(0)
    for expression in (demo.sample_expression(rng) for _ in range(2000)):
        assert (demo.split_of(expression) == "test") == (three_way.split_of(expression) == "test")
    with pytest.raises(ValueError, match="no validation split"):
        demo.expressions("validation", 10, seed=0)
    assert all(int(x) >= 1 for e in splits["test"] for x in e.split("+"))  # min_operand


def test_a_recipe_split_with_overlapping_problems_stops_in_one_line():
    from respo_trl.recipe import RecipeError, build_datasets, parse_args

    argv = ["--tiny_model", "dense", "--task_min_terms", "3", "--task_max_terms", "3", "--task_max_operand", "9",
            "--task_operators", "+", "--task_min_operand", "1", "--train_size", "None", "--heldout_size", "None",
            "--task_validation_fraction", "0.2", "--task_test_fraction", "0.2", "--heldout_split", "validation"]  # fmt: skip
    canonical_args, _, _ = parse_args([*argv, "--task_split_by", "canonical"])
    train, heldout = build_datasets(canonical_args)
    assert len(train) + len(heldout) < 729 and len(heldout) > 100  # every training and validation problem
    expression_args, _, _ = parse_args(argv)  # split by the expression string: twins straddle the splits
    with pytest.raises(RecipeError, match=r"^split overlap: train has .* and validation has .*re-ordered"):
        build_datasets(expression_args)


def test_answer_stratified_split_keeps_twins_together_and_shares_the_answer_distribution():
    """The pretrained-model study's second split (docs/benchmarks/smollm2_staleness.md, 6.1): canonical forms dealt
    by answer. Catches: twins straddling splits, a deal per answer that piles rounding on one split (validation
    missing an answer training is full of, as the canonical hash split did), and the check letting that through."""
    kwargs = dict(min_terms=2, max_terms=2, min_operand=1, max_operand=30, operators="+", scratchpad=False,
                  validation_fraction=0.2, test_fraction=0.2)  # fmt: skip
    task = ArithmeticTask(split_by="answer", **kwargs)
    splits = {name: task.expressions(name, None, seed=0) for name in ("train", "validation", "test")}
    assert sum(len(v) for v in splits.values()) == 30 * 30
    check_disjoint(splits)  # no re-ordered twin across splits
    forms = {name: {canonical(e) for e in v} for name, v in splits.items()}
    assert [len(forms[n]) for n in ("train", "validation", "test")] == [279, 93, 93]  # 465 forms dealt 60/20/20
    balance = answer_balance(splits)
    for name in ("validation", "test"):
        assert balance[name]["max_deviation"] < 1.0  # every answer within one form of its share
        answers = {task.answer(e) for e in splits[name]}
        assert answers >= set(range(10, 52))  # every sum with 5+ forms (a share of 1+) is in every split
    check_answer_balance(splits)
    hashed = ArithmeticTask(split_by="canonical", **kwargs)  # the canonical hash split: twins together, answers not
    unbalanced = {name: hashed.expressions(name, None, seed=0) for name in ("train", "validation", "test")}
    check_disjoint(unbalanced)
    assert answer_balance(unbalanced)["validation"]["max_deviation"] > 2
    with pytest.raises(ValueError, match=r"^answer distributions differ: (validation|test) has \d+ problems whose answer "
                                         r"is \d+ where its share is [\d.]+ \(tolerance 2\); stratify the split by answer"):
        check_answer_balance(unbalanced)
    with pytest.raises(ValueError, match="needs operators='\\+'"):
        ArithmeticTask(split_by="answer", operators="+-")


def test_a_recipe_split_by_answer_is_checked_and_its_twins_stay_together():
    from respo_trl.recipe import build_datasets, parse_args

    argv = ["--tiny_model", "dense", "--task_min_terms", "2", "--task_max_terms", "2", "--task_max_operand", "30",
            "--task_operators", "+", "--task_min_operand", "1", "--train_size", "None", "--heldout_size", "None",
            "--task_validation_fraction", "0.2", "--task_test_fraction", "0.2", "--heldout_split", "validation",
            "--task_split_by", "answer"]  # fmt: skip
    script_args = parse_args(argv)[0]
    train, heldout = build_datasets(script_args)  # checked: no twin across the sets, answers within their share
    task = ArithmeticTask.from_settings(script_args)
    assert task.split_by == "answer"
    assert (len(train), len(heldout)) == (len(task.expressions("train", None, 0)), len(task.expressions("validation", None, 0)))
    assert 150 < len(heldout) < 210 and len(train) > 500  # every training and validation problem (20% / 60% of 900)


def test_small_space_raises_instead_of_looping():
    with pytest.raises(ValueError, match="too small"):
        ArithmeticTask(min_terms=2, max_terms=2, max_operand=3).expressions("train", 10_000, seed=0)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"min_terms": 1}, "min_terms"),
        ({"min_terms": 4, "max_terms": 3}, "min_terms"),
        ({"max_operand": 0}, "max_operand"),
        ({"test_fraction": 1.0}, "test_fraction"),
        ({"operators": "*"}, "operators"),
        ({"teacher_error_rate": 1.5, "operators": "+"}, "teacher_error_rate"),
        ({"teacher_error_rate": 0.5}, "operators='\\+'"),
    ],
)
def test_bad_task_settings_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ArithmeticTask(**kwargs)


def test_reference_completions_are_graded_right_by_the_training_reward():
    from trl.rewards import accuracy_reward

    task = ArithmeticTask(min_terms=3, max_terms=5, max_operand=99)
    rows = task.rows("test", 40, seed=0)
    assert rows["completion"][0].endswith(f"\\boxed{{{rows['solution'][0]}}}")
    completions = [[{"role": "assistant", "content": c}] for c in rows["completion"]]
    assert accuracy_reward(completions, rows["solution"]) == [1.0] * 40
    assert any(int(s) < 0 for s in rows["solution"])  # negative answers are graded too


def test_imperfect_teacher_forgets_carries_and_grading_uses_the_true_answer():
    perfect = ArithmeticTask(min_terms=3, max_terms=5, max_operand=9, operators="+")
    forgetful = ArithmeticTask(min_terms=3, max_terms=5, max_operand=9, operators="+", teacher_error_rate=1.0)
    assert forgetful.completion("17+5+9", random.Random(0)) == "17+5=12,12+9=11 \\boxed{11}"
    assert perfect.completion("17+5+9") == "17+5=22,22+9=31 \\boxed{31}"
    rows = forgetful.rows("train", 200, seed=0)
    assert rows["solution"] == perfect.rows("train", 200, seed=0)["solution"]  # answers stay true
    rates = [
        ArithmeticTask(3, 5, 9, operators="+", teacher_error_rate=q).teacher_accuracy("test", 400, 0)
        for q in (0.0, 0.3, 0.6, 1.0)
    ]
    assert rates[0] == 1.0 and rates == sorted(rates, reverse=True) and rates[-1] < 0.15


def test_tiny_tokenizer_keeps_boxed_as_one_token_and_completions_fit_the_preset(tokenizer):
    task = ArithmeticTask(min_terms=3, max_terms=5, max_operand=9, operators="+", teacher_error_rate=0.6)
    rows = task.rows("train", 2000, seed=0)
    ids = tokenizer("\\boxed{12}", add_special_tokens=False)["input_ids"]
    assert len(ids) == 4 and tokenizer.decode(ids) == "\\boxed{12}"
    longest = max(len(tokenizer(c, add_special_tokens=False)["input_ids"]) + 1 for c in rows["completion"])
    assert longest <= 48  # tiny-cpu.yaml's max_completion_length (completion + EOS)


def test_supervised_warm_start_learns_and_is_seeded(tokenizer):
    from respo_trl.grading import accuracy_scores
    from respo_trl.recipe.generation import generate
    from respo_trl.recipe.warmstart import supervised_warm_start

    task = ArithmeticTask(min_terms=2, max_terms=2, max_operand=3, scratchpad=False)
    rows = task.rows("train", 12, seed=0)

    def run():
        model = tiny_qwen3(tokenizer, hidden_size=64, num_layers=2, intermediate_size=128, seed=0)
        losses = supervised_warm_start(
            model, tokenizer, rows["prompt"], rows["completion"], steps=150, batch_size=16, learning_rate=1e-2, seed=0
        )
        return model, losses

    model, losses = run()
    assert sum(losses[-5:]) / 5 < 0.5 * losses[0]
    assert run()[1] == losses  # same seed, same trajectory
    texts, lengths = generate(model, tokenizer, rows["prompt"], max_new_tokens=8)
    assert len(texts) == 12 and all(0 < n <= 8 for n in lengths)
    assert sum(accuracy_scores(texts, rows["solution"])) >= 6  # memorised most of its 12 training problems


# -- rewards ----------------------------------------------------------------------------------------------------------


def test_boxed_format_reward():
    from respo_trl.rewards import boxed_format_reward

    texts = [
        "1+2=3 \\boxed{3}",
        "<think>try \\boxed{2}</think> so \\boxed{\\frac{1}{2}}",
        "<think>unfinished \\boxed{3}",
        "\\boxed{3} and \\boxed{4}",
        "\\boxed{",
        "\\boxed{}",
        "no box",
    ]
    assert boxed_format_reward([[{"content": t}] for t in texts]) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]


def test_integer_accuracy_grades_the_number_written_not_an_expression_math_verify_evaluates():
    """What SmolLM2-135M learned under RL on the built-in task (docs/vllm.md): boxing the problem itself, which
    math-verify's accuracy evaluates and accepts. Catches: an evaluated or lenient comparison, a box inside unfinished
    reasoning counted, a non-integer gold graded instead of skipped."""
    from respo_trl.rewards import integer_accuracy_reward, resolve_reward

    texts = ["6+28 is \\boxed{6+28}", "\\boxed{34}", "\\boxed{ 34 }", "34", "<think>\\boxed{34}</think> \\boxed{33}",
             "\\boxed{34.0}", "\\boxed{34} then \\boxed{35}"]  # fmt: skip
    completions = [[{"content": t}] for t in texts]
    assert resolve_reward("accuracy")(completions[:1], ["34"]) == [1.0]  # the loophole this reward closes
    assert integer_accuracy_reward(completions, ["34"] * len(texts)) == [0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0]
    assert integer_accuracy_reward(completions[1:3], ["\\boxed{34}", "-34"]) == [1.0, 0.0]
    assert integer_accuracy_reward(completions[:1], ["\\frac{1}{2}"]) == [None]
    assert resolve_reward("integer_accuracy") is integer_accuracy_reward


def test_last_integer_accuracy_grades_the_number_the_answer_ends_on():
    """What SmolLM2-135M writes on the preset's prompt ("What is 6+28? Answer with the number only."): a sum or a
    sentence, no box. Catches: the first number taken instead of the last (copying the problem, "6+28", would score),
    a box required, a decimal or a binary minus read as an integer (0.34 as 34, 28-34 as -34), reasoning counted."""
    from respo_trl.rewards import ACCURACY_REWARDS, last_integer_accuracy_reward, resolve_reward

    texts = ["6+28", "6 + 28 = 34.", "The answer is 34", "34 (6 + 28)", "6+28= \\boxed{34}", "6+28= \\boxed{result}",
             "6 + 28 = 0.34", "6 + 28 = 34. Check: 34 - 28 = 6", "<think>6+28=34</think> 33", "1,034", "",
             "<think>6+28=34</think>"]  # fmt: skip
    completions = [[{"content": t}] for t in texts]
    golds = ["34"] * len(texts)
    golds[9] = "1034"
    assert last_integer_accuracy_reward(completions, golds) == [0, 1, 1, 0, 1, 0, 0, 0, 0, 1, 0, 0]
    negative = [[{"content": t}] for t in ("x = -34", "28-34", "6 - 40 = -34")]
    assert last_integer_accuracy_reward(negative, ["-34"] * 3) == [1.0, 0.0, 1.0]
    assert last_integer_accuracy_reward(completions[1:2], ["\\boxed{34}"]) == [1.0]
    assert last_integer_accuracy_reward(completions[1:2], ["\\frac{1}{2}"]) == [None]
    assert resolve_reward("last_integer_accuracy") is last_integer_accuracy_reward
    assert "last_integer_accuracy" in ACCURACY_REWARDS  # held-out accuracy is graded by the training reward


def test_reward_names_resolve_or_fail_clearly():
    from respo_trl.rewards import boxed_format_reward, resolve_reward

    assert resolve_reward("format") is boxed_format_reward
    assert resolve_reward("accuracy").__name__ == "accuracy_reward"
    assert resolve_reward("respo_trl.rewards.boxed_format_reward") is boxed_format_reward
    with pytest.raises(ValueError, match="unknown reward function 'acuracy'.*accuracy"):
        resolve_reward("acuracy")
    with pytest.raises(ValueError, match="cannot import module"):
        resolve_reward("no_such_module.reward")
    with pytest.raises(ValueError, match="no callable"):
        resolve_reward("respo_trl.rewards.nothing_here")


def failing_reward(completions, **kwargs):
    raise KeyError("ground_truth")


def test_probe_names_a_raising_reward_and_a_wrong_answer_column():
    from respo_trl.rewards import boxed_format_reward, probe_rewards, resolve_reward

    accuracy = resolve_reward("accuracy")
    rows = {"prompt": [[{"role": "user", "content": "1+1"}]] * 4, "solution": ["2"] * 4, "source": ["a"] * 4}
    probe_rewards([accuracy, boxed_format_reward], rows, "solution", accuracy_funcs=[accuracy])  # passes
    with pytest.raises(RuntimeError, match="'failing_reward' raised KeyError"):
        probe_rewards([boxed_format_reward, failing_reward], rows, "solution")
    bad = {**rows, "solution": ["see the worked solution above"] * 4}
    with pytest.raises(RuntimeError, match="--answer_column='solution'"):
        probe_rewards([accuracy], bad, "solution", accuracy_funcs=[accuracy])


def test_heldout_split_exports_as_an_eval_math_file_matching_the_recipe(tmp_path):
    """`python -m respo_trl.builtin.task` writes the tiny preset's held-out problems, answers graded like training."""
    import json

    out = tmp_path / "arith_test.jsonl"
    main(["--out", str(out), "--n", "40"])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    import yaml
    from conftest import ROOT

    cfg = yaml.safe_load((ROOT / "respo_trl" / "recipe" / "presets" / "tiny-cpu.yaml").read_text())  # the CLI's defaults follow it
    preset = ArithmeticTask(
        min_terms=cfg["task_min_terms"], max_terms=cfg["task_max_terms"], max_operand=cfg["task_max_operand"],
        operators=cfg["task_operators"], teacher_error_rate=cfg["task_teacher_error_rate"],
    )  # fmt: skip
    expected = preset.rows("test", 40, seed=0)  # what the recipe holds out (the teacher does not change prompts)
    assert [r["problem"] for r in rows] == [p[-1]["content"] for p in expected["prompt"]]
    assert [r["answer"] for r in rows] == expected["solution"]
    assert all(preset.split_of(r["problem"]) == "test" and str(eval(r["problem"])) == r["answer"] for r in rows)
