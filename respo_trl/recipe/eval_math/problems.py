"""A benchmark's rows as problems and prompts: a name resolved to its data (a short name, a Hub id, a local file), the
columns found by their usual names, gold answers as strings, and the chat prompts.

Why apart from the backends: every input problem (a missing file, a broken JSONL line, an unknown column) is found
here, as a :class:`~respo_trl.recipe.arguments.RecipeError` in one line, before a model is loaded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ...builtin.task import ArithmeticTask
from ..arguments import RecipeError
from .protocols import BENCHMARKS, BenchmarkSpec

PROBLEM_COLUMNS = ("problem", "Problem", "question", "Question")
ANSWER_COLUMNS = ("answer", "Answer", "expected_answer", "final_answer")
ID_COLUMNS = ("unique_id", "id", "ID", "idx", "index")
LOCAL_SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


@dataclass
class Problem:
    uid: str
    problem: str
    answer: str


def resolve_benchmark(name: str) -> tuple[str, BenchmarkSpec]:
    """Short name, local file or ``owner/name[:config][@split]`` -> (label, spec)."""
    if name in BENCHMARKS:
        return name, BENCHMARKS[name]
    path = Path(name)
    if path.suffix in LOCAL_SUFFIXES:
        if not path.is_file():
            raise RecipeError(f"benchmark file {name!r} does not exist")
        return path.stem, BenchmarkSpec(str(path), "train")
    spec, _, split = name.partition("@")
    dataset, _, config = spec.partition(":")
    if dataset.count("/") != 1:
        raise RecipeError(
            f"unknown benchmark {name!r}: use one of {sorted(BENCHMARKS)}, a .jsonl/.json/.parquet file, or a Hub "
            "dataset id owner/name[:config][@split]"
        )
    return name, BenchmarkSpec(dataset, split or "test", config or None)


def pick_column(columns, wanted: str | None, candidates: tuple[str, ...], what: str, dataset: str) -> str | None:
    if wanted is not None:
        if wanted not in columns:
            raise RecipeError(f"{dataset}: column {wanted!r} not found (columns: {list(columns)})")
        return wanted
    for name in candidates:
        if name in columns:
            return name
    if what == "id":
        return None
    raise RecipeError(f"{dataset}: no {what} column among {list(columns)}; pass --{what}_column")


def answer_text(answer) -> str:
    """A gold answer as one string: integral floats as integers (AMC), a list of answers (OlympiadBench's
    ``final_answer``) joined by ", ", and enclosing ``$...$`` math delimiters removed (math-verify then reads the
    boxed answer as written)."""
    if isinstance(answer, (list, tuple)):
        return ", ".join(answer_text(a) for a in answer)
    if isinstance(answer, float) and answer.is_integer():
        answer = int(answer)
    text = str(answer).strip()
    if len(text) >= 2 and text.startswith("$") and text.endswith("$"):
        text = text.strip("$").strip()
    return text


def check_jsonl(path: str) -> None:
    """Every non-empty line of ``path`` must be one JSON object; the first that is not is named with its line."""
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise RecipeError(f"{path}, line {number}: not valid JSON ({error.msg}, column {error.colno})") from None
            if not isinstance(row, dict):
                raise RecipeError(f"{path}, line {number}: expected a JSON object per line, got {type(row).__name__}")


def load_problems(spec: BenchmarkSpec, problem_column=None, answer_column=None, limit=None) -> list[Problem]:
    """Load a benchmark into the common schema (``problem``, ``answer`` as strings, and an id). The spec's data source
    is a Hub dataset or a local ``.jsonl``/``.json``/``.parquet`` file (``--local_data``), read with the spec's columns
    unless ``problem_column``/``answer_column`` are given."""
    from datasets import load_dataset

    suffix = Path(spec.dataset).suffix
    if suffix in LOCAL_SUFFIXES and Path(spec.dataset).is_file():
        if suffix == ".jsonl":
            check_jsonl(spec.dataset)  # datasets would bury the cause in a long DatasetGenerationError
        data = load_dataset(LOCAL_SUFFIXES[suffix], data_files=spec.dataset, split="train")
    else:
        try:
            data = load_dataset(spec.dataset, spec.config, split=spec.split)
        except (ConnectionError, OSError, ValueError) as error:  # offline, misspelt or private: one line
            if Path(spec.dataset).suffix in LOCAL_SUFFIXES:
                raise RecipeError(f"benchmark file {spec.dataset!r} does not exist") from None
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise RecipeError(
                f"cannot load benchmark {spec.dataset!r} from the Hub ({first}); offline, pass a local copy "
                "(--local_data NAME=FILE, or the file itself in --benchmarks)"
            ) from None
    columns = data.column_names
    p_col = pick_column(columns, problem_column or spec.problem_column, PROBLEM_COLUMNS, "problem", spec.dataset)
    a_col = pick_column(columns, answer_column or spec.answer_column, ANSWER_COLUMNS, "answer", spec.dataset)
    id_col = pick_column(columns, None, ID_COLUMNS, "id", spec.dataset)
    if limit is not None:
        data = data.select(range(min(limit, len(data))))
    return [
        Problem(str(row[id_col]) if id_col else str(i), str(row[p_col]), answer_text(row[a_col]))
        for i, row in enumerate(data)
    ]


def write_builtin_heldout(path: str, settings: dict) -> None:
    """The built-in task's held-out split as the run measured it, as a MATH-500-schema JSONL file."""
    task = ArithmeticTask.from_settings(settings)
    task.write_jsonl(path, "test", settings.get("heldout_size") or 500, settings.get("task_seed") or 0)


def build_prompts(
    tokenizer, problems, system_prompt: str, prompt_template: str, chat_template_kwargs: dict
) -> list[str]:
    """Chat-formatted prompt texts (system prompt asking for ``\\boxed{}``, then the problem as the user turn)."""
    prompts = []
    for p in problems:
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        messages.append({"role": "user", "content": prompt_template.replace("{problem}", p.problem)})
        if tokenizer.chat_template is None:
            text = "\n\n".join(m["content"] for m in messages) + "\n\n"
        else:
            text = tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True, **chat_template_kwargs
            )
        prompts.append(text)
    return prompts
