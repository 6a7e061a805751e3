"""Which model card a trainer writes when TRL asks for one (at every checkpoint save and push), without importing the
card code: the writer set on the trainer (``trainer.card_writer``; the recipe sets
:func:`respo_trl.hub.card.write_trainer_card`), else TRL's own card."""

from __future__ import annotations

import inspect


def write_model_card(trainer, trls_card, **card_args) -> None:
    """Write ``trainer``'s card: its ``card_writer`` on the main process, or ``trls_card(**card_args)`` (TRL's)."""
    # the writer as it was set, on the instance or on a subclass, never bound (a function set on a class would
    # otherwise receive the trainer twice)
    writer = inspect.getattr_static(trainer, "card_writer", None)
    writer = writer.__func__ if isinstance(writer, (staticmethod, classmethod)) else writer
    if writer is None:
        trls_card(**card_args)
    elif trainer.is_world_process_zero():
        writer(trainer, **card_args)
