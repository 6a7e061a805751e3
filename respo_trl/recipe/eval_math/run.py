"""Evaluate a checkpoint on math benchmarks: avg@n, unbiased pass@k and maj@n, graded like the training reward.
What ``python recipes/eval_math.py`` runs.

Why the command line is a module of its own: it only parses the options and runs the steps of the other modules in
order (protocol, problems, backend, scoring, report). Bad input ends as the recipe's does, through
:func:`respo_trl.recipe.cli.one_line_errors`: one ``error: ...`` line and exit status 2
(:data:`~respo_trl.recipe.cli.EXIT_BAD_INPUT`, argparse's too), Ctrl-C 130; ``RESPO_TRACEBACK=1`` shows the traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import sys
import time
from dataclasses import replace
from pathlib import Path

from ..arguments import RecipeError
from ..cli import one_line_errors
from ..model import load_tokenizer
from .backends import Sampling, check_model, load_generate, pick_backend, split_generated
from .problems import (
    LOCAL_SUFFIXES,
    build_prompts,
    check_jsonl,
    load_problems,
    resolve_benchmark,
    write_builtin_heldout,
)
from .protocols import BENCHMARKS, LENGTH_BINS, PROTOCOLS, apply_run_defaults, resolve_protocol
from ...run_files import RESULTS_JSON, RESULTS_MD, SAMPLES_JSONL
from .report import archive_previous, build_report, default_output_dir, write_report
from .scoring import benchmark_ks, length_bin_report, score_benchmark

logger = logging.getLogger("eval_math")

LAUNCHER = "recipes/eval_math.py"  # how the report's command line names the program


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


def parse_local_data(item: str, parser) -> tuple[str, str]:
    name, sep, path = item.partition("=")
    if not sep or name not in BENCHMARKS:
        parser.error(f"--local_data takes NAME=PATH with NAME one of {sorted(BENCHMARKS)}, got {item!r}")
    if not Path(path).is_file() or Path(path).suffix not in LOCAL_SUFFIXES:
        parser.error(f"--local_data {name}: {path!r} is not a .jsonl/.json/.parquet file")
    return name, path


def main(argv=None, generate=None) -> dict:
    """Run the evaluation; returns the report written to ``eval_math.json``.

    ``generate(prompts, sampling) -> completions`` replaces the model call (the tests use it to feed known answers);
    each completion is a text or a ``(text, tokens)`` pair. Bad input raises :class:`RecipeError`.
    """
    args = parse_args(argv)
    backend = "custom" if generate is not None else pick_backend(args.backend)
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
        raise RecipeError(f"--model {args.model!r}: cannot load its tokenizer: {first}") from None
    if generate is None:
        generate = load_generate(backend, args, tokenizer)

    rows, all_samples = [], []
    started = time.time()
    for name in args.benchmarks:
        label, spec = resolve_benchmark(name)
        if name in args.local_data:
            spec = replace(spec, dataset=args.local_data[name])
        n = args.samples[name]
        sampling = Sampling(n, args.temperature, args.top_p, args.top_k, args.max_new_tokens, args.seed)
        problems = load_problems(spec, args.problem_column, args.answer_column, args.limit)
        logger.info(f"{label}: {len(problems)} problems x {n} samples ({backend})")
        prompts = build_prompts(
            tokenizer, problems, args.system_prompt, args.prompt_template, args.chat_template_kwargs
        )
        texts, lengths = split_generated(generate(prompts, sampling), tokenizer)
        row, samples = score_benchmark(label, spec, problems, texts, benchmark_ks(n, args.ks), lengths)
        rows.append(row)
        all_samples.extend(samples)

    command = shlex.join(["python", LAUNCHER, *(sys.argv[1:] if argv is None else argv)])
    report = build_report(args, backend, rows, command, time.time() - started)
    if args.length_bins:
        report["length_bins"] = length_bin_report(
            all_samples, [row["benchmark"] for row in rows], args.max_new_tokens, args.length_bins
        )
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
    """``python recipes/eval_math.py``: :func:`main`, ending as the recipe does on bad input (one ``error: ...`` line,
    exit status 2) or Ctrl-C (130)."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    with one_line_errors(interrupted="interrupted before the evaluation finished"):
        return main(argv)
