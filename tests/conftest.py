"""Shared fixtures: a local character tokenizer, tiny Qwen3 models and a toy dataset (no network).

TRL is imported once per test session (it costs seconds); the helpers below build trainers in a fraction of a second.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_DISABLED", "true")
# One intra-op thread: the tiny models gain nothing from two, and on a busy 2-core machine two threads spin-wait on
# each other (measured here: 9 s vs 104 s for tests/test_trainer.py + tests/test_gradients.py under load).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from respo_trl.builtin.tiny_model import build_char_tokenizer, tiny_qwen3
from respo_trl.rewards import crc_reward  # noqa: E402,F401  (re-exported to tests and workers)

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True, scope="module")
def _restore_torch_threads():
    threads = torch.get_num_threads()  # benchmark scripts pin torch to one thread; leave the next module as it was
    yield
    torch.set_num_threads(threads)


CPU_ARGS = dict(
    use_cpu=True,
    bf16=False,
    activation_checkpointing=False,
    report_to="none",
    logging_steps=1,
    save_strategy="no",
    per_device_train_batch_size=8,
    num_generations=4,
    max_completion_length=8,
    learning_rate=1e-2,
    max_steps=3,
    seed=0,
    dataloader_num_workers=0,
    disable_tqdm=True,
)



@pytest.fixture(scope="session")
def tokenizer():
    return build_char_tokenizer()


@pytest.fixture(scope="session")
def toy_dataset():
    from datasets import Dataset

    rows = [[{"role": "user", "content": f"{i}+{i % 7}="}] for i in range(64)]
    return Dataset.from_dict({"prompt": rows, "solution": [str(i + i % 7) for i in range(64)]})


@pytest.fixture(scope="session")
def tiny_model_dir(tokenizer, tmp_path_factory):
    """A tiny dense Qwen3 and its tokenizer saved like a Hub snapshot, loaded by path (as users load Hub ids)."""
    path = tmp_path_factory.mktemp("tiny-qwen3")
    tiny_qwen3(tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture
def make_trainer(tokenizer, toy_dataset, tmp_path):
    """Build a trainer on a fresh tiny model: ``make_trainer(config_cls=ReSPOConfig, moe=False, **config_overrides)``."""
    from respo_trl import ReSPOConfig, ReSPOTrainer
    def build(config_cls=ReSPOConfig, moe=False, trainer_cls=ReSPOTrainer, model=None, **overrides):
        args = config_cls(**{"output_dir": str(tmp_path / "out"), **CPU_ARGS, **overrides})
        model = model if model is not None else tiny_qwen3(tokenizer, moe=moe)
        return trainer_cls(
            model=model, reward_funcs=crc_reward, args=args, train_dataset=toy_dataset, processing_class=tokenizer
        )

    return build


def params_of(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


class StopAt(__import__("transformers").TrainerCallback):
    """Simulates a crash right after a checkpoint."""

    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True
