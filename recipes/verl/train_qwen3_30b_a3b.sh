#!/usr/bin/env bash
# ReSPO on stock verl 0.9.1 + the respo_trl plugin: the paper's Qwen3-30B-A3B-Base run (Megatron, DAPO-Math-17k).
#
# What it does: launches `python -m verl.trainer.main_ppo --config-name ppo_megatron_trainer` (verl's own entry point;
# no fork, no patched worker) with loss_mode=respo and the paper's setting: GRPO over 8 responses per prompt, staleness
# N (train_batch_size = N x 32 prompts, ppo_epochs = 1, 1024/N steps = 1,024 policy updates), lr 1e-6 with 5% warm-up,
# weight decay 0.1, gradient clipping 1.0, no KL, responses up to 8,192 tokens with DAPO's soft overlong penalty (0 at
# 4,096 tokens falling linearly to -1 at 8,192), Megatron TP 2 / EP 8 / PP 1 / CP 1 with fused kernels, DeepEP (flex)
# token dispatch and full recompute, vLLM rollout (tensor parallel 4, async).
#
# One node (8 x H200 141 GB, the paper's setting; it does not fit 80 GB GPUs unchanged):
#   python recipes/verl/prepare_dapo_math.py --output ~/data/dapo-math-17k/train.parquet
#   bash recipes/verl/train_qwen3_30b_a3b.sh --N 32
# N nodes: start Ray first (head: `ray start --head`; others: `ray start --address=HEAD_IP:6379`), then on the head:
#   NNODES=2 GPUS_PER_NODE=8 bash recipes/verl/train_qwen3_30b_a3b.sh --N 16
# Extra arguments are Hydra overrides (e.g. `actor_rollout_ref.actor.megatron.expert_model_parallel_size=16`).
# `--dry-run` prints the command. Details: docs/verl.md.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
DEFAULT_MODEL="Qwen/Qwen3-30B-A3B-Base"
# shellcheck source=recipes/verl/common.sh
source "$here/common.sh"
respo_parse_args "$@"

MAX_RESPONSE_LENGTH=8192
EXPERIMENT="respo-qwen3-30b-a3b-base-dapo-N${N}$([ "$TRAINER" = sync ] || echo "-$TRAINER")"
respo_paper_overrides
respo_trainer_overrides

mcore="actor_rollout_ref.actor.megatron"
MEGATRON_OVERRIDES=(
  "actor_rollout_ref.model.use_fused_kernels=true"
  "$mcore.tensor_model_parallel_size=2"
  "$mcore.expert_model_parallel_size=8"
  "$mcore.expert_tensor_parallel_size=1"
  "$mcore.pipeline_model_parallel_size=1"
  "$mcore.context_parallel_size=1"
  "$mcore.param_offload=false"
  "$mcore.optimizer_offload=false"
  "$mcore.use_mbridge=true"
  "+$mcore.override_transformer_config.moe_router_dtype=fp32"
  "+$mcore.override_transformer_config.moe_permute_fusion=true"
  "+$mcore.override_transformer_config.moe_enable_deepep=true"
  "+$mcore.override_transformer_config.moe_token_dispatcher_type=flex"
  "+$mcore.override_transformer_config.recompute_method=uniform"
  "+$mcore.override_transformer_config.recompute_granularity=full"
  "+$mcore.override_transformer_config.recompute_num_layers=1"
  "+$mcore.override_transformer_config.apply_rope_fusion=true"
  "+$mcore.override_transformer_config.bias_activation_fusion=true"
  "+$mcore.override_transformer_config.gradient_accumulation_fusion=true"
  "actor_rollout_ref.ref.megatron.tensor_model_parallel_size=2"
  "actor_rollout_ref.ref.megatron.expert_model_parallel_size=8"
  "actor_rollout_ref.ref.megatron.expert_tensor_parallel_size=1"
  "actor_rollout_ref.ref.megatron.pipeline_model_parallel_size=1"
  "actor_rollout_ref.ref.megatron.param_offload=false"
  "actor_rollout_ref.rollout.tensor_model_parallel_size=4"
  "actor_rollout_ref.rollout.gpu_memory_utilization=0.85"
  "data.filter_overlong_prompts_workers=64"
  "+reward.reward_kwargs.overlong_buffer_cfg.enable=true"
  "+reward.reward_kwargs.overlong_buffer_cfg.len=4096"
  "+reward.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0"
  "+reward.reward_kwargs.overlong_buffer_cfg.log=false"
)

respo_launch "--config-name=$(respo_config_name ppo_megatron_trainer)" \
  "${PAPER_OVERRIDES[@]}" "${MEGATRON_OVERRIDES[@]}" "${TRAINER_OVERRIDES[@]}" "${RESPO_OVERRIDES[@]}" "${EXTRA_OVERRIDES[@]}"
