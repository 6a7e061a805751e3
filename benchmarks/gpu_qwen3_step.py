"""bf16 step time and peak memory of real-size Qwen3 configs under the ReSPO loss, and the loss kernel alone at up to
32K completion tokens, on one GPU.

What it measures (random-init weights from the published Qwen3 configurations; nothing is downloaded):

1. ``model``: one micro-batch of ``B x (P + C)`` tokens through Qwen3-{0.6B, 1.7B, 4B, 8B} in bf16 with activation
   checkpointing, per-token log-probs of the completion (row-wise log-softmax, as TRL does for bf16), the ReSPO loss
   against off-policy behaviour log-probs, backward, and an AdamW step. ReSPO and TRL's clipped ``dapo`` loss are
   interleaved step by step on the same model, so the ratio is measured in one run. Also a 30B-A3B MoE geometry
   truncated to a few layers (the full model does not train on one GPU), and Qwen3-0.6B on one 32K-token completion.
2. ``kernel``: the loss plus backward on synthetic log-probs (batch 64, completion lengths 1K/8K/32K) for ``respo``,
   TRL's ``dapo`` expression and TRL's ``vespo`` weight, timed with CUDA events (median of interleaved repeats).
3. ``logw_noise``: ReSPO's raw ``log W`` at staleness 0 in bf16. The same weights score the same tokens twice, once
   with all rows in one batch and once row by row (what two forwards with different shapes or kernels do, as the
   trainer's and vLLM's do), with the lm_head in bf16 (TRL's default; bf16 logits, bf16 log-softmax) and in fp32
   (``cast_lm_head_to_fp32=True``). Reported: the standard deviation over rows of ``log W = sum_t (lp_1 - lp_2)``,
   which a true ``log W`` of 0 makes pure rounding noise (docs/benchmarks/logw_precision.md has the CPU proxy). In a
   TRL run the same number is ``offpolicy/log_weight/std`` on the fresh steps (``reuse/staleness_max == 0``).

Run on a GPU machine (prints a table last, writes ``$OUT/gpu_qwen3_step.json`` or ``--out``):

    python -m benchmarks.gpu_qwen3_step --out docs/benchmarks/gpu_qwen3_step
    python -m benchmarks.gpu_qwen3_step --smoke          # tiny shapes, runs on CPU too: checks the script itself
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import traceback

import torch

from respo_trl.kernels import LossParams, respo_weights, vespo_phi

QWEN3 = {  # published configs (hidden, layers, heads, kv heads, intermediate, tied embeddings)
    "Qwen3-0.6B": dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, intermediate_size=3072, tie_word_embeddings=True),
    "Qwen3-1.7B": dict(hidden_size=2048, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, intermediate_size=6144, tie_word_embeddings=True),
    "Qwen3-4B": dict(hidden_size=2560, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, intermediate_size=9728, tie_word_embeddings=True),
    "Qwen3-8B": dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, intermediate_size=12288, tie_word_embeddings=False),
}
QWEN3_MOE_30B_A3B = dict(
    hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, moe_intermediate_size=768, intermediate_size=6144,
    num_experts=128, num_experts_per_tok=8, decoder_sparse_step=1, tie_word_embeddings=False,
)
COMMON = dict(vocab_size=151936, head_dim=128, rope_theta=1_000_000.0, max_position_embeddings=40960)
PARAMS = LossParams()


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def now(device):
    sync(device)
    return time.perf_counter()


# -- losses, exactly as the trainer computes them (dapo: TRL 1.16's expression; respo: respo_trl.kernels) ------------


def dapo_loss(logps, old, adv, mask, num_items):
    coef_1 = torch.exp(logps - old)
    coef_2 = torch.clamp(coef_1, 1 - PARAMS.epsilon_low, 1 + PARAMS.epsilon_high)
    per_token = -torch.min(coef_1 * adv, coef_2 * adv)
    return (per_token * mask).sum() / num_items


def respo_loss(logps, old, adv, mask, num_items):
    coef = respo_weights(logps - old, adv, mask, PARAMS).coefficients  # (B, T), what trl_loss.respo_grpo_loss applies
    return (-coef * adv * logps * mask).sum() / num_items


def vespo_loss(logps, old, adv, mask, num_items):
    phi = vespo_phi(logps - old, adv, mask, PARAMS)  # (B, 1)
    return (-phi * adv * logps * mask).sum() / num_items


LOSSES = {"dapo": dapo_loss, "respo": respo_loss, "vespo": vespo_loss}


def completion_logps(model, input_ids, completion_len):
    logits = model(input_ids=input_ids, logits_to_keep=completion_len + 1).logits[:, :-1]
    targets = input_ids[:, -completion_len:]
    rows = [torch.gather(row.float().log_softmax(-1), -1, t.unsqueeze(-1)).squeeze(-1) for row, t in zip(logits, targets)]
    return torch.stack(rows)


def bench_model(name, config_kwargs, batch, prompt_len, completion_len, steps, device, moe=False):
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    cfg_cls, model_cls = (Qwen3MoeConfig, Qwen3MoeForCausalLM) if moe else (Qwen3Config, Qwen3ForCausalLM)
    config = cfg_cls(**{**COMMON, **config_kwargs})
    config._attn_implementation = "sdpa"
    t0 = now(device)
    with torch.device(device):
        model = model_cls(config).to(torch.bfloat16)
    model.gradient_checkpointing_enable()
    model.config.use_cache = False
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-7, foreach=True)
    build_s = now(device) - t0
    n_params = sum(p.numel() for p in model.parameters())

    tokens = batch * (prompt_len + completion_len)
    input_ids = torch.randint(0, config.vocab_size, (batch, prompt_len + completion_len), device=device)
    lengths = torch.randint(completion_len // 2, completion_len + 1, (batch,), device=device)
    mask = (torch.arange(completion_len, device=device) < lengths[:, None]).float()
    adv = torch.randn(batch, 1, device=device)
    times = {"respo": [], "dapo": []}
    fwd_bwd = {"respo": [], "dapo": []}
    old = None
    for step in range(steps + 1):  # step 0 warms up both losses
        for loss_name in ("respo", "dapo") if step % 2 else ("dapo", "respo"):
            t0 = now(device)
            logps = completion_logps(model, input_ids, completion_len)
            if old is None:
                old = (logps.detach() + 0.3 * torch.randn_like(logps)).detach()
            loss = LOSSES[loss_name](logps, old, adv, mask, mask.sum())
            loss.backward()
            t1 = now(device)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            t2 = now(device)
            if step > 0:
                fwd_bwd[loss_name].append(t1 - t0)
                times[loss_name].append(t2 - t0)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    result = {
        "model": name,
        "params_b": n_params / 1e9,
        "batch": batch,
        "prompt_len": prompt_len,
        "completion_len": completion_len,
        "tokens_per_microbatch": tokens,
        "build_s": build_s,
        "step_s_respo": statistics.median(times["respo"]),
        "step_s_dapo": statistics.median(times["dapo"]),
        "fwd_bwd_s_respo": statistics.median(fwd_bwd["respo"]),
        "fwd_bwd_s_dapo": statistics.median(fwd_bwd["dapo"]),
        "respo_over_dapo": statistics.median(times["respo"]) / statistics.median(times["dapo"]),
        "tokens_per_s_respo": tokens / statistics.median(times["respo"]),
        "peak_mem_gib": peak,
        "steps_timed": steps,
    }
    del model, optimizer
    return result


def bench_logw_noise(name, config_kwargs, batch, prompt_len, completion_len, device):
    """log W of fresh rollouts (true value 0) from two bf16 forwards that differ only in batch shape, per lm_head."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(**{**COMMON, **config_kwargs})
    config._attn_implementation = "sdpa"
    with torch.device(device):
        model = Qwen3ForCausalLM(config).to(torch.bfloat16).eval()
    ids = torch.randint(0, config.vocab_size, (batch, prompt_len + completion_len), device=device)
    weight = model.lm_head.weight

    @torch.no_grad()
    def scores(rows, head):
        hidden = model.model(input_ids=rows).last_hidden_state[:, prompt_len - 1 : -1]
        targets = rows[:, prompt_len:]
        out = []
        for h, t in zip(hidden, targets):  # row by row, as TRL's selective_log_softmax loops for bf16
            if head == "fp32":
                logits = h.float() @ weight.float().T
                out.append(logits.gather(-1, t[:, None]).squeeze(-1) - torch.logsumexp(logits, -1))
            else:
                logp = torch.log_softmax(h @ weight.T, -1)  # bf16 logits and log-softmax
                out.append(logp.gather(-1, t[:, None]).squeeze(-1).float())
        return torch.stack(out)

    result = {"model": name, "batch": batch, "prompt_len": prompt_len, "completion_len": completion_len}
    for head in ("bf16", "fp32"):
        together = scores(ids, head)
        alone = torch.cat([scores(ids[i : i + 1], head) for i in range(batch)])
        diff = (together - alone).double()
        log_w = diff.sum(-1)
        result[head] = {
            "log_w_sd": log_w.std().item() if batch > 1 else None, "log_w_abs_max": log_w.abs().max().item(),
            "per_token_sd": diff.std().item(), "tokens_changed": (diff != 0).double().mean().item(),
        }  # fmt: skip
    del model
    return result


