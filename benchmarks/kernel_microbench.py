"""Kernel microbenchmark: loss + backward time and peak memory of ReSPO against TRL's ``dapo`` and ``vespo``.

Goal (issue 10): ReSPO's loss + backward within 1.10x TRL ``dapo`` at 1K to 32K tokens per row.

What it measures
----------------
The policy-loss part of one training step, on synthetic per-token log-probs (batch 64; completion lengths 1K, 8K and
32K tokens, each row's real length uniform in [T/2, T] so the mask matters), computed the way the trainer computes it:

* ``dapo``  TRL's default loss, replicated here on purpose as the baseline (the same expression as
  ``GRPOTrainer._compute_loss`` in TRL 1.16): ``coef_1 = exp(logp - old)``, ``coef_2 = clamp(coef_1, 1-eps, 1+eps)``,
  ``per_token_loss = -min(coef_1 * A, coef_2 * A)``, then ``(per_token_loss * mask).sum() / num_items``.
* ``vespo`` TRL's own ``GRPOTrainer.get_gamma_weights`` (a staticmethod, called as TRL calls it), then
  ``-phi * A * logp`` and the same aggregation.
* ``respo`` the path ``ReSPOTrainer`` runs: TRL's vespo-branch aggregation with the coefficient from
  :func:`respo_trl.kernels.respo_weights` (what :func:`respo_trl.trl_loss.respo_grpo_loss` applies; the paper's constants
  ``(2, 0.5, 2)`` / ``(1, 0.5, 2)``, raw sequence ratio, no token mask: each sample used once), then
  ``-c * A * logp`` and the same aggregation.
* ``respo_mask`` the same with the directional token trust mask (``respo_trust_mask``: on by default when samples are
  used more than once, ``num_iterations > 1``).
* ``diagnostics`` (reported apart, not in the ratios): :func:`respo_trl.diagnostics.sequence_stats`, which the trainer
  runs on every step for every ``loss_type`` (it differentiates the loss and clipped PPO for the throughput metrics).

Timing: ``logp`` is a leaf tensor that requires grad (the model's output stands in for it); one sample is forward +
``backward()``. Each method is warmed up, then the methods are run in interleaved, rotating order for ``--repeats``
rounds, so machine-load drift hits them alike; the table reports the median time and the median of the per-round ratio
to ``dapo`` (paired, robust to load). On CUDA every sample is synchronised.

Peak memory: on CPU, PyTorch's allocations are invisible to ``tracemalloc`` and RSS hides them behind the allocator's
cache, so one extra run per method is recorded with ``torch.profiler`` (``profile_memory=True``); the running sum of
every event's self allocations (frees are negative) in time order gives the peak of bytes live during forward +
backward above the inputs, gradient included. On CUDA: ``max_memory_allocated`` minus the allocation before the run.

How to run
----------
    OMP_NUM_THREADS=1 python -m benchmarks.kernel_microbench    # CPU: docs/benchmarks/kernel_microbench.*
    python -m benchmarks.kernel_microbench --device cuda --out /tmp/kernel_microbench_cuda.json --no-plot
    python -m benchmarks.kernel_microbench --lengths 1024 --repeats 5    # quick look

Without TRL installed (e.g. the GPU image), pass ``--trl-grpo-source path/to/trl/trainer/grpo_trainer.py`` (TRL
1.16's file, copied along): ``vespo`` then runs TRL's ``get_gamma_weights`` compiled from that file.

The last line printed is the result as one JSON line (for logs and GPU runs). Default ``--threads 1``: on the shared
2-core dev machine multi-threaded timings of these memory-bound element-wise ops are dominated by contention with
other jobs; pass ``--threads 2`` (or 0 for torch's default) to measure that instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import time

import torch

from benchmarks.common import code_commit, machine_info
from respo_trl.diagnostics import sequence_stats
from respo_trl.kernels import LossParams, respo_weights
from respo_trl.packed import packed_policy_loss

EPSILON = 0.2  # TRL's default epsilon (= epsilon_high when unset)
PARAMS = LossParams()  # ReSPO (the paper's constants, no mask) and VESPO at the package / TRL defaults
MASK_PARAMS = dataclasses.replace(PARAMS, respo_trust_mask=True)


def make_inputs(batch: int, length: int, device: str, dtype: torch.dtype, seed: int = 0) -> dict:
    """Synthetic stand-ins for one micro-batch: log-probs, stored old log-probs, advantages, completion mask."""
    gen = torch.Generator().manual_seed(seed)
    logp = -torch.rand(batch, length, generator=gen) * 3  # log-probs in (-3, 0]
    old = logp + 0.05 * torch.randn(batch, length, generator=gen)  # a few steps of drift
    lengths = torch.randint(length // 2, length + 1, (batch,), generator=gen)
    mask = (torch.arange(length) < lengths.unsqueeze(-1)).long()  # TRL's completion_mask is int64
    advantages = torch.randn(batch, generator=gen).unsqueeze(1)  # TRL unsqueezes (B,) to (B, 1)
    return {
        "logp": logp.to(device=device, dtype=dtype).requires_grad_(True),
        "old": old.to(device=device, dtype=dtype),
        "mask": mask.to(device),
        "advantages": advantages.to(device=device, dtype=dtype),
        "num_items": mask.sum().to(device),
    }


def dapo_loss(x: dict) -> torch.Tensor:
    # Deliberate replica of TRL 1.16's dapo branch (the baseline): token clip, then token sum / global token count.
    log_ratio = x["logp"] - x["old"]
    coef_1 = torch.exp(log_ratio)
    coef_2 = torch.clamp(coef_1, 1 - EPSILON, 1 + EPSILON)
    per_token_loss = -torch.min(coef_1 * x["advantages"], coef_2 * x["advantages"])
    return (per_token_loss * x["mask"]).sum() / x["num_items"].clamp(min=1.0)


_TRL = {"get_gamma_weights": None, "source": None}


def load_trl_gamma_weights(source_file: str | None = None):
    """TRL's ``GRPOTrainer.get_gamma_weights``: imported from TRL, or, where TRL cannot be installed (the GPU image has
    no TRL), compiled from TRL's own ``grpo_trainer.py`` given as ``source_file`` (only that function: same code)."""
    if source_file is None:
        from trl import GRPOTrainer

        _TRL.update(get_gamma_weights=GRPOTrainer.get_gamma_weights, source="trl " + _trl_version())
        return _TRL["get_gamma_weights"]
    import ast

    with open(source_file) as f:
        tree = ast.parse(f.read())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "GRPOTrainer")
    fn = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "get_gamma_weights")
    fn.decorator_list = []  # @staticmethod, @torch.no_grad(): re-applied below
    namespace = {"torch": torch, "math": math}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), source_file, "exec"), namespace)
    _TRL.update(get_gamma_weights=torch.no_grad()(namespace["get_gamma_weights"]), source=f"source {source_file}")
    return _TRL["get_gamma_weights"]


