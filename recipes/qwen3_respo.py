"""Train Qwen3 with ReSPO (reshaped sequence policy optimisation) on verifiable math rewards, with rollout reuse.

What it does, top to bottom: parse a preset (YAML ``--config`` or ``--preset NAME``) plus command-line overrides with
TRL's ``TrlParser`` into script arguments, a ``ReSPOConfig`` and a ``trl.ModelConfig``; check everything that can be
checked before compute is spent (model id, dataset columns, reward functions, batch arithmetic); build the model
(dense or MoE, router auxiliary loss on for MoE), tokenizer, datasets and rewards (``trl.rewards.accuracy_reward``,
graded by math-verify, plus a ``\\boxed{}`` format reward); measure held-out accuracy; train with ``ReSPOTrainer``;
measure held-out accuracy again; save, write ``report.json`` and plots into ``output_dir``, and push to the Hub when
``--push_to_hub`` is set. ``--output_dir``, ``--push_to_hub``, ``--resume_from_checkpoint``, ``--seed`` and every
other TRL/transformers argument keep their usual meaning.

With no arguments it runs the embedded default, ``--config recipes/configs/tiny_cpu.yaml``: on a CPU, with nothing
downloaded, a tiny Qwen3 and a character tokenizer are built locally, warm-started by a short supervised fine-tune on
a built-in multi-step arithmetic task (``respo_trl.demo.tasks``), then trained with ReSPO under 4x rollout reuse: about
5 minutes on 2 idle CPU cores, greedy held-out accuracy 18% -> 92% (mean of 3 seeds, final checkpoint; the numbers
depend on the CPU type; docs/recipes.md has them).

Launch lines (presets in recipes/configs/, launch configs in recipes/accelerate/, details in docs/recipes.md):

    # CPU, nothing downloaded (the embedded default); the same with overrides
    accelerate launch recipes/qwen3_respo.py
    python recipes/qwen3_respo.py --seed 1 --output_dir outputs/tiny-seed1

    # 1 GPU: Qwen3-0.6B, vLLM colocated
    accelerate launch --config_file recipes/accelerate/ddp.yaml --num_processes 1 recipes/qwen3_respo.py \\
        --preset qwen3-0.6b-epochs4

    # 8 GPUs on one node: Qwen3-4B with DeepSpeed ZeRO-2; Qwen3-8B with ZeRO-3 or FSDP2
    accelerate launch --config_file recipes/accelerate/zero2.yaml recipes/qwen3_respo.py --preset qwen3-4b-epochs4
    accelerate launch --config_file recipes/accelerate/zero3.yaml recipes/qwen3_respo.py --preset qwen3-8b-epochs4

    # multi-node, 2 x 8 GPUs: run on every node with its rank
    accelerate launch --config_file recipes/accelerate/multinode_zero3.yaml \\
        --machine_rank $NODE_RANK --main_process_ip $MASTER_ADDR --main_process_port 29500 \\
        recipes/qwen3_respo.py --preset qwen3-30b-a3b-epochs4

    # resume an interrupted run (the rollout-reuse buffer is restored from the checkpoint)
    accelerate launch ... recipes/qwen3_respo.py --preset qwen3-4b-epochs4 --resume_from_checkpoint true

    # the ReSPO paper's runs (Base models, staleness N = 8/16/32, 1,024 updates) on 8 GPUs; a baseline is one flag
    accelerate launch --config_file recipes/accelerate/zero2.yaml recipes/qwen3_respo.py \\
        --preset paper-qwen3-1.7b-base --updates_per_rollout 32                 # ReSPO, N = 32
    accelerate launch --config_file recipes/accelerate/zero2.yaml recipes/qwen3_respo.py \\
        --preset paper-qwen3-1.7b-base --updates_per_rollout 32 --algorithm gspo   # or grpo, vespo
    accelerate launch --config_file recipes/accelerate/zero3.yaml recipes/qwen3_respo.py \\
        --preset paper-qwen3-30b-a3b-base --updates_per_rollout 16
    # on 2 nodes x 8 GPUs the same preset keeps the paper's 256 completions per update (accumulation is derived)
    accelerate launch --config_file recipes/accelerate/multinode_zero3.yaml \\
        --machine_rank $NODE_RANK --main_process_ip $MASTER_ADDR --main_process_port 29500 \\
        recipes/qwen3_respo.py --preset paper-qwen3-30b-a3b-base --updates_per_rollout 32
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

RECIPES_DIR = Path(__file__).resolve().parent
CONFIGS_DIR = RECIPES_DIR / "configs"
DEFAULT_PRESET = "tiny_cpu"
BUILTIN_PREFIX = "builtin:"
BUILTIN_TASKS = ("arithmetic",)
EVAL_MODES = ("greedy", "sampled", "none")
TINY_MODELS = ("dense", "moe")
# The presets before the paper's runs were added, renamed so nobody takes them for the paper's setup.
RENAMED_PRESETS = {f"qwen3-{size}": f"qwen3-{size}-epochs4" for size in ("0.6b", "1.7b", "4b", "8b", "14b", "30b-a3b")}
# DAPO-Math-17k's instruction around every problem (it asks for an "Answer:" line); the paper's data preparation
# removes it and asks for \boxed{} instead (--strip_dapo_instruction, --prompt_template).
DAPO_PREFIX = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
)
DAPO_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'
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
SOFT_OVERLONG = "soft_overlong"

if __package__ in (None, "") and str(RECIPES_DIR.parent) not in sys.path:
    sys.path.insert(0, str(RECIPES_DIR.parent))  # run from a checkout without `pip install -e .`

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from trl import ModelConfig, TrlParser

from respo_trl import ReSPOConfig

# ---------------------------------------------------------------------------------------------------------------------
# 1. Arguments
# ---------------------------------------------------------------------------------------------------------------------


@dataclass
class RecipeArguments:
    """Script arguments: data, task, warm start, evaluation and the launch a preset was sized for."""

    preset: str | None = field(
        default=None,
        metadata={"help": "Name of a YAML preset in recipes/configs/ (e.g. 'paper-qwen3-1.7b-base' or 'qwen3-4b-epochs4'); same as --config <path>."},
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
    train_size: int = field(default=20000, metadata={"help": "Built-in task: number of distinct training problems."})
    heldout_size: int | None = field(
        default=500,
        metadata={"help": "Held-out problems (built-in task: generated; Hub eval set: first N rows, None = all)."},
    )
    task_min_terms: int = field(default=3, metadata={"help": "Built-in task: fewest operands per problem."})
    task_max_terms: int = field(default=5, metadata={"help": "Built-in task: most operands per problem."})
    task_max_operand: int = field(default=9, metadata={"help": "Built-in task: operands are drawn from 0..N."})
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
    updates_per_rollout: int | None = field(
        default=None,
        metadata={
            "help": "The paper's staleness N (8, 16 or 32): optimizer updates fed by one rollout batch of N x M "
            "prompts, each sample used once (num_iterations = 1); mini-batch k is k updates stale. Sets TRL's "
            "steps_per_generation = N x gradient_accumulation_steps."
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
    keep_best_heldout: bool = field(
        default=False,
        metadata={
            "help": "Greedy mode with heldout_eval_steps: save the weights at the best in-training held-out point to "
            "output_dir/best-heldout and measure them on the whole held-out set at the end, so the report shows the "
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
            "TRL's and the paper's terms, and exit without loading a model, tokenizer or dataset (0: train)."
        },
    )


def available_presets() -> list[str]:
    return sorted(p.stem for p in CONFIGS_DIR.glob("*.yaml"))


def resolve_argv(argv: list[str]) -> list[str]:
    """Turn ``--preset NAME`` into ``--config <path>``; with no config and no --model_name_or_path, use the embedded
    default (so ``--seed 1`` or ``--tiny_model moe`` alone are overrides of tiny_cpu.yaml)."""
    argv = list(argv)
    matches = [i for i, a in enumerate(argv) if a == "--preset" or a.startswith("--preset=")]
    if matches:
        index = matches[0]
        if argv[index] == "--preset":
            if index + 1 >= len(argv):
                raise SystemExit("--preset needs a name; available presets: " + ", ".join(available_presets()))
            name = argv[index + 1]
            del argv[index : index + 2]
        else:
            name = argv[index].split("=", 1)[1]
            del argv[index]
        name = name.removesuffix(".yaml")
        path = CONFIGS_DIR / f"{name}.yaml"
        if not path.is_file():
            if name in RENAMED_PRESETS:
                raise SystemExit(
                    f"preset {name!r} was renamed {RENAMED_PRESETS[name]!r} (R = 4 epochs on the post-trained model); "
                    "the ReSPO paper's runs are paper-qwen3-1.7b-base and paper-qwen3-30b-a3b-base"
                )
            raise SystemExit(f"unknown preset {name!r}; available presets: {', '.join(available_presets())}")
        if "--config" in argv:
            raise SystemExit("pass either --preset or --config, not both")
        return ["--config", str(path), "--preset", name, *argv]
    if "--config" in argv:
        config = argv[argv.index("--config") + 1] if argv.index("--config") + 1 < len(argv) else None
        if config is None or not Path(config).is_file():
            raise SystemExit(f"--config {config!r} is not a file; presets: {', '.join(available_presets())}")
        return argv
    if not any(a.split("=", 1)[0] == "--model_name_or_path" for a in argv):
        return ["--config", str(CONFIGS_DIR / f"{DEFAULT_PRESET}.yaml"), "--preset", DEFAULT_PRESET, *argv]
    return argv


def make_parser(config_class=ReSPOConfig) -> TrlParser:
    return TrlParser((RecipeArguments, config_class, ModelConfig))


@dataclass
class UncheckedConfig(ReSPOConfig):
    """``ReSPOConfig``'s fields exactly as the preset and the command line give them, with no validation and no
    derived values: the first parsing pass reads the paper's contract from it (TRL's checks run on the second pass,
    on the fields the contract derives, not on a preset's values sized for another process count)."""

    def __post_init__(self):
        pass


