"""Demo and task code for the embedded default run, the tests and the benchmarks (not part of the ReSPO method).

* :mod:`.tiny`: tiny Qwen3 dense/MoE models and a character tokenizer, built locally (no downloads).
* :mod:`.tasks`: the built-in verifiable task (multi-step arithmetic, disjoint train/test split).
* :mod:`.warmstart`: the supervised warm start and batched greedy/sampled generation with grading.
* :mod:`.rewards`: reward functions by name for the recipe (TRL's ``accuracy_reward`` and friends), a probe that fails
  clearly before compute is spent, and ``crc_reward``, the deterministic pseudo-reward of the tests and benchmarks.
* :mod:`.plots`: the recipe's plots.
"""
