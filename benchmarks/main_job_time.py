"""Where the main job's time goes: the README's main job (the embedded default, or any recipe arguments) run in this
process with timers around the phases, written as JSON.

The README promises a wall time for ``accelerate launch recipes/qwen3_respo.py``; this says what that time is made of,
so a change that makes the job slower shows where. It runs ``respo_trl.recipe.train.cli`` unchanged, with wall-clock
timers added around TRL's methods (nothing else is changed: the run writes the same numbers as without them):

* ``training_steps``: TRL's ``training_step`` over the run (rollout generation included);
* ``generation_and_scoring``: TRL's ``_generate_and_score_completions`` (sampling, rewards, old log-probs);
* ``heldout_evaluation``: every held-out measurement (before RL, the curve's points, after RL, the best checkpoint);
* ``checkpoint_saves``: the trainer's checkpoint saves (weights, buffer, card);
* ``import``, ``main`` (the recipe's flow after imports) and ``total``, plus the run's own ``report.json`` phases.

One process, one torch thread, as ``accelerate launch`` runs it on a CPU::

    python -m benchmarks.main_job_time --out docs/benchmarks/main_job_time/main_job_time.json   # the embedded default
    python -m benchmarks.main_job_time --out /tmp/t.json -- --seed 1 --output_dir /tmp/s1  # recipe arguments after --

(docs/recipes.md, "Where the time goes", reads it.)
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import sys
import tempfile
import time
from pathlib import Path


def _timed(owner, name: str, key: str, totals: collections.Counter) -> None:
    original = getattr(owner, name)

    @functools.wraps(original)  # the seam checks TRL's signatures: keep them
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            totals[key] += time.perf_counter() - start

    setattr(owner, name, wrapper)


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    recipe_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="Where the JSON goes.")
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # as accelerate launch sets it for one CPU process
    totals: collections.Counter = collections.Counter()
    started = time.perf_counter()
    from trl import GRPOTrainer

    from respo_trl.recipe import heldout, train
    from respo_trl.trainer import ReSPOTrainer

    from benchmarks.common import code_commit, machine_info

    totals["import"] = time.perf_counter() - started
    _timed(GRPOTrainer, "training_step", "training_steps", totals)
    _timed(GRPOTrainer, "_generate_and_score_completions", "generation_and_scoring", totals)
    _timed(heldout.HeldoutEvaluator, "measure", "heldout_evaluation", totals)
    _timed(ReSPOTrainer, "_save_checkpoint", "checkpoint_saves", totals)
    _timed(train, "main", "main", totals)
    with tempfile.TemporaryDirectory() as scratch:
        if not any(a == "--output_dir" or a.startswith("--output_dir=") for a in recipe_args):
            recipe_args = [*recipe_args, "--output_dir", scratch]
        result = train.cli(recipe_args)
    totals["total"] = time.perf_counter() - started
    record = {
        "seconds": {key: round(value, 1) for key, value in totals.items()},
        "report_time_s": {key: round(value, 1) for key, value in result["time_s"].items()},
        "warm_start": result["warm_start"],
        "heldout": {key: result["heldout"][key] for key in ("before", "after")},
        "generated_tokens": result["training"]["generated_tokens"],
        "recipe_args": recipe_args,
        "commit": code_commit(),
        "machine": machine_info(),
        "command": "python -m benchmarks.main_job_time " + " ".join(argv),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record["seconds"], indent=1))
    return record


if __name__ == "__main__":
    main()
