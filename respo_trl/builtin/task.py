"""A built-in verifiable task: multi-step integer arithmetic with the final answer in ``\\boxed{}``.

Why it exists: the embedded default of ``recipes/qwen3_respo.py`` must show RL from verifiable rewards working on a
CPU in minutes with nothing downloaded. The task is graded by exactly the same ``math-verify`` check as real math
data (``trl.rewards.accuracy_reward`` against the ``solution`` column), so the tiny demo exercises the reward path of
the real presets.

A problem is a chain of ``num_terms`` operands joined by ``+``/``-`` (for example ``47-8+25``). The reference
completion works left to right, one partial result per step, then boxes the answer::

    prompt:      47-8+25
    completion:  47-8=39,39+25=64 \\boxed{64}

The split is by a CRC32 hash bucket, so the sets are disjoint by construction, for any seed and any size, on every
process. By default the bucket is the expression string's (train/test: the default run's split). With
``split_by="canonical"`` it is the problem's canonical form (its multiset of signed terms: ``7+7+1``, ``1+7+7`` and
``7+1+7`` are one problem), and ``validation_fraction`` carves a third set out of the training buckets: train,
validation and test then share no problem, not even a commuted or re-ordered twin (:func:`check_disjoint`). The
pretrained-model study needs that (docs/benchmarks/smollm2_staleness.md): a held-out ``b+a`` whose ``a+b`` was trained
on is not held out.

The same generator builds the benchmark task of the paper's regime (docs/benchmarks/regime.md, section 5): long ``+``
chains (16-20 single-digit terms, ~17 steps of work), a teacher that forgets some carries, and *nuisance*: with
``nuisance=True`` each step's form is a free choice of the teacher that never changes the answer (operand order,
one of four separators, an optional ``!``), so a model that imitates the teacher carries reward-irrelevant entropy on
every step, as long temperature-1 reasoning does::

    prompt:      4+8+3+9
    completion:  8+4=12;12+3=15!|9+15=24 \\boxed{24}
"""

from __future__ import annotations

import collections
import functools
import itertools
import math
import random
import zlib
from dataclasses import dataclass

__all__ = [
    "ANSWER_BALANCE_TOLERANCE", "ArithmeticTask", "SPLITS", "SPLIT_BY", "answer_balance", "answer_strata", "canonical",
    "check_answer_balance", "check_disjoint",
]  # fmt: skip

SPLITS = ("train", "validation", "test")
SPLIT_BY = ("expression", "canonical", "answer")
# The largest task space ``split_by="answer"`` enumerates (canonical forms) to stratify it.
MAX_STRATIFIED_FORMS = 200_000
# How many distinct problems a split may hold above or below its share of an answer's before check_answer_balance
# stops: the whole splits of a stratified task are within a form or two of it (tests/test_tasks.py).
ANSWER_BALANCE_TOLERANCE = 2.0
# The teacher's free choices under `nuisance=True`: none of them changes the boxed answer (math-verify grades that).
NUISANCE_SEPARATORS = (",", ";", " ", "|")
NUISANCE_NOTE = "!"
NUISANCE_NOTE_RATE = 0.3
NUISANCE_MIN_TERMS = 3  # two steps at least, so that a separator is ever chosen