def parse_args(argv: list[str] | None = None, num_processes: int | None = None):
    """(script_args, training_args, model_args) from a preset/config plus overrides; unknown keys are errors.

    Presets with the paper's batch contract (``prompts_per_update``, ``updates_per_rollout``) or an ``--algorithm``
    are parsed twice: the first pass reads them, :func:`derived_overrides` turns them into TRL fields for
    ``num_processes`` processes (default: the launch's), and the second pass builds the configs with those fields, so
    every value goes through ``ReSPOConfig``'s own validation. ``num_processes`` lets tests size a preset for 8 GPUs.
    """
    argv = resolve_argv(sys.argv[1:] if argv is None else argv)
    script_args, raw, _ = make_parser(UncheckedConfig).parse_args_and_config(argv)
    planned = num_processes or script_args.dry_run or int(os.environ.get("WORLD_SIZE", "1"))  # set by launchers
    extra = derived_overrides(script_args, raw, explicit_flags(argv), planned)
    script_args, training_args, model_args = make_parser().parse_args_and_config([*argv, *extra])
    validate_args(script_args, training_args, model_args, num_processes=num_processes or script_args.dry_run or None)
    return script_args, training_args, model_args


def batch_plan(script_args: RecipeArguments, training_args: ReSPOConfig, model_args: ModelConfig) -> str:
    """What ``--dry_run P`` prints: the run's batch arithmetic on P processes, in TRL's terms and in the paper's."""
    processes = script_args.dry_run or training_args.world_size
    batch = check_batch_arithmetic(training_args, processes)
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


def explicit_flags(argv: list[str]) -> set[str]:
    """Names of the options given on the command line (``--name value`` or ``--name=value``)."""
    return {a[2:].split("=", 1)[0] for a in argv if a.startswith("--")}


def derived_overrides(script_args, training_args, explicit: set[str], num_processes: int) -> list[str]:
    """The TRL fields implied by ``--algorithm`` and by the paper's batch contract, as extra command-line arguments.

    The contract: a mini-batch of ``M = prompts_per_update`` prompts x ``G = num_generations`` completions per
    optimizer update (``per_device_train_batch_size x processes x gradient_accumulation_steps = M x G``) and
    ``N = updates_per_rollout`` updates per rollout batch (``steps_per_generation = N x gradient_accumulation_steps``,
    ``num_iterations = 1``). ``gradient_accumulation_steps`` is derived for ``num_processes`` unless given on the command
    line; an explicit value (or batch size) that breaks the contract is a ``ValueError`` naming the fields and the fix.
    An ``output_dir`` holding ``{algorithm}``, ``{n}`` or ``{seed}`` is filled in.
    """
    extra: list[str] = []
    values = {}
    if script_args.algorithm is not None:
        if script_args.algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {sorted(ALGORITHMS)}, got {script_args.algorithm!r}")
        for key, value in ALGORITHMS[script_args.algorithm].items():
            current = getattr(training_args, key)
            if key in explicit and current != value:
                raise ValueError(
                    f"--algorithm {script_args.algorithm} sets {key}={value!r} but the command line also sets "
                    f"{key}={current!r}: drop --{key} (or --algorithm, and set the TRL fields yourself)"
                )
            values[key] = value
    contract = script_args.prompts_per_update is not None or script_args.updates_per_rollout is not None
    if contract:
        values.update(paper_batch_fields(script_args, training_args, explicit, num_processes))
        n = values.pop("updates_per_rollout", None)  # a recipe argument, not a config field
        if n is not None and n != script_args.updates_per_rollout:
            extra += ["--updates_per_rollout", str(n)]
    if "{" in (training_args.output_dir or ""):
        accumulation = values.get("gradient_accumulation_steps", training_args.gradient_accumulation_steps)
        n = values.get("steps_per_generation", training_args.steps_per_generation or accumulation) // accumulation
        algorithm = script_args.algorithm or values.get("loss_type", training_args.loss_type)
        try:
            values["output_dir"] = training_args.output_dir.format(algorithm=algorithm, n=n, seed=training_args.seed)
        except (KeyError, IndexError, ValueError) as error:
            raise ValueError(
                f"output_dir {training_args.output_dir!r}: only {{algorithm}}, {{n}} and {{seed}} can be filled in ({error})"
            ) from None
    for key, value in values.items():
        if getattr(training_args, key) != value:
            extra += [f"--{key}", str(value)]
    return extra


