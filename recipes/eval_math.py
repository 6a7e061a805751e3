"""Evaluate a checkpoint on math benchmarks: avg@n, unbiased pass@k and maj@n, graded like the training reward.

    # A trained output_dir (results land in it, where ReSPOTrainer's model card picks them up):
    python recipes/eval_math.py --model outputs/qwen3-respo --benchmarks math500 aime24 aime25 amc23 --n 16

    # A Hub model id, vLLM on 2 GPUs (used automatically when vLLM is installed and a GPU is visible):
    python recipes/eval_math.py --model Qwen/Qwen3-1.7B --benchmarks math500 aime24 --n 64 \
        --temperature 0.6 --top_p 0.95 --max_new_tokens 32768 --tensor_parallel_size 2

    # A local JSONL/parquet file with the MATH-500 columns, on CPU with transformers (this is what the tests run):
    python recipes/eval_math.py --model path/to/snapshot --benchmarks tests/data/math500_sample.jsonl \
        --n 4 --max_new_tokens 64 --backend transformers --output_dir eval-out

Why it looks like this: users judge an RLVR checkpoint by its benchmark table, so the table must be reproducible and
graded exactly like training. Every completion is graded by ``respo_trl.grading.grade``, which calls TRL's
``accuracy_reward`` (the reward ReSPO trains with); the metric definitions are in ``docs/evaluation.md``.

Benchmarks are named by a short name (``math500``, ``aime24``, ``aime25``, ``amc23``: see ``BENCHMARKS``), a Hub
dataset id (``owner/name``, optionally ``owner/name:config@split``) or a local ``.jsonl``/``.json``/``.parquet``
file. Each is mapped to the common schema ``problem``/``answer`` by looking for the usual column names (override with
``--problem_column``/``--answer_column``). Outputs: ``eval_math.json`` (every setting, the command, versions and
metrics), ``eval_math.md`` (the table) and, with ``--save_samples``, ``eval_math_samples.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import sys
import time
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

logger = logging.getLogger("eval_math")

DEFAULT_SYSTEM_PROMPT = "Please reason step by step, and put your final answer within \\boxed{}."
RESULTS_JSON, RESULTS_MD, SAMPLES_JSONL = "eval_math.json", "eval_math.md", "eval_math_samples.jsonl"
PROBLEM_COLUMNS = ("problem", "Problem", "question", "Question")
ANSWER_COLUMNS = ("answer", "Answer", "expected_answer", "final_answer")
ID_COLUMNS = ("unique_id", "id", "ID", "idx", "index")
LOCAL_SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


@dataclass(frozen=True)
class BenchmarkSpec:
    dataset: str  # Hub id or local file
    split: str = "test"
    config: str | None = None


BENCHMARKS = {
    "math500": BenchmarkSpec("HuggingFaceH4/MATH-500", "test"),  # problem, solution, answer, subject, level, unique_id
    "aime24": BenchmarkSpec("HuggingFaceH4/aime_2024", "train"),  # id, problem, solution, answer, url, year
    "aime25": BenchmarkSpec("math-ai/aime25", "test"),  # id, problem, answer
    "amc23": BenchmarkSpec("math-ai/amc23", "test"),  # id, question, answer (numbers), url
}


@dataclass
class Problem:
    uid: str
    problem: str
    answer: str


# -- data ------------------------------------------------------------------------------------------------------------------


def resolve_benchmark(name: str) -> tuple[str, BenchmarkSpec]:
    """Short name, local file or ``owner/name[:config][@split]`` -> (label, spec)."""
    if name in BENCHMARKS:
        return name, BENCHMARKS[name]
    path = Path(name)
    if path.suffix in LOCAL_SUFFIXES:
        if not path.is_file():
            raise FileNotFoundError(f"benchmark file {name!r} does not exist")
        return path.stem, BenchmarkSpec(str(path), "train")
    spec, _, split = name.partition("@")
    dataset, _, config = spec.partition(":")
    if dataset.count("/") != 1:
        raise ValueError(
            f"unknown benchmark {name!r}: use one of {sorted(BENCHMARKS)}, a .jsonl/.json/.parquet file, or a Hub "
            "dataset id owner/name[:config][@split]"
        )
    return name, BenchmarkSpec(dataset, split or "test", config or None)


def pick_column(columns, wanted: str | None, candidates: tuple[str, ...], what: str, dataset: str) -> str | None:
    if wanted is not None:
        if wanted not in columns:
            raise ValueError(f"{dataset}: column {wanted!r} not found (columns: {list(columns)})")
        return wanted
    for name in candidates:
        if name in columns:
            return name
    if what == "id":
        return None
    raise ValueError(f"{dataset}: no {what} column among {list(columns)}; pass --{what}_column")


def load_problems(spec: BenchmarkSpec, problem_column=None, answer_column=None, limit=None) -> list[Problem]:
    """Load a benchmark into the common schema (``problem``, ``answer`` as strings, and an id)."""
    from datasets import load_dataset

    suffix = Path(spec.dataset).suffix
    if suffix in LOCAL_SUFFIXES and Path(spec.dataset).is_file():
        data = load_dataset(LOCAL_SUFFIXES[suffix], data_files=spec.dataset, split="train")
    else:
        data = load_dataset(spec.dataset, spec.config, split=spec.split)
    columns = data.column_names
    p_col = pick_column(columns, problem_column, PROBLEM_COLUMNS, "problem", spec.dataset)
    a_col = pick_column(columns, answer_column, ANSWER_COLUMNS, "answer", spec.dataset)
    id_col = pick_column(columns, None, ID_COLUMNS, "id", spec.dataset)
    if limit is not None:
        data = data.select(range(min(limit, len(data))))
    problems = []
    for i, row in enumerate(data):
        answer = row[a_col]
        if isinstance(answer, float) and answer.is_integer():
            answer = int(answer)
        problems.append(Problem(str(row[id_col]) if id_col else str(i), str(row[p_col]), str(answer)))
    return problems


def build_prompts(
    tokenizer, problems, system_prompt: str, prompt_template: str, chat_template_kwargs: dict
) -> list[str]:
    """Chat-formatted prompt texts (system prompt asking for ``\\boxed{}``, then the problem as the user turn)."""
    prompts = []
    for p in problems:
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        messages.append({"role": "user", "content": prompt_template.format(problem=p.problem)})
        if tokenizer.chat_template is None:
            text = "\n\n".join(m["content"] for m in messages) + "\n\n"
        else:
            text = tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True, **chat_template_kwargs
            )
        prompts.append(text)
    return prompts


# -- generation ------------------------------------------------------------------------------------------------------------


@dataclass
class Sampling:
    n: int
    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int
    seed: int


def vllm_available() -> bool:
    try:
        import vllm
    except ImportError:
        return False
    import torch

    return torch.cuda.is_available()


def generate_transformers(
    model, tokenizer, prompts: list[str], sampling: Sampling, batch_size: int
) -> list[list[str]]:
    """``n`` completions per prompt with ``model.generate``: left-padded batches of ``batch_size`` sequences, prompts
    sorted by length to limit padding, a tqdm bar counting sequences."""
    import torch
    from tqdm.auto import tqdm
    from transformers import set_seed

    set_seed(sampling.seed)
    device = next(model.parameters()).device
    lengths = [len(tokenizer(p, add_special_tokens=False).input_ids) for p in prompts]
    jobs = sorted(((i, j) for i in range(len(prompts)) for j in range(sampling.n)), key=lambda job: -lengths[job[0]])
    outputs: list[list[str | None]] = [[None] * sampling.n for _ in prompts]
    sample = sampling.temperature > 0
    kwargs = dict(max_new_tokens=sampling.max_new_tokens, do_sample=sample, pad_token_id=tokenizer.pad_token_id)
    if sample:
        kwargs.update(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k)
    else:  # greedy: neutralise sampling defaults a checkpoint's generation_config may carry
        kwargs.update(temperature=None, top_p=None, top_k=None)
    with tqdm(total=len(jobs), desc="generating", unit="seq") as bar:
        for start in range(0, len(jobs), batch_size):
            chunk = jobs[start : start + batch_size]
            encoded = tokenizer(
                [prompts[i] for i, _ in chunk], return_tensors="pt", padding=True, add_special_tokens=False
            ).to(device)
            with torch.no_grad():
                generated = model.generate(**encoded, **kwargs)
            texts = tokenizer.batch_decode(generated[:, encoded["input_ids"].shape[1] :], skip_special_tokens=True)
            for (i, j), text in zip(chunk, texts, strict=True):
                outputs[i][j] = text
            bar.update(len(chunk))
    return outputs


def load_vllm(args, seed: int):
    """The vLLM engine, built once per run (it is reused for every benchmark)."""
    from vllm import LLM

    return LLM(
        model=args.model,
        revision=args.revision,
        dtype=args.dtype,
        tensor_parallel_size=args.tensor_parallel_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=args.max_model_len,
        seed=seed,
        trust_remote_code=args.trust_remote_code,
    )


def generate_vllm(llm, tokenizer, prompts: list[str], sampling: Sampling) -> list[list[str]]:
    """``n`` completions per prompt with vLLM's offline ``LLM.generate`` (its own tqdm bar). Prompts are passed as
    token ids, as TRL does, so the chat template's tokens are not re-tokenised with extra special tokens."""
    from vllm import SamplingParams

    params = SamplingParams(
        n=sampling.n,
        temperature=sampling.temperature,
        top_p=sampling.top_p if sampling.temperature > 0 else 1.0,
        top_k=sampling.top_k
        if sampling.top_k > 0
        else -1,  # -1 disables top-k in every vLLM release (0 only in newer)
        max_tokens=sampling.max_new_tokens,
    )
    requests = [{"prompt_token_ids": tokenizer(p, add_special_tokens=False).input_ids} for p in prompts]
    results = llm.generate(requests, sampling_params=params, use_tqdm=True)
    return [[completion.text for completion in result.outputs] for result in results]


