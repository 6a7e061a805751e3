"""Evaluate a checkpoint on math benchmarks: avg@n, unbiased pass@k and maj@n, graded like the training reward.
What ``python recipes/eval_math.py`` runs.

    # A trained output_dir (results land in it, where ReSPOTrainer's model card picks them up):
    python recipes/eval_math.py --model outputs/qwen3-respo --benchmarks math500 aime24 aime25 amc23 --n 16

    # The recipe's embedded default, as it trained (its report.json: the built-in task's held-out split, no system
    # prompt, 48 new tokens, temperature 1); nothing is downloaded. An earlier eval_math.json is kept, renamed:
    python recipes/eval_math.py --model outputs/qwen3-tiny-respo

    # A Hub model id, vLLM on 2 GPUs (used automatically when vLLM is installed and a GPU is visible):
    python recipes/eval_math.py --model Qwen/Qwen3-1.7B --benchmarks math500 aime24 --n 64 \
        --temperature 0.6 --top_p 0.95 --max_new_tokens 32768 --tensor_parallel_size 2

    # The ReSPO paper's protocol (AIME24/25, AMC23 x 16; MATH-500, OlympiadBench, MinervaMath x 4; temperature 1.0,
    # top-p 0.7, 16,384 new tokens), vLLM on 1 GPU; on N GPUs add --tensor_parallel_size N:
    python recipes/eval_math.py --model outputs/paper-qwen3-1.7b-base-respo-n32-seed0 --protocol respo-paper \\
        --max_model_len 17408

    # A local JSONL/parquet file with the MATH-500 columns, on CPU with transformers (this is what the tests run):
    python recipes/eval_math.py --model path/to/snapshot --benchmarks tests/data/math500_sample.jsonl \
        --n 4 --max_new_tokens 64 --backend transformers --output_dir eval-out

Why it looks like this: users judge an RLVR checkpoint by its benchmark table, so the table must be reproducible and
graded exactly like training. Every completion is graded by ``respo_trl.grading.grade``, which calls TRL's
``accuracy_reward`` (the reward ReSPO trains with); the metric definitions are in ``docs/evaluation.md``.

Benchmarks are named by a short name (``math500``, ``aime24``, ``aime25``, ``amc23``, ``olympiadbench``,
``minervamath``: see ``BENCHMARKS``; ``--local_data NAME=FILE`` reads a named one from a local copy), a Hub dataset id
(``owner/name``, optionally ``owner/name:config@split``) or a local ``.jsonl``/``.json``/``.parquet`` file. Each is
mapped to the common schema ``problem``/``answer`` (the spec's columns, else the usual column names; override with
``--problem_column``/``--answer_column``). ``--protocol respo-paper`` selects the paper's benchmarks, samples per
problem, sampling and budget (``PROTOCOLS``; explicit options override it and are recorded as changes). Accuracy is
also reported by response length in ``--length_bins`` equal-width bins over ``[0, max_new_tokens]`` (30, as the
paper). Outputs: ``eval_math.json`` (every setting, the command, versions, metrics, length bins), ``eval_math.md``
(the tables), ``eval_math_length_bins.png`` and, with ``--save_samples``, ``eval_math_samples.jsonl`` (every
completion with its grade and token length).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import sys
import time
from dataclasses import dataclass, replace
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from ...builtin.task import ArithmeticTask
from ..model import load_tokenizer

logger = logging.getLogger("eval_math")

DEFAULT_SYSTEM_PROMPT = "Please reason step by step, and put your final answer within \\boxed{}."
RESULTS_JSON, RESULTS_MD, SAMPLES_JSONL = "eval_math.json", "eval_math.md", "eval_math_samples.jsonl"
LENGTH_PLOT = "eval_math_length_bins.png"
PROBLEM_COLUMNS = ("problem", "Problem", "question", "Question")
ANSWER_COLUMNS = ("answer", "Answer", "expected_answer", "final_answer")
ID_COLUMNS = ("unique_id", "id", "ID", "idx", "index")
LOCAL_SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


@dataclass(frozen=True)
class BenchmarkSpec:
    dataset: str  # Hub id or local file
    split: str = "test"
    config: str | None = None
    problem_column: str | None = None  # None: the first of PROBLEM_COLUMNS present
    answer_column: str | None = None  # None: the first of ANSWER_COLUMNS present


BENCHMARKS = {
    "math500": BenchmarkSpec("HuggingFaceH4/MATH-500", "test"),  # problem, solution, answer, subject, level, unique_id
    "aime24": BenchmarkSpec("HuggingFaceH4/aime_2024", "train"),  # id, problem, solution, answer, url, year
    "aime25": BenchmarkSpec("math-ai/aime25", "test"),  # id, problem, answer
    "amc23": BenchmarkSpec("math-ai/amc23", "test"),  # id, question, answer (numbers), url
    # OlympiadBench's 675 English, text-only, open-ended math competition problems (OE_TO_maths_en_COMP): id, question,
    # final_answer (a list of LaTeX strings in $...$; several for multi-answer problems), solution, context, unit, ...
    "olympiadbench": BenchmarkSpec("math-ai/olympiadbench", "test", problem_column="question", answer_column="final_answer"),
    # Minerva's 272 undergraduate STEM problems (OCWCourses): question, answer
    "minervamath": BenchmarkSpec("math-ai/minervamath", "test", problem_column="question", answer_column="answer"),
}


@dataclass(frozen=True)
class Protocol:
    """A named evaluation setting: samples per problem for each benchmark, sampling, budget and prompt."""

    description: str
    samples: dict[str, int]  # benchmark -> samples per problem, in report order
    temperature: float
    top_p: float
    max_new_tokens: int
    system_prompt: str
    prompt_template: str


PROTOCOLS = {
    # The ReSPO paper's evaluation (arXiv:2609.35433): AIME24/25 and AMC23 at 16 samples, the larger sets at 4,
    # temperature 1.0, top-p 0.7, up to 16,384 response tokens, Math-Verify. Its prompt is not published: we ask as in
    # training (the user turn of the paper's DAPO preparation, no system turn).
    "respo-paper": Protocol(
        description="the ReSPO paper's evaluation: AIME24, AIME25, AMC23 at 16 samples per problem; MATH-500, "
        "OlympiadBench, MinervaMath at 4; temperature 1.0, top-p 0.7, up to 16,384 new tokens; math-verify",
        samples={"aime24": 16, "aime25": 16, "amc23": 16, "math500": 4, "olympiadbench": 4, "minervamath": 4},
        temperature=1.0,
        top_p=0.7,
        max_new_tokens=16384,
        system_prompt="",
        prompt_template="{problem} Please reason step by step, and put your final answer within \\boxed{}.",
    ),
}
# Without --protocol: the defaults of the options below.
DEFAULTS = dict(
    benchmarks=["math500"],
    n=4,
    temperature=0.6,
    top_p=0.95,
    max_new_tokens=4096,
    system_prompt=DEFAULT_SYSTEM_PROMPT,
    prompt_template="{problem}",
)
LENGTH_BINS = 30  # the paper reports accuracy in 30 response-length bins
MIN_BIN_SAMPLES = 5  # the length-bin plot joins only bins with at least this many samples


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


def answer_text(answer) -> str:
    """A gold answer as one string: integral floats as integers (AMC), a list of answers (OlympiadBench's
    ``final_answer``) joined by ", ", and enclosing ``$...$`` math delimiters removed (math-verify then reads the
    boxed answer as written)."""
    if isinstance(answer, (list, tuple)):
        return ", ".join(answer_text(a) for a in answer)
    if isinstance(answer, float) and answer.is_integer():
        answer = int(answer)
    text = str(answer).strip()
    if len(text) >= 2 and text.startswith("$") and text.endswith("$"):
        text = text.strip("$").strip()
    return text


class UsageError(ValueError):
    """Bad input that the command line reports as one line (no traceback)."""


def check_jsonl(path: str) -> None:
    """Every non-empty line of ``path`` must be one JSON object; the first that is not is named with its line."""
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise UsageError(f"{path}, line {number}: not valid JSON ({error.msg}, column {error.colno})") from None
            if not isinstance(row, dict):
                raise UsageError(f"{path}, line {number}: expected a JSON object per line, got {type(row).__name__}")


def check_model(model: str) -> None:
    """A ``--model`` that is neither an existing model folder nor a Hub id fails here, in one line."""
    path = Path(model).expanduser()
    looks_local = model.startswith((".", "/", "~")) or path.exists() or model.count("/") != 1
    if not looks_local:
        return  # a Hub id: its download errors are reported by load_model_and_tokenizer
    if not path.exists():
        raise UsageError(f"--model {model!r}: no such directory (a local model folder, or a Hub id owner/name)")
    if not (path / "config.json").is_file():
        raise UsageError(f"--model {model!r}: not a model folder (no config.json); pass a training output_dir or a snapshot")


def load_problems(spec: BenchmarkSpec, problem_column=None, answer_column=None, limit=None) -> list[Problem]:
    """Load a benchmark into the common schema (``problem``, ``answer`` as strings, and an id). The spec's data source
    is a Hub dataset or a local ``.jsonl``/``.json``/``.parquet`` file (``--local_data``), read with the spec's columns
    unless ``problem_column``/``answer_column`` are given."""
    from datasets import load_dataset

    suffix = Path(spec.dataset).suffix
    if suffix in LOCAL_SUFFIXES and Path(spec.dataset).is_file():
        if suffix == ".jsonl":
            check_jsonl(spec.dataset)  # datasets would bury the cause in a long DatasetGenerationError
        data = load_dataset(LOCAL_SUFFIXES[suffix], data_files=spec.dataset, split="train")
    else:
        try:
            data = load_dataset(spec.dataset, spec.config, split=spec.split)
        except (ConnectionError, OSError, ValueError) as error:  # offline, misspelt or private: one line
            if Path(spec.dataset).suffix in LOCAL_SUFFIXES:
                raise UsageError(f"benchmark file {spec.dataset!r} does not exist") from None
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise UsageError(
                f"cannot load benchmark {spec.dataset!r} from the Hub ({first}); offline, pass a local copy "
                "(--local_data NAME=FILE, or the file itself in --benchmarks)"
            ) from None
    columns = data.column_names
    p_col = pick_column(columns, problem_column or spec.problem_column, PROBLEM_COLUMNS, "problem", spec.dataset)
    a_col = pick_column(columns, answer_column or spec.answer_column, ANSWER_COLUMNS, "answer", spec.dataset)
    id_col = pick_column(columns, None, ID_COLUMNS, "id", spec.dataset)
    if limit is not None:
        data = data.select(range(min(limit, len(data))))
    return [
        Problem(str(row[id_col]) if id_col else str(i), str(row[p_col]), answer_text(row[a_col]))
        for i, row in enumerate(data)
    ]


def build_prompts(
    tokenizer, problems, system_prompt: str, prompt_template: str, chat_template_kwargs: dict
) -> list[str]:
    """Chat-formatted prompt texts (system prompt asking for ``\\boxed{}``, then the problem as the user turn)."""
    prompts = []
    for p in problems:
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        messages.append({"role": "user", "content": prompt_template.replace("{problem}", p.problem)})
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
) -> list[list[tuple[str, int]]]:
    """``n`` completions per prompt, each ``(text, tokens)``, with the recipe's generation helper
    (:func:`respo_trl.recipe.generation.generate`: ``model.generate`` in left-padded batches of ``batch_size``
    sequences, the longest prompts first, a bar counting sequences); ``tokens`` is the generated length up to and
    including the end-of-sequence token (``max_new_tokens`` when cut off)."""
    from ..generation import generate

    texts, lengths = generate(
        model, tokenizer, prompts, max_new_tokens=sampling.max_new_tokens, batch_size=batch_size,
        do_sample=sampling.temperature > 0, temperature=sampling.temperature, top_p=sampling.top_p,
        top_k=sampling.top_k, samples_per_prompt=sampling.n, seed=sampling.seed, longest_first=True, progress=True,
    )  # fmt: skip
    n = sampling.n
    return [list(zip(texts[i : i + n], lengths[i : i + n])) for i in range(0, len(texts), n)]


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


def generate_vllm(llm, tokenizer, prompts: list[str], sampling: Sampling) -> list[list[tuple[str, int]]]:
    """``n`` completions per prompt, each ``(text, tokens)``, with vLLM's offline ``LLM.generate`` (its own tqdm bar).
    Prompts are passed as token ids, as TRL does, so the chat template's tokens are not re-tokenised with extra special
    tokens; ``tokens`` is ``len(output.token_ids)`` (the end-of-sequence token included when generated)."""
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
    return [[(completion.text, len(completion.token_ids)) for completion in result.outputs] for result in results]


def split_generated(generated, tokenizer) -> tuple[list[list[str]], list[list[int]]]:
    """Texts and token lengths from a backend's output. A ``generate`` callable may return plain strings (the tests'
    canned completions); their length is then the number of tokens the tokenizer gives the text (no special tokens)."""
    texts, lengths = [], []
    for row in generated:
        texts.append([c if isinstance(c, str) else c[0] for c in row])
        lengths.append(
            [len(tokenizer(c, add_special_tokens=False).input_ids) if isinstance(c, str) else int(c[1]) for c in row]
        )
    return texts, lengths


def load_transformers_model(args):
    import torch
    from transformers import AutoModelForCausalLM

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = AutoModelForCausalLM.from_pretrained(
        args.model, revision=args.revision, dtype=args.dtype, trust_remote_code=args.trust_remote_code
    )
    if device == "cpu" and sum(p.numel() for p in model.parameters()) < 50_000_000:
        from ..model import use_one_cpu_thread

        use_one_cpu_thread(logger, "small model on CPU")
    return model.to(device).eval()


# -- scoring and reports ---------------------------------------------------------------------------------------------------


def score_benchmark(
    label: str, spec: BenchmarkSpec, problems: list[Problem], completions: list[list[str]], ks, lengths=None
):
    """Grade every sample with the training reward and reduce to the benchmark's metrics and per-sample records
    (with each sample's response length in tokens when ``lengths`` is given)."""
    from tqdm.auto import tqdm

    from respo_trl.grading import aggregate, gold_solution, grade, problem_metrics

    per_problem, samples, skipped = [], [], []
    lengths = lengths if lengths is not None else [[None] * len(texts) for texts in completions]
    graded = tqdm(
        zip(problems, completions, lengths, strict=True), total=len(problems), desc=f"grading {label}", unit="problem"
    )
    for problem, texts, tokens in graded:
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
                "tokens": length,
                "completion": text,
            }
            for j, (g, text, length) in enumerate(zip(grades, texts, tokens))
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
    counted = [s["tokens"] for s in samples if s["tokens"] is not None]
    if counted:
        row["mean_tokens"] = sum(counted) / len(counted)
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


