"""The recipe's arguments: presets, parsing with TRL's ``TrlParser``, the paper's batch contract, and every check that
can run before a model, tokenizer or dataset is loaded.

``recipes/qwen3_respo.py`` reads ``RecipeArguments``, a :class:`~respo_trl.ReSPOConfig` and a ``trl.ModelConfig``
from a YAML preset plus command-line overrides (:func:`parse_args`). The checks here exist so that a preset sized for
8 GPUs, a typo in a flag or a batch that does not divide fails in seconds, with one line that says what to change,
instead of after minutes of model loading. Presets are package data (``respo_trl/recipe/presets/``); the functions take
that folder as an argument.
"""

from __future__ import annotations

import difflib
import os
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path

from trl import ModelConfig, TrlParser

from ..batching import batch_plan
from ..config import ReSPOConfig
from ..rewards import ACCURACY_REWARDS, resolve_reward


class RecipeError(ValueError):
    """A problem with the recipe's input (a flag, a preset, a path, a dataset column) that the user fixes: the recipe
    prints its message as one line and exits non-zero, without a traceback."""


DEFAULT_PRESET = "tiny-cpu"
# The presets are package data (respo_trl/recipe/presets/*.yaml): they resolve the same from a checkout, an editable
# install or an installed wheel.
PRESETS_DIR = Path(__file__).resolve().parent / "presets"
# Presets renamed by a release: the old name is refused with the new one.
RENAMED_PRESETS = {f"qwen3-{size}": f"qwen3-{size}-epochs4" for size in ("0.6b", "1.7b", "4b", "8b", "14b", "30b-a3b")}
RENAMED_PRESETS["tiny_cpu"] = "tiny-cpu"  # 0.3: every preset name uses dashes
# Options renamed by a release: refused with the new name. 0.4: the staleness N has one name from preset to trainer.
RENAMED_FLAGS = {"updates_per_rollout": "respo_updates_per_rollout"}
BUILTIN_PREFIX = "builtin:"
BUILTIN_TASKS = ("arithmetic",)
EVAL_MODES = ("greedy", "sampled", "none")
TINY_MODELS = ("dense", "moe")
# --algorithm: the paper's comparison as one switch, each entry in TRL's own terms (docs/recipes.md, section 4).
ALGORITHMS = {
    "respo": {"loss_type": "respo", "importance_sampling_level": "token"},
    # GRPO with token-level clipping, epsilon 0.2 both sides, token-mean aggregation over the global batch
    "grpo": {"loss_type": "dapo", "importance_sampling_level": "token", "epsilon": 0.2, "epsilon_high": 0.2},
    # GSPO as TRL documents it (paper index): sequence-level ratio (length-normalised), sequence clip 3e-4 / 4e-4
    "gspo": {"loss_type": "grpo", "importance_sampling_level": "sequence", "epsilon": 3e-4, "epsilon_high": 4e-4},
    # VESPO with TRL's defaults (vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg)
    "vespo": {"loss_type": "vespo", "importance_sampling_level": "token"},
}
LAUNCH_PROCESSES = -1  # a bare --dry_run: the process count of the launch it runs under



