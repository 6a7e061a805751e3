"""The recipe's command line: one parse with TRL's ``TrlParser`` into ``RecipeArguments``, ``ReSPOConfig`` and
``trl.ModelConfig`` from a preset plus overrides, the fields ``--algorithm`` and the paper's batch contract imply, and
what ``--dry_run`` prints. Unknown or renamed flags fail first, in one line; the arguments are then checked
(:mod:`.checks`) before a model, tokenizer or dataset is loaded.
"""

from __future__ import annotations

import difflib
import os
import sys
from dataclasses import dataclass, fields
from pathlib import Path

from trl import ModelConfig, TrlParser

from .._compat import RENAMED_OPTIONS, refuse_renamed
from ..batching import batch_plan, paper_batch, updates_from_steps
from ..config import ReSPOConfig
from .arguments import ALGORITHMS, LAUNCH_PROCESSES, RecipeArguments, RecipeError
from .checks import check_model_path, validate_args
from .presets import PRESETS_DIR, resolve_argv


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
    explicit = explicit_flags(argv)
    values.update(recipe_fields(script_args, raw, explicit, processes))
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
    them after building every dataclass, in a traceback); a renamed flag, or a renamed key of the ``--config`` file,
    fails with its new name (:data:`respo_trl._compat.RENAMED_OPTIONS`)."""
    known = set(known_flags())
    given = [a[2:].split("=", 1)[0] for a in argv if a.startswith("--")]
    refuse_renamed(given, RENAMED_OPTIONS, "--{}", RecipeError)
    refuse_renamed(config_file_keys(argv), RENAMED_OPTIONS, "{}", RecipeError)
    unknown = [name for name in given if name not in known]
    if unknown:
        hints = []
        for name in unknown:
            close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
            hints.append(f"--{name}" + (f" (did you mean --{close[0]}?)" if close else ""))
        raise RecipeError(f"unknown option{'s' if len(unknown) > 1 else ''} {', '.join(hints)}; see --help")


def config_file_keys(argv: list[str]) -> dict:
    """The keys and values of the ``--config`` file ``argv`` names (presets included; ``{}`` without one)."""
    if "--config" not in argv or argv.index("--config") + 1 >= len(argv):
        return {}
    import yaml

    config = yaml.safe_load(Path(argv[argv.index("--config") + 1]).read_text())
    return config if isinstance(config, dict) else {}  # TrlParser refuses a file that is not a mapping


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
        values.update(paper_batch(
            prompts_per_update=script_args.prompts_per_update, num_generations=raw.num_generations,
            per_device_train_batch_size=raw.per_device_train_batch_size, num_processes=num_processes,
            gradient_accumulation_steps=raw.gradient_accumulation_steps,
            accumulation_given="gradient_accumulation_steps" in explicit,
            respo_updates_per_rollout=raw.respo_updates_per_rollout, steps_per_generation=raw.steps_per_generation,
            epochs=raw.num_iterations,
        ))  # fmt: skip
        if "steps_per_generation" not in explicit:
            values["steps_per_generation"] = None  # ReSPOConfig derives it from N and the accumulation above
    if "{" in (raw.output_dir or ""):
        accumulation = values.get("gradient_accumulation_steps", raw.gradient_accumulation_steps)
        n = values.get("respo_updates_per_rollout", raw.respo_updates_per_rollout)
        if n is None:
            n = updates_from_steps(raw.steps_per_generation or accumulation, accumulation)
        algorithm = script_args.algorithm or values.get("loss_type", raw.loss_type)
        try:
            values["output_dir"] = raw.output_dir.format(algorithm=algorithm, n=n, seed=raw.seed)
        except (KeyError, IndexError, ValueError) as error:
            raise ValueError(
                f"output_dir {raw.output_dir!r}: only {{algorithm}}, {{n}} and {{seed}} can be filled in ({error})"
            ) from None
    return values