def run_defaults(model: str) -> dict:
    """How the run in ``model`` (a recipe ``output_dir``: its ``report.json``) trained: the benchmark, prompt format and
    budget to evaluate it with by default. Empty for anything else (a Hub id, a snapshot, a run of a user's script)."""
    report_path = Path(model) / "report.json"
    if not report_path.is_file():
        return {}
    report = json.loads(report_path.read_text())
    script = (report.get("args") or {}).get("script") or {}
    fmt = report.get("prompt_format") or script
    sampling = report.get("sampling") or {}
    if not sampling and (Path(model) / "training_args.bin").is_file():  # reports before 0.3 had no sampling section
        import torch

        training = torch.load(Path(model) / "training_args.bin", weights_only=False)
        sampling = {"max_completion_length": training.max_completion_length, "temperature": training.temperature}
    out = {
        "system_prompt": fmt.get("system_prompt") or "",
        "prompt_template": fmt.get("prompt_template") or "{problem}",
        "max_new_tokens": sampling.get("max_completion_length"),
        "temperature": sampling.get("temperature"),
        "top_p": 1.0,
    }
    task = script.get("dataset_name") or report.get("task") or ""
    if script.get("eval_dataset_name"):
        out["benchmarks"] = [script["eval_dataset_name"]]
    elif task.startswith("builtin:"):  # the run's own held-out split, regenerated exactly (same generator and seed)
        out["benchmarks"] = [str(Path(model) / "heldout.jsonl")]
        out["builtin_heldout"] = script  # the task_* settings, task_seed and heldout_size
    return {k: v for k, v in out.items() if v is not None}


