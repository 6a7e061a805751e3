#!/usr/bin/env python3
"""Write DAPO-Math-17k as verl's RL parquet: the training data of the paper's runs (recipes/verl/train_*.sh).

verl's ``RLHFDataset`` and reward managers read one row per prompt with ``data_source`` (selects the scorer: verl's
``math_dapo`` checks a final ``Answer: ...`` line, then falls back to ``\\boxed{}``), ``prompt`` (a chat: a list of
``{"role", "content"}``), ``ability``, ``reward_model`` (``{"style": "rule", "ground_truth": answer}``) and
``extra_info`` (``{"split", "index"}``). This script converts any copy of DAPO-Math-17k that ``datasets`` can load (the
Hub's ``open-r1/DAPO-Math-17k-Processed``, the original ``BytedTsinghua-SIA/DAPO-Math-17k``, or a local
JSONL/JSON/parquet file) into that schema: it strips the original DAPO instruction wrapper when present, asks for a
``\\boxed{}`` answer, skips rows without a problem or an answer, and writes one parquet file.

Runs on the machine that launches training (CPU is enough; only the verl training itself needs GPUs):
    python recipes/verl/prepare_dapo_math.py --output ~/data/dapo-math-17k/train.parquet
    python recipes/verl/prepare_dapo_math.py --input my_copy.jsonl --output data/train.parquet   # offline
On N nodes, write the file once to storage every node can read (or copy it) and point TRAIN_FILE at it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DEFAULT_SOURCE = "open-r1/DAPO-Math-17k-Processed"
# The original DAPO-Math-17k wraps each problem in this instruction (its answer format is "Answer: ..."):
DAPO_PREFIX = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
)
DAPO_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'
INSTRUCTION = " Please reason step by step, and put your final answer within \\boxed{}."
LOCAL_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


def problem_text(value) -> str:
    """The problem as plain text: a string, or the user turn of a chat-formatted prompt."""
    if isinstance(value, list):
        value = next((m.get("content", "") for m in value if isinstance(m, dict) and m.get("role") == "user"), "")
    text = str(value or "")
    text = text.removeprefix(DAPO_PREFIX).removesuffix(DAPO_SUFFIX)
    return text.strip()


def answer_text(row: dict, answer_column: str) -> str:
    answer = row.get(answer_column)
    if answer in (None, "") and isinstance(row.get("reward_model"), dict):
        answer = row["reward_model"].get("ground_truth")
    return "" if answer is None else str(answer).strip()


def to_verl(row: dict, index: int, *, prompt_column: str, answer_column: str, data_source: str, split: str) -> dict:
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": problem_text(row.get(prompt_column)) + INSTRUCTION}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": answer_text(row, answer_column)},
        "extra_info": {"split": split, "index": index},
    }


def load(source: str, config: str | None, split: str):
    from datasets import load_dataset

    path = Path(source).expanduser()
    if path.exists():
        builder = LOCAL_FORMATS.get(path.suffix.lower())
        if builder is None:
            raise SystemExit(f"error: {path}: unknown file type (use one of {sorted(LOCAL_FORMATS)})")
        return load_dataset(builder, data_files=str(path), split="train")
    return load_dataset(source, config, split=split)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", default=DEFAULT_SOURCE, help="Hub dataset id or local .jsonl/.json/.parquet/.csv")
    parser.add_argument("--config", default=None, help="Hub dataset configuration (open-r1's copy: 'en' or 'all')")
    parser.add_argument("--split", default="train")
    parser.add_argument("--prompt-column", default="prompt")
    parser.add_argument("--answer-column", default="solution", help="falls back to reward_model.ground_truth")
    parser.add_argument("--data-source", default="math_dapo", help="verl scorer key written to every row")
    parser.add_argument("--output", type=Path, required=True, help="parquet file to write")
    parser.add_argument("--limit", type=int, default=None, help="keep only the first N rows (smoke tests)")
    args = parser.parse_args(argv)

    from datasets import Dataset

    source = load(args.input, args.config, args.split)
    if args.prompt_column not in source.column_names:
        raise SystemExit(f"error: {args.input} has no column {args.prompt_column!r} (columns: {source.column_names}); "
                         "pass --prompt-column")
    rows, skipped = [], 0
    for row in source:
        converted = to_verl(row, len(rows), prompt_column=args.prompt_column, answer_column=args.answer_column,
                            data_source=args.data_source, split=args.split)
        if converted["prompt"][0]["content"] == INSTRUCTION or not converted["reward_model"]["ground_truth"]:
            skipped += 1
            continue
        rows.append(converted)
        if args.limit is not None and len(rows) >= args.limit:
            break
    if not rows:
        raise SystemExit(f"error: no usable rows in {args.input} (need a problem and an answer per row)")
    args.output.expanduser().parent.mkdir(parents=True, exist_ok=True)
    Dataset.from_list(rows).to_parquet(str(args.output.expanduser()))
    print(json.dumps({"output": str(args.output), "rows": len(rows), "skipped": skipped}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