@dataclass
class RecipeArguments:
    """Script arguments: data, task, warm start, evaluation and the launch a preset was sized for."""

    preset: str | None = field(
        default=None,
        metadata={"help": "Name of a YAML preset in respo_trl/recipe/presets/ (e.g. 'paper-qwen3-1.7b-base' or 'qwen3-4b-epochs4'); same as --config <path>."},
    )
    # -- data -------------------------------------------------------------------------------------------------------
    dataset_name: str = field(
        default="builtin:arithmetic",
        metadata={
            "help": "Training data: 'builtin:arithmetic' (generated locally, see respo_trl.demo.tasks), a Hub dataset id "
            "(e.g. 'open-r1/DAPO-Math-17k-Processed') or a local path/data file loadable by datasets.load_dataset."
        },
    )
    dataset_config: str | None = field(default=None, metadata={"help": "Dataset configuration name (Hub datasets)."})
    dataset_train_split: str = field(default="train", metadata={"help": "Split of dataset_name used for training."})
    prompt_column: str = field(default="prompt", metadata={"help": "Column of dataset_name holding the problem."})
    answer_column: str = field(
        default="solution", metadata={"help": "Column of dataset_name holding the final answer math-verify grades."}
    )
    eval_dataset_name: str | None = field(
        default=None,
        metadata={
            "help": "Held-out data (e.g. 'HuggingFaceH4/MATH-500'). Unset with the built-in task: its disjoint test "
            "split is used."
        },
    )
    eval_dataset_config: str | None = field(default=None, metadata={"help": "Configuration of eval_dataset_name."})
    eval_dataset_split: str = field(default="test", metadata={"help": "Split of eval_dataset_name."})
    eval_prompt_column: str = field(default="problem", metadata={"help": "Problem column of eval_dataset_name."})
    eval_answer_column: str = field(default="answer", metadata={"help": "Answer column of eval_dataset_name."})
    system_prompt: str | None = field(
        default=None, metadata={"help": "Optional system message prepended to every prompt (train and held-out)."}
    )
    prompt_template: str = field(
        default="{problem}",
        metadata={
            "help": "User turn built from a text prompt column (train and held-out); {problem} is replaced by the "
            "problem. The paper presets: '{problem} Please reason step by step, and put your final answer within "
            "\\boxed{}.'"
        },
    )
    strip_dapo_instruction: bool = field(
        default=False,
        metadata={
            "help": "Remove DAPO-Math-17k's instruction around each problem ('Solve the following math problem step by "
            "step. The last line of your response should be of the form Answer: $Answer ...' and 'Remember to put your "
            "answer on its own line after \"Answer:\".') before prompt_template is applied, as the paper's data "
            "preparation does (it asks for \\boxed{} instead)."
        },
    )
    max_prompt_length: int | None = field(
        default=None,
        metadata={
            "help": "Drop training problems whose chat-formatted prompt is longer than this many tokens (the paper: "
            "1,024, verl's filter_overlong_prompts); the count is reported. TRL 1.16 has no prompt-length setting."
        },
    )
    max_train_samples: int | None = field(
        default=None, metadata={"help": "Keep only the first N training rows (smoke tests)."}
    )
    # -- built-in task -----------------------------------------------------------------------------------------------
    train_size: int | None = field(
        default=20000,
        metadata={"help": "Built-in task: number of distinct training problems (None: every problem of the split)."},
    )
    heldout_size: int | None = field(
        default=500,
        metadata={"help": "Held-out problems (built-in task: generated; Hub eval set: first N rows; None = all)."},
    )
    heldout_split: str = field(
        default="test",
        metadata={
            "help": "Built-in task: the split the held-out evaluation reads. 'validation' (needs "
            "task_validation_fraction) is where settings are chosen; 'test' is scored once, never to choose.",
            "choices": ["validation", "test"],
        },
    )
    task_min_terms: int = field(default=3, metadata={"help": "Built-in task: fewest operands per problem."})
    task_max_terms: int = field(default=5, metadata={"help": "Built-in task: most operands per problem."})
    task_max_operand: int = field(default=9, metadata={"help": "Built-in task: operands are drawn from 0..N."})
    task_min_operand: int = field(default=0, metadata={"help": "Built-in task: the smallest operand."})
    task_split_by: str = field(
        default="expression",
        metadata={
            "help": "Built-in task: what the train/validation/test hash split is taken of. 'canonical': the problem's "
            "signed terms sorted, so no split holds a re-ordered twin (b+a for a+b) of another's problem.",
            "choices": ["expression", "canonical"],
        },
    )
    task_test_fraction: float = field(default=0.1, metadata={"help": "Built-in task: share of problems held out for test."})
    task_validation_fraction: float = field(
        default=0.0, metadata={"help": "Built-in task: share of problems held out for validation (0: none)."}
    )
    task_operators: str = field(
        default="+-", metadata={"help": "Built-in task: operators between operands ('+-' or '+')."}
    )
    task_teacher_error_rate: float = field(
        default=0.0,
        metadata={
            "help": "Built-in task: probability that a reference (warm-start) completion forgets a needed carry "
            "(needs task_operators='+'). The answers RL and evaluation grade against are always the true ones."
        },
    )
    task_nuisance: bool = field(
        default=False,
        metadata={
            "help": "Built-in task: reference completions choose each step's form at random (operand order, separator, "
            "an optional '!'), none of which changes the answer: reward-irrelevant entropy, as in long reasoning "
            "(needs task_operators='+'; the regime benchmark's task, docs/benchmarks.md section 5)."
        },
    )
    task_nuisance_swap: bool = field(
        default=True,
        metadata={
            "help": "Built-in task with task_nuisance: whether the operand order is one of the free choices (False: "
            "separators and notes only, the running sum first; a tiny model loses track of the terms otherwise)."
        },
    )
    task_scratchpad: bool = field(
        default=True,
        metadata={"help": "Built-in task: reference completions show the partial results before the boxed answer."},
    )
    task_seed: int = field(
        default=0, metadata={"help": "Seed of the built-in problem sets (fixed across training seeds by default)."}
    )
    # -- tiny model built locally -------------------------------------------------------------------------------------
    tiny_model: str | None = field(
        default=None,
        metadata={
            "help": "Build a random-init tiny Qwen3 locally instead of loading model_name_or_path: 'dense' or 'moe' "
            "(a character tokenizer is built too). Used by the CPU preset.",
            "choices": [*TINY_MODELS, None],
        },
    )
    tiny_hidden_size: int = field(default=128, metadata={"help": "Tiny model: hidden size."})
    tiny_num_layers: int = field(default=4, metadata={"help": "Tiny model: number of decoder layers."})
    tiny_num_heads: int = field(default=4, metadata={"help": "Tiny model: attention heads (2 key/value heads)."})
    tiny_intermediate_size: int = field(default=384, metadata={"help": "Tiny model: MLP width."})
    # -- warm start ---------------------------------------------------------------------------------------------------
    warmstart_steps: int = field(
        default=0,
        metadata={
            "help": "Supervised warm-start steps on the dataset's 'completion' column before RL (0 = none), for a "
            "model built here. The tiny preset imitates an imperfect teacher (task_teacher_error_rate), leaving RL a "
            "habit to fix."
        },
    )
    warmstart_learning_rate: float = field(default=3e-3, metadata={"help": "Warm start: peak AdamW learning rate."})
    warmstart_batch_size: int = field(default=64, metadata={"help": "Warm start: sequences per step."})
    # -- rewards ------------------------------------------------------------------------------------------------------
    reward_funcs: list[str] = field(
        default_factory=lambda: ["accuracy", "format"],
        metadata={
            "help": "Reward functions: 'accuracy' (trl.rewards.accuracy_reward, math-verify), 'reasoning_accuracy' "
            "(the same on the text after </think>), 'format' (one \\boxed{} answer), 'think_format' "
            "(trl.rewards.think_format_reward), 'dapo_accuracy' (+1 correct / -1 otherwise, math-verify; verl's DAPO "
            "reward, the paper's), 'soft_overlong' (trl.rewards.get_soft_overlong_punishment, see soft_overlong_cache) "
            "or a dotted import path. Weights: --reward_weights."
        },
    )
    soft_overlong_cache: int = field(
        default=0,
        metadata={
            "help": "Ramp length of the 'soft_overlong' reward, built as trl.rewards.get_soft_overlong_punishment("
            "max_completion_length, soft_overlong_cache): 0 up to max_completion_length - soft_overlong_cache tokens, "
            "then falling linearly to -1 at max_completion_length (the paper's 30B runs: 4,096 of 8,192)."
        },
    )
    # -- the paper's batch contract and its comparison (paper-* presets) -----------------------------------------------
    prompts_per_update: int | None = field(
        default=None,
        metadata={
            "help": "The paper's mini-batch M: prompts per optimizer update (32; x num_generations completions). When "
            "set, per_device_train_batch_size x processes x gradient_accumulation_steps must equal M x num_generations "
            "on the launch's process count: gradient_accumulation_steps is derived for that count unless given on the "
            "command line, and what does not divide fails before any model loads."
        },
    )
    algorithm: str | None = field(
        default=None,
        metadata={
            "help": "The paper's comparison as one switch: 'respo', 'grpo' (loss_type='dapo': token-level clip, epsilon "
            "0.2, token-mean), 'gspo' (loss_type='grpo', importance_sampling_level='sequence', epsilon 3e-4/4e-4, as "
            "TRL documents GSPO) or 'vespo' (TRL's VESPO defaults). Sets those TRL fields (an explicit conflicting "
            "flag is an error); unset leaves loss_type as given.",
            "choices": [*ALGORITHMS, None],
        },
    )
    # -- held-out evaluation ------------------------------------------------------------------------------------------
    eval_mode: str = field(
        default="greedy",
        metadata={
            "help": "Held-out accuracy before and after training: 'greedy' (HF generate, one greedy answer per "
            "problem), 'sampled' (trainer.evaluate(): num_generations_eval samples per problem at the training "
            "temperature, through vLLM when enabled; mean accuracy) or 'none'.",
            "choices": list(EVAL_MODES),
        },
    )
    eval_max_new_tokens: int | None = field(
        default=None, metadata={"help": "Greedy evaluation: token budget per answer (default max_completion_length)."}
    )
    eval_batch_size: int = field(default=128, metadata={"help": "Greedy evaluation: prompts per generate call."})
    heldout_eval_steps: int = field(
        default=0,
        metadata={
            "help": "Greedy mode: also measure held-out accuracy every N optimizer steps for the accuracy-vs-tokens "
            "plot (0 = before and after only). Sampled mode: use --eval_strategy steps --eval_steps N instead."
        },
    )
    heldout_curve_size: int | None = field(
        default=None, metadata={"help": "Held-out problems used for the in-training points (None = all)."}
    )
    save_at_steps: list[int] = field(
        default_factory=list,
        metadata={
            "help": "Also save a complete checkpoint after each of these optimizer steps, besides save_strategy's (a "
            "policy a given number of updates after a rollout batch was sampled: the staleness probe of "
            "benchmarks/smollm2_staleness.py).",
            "nargs": "+",
        },
    )
    keep_best_heldout: bool = field(
        default=False,
        metadata={
            "help": "Greedy mode with heldout_eval_steps: save the weights at the best in-training held-out point to "
            "output_dir/checkpoint-best-heldout (a checkpoint-* folder: a push leaves it out) and measure them on the whole held-out set at the end, so the report shows the "
            "best and the final checkpoint (RL curves on small models can peak before the last step). Without "
            "in-training points it does nothing."
        },
    )
    # -- the launch this preset was sized for -------------------------------------------------------------------------
    expected_num_processes: int | None = field(
        default=None,
        metadata={"help": "GPU (process) count the preset's batch arithmetic was sized for; a mismatch is reported."},
    )
    accelerate_config: str | None = field(
        default=None, metadata={"help": "The recipes/accelerate/ config the preset expects (documentation + report)."}
    )
    compact_progress: bool = field(
        default=True,
        metadata={"help": "One progress bar with reward/accuracy instead of printing every log dict."},
    )
    dry_run: int = field(
        default=0,
        metadata={
            "help": "Check the configuration as it would run on this many processes, print the batch arithmetic in "
            "TRL's and the paper's terms, and exit without loading a model, tokenizer or dataset (0: train; a bare "
            "--dry_run: the launch's process count, 1 without a launcher).",
            "nargs": "?",
            "const": LAUNCH_PROCESSES,
        },
    )