def _trl_version() -> str:
    import trl

    return trl.__version__


def vespo_loss(x: dict) -> torch.Tensor:
    get_gamma_weights = _TRL["get_gamma_weights"] or load_trl_gamma_weights()
    log_ratio = x["logp"] - x["old"]
    phi = get_gamma_weights(
        advantages=x["advantages"],
        log_ratio_per_token=log_ratio,
        mask=x["mask"],
        importance_sampling_ratio=None,
        k_pos=PARAMS.vespo_k_pos,
        lambda_pos=PARAMS.vespo_lambda_pos,
        k_neg=PARAMS.vespo_k_neg,
        lambda_neg=PARAMS.vespo_lambda_neg,
    )
    per_token_loss = -phi * x["advantages"] * x["logp"]
    return (per_token_loss * x["mask"]).sum() / x["num_items"].clamp(min=1.0)


def _respo(x: dict, params: LossParams) -> torch.Tensor:
    # What ReSPOTrainer runs (trl_loss.respo_grpo_loss): TRL's vespo-branch aggregation, coefficient respo_weights
    log_ratio = x["logp"] - x["old"]
    coef = respo_weights(log_ratio, x["advantages"], x["mask"], params).coefficients
    per_token_loss = -coef * x["advantages"] * x["logp"]
    return (per_token_loss * x["mask"]).sum() / x["num_items"].clamp(min=1.0)


def respo_loss(x: dict) -> torch.Tensor:
    return _respo(x, PARAMS)


def respo_mask_loss(x: dict) -> torch.Tensor:
    return _respo(x, MASK_PARAMS)


def diagnostics(x: dict) -> torch.Tensor:
    return sequence_stats(x["logp"].detach() - x["old"], x["advantages"], x["mask"], PARAMS, "respo")


LOSSES = {"dapo": dapo_loss, "vespo": vespo_loss, "respo": respo_loss, "respo_mask": respo_mask_loss}