def paper_batch_fields(script_args, training_args, explicit: set[str], num_processes: int) -> dict:
    """``gradient_accumulation_steps`` and ``steps_per_generation`` that hold the paper's batch contract on
    ``num_processes`` processes (see :func:`derived_overrides`), or a ValueError that names what to change."""
    epochs = max(training_args.num_iterations, training_args.respo_reuse)  # aliases (ReSPOConfig reconciles them)
    if epochs != 1:
        raise ValueError(
            f"the paper's staleness N uses each sample once, so num_iterations (respo_reuse) must be 1, got "
            f"{epochs}: drop --num_iterations/--respo_reuse (epochs are the *-epochs4 presets)"
        )
    P, b, G = num_processes, training_args.per_device_train_batch_size, training_args.num_generations
    g = training_args.gradient_accumulation_steps
    fields = {}
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
        g = fields["gradient_accumulation_steps"] = needed
    N = script_args.updates_per_rollout
    alias = getattr(training_args, "respo_updates_per_rollout", None)  # ReSPOConfig's own N, the same switch
    if alias is not None:
        if "updates_per_rollout" in explicit and N != alias:
            raise ValueError(
                f"--updates_per_rollout {N} and --respo_updates_per_rollout {alias} are the same setting (the paper's "
                "N): pass one of them"
            )
        N = fields["updates_per_rollout"] = alias
    given_steps = training_args.steps_per_generation  # None: TRL's default, gradient_accumulation_steps
    if N is None:
        s = given_steps or training_args.gradient_accumulation_steps
        if s % training_args.gradient_accumulation_steps:
            raise ValueError(
                f"steps_per_generation {s} is not a multiple of gradient_accumulation_steps "
                f"{training_args.gradient_accumulation_steps}; set the staleness with --updates_per_rollout N instead"
            )
        N = s // training_args.gradient_accumulation_steps
    elif N < 1:
        raise ValueError(f"updates_per_rollout (the paper's N) must be >= 1, got {N}")
    if "steps_per_generation" in explicit and given_steps != N * g:
        raise ValueError(
            f"--steps_per_generation {given_steps} with gradient_accumulation_steps {g} is not "
            f"updates_per_rollout {N} updates per rollout batch (steps_per_generation must be {N * g}): set the "
            "staleness with --updates_per_rollout only"
        )
    fields["steps_per_generation"] = N * g
    return fields


def validate_args(
    script_args: RecipeArguments, training_args: ReSPOConfig, model_args: ModelConfig, num_processes: int | None = None
) -> None:
    """Cheap checks with clear messages, before any model or dataset is loaded. ``num_processes`` is the process count
    the batch arithmetic is checked for (default: the preset's ``expected_num_processes``, or the launch's for presets
    with the paper's batch contract, whose accumulation is derived for the launch)."""
    from respo_trl.demo.rewards import ACCURACY_REWARDS

    if script_args.eval_mode not in EVAL_MODES:
        raise ValueError(f"eval_mode must be one of {EVAL_MODES}, got {script_args.eval_mode!r}")
    if script_args.tiny_model is None and not model_args.model_name_or_path:
        raise ValueError("set --model_name_or_path (e.g. Qwen/Qwen3-0.6B), --tiny_model dense|moe, or a --preset")
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
    paper = script_args.prompts_per_update is not None or script_args.updates_per_rollout is not None
    if num_processes is None:
        num_processes = training_args.world_size if paper else script_args.expected_num_processes or training_args.world_size
    batch = check_batch_arithmetic(training_args, num_processes, sampled_eval=script_args.eval_mode == "sampled")
    if paper:
        check_paper_contract(script_args, batch)


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


def reward_description(script_args: RecipeArguments, training_args: ReSPOConfig) -> str:
    """Axis label saying what the training reward sums, e.g. 'reward = 1 x accuracy + 0.1 x format (max 1.1)'."""
    weights = training_args.reward_weights or [1.0] * len(script_args.reward_funcs)
    terms = " + ".join(f"{w:g} x {name}" for w, name in zip(weights, script_args.reward_funcs))
    return f"mean training reward = {terms}"


def best_checkpoint_accuracy(trainer, best: dict, best_dir: str, final_dir: str, measure, heldout) -> dict:
    """Whole-held-out-set accuracy of the best in-training checkpoint (chosen on the curve's subset), then the final
    weights are put back (a later push sends the final model)."""
    from safetensors.torch import load_file

    def load(folder):
        model = trainer.accelerator.unwrap_model(trainer.model)
        state = load_file(os.path.join(folder, "model.safetensors"), device=str(trainer.accelerator.device))
        model.load_state_dict(state, strict=False)

    if best["step"] == trainer.state.global_step or not os.path.isdir(best_dir):
        return {"step": trainer.state.global_step, "accuracy": None, "is_final": True, "path": final_dir}
    load(best_dir)
    result = measure(heldout)
    load(final_dir)
    return {
        "step": best["step"],
        "accuracy": result["accuracy"],
        "n": result["n"],
        "subset_accuracy": best["accuracy"],
        "subset_n": best.get("n"),
        "is_final": False,
        "path": best_dir,
    }


def pick_cpu_threads(training_args: ReSPOConfig, tiny: bool, logger) -> None:
    """One torch thread for a tiny model on a CPU (``python recipes/qwen3_respo.py`` leaves torch at 2 threads where
    ``accelerate launch`` sets 1)."""
    import torch

    from respo_trl.demo.tiny import use_one_cpu_thread

    if tiny and not torch.cuda.is_available():
        use_one_cpu_thread(logger, "CPU run of a tiny model")


def check_paper_contract(script_args: RecipeArguments, batch: dict) -> None:
    """The final configuration against the paper's contract (after :func:`derived_overrides`)."""
    problems = []
    if batch["reuse_epochs"] != 1:
        problems.append(f"num_iterations is {batch['reuse_epochs']}, the paper uses each sample once (1)")
    if script_args.prompts_per_update is not None and batch["prompts_per_update"] != script_args.prompts_per_update:
        problems.append(
            f"{batch['completions_per_update']} completions per update are {batch['prompts_per_update']} prompts, "
            f"not prompts_per_update {script_args.prompts_per_update}"
        )
    if script_args.updates_per_rollout is not None and batch["updates_per_rollout"] != script_args.updates_per_rollout:
        problems.append(
            f"{batch['updates_per_rollout']} updates per rollout batch, not updates_per_rollout "
            f"{script_args.updates_per_rollout}"
        )
    if problems:
        raise ValueError("the paper's batch contract does not hold: " + "; ".join(problems))