@dataclass(frozen=True)
class ArithmeticTask:
    """Generator of ``+``/``-`` chains. All fields are plain numbers so the task is fully described by its config."""

    min_terms: int = 3
    max_terms: int = 4
    max_operand: int = 99
    test_fraction: float = 0.1  # share of the expression space reserved for the held-out split (hash buckets)
    validation_fraction: float = 0.0  # share reserved for the validation split (0: no validation split)
    split_by: str = "expression"  # what the hash bucket is taken of: the expression, or its canonical form
    min_operand: int = 0  # operands are drawn from min_operand..max_operand
    scratchpad: bool = True  # reference completions show the partial results before the boxed answer
    operators: str = "+-"  # operators drawn between operands ("+" for addition chains)
    # Probability that the *reference* completion forgets a carry (keeps the tens digit of the previous partial sum) on
    # a step that needs one. 0 = a perfect teacher. The ``solution`` column is always the true answer.
    teacher_error_rate: float = 0.0
    # Reward-irrelevant choices in the reference completion (operand order, separator, optional note): each step's
    # *form* is random, its value is not. Needs operators="+" (so the operands commute) and scratchpad=True.
    nuisance: bool = False
    # With nuisance: whether the operand order is one of the choices. A 0.8M-parameter model that imitates swapped
    # operands loses track of the next term of the prompt (measured: right on 2% of 16-20-term problems at
    # temperature 1 against 21% without nuisance), so the swap is not reward-irrelevant for it; False keeps the
    # separators and notes (~2 nats per step) and the running sum first.
    nuisance_swap: bool = True

    def __post_init__(self):
        if not 2 <= self.min_terms <= self.max_terms:
            raise ValueError(f"need 2 <= min_terms <= max_terms, got {self.min_terms}, {self.max_terms}")
        if not 0 <= self.min_operand <= self.max_operand or self.max_operand < 1:
            raise ValueError(f"need 0 <= min_operand <= max_operand and max_operand >= 1, got "
                             f"{self.min_operand}, {self.max_operand}")  # fmt: skip
        if not 0.0 < self.test_fraction < 1.0:
            raise ValueError(f"test_fraction must be in (0, 1), got {self.test_fraction}")
        if not 0.0 <= self.validation_fraction < 1.0 - self.test_fraction:
            raise ValueError(f"validation_fraction must be in [0, 1 - test_fraction), got {self.validation_fraction}")
        if self.split_by not in SPLIT_BY:
            raise ValueError(f"split_by must be one of {SPLIT_BY}, got {self.split_by!r}")
        if self.split_by == "answer" and self.operators != "+":
            raise ValueError("split_by='answer' stratifies sums only: it needs operators='+' (--task_operators +)")
        if not 0.0 <= self.teacher_error_rate <= 1.0:
            raise ValueError(f"teacher_error_rate must be in [0, 1], got {self.teacher_error_rate}")
        if not self.operators or set(self.operators) - set("+-"):
            raise ValueError(f"operators must be a non-empty combination of '+' and '-', got {self.operators!r}")
        if self.teacher_error_rate and not (self.operators == "+" and self.scratchpad):
            raise ValueError("teacher_error_rate needs operators='+' and scratchpad=True (carries are made per step)")
        if self.nuisance:
            if not (self.operators == "+" and self.scratchpad):
                raise ValueError("nuisance needs operators='+' and scratchpad=True (it swaps operands of each step)")
            if self.min_terms < NUISANCE_MIN_TERMS:
                raise ValueError(
                    f"nuisance needs min_terms >= {NUISANCE_MIN_TERMS} (two steps, so that a separator is chosen), "
                    f"got min_terms={self.min_terms}"
                )

    @classmethod
    def from_settings(cls, settings) -> "ArithmeticTask":
        """The task a recipe run trained on, from its ``task_*`` settings: the recipe's ``RecipeArguments`` or the
        ``args.script`` mapping of its ``report.json`` (so an evaluation regenerates exactly the run's held-out set)."""
        get = settings.get if isinstance(settings, dict) else lambda key, default=None: getattr(settings, key, default)
        return cls(
            min_terms=get("task_min_terms", 3), max_terms=get("task_max_terms", 5),
            max_operand=get("task_max_operand", 9), operators=get("task_operators", "+-"),
            min_operand=get("task_min_operand", 0) or 0, split_by=get("task_split_by", "expression") or "expression",
            validation_fraction=get("task_validation_fraction", 0.0) or 0.0,
            test_fraction=get("task_test_fraction", 0.1) or 0.1,
            scratchpad=get("task_scratchpad", True), teacher_error_rate=get("task_teacher_error_rate", 0.0) or 0.0,
            nuisance=bool(get("task_nuisance", False)), nuisance_swap=bool(get("task_nuisance_swap", True)),
        )  # fmt: skip

    # -- one problem ---------------------------------------------------------------------------------------------

    def split_of(self, expression: str) -> str:
        """The split whose hash buckets hold ``expression`` (its canonical form's, with ``split_by="canonical"``):
        ``"test"`` for the first ``test_fraction`` of buckets, ``"validation"`` for the next ``validation_fraction``,
        ``"train"`` for the rest. The test buckets come first, so carving a validation split out of the training
        buckets leaves the test set as it is: runs with and without a validation split share their test problems.
        With ``split_by="answer"`` the canonical forms are stratified by answer (:func:`answer_strata`)."""
        if self.split_by == "answer":
            return answer_strata(self.min_terms, self.max_terms, self.min_operand, self.max_operand,
                                 self.test_fraction, self.validation_fraction)[canonical(expression)]  # fmt: skip
        key = canonical(expression) if self.split_by == "canonical" else expression
        bucket = zlib.crc32(key.encode()) % 10_000
        if bucket < self.test_fraction * 10_000:
            return "test"
        return "validation" if bucket < (self.test_fraction + self.validation_fraction) * 10_000 else "train"

    def sample_expression(self, rng: random.Random) -> str:
        terms = rng.randint(self.min_terms, self.max_terms)
        draw = lambda: str(rng.randint(self.min_operand, self.max_operand))  # noqa: E731
        expression = draw()
        for _ in range(terms - 1):
            expression += rng.choice(self.operators) + draw()
        return expression

    @staticmethod
    def crosses_ten(previous: int, new: int) -> bool:
        """Whether an addition step from ``previous`` to ``new`` (both >= 0) needs a carry."""
        return previous // 10 != new // 10

    @staticmethod
    def steps(expression: str) -> list[tuple[str, int]]:
        """Left-to-right partial results: ``[("47-8", 39), ("39+25", 64)]`` for ``47-8+25``."""
        tokens, number = [], ""
        for char in expression:
            if char in "+-" and number:
                tokens.append(int(number))
                tokens.append(char)
                number = ""
            else:
                number += char
        tokens.append(int(number))
        value, out = tokens[0], []
        for op, operand in zip(tokens[1::2], tokens[2::2]):
            new = value + operand if op == "+" else value - operand
            out.append((f"{value}{op}{operand}", new))
            value = new
        return out

    @classmethod
    def answer(cls, expression: str) -> int:
        return cls.steps(expression)[-1][1]

    def completion(self, expression: str, rng: random.Random | None = None) -> str:
        """The reference (teacher) completion used by the warm start.

        With ``teacher_error_rate > 0`` (and an ``rng``) the teacher forgets each needed carry with that probability:
        it writes the previous partial sum's tens digit with the new units digit (``17+5=12``), carries on correctly
        from its own wrong partial sum, and boxes what it got. With ``nuisance`` (and an ``rng``) each step's operand
        order, the separator before it and an optional ``!`` after it are drawn at random.
        """
        steps = self.steps(expression)
        if not self.scratchpad:
            return f"\\boxed{{{steps[-1][1]}}}"
        parts, value = [], None
        nuisance = self.nuisance and rng is not None
        for index, (lhs, _) in enumerate(steps):
            if value is not None:
                op_index = max(lhs.rfind("+", 1), lhs.rfind("-", 1))
                lhs = f"{value}{lhs[op_index:]}"
            first, op, second = self._split(lhs)
            new = first + second if op == "+" else first - second
            forgets = self.teacher_error_rate and rng is not None and self.crosses_ten(first, new)
            if forgets and rng.random() < self.teacher_error_rate:
                new = 10 * (first // 10) + new % 10
            step = f"{lhs}={new}"
            if nuisance:
                if self.nuisance_swap and rng.random() < 0.5:
                    step = f"{second}{op}{first}={new}"  # operands commute ('+' only)
                if rng.random() < NUISANCE_NOTE_RATE:
                    step += NUISANCE_NOTE
                if index:
                    step = rng.choice(NUISANCE_SEPARATORS) + step
            elif index:
                step = "," + step
            parts.append(step)
            value = new
        return "".join(parts) + f" \\boxed{{{value}}}"

    @staticmethod
    def _split(lhs: str) -> tuple[int, str, int]:
        index = max(lhs.rfind("+", 1), lhs.rfind("-", 1))
        return int(lhs[:index]), lhs[index], int(lhs[index + 1 :])

    # -- datasets --------------------------------------------------------------------------------------------------

    def expressions(self, split: str, n: int | None, seed: int) -> list[str]:
        """``n`` distinct expressions of ``split``, deterministic in ``seed``; ``n=None``: every expression of the
        split (small spaces only), in an order fixed by ``seed``."""
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        if split == "validation" and not self.validation_fraction:
            raise ValueError("this task has no validation split: set validation_fraction (--task_validation_fraction)")
        if n is None:
            return self._every_expression(split, seed)
        rng = random.Random(f"{split}-{seed}")
        out, seen = [], set()
        attempts = 0
        while len(out) < n:
            attempts += 1
            if attempts > 100 * n + 10_000:
                raise ValueError(f"could not draw {n} distinct {split} expressions: the task's space is too small")
            expression = self.sample_expression(rng)
            if expression in seen or self.split_of(expression) != split:
                continue
            seen.add(expression)
            out.append(expression)
        return out

    def _every_expression(self, split: str, seed: int) -> list[str]:
        import itertools

        operands = range(self.min_operand, self.max_operand + 1)
        size = sum((len(operands) * len(self.operators)) ** t for t in range(self.min_terms, self.max_terms + 1))
        if size > 1_000_000:
            raise ValueError(f"the task's space holds ~{size:,} expressions: ask for a number of them (n)")
        out = []
        for terms in range(self.min_terms, self.max_terms + 1):
            for values in itertools.product(operands, repeat=terms):
                for ops in itertools.product(self.operators, repeat=terms - 1):
                    expression = str(values[0]) + "".join(o + str(v) for o, v in zip(ops, values[1:]))
                    if self.split_of(expression) == split:
                        out.append(expression)
        random.Random(f"{split}-{seed}").shuffle(out)
        return out

    def rows(self, split: str, n: int | None, seed: int) -> dict[str, list]:
        """Columns for ``datasets.Dataset.from_dict``: a conversational ``prompt``, ``solution`` and ``completion``."""
        expressions = self.expressions(split, n, seed)
        teacher = random.Random(f"teacher-{split}-{seed}")
        return {
            "prompt": [[{"role": "user", "content": e}] for e in expressions],
            "solution": [str(self.answer(e)) for e in expressions],
            "completion": [self.completion(e, teacher) for e in expressions],
        }

    def teacher_accuracy(self, split: str, n: int, seed: int) -> float:
        """Share of the reference completions of ``rows(split, n, seed)`` whose boxed answer is right."""
        rows = self.rows(split, n, seed)
        right = sum(c.endswith(f"\\boxed{{{a}}}") for c, a in zip(rows["completion"], rows["solution"]))
        return right / n

    def dataset(self, split: str, n: int, seed: int):
        from datasets import Dataset

        return Dataset.from_dict(self.rows(split, n, seed))

    def write_jsonl(self, path, split: str, n: int, seed: int) -> int:
        """Write ``rows(split, n, seed)`` in the MATH-500 schema (``problem``, ``answer``) that ``recipes/eval_math.py``
        reads; returns the number of rows written."""
        import json

        rows = self.rows(split, n, seed)
        with open(path, "w") as f:
            for prompt, answer in zip(rows["prompt"], rows["solution"]):
                f.write(json.dumps({"problem": prompt[-1]["content"], "answer": answer}) + "\n")
        return n


def canonical(expression: str) -> str:
    """The problem an expression poses, whatever the order of its terms: its signed terms sorted (``7+7+1``,
    ``1+7+7`` -> ``+1+7+7``; ``47-8+25`` and ``25-8+47`` -> ``+25+47-8``). Two expressions with one canonical form are
    twins: the same sum, re-ordered."""
    terms, sign, number = [], "+", ""
    for char in expression.replace(" ", ""):
        if char in "+-" and number:
            terms.append(f"{sign}{int(number)}")
            sign, number = char, ""
        else:
            number += char
    terms.append(f"{sign}{int(number)}")
    return "".join(sorted(terms))


@functools.lru_cache(maxsize=8)
def answer_strata(min_terms: int, max_terms: int, min_operand: int, max_operand: int, test_fraction: float,
                  validation_fraction: float) -> dict[str, str]:  # fmt: skip
    """Canonical form -> split for sums (``split_by="answer"``): the problems are grouped by canonical form (so a
    re-ordered twin is always in its problem's split) and the forms, sorted by answer and then by CRC32 hash, are dealt
    one by one to the split furthest behind its share (test, validation, train). Every run of forms with one answer is
    then cut in proportion to within a form or two, and the rounding does not pile up on one split, so train,
    validation and test share their answer distribution."""
    count = sum(math.comb(max_operand - min_operand + t, t) for t in range(min_terms, max_terms + 1))
    if count > MAX_STRATIFIED_FORMS:
        raise ValueError(f"split_by='answer' would enumerate {count:,} canonical forms (at most "
                         f"{MAX_STRATIFIED_FORMS:,}): use split_by='canonical' for a space this large")  # fmt: skip
    by_answer: dict[int, list[str]] = {}
    for terms in range(min_terms, max_terms + 1):
        for values in itertools.combinations_with_replacement(range(min_operand, max_operand + 1), terms):
            by_answer.setdefault(sum(values), []).append(canonical("+".join(map(str, values))))
    shares = {"test": test_fraction, "validation": validation_fraction, "train": 1.0 - test_fraction - validation_fraction}
    dealt = dict.fromkeys(shares, 0)
    out, j = {}, 0
    for answer in sorted(by_answer):  # one deal over the forms sorted by (answer, hash): every answer gets its share
        for key in sorted(by_answer[answer], key=lambda key: (zlib.crc32(key.encode()), key)):
            j += 1
            split = max(shares, key=lambda name: shares[name] * j - dealt[name])  # the split furthest behind its share
            dealt[split] += 1
            out[key] = split
    return out


def answer_balance(splits: dict[str, list[str]]) -> dict[str, dict]:
    """How far each held-out split's answers are from their share, over distinct problems (canonical forms): for
    each answer ``a`` with ``n(a)`` forms over all the given splits, a split holding a share ``f`` of every form
    should hold ``f n(a)`` of them. Per split other than ``train``: the largest deviation in forms and its answer,
    and the total variation distance from train's answer distribution (0: the same, 1: no answer in common)."""
    forms = {name: {canonical(e): ArithmeticTask.answer(e) for e in expressions} for name, expressions in splits.items()}
    counts = {name: collections.Counter(f.values()) for name, f in forms.items()}
    total = sum(len(f) for f in forms.values())
    everything = sum(counts.values(), collections.Counter())
    out = {}
    for name in splits:
        if name == "train" or not forms[name]:
            continue
        share = len(forms[name]) / total
        worst = max(everything, key=lambda a: (abs(counts[name][a] - share * everything[a]), -a))
        train, held = counts["train"], counts[name]
        n_train, n_held = sum(train.values()), sum(held.values())
        tv = 0.5 * sum(abs(train[a] / n_train - held[a] / n_held) for a in everything)
        out[name] = {"max_deviation": abs(held[worst] - share * everything[worst]), "answer": worst,
                     "forms": held[worst], "expected": share * everything[worst], "total_variation": tv}  # fmt: skip
    return out


def check_answer_balance(splits: dict[str, list[str]], tolerance: float = ANSWER_BALANCE_TOLERANCE) -> None:
    """Stop, in one line, if a held-out split holds some answer's problems more than ``tolerance`` forms away from
    its share (the whole splits of a ``split_by="answer"`` task are within a form or two by construction), naming the
    split, the answer and both counts."""
    for name, b in answer_balance(splits).items():
        if b["max_deviation"] > tolerance:
            raise ValueError(
                f"answer distributions differ: {name} has {b['forms']} problems whose answer is {b['answer']} where "
                f"its share is {b['expected']:.1f} (tolerance {tolerance:g}); stratify the split by answer "
                "(--task_split_by answer)"
            )


def check_disjoint(splits: dict[str, list[str]]) -> None:
    """Stop, in one line, if two of the named problem lists share a problem or a re-ordered twin of one."""
    seen: dict[str, tuple[str, str]] = {}
    for name, expressions in splits.items():
        for expression in expressions:
            key = canonical(expression)
            other = seen.setdefault(key, (name, expression))
            if other[0] != name:
                raise ValueError(
                    f"split overlap: {other[0]} has {other[1]!r} and {name} has {expression!r}, the same problem "
                    f"re-ordered ({key}); split by canonical form (--task_split_by canonical)"
                )


def main(argv=None) -> None:
    """``python -m respo_trl.builtin.task --out arith_test.jsonl``: the tiny preset's held-out split as an eval_math file."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--out", required=True, help="JSONL file to write (columns: problem, answer)")
    parser.add_argument("--split", choices=SPLITS, default="test")
    parser.add_argument("--n", type=int, default=500, help="number of problems")
    parser.add_argument("--seed", type=int, default=0, help="the recipe's --task_seed")
    # defaults: respo_trl/recipe/presets/tiny-cpu.yaml
    parser.add_argument("--min_terms", type=int, default=3)
    parser.add_argument("--max_terms", type=int, default=5)
    parser.add_argument("--max_operand", type=int, default=9)
    parser.add_argument("--operators", default="+")
    args = parser.parse_args(argv)
    task = ArithmeticTask(
        min_terms=args.min_terms, max_terms=args.max_terms, max_operand=args.max_operand, operators=args.operators
    )
    print(f"wrote {task.write_jsonl(args.out, args.split, args.n, args.seed)} {args.split} problems to {args.out}")


if __name__ == "__main__":
    main()