def load_transformers_model(args):
    import torch
    from transformers import AutoModelForCausalLM

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = AutoModelForCausalLM.from_pretrained(
        args.model, revision=args.revision, dtype=args.dtype, trust_remote_code=args.trust_remote_code
    )
    return model.to(device).eval()


def load_tokenizer(args):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        args.model, revision=args.revision, trust_remote_code=args.trust_remote_code
    )
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


# -- scoring and reports ---------------------------------------------------------------------------------------------------


def score_benchmark(label: str, spec: BenchmarkSpec, problems: list[Problem], completions: list[list[str]], ks):
    """Grade every sample with the training reward and reduce to the benchmark's metrics and per-sample records."""
    from tqdm.auto import tqdm

    from respo_trl.grading import aggregate, gold_solution, grade, problem_metrics

    per_problem, samples, skipped = [], [], []
    graded = tqdm(
        zip(problems, completions, strict=True), total=len(problems), desc=f"grading {label}", unit="problem"
    )
    for problem, texts in graded:
        grades = grade(texts, [gold_solution(problem.answer)] * len(texts))
        if any(g.reward is None for g in grades):  # gold answer unparseable: the training reward skips it too
            skipped.append(problem.uid)
            continue
        metrics = problem_metrics(grades, texts, ks)
        per_problem.append(metrics)
        samples.extend(
            {
                "benchmark": label,
                "id": problem.uid,
                "sample": j,
                "answer": problem.answer,
                "parsed": g.answer,
                "correct": g.correct,
                "completion": text,
            }
            for j, (g, text) in enumerate(zip(grades, texts))
        )
    if skipped:
        logger.warning(f"{label}: {len(skipped)} problem(s) skipped, gold answer not parseable: {skipped[:10]}")
    row = {
        "benchmark": label,
        "dataset": spec.dataset,
        "config": spec.config,
        "split": spec.split,
        **aggregate(per_problem),
    }
    row["skipped"] = skipped
    return row, samples


