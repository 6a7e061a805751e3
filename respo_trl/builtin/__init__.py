"""What the recipe's default run is made of: the built-in task and the tiny model, both generated locally.

``accelerate launch recipes/qwen3_respo.py`` with no arguments (the ``tiny-cpu`` preset) trains
:func:`~respo_trl.builtin.tiny_model.tiny_qwen3` (a 0.8M-parameter Qwen3, with the character tokenizer of
:func:`~respo_trl.builtin.tiny_model.build_char_tokenizer`) on :class:`~respo_trl.builtin.task.ArithmeticTask`
(``--dataset_name builtin:arithmetic``), nothing downloaded. The tests and the CPU benchmarks run on the same two.
Neither is part of ReSPO: the trainer never imports this package; the recipe, the benchmarks and the tests do.

* :mod:`.task`: the built-in verifiable task (multi-step arithmetic; train/validation/test split by expression, by
  canonical form, or by canonical form stratified by answer) and its checks.
* :mod:`.tiny_model`: tiny Qwen3 dense/MoE models and the character tokenizer.
"""
