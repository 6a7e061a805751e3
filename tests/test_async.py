"""ReSPO in TRL's async trainer (respo_trl.async_trainer), with the in-process rollout worker (no server).

The loss is checked against a per-sequence closed form computed apart from the trainer: each packed sample's
log-probabilities from a plain causal forward of a copy of the current weights (no tree packing, no scatter, no
kernel module), ``W`` and ``phi`` written out. The baseline is checked against TRL's own ``AsyncGRPOTrainer`` on the
same rollouts: every metric TRL logs, and the trained parameters, equal.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from respo_trl.builtin.task import ArithmeticTask  # noqa: E402
from respo_trl.builtin.tiny_model import tiny_qwen3  # noqa: E402
from respo_trl.rewards import crc_reward  # noqa: E402
from tests.async_helpers import Spy, closed_form_check, phi_respo, phi_vespo  # noqa: E402

ASYNC_ARGS = dict(use_cpu=True, bf16=False, report_to="none", logging_steps=1, save_strategy="no",
                  per_device_train_batch_size=8, num_generations=4, max_completion_length=10, learning_rate=5e-2,
                  max_steps=4, seed=0, token_budget=0, disable_tqdm=True)  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tokenizer, tmp_path_factory):
    path = tmp_path_factory.mktemp("async-model")
    tiny_qwen3(tokenizer, seed=3).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def prompts():
    return ArithmeticTask(operators="+", max_operand=9).dataset("train", 32, seed=0).remove_columns("completion")


def make_trainer(model_dir, tokenizer, prompts, *, trainer_cls=None, lags=None, seed=0, **overrides):
    from respo_trl.async_config import AsyncReSPOConfig
    from respo_trl.async_rollouts import InProcessRollouts
    from respo_trl.async_trainer import AsyncReSPOTrainer

    trainer_cls = trainer_cls or AsyncReSPOTrainer
    config_cls = AsyncReSPOConfig if trainer_cls is AsyncReSPOTrainer else overrides.pop("config_cls")
    args = config_cls(output_dir=overrides.pop("output_dir", "/tmp/respo-async-test"), **{**ASYNC_ARGS, **overrides})
    worker = InProcessRollouts(model_dir, tokenizer, prompts, crc_reward, num_generations=args.num_generations,
                               max_tokens=args.max_completion_length, lag_probabilities=lags, seed=seed)  # fmt: skip
    trainer = trainer_cls(model_dir, crc_reward, args, train_dataset=prompts, processing_class=tokenizer,
                          rollout_worker=worker, weight_transfer=worker)  # fmt: skip
    return trainer, worker


@pytest.mark.parametrize("loss_type,phi", [("respo", phi_respo), ("vespo", phi_vespo)])
def test_loss_equals_the_per_sequence_closed_form(model_dir, tokenizer, prompts, loss_type, phi):
    trainer, _ = make_trainer(model_dir, tokenizer, prompts, loss_type=loss_type, lags={0: 0.4, 1: 0.3, 3: 0.3})
    spy = Spy(trainer)
    trainer.train()
    assert len(spy.losses) == 4
    moved = closed_form_check(spy, model_dir, phi)
    assert moved > 4  # the check ran where W is away from 1 (stale samples after real updates)


def test_baseline_reproduces_trls_async_trainer(model_dir, tokenizer, prompts):
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    from respo_trl.integrations import async_cpu

    async_cpu.prepare()
    histories, params = [], []
    for cls, extra in ((AsyncGRPOTrainer, {"config_cls": AsyncGRPOConfig}), (None, {"loss_type": "clip"})):
        trainer, _ = make_trainer(model_dir, tokenizer, prompts, trainer_cls=cls, lags={0: 0.5, 2: 0.5}, **extra)
        trainer.train()
        histories.append(trainer.state.log_history)
        params.append({k: v.clone() for k, v in trainer.model.state_dict().items()})
    trl_history, ours = histories
    for trl_log, our_log in zip(trl_history, ours, strict=True):
        for key, value in trl_log.items():
            if key.startswith("perf/") or key in ("train_runtime", "train_samples_per_second", "train_steps_per_second"):
                continue
            assert our_log[key] == value, key  # every metric TRL logs, with the same name and value
        assert {"staleness/at_use_mean", "offpolicy/log_weight/std"} <= set(our_log) or "train_loss" in our_log
    for name, value in params[0].items():
        assert torch.equal(value, params[1][name]), name


def test_samples_carry_their_version_and_dropped_tokens_are_counted(model_dir, tokenizer, prompts):
    trainer, worker = make_trainer(model_dir, tokenizer, prompts, lags={0: 0.5, 6: 0.5}, max_staleness=2, max_steps=8)
    spy = Spy(trainer)
    received, sampled_at = [], {}
    tap_get = trainer.rollout_queue.get

    def get(*args, **kwargs):
        sample = tap_get(*args, **kwargs)
        received.append((trainer.model_version - sample.model_version, int(sample.completion_mask.sum())))
        sampled_at[sample.group_id] = sample.model_version  # the version the worker stamped, read apart from the tap
        return sample

    trainer.rollout_queue.get = get
    trainer.train()
    logs = [log for log in trainer.state.log_history if "loss" in log]
    # the staleness logged for each step is its samples' version distance when the loss used them
    for log, (samples, _, _, version, _) in zip(logs, spy.losses):
        versions = [sampled_at[s["group_id"]] for s in samples]
        stale = [version - v for v in versions]
        assert log["staleness/at_use_mean"] == pytest.approx(sum(stale) / len(stale))
        assert log["staleness/at_use_max"] == max(stale)
    dropped = sum(tokens for staleness, tokens in received if staleness > 2)
    assert dropped > 0 and any(version - v > 0 for _, _, _, version, _ in spy.losses for v in sampled_at.values())
    assert sum(log.get("async/dropped_stale_tokens_total", 0.0) for log in logs) == dropped
    assert sum(log.get("async/received_tokens_total", 0.0) for log in logs) == sum(t for _, t in received)
    assert worker.generated_tokens >= sum(t for _, t in received)


def test_plain_async_config_is_upgraded_and_bad_input_refused(model_dir, tokenizer, prompts):
    from trl.experimental.async_grpo import AsyncGRPOConfig

    from respo_trl.async_config import AsyncReSPOConfig
    from respo_trl.async_trainer import _respo_args

    upgraded = _respo_args(AsyncGRPOConfig(output_dir="/tmp/x", use_cpu=True, bf16=False, max_staleness=7), "m")
    assert isinstance(upgraded, AsyncReSPOConfig) and upgraded.loss_type == "respo" and upgraded.max_staleness == 7
    with pytest.raises(ValueError, match="train with respo_trl.ReSPOTrainer"):
        AsyncReSPOConfig(output_dir="/tmp/x", use_cpu=True, bf16=False, loss_type="dapo")
    with pytest.raises(ValueError, match="respo_beta_pos must be a finite number in"):
        AsyncReSPOConfig(output_dir="/tmp/x", use_cpu=True, bf16=False, respo_beta_pos=1.5)
    with pytest.raises(TypeError, match="AsyncReSPOConfig or AsyncGRPOConfig"):
        _respo_args(object(), "m")


def test_cpu_tree_attention_matches_per_segment_attention():
    from respo_trl.integrations.async_cpu import varlen_attention_sdpa

    torch.manual_seed(0)
    heads, kv_heads, dim = 4, 2, 8
    # a trie of two samples sharing a 3-token prefix: segment 0 = tokens 0-2, segment 1 = 3-4, segment 2 = 5-6
    q = torch.randn(7, heads, dim)
    k, v = torch.randn(7, kv_heads, dim), torch.randn(7, kv_heads, dim)
    kv_index = torch.tensor([0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 2, 5, 6])
    cu_q, cu_k = torch.tensor([0, 3, 5, 7]), torch.tensor([0, 3, 8, 13])
    out = varlen_attention_sdpa(q, k.index_select(0, kv_index), v.index_select(0, kv_index), cu_q, cu_k, causal=True)
    for path in ([0, 1, 2, 3, 4], [0, 1, 2, 5, 6]):  # each sample alone, plain causal attention
        qs, ks, vs = q[path], k[path].repeat_interleave(2, 1), v[path].repeat_interleave(2, 1)
        scores = torch.einsum("qhd,khd->hqk", qs, ks) / math.sqrt(dim)
        scores = scores.masked_fill(~torch.ones(5, 5, dtype=torch.bool).tril(), -math.inf)
        expected = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vs)
        assert torch.allclose(out[path], expected, atol=1e-5)


def test_async_surface_refuses_a_moved_name(monkeypatch):
    from respo_trl import trl_surface

    trl_surface.check_async_surface.cache_clear()
    trainer_module, _ = trl_surface.async_modules()

    def compute_loss(self, model, inputs):
        pass

    monkeypatch.setattr(trainer_module.AsyncGRPOTrainer, "compute_loss", compute_loss)
    try:
        with pytest.raises(RuntimeError, match=r"AsyncGRPOTrainer\.compute_loss\(self, model, inputs, return_outputs"):
            trl_surface.check_async_surface()
    finally:
        trl_surface.check_async_surface.cache_clear()


def test_packed_scatter_keeps_order_and_gradient():
    from respo_trl.packed import unpack_terms

    log_probs = torch.tensor([-1.0, -2.0, -3.0, -4.0, -5.0], requires_grad=True)
    old = torch.tensor([-1.5, -2.5, -3.5, -4.5, -5.5])
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, -1.0])
    segment = torch.tensor([0, 0, 2, 2, 2])  # sample 1 has no trained token
    seqs = unpack_terms(log_probs, old, adv, segment, num_sequences=3)
    assert seqs.log_probs.tolist() == [[-1.0, -2.0, 0.0], [0.0, 0.0, 0.0], [-3.0, -4.0, -5.0]]
    assert seqs.mask.tolist() == [[1, 1, 0], [0, 0, 0], [1, 1, 1]]
    assert seqs.advantages.tolist() == [1.0, 0.0, -1.0]
    (seqs.log_probs * torch.arange(9.0).reshape(3, 3)).sum().backward()
    assert log_probs.grad.tolist() == [0.0, 1.0, 6.0, 7.0, 8.0]


def test_async_recipe_runs_the_builtin_default_and_refuses_bad_lags(tmp_path, capsys):
    """``recipes/qwen3_async_respo.py`` with no model: the built-in tiny model, warm-started, trained through the async
    trainer with in-process rollouts whose lags TRL's bound partly drops; report.json says what happened."""
    import json

    from respo_trl.recipe.arguments import RecipeError
    from respo_trl.recipe.async_train import main, parse, parse_lags

    script_args, training_args = parse(["--max_steps", "2", "--warmstart_steps", "2", "--heldout_size", "4",
                                        "--in_process_lags", "0:0.5,9:0.5", "--per_device_train_batch_size", "16",
                                        "--max_completion_length", "8", "--output_dir", str(tmp_path)])  # fmt: skip
    assert training_args.use_cpu and training_args.loss_type == "respo" and training_args.max_staleness == 4
    report = main(script_args, training_args)
    assert report["updates"] == 2 and report["heldout"]["n"] == 4
    assert json.loads((tmp_path / "report.json").read_text())["updates"] == 2
    assert 0 < report["received_tokens"] and 0 <= report["dropped_stale_tokens"] <= report["received_tokens"]
    with pytest.raises(RecipeError, match="lag:probability"):
        parse_lags("0-1")
    with pytest.raises(RecipeError, match="lags >= 0"):
        parse_lags("-1:1")


