"""Grading and sampling metrics shared by training and evaluation.

Why this module exists: a benchmark number only says something about an RLVR checkpoint if the benchmark grades
answers exactly the way the policy was rewarded. Training uses TRL's ``trl.rewards.accuracy_reward`` (math-verify,
``\\boxed{}`` first, no un-anchored extraction, units normalised), so :func:`grade` *calls that function* rather than
re-implementing it, and majority voting re-parses answers with :data:`PREDICTION_EXTRACTION`, the configuration
inside it (a test compares the two so they cannot drift apart).

Gold answers are wrapped in ``\\boxed{...}`` before grading (:func:`gold_solution`): math-verify's default parse of a
*bare* answer string mis-reads many MATH answers (``6 - 5i`` parses as ``5``, ``3\\sqrt{13}`` as ``3``, ``1,-2`` as
``1``), while a boxed answer parses as written. Training datasets should store ``solution`` the same way.

The metrics (definitions in ``docs/evaluation.md``):

- ``avg@n``: the mean over problems of the fraction of the ``n`` samples that are correct (``pass@1`` estimated with
  ``n`` samples).
- ``pass@k``: the unbiased estimator of Chen et al. (2021, arXiv:2107.03374), ``1 - C(n-c, k) / C(n, k)`` for a
  problem with ``c`` correct samples out of ``n``, averaged over problems.
- ``maj@n``: the answer given most often among the ``n`` samples (answers are grouped by mathematical equivalence;
  samples with no extractable answer do not vote) is graded; a tie between ``t`` top answers scores the fraction of
  them that are correct (the expectation under a uniformly random tie-break), so the metric does not depend on sample
  order.

Also here: :func:`dapo_accuracy_reward` (the +1/-1 reward of verl's DAPO reward manager, which the ReSPO paper trains
with, graded by :func:`grade`) and :func:`length_bins` (accuracy by response length in equal-width bins, as the paper
reports it; definition in ``docs/evaluation.md``).

Importing this module does not import TRL; :func:`grade` does, on first use.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

UNPARSEABLE = "[unparseable]"  # what accuracy_reward logs when no answer can be extracted from a completion
SKIPPED = "[skipped]"  # what it logs when the gold answer cannot be parsed (reward None)


def prediction_extraction():
    """The extraction config ``trl.rewards.accuracy_reward`` uses for completions (kept identical by a test)."""
    from latex2sympy2_extended import NormalizationConfig
    from math_verify import LatexExtractionConfig

    return [
        LatexExtractionConfig(
            normalization_config=NormalizationConfig(units=True),
            boxed_match_priority=0,
            try_extract_without_anchor=False,
        )
    ]


def parse_prediction(text: str):
    """Parse a completion's final answer with the training reward's settings (math-verify objects, maybe empty)."""
    from math_verify import parse

    return parse(text, extraction_config=prediction_extraction(), extraction_mode="first_match")


def gold_solution(answer) -> str:
    """The ``solution`` string to grade against: the answer inside ``\\boxed{}`` (integral floats become integers)."""
    if isinstance(answer, float) and answer.is_integer():
        answer = int(answer)
    text = str(answer).strip()
    return text if "\\boxed" in text else f"\\boxed{{{text}}}"


@dataclass(frozen=True)
class Grade:
    """One graded sample: ``reward`` is 1.0/0.0 (None when the gold answer itself cannot be parsed), ``answer`` is
    the parsed prediction exactly as ``accuracy_reward`` logs it (:data:`UNPARSEABLE` when nothing was extracted)."""

    reward: float | None
    answer: str

    @property
    def correct(self) -> bool:
        return bool(self.reward)

    @property
    def has_answer(self) -> bool:
        return self.answer not in (UNPARSEABLE, SKIPPED)


def grade(completions: Sequence[str], solutions: Sequence[str]) -> list[Grade]:
    """Grade completion texts against gold ``solutions`` (see :func:`gold_solution`) with TRL's training reward."""
    from trl.rewards import accuracy_reward

    logged: dict[str, list] = {}
    rewards = accuracy_reward(
        [[{"role": "assistant", "content": text}] for text in completions],
        list(solutions),
        log_extra=lambda name, values: logged.__setitem__(name, values),
    )
    return [Grade(reward, answer) for reward, answer in zip(rewards, logged["answer_parsed"], strict=True)]


