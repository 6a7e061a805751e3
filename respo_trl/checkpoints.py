"""Which checkpoint a run can resume from: complete ones only, never one past ``max_steps``.

transformers writes ``trainer_state.json`` last into a checkpoint, so its presence marks a save that finished; a
checkpoint of ``ReSPOTrainer`` also holds one rollout-buffer file per process (:mod:`respo_trl.buffer`), and a
checkpoint missing some of them cannot serve the rest of its batch.
"""

from __future__ import annotations

import json
import os
import re

from .buffer import buffer_files, has_buffer_files

TRAINER_STATE = "trainer_state.json"  # transformers writes it last into a checkpoint: its presence marks completion
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def checkpoint_status(checkpoint_dir: str, num_processes: int) -> str | None:
    """``None`` if ``checkpoint_dir`` is a complete checkpoint to resume from, else why not (one line).

    Complete means: transformers' ``trainer_state.json`` (written last) is there, and either every one of the
    ``num_processes`` ranks saved its rollout buffer or none did (a checkpoint of plain ``GRPOTrainer``).
    """
    if not os.path.isfile(os.path.join(checkpoint_dir, TRAINER_STATE)):
        return f"incomplete checkpoint (no {TRAINER_STATE}: the save was interrupted)"
    if not has_buffer_files(checkpoint_dir):
        return None
    missing = [r for r in range(num_processes) if not all(os.path.isfile(p) for p in buffer_files(checkpoint_dir, r))]
    if missing:
        return (
            f"rollout buffer files of rank(s) {missing} are missing (saved with another number of processes, the save "
            f"was interrupted, or on a multi-node run output_dir is not on a filesystem every node shares: each rank "
            f"writes its own buffer file); this run has {num_processes} process(es)"
        )
    return None


def finished_at(checkpoint_dir: str, max_steps: int) -> str | None:
    """Why resuming from ``checkpoint_dir`` would train what it should not (one line), or ``None``.

    transformers checks the stop only after a step, so a run resumed from a checkpoint already at (or past)
    ``max_steps`` (a relaunched job, a benchmark started again) silently trains one update more than asked. Runs
    bounded by epochs (``max_steps <= 0``) are not checked: the step count they stop at is transformers' to compute
    (a fractional ``num_train_epochs`` over-runs the same way)."""
    if max_steps <= 0:
        return None
    path = os.path.join(checkpoint_dir, TRAINER_STATE)
    try:
        with open(path) as f:
            done = json.load(f)["global_step"]
    except (json.JSONDecodeError, KeyError, TypeError) as error:
        return f"{path} is not a trainer state ({type(error).__name__}: {error})"
    if done < max_steps:
        return None
    return (
        f"the checkpoint is at step {done}, already at or past max_steps {max_steps}: nothing to train (a larger "
        "max_steps trains on, though a decaying lr schedule then differs from one run to the new max_steps)"
    )


def last_complete_checkpoint(output_dir: str, num_processes: int) -> tuple[str | None, list[tuple[str, str]]]:
    """The newest complete ``checkpoint-N`` folder of ``output_dir`` (or None), and the newer ones skipped, with why."""
    if not os.path.isdir(output_dir):
        return None, []
    found = [(int(m.group(1)), name) for name in os.listdir(output_dir) if (m := _CHECKPOINT.match(name))]
    skipped = []
    for _, name in sorted(found, reverse=True):
        path = os.path.join(output_dir, name)
        if not os.path.isdir(path):
            continue
        problem = checkpoint_status(path, num_processes)
        if problem is None:
            return path, skipped
        skipped.append((path, problem))
    return None, skipped


def latest_complete_checkpoint(output_dir: str, num_processes: int, warn) -> str:
    """:func:`last_complete_checkpoint` for a resume that asked for "the latest": each newer checkpoint skipped is
    reported through ``warn`` (one line, why), and no complete one is an error naming ``output_dir``."""
    path, skipped = last_complete_checkpoint(output_dir, num_processes)
    for folder, problem in skipped:
        warn(f"Skipping {folder}: {problem}")
    if path is None:
        raise ValueError(f"No valid checkpoint found in output directory ({output_dir})")
    return path


def resume_target(resume_from_checkpoint, output_dir: str, num_processes: int, max_steps: int, warn):
    """What ``Trainer.train(resume_from_checkpoint=...)`` should resume from, complete checkpoints only: for ``True``
    the latest complete one (interrupted saves skipped with a warning); an explicit incomplete path, or one already
    at ``max_steps`` (transformers would train one update past it), is an error (one line). Anything else passes
    through unchanged."""
    if resume_from_checkpoint is True:
        resume_from_checkpoint = latest_complete_checkpoint(output_dir, num_processes, warn)
    if isinstance(resume_from_checkpoint, str) and os.path.isdir(resume_from_checkpoint):
        problem = checkpoint_status(resume_from_checkpoint, num_processes) or finished_at(resume_from_checkpoint, max_steps)
        if problem:
            raise ValueError(f"cannot resume from {resume_from_checkpoint}: {problem}")
    return resume_from_checkpoint
