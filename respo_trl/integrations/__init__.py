"""Other frameworks: front ends of the ReSPO kernel for RL frameworks other than TRL, and what TRL runs with.

Each kernel front end is a thin adapter around the pure-torch kernel in :mod:`respo_trl.kernels` (one kernel, several
front ends); none of these modules holds math of its own. Importing this package imports nothing: each integration
is loaded explicitly (``import respo_trl.integrations.verl``) or by its framework's plugin mechanism, and needs that
framework installed.

* :mod:`respo_trl.integrations.verl`: ``loss_mode="respo"`` for verl (``docs/verl.md``).
* :mod:`respo_trl.integrations.vllm`: whether a colocated vLLM engine can take TRL's weight sync (imports nothing;
  ``ReSPOTrainer`` calls it, ``docs/vllm.md``).
* :mod:`respo_trl.integrations.gguf`: a llama.cpp GGUF file as a local transformers checkpoint (needs ``gguf``).
"""
