#!/usr/bin/env bash
# Reproduce model_cards/qwen3-tiny-respo-demo.md: train the embedded default, evaluate it, render its card.
# About 6 minutes on 2 idle CPU cores. Run from the repository root after `pip install -e .`.
#
#   bash scripts/demo_card.sh [OUTPUT_DIR]      # default outputs/qwen3-tiny-respo (the recipe's default)
set -euo pipefail
out="${1:-outputs/qwen3-tiny-respo}"

# 1. the main job: tiny Qwen3 built locally, warm start, ReSPO with 4x rollout reuse (seed 0); report.json + plots
accelerate launch recipes/qwen3_respo.py --output_dir "$out"
# 2. the held-out split of the built-in task as an eval_math file (MATH-500 schema)
python -m respo_trl.demo.tasks --split test --n 500 --out "$out/arith_test.jsonl"
# 3. avg@8 / pass@k / maj@8 at the training temperature, graded by math-verify as the reward is
python recipes/eval_math.py --model "$out" --benchmarks "$out/arith_test.jsonl" --n 8 --temperature 1.0 --top_p 1.0 \
    --system_prompt '' --max_new_tokens 48 --backend transformers --output_dir "$out"
# 4. the card, with the evaluation table, the recipe's held-out accuracy and the training curves
python -m respo_trl.hub.card "$out" --model_name qwen3-tiny-respo-demo --hub_model_id "$out" \
    --dataset_name "built-in arithmetic task (respo_trl.demo.tasks)" --out model_cards/qwen3-tiny-respo-demo.md
