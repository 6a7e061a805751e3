"""Routing Replay (R3) on CPU: its cost, and how far the routing of reused rollouts drifts without it.

Two measurements, both on random-init tiny Qwen3-MoE models (``respo_trl.builtin.tiny_model``):

1. Overhead, model level (no trainer): a KV-cached ``generate`` of ``--batch`` sequences x ``--new_tokens`` tokens
   with and without :meth:`RoutingReplay.recording` (+ ``finish``), and one loss forward + backward over the same
   sequences with and without :meth:`RoutingReplay.replaying` (the router perturbed first, so that replay really
   overrides the router's choice). Settings alternate within each repeat; medians are reported.
2. Drift in training: ``ReSPOTrainer`` with ``respo_routing_replay=True`` and ``num_iterations`` passes over each
   generation batch; ``routing/drift`` (share of token x MoE-layer slots where the current router would pick another
   expert set than the sampler did) is averaged by reuse pass.

    python -m benchmarks.routing_replay --out docs/benchmarks/routing_replay
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from benchmarks.common import QUIET_CPU_TRAINING, command, machine_info  # noqa: E402
from respo_trl.builtin.tiny_model import build_char_tokenizer, tiny_qwen3
from respo_trl.rewards import crc_reward  # noqa: E402

MODELS = {  # name: tiny_qwen3 kwargs
    "tiny (64x2, 4 experts top-2)": dict(hidden_size=64, num_layers=2, num_experts=4, experts_per_token=2),
    "wider (256x4, 16 experts top-4)": dict(
        hidden_size=256, num_layers=4, num_heads=4, intermediate_size=512, num_experts=16, experts_per_token=4
    ),
}


def overhead(name, kwargs, args, tokenizer) -> dict:
    import torch

    from respo_trl.routing_replay import RoutingReplay

    model = tiny_qwen3(tokenizer, moe=True, **kwargs).eval()
    replay = RoutingReplay(model)
    prompts = [f"{i * 37 % 1000}+{i * 11 % 97}-{i % 13}=" for i in range(args.batch)]
    encoded = tokenizer(prompts, return_tensors="pt", padding=True)
    width = encoded.input_ids.shape[1]
    generate = dict(do_sample=True, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens)

    def gen(record: bool) -> tuple[float, torch.Tensor]:
        torch.manual_seed(0)
        start = time.perf_counter()
        with torch.no_grad():
            if record:
                with replay.recording():
                    out = model.generate(**encoded, **generate)
                replay.finish([tokenizer(p).input_ids for p in prompts], out[:, width:].tolist())
            else:
                out = model.generate(**encoded, **generate)
        return time.perf_counter() - start, out

    _, out = gen(True)
    input_ids, keep = out, args.new_tokens
    attention_mask = torch.cat([encoded.attention_mask, torch.ones_like(out[:, width:])], dim=1)
    routes = replay.layout(input_ids, keep)
    with torch.no_grad():
        for gate in replay.gates:
            gate.weight.add_(0.5 * gate.weight.abs().mean() * torch.randn_like(gate.weight))
    model.train()

    def loss_step(use_replay: bool) -> float:
        model.zero_grad()
        start = time.perf_counter()
        if use_replay:
            with replay.replaying(input_ids, routes):
                logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
        else:
            logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
        logps = torch.log_softmax(logits[:, -keep - 1 : -1].float(), -1).gather(-1, input_ids[:, -keep:, None])
        (-logps.mean()).backward()
        return time.perf_counter() - start

    samples = defaultdict(list)
    for setting in (True, False):  # warm-up
        gen(setting)
        loss_step(setting)
    for rep in range(args.repeats):
        for setting in (True, False) if rep % 2 == 0 else (False, True):
            samples[("gen", setting)].append(gen(setting)[0])
            samples[("loss", setting)].append(loss_step(setting))
    med = {key: statistics.median(values) for key, values in samples.items()}
    replay.close()
    return {
        "model": name,
        "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
        "moe_layers": replay.num_layers,
        "top_k": replay.top_k,
        "sequences": args.batch,
        "tokens_per_sequence": width + args.new_tokens,
        "route_bytes_per_token": replay.num_layers * replay.top_k * 2,
        "drift_slots_in_timed_replay": replay.last_stats[0].item() / max(1, replay.last_stats[1].item()),
        "generate_ms": med[("gen", False)] * 1e3,
        "generate_recorded_ms": med[("gen", True)] * 1e3,
        "loss_ms": med[("loss", False)] * 1e3,
        "loss_replayed_ms": med[("loss", True)] * 1e3,
    }


def drift_run(args, tokenizer, tmp) -> dict:
    from datasets import Dataset
    from transformers.trainer_callback import PrinterCallback

    from respo_trl import ReSPOConfig, ReSPOTrainer
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"{i}+{i % 9}="}] for i in range(256)]})
    config = ReSPOConfig(
        output_dir=tmp,
        **QUIET_CPU_TRAINING,
        logging_steps=1,
        per_device_train_batch_size=16,
        num_generations=4,
        max_completion_length=32,
        num_iterations=args.reuse,
        respo_routing_replay=True,
        max_steps=args.steps,
        learning_rate=args.lr,
        seed=0,
    )
    model = tiny_qwen3(tokenizer, moe=True, **MODELS["tiny (64x2, 4 experts top-2)"])
    trainer = ReSPOTrainer(model=model, reward_funcs=crc_reward, args=config, train_dataset=dataset, processing_class=tokenizer)
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    by_pass = defaultdict(list)
    for entry in trainer.state.log_history:
        if "routing/drift" in entry:
            by_pass[int(entry.get("reuse/pass", 1))].append((entry["routing/drift"], entry["routing/drift_tokens"]))
    return {
        "lr": args.lr,
        "reuse": args.reuse,
        "steps": args.steps,
        "by_pass": {
            p: {
                "drift": statistics.mean(v[0] for v in values),
                "drift_tokens": statistics.mean(v[1] for v in values),
                "steps": len(values),
            }
            for p, values in sorted(by_pass.items())
        },
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--new_tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--reuse", type=int, default=4)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--out", default="docs/benchmarks/routing_replay")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1 on a shared 2-core box)")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    tokenizer = build_char_tokenizer()
    rows = []
    for name, kwargs in MODELS.items():
        rows.append(overhead(name, kwargs, args, tokenizer))
        print(json.dumps(rows[-1]), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        drift = drift_run(args, tokenizer, tmp)
    print(json.dumps(drift), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "routing_replay.json"), "w") as f:
        record = {"command": command("routing_replay", sys.argv[1:]), "settings": vars(args), "machine": machine_info()}
        json.dump({**record, "overhead": rows, "drift": drift}, f, indent=1)

    print(f"\n{'model':>34} {'generate ms':>12} {'+record':>9} {'loss f+b ms':>12} {'+replay':>9} {'B/token':>8}")
    for r in rows:
        print(
            f"{r['model']:>34} {r['generate_ms']:12.1f} {r['generate_recorded_ms'] / r['generate_ms'] - 1:+9.1%} "
            f"{r['loss_ms']:12.1f} {r['loss_replayed_ms'] / r['loss_ms'] - 1:+9.1%} {r['route_bytes_per_token']:8d}"
        )
    print(f"\ndrift by reuse pass (tiny MoE, R={args.reuse}, lr {args.lr}, {args.steps} steps):")
    for p, v in drift["by_pass"].items():
        print(f"  pass {p}: slots {v['drift']:.3f}, tokens {v['drift_tokens']:.3f} ({v['steps']} steps)")


if __name__ == "__main__":
    main()