def accuracy_scores(completions: Sequence[str], solutions: Sequence[str], reward_fn=None) -> list[float]:
    """The training accuracy reward of each completion text (``trl.rewards.accuracy_reward`` unless ``reward_fn``, the
    run's own accuracy reward, is given), with an ungradable gold answer (``None``) scored 0: the held-out accuracy
    the recipe, the warm start's demonstrations and the benchmarks report."""
    if reward_fn is None:
        from trl.rewards import accuracy_reward as reward_fn
    scores = reward_fn([[{"role": "assistant", "content": c}] for c in completions], list(solutions))
    return [0.0 if s is None else float(s) for s in scores]


def dapo_accuracy_reward(completions, solution, log_extra=None, **kwargs) -> list[float | None]:
    """DAPO-style accuracy reward for TRL: ``+1.0`` for a correct final answer, ``-1.0`` otherwise.

    The ReSPO paper trains with verl's DAPO reward manager, which scores a response +1 or -1 (and adds the soft overlong
    penalty on top, in [-1, 0]). Correctness here is :func:`grade`, i.e. TRL's ``accuracy_reward`` (math-verify, first
    ``\\boxed{}`` answer) against the gold answer wrapped by :func:`gold_solution`, exactly as ``eval_math.py`` grades.
    With group-normalised advantages (GRPO, TRL ``scale_rewards="group"``) +1/-1 and 1/0 give identical advantages;
    the +1/-1 scale matters when a second reward (the overlong penalty) is added, where it reproduces verl's sum.
    A gold answer math-verify cannot parse gives ``None`` (TRL skips it), as ``accuracy_reward`` does.
    """
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    grades = grade(texts, [gold_solution(s) for s in solution])
    if log_extra is not None:
        log_extra("answer_parsed", [g.answer for g in grades])
    return [None if g.reward is None else (1.0 if g.correct else -1.0) for g in grades]


