"""The training recipe: what ``recipes/qwen3_respo.py`` runs (``python recipes/qwen3_respo.py``, ``accelerate launch
recipes/qwen3_respo.py``), importable by the benchmarks and tests as a package. One job per module:

- :mod:`.train`: the flow, top to bottom, in the shape of TRL's ``trl/scripts/grpo.py`` (``main``, ``cli``);
- :mod:`.args`: ``RecipeArguments``, presets, one parse with TRL's ``TrlParser``, the paper's batch contract, and
  every check that runs before a model or dataset is loaded (:class:`RecipeError`: one line, what to change);
- :mod:`.data`: the built-in task (:mod:`respo_trl.builtin`), Hub or local datasets with their columns checked,
  prompts as chats;
- :mod:`.model`: model configs read before weights load, MoE router settings, the default run's tiny model and its
  warm start;
- :mod:`.evaluation`: held-out accuracy of the trainer's weights and the best in-training checkpoint
  (``HeldoutEvaluator``), the progress bar, the summary table;
- :mod:`.report`: ``report.json``, the held-out curve file, plots and the model card, written in one place
  (``RunReport``);
- :mod:`.plots`: the run's plots; :mod:`.cli`: how a run ends when it cannot go on (one line, what to change; Ctrl-C
  says how to resume);
- :mod:`.eval_math`: benchmark evaluation of a checkpoint (what ``recipes/eval_math.py`` runs), a package with one
  module per job; its bad input ends through :mod:`.cli` too.

It imports TRL (it is glue, like the trainer); nothing in the library imports it at module level (the model card
imports the names of the files it reads from :mod:`.report` and :mod:`.eval_math` when it reads them).
"""

from ..batching import batch_plan
from .args import parse_args, plan_table
from .arguments import ALGORITHMS, BUILTIN_PREFIX, EVAL_MODES, RecipeArguments, RecipeError
from .checks import build_reward, validate_args
from .cli import Interrupted, one_line_errors
from .data import build_datasets, drop_long_prompts, load_split, to_conversation
from .evaluation import BEST_HELDOUT_DIR, HeldoutEvaluator, greedy_accuracy, sampled_accuracy
from .model import build_tiny, configure_moe, inspect_model, load_tokenizer, pick_cpu_threads, warm_start
from .presets import DEFAULT_PRESET, PRESETS_DIR, available_presets
from .report import ANSWERS_FILE, CURVE_FILE, RunReport
from .train import cli, main

__all__ = [
    "ALGORITHMS", "ANSWERS_FILE", "BEST_HELDOUT_DIR", "BUILTIN_PREFIX", "CURVE_FILE", "DEFAULT_PRESET", "EVAL_MODES", "PRESETS_DIR",
    "HeldoutEvaluator", "Interrupted", "RecipeArguments", "RecipeError", "RunReport", "available_presets",
    "batch_plan", "build_datasets", "build_reward", "build_tiny", "cli", "configure_moe", "drop_long_prompts",
    "greedy_accuracy", "inspect_model", "load_split", "load_tokenizer", "main", "one_line_errors", "parse_args",
    "pick_cpu_threads", "plan_table", "sampled_accuracy", "to_conversation", "validate_args", "warm_start",
]  # fmt: skip
