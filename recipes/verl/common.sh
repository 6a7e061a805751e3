# Shared by the ReSPO verl launchers (sourced, not run): argument parsing, the staleness arithmetic, the plugin check
# and the overrides that select ReSPO. See docs/verl.md.
#
# Paper's staleness N: one rollout batch of N x M prompts (x G responses) feeds N actor updates of M prompts each, every
# sample used once, 1,024 updates in total. In verl: data.train_batch_size = N x ppo_mini_batch_size, ppo_epochs = 1,
# trainer.total_training_steps = 1024 / N.

PAPER_UPDATES=1024      # policy updates per run, whatever N
MINI_BATCH_PROMPTS=32   # M
RESPONSES_PER_PROMPT=8  # G

respo_usage() {
  cat <<EOF
usage: $(basename "$0") [--N N] [--trainer T] [--model PATH] [--dry-run] [hydra overrides...]
  --N N         staleness / reuse ratio: a rollout batch of N x ${MINI_BATCH_PROMPTS} prompts feeds N actor updates.
                The paper ran 8, 16 and 32; any divisor of ${PAPER_UPDATES} works (1024/N trainer steps). Default 8.
  --trainer T   sync (default: verl.trainer.main_ppo), one_step_off (the next batch is generated while this one
                trains: every sample N updates older) or fully_async (rollout on its own GPUs, weights pushed every
                N updates); docs/verl.md. The async trainers take ROLLOUT_GPUS_PER_NODE (default half) for rollout.
  --model PATH  Hugging Face id or local path of the base model (default: ${DEFAULT_MODEL}).
  --dry-run     print the command (one argument per line) and exit, without data, GPUs or Ray.
  Environment:  NNODES (default 1), GPUS_PER_NODE (default 8), TRAIN_FILE (default \$DATA_DIR/train.parquet,
                DATA_DIR defaults to \$HOME/data/dapo-math-17k), CHECKPOINT_DIR, TRAINER_LOGGER (default ['console']),
                PYTHON_BIN (default python3).
EOF
}

respo_parse_args() {
  N=8
  TRAINER=sync
  MODEL="$DEFAULT_MODEL"
  DRY_RUN=0
  EXTRA_OVERRIDES=()
  while [ $# -gt 0 ]; do
    case "$1" in
      --N|-N) [ $# -ge 2 ] || { echo "error: --N needs a value" >&2; exit 2; }; N="$2"; shift 2 ;;
      --N=*) N="${1#--N=}"; shift ;;
      --model) [ $# -ge 2 ] || { echo "error: --model needs a value" >&2; exit 2; }; MODEL="$2"; shift 2 ;;
      --trainer) [ $# -ge 2 ] || { echo "error: --trainer needs a value" >&2; exit 2; }; TRAINER="$2"; shift 2 ;;
      --trainer=*) TRAINER="${1#--trainer=}"; shift ;;
      --dry-run) DRY_RUN=1; shift ;;
      -h|--help) respo_usage; exit 0 ;;
      --*) echo "error: unknown option $1 (hydra overrides have no leading dashes)" >&2; respo_usage >&2; exit 2 ;;
      *) EXTRA_OVERRIDES+=("$1"); shift ;;
    esac
  done
  if ! [[ "$N" =~ ^[0-9]+$ ]] || [ "$N" -lt 1 ] || [ $((PAPER_UPDATES % N)) -ne 0 ]; then
    echo "error: --N must be a positive divisor of ${PAPER_UPDATES} (the paper's runs: 8, 16, 32), got '$N':" \
         "the run makes ${PAPER_UPDATES} policy updates, ${PAPER_UPDATES}/N trainer steps of N updates each" >&2
    exit 2
  fi
  NNODES="${NNODES:-1}"
  GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
  if ! [[ "$NNODES" =~ ^[1-9][0-9]*$ && "$GPUS_PER_NODE" =~ ^[1-9][0-9]*$ ]]; then
    echo "error: NNODES and GPUS_PER_NODE must be positive integers (got '$NNODES', '$GPUS_PER_NODE')" >&2
    exit 2
  fi
  TRAIN_BATCH_SIZE=$((N * MINI_BATCH_PROMPTS))
  TOTAL_STEPS=$((PAPER_UPDATES / N))
  TRAIN_GPUS_PER_NODE="$GPUS_PER_NODE"
  case "$TRAINER" in
    sync) ENTRY_MODULE=verl.trainer.main_ppo ;;
    one_step_off) ENTRY_MODULE=verl.experimental.one_step_off_policy.main_ppo ;;
    fully_async) ENTRY_MODULE=verl.experimental.fully_async_policy.fully_async_main
                 TRAIN_BATCH_SIZE=0 ;;  # fully_async draws ppo_mini_batch_size prompts per update from its queue
    *) echo "error: --trainer must be sync, one_step_off or fully_async, got '$TRAINER'" >&2; exit 2 ;;
  esac
  if [ "$TRAINER" != sync ]; then
    ROLLOUT_GPUS_PER_NODE="${ROLLOUT_GPUS_PER_NODE:-$((GPUS_PER_NODE / 2))}"
    if ! [[ "$ROLLOUT_GPUS_PER_NODE" =~ ^[1-9][0-9]*$ ]] || [ "$ROLLOUT_GPUS_PER_NODE" -ge "$GPUS_PER_NODE" ]; then
      echo "error: ROLLOUT_GPUS_PER_NODE must be between 1 and GPUS_PER_NODE - 1 ($((GPUS_PER_NODE - 1))), got" \
           "'$ROLLOUT_GPUS_PER_NODE': --trainer $TRAINER puts rollout and training on separate GPUs" >&2
      exit 2
    fi
    TRAIN_GPUS_PER_NODE=$((GPUS_PER_NODE - ROLLOUT_GPUS_PER_NODE))
  fi
  TRAIN_FILE="${TRAIN_FILE:-${DATA_DIR:-$HOME/data/dapo-math-17k}/train.parquet}"
  PYTHON_BIN="${PYTHON_BIN:-python3}"
  TRAINER_LOGGER="${TRAINER_LOGGER:-['console']}"
}

