"""verl 0.9.1's V1 trainers (``trainer.use_v1=true``, the default of ``python -m verl.trainer.main_ppo``) with
``loss_mode=respo``: ``trainer.v1.trainer_mode`` in ``sync``, ``colocate_async`` and ``separate_async``, each in
decoupled mode (``algorithm.rollout_correction.bypass_mode=false``, verl's default) and bypass mode.

The V1 trainers never call ``apply_bypass_mode``: their ``_compute_old_log_prob`` either copies the rollout's
log-probs into ``old_log_probs`` (bypass) or recomputes them with the trainer's weights (decoupled; ``separate_async``
restores the weights of the step's first mini-batch from a CPU snapshot for every later mini-batch). These tests
build verl's own trainer class from verl's own config (composed from the launcher's overrides) and run its own
``step`` -> ``_step_once`` -> ``_compute_old_log_prob`` / ``_compute_advantage`` / ``_update_actor`` code, with
three stand-ins for what needs GPUs and Ray: an in-memory TransferQueue (``tq.kv_batch_get`` / ``kv_batch_put``),
a replay buffer that hands out pre-built rollouts, and an actor worker group whose "model" is a table of per-token
log-probs per weight version (one version per optimizer update). The worker group's ``update_actor`` runs verl's
own actor loss (``verl.workers.utils.losses.ppo_loss``) with the ``ActorConfig`` the workers build from that config,
and records the gradient with respect to the current log-probs, so each test checks

(a) what ``old_log_probs`` is in that mode, (b) that ReSPO is the loss that ran, and (c) what ReSPO's ``W`` is
measured against, by comparing the gradient with ReSPO's closed form ``-phi(W) A / #tokens``.

What the stand-ins replace (vLLM generation, Ray, TransferQueue's storage, the FSDP update) is not tested here; the
FSDP update with ``ppo_loss`` is ``test_actor_update.py``.
"""

from __future__ import annotations

import functools
import math
import subprocess

import pytest
from _verl_helpers import ROOT, VERL_SKIP_REASON, respo_overrides

pytest.importorskip("verl", reason=VERL_SKIP_REASON)

import torch  # noqa: E402

N = 4  # updates per weight sync: the paper's staleness N (a divisor of 1,024, as the launcher requires)
M = 2  # prompts per update (ppo_mini_batch_size)
G = 2  # responses per prompt (rollout.n)
STEPS = 2  # trainer steps (weight syncs) run per test
MODES = ("sync", "colocate_async", "separate_async")


@functools.lru_cache(maxsize=None)
def launcher_overrides(*args):
    """The 1.7B launcher's Hydra overrides (``--dry-run``), as users run it."""
    result = subprocess.run(["bash", str(ROOT / "recipes/verl/train_qwen3_1_7b.sh"), *args, "--dry-run"],
                            capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin", "HOME": "/tmp"})
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[1:3] == ["-m", "verl.trainer.main_ppo"], lines[:3]  # --trainer sync is verl's main_ppo: V1 by default
    return tuple(lines[3:])


def v1_mode_overrides(mode, n_updates):
    """What docs/verl.md tells users to append to the launcher to run a V1 mode with staleness N."""
    if mode == "separate_async":  # rollout on GPUs of its own; weights pushed every parameter_sync_step updates
        return ["trainer.v1.trainer_mode=separate_async", f"trainer.v1.separate_async.parameter_sync_step={n_updates}",
                "trainer.n_gpus_per_node=4", "actor_rollout_ref.rollout.nnodes=1",
                "actor_rollout_ref.rollout.n_gpus_per_node=4",
                "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl"]
    return [f"trainer.v1.trainer_mode={mode}"]


def compose(overrides):
    import os

    import verl
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=os.path.join(os.path.dirname(verl.__file__), "trainer/config"),
                               version_base=None):
        return hydra_compose(config_name="ppo_trainer", overrides=list(overrides))


