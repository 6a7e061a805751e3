"""What an evaluation measures, by name: the benchmark registry, the named protocols (the ReSPO paper's), the defaults
without one, and the settings a recipe run trained with.

Why here and named: a benchmark table is only comparable when its benchmarks, samples per problem, sampling, budget
and prompt can be read back from names. The options a user gives are resolved against a protocol here, and every
change from it is recorded, so the report and the model card can say "the paper's protocol, with changes: ...".
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from ...run_files import REPORT_FILE

logger = logging.getLogger("eval_math")

DEFAULT_SYSTEM_PROMPT = "Please reason step by step, and put your final answer within \\boxed{}."


@dataclass(frozen=True)
class BenchmarkSpec:
    dataset: str  # Hub id or local file
    split: str = "test"
    config: str | None = None
    problem_column: str | None = None  # None: the first of PROBLEM_COLUMNS present
    answer_column: str | None = None  # None: the first of ANSWER_COLUMNS present


BENCHMARKS = {
    "math500": BenchmarkSpec("HuggingFaceH4/MATH-500", "test"),  # problem, solution, answer, subject, level, unique_id
    "aime24": BenchmarkSpec("HuggingFaceH4/aime_2024", "train"),  # id, problem, solution, answer, url, year
    "aime25": BenchmarkSpec("math-ai/aime25", "test"),  # id, problem, answer
    "amc23": BenchmarkSpec("math-ai/amc23", "test"),  # id, question, answer (numbers), url
    # OlympiadBench's 675 English, text-only, open-ended math competition problems (OE_TO_maths_en_COMP): id, question,
    # final_answer (a list of LaTeX strings in $...$; several for multi-answer problems), solution, context, unit, ...
    "olympiadbench": BenchmarkSpec("math-ai/olympiadbench", "test", problem_column="question", answer_column="final_answer"),
    # Minerva's 272 undergraduate STEM problems (OCWCourses): question, answer
    "minervamath": BenchmarkSpec("math-ai/minervamath", "test", problem_column="question", answer_column="answer"),
}


@dataclass(frozen=True)
class Protocol:
    """A named evaluation setting: samples per problem for each benchmark, sampling, budget and prompt."""

    description: str
    samples: dict[str, int]  # benchmark -> samples per problem, in report order
    temperature: float
    top_p: float
    max_new_tokens: int
    system_prompt: str
    prompt_template: str


PROTOCOLS = {
    # The ReSPO paper's evaluation (arXiv:2609.35433): AIME24/25 and AMC23 at 16 samples, the larger sets at 4,
    # temperature 1.0, top-p 0.7, up to 16,384 response tokens, Math-Verify. Its prompt is not published: we ask as in
    # training (the user turn of the paper's DAPO preparation, no system turn).
    "respo-paper": Protocol(
        description="the ReSPO paper's evaluation: AIME24, AIME25, AMC23 at 16 samples per problem; MATH-500, "
        "OlympiadBench, MinervaMath at 4; temperature 1.0, top-p 0.7, up to 16,384 new tokens; math-verify",
        samples={"aime24": 16, "aime25": 16, "amc23": 16, "math500": 4, "olympiadbench": 4, "minervamath": 4},
        temperature=1.0,
        top_p=0.7,
        max_new_tokens=16384,
        system_prompt="",
        prompt_template="{problem} Please reason step by step, and put your final answer within \\boxed{}.",
    ),
}
# Without --protocol: the defaults of the options below.
DEFAULTS = {
    "benchmarks": ["math500"],
    "n": 4,
    "temperature": 0.6,
    "top_p": 0.95,
    "max_new_tokens": 4096,
    "system_prompt": DEFAULT_SYSTEM_PROMPT,
    "prompt_template": "{problem}",
}
LENGTH_BINS = 30  # the paper reports accuracy in 30 response-length bins


def run_defaults(model: str) -> dict:
    """How the run in ``model`` (a recipe ``output_dir``: its ``report.json``) trained: the benchmark, prompt format and
    budget to evaluate it with by default. Empty for anything else (a Hub id, a snapshot, a run of a user's script)."""
    report_path = Path(model) / REPORT_FILE
    if not report_path.is_file():
        return {}
    report = json.loads(report_path.read_text())
    script = (report.get("args") or {}).get("script") or {}
    fmt = report.get("prompt_format") or script
    sampling = report.get("sampling") or {}
    # an older recipe's report has no sampling section: the budget and temperature are then the saved config's
    if not sampling and (Path(model) / "training_args.bin").is_file():
        import torch

        training = torch.load(Path(model) / "training_args.bin", weights_only=False)
        sampling = {"max_completion_length": training.max_completion_length, "temperature": training.temperature}
    out = {
        "system_prompt": fmt.get("system_prompt") or "",
        "prompt_template": fmt.get("prompt_template") or "{problem}",
        "max_new_tokens": sampling.get("max_completion_length"),
        "temperature": sampling.get("temperature"),
        "top_p": 1.0,
    }
    task = script.get("dataset_name") or report.get("task") or ""
    if script.get("eval_dataset_name"):
        out["benchmarks"] = [script["eval_dataset_name"]]
    elif task.startswith("builtin:"):  # the run's own held-out split, regenerated exactly (same generator and seed)
        out["benchmarks"] = [str(Path(model) / "heldout.jsonl")]
        out["builtin_heldout"] = script  # the task_* settings, task_seed and heldout_size
    return {k: v for k, v in out.items() if v is not None}


def apply_run_defaults(args) -> dict:
    """Without ``--protocol``, options left unset take the values the run in ``--model`` trained with (its
    ``report.json``): its held-out set, prompt format, token budget and temperature. Returns what was taken."""
    if args.protocol is not None:
        return {}
    defaults = run_defaults(args.model)
    taken = {}
    for name in ("benchmarks", "system_prompt", "prompt_template", "max_new_tokens", "temperature", "top_p"):
        if name in defaults and getattr(args, name) is None:
            setattr(args, name, defaults[name])
            taken[name] = defaults[name]
    args.builtin_heldout = defaults.get("builtin_heldout") if "benchmarks" in taken else None
    if taken:
        described = ", ".join(f"{k}={v!r}" for k, v in taken.items())
        logger.info(f"defaults from {os.path.join(args.model, REPORT_FILE)} (how the run trained): {described}")
    return taken


def resolve_protocol(args, parser) -> None:
    """Fill the unset options from ``--protocol`` (or the defaults) and record what was changed from the protocol.

    Sets ``args.samples`` (benchmark -> samples per problem) and ``args.protocol_report`` (``None`` without a protocol).
    """
    protocol = PROTOCOLS.get(args.protocol)
    changed = []
    for name in ("temperature", "top_p", "max_new_tokens", "system_prompt", "prompt_template"):
        given = getattr(args, name)
        reference = getattr(protocol, name) if protocol else DEFAULTS[name]
        if given is None:
            setattr(args, name, reference)
        elif protocol and given != reference:
            changed.append(f"{name}={given!r}")
    if args.benchmarks is None:
        args.benchmarks = list(protocol.samples) if protocol else list(DEFAULTS["benchmarks"])
    elif protocol and args.benchmarks != list(protocol.samples):
        changed.append(f"benchmarks={' '.join(args.benchmarks)}")
    args.samples = {}
    for name in args.benchmarks:
        if args.n is not None:
            args.samples[name] = args.n
            if protocol and name in protocol.samples and args.n != protocol.samples[name]:
                changed.append(f"n={args.n} on {name}")
        elif protocol:
            if name not in protocol.samples:
                parser.error(f"{name!r} is not a benchmark of --protocol {args.protocol}: pass --n for it")
            args.samples[name] = protocol.samples[name]
        else:
            args.samples[name] = DEFAULTS["n"]
    if protocol and args.limit is not None:
        changed.append(f"limit={args.limit}")
    args.protocol_report = (
        {"name": args.protocol, "description": protocol.description, "changed": changed} if protocol else None
    )
