"""What a recipe run on the built-in sums taught SmolLM2: the answers' shape, and arithmetic with the shape held fixed.

A held-out gain on "Calculate 6+28." can come from two things: the model settling on an answer shape it computes well
in (``6 + 28 = 34`` and nothing after it, where the base model also chats and ends on another number), or the model
getting the sums themselves right more often. This separates them, for the base checkpoint and the trained one, on
the run's own held-out problems (rebuilt from its ``report.json``, prompts exactly as the recipe built them), graded
by ``last_integer_accuracy`` like the run:

- greedy and sampled accuracy (``--samples`` per problem at the run's temperature);
- the shape of each greedy answer (a bare number, ``a + b = c`` alone, ``a + b = c`` followed by text, other) and
  how often each shape is right; problems with and without a carry in the units;
- **shape held fixed**: the reply prefilled with ``"a + b ="`` and the next number read greedily, on the held-out
  problems and on ``--train-problems`` training problems; what changes here between the two checkpoints is arithmetic.

    python -m benchmarks.smollm2_answers --report docs/benchmarks/smollm2_cpu_vllm/last_integer_accuracy/report.json \
        --model outputs/smollm2-135m-instruct-q4 --model outputs/smollm2-135m-instruct-q4-dequantised-respo

vLLM in float32 (the trainer's arithmetic; its greedy answers equal the recipe's ``generate`` ones on the measured
run). Needs the vLLM environment (``tests/vllm_integration/run.sh``); one torch thread unless ``OMP_NUM_THREADS`` says.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
from collections import Counter
from pathlib import Path

from benchmarks.smollm2_task import shape

def run_datasets(report: dict, train_problems: int):
    """(held-out rows, training rows) of the run, prompts built by the recipe's own code from its arguments."""
    from respo_trl.recipe.arguments import RecipeArguments
    from respo_trl.recipe.data import build_datasets

    script = report["args"]["script"]
    names = {f.name for f in dataclasses.fields(RecipeArguments)}
    args = RecipeArguments(**{k: v for k, v in script.items() if k in names})
    train, heldout = build_datasets(args)
    return heldout, train.select(range(min(train_problems, len(train))))


def measure(model: str, heldout, train, temperature: float, samples: int, max_tokens: int) -> dict:
    from vllm import LLM, SamplingParams

    from respo_trl.rewards import last_integer_accuracy_reward as grade

    llm = LLM(model=model, dtype="float32", max_model_len=512, seed=0, enable_prefix_caching=False)
    tokenizer = llm.get_tokenizer()

    def chat(prompt):
        return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)

    def scores(texts, golds):
        return grade([[{"content": t}] for t in texts], list(golds))

    prompts = [chat(p) for p in heldout["prompt"]]
    greedy = [r.outputs[0].text for r in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens),
                                                      use_tqdm=False)]  # fmt: skip
    right = scores(greedy, heldout["solution"])
    sampled = llm.generate(prompts, SamplingParams(n=samples, temperature=temperature, max_tokens=max_tokens),
                           use_tqdm=False)  # fmt: skip
    sampled_right = [
        s for r, g in zip(sampled, heldout["solution"]) for s in scores([o.text for o in r.outputs], [g] * samples)
    ]
    shapes, carry = Counter(), Counter()
    for prompt, text, ok in zip(heldout["prompt"], greedy, right):
        shapes[(shape(text), bool(ok))] += 1
        a, b = (int(x) for x in re.findall(r"\d+", prompt[-1]["content"])[:2])
        carry[("carry" if a % 10 + b % 10 >= 10 else "no carry", bool(ok))] += 1

    def fixed_shape(rows):
        """The reply prefilled with 'a + b =', the next number read greedily (the shape held fixed)."""
        texts = []
        for prompt in rows["prompt"]:
            a, b = re.findall(r"\d+", prompt[-1]["content"])[:2]
            texts.append(chat(prompt) + f"{a} + {b} =")
        outputs = llm.generate(texts, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        numbers = [(re.match(r"\s*-?\d+", o.outputs[0].text) or [""])[0] for o in outputs]
        return sum(scores(numbers, rows["solution"])) / len(rows)

    result = {
        "model": model,
        "greedy_accuracy": sum(right) / len(right),
        "sampled_accuracy": sum(sampled_right) / len(sampled_right),
        "greedy_mean_tokens": sum(len(tokenizer(t)["input_ids"]) for t in greedy) / len(greedy),
        "shapes": {
            s: {"n": shapes[(s, True)] + shapes[(s, False)], "right": shapes[(s, True)]}
            for s in ("number only", "a + b = c", "a + b = c, then text", "other")
        },
        "carry": {
            c: {"n": carry[(c, True)] + carry[(c, False)], "right": carry[(c, True)]} for c in ("carry", "no carry")
        },
        "fixed_shape_accuracy": {"heldout": fixed_shape(heldout), "train": fixed_shape(train)},
        "examples": [{"prompt": p[-1]["content"], "answer": t} for p, t in zip(heldout["prompt"][:8], greedy[:8])],
    }
    return result


def markdown(results: list[dict], n_heldout: int, n_train: int) -> str:
    def pct(x):
        return f"{100 * x:.1f}%"

    lines = [
        f"| checkpoint | greedy | sampled | bare number | `a + b = c` alone | `a + b = c`, then text | other | carry / "
        f"no carry | shape fixed: held-out ({n_heldout}) / train ({n_train}) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        cells = [f"{v['right']}/{v['n']}" for v in r["shapes"].values()]
        carry = " / ".join(f"{v['right']}/{v['n']}" for v in r["carry"].values())
        fixed = r["fixed_shape_accuracy"]
        lines.append(f"| `{r['model']}` | {pct(r['greedy_accuracy'])} | {pct(r['sampled_accuracy'])} | "
                     + " | ".join(cells) + f" | {carry} | {pct(fixed['heldout'])} / {pct(fixed['train'])} |")  # fmt: skip
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--report", required=True, help="the run's report.json (task, prompt format, temperature)")
    parser.add_argument("--model", action="append", required=True, help="a checkpoint (repeat: base, then trained)")
    parser.add_argument("--samples", type=int, default=8, help="sampled answers per held-out problem")
    parser.add_argument("--train-problems", type=int, default=400, help="training problems for the fixed-shape check")
    parser.add_argument("--out", default=None, help="JSON to write (default: answers.json next to --report)")
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: no __main__ spawn
    report = json.loads(Path(args.report).read_text())
    heldout, train = run_datasets(report, args.train_problems)
    sampling = report.get("sampling") or {}
    results = [measure(m, heldout, train, sampling.get("temperature", 1.0), args.samples,
                       report["args"]["script"].get("eval_max_new_tokens") or sampling.get("max_completion_length", 48))
               for m in args.model]  # fmt: skip
    out = Path(args.out or Path(args.report).with_name("answers.json"))
    out.write_text(json.dumps({"heldout_n": len(heldout), "train_n": len(train), "samples": args.samples,
                               "results": results}, indent=1) + "\n")  # fmt: skip
    print(markdown(results, len(heldout), len(train)))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
