"""The ESS refresh floor (``respo_min_ess``) measures what ReSPO weighs: the raw sequence weights W of the buffered
batch under the current policy, sampler correction included, over all processes."""

import pytest
import torch
from conftest import CPU_ARGS
from vllm_standin import use_fake_vllm

from respo_trl.builtin.tiny_model import tiny_qwen3
from respo_trl.rewards import crc_reward


def test_ess_floor_uses_raw_weights_with_the_sampler_correction(tokenizer, toy_dataset, tmp_path):
    from respo_trl import ReSPOConfig, ReSPOTrainer
    from respo_trl.kernels import fold_sampler_ratio, kish_ess, sequence_log_weight

    checks, policy = [], []

    class Checked(ReSPOTrainer):
        def _drift(self, batch):
            assert batch is self.rollouts.batch  # before a reuse pass: the whole stored batch
            with torch.no_grad():
                logps, _, _ = self._get_per_token_logps_and_entropies(
                    self.model,
                    torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1),
                    torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1),
                    batch["completion_ids"].size(1),
                )
            mask = batch["completion_mask"]
            log_c, kept = fold_sampler_ratio(batch["importance_sampling_ratio"], mask)
            with_sampler = kish_ess(sequence_log_weight(logps - batch["old_per_token_logps"], kept, log_c)).item()
            without = kish_ess(sequence_log_weight(logps - batch["old_per_token_logps"], mask)).item()
            signals = super()._drift(batch)
            checks.append((signals.ess, with_sampler, without))
            policy.append(signals.policy_ess)
            return signals

    args = ReSPOConfig(**{**CPU_ARGS, "output_dir": str(tmp_path), "max_steps": 2, "num_iterations": 2,
                          "use_vllm": True, "vllm_mode": "colocate", "vllm_importance_sampling_mode": "token_truncate",
                          "respo_min_ess": 0.999})  # fmt: skip
    with use_fake_vllm():
        trainer = Checked(model=tiny_qwen3(tokenizer), reward_funcs=crc_reward, args=args, train_dataset=toy_dataset,
                          processing_class=tokenizer)  # fmt: skip
        trainer.train()
    (measured, with_sampler, without), = checks  # one reuse pass in 2 steps at R = 2
    assert measured == pytest.approx(with_sampler, rel=1e-5)
    assert policy == [pytest.approx(without, rel=1e-5)]  # adaptive reuse's "ess": the policy's drift, no sampler gap
    assert abs(with_sampler - without) > 1e-3  # the sampler ratio matters here, so dropping it would be caught
    assert with_sampler < 0.999 and trainer.rollouts.refreshes == 1  # drifted after one step at lr 1e-2: refreshed
    logged = [h["reuse/ess_before_pass"] for h in trainer.state.log_history if "reuse/ess_before_pass" in h]
    assert logged == [pytest.approx(measured, rel=1e-5)]


def test_ess_floor_works_under_the_papers_n(make_trainer):
    """With each sample used once (respo_updates_per_rollout > 1, one epoch) the floor was a no-op in 0.2 (it only
    fired between epochs). Now a stale mini-batch below the floor is resampled: the run generates more than one
    rollout batch, the fresh batch serves the rest of the cycle with staleness 0, and reuse/pass reads 1."""
    trainer = make_trainer(respo_updates_per_rollout=4, max_steps=4, respo_min_ess=0.999, learning_rate=5e-2)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert trainer.rollouts.refreshes >= 1
    assert all(h["reuse/pass"] == 1 for h in logs)
    staleness = [h["reuse/staleness_mean"] for h in logs]
    assert staleness[0] == 0 and any(s == 0 for s in staleness[1:])  # a refreshed mini-batch is fresh again
    assert staleness != [0, 1, 2, 3]
    per_batch = logs[0]["reuse/generated_tokens"]  # the first rollout batch (4 mini-batches)
    assert logs[-1]["reuse/generated_tokens"] > per_batch  # each refresh samples a whole rollout batch
    assert "reuse/ess_before_pass" in logs[1]  # measured before every stale optimizer step


def test_ess_floor_under_n_with_a_low_floor_changes_nothing(make_trainer):
    trainer = make_trainer(respo_updates_per_rollout=4, max_steps=4, respo_min_ess=1e-6)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert trainer.rollouts.refreshes == 0
    assert [h["reuse/staleness_mean"] for h in logs] == [0, 1, 2, 3]


def test_a_refresh_between_epochs_serves_the_fresh_batch_as_its_first_pass(make_trainer):
    """After the floor replaces a stale batch at the start of pass 2 of 2, the fresh batch is on its own first pass:
    reuse/pass reads 1 and its rollouts are 0 steps stale (catches the refreshed batch served as a reuse pass)."""
    trainer = make_trainer(num_iterations=2, max_steps=4, respo_min_ess=0.999, learning_rate=5e-2)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert trainer.rollouts.refreshes == 2  # before step 2 and before step 4
    assert [h["reuse/pass"] for h in logs] == [1, 1, 1, 1]
    assert [h["reuse/staleness_mean"] for h in logs] == [0, 0, 0, 0]


def test_under_accumulation_the_floor_is_checked_once_per_optimizer_step_on_its_rows(make_trainer):
    """N = 2 updates of 2 accumulated micro-batches each: the floor looks before update 2 at exactly the two
    micro-batches that update trains on, never in the middle of an update."""
    from respo_trl import ReSPOTrainer

    seen = []

    class Watched(ReSPOTrainer):
        def _drift(self, batch):
            seen.append((self._step, {k: batch[k].clone() for k in ("prompt_ids", "advantages")}))
            return super()._drift(batch)

    trainer = make_trainer(trainer_cls=Watched, respo_updates_per_rollout=2, gradient_accumulation_steps=2,
                           per_device_train_batch_size=4, max_steps=2, respo_min_ess=1e-6)  # fmt: skip
    trainer.train()
    assert trainer.rollouts.refreshes == 0
    assert [step for step, _ in seen] == [2]  # micro-step 2 starts update 2; micro-steps 1 and 3 are mid-update
    for key in ("prompt_ids", "advantages"):  # 2-D and 1-D fields of both micro-batches
        rows = torch.cat([trainer.rollouts.micro_batch(0, k)[key] for k in (2, 3)])
        assert torch.equal(seen[0][1][key], rows), key


def test_after_a_refresh_the_floor_measures_the_fresh_batchs_own_pass(make_trainer):
    """N = 2 mini-batches per pass, R = 2 passes, every check refreshing: a check in the middle of pass 2, after the
    refresh at its start, measures the rows the fresh batch serves next (its own first pass), not a reshuffled pass."""
    from respo_trl import ReSPOTrainer

    checks = []

    class Watched(ReSPOTrainer):
        def _drift(self, batch):
            if batch is not self.rollouts.batch:  # a check inside a pass (the whole batch is checked between passes)
                cycle_pass, micro = divmod(self._step % 4, 2)
                served = self.rollouts.micro_batch(cycle_pass - self.rollouts.first_pass, micro)
                checks.append((self._step, torch.equal(batch["prompt_ids"], served["prompt_ids"])))
            return super()._drift(batch)

    trainer = make_trainer(trainer_cls=Watched, respo_updates_per_rollout=2, num_iterations=2, max_steps=4,
                           respo_min_ess=1.0, learning_rate=5e-2)  # fmt: skip
    trainer.train()
    assert [step for step, _ in checks] == [1, 3] and all(same for _, same in checks)
    assert trainer.rollouts.first_pass == 1  # the last refresh happened at the start of pass 2
