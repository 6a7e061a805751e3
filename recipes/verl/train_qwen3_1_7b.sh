#!/usr/bin/env bash
# ReSPO on stock verl 0.9.1 + the respo_trl plugin: the paper's Qwen3-1.7B-Base run (FSDP, DAPO-Math-17k).
#
# What it does: launches `python -m verl.trainer.main_ppo` (verl's own entry point; no fork, no patched worker) with
# loss_mode=respo and the paper's setting: GRPO over 8 responses per prompt, staleness N (train_batch_size = N x 32
# prompts, ppo_epochs = 1, 1024/N steps = 1,024 policy updates), lr 1e-6 with 5% warm-up, weight decay 0.1, gradient
# clipping 1.0, no KL, responses up to 15,360 tokens, Ulysses sequence parallel 2, vLLM rollout (tensor parallel 2,
# async), DAPO reward manager.
#
# One node (8 GPUs, H100/H200 class, the paper's setting):
#   python recipes/verl/prepare_dapo_math.py --output ~/data/dapo-math-17k/train.parquet
#   bash recipes/verl/train_qwen3_1_7b.sh --N 32
# N nodes: start Ray first (head: `ray start --head`; others: `ray start --address=HEAD_IP:6379`), then on the head:
#   NNODES=4 GPUS_PER_NODE=8 bash recipes/verl/train_qwen3_1_7b.sh --N 16
# verl's async trainers: `--trainer one_step_off` or `--trainer fully_async` (rollout on ROLLOUT_GPUS_PER_NODE GPUs).
# Extra arguments are Hydra overrides, e.g. `+actor_rollout_ref.actor.policy_loss.respo_lambda_pos=1.0` or
# `trainer.logger=['console','wandb']`. `--dry-run` prints the command. Details: docs/verl.md.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
DEFAULT_MODEL="Qwen/Qwen3-1.7B-Base"
# shellcheck source=recipes/verl/common.sh
source "$here/common.sh"
respo_parse_args "$@"

MAX_RESPONSE_LENGTH=15360
EXPERIMENT="respo-qwen3-1.7b-base-dapo-N${N}$([ "$TRAINER" = sync ] || echo "-$TRAINER")"
respo_paper_overrides
respo_trainer_overrides

FSDP_OVERRIDES=(
  "actor_rollout_ref.actor.strategy=fsdp"
  "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4"
  "actor_rollout_ref.actor.fsdp_config.model_dtype=bfloat16"
  "actor_rollout_ref.actor.fsdp_config.param_offload=false"
  "actor_rollout_ref.actor.fsdp_config.optimizer_offload=false"
  "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"
  "actor_rollout_ref.actor.entropy_checkpointing=true"
  "actor_rollout_ref.ref.fsdp_config.param_offload=false"
  "actor_rollout_ref.ref.ulysses_sequence_parallel_size=2"
  "actor_rollout_ref.rollout.tensor_model_parallel_size=2"
  "actor_rollout_ref.rollout.gpu_memory_utilization=0.75"
)

CONFIG_NAME=()
[ "$TRAINER" = sync ] || CONFIG_NAME=("--config-name=$(respo_config_name ppo_trainer)")
respo_launch "${CONFIG_NAME[@]}" "${PAPER_OVERRIDES[@]}" "${FSDP_OVERRIDES[@]}" "${TRAINER_OVERRIDES[@]}" \
  "${RESPO_OVERRIDES[@]}" "${EXTRA_OVERRIDES[@]}"