def available_presets(configs_dir: Path = PRESETS_DIR) -> list[str]:
    return sorted(p.stem for p in Path(configs_dir).glob("*.yaml"))


def resolve_argv(argv: list[str], configs_dir: Path) -> list[str]:
    """Turn ``--preset NAME`` into ``--config <path>``; with no config and no --model_name_or_path, use the embedded
    default (so ``--seed 1`` or ``--tiny_model moe`` alone are overrides of tiny-cpu.yaml)."""
    argv, configs_dir = list(argv), Path(configs_dir)
    presets = available_presets(configs_dir)
    matches = [i for i, a in enumerate(argv) if a == "--preset" or a.startswith("--preset=")]
    if matches:
        index = matches[0]
        if argv[index] == "--preset":
            if index + 1 >= len(argv):
                raise RecipeError("--preset needs a name; available presets: " + ", ".join(presets))
            name = argv[index + 1]
            del argv[index : index + 2]
        else:
            name = argv[index].split("=", 1)[1]
            del argv[index]
        name = name.removesuffix(".yaml")
        path = configs_dir / f"{name}.yaml"
        if not path.is_file():
            if name in RENAMED_PRESETS:
                why = "" if name == "tiny_cpu" else (
                    " (R = 4 epochs on the post-trained model); the ReSPO paper's runs are paper-qwen3-1.7b-base and "
                    "paper-qwen3-30b-a3b-base"
                )  # fmt: skip
                raise RecipeError(f"preset {name!r} was renamed {RENAMED_PRESETS[name]!r}{why}")
            close = difflib.get_close_matches(name, presets, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise RecipeError(f"unknown preset {name!r}; {hint}available presets: {', '.join(presets)}")
        if "--config" in argv:
            raise RecipeError("pass either --preset or --config, not both")
        return ["--config", str(path), "--preset", name, *argv]
    if "--config" in argv:
        config = argv[argv.index("--config") + 1] if argv.index("--config") + 1 < len(argv) else None
        if config is None or not Path(config).is_file():
            raise RecipeError(f"--config {config!r} is not a file; presets: {', '.join(presets)}")
        return argv
    if not any(a.split("=", 1)[0] == "--model_name_or_path" for a in argv):
        return ["--config", str(configs_dir / f"{DEFAULT_PRESET}.yaml"), "--preset", DEFAULT_PRESET, *argv]
    return argv


class RecipeParser(TrlParser):
    """``TrlParser`` whose own errors (a flag without its value, a value of the wrong type) are one line, like every
    other refusal: argparse prints the whole usage first (~270 lines with TRL's fields); ``--help`` still does."""

    def error(self, message):
        raise RecipeError(f"{message}; see --help")


def make_parser(config_class=ReSPOConfig) -> TrlParser:
    return RecipeParser((RecipeArguments, config_class, ModelConfig))


def launch_processes() -> int:
    """The process count of the launch this process belongs to (``accelerate launch`` and ``torchrun`` set
    ``WORLD_SIZE``), 1 without a launcher."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def resolve_dry_run(script_args: RecipeArguments) -> RecipeArguments:
    """A bare ``--dry_run`` plans for the launch's process count; a negative count is refused."""
    if script_args.dry_run == LAUNCH_PROCESSES:
        script_args.dry_run = launch_processes()
    if script_args.dry_run < 0:
        raise RecipeError(f"--dry_run {script_args.dry_run}: give a process count >= 1, or no value for the launch's")
    return script_args


@dataclass
class UncheckedConfig(ReSPOConfig):
    """``ReSPOConfig``'s fields exactly as the preset and the command line give them, with no validation and no
    derived values: the recipe derives the launch's fields from them (:func:`recipe_fields`) and builds the one
    ``ReSPOConfig`` from the result, so TRL's checks run once, on the fields the run will use, not on a preset's values
    sized for another process count."""

    def __post_init__(self):
        pass


def parse_args(argv: list[str] | None = None, num_processes: int | None = None, configs_dir: Path = PRESETS_DIR):
    """(script_args, training_args, model_args) from a preset/config plus overrides, parsed once; unknown keys are
    errors.

    The command line is parsed once (``TrlParser``) into the recipe's arguments, ``ReSPOConfig``'s raw fields and
    ``ModelConfig``; :func:`recipe_fields` derives what ``--algorithm`` and the paper's batch contract imply for
    ``num_processes`` processes (default: ``--dry_run``'s count, else the launch's); ``ReSPOConfig`` is built from the
    result, so every value goes through its own validation. ``num_processes`` lets tests size a preset for 8 GPUs.
    """
    argv = resolve_argv(sys.argv[1:] if argv is None else argv, configs_dir)
    check_flags(argv)
    for i, flag in enumerate(argv):  # a model path that does not exist fails before any config is built
        if flag.split("=", 1)[0] == "--model_name_or_path":
            value = flag.split("=", 1)[1] if "=" in flag else (argv[i + 1] if i + 1 < len(argv) else "")
            check_model_path(value)
    script_args, raw, model_args = make_parser(UncheckedConfig).parse_args_and_config(argv)
    processes = num_processes or resolve_dry_run(script_args).dry_run or launch_processes()
    values = {f.name: getattr(raw, f.name) for f in fields(ReSPOConfig) if f.init}
    values.update(recipe_fields(script_args, raw, explicit_flags(argv), processes))
    if script_args.dry_run and not values["use_cpu"]:
        import torch

        if not torch.cuda.is_available():  # a dry run checks the plan for its launch, not this machine (bf16 needs a GPU)
            values["use_cpu"] = True
    training_args = ReSPOConfig(**values)
    validate_args(script_args, training_args, model_args, num_processes=num_processes or script_args.dry_run or None)
    return script_args, training_args, model_args


def plan_table(script_args: RecipeArguments, training_args: ReSPOConfig, model_args: ModelConfig) -> str:
    """What ``--dry_run P`` prints: the run's batch plan on P processes, in TRL's terms and in the paper's."""
    processes = script_args.dry_run or training_args.world_size
    batch = batch_plan(training_args, processes)
    rows = [
        ("model", model_args.model_name_or_path or f"tiny {script_args.tiny_model}"),
        ("algorithm (loss_type)", f"{script_args.algorithm or training_args.loss_type} ({training_args.loss_type})"),
        ("processes", processes),
        ("per_device_train_batch_size", training_args.per_device_train_batch_size),
        ("gradient_accumulation_steps", training_args.gradient_accumulation_steps),
        ("steps_per_generation", training_args.steps_per_generation),
        ("num_iterations", training_args.num_iterations),
        ("generation batch (completions)", batch["generation_batch_size"]),
        ("prompts per rollout batch", batch["prompts_per_generation"]),
        ("completions per update", batch["completions_per_update"]),
        ("prompts per update (M)", batch["prompts_per_update"]),
        ("updates per rollout batch (N)", batch["updates_per_rollout"]),
        ("total updates (max_steps)", batch["total_updates"]),
        ("rollout batches", batch["rollout_batches"]),
        ("output_dir", training_args.output_dir),
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def known_flags() -> list[str]:
    """Every option the recipe accepts (the three dataclasses' fields, plus TrlParser's ``--config`` and ``--help``)."""
    names = {f.name for cls in (RecipeArguments, ReSPOConfig, ModelConfig) for f in fields(cls)}
    return sorted(names | {"config", "help"})


def check_flags(argv: list[str]) -> None:
    """Unknown ``--flags`` fail here, all at once, each with the closest known option (TrlParser would only list
    them after building every dataclass, in a traceback)."""
    known = set(known_flags())
    given = [a[2:].split("=", 1)[0] for a in argv if a.startswith("--")]
    for name in given:
        if name in RENAMED_FLAGS:
            raise RecipeError(f"--{name} was renamed --{RENAMED_FLAGS[name]} (ReSPOConfig's field, the one name of the "
                              "paper's staleness N from preset to trainer)")
    unknown = [name for name in given if name not in known]
    if unknown:
        hints = []
        for name in unknown:
            close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
            hints.append(f"--{name}" + (f" (did you mean --{close[0]}?)" if close else ""))
        raise RecipeError(f"unknown option{'s' if len(unknown) > 1 else ''} {', '.join(hints)}; see --help")


def explicit_flags(argv: list[str]) -> set[str]:
    """Names of the options given on the command line (``--name value`` or ``--name=value``)."""
    return {a[2:].split("=", 1)[0] for a in argv if a.startswith("--")}


def recipe_fields(script_args, raw, explicit: set[str], num_processes: int) -> dict:
    """The ``ReSPOConfig`` fields implied by ``--algorithm``, by the paper's batch contract and by an ``output_dir``
    template, for ``num_processes`` processes (``raw``: the fields as given, see :class:`UncheckedConfig`).

    The contract: a mini-batch of ``M = prompts_per_update`` prompts x ``G = num_generations`` completions per
    optimizer update (``per_device_train_batch_size x processes x gradient_accumulation_steps = M x G``) and
    ``N = respo_updates_per_rollout`` updates per rollout batch, each sample used once (``num_iterations = 1``;
    ``ReSPOConfig`` sets ``steps_per_generation = N x gradient_accumulation_steps``). ``gradient_accumulation_steps`` is
    derived for ``num_processes`` unless given on the command line; an explicit value (or batch size) that breaks the
    contract is a ``ValueError`` naming the fields and the fix. An ``output_dir`` holding ``{algorithm}``, ``{n}`` or
    ``{seed}`` is filled in.
    """
    values = {}
    if script_args.algorithm is not None:
        if script_args.algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {sorted(ALGORITHMS)}, got {script_args.algorithm!r}")
        for key, value in ALGORITHMS[script_args.algorithm].items():
            current = getattr(raw, key)
            if key in explicit and current != value:
                raise ValueError(
                    f"--algorithm {script_args.algorithm} sets {key}={value!r} but the command line also sets "
                    f"{key}={current!r}: drop --{key} (or --algorithm, and set the TRL fields yourself)"
                )
            values[key] = value
    if script_args.prompts_per_update is not None:  # the paper's presets
        values.update(paper_fields(script_args, raw, explicit, num_processes))
    if "{" in (raw.output_dir or ""):
        accumulation = values.get("gradient_accumulation_steps", raw.gradient_accumulation_steps)
        n = values.get("respo_updates_per_rollout", raw.respo_updates_per_rollout)
        if n is None:
            n = (raw.steps_per_generation or accumulation) // accumulation
        algorithm = script_args.algorithm or values.get("loss_type", raw.loss_type)
        try:
            values["output_dir"] = raw.output_dir.format(algorithm=algorithm, n=n, seed=raw.seed)
        except (KeyError, IndexError, ValueError) as error:
            raise ValueError(
                f"output_dir {raw.output_dir!r}: only {{algorithm}}, {{n}} and {{seed}} can be filled in ({error})"
            ) from None
    return values


def paper_fields(script_args, raw, explicit: set[str], num_processes: int) -> dict:
    """``gradient_accumulation_steps``, ``respo_updates_per_rollout`` and ``steps_per_generation`` that hold the paper's
    batch contract on ``num_processes`` processes (see :func:`recipe_fields`), or a ValueError that names what to
    change."""
    epochs = max(raw.num_iterations, raw.respo_reuse)  # aliases (ReSPOConfig reconciles them)
    if epochs != 1:
        raise ValueError(
            f"the paper's staleness N uses each sample once, so num_iterations (respo_reuse) must be 1, got "
            f"{epochs}: drop --num_iterations/--respo_reuse (epochs are the *-epochs4 presets)"
        )
    P, b, G = num_processes, raw.per_device_train_batch_size, raw.num_generations
    g = raw.gradient_accumulation_steps
    derived = {}
    M = script_args.prompts_per_update
    if M is not None:
        if M < 1:
            raise ValueError(f"prompts_per_update (the paper's M) must be >= 1, got {M}")
        C = M * G
        if C % (b * P):
            if C % P:
                fix = f"launch on a number of processes that divides {C}"
            else:
                options = [d for d in range(1, C // P + 1) if (C // P) % d == 0]
                fix = f"use a per_device_train_batch_size that divides {C // P}: one of {options}"
            raise ValueError(
                f"per_device_train_batch_size {b} x {P} processes = {b * P} completions per micro-step does not divide "
                f"the paper's mini-batch of {C} completions (prompts_per_update {M} x num_generations {G}): {fix}"
            )
        needed = C // (b * P)
        if g != needed and "gradient_accumulation_steps" in explicit:
            raise ValueError(
                f"gradient_accumulation_steps {g} x per_device_train_batch_size {b} x {P} processes = {g * b * P} "
                f"completions per optimizer update, but the paper's mini-batch is {C} (prompts_per_update {M} x "
                f"num_generations {G}): pass --gradient_accumulation_steps {needed}, or leave it out (it is derived)"
            )
        derived["gradient_accumulation_steps"] = needed
    N = raw.respo_updates_per_rollout
    if N is None:  # a contract preset that states TRL's steps_per_generation instead: N is read from it once
        s = raw.steps_per_generation or g
        if s % g:
            raise ValueError(
                f"steps_per_generation {s} is not a multiple of gradient_accumulation_steps {g}; set the staleness "
                "with --respo_updates_per_rollout N instead"
            )
        derived["respo_updates_per_rollout"] = s // g
    if "steps_per_generation" not in explicit:
        derived["steps_per_generation"] = None  # ReSPOConfig derives it from N and the accumulation above
    return derived


def validate_args(
    script_args: RecipeArguments, training_args: ReSPOConfig, model_args: ModelConfig, num_processes: int | None = None
) -> None:
    """Cheap checks with clear messages, before any model or dataset is loaded. ``num_processes`` is the process count
    the batch arithmetic is checked for (default: the preset's ``expected_num_processes``, or the launch's for presets
    with the paper's batch contract, whose accumulation is derived for the launch)."""
    if script_args.eval_mode not in EVAL_MODES:
        raise ValueError(f"eval_mode must be one of {EVAL_MODES}, got {script_args.eval_mode!r}")
    if script_args.tiny_model is None and not model_args.model_name_or_path:
        raise ValueError("set --model_name_or_path (e.g. Qwen/Qwen3-0.6B), --tiny_model dense|moe, or a --preset")
    if script_args.tiny_model is None:
        check_model_path(model_args.model_name_or_path)
    if script_args.tiny_model is not None and script_args.tiny_model not in TINY_MODELS:
        raise ValueError(f"tiny_model must be one of {TINY_MODELS}, got {script_args.tiny_model!r}")
    if script_args.tiny_model is not None and training_args.use_vllm:
        raise ValueError(
            "vLLM loads the model by name and cannot serve a --tiny_model built in memory; drop --use_vllm"
        )
    if script_args.dataset_name.startswith(BUILTIN_PREFIX):
        task = script_args.dataset_name.removeprefix(BUILTIN_PREFIX)
        if task not in BUILTIN_TASKS:
            raise ValueError(
                f"unknown built-in task {task!r}; available: {[BUILTIN_PREFIX + t for t in BUILTIN_TASKS]}"
            )
    if not script_args.reward_funcs:
        raise ValueError("reward_funcs is empty: RL needs at least one reward function (e.g. 'accuracy')")
    for name in script_args.reward_funcs:
        build_reward(name, script_args, training_args)  # unknown names fail here, with the list of known ones
    if "{" in training_args.output_dir:
        raise ValueError(f"output_dir {training_args.output_dir!r} still holds a placeholder: pass --output_dir")
    check_output_dir(training_args.output_dir)
    check_resume(training_args.resume_from_checkpoint, training_args.output_dir, training_args.world_size)
    weights = training_args.reward_weights
    if weights is not None and len(weights) != len(script_args.reward_funcs):
        raise ValueError(
            f"reward_weights has {len(weights)} values but reward_funcs has {len(script_args.reward_funcs)} "
            f"({script_args.reward_funcs})"
        )
    if script_args.eval_mode != "none" and not set(script_args.reward_funcs) & set(ACCURACY_REWARDS):
        raise ValueError(
            f"held-out accuracy (eval_mode={script_args.eval_mode!r}) is graded by an accuracy reward: add one of "
            f"{ACCURACY_REWARDS} to --reward_funcs, or pass --eval_mode none"
        )
    if script_args.heldout_eval_steps and script_args.eval_mode != "greedy":
        raise ValueError("heldout_eval_steps needs eval_mode='greedy'; with 'sampled' use --eval_strategy steps")
    paper = script_args.prompts_per_update is not None
    if num_processes is None:
        num_processes = training_args.world_size if paper else script_args.expected_num_processes or training_args.world_size
    batch = batch_plan(training_args, num_processes, sampled_eval=script_args.eval_mode == "sampled")
    if paper:
        check_paper_contract(script_args, batch)


def check_model_path(name: str) -> None:
    """A model given as a path must be a saved model directory (a name that is no path is a Hub id: its config is
    read, with a one-line error, before any weights load)."""
    path = os.path.expanduser(name)
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise RecipeError(f"--model_name_or_path {name!r} is a directory without config.json: not a saved model")
        return
    if os.path.exists(path):
        raise RecipeError(f"--model_name_or_path {name!r} is a file; pass a model directory or a Hub id (org/name)")
    if name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise RecipeError(f"--model_name_or_path {name!r}: no such directory (and not a Hub id of the form org/name)")


def check_resume(resume, output_dir: str, num_processes: int) -> None:
    """``--resume_from_checkpoint`` names something to resume from: ``true`` needs a complete checkpoint in
    ``output_dir``, a path must be a complete checkpoint folder (checked with the trainer's own rules)."""
    from ..buffer import checkpoint_status, last_complete_checkpoint

    if resume in (None, False, "") or (isinstance(resume, str) and resume.lower() in ("false", "none")):
        return
    if resume is True or (isinstance(resume, str) and resume.lower() in ("true", "last")):
        path, skipped = last_complete_checkpoint(output_dir, num_processes)
        if path is None:
            why = f" ({skipped[0][0]}: {skipped[0][1]})" if skipped else ""
            state = "does not exist" if not os.path.isdir(output_dir) else "holds no complete checkpoint-N folder"
            raise RecipeError(
                f"--resume_from_checkpoint true: output_dir {output_dir!r} {state}{why}; pass the run's --output_dir, "
                "or start without --resume_from_checkpoint"
            )
        return
    if not os.path.isdir(resume):
        raise RecipeError(f"--resume_from_checkpoint {resume!r}: no such directory (pass a checkpoint-N folder or true)")
    if not os.listdir(resume):
        raise RecipeError(f"--resume_from_checkpoint {resume!r} is an empty directory, not a checkpoint (pass a "
                          "checkpoint-N folder of a run, or true for the latest one in --output_dir)")  # fmt: skip
    problem = checkpoint_status(resume, num_processes)
    if problem:
        raise RecipeError(f"cannot resume from {resume}: {problem}")


def check_output_dir(path: str) -> None:
    """``output_dir`` must be a directory this process can create or write: checked (without creating anything)
    before minutes of warm start are spent."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"--output_dir {path!r} exists and is a file, not a directory: pass another path")
    existing = os.path.abspath(path)
    while not os.path.exists(existing):  # the nearest ancestor that exists decides whether it can be created
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ValueError(f"--output_dir {path!r} cannot be created: {existing!r} is a file")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"--output_dir {path!r} cannot be written: {existing!r} is not writable by this user")


def check_paper_contract(script_args: RecipeArguments, batch: dict) -> None:
    """The final configuration's batch plan against the paper's contract (``N`` holds by construction:
    ``ReSPOConfig`` derives ``steps_per_generation`` from it)."""
    problems = []
    if batch["reuse_epochs"] != 1:
        problems.append(f"num_iterations is {batch['reuse_epochs']}, the paper uses each sample once (1)")
    if script_args.prompts_per_update is not None and batch["prompts_per_update"] != script_args.prompts_per_update:
        problems.append(
            f"{batch['completions_per_update']} completions per update are {batch['prompts_per_update']} prompts, "
            f"not prompts_per_update {script_args.prompts_per_update}"
        )
    if problems:
        raise ValueError("the paper's batch contract does not hold: " + "; ".join(problems))


def build_reward(name: str, script_args: RecipeArguments, training_args: ReSPOConfig):
    """A reward function by name (:func:`respo_trl.rewards.resolve_reward`) with this run's completion budget."""
    return resolve_reward(name, training_args.max_completion_length, script_args.soft_overlong_cache)


def reward_description(script_args: RecipeArguments, training_args: ReSPOConfig) -> str:
    """Axis label saying what the training reward sums, e.g. 'reward = 1 x accuracy + 0.1 x format (max 1.1)'."""
    weights = training_args.reward_weights or [1.0] * len(script_args.reward_funcs)
    terms = " + ".join(f"{w:g} x {name}" for w, name in zip(weights, script_args.reward_funcs))
    return f"mean training reward = {terms}"
