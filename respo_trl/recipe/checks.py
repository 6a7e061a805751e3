"""Every check that can run before a model, tokenizer or dataset is loaded (the parsed arguments, paths, the resume
point, the paper's batch contract), so that a preset sized for 8 GPUs, a typo or a batch that does not divide fails
in seconds with one line that says what to change."""

from __future__ import annotations

import os

from trl import ModelConfig

from ..batching import batch_plan
from ..config import ReSPOConfig
from ..rewards import ACCURACY_REWARDS, resolve_reward
from .arguments import BUILTIN_PREFIX, BUILTIN_TASKS, EVAL_MODES, TINY_MODELS, RecipeArguments, RecipeError


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
    check_resume(training_args.resume_from_checkpoint, training_args.output_dir, training_args.world_size,
                 training_args.max_steps)
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
    for name in ("heldout_eval_steps", "heldout_eval_tokens"):
        if getattr(script_args, name) and script_args.eval_mode != "greedy":
            raise ValueError(f"{name} needs eval_mode='greedy'; with 'sampled' use --eval_strategy steps")
    if script_args.heldout_eval_steps and script_args.heldout_eval_tokens:
        raise ValueError("heldout_eval_steps and heldout_eval_tokens both schedule the held-out points: set one")
    for name in ("heldout_eval_tokens", "max_generated_tokens"):
        value = getattr(script_args, name)
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a positive number of tokens or unset, got {value!r}")
    paper = script_args.prompts_per_update is not None
    if num_processes is None:
        num_processes = training_args.world_size if paper else script_args.expected_num_processes or training_args.world_size
    batch = batch_plan(training_args, num_processes, sampled_eval=script_args.eval_mode == "sampled")
    if paper:
        check_paper_contract(script_args.prompts_per_update, batch)


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


def check_resume(resume, output_dir: str, num_processes: int, max_steps: int = -1) -> None:
    """``--resume_from_checkpoint`` names something to resume from: ``true`` needs a complete checkpoint in
    ``output_dir``, a path must be a complete checkpoint folder short of ``max_steps`` (the trainer's own rules)."""
    from ..checkpoints import checkpoint_status, finished_at, last_complete_checkpoint

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
        if finished := finished_at(path, max_steps):
            raise RecipeError(f"--resume_from_checkpoint true: the latest checkpoint is {path}: {finished}")
        return
    if not os.path.isdir(resume):
        raise RecipeError(f"--resume_from_checkpoint {resume!r}: no such directory (pass a checkpoint-N folder or true)")
    if not os.listdir(resume):
        raise RecipeError(f"--resume_from_checkpoint {resume!r} is an empty directory, not a checkpoint (pass a "
                          "checkpoint-N folder of a run, or true for the latest one in --output_dir)")  # fmt: skip
    problem = checkpoint_status(resume, num_processes) or finished_at(resume, max_steps)
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


def check_paper_contract(prompts_per_update: int, batch: dict) -> None:
    """The final configuration's batch plan (:func:`respo_trl.batching.batch_plan`) against the paper's contract
    (``N`` holds by construction: ``ReSPOConfig`` derives ``steps_per_generation`` from it)."""
    problems = []
    if batch["reuse_epochs"] != 1:
        problems.append(f"num_iterations is {batch['reuse_epochs']}, the paper uses each sample once (1)")
    if batch["prompts_per_update"] != prompts_per_update:
        problems.append(
            f"{batch['completions_per_update']} completions per update are {batch['prompts_per_update']} prompts, "
            f"not prompts_per_update {prompts_per_update}"
        )
    if problems:
        raise ValueError("the paper's batch contract does not hold: " + "; ".join(problems))


def build_reward(name: str, script_args: RecipeArguments, training_args: ReSPOConfig):
    """A reward function by name (:func:`respo_trl.rewards.resolve_reward`) with this run's completion budget."""
    return resolve_reward(name, training_args.max_completion_length, script_args.soft_overlong_cache)
