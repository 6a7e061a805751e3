"""The async trainer on a GPU, briefly: TRL's tree attention (FA3 when it can be fetched) under ReSPO's loss.

Run it first whenever a GPU is lent (docs/gpu.md): a random-init Qwen3 (0.6B geometry, 4 layers; nothing
downloaded) is saved locally and trained 3 updates by ``AsyncReSPOTrainer`` in bf16 with in-process rollouts (lags
0/1/2, so ``W`` moves; the sampler is transformers in float32, the trainer bf16 autocast). Written to
``$OUT/gpu_async_check.json`` or ``--out``: the attention path used (``fa3``, or ``sdpa`` when the FA3 kernel cannot
be fetched: the machine may not reach the Hub), seconds per update, the losses (finite?), staleness at use and
``offpolicy/log_weight/std`` per update (on the first, at staleness 0, it is the gap between the trainer's bf16 tree
attention and the sampler's forward). The loss's closed form is checked on a CPU by tests/test_async.py.

    python -m benchmarks.gpu_async_check --out docs/benchmarks/gpu_qwen3_step   # on the GPU machine
    python -m benchmarks.gpu_async_check --smoke --out /tmp/gac                  # CPU, tiny model: checks the script
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import time
import traceback


def tree_attention_path(device: str) -> str:
    """``fa3`` when TRL's kernel loads, else install the SDPA fallback and say ``sdpa``."""
    from respo_trl.integrations.async_cpu import use_sdpa_tree_attention
    from respo_trl.trl_surface import async_modules

    if device == "cuda":
        try:
            async_modules()[1]._flash_attn()
            return "fa3"
        except Exception as error:  # noqa: BLE001  (no Hub access, no `kernels` package, an unsupported GPU)
            print(f"FA3 tree attention unavailable ({type(error).__name__}: {error}); using SDPA", flush=True)
    use_sdpa_tree_attention()
    return "sdpa"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--smoke", action="store_true", help="tiny model on the CPU")
    args = parser.parse_args(argv)
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from respo_trl.async_config import AsyncReSPOConfig
    from respo_trl.async_rollouts import InProcessRollouts
    from respo_trl.async_trainer import AsyncReSPOTrainer
    from respo_trl.builtin.task import ArithmeticTask
    from respo_trl.builtin.tiny_model import build_char_tokenizer
    from respo_trl.rewards import crc_reward

    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    result = {"device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu", "torch": torch.__version__}
    try:
        result["attention"] = tree_attention_path(device)
        tokenizer = build_char_tokenizer()
        size = dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, intermediate_size=128, head_dim=32) \
            if args.smoke else dict(hidden_size=1024, num_attention_heads=16, num_key_value_heads=8,
                                    intermediate_size=3072, head_dim=128)  # fmt: skip
        config = Qwen3Config(vocab_size=len(tokenizer), num_hidden_layers=2 if args.smoke else 4,
                             tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
                             eos_token_id=tokenizer.eos_token_id, bos_token_id=None, **size)  # fmt: skip
        path = tempfile.mkdtemp(prefix="gpu-async-")
        Qwen3ForCausalLM(config).save_pretrained(path)
        tokenizer.save_pretrained(path)
        prompts = ArithmeticTask(operators="+", max_operand=9).dataset("train", 64, seed=0).remove_columns("completion")
        on_gpu = device == "cuda"
        cfg = AsyncReSPOConfig(output_dir=os.path.join(path, "out"), max_steps=3, per_device_train_batch_size=16,
                               num_generations=4, max_completion_length=32, learning_rate=1e-3, token_budget=0,
                               bf16=on_gpu, use_cpu=not on_gpu, report_to="none", logging_steps=1,
                               save_strategy="no", disable_tqdm=True)  # fmt: skip
        worker = InProcessRollouts(path, tokenizer, prompts, crc_reward, num_generations=4, max_tokens=32,
                                   lag_probabilities={0: 0.4, 1: 0.3, 2: 0.3}, groups_per_call=4)  # fmt: skip
        worker.sampler.to(device)
        trainer = AsyncReSPOTrainer(path, crc_reward, cfg, train_dataset=prompts, processing_class=tokenizer,
                                    rollout_worker=worker, weight_transfer=worker)  # fmt: skip
        first = {}
        compute = trainer.compute_loss

        def compute_loss(model, inputs, *a, **k):
            loss = compute(model, inputs, *a, **k)
            first.setdefault("loss", loss.item())
            return loss

        trainer.compute_loss = compute_loss
        start = time.time()
        trainer.train()
        logs = [h for h in trainer.state.log_history if "loss" in h]
        result.update(
            seconds_per_update=(time.time() - start) / max(len(logs), 1), updates=len(logs),
            losses=[h["loss"] for h in logs], staleness_at_use=[h.get("staleness/at_use_mean") for h in logs],
            log_weight_std=[h.get("offpolicy/log_weight/std") for h in logs], first_loss=first.get("loss"),
            finite=all(math.isfinite(h["loss"]) for h in logs), ok=True,
        )  # fmt: skip
    except Exception:  # noqa: BLE001  (the JSON says what failed; the machine is lent for minutes)
        result.update(ok=False, error=traceback.format_exc()[-3000:])
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_async_check.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "error"}), flush=True)
    if not result["ok"]:
        print(result["error"], flush=True)
    return result


if __name__ == "__main__":
    main()
