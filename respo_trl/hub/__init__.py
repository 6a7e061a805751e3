"""The Hub side of respo_trl: model cards from measured numbers (:mod:`.card`) and pushes that fail clearly (:mod:`.push`).

Nothing here is needed to train; the trainer calls into it when it saves or pushes.
"""
