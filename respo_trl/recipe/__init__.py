"""What ``recipes/qwen3_respo.py`` is made of, so that the script itself reads top to bottom.

The recipe's flow stays in the script (parse, build model and data, warm start, train, evaluate, report); the
machinery lives here, one job per module:

- :mod:`.args`: ``RecipeArguments``, presets, two-pass parsing with TRL's ``TrlParser``, the paper's batch contract,
  and every check that runs before a model or dataset is loaded (:class:`RecipeError`: one line, what to change);
- :mod:`.data`: the built-in task, Hub or local datasets with their columns checked, prompts as chats;
- :mod:`.model`: model configs read before weights load, MoE router settings, the demo's tiny model and warm start;
- :mod:`.evaluation`: held-out accuracy (greedy or sampled), the best in-training checkpoint, progress bar, summary;
- :mod:`.report`: ``report.json``, plots and the model card of a run;
- :mod:`.cli`: how a run ends when it cannot go on (one line, what to change; Ctrl-C says how to resume).

It imports TRL (it is glue, like the trainer); nothing in the library imports it.
"""

from .args import (
    ALGORITHMS,
    BUILTIN_PREFIX,
    DEFAULT_PRESET,
    EVAL_MODES,
    RecipeArguments,
    RecipeError,
    available_presets,
    batch_plan,
    build_reward,
    check_batch_arithmetic,
    parse_args,
    validate_args,
)
from .cli import Interrupted, one_line_errors
from .data import build_datasets, drop_long_prompts, load_split, to_conversation
from .evaluation import (
    BEST_HELDOUT_DIR,
    add_curve_point,
    best_checkpoint_accuracy,
    eval_curve_from_logs,
    greedy_accuracy,
    make_callbacks,
    print_summary,
    resumed_curve,
    sampled_accuracy,
)
from .model import build_tiny, configure_moe, inspect_model, load_tokenizer, pick_cpu_threads, warm_start
from .report import log_launch, new_report, training_summary, write_report

__all__ = [
    "BEST_HELDOUT_DIR", "Interrupted", "add_curve_point", "new_report", "one_line_errors", "resumed_curve",
    "ALGORITHMS", "BUILTIN_PREFIX", "DEFAULT_PRESET", "EVAL_MODES", "RecipeArguments", "RecipeError",
    "available_presets", "batch_plan", "best_checkpoint_accuracy", "build_datasets", "build_reward", "build_tiny",
    "check_batch_arithmetic", "configure_moe", "drop_long_prompts", "eval_curve_from_logs", "greedy_accuracy",
    "inspect_model", "load_split", "load_tokenizer", "log_launch", "make_callbacks", "parse_args", "pick_cpu_threads",
    "print_summary", "sampled_accuracy", "to_conversation", "training_summary", "validate_args", "warm_start",
    "write_report",
]  # fmt: skip
