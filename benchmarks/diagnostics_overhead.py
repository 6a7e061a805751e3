"""Cost of the per-step starvation diagnostics: loss + backward time with ``respo_log_diagnostics`` on vs off.

The diagnostics recompute every loss's coefficient by autograd on the (B, T) log-ratio tensor, evaluate TRL's
clipped loss as a counterfactual, and gather one per-sequence table across processes. This times
``trainer._compute_loss`` + ``backward`` on one fixed, off-policy batch of real rollouts, alternating the two settings
on the same trainer (median of interleaved repeats), for tiny Qwen3 models of growing width. The tiny model is the
worst case: the elementwise diagnostics are a larger share of a small model's step.

    python -m benchmarks.diagnostics_overhead --out docs/benchmarks/diagnostics_overhead
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from benchmarks.common import QUIET_CPU_TRAINING, command, machine_info  # noqa: E402
from respo_trl.builtin.tiny_model import build_char_tokenizer, tiny_qwen3
from respo_trl.rewards import crc_reward  # noqa: E402


def measure(hidden: int, layers: int, args, tokenizer, dataset, tmp) -> dict:
    import torch
    from transformers.trainer_callback import PrinterCallback

    from respo_trl import ReSPOConfig, ReSPOTrainer
    config = ReSPOConfig(
        output_dir=tmp,
        **QUIET_CPU_TRAINING,
        per_device_train_batch_size=args.batch,
        num_generations=4,
        max_completion_length=args.completion_len,
        generation_kwargs={"min_new_tokens": args.completion_len},
        num_iterations=2,
        max_steps=1,
        learning_rate=1e-3,
    )
    model = tiny_qwen3(tokenizer, hidden_size=hidden, num_layers=layers, num_heads=4, intermediate_size=2 * hidden)
    trainer = ReSPOTrainer(model=model, reward_funcs=crc_reward, args=config, train_dataset=dataset, processing_class=tokenizer)
    trainer.remove_callback(PrinterCallback)
    trainer.train()  # one real step: the buffer now holds off-policy rollouts for the measurement
    inputs = trainer.rollouts.micro_batch(1, 0)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1

    def step(diagnostics: bool) -> float:
        trainer.args.respo_log_diagnostics = diagnostics
        trainer.model.zero_grad()
        start = time.perf_counter()
        loss = trainer._compute_loss(trainer.model, inputs)
        loss.backward()
        return time.perf_counter() - start

    for setting in (True, False, True, False):  # warm-up
        step(setting)
    samples = {True: [], False: []}
    for rep in range(args.repeats):
        for setting in (True, False) if rep % 2 == 0 else (False, True):
            samples[setting].append(step(setting))
    on, off = statistics.median(samples[True]), statistics.median(samples[False])
    return {
        "hidden": hidden,
        "layers": layers,
        "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
        "tokens": int(inputs["completion_mask"].numel()),
        "ms_with": 1e3 * on,
        "ms_without": 1e3 * off,
        "ratio": on / off,
        "repeats": args.repeats,
        "torch_threads": torch.get_num_threads(),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--widths", default="64,256,512")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--completion_len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--out", default="docs/benchmarks/diagnostics_overhead")
    parser.add_argument(
        "--threads", type=int, default=1,
        help="torch intra-op threads; 1 keeps timings sane on a shared 2-core box (2 threads spin-wait under load)",
    )
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)

    import tempfile

    from datasets import Dataset

    tokenizer = build_char_tokenizer()
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"{i}+{i % 9}="}] for i in range(64)]})
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for width in (int(w) for w in args.widths.split(",")):
            rows.append(measure(width, args.layers, args, tokenizer, dataset, tmp))
            print(json.dumps(rows[-1]), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "diagnostics_overhead.json"), "w") as f:
        machine = machine_info()
        json.dump({"command": command("diagnostics_overhead", sys.argv[1:]), "settings": vars(args), "machine": machine, "rows": rows}, f, indent=1)
    print(f"\n{'model':>22} {'tokens':>7} {'with (ms)':>10} {'without (ms)':>13} {'ratio':>6}")
    for r in rows:
        name = f"{r['params_m']:.2f}M ({r['hidden']}x{r['layers']})"
        print(f"{name:>22} {r['tokens']:>7} {r['ms_with']:10.2f} {r['ms_without']:13.2f} {r['ratio']:6.3f}")


if __name__ == "__main__":
    main()
