"""One real verl actor update with ``loss_mode=respo`` on CPU, checked against ReSPO's closed forms.

Run by ``test_actor_update.py`` in a fresh process (it initialises torch.distributed and selects verl's platform
before verl first asks for one). Steps:

1. build a tiny randomly initialised Qwen3 locally (``transformers.Qwen3Config``) and save it;
2. compose verl 0.9.1's own ``ppo_trainer`` config with Hydra overrides the way ``python -m verl.trainer.main_ppo``
   would (``loss_mode=respo``, our ``ReSPOPolicyLossConfig`` as ``_target_``, the ``rollout_is`` layout interpolated
   from ``algorithm.rollout_correction.rollout_is=sequence``), and run verl's ``validate_config`` on it;
3. build verl's FSDP2 training engine (``EngineRegistry.new``, world size 1 over gloo) and call its ``train_batch``
   with verl's actor loss (``verl.workers.utils.losses.ppo_loss``), i.e. what ``ActorRolloutRefWorker.update_actor``
   runs per mini-batch: two micro-batches, global token count, optimizer step;
4. recompute the expected SGD step from a plain Hugging Face copy of the model, the closed forms
   ``phi+(W) = (1+W)/2 e^(1-W)``, ``phi-(W) = sqrt(W) e^(2(1-sqrt W))``, and ``log W = sum_t (logp - old) + log r``
   with the sequence-level sampler weight ``r`` (verl's own ``compute_rollout_correction_weights``) counted once.

Prints one JSON line: the largest deviation of the engine's parameter step from the expected one, the largest
expected step, verl's aggregated metrics and the time taken.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

os.environ.setdefault("VERL_PLATFORM", "cpu")
os.environ.setdefault("RANK", "0")
os.environ.setdefault("LOCAL_RANK", "0")
os.environ.setdefault("WORLD_SIZE", "1")
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29531")

import torch  # noqa: E402

# run by path in a fresh process: main() imports _cpu_platform from this folder, which -P/PYTHONSAFEPATH would drop
sys.path.insert(0, str(Path(__file__).resolve().parent))

LR = 0.1
VOCAB = 64


def main() -> None:
    t0 = time.time()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    from transformers import Qwen3Config, Qwen3ForCausalLM

    model_dir = tempfile.mkdtemp(prefix="respo-verl-qwen3-")
    hf_config = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
                            tie_word_embeddings=False)
    Qwen3ForCausalLM(hf_config).save_pretrained(model_dir)

    import _cpu_platform
    import torch.distributed as dist
    import verl
    from hydra import compose, initialize_config_dir
    from tensordict import TensorDict
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_weights
    from verl.utils import tensordict_utils as tu
    from verl.utils.config import omega_conf_to_dataclass, validate_config
    from verl.workers.engine import EngineRegistry
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import left_right_2_no_padding

    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer/config")
    overrides = [
        f"actor_rollout_ref.model.path={model_dir}",
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        "actor_rollout_ref.model.use_remove_padding=false",
        "actor_rollout_ref.model.enable_gradient_checkpointing=false",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.strategy=fsdp2",
        "actor_rollout_ref.actor.use_torch_compile=false",
        "actor_rollout_ref.actor.fsdp_config.model_dtype=float32",
        "+actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=fp32",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.actor.optim.optimizer=SGD",  # the step is then exactly -lr * grad
        "actor_rollout_ref.actor.optim.weight_decay=0",
        f"actor_rollout_ref.actor.optim.lr={LR}",
        "actor_rollout_ref.actor.optim.clip_grad=1e9",
        "actor_rollout_ref.actor.policy_loss.loss_mode=respo",
        "actor_rollout_ref.actor.policy_loss._target_=respo_trl.integrations.verl.ReSPOPolicyLossConfig",
        "+actor_rollout_ref.actor.policy_loss.respo_rollout_is=${algorithm.rollout_correction.rollout_is}",
        "algorithm.rollout_correction.rollout_is=sequence",
        "data.train_batch_size=2",
        "trainer.n_gpus_per_node=1",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
    ]
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        config = compose(config_name="ppo_trainer", overrides=overrides)
    validate_config(config, use_reference_policy=False, use_critic=False)  # what main_ppo runs before Ray starts
    actor_config = omega_conf_to_dataclass(config.actor_rollout_ref.actor)
    model_config = omega_conf_to_dataclass(config.actor_rollout_ref.model)
    model_config.model_type = "language_model"

    dist.init_process_group("gloo", rank=0, world_size=1)
    _cpu_platform.register_cpu_fsdp_engine()
    engine_config = actor_config.engine
    engine_config.use_dynamic_bsz = False
    engine_config.micro_batch_size_per_gpu = 2
    engine_config.max_token_len_per_gpu = 1024
    engine_config.use_remove_padding = False
    engine = EngineRegistry.new(model_type="language_model", backend=engine_config.strategy, model_config=model_config,
                                engine_config=engine_config, optimizer_config=actor_config.optim,
                                checkpoint_config=actor_config.checkpoint)
    engine.initialize()

    # A rollout batch: 4 responses, left-padded prompts, right-padded responses of different lengths.
    B, P, R = 4, 4, 6
    g = torch.Generator().manual_seed(1)
    prompt_len, resp_len = [4, 3, 4, 2], [6, 4, 5, 3]
    input_ids = torch.zeros(B, P + R, dtype=torch.long)
    attention_mask = torch.zeros(B, P + R, dtype=torch.long)
    for i in range(B):
        input_ids[i, P - prompt_len[i]:P] = torch.randint(1, VOCAB, (prompt_len[i],), generator=g)
        input_ids[i, P:P + resp_len[i]] = torch.randint(1, VOCAB, (resp_len[i],), generator=g)
        attention_mask[i, P - prompt_len[i]:P + resp_len[i]] = 1
    position_ids = (attention_mask.cumsum(-1) - 1).clamp_min(0)
    response_mask = attention_mask[:, P:].clone()
    m = response_mask.float()

    reference = Qwen3ForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa", dtype=torch.float32)
    logits = reference(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    logp = torch.log_softmax(logits.float(), -1)[:, P - 1:-1].gather(-1, input_ids[:, P:, None]).squeeze(-1)

    # old_log_probs chosen so that log(pi_theta / pi_old) per response is these values: both tails, both signs.
    train_log_ratio = torch.tensor([-3.0, 0.5, -0.4, 2.0])
    advantage = torch.tensor([1.0, 1.0, -1.0, -1.0])
    old_log_probs = (logp.detach() - (train_log_ratio / m.sum(-1))[:, None]) * m
    # Rollout-engine log-probs differ from pi_old: verl turns them into a sequence-level, truncated (at 2) weight.
    rollout_log_ratio = torch.tensor([0.3, -0.8, 0.25, 1.5])  # log(pi_old / pi_rollout) per response
    rollout_log_probs = (old_log_probs - (rollout_log_ratio / m.sum(-1))[:, None]) * m
    rollout_is_weights, _ = compute_rollout_correction_weights(
        log_ratio=old_log_probs - rollout_log_probs, response_mask=response_mask, rollout_is="sequence",
        rollout_is_threshold=2.0)

    batch = TensorDict({
        "input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
        "prompts": input_ids[:, :P], "responses": input_ids[:, P:], "response_mask": response_mask,
        "old_log_probs": old_log_probs, "advantages": advantage[:, None] * m, "rollout_is_weights": rollout_is_weights,
    }, batch_size=[B])
    batch = left_right_2_no_padding(batch)
    tu.assign_non_tensor(batch, calculate_entropy=False, global_batch_size=B, temperature=1.0, compute_loss=True,
                         use_remove_padding=False, use_dynamic_bsz=False, micro_batch_size_per_gpu=2,
                         max_token_len_per_gpu=1024, use_fused_kernels=False, distillation_use_topk=False,
                         distillation_only=False)

    def full(p):
        return (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()

    before = {name: full(p) for name, p in engine.module.named_parameters()}
    with engine.train_mode():
        output = engine.train_batch(batch, loss_function=partial(ppo_loss, config=actor_config))
    after = {name: full(p) for name, p in engine.module.named_parameters()}

    # Expected: closed forms, sampler weight folded once (truncated at 2 as verl did), token-mean over all tokens.
    log_w = (train_log_ratio + torch.log(torch.exp(rollout_log_ratio).clamp(max=2.0))).clamp(-20, 20)
    w = log_w.exp()
    phi = torch.where(advantage >= 0, (1 + w) / 2 * torch.exp(1 - w), w.sqrt() * torch.exp(2 * (1 - w.sqrt())))
    loss = -(phi[:, None] * advantage[:, None] * logp * m).sum() / m.sum()
    loss.backward()

    max_err = max_step = 0.0
    for name, p in reference.named_parameters():
        expected = -LR * p.grad
        max_err = max(max_err, (after[name] - before[name] - expected).abs().max().item())
        max_step = max(max_step, expected.abs().max().item())

    metrics = {k: (v.aggregate() if hasattr(v, "aggregate") else v) for k, v in output["metrics"].items()}
    metrics = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) or hasattr(v, "__float__")}
    print(json.dumps({
        "max_abs_err": max_err, "max_abs_step": max_step, "expected_loss": loss.item(),
        "expected_phi": phi.tolist(), "policy_loss_config": type(actor_config.policy_loss).__name__,
        "respo_rollout_is": actor_config.policy_loss.respo_rollout_is, "metrics": metrics,
        "seconds": time.time() - t0,
    }))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