def check_batch_arithmetic(args: ReSPOConfig, num_processes: int, sampled_eval: bool = False) -> dict:
    """The batch sizes TRL derives for ``num_processes`` processes, or a ValueError naming what does not divide.

    ``GRPOConfig`` checks this for the world size it runs in; presets are checked here for the GPU count they were
    sized for, so a preset test on one CPU process catches arithmetic that would fail on 8 GPUs. Presets set
    ``steps_per_generation`` (not ``generation_batch_size``), so the generation batch is
    ``per_device_train_batch_size x processes x steps_per_generation``.
    """
    steps_per_generation = args.steps_per_generation
    generation_batch = args.per_device_train_batch_size * num_processes * steps_per_generation
    problems = []
    if generation_batch % args.num_generations:
        problems.append(
            f"generation batch {generation_batch} (= {args.per_device_train_batch_size} per device x {num_processes} "
            f"processes x {steps_per_generation} steps per generation) is not divisible by num_generations "
            f"{args.num_generations}"
        )
    if steps_per_generation % args.gradient_accumulation_steps:
        problems.append(
            f"steps_per_generation {steps_per_generation} is not a multiple of gradient_accumulation_steps "
            f"{args.gradient_accumulation_steps}: an optimizer step would straddle two generation batches"
        )
    num_generations_eval = args.num_generations_eval or args.num_generations
    if (sampled_eval or (args.do_eval and args.eval_strategy != "no")) and (
        args.per_device_eval_batch_size * num_processes
    ) % num_generations_eval:
        problems.append(
            f"global eval batch {args.per_device_eval_batch_size * num_processes} (per_device_eval_batch_size x "
            f"processes) is not divisible by num_generations_eval {num_generations_eval}"
        )
    if args.use_vllm and args.vllm_mode == "colocate" and num_processes % args.vllm_tensor_parallel_size:
        problems.append(
            f"vllm_tensor_parallel_size {args.vllm_tensor_parallel_size} does not divide {num_processes} processes"
        )
    if problems:
        raise ValueError(f"batch arithmetic for {num_processes} process(es): " + "; ".join(problems))
    completions_per_update = args.per_device_train_batch_size * num_processes * args.gradient_accumulation_steps
    updates_per_rollout = steps_per_generation // args.gradient_accumulation_steps  # each sample once (per epoch)
    optimizer_steps = steps_per_generation // args.gradient_accumulation_steps * args.respo_reuse
    return {
        "num_processes": num_processes,
        "generation_batch_size": generation_batch,
        "prompts_per_generation": generation_batch // args.num_generations,
        "steps_per_generation": steps_per_generation,
        "optimizer_steps_per_generation": optimizer_steps,
        # the paper's terms: mini-batch M prompts per update, N updates per rollout batch of N x M prompts
        "completions_per_update": completions_per_update,
        "prompts_per_update": (
            completions_per_update // args.num_generations
            if completions_per_update % args.num_generations == 0
            else completions_per_update / args.num_generations
        ),
        "updates_per_rollout": updates_per_rollout,
        "reuse_epochs": args.respo_reuse,
        "total_updates": args.max_steps,
        "rollout_batches": -(-args.max_steps // optimizer_steps) if args.max_steps > 0 else None,
    }


def build_reward(name: str, script_args: RecipeArguments, training_args: ReSPOConfig):
    """A reward function by name: the registry of ``respo_trl.demo.rewards`` (or a dotted path), plus ``soft_overlong``,
    TRL's ``get_soft_overlong_punishment(max_completion_length, soft_overlong_cache)``."""
    from respo_trl.demo.rewards import resolve_reward

    if name != SOFT_OVERLONG:
        return resolve_reward(name)
    from trl.rewards import get_soft_overlong_punishment

    cache, cap = script_args.soft_overlong_cache, training_args.max_completion_length
    if not 0 < cache <= cap:
        raise ValueError(
            f"reward 'soft_overlong' needs 0 < soft_overlong_cache <= max_completion_length ({cap}), got "
            f"soft_overlong_cache={cache}: pass --soft_overlong_cache (the paper's 30B runs: 4096 of 8192)"
        )
    return get_soft_overlong_punishment(max_completion_len=cap, soft_punish_cache=cache)


# ---------------------------------------------------------------------------------------------------------------------
# 2. Model and tokenizer
# ---------------------------------------------------------------------------------------------------------------------


def inspect_model(model_args: ModelConfig, training_args: ReSPOConfig):
    """The model's config (config file only, no weights), with a clear error for an unknown id or path."""
    from transformers import AutoConfig

    name = model_args.model_name_or_path
    try:
        return AutoConfig.from_pretrained(
            name, revision=model_args.model_revision, trust_remote_code=training_args.trust_remote_code
        )
    except (OSError, ValueError) as error:
        presets = ", ".join(available_presets())
        raise ValueError(
            f"cannot resolve model {name!r}: it is neither a local model directory nor a Hub model id whose config "
            f"could be fetched (offline mode: HF_HUB_OFFLINE={os.environ.get('HF_HUB_OFFLINE', '0')}). Check the "
            f"spelling (the presets use Qwen/Qwen3-0.6B ... Qwen/Qwen3-30B-A3B: {presets}). Cause: {error}"
        ) from None


def load_tokenizer(model_args: ModelConfig, training_args: ReSPOConfig):
    """The model's tokenizer (a few MB, no weights), to measure prompt lengths before the trainer loads the model."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        model_args.model_name_or_path,
        revision=model_args.model_revision,
        trust_remote_code=training_args.trust_remote_code,
    )


def is_moe(config) -> bool:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return hasattr(text, "output_router_logits") and getattr(text, "num_experts", 0) > 0


def configure_moe(config, training_args: ReSPOConfig, logger) -> dict:
    """Router auxiliary (load-balancing) loss on for MoE models; an error for a coefficient on a dense model."""
    text = config.get_text_config()
    moe = is_moe(config)
    coef = training_args.router_aux_loss_coef
    if not moe and coef:
        raise ValueError(
            f"router_aux_loss_coef={coef} but {config.model_type} is a dense model (no router); remove the setting"
        )
    if not moe:
        return {"moe": False}
    effective = getattr(text, "router_aux_loss_coef", 0.0) if coef is None else coef
    if effective == 0:
        logger.warning("MoE model with router_aux_loss_coef=0: the router load-balancing loss is OFF.")
    return {"moe": True, "num_experts": text.num_experts, "router_aux_loss_coef": effective}


def build_tiny(script_args: RecipeArguments, seed: int):
    from respo_trl.demo.tiny import build_char_tokenizer, tiny_qwen3

    tokenizer = build_char_tokenizer()
    model = tiny_qwen3(
        tokenizer,
        moe=script_args.tiny_model == "moe",
        hidden_size=script_args.tiny_hidden_size,
        num_layers=script_args.tiny_num_layers,
        num_heads=script_args.tiny_num_heads,
        num_kv_heads=max(1, script_args.tiny_num_heads // 2),
        intermediate_size=script_args.tiny_intermediate_size,
        seed=seed,
    )
    model.config._name_or_path = f"tiny-qwen3-{script_args.tiny_model}"
    return model, tokenizer


def warm_start(model, tokenizer, train_dataset, script_args: RecipeArguments, seed: int, on_step=None) -> list[float]:
    """Supervised warm start on the dataset's reference completions (the tiny preset imitates an imperfect teacher);
    returns the losses. Shared with benchmarks/reuse_lm.py, which warm-starts once per seed for all its arms."""
    from respo_trl.demo.warmstart import supervised_warm_start

    return supervised_warm_start(
        model,
        tokenizer,
        train_dataset["prompt"],
        train_dataset["completion"],
        steps=script_args.warmstart_steps,
        batch_size=script_args.warmstart_batch_size,
        learning_rate=script_args.warmstart_learning_rate,
        seed=seed,
        on_step=on_step,
    )


# ---------------------------------------------------------------------------------------------------------------------
# 3. Data
# ---------------------------------------------------------------------------------------------------------------------


def strip_dapo_instruction(text: str) -> str:
    """A DAPO-Math-17k problem without the instruction around it (its 'Answer:' preamble and closing line)."""
    return text.replace(DAPO_PREFIX, "").replace(DAPO_SUFFIX, "").strip()


def to_conversation(problem, system_prompt: str | None, template: str = "{problem}", strip_dapo: bool = False):
    """A chat prompt: a text problem becomes the user turn ``template.format(problem=...)`` (after removing the DAPO
    instruction when ``strip_dapo``); a conversation is kept as it is. ``system_prompt`` is prepended when set."""
    if isinstance(problem, list):
        messages = list(problem)
    else:
        text = strip_dapo_instruction(str(problem)) if strip_dapo else str(problem)
        messages = [{"role": "user", "content": template.replace("{problem}", text)}]
    if system_prompt and messages[0].get("role") != "system":
        messages = [{"role": "system", "content": system_prompt}, *messages]
    return messages


def drop_long_prompts(dataset, tokenizer, max_tokens: int, chat_template_kwargs: dict | None = None):
    """``(dataset, dropped)``: rows whose chat-formatted prompt (as TRL tokenises it: chat template with the generation
    prompt) is longer than ``max_tokens`` tokens are removed, like verl's ``filter_overlong_prompts``."""
    kwargs = json.loads(chat_template_kwargs) if isinstance(chat_template_kwargs, str) else chat_template_kwargs or {}

    def fits(row):
        ids = tokenizer.apply_chat_template(row["prompt"], tokenize=True, add_generation_prompt=True, **kwargs)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        return len(ids) <= max_tokens

    kept = dataset.filter(fits)
    return kept, len(dataset) - len(kept)


def load_split(name: str, config: str | None, split: str, prompt_column: str, answer_column: str, what: str):
    """``load_dataset`` (Hub id, local dir or data file), with the columns checked before anything else runs."""
    from datasets import load_dataset

    path = Path(name)
    try:
        if path.is_file():
            builder = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}.get(path.suffix)
            if builder is None:
                raise ValueError(f"unsupported data file type {path.suffix!r} (use .jsonl, .json, .parquet or .csv)")
            dataset = load_dataset(builder, data_files=str(path), split="train")
        else:
            dataset = load_dataset(name, name=config, split=split)
    except (FileNotFoundError, ValueError, OSError) as error:
        raise ValueError(f"cannot load the {what} dataset {name!r} (split {split!r}): {error}") from error
    missing = [c for c in (prompt_column, answer_column) if c not in dataset.column_names]
    if missing:
        raise ValueError(
            f"the {what} dataset {name!r} has no column {missing[0]!r} (columns: {dataset.column_names}); set "
            f"--{'eval_' if what == 'held-out' else ''}{'answer' if missing[0] == answer_column else 'prompt'}_column"
        )
    return dataset