# The plugin must be installed in the environment that runs verl (every Ray worker imports it through the
# verl.plugins entry point); checked without importing verl.
respo_check_plugin() {
  "$PYTHON_BIN" - <<'PY' || exit 2
import sys
from importlib.metadata import entry_points
if not any(ep.value == "respo_trl.integrations.verl" for ep in entry_points(group="verl.plugins")):
    sys.exit("error: respo_trl's verl plugin is not installed in this Python: pip install --no-deps -e /path/to/respo_trl "
             "(docs/verl.md)")
PY
  [ -f "$TRAIN_FILE" ] || { echo "error: training data not found: $TRAIN_FILE (run recipes/verl/prepare_dapo_math.py)" >&2; exit 2; }
}

# ReSPO itself: the loss, its typed config (constants default to the paper's), the layout of verl's sampler weights
# taken from algorithm.rollout_correction.rollout_is (null = no sampler correction), and the rollout correction itself,
# so that the actor workers know when bypass mode makes the rollout's log-probs pi_old (rejection sampling applies).
RESPO_OVERRIDES=(
  "actor_rollout_ref.actor.policy_loss.loss_mode=respo"
  "actor_rollout_ref.actor.policy_loss._target_=respo_trl.integrations.verl.ReSPOPolicyLossConfig"
  '+actor_rollout_ref.actor.policy_loss.respo_rollout_is=${algorithm.rollout_correction.rollout_is}'
  '+actor_rollout_ref.actor.policy_loss.rollout_correction=${algorithm.rollout_correction}'
  "actor_rollout_ref.actor.loss_agg_mode=token-mean"
)

# verl's async trainers (--trainer): rollout on ROLLOUT_GPUS_PER_NODE GPUs of each node, training on the rest, and the
# rollout's log-probs as pi_old (their default bypass mode; ReSPO's W is then pi_theta / pi_rollout). one_step_off
# keeps the sync batch arithmetic; fully_async pushes new weights to the rollout every N updates of M prompts.
respo_trainer_overrides() {
  TRAINER_OVERRIDES=()
  [ "$TRAINER" = sync ] && return 0
  TRAINER_OVERRIDES=(
    "hydra.searchpath=[pkg://verl.trainer.config]"  # one_step_off's own searchpath only resolves in a verl checkout
    "actor_rollout_ref.hybrid_engine=false"
    "actor_rollout_ref.rollout.calculate_log_probs=true"
    "rollout.nnodes=$NNODES"
    "rollout.n_gpus_per_node=$ROLLOUT_GPUS_PER_NODE"
  )
  if [ "$TRAINER" = fully_async ]; then
    TRAINER_OVERRIDES+=(
      "data.gen_batch_size=1"
      "rollout.total_rollout_steps=$((PAPER_UPDATES * MINI_BATCH_PROMPTS))"
      "async_training.require_batches=1"
      "async_training.trigger_parameter_sync_step=$N"
      "async_training.staleness_threshold=0"
    )
  fi
}