def bench_kernel(length, batch, repeats, device):
    gen = torch.Generator(device=device).manual_seed(length)
    logps0 = -torch.rand(batch, length, device=device, generator=gen) * 3
    old = logps0 + 0.2 * torch.randn(batch, length, device=device, generator=gen)
    lengths = torch.randint(length // 2, length + 1, (batch,), device=device, generator=gen)
    mask = (torch.arange(length, device=device) < lengths[:, None]).float()
    adv = torch.randn(batch, 1, device=device, generator=gen)
    num_items = mask.sum()
    samples = {name: [] for name in LOSSES}

    def run(name):
        logps = logps0.clone().requires_grad_(True)
        loss = LOSSES[name](logps, old, adv, mask, num_items)
        loss.backward()
        return logps.grad

    for name in LOSSES:  # warm-up
        run(name)
    for rep in range(repeats):
        order = list(LOSSES) if rep % 2 == 0 else list(reversed(LOSSES))
        for name in order:
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                run(name)
                end.record()
                torch.cuda.synchronize()
                samples[name].append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                run(name)
                samples[name].append(time.perf_counter() - t0)
    peaks = {}
    for name in LOSSES:
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            run(name)
            torch.cuda.synchronize()
            peaks[name] = (torch.cuda.max_memory_allocated() - base) / 2**20
        else:
            peaks[name] = float("nan")
    med = {name: statistics.median(v) for name, v in samples.items()}
    return {
        "batch": batch,
        "length": length,
        "tokens": batch * length,
        **{f"ms_{n}": 1e3 * med[n] for n in LOSSES},
        **{f"peak_extra_mib_{n}": peaks[n] for n in LOSSES},
        "respo_over_dapo": med["respo"] / med["dapo"],
        "vespo_over_dapo": med["vespo"] / med["dapo"],
        "repeats": repeats,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (checks the script on CPU)")
    parser.add_argument("--models", default="Qwen3-0.6B,Qwen3-1.7B,Qwen3-4B,Qwen3-8B")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "gpu_qwen3_step.json")
    report = {
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "smoke": args.smoke,
        "kernel": [],
        "model": [],
        "logw_noise": [],
        "errors": [],
    }
    try:
        import transformers

        report["transformers"] = transformers.__version__
    except ImportError:
        pass

    def save():
        with open(path, "w") as f:
            json.dump(report, f, indent=1)

    kernel_lengths, kernel_batch, repeats = ([64, 256], 8, 5) if args.smoke else ([1024, 8192, 32768], 64, 30)
    for length in kernel_lengths:
        report["kernel"].append(bench_kernel(length, kernel_batch, repeats, device))
        print("kernel", json.dumps(report["kernel"][-1]), flush=True)
        save()

    if args.smoke:
        plans = [("Qwen3-tiny", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, tie_word_embeddings=True, head_dim=16, vocab_size=512), 2, 8, 16, 2, False)]
        plans.append(("Qwen3-MoE-tiny", {**QWEN3_MOE_30B_A3B, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2, "num_hidden_layers": 2, "head_dim": 16, "vocab_size": 512}, 2, 8, 16, 2, True))
    else:
        batch_for = {"Qwen3-0.6B": 4, "Qwen3-1.7B": 4, "Qwen3-4B": 2, "Qwen3-8B": 2}
        plans = [(m, QWEN3[m], batch_for[m], 512, 4096, 4, False) for m in args.models.split(",")]
        plans.append(("Qwen3-0.6B@32K", QWEN3["Qwen3-0.6B"], 1, 512, 32768, 3, False))
        plans.append(("Qwen3-30B-A3B (4 of 48 layers)", {**QWEN3_MOE_30B_A3B, "num_hidden_layers": 4}, 2, 512, 4096, 3, True))
    noise_plans = ([("Qwen3-tiny", plans[0][1], 4, 8, 64)] if args.smoke else
                   [("Qwen3-1.7B", QWEN3["Qwen3-1.7B"], 8, 512, 8192), ("Qwen3-1.7B", QWEN3["Qwen3-1.7B"], 4, 512, 15360)])
    for name, kwargs, batch, prompt_len, completion_len in noise_plans:  # first: the cheapest answer to the risk
        try:
            report["logw_noise"].append(bench_logw_noise(name, kwargs, batch, prompt_len, completion_len, device))
            print("logw_noise", json.dumps(report["logw_noise"][-1]), flush=True)
        except Exception as error:
            report["errors"].append({"model": f"logw_noise {name}", "error": repr(error),
                                     "trace": traceback.format_exc()[-2000:]})  # fmt: skip
        save()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    for name, kwargs, batch, prompt_len, completion_len, steps, moe in plans:
        try:
            result = bench_model(name, kwargs, batch, prompt_len, completion_len, steps, device, moe=moe)
            report["model"].append(result)
            print("model", json.dumps(result), flush=True)
        except Exception as error:  # keep the other measurements if one configuration fails (e.g. OOM)
            report["errors"].append({"model": name, "error": repr(error), "trace": traceback.format_exc()[-2000:]})
            print("ERROR", name, repr(error), flush=True)
        save()
        if device.type == "cuda":
            torch.cuda.empty_cache()

    print(f"\ndevice: {report['device']}  torch {report['torch']}  transformers {report.get('transformers')}")
    print("\nloss + backward on synthetic log-probs (median ms; ratio to dapo)")
    print(f"{'B x L':>12} {'dapo':>9} {'respo':>9} {'vespo':>9} {'respo/dapo':>11} {'vespo/dapo':>11}")
    for k in report["kernel"]:
        print(f"{k['batch']:>4} x {k['length']:<6} {k['ms_dapo']:9.3f} {k['ms_respo']:9.3f} {k['ms_vespo']:9.3f} {k['respo_over_dapo']:11.3f} {k['vespo_over_dapo']:11.3f}")
    print("\nbf16 micro-batch step (fwd+bwd+AdamW), activation checkpointing, median s")
    print(f"{'model':<32} {'B x (P+C)':>16} {'respo s':>8} {'dapo s':>8} {'ratio':>6} {'tok/s':>9} {'peak GiB':>9}")
    for m in report["model"]:
        shape = f"{m['batch']} x ({m['prompt_len']}+{m['completion_len']})"
        print(f"{m['model']:<32} {shape:>16} {m['step_s_respo']:8.3f} {m['step_s_dapo']:8.3f} {m['respo_over_dapo']:6.3f} {m['tokens_per_s_respo']:9.0f} {m['peak_mem_gib']:9.1f}")
    print("\nlog W of fresh rollouts (true 0): batch of B vs row by row, bf16 model; sd over rows by lm_head precision")
    for r in report["logw_noise"]:
        print(f"{r['model']:<14} {r['batch']} x {r['completion_len']:<6} bf16 head sd {r['bf16']['log_w_sd']}  "
              f"fp32 head sd {r['fp32']['log_w_sd']}  (tokens changed {r['bf16']['tokens_changed']:.3f} / "
              f"{r['fp32']['tokens_changed']:.3f})")  # fmt: skip
    for e in report["errors"]:
        print("ERROR", e["model"], e["error"])
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
