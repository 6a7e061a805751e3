"""Completions to numbers: every sample graded with the training reward, reduced to a benchmark's avg@n, pass@k and
maj@n, and pooled into accuracy by response length.

Why this is glue only: the grading and the metric definitions live in :mod:`respo_trl.grading` (the reward ReSPO trains
with, ``docs/evaluation.md``), so a benchmark number and a training reward cannot disagree on what "correct" means.
"""

from __future__ import annotations

import logging

from .problems import Problem
from .protocols import BenchmarkSpec

logger = logging.getLogger("eval_math")


def benchmark_ks(n: int, ks=None) -> list[int]:
    """The k of pass@k for ``n`` samples: ``--ks`` (or powers of two below n, and n) within ``1..n``, 1 always."""
    from respo_trl.grading import default_ks

    return sorted({k for k in (ks or default_ks(n)) if 1 <= k <= n} | {1})


def score_benchmark(
    label: str, spec: BenchmarkSpec, problems: list[Problem], completions: list[list[str]], ks, lengths=None
):
    """Grade every sample with the training reward and reduce to the benchmark's metrics and per-sample records
    (with each sample's response length in tokens when ``lengths`` is given)."""
    from tqdm.auto import tqdm

    from respo_trl.grading import aggregate, gold_solution, grade, problem_metrics

    per_problem, samples, skipped = [], [], []
    lengths = lengths if lengths is not None else [[None] * len(texts) for texts in completions]
    graded = tqdm(
        zip(problems, completions, lengths, strict=True), total=len(problems), desc=f"grading {label}", unit="problem"
    )
    for problem, texts, tokens in graded:
        grades = grade(texts, [gold_solution(problem.answer)] * len(texts))
        if any(g.reward is None for g in grades):  # gold answer unparseable: the training reward skips it too
            skipped.append(problem.uid)
            continue
        metrics = problem_metrics(grades, texts, ks)
        per_problem.append(metrics)
        samples.extend(
            {
                "benchmark": label,
                "id": problem.uid,
                "sample": j,
                "answer": problem.answer,
                "parsed": g.answer,
                "correct": g.correct,
                "tokens": length,
                "completion": text,
            }
            for j, (g, text, length) in enumerate(zip(grades, texts, tokens))
        )
    if skipped:
        logger.warning(f"{label}: {len(skipped)} problem(s) skipped, gold answer not parseable: {skipped[:10]}")
    row = {
        "benchmark": label,
        "dataset": spec.dataset,
        "config": spec.config,
        "split": spec.split,
        **aggregate(per_problem),
    }
    row["skipped"] = skipped
    counted = [s["tokens"] for s in samples if s["tokens"] is not None]
    if counted:
        row["mean_tokens"] = sum(counted) / len(counted)
    return row, samples


def length_bin_report(samples: list[dict], benchmarks: list[str], max_new_tokens: int, count: int) -> dict:
    """Accuracy in ``count`` equal-width response-length bins over ``[0, max_new_tokens]``: every benchmark pooled
    (``all``) and each on its own (``by_benchmark``), with the definition the report prints."""
    from respo_trl.grading import LENGTH_BINS_DEFINITION, length_bins

    def bins_of(records):
        return length_bins([s["tokens"] for s in records], [s["correct"] for s in records], max_new_tokens, count)

    return {
        "bins": count,
        "max_new_tokens": max_new_tokens,
        "definition": LENGTH_BINS_DEFINITION.format(bins=count, max_tokens=max_new_tokens, width=max_new_tokens / count),
        "all": bins_of(samples),
        "by_benchmark": {name: bins_of([s for s in samples if s["benchmark"] == name]) for name in benchmarks},
    }