@pytest.mark.parametrize("loss_name", ["respo", "vespo"])
def test_packed_loss_equals_the_registered_loss_on_whole_sequences(loss_name):
    """The packed loss computes each sample's coefficient from its summed log-ratio and the loss on the flat terms;
    that must equal ``kernels``' registered loss on the same samples laid out as (S, T), value and gradient,
    including tokens whose log-ratio is beyond +-20 (VESPO clamps each token, ReSPO only the sum)."""
    from respo_trl.kernels import LossParams, get_policy_loss
    from respo_trl.packed import packed_policy_loss, unpack_terms

    torch.manual_seed(0)
    lengths = [3, 1, 5, 4]
    segment = torch.repeat_interleave(torch.arange(4), torch.tensor(lengths))
    old = -torch.rand(len(segment)) * 3
    logp = (old + 0.4 * torch.randn(len(segment))).requires_grad_(True)
    with torch.no_grad():
        logp[2] += 25.0  # a token far beyond the clamp, offset by another in the same sample (sum inside +-20)
        logp[0] -= 24.0
        logp[9] -= 30.0
    adv = torch.tensor([1.0, -0.5, 2.0, -1.5])[segment]
    packed = packed_policy_loss(logp, old, adv, segment, loss_name, LossParams(), normalizer=7.0).loss
    seqs = unpack_terms(logp, old, adv, segment)
    per_token = get_policy_loss(loss_name)((seqs.log_probs - seqs.old_log_probs) * seqs.mask, seqs.advantages,
                                           seqs.mask, LossParams())  # fmt: skip
    reference = (per_token * seqs.mask).sum() / 7.0
    assert packed.item() == pytest.approx(reference.item(), rel=1e-5, abs=1e-7)
    (g_packed,) = torch.autograd.grad(packed, logp)
    (g_reference,) = torch.autograd.grad(reference, logp)
    assert torch.allclose(g_packed, g_reference, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("case", ["sampler_gap", "policy_moved_between_syncs"])
def test_sampler_gap_alarm_fires_on_a_sampler_gap_only(model_dir, tokenizer, prompts, monkeypatch, case):
    """The alarm blames the sampler when fresh samples' log W spreads: it must fire when the sampler really differs
    (a sampler at another temperature) and stay quiet when the policy moved between syncs (weight_sync_steps > 1:
    a sample of the current version can be several updates old)."""
    from respo_trl import async_trainer
    from respo_trl.async_config import AsyncReSPOConfig
    from respo_trl.async_rollouts import InProcessRollouts
    from respo_trl.async_trainer import AsyncReSPOTrainer

    warnings = []
    monkeypatch.setattr(async_trainer.logger, "warning", lambda message, *a, **k: warnings.append(str(message)))
    gap = case == "sampler_gap"
    args = AsyncReSPOConfig(output_dir="/tmp/respo-async-alarm",
                            **{**ASYNC_ARGS, "weight_sync_steps": 1 if gap else 2, "max_steps": 4})  # fmt: skip
    worker = InProcessRollouts(model_dir, tokenizer, prompts, crc_reward, num_generations=args.num_generations,
                               max_tokens=args.max_completion_length, temperature=4.0 if gap else 1.0)  # fmt: skip
    trainer = AsyncReSPOTrainer(model_dir, crc_reward, args, train_dataset=prompts, processing_class=tokenizer,
                                rollout_worker=worker, weight_transfer=worker)  # fmt: skip
    trainer.train()
    fresh = [log["offpolicy/log_weight/std"] for log in trainer.state.log_history
             if log.get("staleness/at_use_max") == 0 and "offpolicy/log_weight/std" in log]  # fmt: skip
    assert max(fresh) > 0.5  # updates with every sample at staleness 0 whose log W spread past the alarm's line
    fired = any("sampler's log-probabilities" in w for w in warnings)
    assert fired == gap
