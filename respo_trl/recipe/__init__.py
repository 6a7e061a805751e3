"""The training recipe: what ``recipes/qwen3_respo.py`` runs (``python recipes/qwen3_respo.py``, ``accelerate launch
recipes/qwen3_respo.py``), importable by the benchmarks and tests as a package. One job per module, in the order a
run meets them:

- :mod:`.train`: the flow, top to bottom, in the shape of TRL's ``trl/scripts/grpo.py`` (``main``, ``cli``);
- :mod:`.arguments`: ``RecipeArguments`` (the recipe's own fields; TRL's are ``ReSPOConfig``'s and
  ``trl.ModelConfig``'s), the ``--algorithm`` table, and :class:`RecipeError`, the error of everything a user fixes;
- :mod:`.presets`: the YAML presets shipped as package data, found by ``--preset NAME``;
- :mod:`.parsing`: one parse with TRL's ``TrlParser`` into the three dataclasses, unknown or renamed flags refused
  first, the fields ``--algorithm`` and the paper's batch contract imply, what ``--dry_run`` prints;
- :mod:`.checks`: every check that runs before a model or dataset is loaded (paths, the resume point, the batch
  contract on the launch's process count), each a one-line :class:`RecipeError`;
- :mod:`.data`: the built-in task (:mod:`respo_trl.builtin`), Hub or local datasets with their columns checked,
  prompts as chats;
- :mod:`.model`: model configs read before weights load, MoE router settings, the default run's tiny model and when
  it is warm-started;
- :mod:`.warmstart`: the warm start itself, a short supervised fine-tune on reference completions before RL
  (``--warmstart_steps``);
- :mod:`.generation`: batched generation outside TRL's trainer, tokenised as TRL tokenises prompts (the held-out
  evaluator, the warm start, ``eval_math`` and the benchmarks sample with it);
- :mod:`.heldout`: held-out accuracy of the trainer's weights during and after training, the best in-training
  checkpoint (``HeldoutEvaluator``), the progress bar, the summary table;
- :mod:`.report`: ``report.json``, the held-out curve and answers, plots and the model card, written in one place
  (``RunReport``; the file names are :mod:`respo_trl.run_files`');
- :mod:`.plots`: the run's plots against generated tokens;
- :mod:`.cli`: how a run ends when it cannot go on (one line, what to change; Ctrl-C says how to resume);
- :mod:`.eval_math`: benchmark evaluation of a checkpoint (what ``recipes/eval_math.py`` runs), a package with one
  module per job; its bad input ends through :mod:`.cli` too.

It imports TRL (it is glue, like the trainer); nothing in the library imports it. The model card
(:mod:`respo_trl.hub.card`), which the recipe imports, reads the recipe's files by the names in
:mod:`respo_trl.run_files`.
"""

from ..batching import batch_plan
from ..run_files import ANSWERS_FILE, CURVE_FILE
from .arguments import ALGORITHMS, BUILTIN_PREFIX, EVAL_MODES, RecipeArguments, RecipeError
from .checks import build_reward, validate_args
from .cli import Interrupted, one_line_errors
from .data import build_datasets, drop_long_prompts, load_split, to_conversation
from .heldout import BEST_HELDOUT_DIR, HeldoutEvaluator, greedy_accuracy, sampled_accuracy
from .model import build_tiny, configure_moe, inspect_model, load_tokenizer, pick_cpu_threads, warm_start
from .parsing import parse_args, plan_table
from .presets import DEFAULT_PRESET, PRESETS_DIR, available_presets
from .report import RunReport
from .train import cli, main

__all__ = [
    "ALGORITHMS", "ANSWERS_FILE", "BEST_HELDOUT_DIR", "BUILTIN_PREFIX", "CURVE_FILE", "DEFAULT_PRESET", "EVAL_MODES", "PRESETS_DIR",
    "HeldoutEvaluator", "Interrupted", "RecipeArguments", "RecipeError", "RunReport", "available_presets",
    "batch_plan", "build_datasets", "build_reward", "build_tiny", "cli", "configure_moe", "drop_long_prompts",
    "greedy_accuracy", "inspect_model", "load_split", "load_tokenizer", "main", "one_line_errors", "parse_args",
    "pick_cpu_threads", "plan_table", "sampled_accuracy", "to_conversation", "validate_args", "warm_start",
]  # fmt: skip
