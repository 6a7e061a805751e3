"""Every configuration TRL trains, the drop-in trains: a seeded sample of plain ``GRPOConfig``s, each trained for two
optimizer steps by ``trl.GRPOTrainer`` and then by ``ReSPOTrainer`` (which upgrades it to ReSPO). Wherever TRL's own
trainer ends with finite losses, ReSPO must build, log its one-line notes (each rendering) and train with finite
losses; its logs must serialise.

The space is TRL 1.16's loss-side settings; a case is one draw from it (``random.Random(SEED)``), plus the
configurations a user reported crashing. 0.3 only built the sequence-level (GSPO) case with explicit epsilons, and
``respo_notes`` formatted TRL's default ``epsilon_high=None`` with ``:g``.
"""

from __future__ import annotations

import json
import logging
import math
import random

import pytest
import torch
from conftest import CPU_ARGS
from vllm_standin import use_fake_vllm

from respo_trl.builtin.tiny_model import tiny_qwen3
from respo_trl.rewards import crc_reward

DEFAULT = object()  # leave the field to TRL's default
SPACE = {
    "loss_type": ["grpo", "dapo", "bnpo", "dr_grpo", "cispo", "sapo", "luspo", "vespo"],
    "importance_sampling_level": ["token", "sequence"],
    "num_iterations": [1, 2],
    "gradient_accumulation_steps": [1, 2],
    "steps_per_generation": [DEFAULT, 2, 4],
    "epsilon": [DEFAULT, 0.1, 3e-4],
    "epsilon_high": [DEFAULT, 0.28, 4e-4, 5.0],
    "delta": [DEFAULT, 1.5],
    "top_entropy_quantile": [1.0, 0.5],
    "off_policy_mask_threshold": [DEFAULT, 0.5],
    "beta": [0.0, 0.04],
    "scale_rewards": ["group", "batch", "none"],
    "mask_truncated_completions": [False, True],
    "reward_weights": [DEFAULT, [2.0, 0.5]],  # two reward functions, weighted
    "multi_objective_aggregation": [DEFAULT, "normalize_then_sum"],
    "entropy_coef": [DEFAULT, 0.01],
    "use_vllm": [False, False, "token_truncate", "sequence_mask", "token_mask", "sequence_truncate"],
}
SEED, DRAWN = 27, 24
REPORTED = [  # the crashing configurations: TRL's default epsilons with sequence-level IS and epochs
    {"loss_type": "grpo", "importance_sampling_level": "sequence", "num_iterations": 2},
    {"loss_type": "dr_grpo", "importance_sampling_level": "sequence", "num_iterations": 2, "delta": 1.5},
    {"loss_type": "bnpo", "importance_sampling_level": "sequence", "num_iterations": 2, "steps_per_generation": 2,
     "top_entropy_quantile": 0.5},
]


def draw_cases() -> list[dict]:
    rng = random.Random(SEED)
    cases = [dict(case) for case in REPORTED]
    for _ in range(DRAWN):
        case = {name: rng.choice(values) for name, values in SPACE.items()}
        cases.append({name: value for name, value in case.items() if value is not DEFAULT})
    return cases


def case_id(case: dict) -> str:
    short = {"importance_sampling_level": "is", "num_iterations": "R", "gradient_accumulation_steps": "gas",
             "steps_per_generation": "spg", "top_entropy_quantile": "ent", "off_policy_mask_threshold": "opm",
             "mask_truncated_completions": "mtc", "multi_objective_aggregation": "agg", "reward_weights": "rw"}
    return ",".join(f"{short.get(k, k)}={v}" for k, v in case.items())


def second_reward(completions, **kwargs):
    """Rewards the completion's length parity: a second objective, so reward weights and aggregation matter."""
    return [float(len(c[0]["content"]) % 2) for c in completions]


CASES = draw_cases()


@pytest.fixture(scope="module")
def model_dir(tokenizer, tmp_path_factory):
    """The tiny Qwen3 saved to disk: TRL loads the reference model (``beta > 0``) from the policy's path."""
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny")
    tiny_qwen3(tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def train(trainer_cls, case, model_dir, tokenizer, toy_dataset, output_dir):
    """Build ``trainer_cls`` on a plain ``GRPOConfig`` of ``case`` and train two optimizer steps."""
    from trl import GRPOConfig

    fields = dict(case)
    vllm_mode = fields.pop("use_vllm", False)
    if vllm_mode:
        fields.update(use_vllm=True, vllm_mode="colocate", vllm_importance_sampling_mode=vllm_mode)
    rewards = [crc_reward, second_reward] if "reward_weights" in fields else crc_reward
    args = GRPOConfig(**{**CPU_ARGS, "output_dir": output_dir, "max_steps": 2, **fields})
    torch.manual_seed(0)
    with use_fake_vllm():
        trainer = trainer_cls(model=model_dir, reward_funcs=rewards, args=args, train_dataset=toy_dataset,
                              processing_class=tokenizer)
        trainer.train()
    return trainer


def losses(trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_a_config_trl_trains_trains_through_the_drop_in(case, model_dir, tokenizer, toy_dataset, tmp_path, caplog):
    from trl import GRPOTrainer

    from respo_trl import ReSPOTrainer

    try:
        reference = losses(train(GRPOTrainer, case, model_dir, tokenizer, toy_dataset, str(tmp_path / "trl")))
    except ValueError as error:  # TRL refuses the configuration: nothing to match
        pytest.skip(f"TRL refuses it: {error}")
    if len(reference) != 2 or not all(map(math.isfinite, reference)):
        pytest.skip(f"TRL itself does not train it to finite losses: {reference}")

    with caplog.at_level(logging.INFO):
        trainer = train(ReSPOTrainer, case, model_dir, tokenizer, toy_dataset, str(tmp_path / "respo"))
    messages = [record.getMessage() for record in caplog.records]  # every log line renders
    messages = [m for m, record in zip(messages, caplog.records) if record.name.startswith("respo_trl")]
    assert sum("ReSPO kernel (alpha, beta, lambda)" in m for m in messages) == 1
    if case.get("importance_sampling_level") == "sequence":
        assert sum("importance_sampling_level='sequence'" in m for m in messages) == 1
    assert trainer.loss_type == "respo"
    ours = losses(trainer)
    assert len(ours) == 2 and all(map(math.isfinite, ours)), ours
    json.dumps(trainer.state.log_history)  # the logged metrics serialise (what report_to and the console print)


def test_a_misspelt_loss_type_is_refused_by_the_config_in_one_line(tmp_path):
    """Before 0.4 ``ReSPOConfig(loss_type="respoo")`` was accepted and failed only once the trainer was built, after
    the model had loaded."""
    from respo_trl import ReSPOConfig
    from respo_trl.config import LOSS_TYPES

    with pytest.raises(ValueError) as error:
        ReSPOConfig(output_dir=str(tmp_path), loss_type="respoo")  # bf16 on a CPU would fail too: ours comes first
    message = str(error.value)
    assert "\n" not in message and "loss_type='respoo'" in message and "did you mean 'respo'?" in message
    assert all(name in message for name in LOSS_TYPES) and {"respo", "vespo", "dapo", "grpo"} <= set(LOSS_TYPES)
    for loss_type in LOSS_TYPES:  # every registered loss is accepted
        assert ReSPOConfig(**{**CPU_ARGS, "output_dir": str(tmp_path), "loss_type": loss_type}).loss_type == loss_type
