"""Reward functions by name (the recipe's ``--reward_funcs``, the paper presets' among them), and a pre-flight probe
that runs them before any compute.

Why: a reward function that raises, or an answer column that math-verify cannot parse, otherwise surfaces after the
model is loaded and the first batch is generated (minutes to hours on a real preset). :func:`probe_rewards` calls
every reward function on a handful of dataset rows with a synthetic "reference" completion (``\\boxed{answer}``)
and fails with a message that names the function and the column.

Accuracy is TRL's own ``trl.rewards.accuracy_reward`` (math-verify), so the recipes are graded exactly like TRL's
GRPO examples; ``dapo_accuracy`` (the paper's +1/-1) and every held-out score go through :mod:`respo_trl.grading`.
The format reward is ours: it checks the final-answer convention the accuracy reward relies on. ``soft_overlong`` is
TRL's ``get_soft_overlong_punishment``, built from the run's completion budget.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
import zlib
from collections.abc import Callable, Sequence

# Text after the last closing think tag is the visible answer of a reasoning model (Qwen3 thinking mode).
_THINK_OPEN, _THINK_CLOSE = "<think>", "</think>"
_BOXED = "\\boxed{"


def _boxed_contents(text: str) -> list[str | None]:
    """Contents of every ``\\boxed{...}`` in ``text`` (``None`` for one whose braces never close)."""
    out, start = [], 0
    while (index := text.find(_BOXED, start)) != -1:
        depth, position = 1, index + len(_BOXED)
        while position < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[position], 0)
            position += 1
        out.append(text[index + len(_BOXED) : position - 1] if depth == 0 else None)
        start = position
    return out


def crc_reward(completions: list[list[dict[str, str]]], **kwargs) -> list[float]:
    """Deterministic pseudo-reward in {0, 1} from the completion text: non-zero advantages for tests and benchmarks
    that exercise the trainer without a task (it rewards nothing learnable)."""
    return [float(zlib.crc32(c[0]["content"].encode()) % 2) for c in completions]


def boxed_format_reward(completions: list[list[dict[str, str]]], **kwargs) -> list[float]:
    r"""1.0 when the answer part of a completion holds exactly one well-formed, non-empty ``\boxed{...}``, else 0.0.

    The answer part is the text after the last ``</think>`` when the model thinks (Qwen3), the whole text otherwise;
    a completion that opens ``<think>`` and never closes it (truncated reasoning) scores 0, and so does one whose
    braces never close or that boxes several answers.
    """
    rewards = []
    for completion in completions:
        text = completion[0]["content"] if isinstance(completion, list) else completion
        if _THINK_OPEN in text and _THINK_CLOSE not in text:
            rewards.append(0.0)
            continue
        answer = text.rsplit(_THINK_CLOSE, 1)[-1]
        boxes = _boxed_contents(answer)
        rewards.append(1.0 if len(boxes) == 1 and boxes[0] is not None and boxes[0].strip() else 0.0)
    return rewards


def _integer_gold(gold) -> str | None:
    """The integer a gold answer holds (``"34"``, ``"\\boxed{34}"``), or ``None`` when it is not an integer."""
    gold_boxes = _boxed_contents(str(gold))
    gold = (gold_boxes[0] if gold_boxes and gold_boxes[0] is not None else str(gold)).strip()
    return gold if re.fullmatch(r"-?\d+", gold) else None


def integer_accuracy_reward(completions: list[list[dict[str, str]]], solution: list[str], **kwargs) -> list:
    r"""1.0 when the first ``\boxed{}`` of the answer part holds exactly the integer ``solution`` (``\boxed{34}``),
    else 0.0; ``None`` (skipped, as ``accuracy`` skips a gold it cannot parse) when the solution is not an integer.

    Why, next to math-verify's ``accuracy``: math-verify evaluates what it parses, so ``\boxed{6+28}`` counts as 34.
    When the problem sits in the prompt as an expression (the built-in task), copying it into the box is the easiest
    way to full reward, and a pretrained model finds it: SmolLM2-135M did within 40 RL steps (docs/vllm.md). For
    integer answers this grades the number the model wrote.
    """

    def first_box(answer: str) -> str | None:
        boxes = [box for box in _boxed_contents(answer) if box is not None]
        return boxes[0].strip() if boxes else None

    return _integer_rewards(completions, solution, first_box)


# A number as written: a sign only where it cannot be a binary minus (not after a digit or a closing bracket), a
# decimal part kept so that 34.5 is not read as 5, thousands separators removed before matching.
_NUMBER = re.compile(r"(?:(?<![\w.)\]}])-)?\d+(?:\.\d+)?")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")


def last_integer_accuracy_reward(completions: list[list[dict[str, str]]], solution: list[str], **kwargs) -> list:
    r"""1.0 when the last number in the answer part of a completion is the integer ``solution``, else 0.0; ``None``
    (skipped) when the solution is not an integer.

    Why: a small chat model answers "6 + 28 = 34" or "The answer is 34." and rarely boxes anything, so a box-based
    reward scores its right answers 0 and a format bonus then teaches it to box anything at all; SmolLM2-135M boxed
    the prompt's placeholder ``\boxed{result}`` (docs/vllm.md). The last number is the one the answer ends on, so
    copying the problem (``6+28``, ending in 28) or restating it after the answer (``34 (6 + 28)``) scores 0, and a
    decimal (``34.5``) is not an integer. The answer part is the text after the last ``</think>``.
    """

    def last_number(answer: str) -> str | None:
        numbers = _NUMBER.findall(_THOUSANDS.sub("", answer))
        return numbers[-1] if numbers else None

    return _integer_rewards(completions, solution, last_number)


def _integer_rewards(completions, solution, read) -> list[float | None]:
    """1.0 where ``read`` (the answer part, after the last ``</think>``) gives the integer gold exactly, else 0.0;
    None where the gold is not an integer."""
    rewards: list[float | None] = []
    for completion, gold in zip(completions, solution, strict=True):
        text = completion[0]["content"] if isinstance(completion, list) else completion
        gold = _integer_gold(gold)
        rewards.append(None if gold is None else float(read(text.rsplit(_THINK_CLOSE, 1)[-1]) == gold))
    return rewards


def _accuracy_reward():
    from trl.rewards import accuracy_reward

    return accuracy_reward


def _reasoning_accuracy_reward():
    from trl.rewards import reasoning_accuracy_reward

    return reasoning_accuracy_reward


def _dapo_accuracy_reward():
    from respo_trl.grading import dapo_accuracy_reward

    return dapo_accuracy_reward


def _think_format_reward():
    from trl.rewards import think_format_reward

    return think_format_reward


# Names accepted by the recipe's ``--reward_funcs``; a dotted path ``package.module.function`` also works.
# ``reasoning_accuracy`` (TRL) grades only the text after ``</think>``: stricter than ``accuracy`` for thinking models,
# which also credits a box written inside unfinished reasoning. ``dapo_accuracy`` scores +1/-1 (verl's DAPO reward
# manager, the ReSPO paper's) with the same math-verify grading; ``soft_overlong`` (SOFT_OVERLONG) is built from the
# completion budget (trl.rewards.get_soft_overlong_punishment). ``integer_accuracy`` grades the integer written in the
# box, not what math-verify evaluates it to (``\boxed{6+28}`` is not 34 for it); ``last_integer_accuracy`` the last
# number of the answer, boxed or not (for models that do not box).
SOFT_OVERLONG = "soft_overlong"
REWARD_FUNCS: dict[str, Callable[[], Callable]] = {
    "accuracy": _accuracy_reward,
    "dapo_accuracy": _dapo_accuracy_reward,
    "reasoning_accuracy": _reasoning_accuracy_reward,
    "format": lambda: boxed_format_reward,
    "integer_accuracy": lambda: integer_accuracy_reward,
    "last_integer_accuracy": lambda: last_integer_accuracy_reward,
    "think_format": _think_format_reward,
}


def resolve_reward(name: str, max_completion_length: int | None = None, soft_overlong_cache: int = 0) -> Callable:
    """A reward function from a registry name or a dotted import path; a clear ``ValueError`` otherwise.

    ``soft_overlong`` is TRL's ``get_soft_overlong_punishment(max_completion_length, soft_overlong_cache)``: 0 up to
    ``max_completion_length - soft_overlong_cache`` tokens, then falling linearly to -1 at ``max_completion_length``.
    """
    if name == SOFT_OVERLONG:
        from trl.rewards import get_soft_overlong_punishment

        cap, cache = max_completion_length, soft_overlong_cache
        if cap is None or not 0 < cache <= cap:
            raise ValueError(
                f"reward 'soft_overlong' needs 0 < soft_overlong_cache <= max_completion_length ({cap}), got "
                f"soft_overlong_cache={cache}: pass --soft_overlong_cache (the paper's 30B runs: 4096 of 8192)"
            )
        return get_soft_overlong_punishment(max_completion_len=cap, soft_punish_cache=cache)
    if name in REWARD_FUNCS:
        return REWARD_FUNCS[name]()
    if "." in name:
        module_path, attribute = name.rsplit(".", 1)
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(module_path)
        except ImportError as error:
            raise ValueError(f"reward function {name!r}: cannot import module {module_path!r} ({error})") from error
        function = getattr(module, attribute, None)
        if not callable(function):
            raise ValueError(f"reward function {name!r}: module {module_path!r} has no callable {attribute!r}")
        return function
    raise ValueError(
        f"unknown reward function {name!r}: use one of {sorted([*REWARD_FUNCS, SOFT_OVERLONG])} or a dotted import path "
        "such as 'my_package.rewards.my_reward'"
    )


def reward_name(function: Callable) -> str:
    return getattr(function, "__name__", type(function).__name__)


def probe_rewards(
    reward_funcs: Sequence[Callable],
    rows: dict[str, list],
    answer_column: str = "solution",
    accuracy_funcs: Sequence[Callable] = (),
) -> None:
    """Call every reward function on ``rows`` with reference completions ``\\boxed{answer}``; raise on failure.

    ``rows`` holds the columns TRL passes to reward functions (``prompt``, ``solution``, ...). Functions in
    ``accuracy_funcs`` must additionally score the reference completion 1.0 on at least half the rows: an answer column
    that math-verify cannot parse (all ``None``/0) is reported here rather than as a flat zero reward after hours.
    """
    answers = [str(a) for a in rows[answer_column]]
    # A reference completion in the shape of a thinking model's answer, accepted by every built-in reward.
    completions = [[{"role": "assistant", "content": f"<think>\nprobe\n</think>\n\n\\boxed{{{a}}}"}] for a in answers]
    kwargs = {key: value for key, value in rows.items() if key not in ("completion", "completions")}
    for function in reward_funcs:
        name = reward_name(function)
        try:
            scores = function(
                prompts=rows.get("prompt"),
                completions=completions,
                completion_ids=[[0]] * len(completions),
                trainer_state=None,
                log_extra=None,
                log_metric=None,
                **kwargs,
            )
        except Exception as error:
            raise RuntimeError(
                f"reward function {name!r} raised {type(error).__name__} on {len(answers)} probe rows of the training "
                f"set before training started: {error}"
            ) from error
        if scores is None or len(scores) != len(answers):
            got = "None" if scores is None else f"{len(scores)} scores"
            raise RuntimeError(f"reward function {name!r} must return one score per completion: got {got}")
        if function in accuracy_funcs:
            hits = sum(1 for s in scores if s is not None and s >= 1.0)
            if hits * 2 < len(answers):
                unparsed = sum(1 for s in scores if s is None)
                raise RuntimeError(
                    f"reward function {name!r} scored only {hits}/{len(answers)} reference answers "
                    f"(\\boxed{{<{answer_column}>}}) as correct ({unparsed} unparseable gold answers). Is "
                    f"--answer_column={answer_column!r} the column with the final answers? Examples: "
                    f"{[a[:40] for a in answers[:3]]}"
                )


def find_boxed_answer(text: str) -> str | None:
    """The content of the last complete ``\\boxed{...}`` (for logs and reports)."""
    boxes = [b for b in _boxed_contents(text) if b is not None]
    return boxes[-1] if boxes else None


# The rewards held-out accuracy is measured with, and how each grades (for the model card).
GRADED_BY = {
    "accuracy": "math-verify",
    "reasoning_accuracy": "math-verify on the text after </think>",
    "integer_accuracy": "the integer in the first \\boxed{} equals the answer",
    "last_integer_accuracy": "the last number of the answer equals the answer",
}
ACCURACY_REWARDS = tuple(GRADED_BY)

__all__ = [
    "ACCURACY_REWARDS",
    "GRADED_BY",
    "REWARD_FUNCS",
    "SOFT_OVERLONG",
    "boxed_format_reward",
    "crc_reward",
    "find_boxed_answer",
    "integer_accuracy_reward",
    "last_integer_accuracy_reward",
    "probe_rewards",
    "resolve_reward",
    "reward_name",
]