# The Hydra config of the chosen trainer for a sync config name (ppo_trainer, ppo_megatron_trainer).
respo_config_name() {
  case "$TRAINER" in
    sync) echo "$1" ;;
    one_step_off) echo "one_step_off_$1" ;;
    fully_async) echo "fully_async_$1" ;;
  esac
}

# The paper's optimisation setting, shared by both models: GRPO advantages over G=8 responses, staleness N, lr 1e-6 with
# 5% warm-up, weight decay 0.1, gradient clipping 1.0, no KL anywhere, no entropy bonus, temperature 1, top-p 1.
respo_paper_overrides() {
  PAPER_OVERRIDES=(
    "algorithm.adv_estimator=grpo"
    "algorithm.use_kl_in_reward=false"
    "algorithm.kl_ctrl.kl_coef=0.0"
    "data.train_files=$TRAIN_FILE"
    "data.val_files=$TRAIN_FILE"
    "data.prompt_key=prompt"
    "data.shuffle=true"
    "data.truncation=error"
    "data.filter_overlong_prompts=true"
    "data.return_raw_chat=true"
    "data.train_batch_size=$TRAIN_BATCH_SIZE"
    "data.max_prompt_length=1024"
    "data.max_response_length=$MAX_RESPONSE_LENGTH"
    "actor_rollout_ref.model.path=$MODEL"
    "actor_rollout_ref.model.use_remove_padding=true"
    "actor_rollout_ref.model.enable_gradient_checkpointing=true"
    "actor_rollout_ref.actor.ppo_mini_batch_size=$MINI_BATCH_PROMPTS"
    "actor_rollout_ref.actor.ppo_epochs=1"
    "actor_rollout_ref.actor.optim.lr=1e-6"
    "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.05"
    "actor_rollout_ref.actor.optim.weight_decay=0.1"
    "actor_rollout_ref.actor.optim.clip_grad=1.0"
    "actor_rollout_ref.actor.use_kl_loss=false"
    "actor_rollout_ref.actor.kl_loss_coef=0.0"
    "actor_rollout_ref.actor.entropy_coeff=0"
    "actor_rollout_ref.actor.use_dynamic_bsz=true"
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=$(( (1024 + MAX_RESPONSE_LENGTH) * 2 ))"
    "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=true"
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=$(( (1024 + MAX_RESPONSE_LENGTH) * 2 ))"
    "actor_rollout_ref.rollout.name=vllm"
    "actor_rollout_ref.rollout.mode=async"
    "actor_rollout_ref.rollout.n=$RESPONSES_PER_PROMPT"
    "actor_rollout_ref.rollout.temperature=1.0"
    "actor_rollout_ref.rollout.top_p=1.0"
    "actor_rollout_ref.rollout.top_k=-1"
    "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true"
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=$(( (1024 + MAX_RESPONSE_LENGTH) * 2 ))"
    "actor_rollout_ref.rollout.enable_chunked_prefill=true"
    "actor_rollout_ref.rollout.max_num_batched_tokens=$(( 1024 + MAX_RESPONSE_LENGTH ))"
    "reward.reward_manager.name=dapo"
    "+reward.reward_kwargs.max_resp_len=$MAX_RESPONSE_LENGTH"
    "trainer.logger=$TRAINER_LOGGER"
    "trainer.project_name=respo"
    "trainer.experiment_name=$EXPERIMENT"
    "trainer.nnodes=$NNODES"
    "trainer.n_gpus_per_node=$TRAIN_GPUS_PER_NODE"
    "trainer.val_before_train=false"
    "trainer.test_freq=-1"
    "trainer.save_freq=$(( TOTAL_STEPS / 4 > 0 ? TOTAL_STEPS / 4 : 1 ))"
    "trainer.total_epochs=100"
    "trainer.total_training_steps=$TOTAL_STEPS"
    "trainer.default_local_dir=${CHECKPOINT_DIR:-checkpoints/respo/$EXPERIMENT}"
    "trainer.resume_mode=auto"
  )
}

# Run (or, with --dry-run, print) python -m $ENTRY_MODULE (verl's entry point of the chosen trainer) with the arguments.
respo_launch() {
  local cmd=("$PYTHON_BIN" -m "$ENTRY_MODULE" "$@")
  if [ "$DRY_RUN" = 1 ]; then
    printf '%s\n' "${cmd[@]}"
    return 0
  fi
  respo_check_plugin
  echo "ReSPO on verl ($TRAINER trainer): $EXPERIMENT, N=$N (train_batch_size=$TRAIN_BATCH_SIZE prompts," \
       "$TOTAL_STEPS steps), $NNODES node(s) x $GPUS_PER_NODE GPUs" >&2
  export HYDRA_FULL_ERROR=1
  exec "${cmd[@]}"
}
