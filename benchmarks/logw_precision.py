"""How much rounding noise the lm_head's precision puts into ReSPO's raw sequence log-weight ``log W``.

ReSPO sums token log-ratios over the whole response (``l_i = sum_t log pi_theta - log pi_old``, no length
normalisation), so per-token rounding noise adds up over thousands of tokens, while the true signal of one small
update (lr 1e-6) is ~1e-3 to 1e-2 per response. TRL computes log-probs from bf16 logits by default
(``cast_lm_head_to_fp32=False``): the logits and their log-softmax are rounded to bf16 (8 significant bits). Two
computations of the same tokens with the same weights that differ only in floating-point order (vLLM's forward and the
trainer's, two batch shapes) then disagree by whole bf16 steps on some tokens, and ``log W`` of a fresh rollout is
not 0.

This script measures that on a CPU with the real Qwen3-1.7B head shape (hidden 2048, vocabulary 151,936, random
weights scaled so that the next-token distributions are peaked like a trained model's), for the lm_head in bf16 (TRL's
default) and in fp32 (``cast_lm_head_to_fp32=True``), in two scenarios:

* ``order``: identical final hidden states, the head's product accumulated in two different orders (the same model
  computed twice with different kernels or batch shapes);
* ``hidden``: final hidden states that differ by bf16 rounding noise (two implementations whose upstream layers
  round differently, as vLLM and transformers do).

Per-token differences are independent across positions here, so the noise of a sum over ``T`` tokens is measured on
windows of up to 256 tokens and reported as ``sqrt(T)`` times the per-token standard deviation for ``T`` up to 15,360
(the paper's 1.7B response cap); the window measurements check the ``sqrt(T)`` scaling.

    python -m benchmarks.logw_precision                 # ~6-11 min on one core; docs/benchmarks/logw_precision/logw_precision.json
    python -m benchmarks.logw_precision --tokens 256    # a smoke run (the test suite)
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import command, machine_info

HIDDEN, VOCAB = 2048, 151_936  # Qwen3-1.7B (tied embeddings)
LENGTHS = (1024, 4096, 8192, 15_360)
WINDOWS = (16, 64, 256)


def log_probs(hidden: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor, head: str, chunks: int = 1):
    """Log-probs of ``tokens`` as TRL computes them: ``head='bf16'`` rounds the logits to bf16 and takes a bf16
    log-softmax (TRL's ``selective_log_softmax`` on bf16 logits); ``'fp32'`` keeps logits and log-softmax in fp32.
    The product is accumulated in fp32 (as GPU tensor cores do), over ``chunks`` slices of the hidden dimension added
    in order: a different ``chunks`` is a different summation order."""
    h = hidden.to(torch.bfloat16).float()  # the model's last hidden state is bf16 in a bf16 model
    w = weight.to(torch.bfloat16).float() if head == "bf16" else weight
    logits = sum(hc @ wc.T for hc, wc in zip(h.chunk(chunks, -1), w.chunk(chunks, -1)))
    if head == "bf16":
        logits = logits.to(torch.bfloat16)
        return torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(-1).float()
    return (logits.gather(-1, tokens[:, None]).squeeze(-1) - torch.logsumexp(logits, -1)).float()


def measure(n_tokens: int, logit_scale: float, seed: int = 0, block: int = 256) -> dict:
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(VOCAB, HIDDEN, generator=gen) * (logit_scale / math.sqrt(HIDDEN))
    diffs = {(head, scenario): [] for head in ("bf16", "fp32") for scenario in ("order", "hidden")}
    entropy, top_p = [], []
    for start in range(0, n_tokens, block):
        rows = min(block, n_tokens - start)
        hidden = torch.randn(rows, HIDDEN, generator=gen)  # unit RMS, as after the final RMSNorm
        with torch.no_grad():
            logits = hidden @ weight.T
            probs = torch.softmax(logits, -1)
            tokens = torch.multinomial(probs, 1, generator=gen).squeeze(-1)  # sampled at temperature 1
            entropy.append(-(probs * torch.log(probs.clamp_min(1e-30))).sum(-1))
            top_p.append(probs.max(-1).values)
            # one bf16 step of noise on the hidden state, as two implementations' upstream rounding differs
            nudged = hidden + hidden.abs() * 2.0**-8 * (torch.rand(rows, HIDDEN, generator=gen) - 0.5)
            for head in ("bf16", "fp32"):
                base = log_probs(hidden, weight, tokens, head)
                diffs[(head, "order")].append(log_probs(hidden, weight, tokens, head, chunks=4) - base)
                diffs[(head, "hidden")].append(log_probs(nudged, weight, tokens, head) - base)
    out = {
        "logit_scale": logit_scale,
        "tokens": n_tokens,
        "entropy_per_token": torch.cat(entropy).mean().item(),
        "top_token_probability": torch.cat(top_p).mean().item(),
        "paths": {},
    }
    for (head, scenario), parts in diffs.items():
        d = torch.cat(parts).double()
        per_token_sd = d.std().item()
        windows = {}
        for width in WINDOWS:
            sums = d[: (len(d) // width) * width].reshape(-1, width).sum(-1)
            if len(sums) > 2:
                windows[width] = {"sd": sums.std().item(), "sqrt_T_prediction": per_token_sd * math.sqrt(width)}
        out["paths"][f"{head}/{scenario}"] = {
            "head": head, "scenario": scenario, "per_token_mean": d.mean().item(), "per_token_sd": per_token_sd,
            "nonzero_share": (d != 0).double().mean().item(), "windows": windows,
            "log_w_sd": {T: per_token_sd * math.sqrt(T) for T in LENGTHS},
            "log_w_bias": {T: d.mean().item() * T for T in LENGTHS},
        }  # fmt: skip
    return out


def markdown(result: dict) -> str:
    lines = [
        "| logit scale | entropy (nats/token) | top-token p | lm_head | scenario | tokens changed | per-token sd "
        "| window 256: sd (sqrt(T) pred.) | log W sd at T = " + " / ".join(f"{T:,}" for T in LENGTHS) + " |",
        "|---:|---:|---:|---|---|---:|---:|---|---|",
    ]
    for m in result["measurements"]:
        for path in m["paths"].values():
            windows = {int(k): v for k, v in path["windows"].items()}  # JSON keys are strings
            w = windows.get(256) or windows[max(windows)]
            log_w_sd = {int(k): v for k, v in path["log_w_sd"].items()}
            lines.append(
                f"| {m['logit_scale']:g} | {m['entropy_per_token']:.2f} | {m['top_token_probability']:.2f} "
                f"| {path['head']} | {path['scenario']} | {100 * path['nonzero_share']:.1f}% "
                f"| {path['per_token_sd']:.2e} | {w['sd']:.3g} ({w['sqrt_T_prediction']:.3g}) | "
                + " / ".join(f"{log_w_sd[T]:.3g}" for T in LENGTHS) + " |"
            )
    return "\n".join(lines)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=1024, help="Tokens per logit scale (block-wise, 256 at a time).")
    p.add_argument("--logit-scales", type=float, nargs="+", default=[4.0, 8.0],
                   help="Standard deviation of the random logits (4: ~4 nats/token; 8: peaked, ~0.6).")  # fmt: skip
    p.add_argument("--out", default="docs/benchmarks/logw_precision", help="Folder for logw_precision.json.")
    p.add_argument("--markdown-from", metavar="JSON", help="Print the docs table of an existing result and exit.")
    args = p.parse_args(argv)
    if args.markdown_from:
        result = json.loads(Path(args.markdown_from).read_text())
        print(markdown(result))
        return result
    torch.set_num_threads(1)

    start = time.time()
    result = {"measurements": [measure(args.tokens, scale) for scale in args.logit_scales]}
    result.update(machine=machine_info(), wall_s=time.time() - start,
                  command=command("logw_precision", sys.argv[1:] if argv is None else argv))  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "logw_precision.json").write_text(json.dumps(result, indent=1))
    print(markdown(result))
    print(f"\nwrote {out / 'logw_precision.json'} ({result['wall_s']:.0f} s)")
    return result


if __name__ == "__main__":
    main()