def build_datasets(script_args: RecipeArguments):
    """(train, held-out) datasets with a conversational ``prompt`` and the answer in ``solution``."""
    from datasets import Dataset

    system = script_args.system_prompt
    template, strip = script_args.prompt_template, script_args.strip_dapo_instruction
    if "{problem}" not in template:
        raise ValueError(f"prompt_template {template!r} has no {{problem}} placeholder")
    if script_args.dataset_name.startswith(BUILTIN_PREFIX):
        from respo_trl.demo.tasks import ArithmeticTask

        task = ArithmeticTask(
            min_terms=script_args.task_min_terms,
            max_terms=script_args.task_max_terms,
            max_operand=script_args.task_max_operand,
            scratchpad=script_args.task_scratchpad,
            operators=script_args.task_operators,
            teacher_error_rate=script_args.task_teacher_error_rate,
            nuisance=script_args.task_nuisance,
        )
        train = task.rows("train", script_args.train_size, seed=script_args.task_seed)
        heldout = task.rows("test", script_args.heldout_size or 500, seed=script_args.task_seed)
        for rows in (train, heldout):
            rows["prompt"] = [to_conversation(p, system, template) for p in rows["prompt"]]
        train, heldout = Dataset.from_dict(train), Dataset.from_dict(heldout)
    else:
        raw = load_split(
            script_args.dataset_name,
            script_args.dataset_config,
            script_args.dataset_train_split,
            script_args.prompt_column,
            script_args.answer_column,
            "training",
        )
        if script_args.max_train_samples:
            raw = raw.select(range(min(script_args.max_train_samples, len(raw))))
        keep = {"completion"} & set(raw.column_names)  # a reference completion enables --warmstart_steps
        train = raw.map(
            lambda row: {
                "prompt": to_conversation(row[script_args.prompt_column], system, template, strip),
                "solution": str(row[script_args.answer_column]),
            },
            remove_columns=[c for c in raw.column_names if c not in keep],
        )
        heldout = None
    if script_args.eval_dataset_name:
        raw = load_split(
            script_args.eval_dataset_name,
            script_args.eval_dataset_config,
            script_args.eval_dataset_split,
            script_args.eval_prompt_column,
            script_args.eval_answer_column,
            "held-out",
        )
        if script_args.heldout_size:
            raw = raw.select(range(min(script_args.heldout_size, len(raw))))
        heldout = raw.map(
            lambda row: {
                "prompt": to_conversation(row[script_args.eval_prompt_column], system, template, strip),
                "solution": str(row[script_args.eval_answer_column]),
            },
            remove_columns=raw.column_names,
        )
    return train, heldout


