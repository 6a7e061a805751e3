"""Demo and task code for the embedded default run, the tests and the benchmarks (not part of the ReSPO method).

* :mod:`.tiny`: tiny Qwen3 dense/MoE models and a character tokenizer, built locally (no downloads).
* :mod:`.tasks`: the built-in verifiable task (multi-step arithmetic, disjoint train/test split).
* :mod:`.warmstart`: the supervised warm start and batched greedy/sampled generation (graded by
  :mod:`respo_trl.grading`).

The recipe's rewards are :mod:`respo_trl.rewards`, its grading :mod:`respo_trl.grading`, its plots
:mod:`respo_trl.recipe.plots`.
"""