def write_builtin_heldout(path: str, settings: dict) -> None:
    """The built-in task's held-out split as the run measured it, as a MATH-500-schema JSONL file."""
    task = ArithmeticTask.from_settings(settings)
    task.write_jsonl(path, "test", settings.get("heldout_size") or 500, settings.get("task_seed") or 0)


def archive_previous(output_dir: str) -> str | None:
    """Move an earlier ``eval_math.json``/``.md`` of ``output_dir`` aside (never silently replaced); returns its name."""
    old = Path(output_dir) / RESULTS_JSON
    if not old.is_file():
        return None
    index = 1
    while (Path(output_dir) / f"eval_math.previous-{index}.json").exists():
        index += 1
    target = Path(output_dir) / f"eval_math.previous-{index}.json"
    old.rename(target)
    md = Path(output_dir) / RESULTS_MD
    if md.is_file():
        md.rename(target.with_suffix(".md"))
    return target.name


def default_output_dir(model: str) -> str:
    """A trained output_dir (it holds ``training_args.bin``) keeps its results; anything else gets its own folder."""
    if os.path.isdir(model) and os.path.isfile(os.path.join(model, "training_args.bin")):
        return model
    return os.path.join("eval_math", model.rstrip("/").split("/")[-1])


def plot_length_bins(report: dict, path: str) -> str:
    """Accuracy by response-length bin (line, left axis) over the number of samples in each bin (bars, right axis),
    every benchmark pooled, plus one thin line per benchmark."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bins = report["length_bins"]
    rows = bins["all"]
    centers = [(r["lo"] + r["hi"]) / 2 for r in rows]
    width = rows[0]["hi"] - rows[0]["lo"]
    fig, ax = plt.subplots(figsize=(9, 4.2))
    counts = ax.twinx()
    counts.bar(centers, [r["samples"] for r in rows], width=0.9 * width, color="0.85", zorder=0)
    counts.set_ylabel("samples in bin")
    ax.set_zorder(counts.get_zorder() + 1)
    ax.patch.set_visible(False)
    # A bin with a handful of samples has an accuracy of 0% or 100% by chance: the lines join only bins with at least
    # MIN_BIN_SAMPLES samples, and the sparse ones are drawn as hollow points (0.2 drew 1-sample bins as drops to 0%).
    def dense(per):
        return [((r["lo"] + r["hi"]) / 2, 100 * r["accuracy"]) for r in per
                if r["accuracy"] is not None and r["samples"] >= MIN_BIN_SAMPLES]  # fmt: skip

    for label, per in bins["by_benchmark"].items():
        points = dense(per)
        if points:
            ax.plot(*zip(*points), lw=0.8, alpha=0.6, label=label)
    points = dense(rows)
    if points:
        ax.plot(*zip(*points), "o-", color="black", lw=2, ms=4, label="all benchmarks")
    sparse = [((r["lo"] + r["hi"]) / 2, 100 * r["accuracy"]) for r in rows
              if r["accuracy"] is not None and r["samples"] < MIN_BIN_SAMPLES]  # fmt: skip
    if sparse:
        ax.plot(*zip(*sparse), "o", mfc="white", color="black", ms=4, label=f"bins with < {MIN_BIN_SAMPLES} samples")
    ax.set_xlim(0, bins["max_new_tokens"])
    ax.set_ylim(-2, 102)
    ax.set_xlabel(f"response length (tokens), {bins['bins']} equal-width bins")
    ax.set_ylabel("accuracy (%)")
    protocol = report.get("protocol") or {}
    ax.set_title(f"{report['model']}: accuracy by response length" + (f" ({protocol['name']})" if protocol else ""))
    ax.legend(fontsize=7, loc="upper right", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_report(report: dict, samples: list[dict], output_dir: str, save_samples: bool) -> None:
    from respo_trl.grading import generation_summary, length_bins_table, results_table

    os.makedirs(output_dir, exist_ok=True)
    bins = report.get("length_bins")
    if bins:
        bins["plot"] = os.path.basename(plot_length_bins(report, os.path.join(output_dir, LENGTH_PLOT)))
    with open(os.path.join(output_dir, RESULTS_JSON), "w") as f:
        json.dump(report, f, indent=2)
    text = (
        f"`{report['model']}`. {generation_summary(report)} avg@n ± its standard error over problems.\n\n"
        + results_table(report)
    )
    if bins:
        text += (
            f"\n\n## Accuracy by response length\n\nAll benchmarks pooled: {bins['definition']}.\n\n"
            + length_bins_table(bins["all"])
            + f"\n\n![accuracy by response length]({bins['plot']})"
        )
    with open(os.path.join(output_dir, RESULTS_MD), "w") as f:
        f.write(text + f"\n\nCommand: `{report['command']}`\n")
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
        "--protocol",
        choices=sorted(PROTOCOLS),
        default=None,
        help="a named evaluation protocol: 'respo-paper' is the ReSPO paper's (AIME24/25, AMC23 x 16 samples; "
        "MATH-500, OlympiadBench, MinervaMath x 4; temperature 1.0, top-p 0.7, 16,384 new tokens). Options given "
        "explicitly override it and are listed as changes in the report and the model card",
    )
    parser.add_argument(
        "--benchmarks",
        nargs="+",
        default=None,
        help=f"short names {sorted(BENCHMARKS)}, Hub ids or files (default: the protocol's; for a recipe output_dir "
        "the run's held-out set; else math500)",
    )
    parser.add_argument(
        "--local_data",
        nargs="*",
        default=[],
        metavar="NAME=PATH",
        help="read a named benchmark from a local .jsonl/.json/.parquet copy with the Hub columns (offline machines), "
        "e.g. olympiadbench=data/olympiadbench.jsonl",
    )
    parser.add_argument("--n", type=int, default=None, help="samples per problem (default: the protocol's, else 4)")
    parser.add_argument("--temperature", type=float, default=None, help="0 means greedy (default: the run's, else 0.6)")
    parser.add_argument("--top_p", type=float, default=None, help="default: 1.0 for a recipe run, else 0.95")
    parser.add_argument("--top_k", type=int, default=0, help="0 disables top-k (TRL's default)")
    parser.add_argument("--max_new_tokens", type=int, default=None, help="default: the run's max_completion_length, else 4096")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--ks", type=int, nargs="*", default=None, help="k for pass@k (default: powers of two < n, and n)"
    )
    parser.add_argument(
        "--length_bins",
        type=int,
        default=LENGTH_BINS,
        help="equal-width response-length bins over [0, max_new_tokens] for accuracy by length (0: none)",
    )
    parser.add_argument("--system_prompt", default=None,
                        help="'' for no system turn (default: the run's, from its report.json; else a \\boxed{} request)")
    parser.add_argument("--prompt_template", default=None,
                        help="user turn; {problem} is replaced (default: the run's, else {problem})")  # fmt: skip
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
    args.local_data = dict(parse_local_data(item, parser) for item in args.local_data)
    args.from_run = apply_run_defaults(args)
    resolve_protocol(args, parser)
    if args.n is not None and args.n < 1:
        parser.error("--n must be >= 1")
    if args.length_bins < 0:
        parser.error("--length_bins must be >= 0")
    if args.temperature == 0 and max(args.samples.values(), default=args.n or 1) > 1:
        logger.warning("--temperature 0 is greedy decoding: the n samples of a problem are identical")
    return args


def apply_run_defaults(args) -> dict:
    """Without ``--protocol``, options left unset take the values the run in ``--model`` trained with (its
    ``report.json``): its held-out set, prompt format, token budget and temperature. Returns what was taken."""
    if args.protocol is not None:
        return {}
    defaults = run_defaults(args.model)
    taken = {}
    for name in ("benchmarks", "system_prompt", "prompt_template", "max_new_tokens", "temperature", "top_p"):
        if name in defaults and getattr(args, name) is None:
            setattr(args, name, defaults[name])
            taken[name] = defaults[name]
    args.builtin_heldout = defaults.get("builtin_heldout") if "benchmarks" in taken else None
    if taken:
        described = ", ".join(f"{k}={v!r}" for k, v in taken.items())
        logger.info(f"defaults from {os.path.join(args.model, 'report.json')} (how the run trained): {described}")
    return taken


def parse_local_data(item: str, parser) -> tuple[str, str]:
    name, sep, path = item.partition("=")
    if not sep or name not in BENCHMARKS:
        parser.error(f"--local_data takes NAME=PATH with NAME one of {sorted(BENCHMARKS)}, got {item!r}")
    if not Path(path).is_file() or Path(path).suffix not in LOCAL_SUFFIXES:
        parser.error(f"--local_data {name}: {path!r} is not a .jsonl/.json/.parquet file")
    return name, path


def resolve_protocol(args, parser) -> None:
    """Fill the unset options from ``--protocol`` (or the defaults) and record what was changed from the protocol.

    Sets ``args.samples`` (benchmark -> samples per problem) and ``args.protocol_report`` (``None`` without a protocol).
    """
    protocol = PROTOCOLS.get(args.protocol)
    changed = []
    for name in ("temperature", "top_p", "max_new_tokens", "system_prompt", "prompt_template"):
        given = getattr(args, name)
        reference = getattr(protocol, name) if protocol else DEFAULTS[name]
        if given is None:
            setattr(args, name, reference)
        elif protocol and given != reference:
            changed.append(f"{name}={given!r}")
    if args.benchmarks is None:
        args.benchmarks = list(protocol.samples) if protocol else list(DEFAULTS["benchmarks"])
    elif protocol and args.benchmarks != list(protocol.samples):
        changed.append(f"benchmarks={' '.join(args.benchmarks)}")
    args.samples = {}
    for name in args.benchmarks:
        if args.n is not None:
            args.samples[name] = args.n
            if protocol and name in protocol.samples and args.n != protocol.samples[name]:
                changed.append(f"n={args.n} on {name}")
        elif protocol:
            if name not in protocol.samples:
                parser.error(f"{name!r} is not a benchmark of --protocol {args.protocol}: pass --n for it")
            args.samples[name] = protocol.samples[name]
        else:
            args.samples[name] = DEFAULTS["n"]
    if protocol and args.limit is not None:
        changed.append(f"limit={args.limit}")
    args.protocol_report = (
        {"name": args.protocol, "description": protocol.description, "changed": changed} if protocol else None
    )


def main(argv=None, generate=None) -> dict:
    """Run the evaluation; returns the report written to ``eval_math.json``.

    ``generate(prompts, sampling) -> completions`` replaces the model call (the tests use it to feed known answers);
    each completion is a text or a ``(text, tokens)`` pair.
    """
    args = parse_args(argv)
    from respo_trl.grading import LENGTH_BINS_DEFINITION, default_ks, length_bins

    backend = args.backend
    if backend == "auto":
        backend = "vllm" if vllm_available() else "transformers"
    if generate is not None:
        backend = "custom"
    check_model(args.model)
    if getattr(args, "builtin_heldout", None) and not Path(args.benchmarks[0]).is_file():
        write_builtin_heldout(args.benchmarks[0], args.builtin_heldout)
    for name in args.benchmarks:  # local files are read before any model is loaded: bad input fails in seconds
        path = args.local_data.get(name) or resolve_benchmark(name)[1].dataset
        if str(path).endswith(".jsonl") and Path(path).is_file():
            check_jsonl(path)
    try:
        tokenizer = load_tokenizer(args.model, args.revision, args.trust_remote_code)
    except OSError as error:  # a Hub id that cannot be fetched (offline, private, misspelt)
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise UsageError(f"--model {args.model!r}: cannot load its tokenizer: {first}") from None
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
        if name in args.local_data:
            spec = replace(spec, dataset=args.local_data[name])
        n = args.samples[name]
        sampling = Sampling(n, args.temperature, args.top_p, args.top_k, args.max_new_tokens, args.seed)
        ks = sorted({k for k in (args.ks or default_ks(n)) if 1 <= k <= n} | {1})
        problems = load_problems(spec, args.problem_column, args.answer_column, args.limit)
        logger.info(f"{label}: {len(problems)} problems x {n} samples ({backend})")
        prompts = build_prompts(
            tokenizer, problems, args.system_prompt, args.prompt_template, args.chat_template_kwargs
        )
        texts, lengths = split_generated(generate(prompts, sampling), tokenizer)
        row, samples = score_benchmark(label, spec, problems, texts, ks, lengths)
        rows.append(row)
        all_samples.extend(samples)

    command = shlex.join(["python", "recipes/eval_math.py", *(sys.argv[1:] if argv is None else argv)])
    from respo_trl.hub.card import weights_fingerprint

    samples_per_problem = {row["benchmark"]: row["n"] for row in rows}
    uniform = len(set(samples_per_problem.values())) == 1 and not args.protocol_report
    report = {
        "model": args.model,
        "revision": args.revision,
        "weights_sha256": weights_fingerprint(args.model),  # lets a model card check these are its weights
        "backend": backend,
        "protocol": args.protocol_report,
        "generation": {
            "n": next(iter(samples_per_problem.values())) if uniform else samples_per_problem,
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
    if args.length_bins:
        cap, count = args.max_new_tokens, args.length_bins

        def bins_of(records):
            return length_bins([s["tokens"] for s in records], [s["correct"] for s in records], cap, count)

        report["length_bins"] = {
            "bins": count,
            "max_new_tokens": cap,
            "definition": LENGTH_BINS_DEFINITION.format(bins=count, max_tokens=cap, width=cap / count),
            "all": bins_of(all_samples),
            "by_benchmark": {row["benchmark"]: bins_of([s for s in all_samples if s["benchmark"] == row["benchmark"]])
                             for row in rows},
        }  # fmt: skip
    report["defaults_from_run"] = args.from_run
    output_dir = args.output_dir or default_output_dir(args.model)
    previous = archive_previous(output_dir)
    write_report(report, all_samples, output_dir, args.save_samples)
    from respo_trl.grading import results_table

    print(results_table(report))
    print(f"\nwrote {os.path.join(output_dir, RESULTS_JSON)} and {RESULTS_MD}"
          + (f" (the earlier evaluation is kept as {previous})" if previous else ""))  # fmt: skip
    if rows and all(row["avg_at_n"] == 0 for row in rows):
        print(f"every answer was graded wrong: check that the prompt matches the one the model was trained with "
              f"(system prompt {args.system_prompt!r}, template {args.prompt_template!r}; see --system_prompt and "
              "--prompt_template)", file=sys.stderr)  # fmt: skip
    return report


def cli(argv: list[str] | None = None) -> dict:
    """``python recipes/eval_math.py``: :func:`main`, with a usage problem as one line and exit status 1."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        return main(argv)
    except (UsageError, FileNotFoundError) as error:
        sys.exit(f"eval_math.py: error: {error}")
