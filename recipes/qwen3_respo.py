"""Train Qwen3 with ReSPO (reshaped sequence policy optimisation) on verifiable math rewards, with rollout reuse.

What it does, top to bottom: parse a preset (``--preset NAME`` or a YAML ``--config``) plus command-line overrides
with TRL's ``TrlParser`` (once) into script arguments, a ``ReSPOConfig`` and a ``trl.ModelConfig``, and check everything that
can be checked before compute is spent; build the model (dense or MoE), tokenizer, datasets and rewards
(``trl.rewards.accuracy_reward``, graded by math-verify, plus a ``\\boxed{}`` format reward); warm-start a model built
here; measure held-out accuracy; train with ``ReSPOTrainer``; measure again; save, write ``report.json``, plots and the
model card into ``output_dir``, and push to the Hub with ``--push_to_hub``. Every TRL/transformers argument keeps its
usual meaning. The flow reads top to bottom in ``respo_trl/recipe/train.py`` (``main``, shaped like TRL's
``trl/scripts/grpo.py``); this file is what you launch, and its presets are ``respo_trl/recipe/presets/`` (package data: ``--preset NAME``).

With no arguments it runs the embedded default, ``--preset tiny-cpu``: on a CPU, with nothing downloaded, a tiny Qwen3
and a character tokenizer are built locally, warm-started by a short supervised fine-tune on a built-in multi-step
arithmetic task (``respo_trl.builtin.task``), then trained with ReSPO under 4x rollout reuse: about 5 minutes on 2 idle
CPU cores, greedy held-out accuracy 15-23% -> 89-97% over seeds 0-2 (final checkpoint; the numbers depend on the CPU
type, docs/recipes.md has them).

Launch lines (presets in respo_trl/recipe/presets/, launch configs in recipes/accelerate/, details in docs/recipes.md):

    # CPU, nothing downloaded (the embedded default); the same with overrides
    accelerate launch recipes/qwen3_respo.py
    python recipes/qwen3_respo.py --seed 1 --output_dir outputs/tiny-seed1

    # 1 GPU: Qwen3-0.6B, vLLM colocated
    accelerate launch --config_file recipes/accelerate/ddp.yaml --num_processes 1 recipes/qwen3_respo.py \\
        --preset qwen3-0.6b-epochs4

    # 8 GPUs on one node: Qwen3-4B with DeepSpeed ZeRO-2; Qwen3-8B with ZeRO-3 or FSDP2
    accelerate launch --config_file recipes/accelerate/zero2.yaml recipes/qwen3_respo.py --preset qwen3-4b-epochs4
    accelerate launch --config_file recipes/accelerate/zero3.yaml recipes/qwen3_respo.py --preset qwen3-8b-epochs4

    # multi-node, 2 x 8 GPUs: run on every node with its rank (output_dir on a filesystem all nodes share)
    accelerate launch --config_file recipes/accelerate/multinode_zero3.yaml \\
        --machine_rank $NODE_RANK --main_process_ip $MASTER_ADDR --main_process_port 29500 \\
        recipes/qwen3_respo.py --preset qwen3-30b-a3b-epochs4

    # resume an interrupted run (the rollout-reuse buffer is restored from the checkpoint)
    accelerate launch ... recipes/qwen3_respo.py --preset qwen3-4b-epochs4 --resume_from_checkpoint true

    # the ReSPO paper's runs (Base models, staleness N = 8/16/32, 1,024 updates) on 8 GPUs; a baseline is one flag
    accelerate launch --config_file recipes/accelerate/zero2.yaml recipes/qwen3_respo.py \\
        --preset paper-qwen3-1.7b-base --respo_updates_per_rollout 32                 # ReSPO, N = 32
    accelerate launch --config_file recipes/accelerate/zero2.yaml recipes/qwen3_respo.py \\
        --preset paper-qwen3-1.7b-base --respo_updates_per_rollout 32 --algorithm gspo   # or grpo, vespo
    accelerate launch --config_file recipes/accelerate/zero3.yaml recipes/qwen3_respo.py \\
        --preset paper-qwen3-30b-a3b-base --respo_updates_per_rollout 16

Bad input (an unknown flag, a preset value out of range, a missing model path or dataset column, nothing to resume)
ends with one line naming what to change and exit status 2, before any model loads; ``RESPO_TRACEBACK=1`` shows the
traceback. Ctrl-C says how to resume.
"""

from __future__ import annotations

import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from respo_trl.recipe import cli  # after the environment it reads

if __name__ == "__main__":
    cli()
