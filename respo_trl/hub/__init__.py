"""The Hub side of respo_trl: model cards from measured numbers (:mod:`.card`) and pushes that fail clearly (:mod:`.push`).

Nothing here is needed to train: the trainer writes TRL's own card unless a card writer is set on it
(``trainer.card_writer = write_trainer_card``, as the recipe does), and :func:`.push.push_to_hub` wraps its push.
"""