def check_on_policy_equivalence(device: str, dtype: torch.dtype) -> float:
    """On-policy (old = logp) the losses are all the plain policy gradient: their gradients must coincide.

    Guards the benchmark against timing a wrong expression. Returns the largest absolute gradient difference.
    """
    x = make_inputs(8, 64, device, dtype, seed=1)
    x["old"] = x["logp"].detach().clone()
    grads = {}
    for name, fn in LOSSES.items():
        x["logp"].grad = None
        fn(x).backward()
        grads[name] = x["logp"].grad.clone()
    diff = max((grads[name] - grads["dapo"]).abs().max().item() for name in grads)
    scale = grads["dapo"].abs().max().item()
    if diff > 1e-5 * max(scale, 1e-12) + (1e-2 * scale if dtype == torch.bfloat16 else 0.0):
        raise AssertionError(f"on-policy gradients differ between losses by {diff:g} (scale {scale:g})")
    return diff


def run_once(fn, x: dict, device: str) -> float:
    x["logp"].grad = None
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn(x)
    if out.requires_grad:
        out.backward()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def peak_memory(fn, x: dict, device: str) -> int:
    """Peak bytes allocated above the starting point during one forward + backward (see the module docstring)."""
    x["logp"].grad = None
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        out = fn(x)
        if out.requires_grad:
            out.backward()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn(x)
        if out.requires_grad:
            out.backward()
    live = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        live += event.self_cpu_memory_usage
        peak = max(peak, live)
    return peak


def time_methods(methods: dict, x: dict, args, baseline: str) -> dict:
    """Each method's forward + backward on ``x``: warmed up, then run in interleaved, rotating order for
    ``args.repeats`` rounds; median time, IQR, the median of the per-round ratio to ``baseline`` and peak memory."""
    for name, fn in methods.items():  # warm-up (allocator, TRL import, lazy init)
        for _ in range(args.warmup):
            run_once(fn, x, args.device)
    samples = {name: [] for name in methods}
    names = list(methods)
    for rep in range(args.repeats):
        order = names[rep % len(names):] + names[: rep % len(names)]  # rotate: no method always runs first
        for name in order:
            samples[name].append(run_once(methods[name], x, args.device))
    memory = {name: peak_memory(fn, x, args.device) for name, fn in methods.items()}
    stats = {}
    for name in names:
        times = samples[name]
        stats[name] = {
            "median_ms": 1e3 * statistics.median(times),
            "min_ms": 1e3 * min(times),
            "iqr_ms": 1e3 * _iqr(times),
            f"ratio_to_{baseline}": statistics.median([t / d for t, d in zip(times, samples[baseline])]),
            "peak_mb": memory[name] / 2**20,
            "samples_ms": [1e3 * t for t in times],
        }
    return stats


def bench_length(length: int, args, log) -> dict:
    x = make_inputs(args.batch, length, args.device, getattr(torch, args.dtype))
    methods = dict(LOSSES)
    if not args.no_diagnostics:
        methods["diagnostics"] = diagnostics
    row = {"length": length, "batch": args.batch, "tokens": int(x["num_items"]),
           "methods": time_methods(methods, x, args, "dapo")}  # fmt: skip
    m = row["methods"]
    log(
        f"T={length:6d}  dapo {m['dapo']['median_ms']:8.2f} ms  vespo {m['vespo']['median_ms']:8.2f} ms "
        f"({m['vespo']['ratio_to_dapo']:.2f}x)  respo {m['respo']['median_ms']:8.2f} ms "
        f"({m['respo']['ratio_to_dapo']:.2f}x)  respo_mask {m['respo_mask']['median_ms']:8.2f} ms "
        f"({m['respo_mask']['ratio_to_dapo']:.2f}x)" + (
            f"  diagnostics {m['diagnostics']['median_ms']:8.2f} ms" if "diagnostics" in m else ""
        )
    )
    return row


# -- TRL's async trainer: the loss on packed rows (issue 51) ------------------------------------------------------------