# ---------------------------------------------------------------------------------------------------------------------
# 4. Held-out accuracy, progress and plots
# ---------------------------------------------------------------------------------------------------------------------


def greedy_accuracy(trainer, dataset, max_new_tokens: int, batch_size: int, reward_fn) -> dict:
    """Greedy held-out accuracy graded by the training accuracy reward, sharded over processes and summed."""
    import torch
    from trl.models import unwrap_model_for_generation

    from respo_trl.demo.warmstart import generate, grade

    accelerator = trainer.accelerator
    shard = dataset.select(range(accelerator.process_index, len(dataset), accelerator.num_processes))
    with unwrap_model_for_generation(trainer.model_wrapped, accelerator) as model:
        texts, lengths = generate(
            model, trainer.processing_class, shard["prompt"], max_new_tokens=max_new_tokens, batch_size=batch_size
        )
    correct = grade(texts, shard["solution"], reward_fn) if texts else []
    local = torch.tensor([sum(correct), len(correct), sum(lengths)], dtype=torch.float64, device=accelerator.device)
    total = accelerator.reduce(local, "sum").tolist()
    return {
        "accuracy": total[0] / max(total[1], 1),
        "n": int(total[1]),
        "mean_answer_tokens": total[2] / max(total[1], 1),
        "examples": [{"prompt": p[-1]["content"], "completion": t} for p, t in zip(shard["prompt"][:3], texts[:3])],
    }


def sampled_accuracy(trainer, dataset, accuracy_name: str) -> dict:
    """Mean accuracy reward of ``num_generations_eval`` samples per problem, from ``trainer.evaluate()``."""
    metrics = trainer.evaluate(eval_dataset=dataset)
    key = f"eval_rewards/{accuracy_name}/mean"
    if key not in metrics:
        raise RuntimeError(f"trainer.evaluate() returned no {key!r}; got {sorted(metrics)}")
    return {"accuracy": metrics[key], "n": len(dataset), "samples_per_problem": trainer.num_generations_eval}


def eval_curve_from_logs(log_history: list[dict], accuracy_name: str) -> list[dict]:
    """Sampled mode: the ``eval_strategy`` evaluations as (step, generated tokens, accuracy) points."""
    key, points, tokens = f"eval_rewards/{accuracy_name}/mean", [], 0
    for log in log_history:
        tokens = log.get("reuse/generated_tokens", tokens)
        if key in log:
            points.append({"step": log["step"], "generated_tokens": int(tokens), "accuracy": log[key]})
    return points


def make_callbacks(report: dict, curve_point=None, every: int = 0):
    """A compact progress bar and, when ``every`` > 0, a held-out accuracy point every ``every`` steps."""
    from tqdm.auto import tqdm
    from transformers import TrainerCallback

    class CompactProgress(TrainerCallback):
        """One progress bar with the numbers that matter, instead of a log dict per step."""

        bar = None

        def on_train_begin(self, args, state, control, **kwargs):
            if state.is_world_process_zero:
                self.bar = tqdm(total=state.max_steps, initial=state.global_step, desc="ReSPO", dynamic_ncols=True)

        def on_step_end(self, args, state, control, **kwargs):
            if self.bar is not None:
                self.bar.update(state.global_step - self.bar.n)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if self.bar is None or not logs:
                return
            postfix = dict(self.bar.postfix and [kv.split("=", 1) for kv in self.bar.postfix.split(", ")] or [])
            if "reward" in logs:
                postfix["reward"] = f"{logs['reward']:.2f}"
            if "reuse/generated_tokens" in logs:
                postfix["tokens"] = f"{logs['reuse/generated_tokens'] / 1e3:.0f}k"
            if report["curve"]:
                postfix["held-out"] = f"{100 * report['curve'][-1]['accuracy']:.1f}%"
            self.bar.set_postfix(postfix, refresh=False)

        def on_train_end(self, args, state, control, **kwargs):
            if self.bar is not None:
                self.bar.close()

    class HeldoutCurve(TrainerCallback):
        """Held-out accuracy every ``every`` optimizer steps, against generated tokens (all processes take part)."""

        def on_step_end(self, args, state, control, **kwargs):
            if every and state.global_step % every == 0 and state.global_step < state.max_steps:
                report["curve"].append(curve_point(state.global_step))

    return [CompactProgress(), HeldoutCurve()]


def print_summary(report: dict) -> None:
    def pct(x):
        return "n/a" if x is None else f"{100 * x:.1f}%"

    before, after = report["heldout"]["before"], report["heldout"]["after"]
    delta = None if before is None or after is None else 100 * (after - before)
    rows = [
        ("model", report["model"]["name"] + f" ({report['model']['parameters'] / 1e6:.2f}M params)"),
        ("held-out set", f"{report['heldout']['dataset']} (n={report['heldout']['n']}, {report['heldout']['mode']})"),
        ("warm-start demonstrations right", pct(report["warm_start"]["demonstration_accuracy"])),
        ("held-out accuracy before RL", pct(before)),
        ("held-out accuracy after RL (final)", pct(after)),
        ("change", "n/a" if delta is None else f"{delta:+.1f} points"),
        ("optimizer steps", str(report["training"]["global_step"])),
        ("generated tokens", f"{report['training']['generated_tokens']:,}"),
        ("rollout reuse R", str(report["training"]["respo_reuse"])),
        (
            "grad norm of reuse passes / fresh",
            ", ".join(f"{v:.2f}" for v in report["training"]["mean_grad_norm_vs_fresh"].values()) or "n/a (R = 1)",
        ),
        ("warm-start time", f"{report['time_s']['warm_start']:.0f} s"),
        ("RL time", f"{report['time_s']['train']:.0f} s"),
        ("wall time (this process)", f"{report['time_s']['total']:.0f} s"),
    ]
    best = report["heldout"].get("best")
    if best and not best["is_final"]:
        rows.insert(5, (f"held-out accuracy, best checkpoint (step {best['step']})", pct(best["accuracy"])))
    elif best:
        rows.insert(5, ("best checkpoint", "the final one"))
    width = max(len(k) for k, _ in rows)
    line = "+" + "-" * (width + 2) + "+" + "-" * 52 + "+"
    print("\n" + line)
    for key, value in rows:
        print(f"| {key:<{width}} | {value:<50} |")
    print(line)
    print(f"report and plots: {report['output_dir']}")


# ---------------------------------------------------------------------------------------------------------------------
# 5. Main
# ---------------------------------------------------------------------------------------------------------------------