def package_versions() -> dict:
    names = ["respo-trl", "trl", "transformers", "torch", "datasets", "math-verify", "vllm"]
    found = {}
    for name in names:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            if name == "respo-trl":
                from respo_trl import __version__

                found[name] = __version__
    return found


def default_output_dir(model: str) -> str:
    """A trained output_dir (it holds ``training_args.bin``) keeps its results; anything else gets its own folder."""
    if os.path.isdir(model) and os.path.isfile(os.path.join(model, "training_args.bin")):
        return model
    return os.path.join("eval_math", model.rstrip("/").split("/")[-1])


def write_report(report: dict, samples: list[dict], output_dir: str, save_samples: bool) -> None:
    from respo_trl.grading import results_table

    os.makedirs(output_dir, exist_ok=True)
    with open(os.path.join(output_dir, RESULTS_JSON), "w") as f:
        json.dump(report, f, indent=2)
    g = report["generation"]
    header = (
        f"`{report['model']}`, {g['n']} samples per problem, temperature {g['temperature']}, top-p {g['top_p']}, "
        f"max {g['max_new_tokens']} new tokens, {report['backend']}. Percentages; avg@n ± its standard error over "
        "problems.\n\n"
    )
    with open(os.path.join(output_dir, RESULTS_MD), "w") as f:
        f.write(header + results_table(report) + f"\n\nCommand: `{report['command']}`\n")
    if save_samples:
        with open(os.path.join(output_dir, SAMPLES_JSONL), "w") as f:
            f.writelines(json.dumps(record) + "\n" for record in samples)