def small_overrides():
    """Shrink the launcher's run to N updates of M prompts x G responses per step (the arithmetic it uses)."""
    return [f"data.train_batch_size={N * M}", f"actor_rollout_ref.actor.ppo_mini_batch_size={M}",
            f"actor_rollout_ref.rollout.n={G}", "actor_rollout_ref.actor.use_dynamic_bsz=false",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2"]


def build_trainer(mode, *extra):
    """verl's own V1 trainer class built from the launcher's config plus the V1 mode overrides, resolved as
    ``TaskRunnerV1.run`` resolves it (no Ray, no workers: ``init()`` is not called)."""
    from omegaconf import OmegaConf
    from verl.trainer.ppo.v1 import get_trainer_cls

    config = compose([*launcher_overrides("--N", str(N)), *v1_mode_overrides(mode, N), *small_overrides(), *extra])
    assert config.trainer.use_v1 is True  # verl 0.9.1's default: main_ppo runs the V1 trainer
    OmegaConf.resolve(config)
    return get_trainer_cls(config.trainer.v1.trainer_mode)(config=config)


# --------------------------------------------------------------------------------------------------------------------
# Stand-ins for what needs GPUs and Ray


def metric_value(metric):
    """A number from verl's ``Metric`` wrapper (``ppo_loss`` wraps the loss's metrics) or a plain float."""
    return float(metric.aggregate() if hasattr(metric, "aggregate") else metric)


def _nested(rows):
    return torch.nested.as_nested_tensor(list(rows), layout=torch.jagged)


class FakeTransferQueue:
    """The part of TransferQueue's KV interface the trainer's own code calls: rows stored per key, variable-length
    fields returned as jagged nested tensors (as TransferQueue returns them), scalar fields stacked."""

    def __init__(self):
        self.rows: dict[str, dict[str, torch.Tensor]] = {}

    def kv_batch_put(self, keys, partition_id, fields=None, tags=None):
        from transfer_queue import KVBatchMeta

        if fields is not None:
            for name in fields.keys():
                value = fields[name]
                rows = value.unbind(0) if value.is_nested else list(value)
                for key, row in zip(keys, rows, strict=True):
                    self.rows.setdefault(key, {})[name] = row.detach().clone()
        return KVBatchMeta(partition_id=partition_id, keys=list(keys), tags=list(tags or [{} for _ in keys]))

    def kv_batch_get(self, keys, partition_id, select_fields=None):
        from tensordict import TensorDict

        names = select_fields or list(self.rows[keys[0]])
        out = {}
        for name in names:
            if name not in self.rows[keys[0]]:
                continue  # e.g. ref_log_prob, values: not produced in this run
            rows = [self.rows[key][name] for key in keys]
            out[name] = torch.stack(rows) if rows[0].dim() == 0 else _nested(rows)
        return TensorDict(out, batch_size=[len(keys)])

    def kv_clear(self, keys=None, partition_id=None):
        for key in keys or []:
            self.rows.pop(key, None)


class Policy:
    """The trainer's weights as a table: per-token log-probs of every response token under weight version ``v``
    (``v`` = updates made so far) are ``base + v * drift``; the rollout engine's are ``base + sampler`` (not equal
    to any trainer version: an older policy plus engine noise)."""

    def __init__(self, lengths, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.base = [-0.2 - torch.rand(n, generator=g) * 1.5 for n in lengths]
        self.drift = [torch.randn(n, generator=g) * 0.25 for n in lengths]
        self.sampler = [torch.randn(n, generator=g) * 0.3 for n in lengths]

    def logp(self, row, version):
        return self.base[row] + version * self.drift[row]

    def rollout_logp(self, row):
        return self.base[row] + self.sampler[row]


class FakeActorWorkerGroup:
    """verl's actor worker group, with the calls the V1 trainers make: ``compute_log_prob`` (writes full-sequence
    ``log_probs`` / ``entropy`` as the engine does), ``update_actor`` (one optimizer update per mini-batch, through
    verl's ``ppo_loss``), and ``DetachActorWorker``'s CPU snapshot API used by ``separate_async``."""

    def __init__(self, tq, policy, row_of, prompt_len, actor_config):
        self.tq, self.policy, self.row_of, self.prompt_len = tq, policy, row_of, prompt_len
        self.actor_config = actor_config
        self.version = 0
        self.snapshots: dict[int, int] = {}
        self.calls: list[tuple] = []
        self.updates: list[dict] = []

    def compute_log_prob(self, batch):
        self.calls.append(("compute_log_prob", self.version))
        for key in batch.keys:
            row = self.row_of[key]
            response = self.policy.logp(row, self.version)
            prompt = torch.zeros(self.prompt_len)  # position t of the output predicts token t + 1
            full = torch.cat([prompt[:-1], response, torch.zeros(1)])
            self.tq.rows[key]["log_probs"] = full
            self.tq.rows[key]["entropy"] = torch.ones_like(full)
        return batch

    def save_model_to_cpu(self, n):
        self.calls.append(("save", n, self.version))
        self.snapshots[n] = self.version

    def restore_model_from_cpu(self, n):
        self.calls.append(("restore", n, self.snapshots[n]))
        self.version = self.snapshots[n]

    def clear_cpu_model(self, n):
        self.snapshots.pop(n, None)

    def update_actor(self, batch):
        from verl.utils import tensordict_utils as tu
        from verl.workers.utils.losses import ppo_loss

        rows_per_update = batch.extra_info["mini_batch_size"]  # ppo_mini_batch_size x rollout.n
        assert batch.extra_info["epochs"] == 1 and len(batch.keys) % rows_per_update == 0
        phi_means = []
        for start in range(0, len(batch.keys), rows_per_update):
            keys = batch.keys[start:start + rows_per_update]
            fields = ["prompts", "responses", "response_mask", "old_log_probs", "advantages", "rollout_is_weights",
                      "rollout_log_probs"]
            data = self.tq.kv_batch_get(keys=keys, partition_id="train", select_fields=fields)
            current = [self.policy.logp(self.row_of[k], self.version).double().requires_grad_(True) for k in keys]
            full = torch.cat([torch.cat([torch.zeros(self.prompt_len - 1, dtype=torch.double), c,
                                         torch.zeros(1, dtype=torch.double)]) for c in current])
            n_tokens = int(data["response_mask"].values().sum())
            tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=n_tokens, global_batch_size=len(keys))
            loss, metrics = ppo_loss(self.actor_config, {"log_probs": full}, data)
            grads = torch.autograd.grad(loss, current)
            self.updates.append({
                "version": self.version, "keys": list(keys), "grads": [g.detach() for g in grads],
                "old": [self.tq.rows[k]["old_log_probs"].double() for k in keys],
                "advantages": [self.tq.rows[k]["advantages"].double() for k in keys],
                "is_weights": [self.tq.rows[k]["rollout_is_weights"].double()
                               if "rollout_is_weights" in self.tq.rows[k] else None for k in keys],
                "n_tokens": n_tokens, "metrics": metrics,
            })
            phi_means.append(metric_value(metrics["respo/phi_mean"]))
            self.version += 1  # one optimizer step per mini-batch (ppo_epochs=1)
        return {"metrics": {"mfu": [0.0], "respo/phi_mean": phi_means}}


class FakeReplayBuffer:
    """Hands out the pre-built rollouts in order, ``batch_size`` prompts (all their responses) at a time, and records
    the batch sizes the trainer asks for."""

    def __init__(self, prompt_keys):
        self.prompt_keys, self.requests = prompt_keys, []

    def sample(self, global_steps, partition_id, batch_size):
        from transfer_queue import KVBatchMeta

        self.requests.append(batch_size)
        prompts, self.prompt_keys = self.prompt_keys[:batch_size], self.prompt_keys[batch_size:]
        keys = [key for prompt in prompts for key in prompt]
        return KVBatchMeta(partition_id=partition_id, keys=keys, tags=[{"seq_len": 8} for _ in keys]), {}


class _Stub:
    def __init__(self, **attrs):
        self.__dict__.update(attrs)

    def __getattr__(self, name):  # checkpoint manager: sleep_replicas, abort_replicas, update_weights, ...
        return lambda *args, **kwargs: None


def run_v1(mode, monkeypatch, *extra, steps=STEPS):
    """Build verl's V1 trainer for ``mode`` and run ``steps`` of its own ``step()``; returns the trainer, the fake
    worker group (with every update's gradient) and the policy table."""
    import verl.trainer.ppo.v1.trainer_base as trainer_base
    from verl.utils.config import omega_conf_to_dataclass

    trainer = build_trainer(mode, *extra)
    actor_config = omega_conf_to_dataclass(trainer.config.actor_rollout_ref.actor)  # what each actor worker builds

    n_prompts = steps * N * M
    prompt_len = 3
    lengths = [2 + (i * 7) % 4 for i in range(n_prompts * G)]  # 2..5 response tokens
    tq = FakeTransferQueue()
    policy = Policy(lengths)
    row_of, prompt_keys = {}, []
    g = torch.Generator().manual_seed(1)
    for p in range(n_prompts):
        uid = f"{1000 + p}"
        keys = []
        for s in range(G):
            row = p * G + s
            key = f"{uid}_{s}_0"  # verl's {uid}_{session_id}_{index}
            row_of[key], n = row, lengths[row]
            reward = torch.zeros(n)
            reward[-1] = float(torch.rand(1, generator=g) > 0.5) + s * 0.5  # the two responses of a prompt differ
            tq.rows[key] = {"uid": torch.tensor(int(uid)), "prompts": torch.ones(prompt_len, dtype=torch.long),
                            "responses": torch.ones(n, dtype=torch.long),
                            "response_mask": torch.ones(n, dtype=torch.long),
                            "rm_scores": reward, "rollout_log_probs": policy.rollout_logp(row).float()}
            keys.append(key)
        prompt_keys.append(keys)

    wg = FakeActorWorkerGroup(tq, policy, row_of, prompt_len, actor_config)
    monkeypatch.setattr(trainer_base, "tq", tq)
    trainer.actor_rollout_wg = wg
    trainer.replay_buffer = FakeReplayBuffer(prompt_keys)
    trainer.reward_loop_manager = _Stub(reward_loop_worker_handles=["rule-based reward workers"])  # no colocated RM
    trainer.checkpoint_manager = _Stub()
    trainer.curr_step_profile = False
    trainer._step_sample_wait_seconds = 0.0
    trainer._step_wait_samples = 0
    monkeypatch.setattr(trainer, "prepare_step", lambda: {})  # submits prompts to the rollout (GPU workers)
    monkeypatch.setattr(trainer, "_balance_batch", lambda batch, metrics: batch)  # reorders rows across DP ranks
    for step in range(1, steps + 1):
        trainer.global_steps = step
        metrics = {}
        trainer.step(metrics, {})
        assert "actor/respo/phi_mean" in metrics  # ReSPO's own metric reached the trainer's log
    return trainer, wg, policy


def closed_form_phi(log_w, advantage):
    w = log_w.clamp(-20, 20).exp()
    if advantage >= 0:
        return (1 + w) / 2 * torch.exp(1 - w)
    return w.sqrt() * torch.exp(2 * (1 - w.sqrt()))


def check_gradients(wg, policy, reference):
    """(b) and (c): every update's gradient is ReSPO's, ``-phi(W) A / #tokens``, with ``log W`` the sum over the
    response of ``log pi_theta - log reference`` (+ the log of verl's sampler weight when it sent one, once)."""
    signs = set()
    for update in wg.updates:
        for key, grad, old, adv, is_w in zip(update["keys"], update["grads"], update["old"], update["advantages"],
                                            update["is_weights"], strict=True):
            row = wg.row_of[key]
            current = policy.logp(row, update["version"]).double()
            torch.testing.assert_close(old, reference(update, row).double())  # (a) for this update
            log_w = (current - old).sum()
            if is_w is not None:
                log_w = log_w + torch.log(is_w[0])  # sequence level: one weight, broadcast to every token
            phi = closed_form_phi(log_w, float(adv[0]))
            torch.testing.assert_close(grad, -phi * adv / update["n_tokens"], rtol=1e-6, atol=1e-10)
            signs.add(math.copysign(1.0, float(adv[0])))
    assert signs == {-1.0, 1.0}  # both of ReSPO's branches were exercised


# --------------------------------------------------------------------------------------------------------------------
# Tests


@pytest.mark.parametrize("mode", MODES)
def test_v1_decoupled_old_log_probs_are_the_trainers_weights_at_the_step_start(mode, monkeypatch):
    """verl's default (``bypass_mode=false``): ``old_log_probs`` are recomputed by the trainer with the weights it
    held when the step began (``separate_async``: restored from the CPU snapshot of the step's first mini-batch), so
    update ``k`` of a step sees ``W = pi_theta_k / pi_theta_0``: the paper's within-step staleness, not the rollout.
    Catches: W measured against the rollout or against the current weights (W = 1, ReSPO becomes plain REINFORCE),
    ReSPO replaced by another loss, the separate_async snapshot not restored."""
    trainer, wg, policy = run_v1(mode, monkeypatch)
    assert trainer.config.algorithm.rollout_correction.bypass_mode is False
    assert trainer.config.actor_rollout_ref.actor.policy_loss.loss_mode == "respo"
    assert type(wg.actor_config.policy_loss).__name__ == "ReSPOPolicyLossConfig"
    assert len(wg.updates) == STEPS * N

    # one weight sync every N updates: sync/colocate_async sample N x M prompts per step, separate_async M per update
    expected_requests = [N * M] * STEPS if mode != "separate_async" else [M] * (STEPS * N)
    assert trainer.replay_buffer.requests == expected_requests
    assert trainer.parameter_sync_step == (N if mode == "separate_async" else 1)
    if mode == "separate_async":  # restored snapshot 0 (the step's first weights) for mini-batches 1..N-1
        from verl.experimental.separation.engine_workers import DetachActorWorker  # the worker the fake stands in for

        assert all(hasattr(DetachActorWorker, name) for name in ("save_model_to_cpu", "restore_model_from_cpu"))
        restores = [c for c in wg.calls if c[0] == "restore" and c[1] == 0]
        assert [c[2] for c in restores] == [s * N for s in range(STEPS) for _ in range(N - 1)]

    def step_start(update, row):
        return policy.logp(row, update["version"] - update["version"] % N)

    check_gradients(wg, policy, step_start)
    versions = [u["version"] % N for u in wg.updates]
    assert versions == list(range(N)) * STEPS  # staleness k = 0..N-1 within each step, W = 1 only at k = 0
    phis = [metric_value(update["metrics"]["respo/phi_mean"]) for update in wg.updates]
    assert any(abs(p - 1.0) > 1e-3 for p in phis)  # ReSPO reweights the stale updates


@pytest.mark.parametrize("mode", MODES)
def test_v1_bypass_old_log_probs_are_the_rollouts(mode, monkeypatch):
    """``bypass_mode=true``: the V1 trainers copy ``rollout_log_probs`` into ``old_log_probs`` and never call
    ``apply_bypass_mode``, so ``loss_mode=respo`` is untouched and ``W = pi_theta / pi_rollout``: the ratio to the
    policy that sampled (the whole lag since sampling, engine precision included).
    Catches: old_log_probs recomputed, ReSPO swapped for verl's bypass loss, the trainer's forward pass run anyway."""
    trainer, wg, policy = run_v1(mode, monkeypatch, "algorithm.rollout_correction.bypass_mode=true")
    assert trainer.config.actor_rollout_ref.actor.policy_loss.loss_mode == "respo"
    assert wg.actor_config.policy_loss.rollout_correction["bypass_mode"] is True  # the launcher's interpolation
    assert not any(c[0] == "compute_log_prob" for c in wg.calls)  # no pi_old forward in bypass mode
    assert len(wg.updates) == STEPS * N
    check_gradients(wg, policy, lambda update, row: policy.rollout_logp(row).float())


@pytest.mark.parametrize("mode", ["colocate_async", "separate_async"])
def test_v1_decoupled_with_sampler_weights_measures_w_against_the_rollout(mode, monkeypatch):
    """Decoupled mode with ``algorithm.rollout_correction.rollout_is=sequence``: verl's ``_compute_advantage`` sends
    ``rollout_is_weights = min(pi_old / pi_rollout, 2)`` per response and ReSPO folds it into ``log W`` once, so
    ``W = pi_theta / pi_rollout`` up to verl's truncation. Catches: the weight ignored (W would stop at pi_old) or
    counted once per token (the launcher interpolates ``respo_rollout_is`` from ``rollout_is``)."""
    trainer, wg, policy = run_v1(mode, monkeypatch, "algorithm.rollout_correction.rollout_is=sequence")
    assert wg.actor_config.policy_loss.respo_rollout_is == "sequence"
    threshold = trainer.config.algorithm.rollout_correction.rollout_is_threshold
    seen = []
    for update in wg.updates:
        for key, is_w, old in zip(update["keys"], update["is_weights"], update["old"], strict=True):
            row = wg.row_of[key]
            assert is_w is not None
            expected = min(math.exp(float((old - policy.rollout_logp(row).float().double()).sum())), threshold)
            torch.testing.assert_close(is_w, torch.full_like(is_w, expected), rtol=1e-5, atol=1e-7)
            seen.append(expected)
    assert min(seen) < 1 < max(seen)  # both directions of the sampler gap occur
    check_gradients(wg, policy, lambda update, row: policy.logp(row, update["version"] - update["version"] % N))


def test_v1_bypass_rejection_sampling_reaches_respo_through_the_launchers_interpolation(monkeypatch):
    """The V1 trainers do not attach ``rollout_correction`` to the actor's policy-loss config (V0's
    ``apply_bypass_mode`` did); the launcher's ``+...policy_loss.rollout_correction=${algorithm.rollout_correction}``
    does, so ReSPO drops the tokens verl's rejection (``rollout_rs``) rejects. Catches: rejection ignored under V1."""
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask

    rs = ["algorithm.rollout_correction.bypass_mode=true", "algorithm.rollout_correction.rollout_rs=token_k1",
          "algorithm.rollout_correction.rollout_rs_threshold=0.7_1.4"]
    from verl.utils.config import omega_conf_to_dataclass

    # the premise: without the launcher's interpolation a worker's policy-loss config says decoupled (its default)
    plain = omega_conf_to_dataclass(compose(respo_overrides(*rs)).actor_rollout_ref.actor).policy_loss
    assert plain.rollout_correction.bypass_mode is False and plain.rollout_correction.rollout_rs is None

    trainer, wg, policy = run_v1("sync", monkeypatch, *rs, steps=1)
    assert wg.actor_config.policy_loss.rollout_correction["rollout_rs"] == "token_k1"
    rejected = kept = 0
    for update in wg.updates:
        for key, grad, old in zip(update["keys"], update["grads"], update["old"], strict=True):
            current = policy.logp(wg.row_of[key], update["version"]).double()
            _, keep, _ = compute_rollout_correction_and_rejection_mask(
                old_log_prob=current[None], rollout_log_prob=old[None],
                response_mask=torch.ones_like(old)[None].bool(),
                rollout_is=None, rollout_rs="token_k1", rollout_rs_threshold="0.7_1.4")
            keep = keep[0].bool()
            assert torch.all(grad[~keep] == 0) and torch.all(grad[keep] != 0)
            rejected, kept = rejected + int((~keep).sum()), kept + int(keep.sum())
    assert rejected > 0 and kept > 0


@pytest.mark.parametrize("mode", MODES)
def test_v1_modes_compose_from_the_launcher(mode):
    """The launcher plus the overrides docs/verl.md gives for each mode builds verl's trainer for that mode with the
    paper's arithmetic (N updates of 32 prompts per weight sync) and the replay buffer's default staleness bound."""
    from omegaconf import OmegaConf
    from verl.trainer.ppo.v1 import get_trainer_cls

    config = compose([*launcher_overrides("--N", "16"), *v1_mode_overrides(mode, 16)])
    OmegaConf.resolve(config)
    trainer = get_trainer_cls(config.trainer.v1.trainer_mode)(config=config)  # separate_async asserts its arithmetic
    assert type(trainer).__name__ == {"sync": "PPOTrainerSync", "colocate_async": "PPOTrainerColocateAsync",
                                      "separate_async": "PPOTrainerSeparateAsync"}[mode]
    assert config.data.train_batch_size == 16 * 32 and config.actor_rollout_ref.actor.ppo_mini_batch_size == 32
    updates_per_sync = trainer.parameter_sync_step * (config.data.train_batch_size // trainer.parameter_sync_step
                                                      // config.actor_rollout_ref.actor.ppo_mini_batch_size)
    assert updates_per_sync == 16
    assert trainer.replay_buffer.max_off_policy_threshold == 8  # verl's default: a sample spans at most 8 versions
    assert trainer.replay_buffer.max_off_policy_strategy == "drop"
    assert type(trainer.replay_buffer).__name__ == ("ReplayBuffer" if mode == "sync" else "ReplayBufferAsync")