def main(script_args: RecipeArguments, training_args: ReSPOConfig, model_args: ModelConfig) -> dict:
    start = time.time()
    import torch
    from accelerate import PartialState
    from accelerate.logging import get_logger
    from tqdm.auto import tqdm
    from transformers import ProgressCallback, set_seed
    from trl import get_peft_config

    from respo_trl import ReSPOTrainer
    from respo_trl.demo.plots import plot_run
    from respo_trl.demo.rewards import ACCURACY_REWARDS, probe_rewards, reward_name
    from respo_trl.demo.warmstart import grade

    logger = get_logger(__name__)
    state = PartialState()
    world = state.num_processes
    pick_cpu_threads(training_args, script_args.tiny_model is not None, logger)
    paper = script_args.prompts_per_update is not None or script_args.updates_per_rollout is not None
    if paper:
        batch = check_batch_arithmetic(training_args, world)
        logger.info(
            f"the paper's batch arithmetic on {world} process(es): {batch['prompts_per_update']} prompts x "
            f"{training_args.num_generations} per update (per_device_train_batch_size "
            f"{training_args.per_device_train_batch_size} x gradient_accumulation_steps "
            f"{training_args.gradient_accumulation_steps}), N = {batch['updates_per_rollout']} updates per rollout batch "
            f"of {batch['prompts_per_generation']} prompts (steps_per_generation {training_args.steps_per_generation}), "
            f"{batch['total_updates']} updates",
            main_process_only=True,
        )
    elif script_args.expected_num_processes and script_args.expected_num_processes != world:
        logger.warning(
            f"this preset was sized for {script_args.expected_num_processes} processes "
            f"({script_args.accelerate_config or 'see docs/recipes.md'}) but runs on {world}: the global batch "
            "scales with the process count.",
            main_process_only=True,
        )
    resume = training_args.resume_from_checkpoint
    if isinstance(resume, str) and resume.lower() in ("true", "last"):
        resume = True  # the latest checkpoint in output_dir
    set_seed(training_args.seed)

    # -- rewards: resolved first, so a bad name fails before anything is built ----------------------------------------
    reward_funcs = [build_reward(name, script_args, training_args) for name in script_args.reward_funcs]
    accuracy_fn = next((f for n, f in zip(script_args.reward_funcs, reward_funcs) if n in ACCURACY_REWARDS), None)

    # -- model: built locally (tiny) or only its config read (Hub/local weights are loaded by the trainer) ------------
    if script_args.tiny_model:
        model, tokenizer = build_tiny(script_args, seed=training_args.seed)
        model_info = configure_moe(model.config, training_args, logger)
        model_name = model.config._name_or_path
    else:
        config = inspect_model(model_args, training_args)
        model_info = configure_moe(config, training_args, logger)
        init_kwargs = {
            "revision": model_args.model_revision,
            "trust_remote_code": training_args.trust_remote_code,
            "attn_implementation": model_args.attn_implementation,
            "dtype": model_args.dtype,
        }
        training_args.model_init_kwargs = {**init_kwargs, **(training_args.model_init_kwargs or {})}
        model, tokenizer, model_name = model_args.model_name_or_path, None, model_args.model_name_or_path

    # -- data, then every reward function probed on real rows (clear errors before any generation) --------------------
    with state.main_process_first():
        train_dataset, heldout = build_datasets(script_args)
        dropped = 0
        if script_args.max_prompt_length:
            length_tokenizer = tokenizer if tokenizer is not None else load_tokenizer(model_args, training_args)
            train_dataset, dropped = drop_long_prompts(
                train_dataset, length_tokenizer, script_args.max_prompt_length, training_args.chat_template_kwargs
            )
            if len(train_dataset) == 0:
                raise ValueError(
                    f"every training prompt is longer than max_prompt_length={script_args.max_prompt_length} tokens"
                )
            logger.info(
                f"dropped {dropped} training prompts longer than {script_args.max_prompt_length} tokens",
                main_process_only=True,
            )
    if script_args.eval_mode != "none" and heldout is None:
        raise ValueError("no held-out set: set --eval_dataset_name (e.g. HuggingFaceH4/MATH-500) or --eval_mode none")
    probe_rewards(
        reward_funcs,
        train_dataset.select(range(min(8, len(train_dataset)))).to_dict(),
        "solution",
        accuracy_funcs=[accuracy_fn] if accuracy_fn else [],
    )
    if heldout is not None and accuracy_fn is not None:
        probe_rewards(
            [accuracy_fn],
            heldout.select(range(min(8, len(heldout)))).to_dict(),
            "solution",
            accuracy_funcs=[accuracy_fn],
        )

    # -- warm start: a short supervised fine-tune on reference completions (skipped when resuming) --------------------
    warm_losses, warm_start_s, demo_accuracy = [], 0.0, None
    if script_args.warmstart_steps and not resume:
        if "completion" not in train_dataset.column_names:
            raise ValueError("--warmstart_steps needs a 'completion' column with reference answers in the dataset")
        if isinstance(model, str):
            raise ValueError(
                "--warmstart_steps is for a model built here (--tiny_model); start from an SFT checkpoint"
            )
        t0 = time.time()
        bar = tqdm(total=script_args.warmstart_steps, desc="warm start (SFT)", disable=not state.is_main_process)

        def on_step(step, loss):
            bar.update(1)
            if step % 10 == 0:
                bar.set_postfix(loss=f"{loss:.3f}", refresh=False)

        model.to(training_args.device)
        warm_losses = warm_start(
            model,
            tokenizer,
            train_dataset,
            script_args,
            seed=training_args.seed,
            on_step=on_step,
        )
        bar.close()
        warm_start_s = time.time() - t0
        if accuracy_fn is not None:  # how good the demonstrations the warm start imitated are
            sample = train_dataset.select(range(min(500, len(train_dataset))))
            demo_accuracy = sum(grade(sample["completion"], sample["solution"], accuracy_fn)) / len(sample)
    if "completion" in train_dataset.column_names:
        train_dataset = train_dataset.remove_columns("completion")  # RL sees prompts and answers only

    # -- trainer ------------------------------------------------------------------------------------------------------
    sampled = script_args.eval_mode == "sampled"
    trainer = ReSPOTrainer(
        model=model,
        reward_funcs=reward_funcs,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=heldout if sampled or training_args.eval_strategy != "no" else None,
        processing_class=tokenizer,
        peft_config=get_peft_config(model_args),
    )
    eval_tokens = script_args.eval_max_new_tokens or training_args.max_completion_length
    curve_set = heldout
    if heldout is not None and script_args.heldout_curve_size:
        curve_set = heldout.select(range(min(script_args.heldout_curve_size, len(heldout))))

    def heldout_accuracy(dataset):
        if sampled:
            return sampled_accuracy(trainer, dataset, reward_name(accuracy_fn))
        return greedy_accuracy(trainer, dataset, eval_tokens, script_args.eval_batch_size, accuracy_fn)

    best_dir = os.path.join(training_args.output_dir, "best-heldout")
    best = {"step": None, "accuracy": -1.0}

    def curve_point(step, dataset=curve_set):
        result = heldout_accuracy(dataset)
        tokens = trainer.rollouts.generated_tokens
        if script_args.keep_best_heldout and step > 0 and result["accuracy"] > best["accuracy"]:
            trainer.save_model(best_dir)  # every process takes part, as in any save
            best.update(step=step, accuracy=result["accuracy"], n=result["n"])
        return {"step": step, "generated_tokens": tokens, "accuracy": result["accuracy"], "n": result["n"]}

    report = {
        "preset": script_args.preset,
        "output_dir": training_args.output_dir,
        "model": {
            "name": model_name,
            "parameters": sum(p.numel() for p in trainer.model.parameters()),
            **model_info,
        },
        "task": script_args.dataset_name,
        "data": {
            "train_rows": len(train_dataset),
            "max_prompt_length": script_args.max_prompt_length,
            "dropped_long_prompts": dropped,
        },
        "seed": training_args.seed,
        "num_processes": world,
        "distributed_type": trainer.accelerator.distributed_type.value,
        "resumed_from": None if not resume else str(resume),
        "heldout": {
            "dataset": script_args.eval_dataset_name or f"{script_args.dataset_name} (test split)",
            "n": 0 if heldout is None else len(heldout),
            "mode": script_args.eval_mode,
            "before": None,
            "after": None,
        },
        "curve": [],
        "warm_start": {
            "steps": len(warm_losses),
            "final_loss": warm_losses[-1] if warm_losses else None,
            "demonstration_accuracy": demo_accuracy,
        },
    }
    if script_args.compact_progress and not training_args.disable_tqdm:
        trainer.remove_callback(ProgressCallback)
    every = script_args.heldout_eval_steps if script_args.eval_mode == "greedy" else 0
    for callback in make_callbacks(report, curve_point, every):
        trainer.add_callback(callback)

    # -- held-out accuracy before RL (not when resuming: the first run measured the starting point) -------------------
    t0 = time.time()
    if script_args.eval_mode != "none" and not resume:
        before = heldout_accuracy(heldout)
        report["heldout"]["before"], report["heldout"]["before_detail"] = before["accuracy"], before
        report["curve"].append({"step": 0, "generated_tokens": 0, "accuracy": before["accuracy"], "n": before["n"]})
        trainer.accelerator.print(f"held-out accuracy before RL: {100 * before['accuracy']:.1f}% (n={before['n']})")
    eval_s = time.time() - t0

    # -- RL -----------------------------------------------------------------------------------------------------------
    t0 = time.time()
    train_result = trainer.train(resume_from_checkpoint=resume)
    train_s = time.time() - t0

    # -- held-out accuracy after RL ----------------------------------------------------------------------------------
    t0 = time.time()
    if script_args.eval_mode != "none":
        if sampled:
            logged = eval_curve_from_logs(trainer.state.log_history, reward_name(accuracy_fn))
            report["curve"].extend(point for point in logged if point["step"] > 0)
        last = report["curve"][-1] if report["curve"] else None
        if sampled and last is not None and last["step"] == trainer.state.global_step and last["step"] > 0:
            after = {"accuracy": last["accuracy"], "n": len(heldout), "from": "last eval_strategy evaluation"}
        else:
            after = heldout_accuracy(heldout)
            report["curve"].append(
                {
                    "step": trainer.state.global_step,
                    "generated_tokens": trainer.rollouts.generated_tokens,
                    "accuracy": after["accuracy"],
                    "n": after["n"],
                }
            )
        report["heldout"]["after"], report["heldout"]["after_detail"] = after["accuracy"], after
    eval_s += time.time() - t0

    # -- save; the best in-training checkpoint measured on the whole held-out set too ---------------------------------
    trainer.save_model(training_args.output_dir)
    if best["step"] is not None and script_args.eval_mode != "none":
        final = report["curve"][-1]
        if final.get("n") == best.get("n") and final["accuracy"] >= best["accuracy"]:
            best.update(step=final["step"], accuracy=final["accuracy"])  # the final checkpoint is the best one
        t0 = time.time()
        report["heldout"]["best"] = best_checkpoint_accuracy(trainer, best, best_dir, training_args.output_dir, heldout_accuracy, heldout)
        eval_s += time.time() - t0
    trainer.save_state()  # trainer_state.json: the full log history the plots are drawn from
    history = trainer.state.log_history
    rewards = [h["reward"] for h in history if "reward" in h]
    throughput = {}
    for key in ("grad_throughput/pos", "grad_throughput/neg", "clip_grad_throughput/pos", "clip_grad_throughput/neg"):
        values = [h.get(f"starvation/{key}") for h in history]
        values = [v for v in values if v is not None and math.isfinite(v)]
        throughput[key] = sum(values) / len(values) if values else None
    step_size = {}  # mean grad_norm of each reuse pass relative to its batch's fresh pass (docs/method.md, section 6)
    for h in history:
        if "reuse/grad_norm_vs_fresh" in h and math.isfinite(h["reuse/grad_norm_vs_fresh"]):
            step_size.setdefault(f"pass_{int(h['reuse/pass'])}", []).append(h["reuse/grad_norm_vs_fresh"])
    report["training"] = {
        "global_step": trainer.state.global_step,
        "generated_tokens": trainer.rollouts.generated_tokens,
        "respo_reuse": training_args.respo_reuse,
        "loss_type": training_args.loss_type,
        "learning_rate": training_args.learning_rate,
        "reward_first": rewards[0] if rewards else None,
        "reward_last": rewards[-1] if rewards else None,
        "mean_grad_throughput": throughput,
        "mean_grad_norm_vs_fresh": {k: sum(v) / len(v) for k, v in sorted(step_size.items())},
        "train_runtime_s": train_result.metrics.get("train_runtime"),
        "batch": check_batch_arithmetic(training_args, world, sampled_eval=sampled),
    }
    report["time_s"] = {"warm_start": warm_start_s, "train": train_s, "heldout_eval": eval_s}
    report["args"] = {"script": asdict(script_args), "model": asdict(model_args)}
    if trainer.accelerator.is_main_process:
        report["plots"] = plot_run(
            history,
            report["curve"],
            training_args.output_dir,
            title=f"{model_name}, {training_args.loss_type} R={training_args.respo_reuse}, seed {training_args.seed}",
            accuracy_label=f"held-out accuracy, {script_args.eval_mode}",
            loss_name=training_args.loss_type,
            reward_label=reward_description(script_args, training_args),
        )
        curves = os.path.join(training_args.output_dir, "training_curves.png")  # the model card's (respo_trl.hub.card)
        if os.path.isfile(curves):
            report["plots"].append(curves)
        report["time_s"]["total"] = time.time() - start
        with open(os.path.join(training_args.output_dir, "report.json"), "w") as f:
            json.dump(report, f, indent=1, default=str)
        print_summary(report)

    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)
        trainer.accelerator.print(f"pushed to https://huggingface.co/{trainer.hub_model_id}")
    trainer.accelerator.wait_for_everyone()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return report


if __name__ == "__main__":
    parsed = parse_args()
    if parsed[0].dry_run:
        print(batch_plan(*parsed))
    else:
        main(*parsed)