# -- metrics -------------------------------------------------------------------------------------------------------------


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one problem with ``c`` correct out of ``n`` samples: ``1 - C(n-c, k) / C(n, k)``.

    Computed as ``1 - prod_{j=n-c+1}^{n} (1 - k/j)``, which is exact and never forms large binomials.
    """
    if not 0 <= c <= n:
        raise ValueError(f"need 0 <= c <= n, got c={c}, n={n}")
    if not 1 <= k <= n:
        raise ValueError(f"need 1 <= k <= n, got k={k}, n={n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / j for j in range(n - c + 1, n + 1))


def default_ks(n: int) -> list[int]:
    """The k reported for pass@k: powers of two below ``n``, and ``n`` itself."""
    ks = [2**i for i in range(n.bit_length()) if 2**i < n]
    return [*ks, n]


def majority_vote(
    answers: Sequence[Hashable | None],
    correct: Sequence[bool],
    same: Callable[[Hashable, Hashable], bool] | None = None,
) -> float:
    """maj@n for one problem: the score of the most frequent answer, ties shared (see the module docstring).

    ``answers[i]`` is a key for sample ``i``'s answer (``None``: no answer, no vote) and ``correct[i]`` its grade.
    Equal keys are one answer; ``same(a, b)`` may merge distinct keys that are equivalent (e.g. ``0.5`` and
    ``\\frac{1}{2}``). A merged answer is graded by its most frequent key.
    """
    if len(answers) != len(correct):
        raise ValueError("answers and correct must have the same length")
    counts: dict[Hashable, int] = {}
    right: dict[Hashable, bool] = {}
    for key, ok in zip(answers, correct):
        if key is None:
            continue
        counts[key] = counts.get(key, 0) + 1
        right.setdefault(key, bool(ok))
    if not counts:
        return 0.0
    clusters: list[list[Hashable]] = []  # distinct keys, most frequent first, merged by `same`
    for key in sorted(counts, key=lambda k: -counts[k]):
        for cluster in clusters:
            if same is not None and same(cluster[0], key):
                cluster.append(key)
                break
        else:
            clusters.append([key])
    votes = [sum(counts[k] for k in cluster) for cluster in clusters]
    top = max(votes)
    winners = [cluster for cluster, v in zip(clusters, votes) if v == top]
    return sum(right[cluster[0]] for cluster in winners) / len(winners)


def equivalent_answers(texts_by_key: dict[str, str]) -> Callable[[str, str], bool]:
    """An equivalence test for :func:`majority_vote` keys: math-verify on the answers parsed from sample texts.

    ``texts_by_key`` maps each key (an ``accuracy_reward`` parsed-answer string) to one completion that produced it;
    each is re-parsed once with :func:`parse_prediction`.
    """
    from math_verify import verify

    parsed: dict[str, list] = {}

    def same(a: str, b: str) -> bool:
        for key in (a, b):
            if key not in parsed:
                parsed[key] = parse_prediction(texts_by_key[key])
        if not parsed[a] or not parsed[b]:
            return False
        return bool(verify(parsed[a], parsed[b]))

    return same


def problem_metrics(grades: Sequence[Grade], texts: Sequence[str], ks: Sequence[int]) -> dict:
    """Per-problem numbers from its ``n`` graded samples: correct count, pass@k for each k, maj@n."""
    n = len(grades)
    c = sum(g.correct for g in grades)
    keys = [g.answer if g.has_answer else None for g in grades]
    first_text = {}
    for key, text in zip(keys, texts):
        if key is not None:
            first_text.setdefault(key, text)
    return {
        "n": n,
        "correct": c,
        "pass_at_k": {str(k): pass_at_k(n, c, k) for k in ks},
        "maj": majority_vote(keys, [g.correct for g in grades], equivalent_answers(first_text)),
    }


def aggregate(per_problem: Sequence[dict]) -> dict:
    """Benchmark-level avg@n (with its standard error over problems), pass@k and maj@n from :func:`problem_metrics`."""
    if not per_problem:
        raise ValueError("no gradable problems")
    n = per_problem[0]["n"]
    accuracies = [p["correct"] / p["n"] for p in per_problem]
    count = len(accuracies)
    mean = sum(accuracies) / count
    stderr = math.sqrt(sum((a - mean) ** 2 for a in accuracies) / (count - 1) / count) if count > 1 else 0.0
    ks = per_problem[0]["pass_at_k"].keys()
    return {
        "problems": count,
        "n": n,
        "avg_at_n": mean,
        "avg_at_n_stderr": stderr,
        "pass_at_k": {k: sum(p["pass_at_k"][k] for p in per_problem) / count for k in ks},
        "maj_at_n": sum(p["maj"] for p in per_problem) / count,
    }


# -- reporting -----------------------------------------------------------------------------------------------------------


def results_table(report: dict) -> str:
    """A markdown table of an ``eval_math.json`` report, one row per benchmark, percentages."""
    rows = report["results"]
    if not rows:
        return ""
    ks = sorted({int(k) for row in rows for k in row["pass_at_k"]} - {1})
    header = ["benchmark", "problems", "n", "avg@n", *[f"pass@{k}" for k in ks], "maj@n"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        pass_k = [f"{100 * row['pass_at_k'][str(k)]:.1f}" if str(k) in row["pass_at_k"] else "" for k in ks]
        cells = [
            row["benchmark"],
            str(row["problems"]),
            str(row["n"]),
            f"{100 * row['avg_at_n']:.1f} ± {100 * row['avg_at_n_stderr']:.1f}",
            *pass_k,
            f"{100 * row['maj_at_n']:.1f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# -- accuracy by response length ---------------------------------------------------------------------------------------

LENGTH_BINS_DEFINITION = (
    "{bins} equal-width bins over [0, {max_tokens}] response tokens (width {width:.1f}): a response of L tokens falls "
    "in bin floor(L * {bins} / {max_tokens}), and responses that reach the cap ({max_tokens} tokens, i.e. truncated) "
    "are counted in the last bin; accuracy = correct samples / samples in the bin, every sample counted once"
)


def length_bin_index(length: int, max_tokens: int, bins: int) -> int:
    """The bin of a response of ``length`` tokens: ``floor(length * bins / max_tokens)``, capped at the last bin."""
    if length < 0:
        raise ValueError(f"negative response length {length}")
    return min(length * bins // max_tokens, bins - 1)


def length_bins(lengths: Sequence[int], correct: Sequence[bool], max_tokens: int, bins: int = 30) -> list[dict]:
    """Accuracy by response length in ``bins`` equal-width bins over ``[0, max_tokens]`` (integer arithmetic, so a
    length on an edge belongs to the bin above it; lengths at or beyond the cap go to the last bin).

    Equal-width bins, not quantiles: two checkpoints evaluated with the same ``max_tokens`` share the same bins, so their
    accuracies can be compared bin by bin (quantile bins would move with each model's own length distribution).
    Returns one dict per bin: ``bin``, ``lo``, ``hi`` (token edges), ``samples``, ``correct``, ``accuracy`` (``None``
    for an empty bin) and ``at_cap`` (samples that reached ``max_tokens``).
    """
    if bins < 1 or max_tokens < 1:
        raise ValueError(f"need bins >= 1 and max_tokens >= 1, got bins={bins}, max_tokens={max_tokens}")
    if len(lengths) != len(correct):
        raise ValueError("lengths and correct must have the same length")
    counts, hits, capped = [0] * bins, [0] * bins, [0] * bins
    for length, ok in zip(lengths, correct):
        index = length_bin_index(int(length), max_tokens, bins)
        counts[index] += 1
        hits[index] += bool(ok)
        capped[index] += int(length) >= max_tokens
    return [
        {
            "bin": k,
            "lo": max_tokens * k / bins,
            "hi": max_tokens * (k + 1) / bins,
            "samples": counts[k],
            "correct": hits[k],
            "accuracy": hits[k] / counts[k] if counts[k] else None,
            "at_cap": capped[k],
        }
        for k in range(bins)
    ]


def length_bins_table(rows: Sequence[dict]) -> str:
    """A markdown table of :func:`length_bins` rows (token ranges, samples, correct, accuracy in percent)."""
    lines = ["| bin | response tokens | samples | correct | accuracy |", "|---|---|---|---|---|"]
    for row in rows:
        accuracy = "" if row["accuracy"] is None else f"{100 * row['accuracy']:.1f}"
        lines.append(
            f"| {row['bin'] + 1} | {row['lo']:.0f}-{row['hi']:.0f} | {row['samples']} | {row['correct']} | {accuracy} |"
        )
    return "\n".join(lines)


def generation_summary(report: dict) -> str:
    """One sentence with the evaluation settings of an ``eval_math.json`` report (used in its markdown and in model
    cards): the protocol when one was used (and what was changed from it), samples per problem, sampling, backend."""
    g = report["generation"]
    n = g["n"]
    samples = (
        "Samples per problem: " + ", ".join(f"{name} {count}" for name, count in n.items()) + ";"
        if isinstance(n, dict)
        else f"{n} samples per problem,"
    )
    text = (
        f"{samples} temperature {g['temperature']}, top-p {g['top_p']}, at most {g['max_new_tokens']} new tokens, "
        f"{report['backend']} generation; percentages."
    )
    protocol = report.get("protocol")
    if protocol:
        changed = protocol.get("changed") or []
        text = (
            f"Protocol `{protocol['name']}` ({protocol['description']})"
            + (f", with changes: {', '.join(changed)}" if changed else "")
            + ". "
            + text
        )
    return text
