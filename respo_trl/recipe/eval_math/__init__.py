"""Evaluate a checkpoint on math benchmarks: avg@n, unbiased pass@k and maj@n, graded like the training reward.
What ``python recipes/eval_math.py`` runs.

    # A trained output_dir (results land in it, where ReSPOTrainer's model card picks them up):
    python recipes/eval_math.py --model outputs/qwen3-respo --benchmarks math500 aime24 aime25 amc23 --n 16

    # The recipe's embedded default, as it trained (its report.json: the built-in task's held-out split, no system
    # prompt, 48 new tokens, temperature 1); nothing is downloaded. An earlier eval_math.json is kept, renamed:
    python recipes/eval_math.py --model outputs/qwen3-tiny-respo

    # A Hub model id, vLLM on 2 GPUs (used automatically when vLLM is installed and a GPU is visible):
    python recipes/eval_math.py --model Qwen/Qwen3-1.7B --benchmarks math500 aime24 --n 64 \\
        --temperature 0.6 --top_p 0.95 --max_new_tokens 32768 --tensor_parallel_size 2

    # The ReSPO paper's protocol (AIME24/25, AMC23 x 16; MATH-500, OlympiadBench, MinervaMath x 4; temperature 1.0,
    # top-p 0.7, 16,384 new tokens), vLLM on 1 GPU; on N GPUs add --tensor_parallel_size N:
    python recipes/eval_math.py --model outputs/paper-qwen3-1.7b-base-respo-n32-seed0 --protocol respo-paper \\
        --max_model_len 17408

    # A local JSONL/parquet file with the MATH-500 columns, on CPU with transformers (this is what the tests run):
    python recipes/eval_math.py --model path/to/snapshot --benchmarks tests/data/math500_sample.jsonl \\
        --n 4 --max_new_tokens 64 --backend transformers --output_dir eval-out

Why it looks like this: users judge an RLVR checkpoint by its benchmark table, so the table must be reproducible and
graded exactly like training. Every completion is graded by ``respo_trl.grading.grade``, which calls TRL's
``accuracy_reward`` (the reward ReSPO trains with); the metric definitions are in ``docs/evaluation.md``. One job per
module, in the order a run goes through them:

- :mod:`.protocols`: the benchmark registry (``BENCHMARKS``), the named protocols (``PROTOCOLS``: ``respo-paper``), the
  defaults without one, and a recipe run's own settings (its ``report.json``) as defaults;
- :mod:`.problems`: a benchmark name, Hub id or local file to problems in the common schema ``problem``/``answer`` (the
  usual column names, or ``--problem_column``/``--answer_column``), and the chat prompts;
- :mod:`.backends`: completions with their token lengths, from vLLM or transformers;
- :mod:`.scoring`: grades, avg@n, pass@k, maj@n and accuracy in response-length bins (:mod:`respo_trl.grading`'s);
- :mod:`.report`: ``eval_math.json``, ``eval_math.md``, the length-bin plot, the samples, an earlier result kept
  (the file names are :mod:`respo_trl.run_files`', where the model card reads them too);
- :mod:`.run`: the options, ``main`` and ``cli``. Bad input is a :class:`~respo_trl.recipe.arguments.RecipeError` and ends as
  the training recipe's does (:func:`respo_trl.recipe.cli.one_line_errors`: one line, exit status 2).

The package re-exports the names its users and tests import (``__all__``), so ``from respo_trl.recipe.eval_math import
X`` does not depend on which module defines ``X``.
"""

from ..arguments import RecipeError
from .backends import (
    Sampling,
    check_model,
    generate_transformers,
    generate_vllm,
    load_generate,
    load_transformers_model,
    load_vllm,
    pick_backend,
    split_generated,
    vllm_available,
)
from .problems import (
    ANSWER_COLUMNS,
    ID_COLUMNS,
    LOCAL_SUFFIXES,
    PROBLEM_COLUMNS,
    Problem,
    answer_text,
    build_prompts,
    check_jsonl,
    load_problems,
    pick_column,
    resolve_benchmark,
    write_builtin_heldout,
)
from .protocols import (
    BENCHMARKS,
    DEFAULT_SYSTEM_PROMPT,
    DEFAULTS,
    LENGTH_BINS,
    PROTOCOLS,
    BenchmarkSpec,
    Protocol,
    apply_run_defaults,
    resolve_protocol,
    run_defaults,
)
from ...run_files import LENGTH_PLOT, PREVIOUS_JSON, RESULTS_JSON, RESULTS_MD, SAMPLES_JSONL
from .report import (
    GRADING,
    MIN_BIN_SAMPLES,
    OUTPUT_ROOT,
    archive_previous,
    build_report,
    default_output_dir,
    package_versions,
    plot_length_bins,
    write_report,
)
from .run import LAUNCHER, cli, logger, main, parse_args, parse_local_data
from .scoring import benchmark_ks, length_bin_report, score_benchmark

__all__ = [
    "ANSWER_COLUMNS", "BENCHMARKS", "DEFAULTS", "DEFAULT_SYSTEM_PROMPT", "GRADING", "ID_COLUMNS", "LAUNCHER",
    "LENGTH_BINS", "LENGTH_PLOT", "LOCAL_SUFFIXES", "MIN_BIN_SAMPLES", "OUTPUT_ROOT", "PREVIOUS_JSON", "PROBLEM_COLUMNS",
    "PROTOCOLS", "RESULTS_JSON", "RESULTS_MD", "SAMPLES_JSONL", "BenchmarkSpec", "Problem", "Protocol", "RecipeError",
    "Sampling", "answer_text", "apply_run_defaults", "archive_previous", "benchmark_ks", "build_prompts", "build_report",
    "check_jsonl", "check_model", "cli", "default_output_dir", "generate_transformers", "generate_vllm",
    "length_bin_report", "load_generate", "load_problems", "load_transformers_model", "load_vllm", "logger", "main",
    "package_versions", "parse_args", "parse_local_data", "pick_backend", "pick_column", "plot_length_bins",
    "resolve_benchmark", "resolve_protocol", "run_defaults", "score_benchmark", "split_generated", "vllm_available",
    "write_builtin_heldout", "write_report",
]  # fmt: skip

