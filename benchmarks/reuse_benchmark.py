"""Rollout reuse on the tiny Qwen3: sampled tokens and wall time per optimizer step for R in {1, 2, 4, 8}.

Reuse only pays if generation dominates the step. This measures, in one process and with interleaved repeats, the
completion tokens sampled per optimizer step (R=4 must be exactly a quarter of R=1, since the generation batch is the
same) and the wall time per optimizer step, and prints the measured time ratio to R=1 next to the ideal
``(gen/R + train) / (gen + train)`` computed from R=1's measured generation and training time.

    python -m benchmarks.reuse_benchmark                    # ~1 min on 2 CPU cores
    python -m benchmarks.reuse_benchmark --steps 16 --repeats 3 --out docs/benchmarks/reuse_benchmark

Writes ``reuse_benchmark.json`` and ``reuse_benchmark.png`` into ``--out``.
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


def run_once(reuse: int, steps: int, completion_len: int, args, tokenizer, dataset, tmp: str) -> dict:
    from transformers.trainer_callback import PrinterCallback

    from respo_trl import ReSPOConfig, ReSPOTrainer
    class TimedTrainer(ReSPOTrainer):
        generation_seconds = 0.0
        generations = 0

        def _sample(self, generation_batch):
            start = time.perf_counter()
            batch = super()._sample(generation_batch)
            self.generation_seconds += time.perf_counter() - start
            self.generations += 1
            return batch

    config = ReSPOConfig(
        output_dir=os.path.join(tmp, f"r{reuse}-{completion_len}"),
        **QUIET_CPU_TRAINING,
        logging_steps=1,
        per_device_train_batch_size=args.batch,
        num_generations=4,
        max_completion_length=completion_len,
        # every completion runs to the full length, so sampled tokens measure the generation work exactly
        generation_kwargs={"min_new_tokens": completion_len},
        learning_rate=1e-4,
        max_steps=steps,
        num_iterations=reuse,
        seed=0,
    )
    trainer = TimedTrainer(
        model=tiny_qwen3(tokenizer, hidden_size=args.hidden, num_layers=args.layers, intermediate_size=2 * args.hidden),
        reward_funcs=crc_reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
    )
    trainer.remove_callback(PrinterCallback)
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return {
        "reuse": reuse,
        "completion_len": completion_len,
        "steps": steps,
        "wall_s": wall,
        "s_per_step": wall / steps,
        "generations": trainer.generations,
        "generation_s_per_batch": trainer.generation_seconds / trainer.generations,
        "train_s_per_step": (wall - trainer.generation_seconds) / steps,
        "generated_tokens": trainer.rollouts.generated_tokens,
        "generated_tokens_per_step": trainer.rollouts.generated_tokens / steps,
        "mean_staleness": statistics.mean(h["reuse/staleness_mean"] for h in logs),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reuse", default="1,2,4,8")
    parser.add_argument("--steps", type=int, default=16, help="optimizer steps per run (a multiple of every R)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats; medians are reported")
    parser.add_argument("--batch", type=int, default=16, help="completions per optimizer step")
    parser.add_argument(
        "--completion_lens", default="32,128,512",
        help="completion lengths to measure; reuse pays more the more generation dominates the step",
    )
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--out", default="docs/benchmarks/reuse_benchmark")
    parser.add_argument(
        "--threads", type=int, default=1,
        help="torch intra-op threads; 1 keeps timings sane on a shared 2-core box (2 threads spin-wait under load)",
    )
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    reuses = [int(r) for r in args.reuse.split(",")]
    if any(args.steps % r for r in reuses):
        parser.error(f"--steps {args.steps} must be a multiple of every R in {reuses}")

    import tempfile

    import torch
    from datasets import Dataset
    from tqdm import tqdm

    tokenizer = build_char_tokenizer()
    prompts = [[{"role": "user", "content": f"{i}+{(7 * i) % 13}="}] for i in range(512)]
    dataset = Dataset.from_dict({"prompt": prompts})

    lengths = [int(n) for n in args.completion_lens.split(",")]
    runs = {(n, r): [] for n in lengths for r in reuses}
    order = []
    for rep in range(args.repeats):
        order += [(n, r) for n in lengths for r in (reuses if rep % 2 == 0 else list(reversed(reuses)))]
    with tempfile.TemporaryDirectory() as tmp:
        for n, reuse in tqdm(order, desc="runs"):
            runs[(n, reuse)].append(run_once(reuse, args.steps, n, args, tokenizer, dataset, tmp))

    def med(n, reuse, key):
        return statistics.median(run[key] for run in runs[(n, reuse)])

    base = reuses[0]
    rows = []
    for n in lengths:
        gen, train = med(n, base, "generation_s_per_batch"), med(n, base, "train_s_per_step")
        for reuse in reuses:
            rows.append(
                {
                    "completion_len": n,
                    "reuse": reuse,
                    "generated_tokens_per_step": med(n, reuse, "generated_tokens_per_step"),
                    "tokens_ratio_to_R1": med(n, reuse, "generated_tokens_per_step") / med(n, base, "generated_tokens_per_step"),
                    "s_per_step": med(n, reuse, "s_per_step"),
                    "time_ratio_to_R1": med(n, reuse, "s_per_step") / med(n, base, "s_per_step"),
                    "ideal_time_ratio": (gen / reuse + train) / (gen + train),
                    "generation_s_per_batch_R1": gen,
                    "train_s_per_step_R1": train,
                    "mean_staleness": med(n, reuse, "mean_staleness"),
                }
            )
    report = {
        "command": command("reuse_benchmark", sys.argv[1:]),
        "machine": machine_info(),
        "settings": vars(args),
        "rows": rows,
        "runs": {f"len{n}-R{r}": v for (n, r), v in runs.items()},
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "reuse_benchmark.json"), "w") as f:
        json.dump(report, f, indent=1)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(lengths), figsize=(5 * len(lengths), 3.5), squeeze=False)
    for ax, n in zip(axes[0], lengths):
        sub = [r for r in rows if r["completion_len"] == n]
        x = range(len(sub))
        ax.bar([i - 0.2 for i in x], [r["time_ratio_to_R1"] for r in sub], 0.4, label="measured wall time")
        ax.bar([i + 0.2 for i in x], [r["ideal_time_ratio"] for r in sub], 0.4, label="ideal (gen/R + train)")
        ax.plot(list(x), [r["tokens_ratio_to_R1"] for r in sub], "k.--", label="sampled tokens")
        ax.set_xticks(list(x), [f"R={r['reuse']}" for r in sub])
        ax.set_ylabel("per optimizer step, relative to R=1")
        ax.set_title(f"{n}-token completions")
        ax.legend(fontsize=8)
    fig.suptitle("Rollout reuse on the tiny Qwen3 (CPU)")
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "reuse_benchmark.png"), dpi=120)

    print(f"\n{'len':>4} {'R':>3} {'tokens/step':>12} {'tok ratio':>10} {'s/step':>8} {'time ratio':>11} {'ideal':>7} {'staleness':>10}")
    for r in rows:
        print(
            f"{r['completion_len']:>4} {r['reuse']:>3} {r['generated_tokens_per_step']:12.1f} {r['tokens_ratio_to_R1']:10.3f} "
            f"{r['s_per_step']:8.3f} {r['time_ratio_to_R1']:11.3f} {r['ideal_time_ratio']:7.3f} {r['mean_staleness']:10.2f}"
        )
    print(f"wrote {os.path.join(args.out, 'reuse_benchmark.json')}")


if __name__ == "__main__":
    main()
