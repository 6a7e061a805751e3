"""How the recipe (training, and the benchmark evaluation of :mod:`.eval_math`) ends when it cannot go on: one line
that says what to change, and no half-written output.

A user who mistypes a flag, points at a model directory that does not exist or presses Ctrl-C wants the reason and
the next command, not 20-140 lines of traceback (doubled by ``accelerate launch``). Problems with the input are
:class:`~respo_trl.recipe.arguments.RecipeError` (and, while parsing, the ``ValueError`` of a config field TRL or ReSPO
rejects); anything else is a bug and keeps its traceback. ``RESPO_TRACEBACK=1`` shows the traceback in every case.
"""

from __future__ import annotations

import os
import shutil
import sys
from contextlib import contextmanager

from ..checkpoints import last_complete_checkpoint
from .arguments import RecipeError

EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130  # the shell's code for a process ended by SIGINT


class Interrupted(Exception):
    """Ctrl-C during training, with where the run stands and how to resume it."""

    def __init__(self, trainer):
        output_dir = trainer.args.output_dir
        path, _ = last_complete_checkpoint(output_dir, trainer.accelerator.num_processes)
        where = f"interrupted at step {trainer.state.global_step} of {trainer.state.max_steps}"
        if path is not None:
            message = (f"{where}; the last complete checkpoint is {path}: resume with --resume_from_checkpoint true "
                       f"(and the same --output_dir {output_dir})")  # fmt: skip
        else:
            message = f"{where}; no checkpoint was saved yet (every --save_steps {trainer.args.save_steps} steps)"
        super().__init__(message)
        self.has_checkpoint = path is not None


def _fail(message: str, code: int) -> None:
    first = str(message).strip().splitlines()[0] if str(message).strip() else "failed"
    print(f"error: {first}", file=sys.stderr, flush=True)
    raise SystemExit(code)


@contextmanager
def one_line_errors(
    parsing: bool = False, output_dir: str | None = None, interrupted: str = "interrupted before training started"
):
    """Turn input problems into one ``error: ...`` line on stderr and a non-zero exit: :data:`EXIT_BAD_INPUT` for a
    :class:`RecipeError`, :data:`EXIT_INTERRUPTED` for Ctrl-C. The training recipe and the benchmark evaluation
    (:mod:`respo_trl.recipe.eval_math`) both end through it.

    ``parsing``: also a ``ValueError``/``TypeError`` (a field TRL or ReSPO rejects: no model is loaded yet).
    ``output_dir``: a directory this run is about to create; removed on failure if no checkpoint made it worth
    keeping (so a failed start leaves nothing half-written behind). ``interrupted``: the line for a Ctrl-C outside
    training (inside it, :class:`Interrupted` says where the run stands).
    """
    existed = output_dir is not None and os.path.exists(output_dir)
    handled = (RecipeError, ValueError, TypeError) if parsing else (RecipeError,)
    try:
        yield
    except (*handled, Interrupted, KeyboardInterrupt) as error:
        if output_dir is not None and not existed and os.path.isdir(output_dir):
            path, _ = last_complete_checkpoint(output_dir, 1)
            if path is None and not any(name.startswith("checkpoint-") for name in os.listdir(output_dir)):
                shutil.rmtree(output_dir, ignore_errors=True)
        if os.environ.get("RESPO_TRACEBACK", "0") not in ("0", "", "false"):
            raise
        if isinstance(error, KeyboardInterrupt):
            _fail(interrupted, EXIT_INTERRUPTED)
        _fail(str(error), EXIT_INTERRUPTED if isinstance(error, Interrupted) else EXIT_BAD_INPUT)
