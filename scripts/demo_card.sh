#!/usr/bin/env bash
# Reproduce model_cards/qwen3-tiny-respo-demo.md: train the embedded default, evaluate it, render its card.
# About 6-10 minutes on 2 CPU cores. Run from the repository root after `pip install -e .`.
#
#   bash scripts/demo_card.sh [OUTPUT_DIR]      # default outputs/qwen3-tiny-respo (the recipe's default)
set -euo pipefail
out="${1:-outputs/qwen3-tiny-respo}"

# 1. the main job: tiny Qwen3 built locally, warm start, ReSPO with 4x rollout reuse (seed 0); report.json + plots
accelerate launch recipes/qwen3_respo.py --output_dir "$out"
# 2. avg@8 / pass@k / maj@8 on the run's own held-out split, as it trained (report.json: no system prompt, 48 new
#    tokens, temperature 1), graded by math-verify as the reward is; nothing is downloaded
python recipes/eval_math.py --model "$out" --n 8
# 3. the card, with the evaluation table, the recipe's held-out accuracy and the training curves
python -m respo_trl.hub.card "$out" --model_name qwen3-tiny-respo-demo \
    --dataset_name "builtin:arithmetic" --out model_cards/qwen3-tiny-respo-demo.md