def make_packed(batch: int, length: int, device: str, dtype: torch.dtype, seed: int = 0) -> dict:
    """One rank's packed row as TRL's async collator lays it out: ``batch`` samples' trained tokens as flat terms
    (log-probs, the sampler's log-probs, the sample's advantage on each term, its segment id), lengths uniform in
    [T/2, T]."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(length // 2, length + 1, (batch,), generator=gen)
    segment = torch.repeat_interleave(torch.arange(batch), lengths)
    logp = -torch.rand(len(segment), generator=gen) * 3
    old = logp + 0.05 * torch.randn(len(segment), generator=gen)
    advantages = torch.randn(batch, generator=gen)[segment]
    return {"logp": logp.to(device=device, dtype=dtype).requires_grad_(True), "old": old.to(device=device, dtype=dtype),
            "advantages": advantages.to(device=device, dtype=dtype), "segment": segment.to(device),
            "tokens": torch.tensor(float(len(segment)), device=device), "batch": batch}  # fmt: skip


def trl_async_clip(x: dict) -> torch.Tensor:
    # Deliberate replica of TRL 1.16's AsyncGRPOTrainer.compute_loss loss (the baseline): token clip on the flat
    # terms, summed, over the rank's share of the global token count.
    log_ratio = x["logp"] - x["old"]
    coef_1 = torch.exp(log_ratio)
    coef_2 = torch.clamp(coef_1, 1 - EPSILON, 1 + EPSILON)
    return -torch.min(coef_1 * x["advantages"], coef_2 * x["advantages"]).sum() / x["tokens"].clamp(min=1.0)


def _packed(x: dict, loss_name: str) -> torch.Tensor:
    # what AsyncReSPOTrainer runs: each sample's coefficient from its summed log-ratio, the loss on the flat terms
    return packed_policy_loss(x["logp"], x["old"], x["advantages"], x["segment"], loss_name, PARAMS,
                              normalizer=x["tokens"].clamp(min=1.0), num_sequences=x["batch"]).loss


PACKED_LOSSES = {"trl_clip": trl_async_clip, "respo": lambda x: _packed(x, "respo"),
                 "vespo": lambda x: _packed(x, "vespo")}  # fmt: skip


def bench_packed(length: int, args, log) -> dict:
    x = make_packed(args.batch, length, args.device, getattr(torch, args.dtype))
    row = {"length": length, "batch": args.batch, "tokens": int(x["tokens"]),
           "methods": time_methods(PACKED_LOSSES, x, args, "trl_clip")}  # fmt: skip
    m = row["methods"]
    log(f"packed T={length:6d}  trl_clip {m['trl_clip']['median_ms']:8.2f} ms  respo {m['respo']['median_ms']:8.2f} "
        f"ms ({m['respo']['ratio_to_trl_clip']:.2f}x)  vespo {m['vespo']['median_ms']:8.2f} ms "
        f"({m['vespo']['ratio_to_trl_clip']:.2f}x)")  # fmt: skip
    return row


def _iqr(values: list[float]) -> float:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return q[2] - q[0]


def table(rows: list[dict]) -> str:
    lines = [
        "| T (tokens/row) | method | median ms | IQR ms | x dapo (median of paired ratios) | peak MB |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for row in rows:
        for name, m in row["methods"].items():
            ratio = f"{m['ratio_to_dapo']:.2f}x" if name != "diagnostics" else f"({m['ratio_to_dapo']:.2f}x)"
            lines.append(
                f"| {row['length']} | {name} | {m['median_ms']:.2f} | {m['iqr_ms']:.2f} | {ratio} | "
                f"{m['peak_mb']:.1f} |"
            )
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    names = list(rows[0]["methods"])
    colors = {"dapo": "tab:red", "vespo": "tab:purple", "respo": "tab:blue", "respo_mask": "tab:cyan",
              "diagnostics": "tab:gray"}
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(rows))]
        axes[0].bar(xs, [r["methods"][name]["median_ms"] for r in rows], width, label=name, color=colors.get(name))
        axes[1].bar(xs, [r["methods"][name]["ratio_to_dapo"] for r in rows], width, label=name,
                    color=colors.get(name))
        axes[2].bar(xs, [r["methods"][name]["peak_mb"] for r in rows], width, label=name, color=colors.get(name))
    labels = [f"{r['length'] // 1024}K" for r in rows]
    for ax, title in zip(axes, ("loss + backward, median ms", "time / dapo (median of paired ratios)",
                                "peak memory above inputs, MB")):
        ax.set_xticks(range(len(rows)), labels)
        ax.set_xlabel(f"completion length (batch {rows[0]['batch']})")
        ax.set_title(title)
        ax.grid(alpha=0.3, axis="y")
    axes[0].set_yscale("log")
    axes[1].axhline(1.10, color="k", ls="--", lw=0.8, label="goal: respo <= 1.10x dapo")
    axes[1].legend(fontsize=8)
    m = result["machine"]
    fig.suptitle(f"Policy-loss microbenchmark on {m['device_name']} ({m['threads']} thread(s)), torch {m['torch']}")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def machine(args) -> dict:
    return machine_info(args.device)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 8192, 32768])
    parser.add_argument("--repeats", type=int, default=25)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads; 0 keeps torch's default")
    parser.add_argument("--no-diagnostics", action="store_true", help="skip the diagnostics row")
    parser.add_argument("--trl-grpo-source", help="path of TRL 1.16's trl/trainer/grpo_trainer.py, for machines "
                        "without TRL: get_gamma_weights is compiled from it instead of imported")
    parser.add_argument("--out", default="docs/benchmarks/kernel_microbench/kernel_microbench.json")
    parser.add_argument("--plot", default=None, help="PNG path (default: --out with .png)")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--packed", action="store_true", help="the async trainer's packed-row loss against TRL's async "
                        "clip on the same packed rows (scatter included); --out defaults to .../packed.json")
    args = parser.parse_args(argv)
    if args.packed:
        return main_packed(args)

    if args.threads:
        torch.set_num_threads(args.threads)
    load_trl_gamma_weights(args.trl_grpo_source)  # import TRL once, before timing
    info = machine(args)
    info["vespo_from"] = _TRL["source"]
    check_on_policy_equivalence(args.device, getattr(torch, args.dtype))
    print(f"kernel microbench on {info['device_name']} ({info['threads']} thread(s)), batch {args.batch}, "
          f"{args.repeats} interleaved repeats after {args.warmup} warm-ups", flush=True)
    start = time.perf_counter()
    rows = [bench_length(length, args, lambda line: print(line, flush=True)) for length in args.lengths]
    worst = max(row["methods"]["respo"]["ratio_to_dapo"] for row in rows)
    worst_mask = max(row["methods"]["respo_mask"]["ratio_to_dapo"] for row in rows)
    result = {
        "config": {k: v for k, v in vars(args).items()},
        "machine": info,
        "rows": rows,
        "goal": {"respo_over_dapo_max": 1.10, "worst_respo_over_dapo": worst, "met": worst <= 1.10,
                 "worst_respo_mask_over_dapo": worst_mask, "met_with_mask": worst_mask <= 1.10},
        "runtime_s": time.perf_counter() - start,
    }
    print("\n" + table(rows))
    print(f"\ngoal respo <= 1.10x dapo: {'met' if worst <= 1.10 else 'MISSED'} (worst {worst:.2f}x; with the token "
          f"trust mask {worst_mask:.2f}x)")
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.out}")
        if not args.no_plot:
            png = args.plot or os.path.splitext(args.out)[0] + ".png"
            plot(result, png)
            print(f"wrote {png}")
    compact = {
        "machine": info["device_name"],
        "threads": info["threads"],
        **{f"{name}_T{row['length']}_ms": round(m["median_ms"], 3)
           for row in rows for name, m in row["methods"].items()},
        **{f"{name}_over_dapo_T{row['length']}": round(row["methods"][name]["ratio_to_dapo"], 3)
           for row in rows for name in ("respo", "respo_mask")},
        "goal_met": worst <= 1.10,
    }
    print(json.dumps(compact))
    return result


def main_packed(args) -> dict:
    """``--packed``: the table of docs/benchmarks/kernel_microbench.md's section on the async trainer."""
    if args.threads:
        torch.set_num_threads(args.threads)
    out = args.out if args.out != "docs/benchmarks/kernel_microbench/kernel_microbench.json" else \
        "docs/benchmarks/kernel_microbench/packed.json"
    info = machine(args)
    print(f"packed-row loss microbench on {info['device_name']} ({info['threads']} thread(s)), {args.batch} samples per "
          f"row, {args.repeats} interleaved repeats after {args.warmup} warm-ups", flush=True)
    start = time.perf_counter()
    rows = [bench_packed(length, args, lambda line: print(line, flush=True)) for length in args.lengths]
    result = {"config": dict(vars(args)), "machine": info, "rows": rows, "runtime_s": time.perf_counter() - start,
              "commit": code_commit(), "command": "OMP_NUM_THREADS=1 python -m benchmarks.kernel_microbench --packed"}  # fmt: skip
    lines = ["| T (max tokens/sample) | method | median ms | IQR ms | x trl_clip (median of paired ratios) | peak MB |",
             "|---:|---|---:|---:|---:|---:|"]
    for row in rows:
        for name, m in row["methods"].items():
            lines.append(f"| {row['length']} | {name} | {m['median_ms']:.2f} | {m['iqr_ms']:.2f} | "
                         f"{m['ratio_to_trl_clip']:.2f}x | {m['peak_mb']:.1f} |")
    print("\n" + "\n".join(lines))
    if out:
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