# -- main ------------------------------------------------------------------------------------------------------------------


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", required=True, help="local directory (a trained output_dir or a snapshot) or Hub id"
    )
    parser.add_argument("--revision", default=None, help="Hub revision (branch, tag or commit) of --model")
    parser.add_argument(
        "--benchmarks", nargs="+", default=["math500"], help=f"short names {sorted(BENCHMARKS)}, Hub ids or files"
    )
    parser.add_argument("--n", type=int, default=4, help="samples per problem")
    parser.add_argument("--temperature", type=float, default=0.6, help="0 means greedy (then use --n 1)")
    parser.add_argument("--top_p", type=float, default=0.95)
    parser.add_argument("--top_k", type=int, default=0, help="0 disables top-k (TRL's default)")
    parser.add_argument("--max_new_tokens", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--ks", type=int, nargs="*", default=None, help="k for pass@k (default: powers of two < n, and n)"
    )
    parser.add_argument("--system_prompt", default=DEFAULT_SYSTEM_PROMPT, help="'' for no system turn")
    parser.add_argument("--prompt_template", default="{problem}", help="user turn; {problem} is replaced")
    parser.add_argument(
        "--chat_template_kwargs", type=json.loads, default={}, help="JSON, e.g. '{\"enable_thinking\": false}'"
    )
    parser.add_argument("--problem_column", default=None)
    parser.add_argument("--answer_column", default=None)
    parser.add_argument("--limit", type=int, default=None, help="first N problems of each benchmark (quick checks)")
    parser.add_argument("--backend", choices=["auto", "vllm", "transformers"], default="auto")
    parser.add_argument("--batch_size", type=int, default=32, help="transformers backend: sequences per generate call")
    parser.add_argument("--device", default=None, help="transformers backend: default cuda if available, else cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--tensor_parallel_size", type=int, default=1, help="vLLM backend")
    parser.add_argument("--gpu_memory_utilization", type=float, default=0.9, help="vLLM backend")
    parser.add_argument("--max_model_len", type=int, default=None, help="vLLM backend")
    parser.add_argument("--trust_remote_code", action="store_true")
    parser.add_argument(
        "--output_dir", default=None, help="default: --model if it is a trained output_dir, else eval_math/NAME"
    )
    parser.add_argument("--save_samples", action="store_true", help=f"also write every completion to {SAMPLES_JSONL}")
    args = parser.parse_args(argv)
    if args.n < 1:
        parser.error("--n must be >= 1")
    if args.temperature == 0 and args.n > 1:
        logger.warning("--temperature 0 is greedy decoding: the n samples of a problem are identical")
    return args


def main(argv=None, generate=None) -> dict:
    """Run the evaluation; returns the report written to ``eval_math.json``.

    ``generate(prompts, sampling) -> completions`` replaces the model call (the tests use it to feed known answers).
    """
    args = parse_args(argv)
    from respo_trl.grading import default_ks

    sampling = Sampling(args.n, args.temperature, args.top_p, args.top_k, args.max_new_tokens, args.seed)
    ks = sorted({k for k in (args.ks or default_ks(args.n)) if 1 <= k <= args.n} | {1})
    backend = args.backend
    if backend == "auto":
        backend = "vllm" if vllm_available() else "transformers"
    if generate is not None:
        backend = "custom"
    tokenizer = load_tokenizer(args)
    if generate is None:
        if backend == "transformers":
            model = load_transformers_model(args)
            generate = lambda prompts, s: generate_transformers(model, tokenizer, prompts, s, args.batch_size)
        else:
            llm = load_vllm(args, args.seed)
            generate = lambda prompts, s: generate_vllm(llm, tokenizer, prompts, s)

    rows, all_samples = [], []
    started = time.time()
    for name in args.benchmarks:
        label, spec = resolve_benchmark(name)
        problems = load_problems(spec, args.problem_column, args.answer_column, args.limit)
        logger.info(f"{label}: {len(problems)} problems x {args.n} samples ({backend})")
        prompts = build_prompts(
            tokenizer, problems, args.system_prompt, args.prompt_template, args.chat_template_kwargs
        )
        completions = generate(prompts, sampling)
        row, samples = score_benchmark(label, spec, problems, completions, ks)
        rows.append(row)
        all_samples.extend(samples)

    command = shlex.join(["python", "recipes/eval_math.py", *(sys.argv[1:] if argv is None else argv)])
    from respo_trl.hub.card import weights_fingerprint

    report = {
        "model": args.model,
        "revision": args.revision,
        "weights_sha256": weights_fingerprint(args.model),  # lets a model card check these are its weights
        "backend": backend,
        "generation": {
            "n": args.n,
            "temperature": args.temperature,
            "top_p": args.top_p,
            "top_k": args.top_k,
            "max_new_tokens": args.max_new_tokens,
            "seed": args.seed,
            "system_prompt": args.system_prompt,
            "prompt_template": args.prompt_template,
            "chat_template_kwargs": args.chat_template_kwargs,
        },
        "grading": "respo_trl.grading.grade (trl.rewards.accuracy_reward, math-verify), gold answers boxed",
        "results": rows,
        "command": command,
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "seconds": round(time.time() - started, 1),
        "versions": package_versions(),
    }
    output_dir = args.output_dir or default_output_dir(args.model)
    write_report(report, all_samples, output_dir, args.save_samples)
    from respo_trl.grading import results_table

    print(results_table(report))
    print(f"\nwrote {os.path.join(output_dir, RESULTS_JSON)} and {RESULTS_MD}")
    return report


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
    main()
