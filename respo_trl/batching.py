"""The batch plan: TRL's batch settings read in the paper's terms, derived in one place.

TRL sizes a run with ``per_device_train_batch_size``, ``gradient_accumulation_steps``, ``steps_per_generation``,
``num_generations`` and ``num_iterations``; the paper with ``M`` prompts per optimizer update and the staleness ``N``
(updates fed by one rollout batch, each sample used once); this package adds epochs ``R`` (``num_iterations``). ``N``
has one name from a preset to the trainer, ``respo_updates_per_rollout`` (``ReSPOConfig`` turns it into
``steps_per_generation = N x gradient_accumulation_steps``); everything that reports the arithmetic (the recipe's
checks and ``--dry_run``, ``report.json``, the model card) reads it from :func:`batch_plan`, so a preset sized for 8
GPUs is checked on one CPU process for the launch it names.
"""

from __future__ import annotations

from collections.abc import Mapping


def _get(args, name: str, default=None):
    if isinstance(args, Mapping):
        return args.get(name, default)
    return getattr(args, name, default)


# The one conversion between the paper's N and TRL's steps_per_generation, both ways; everything else reads these.


def steps_from_updates(updates_per_rollout: int, gradient_accumulation_steps: int) -> int:
    """TRL's ``steps_per_generation`` (micro-steps per rollout batch) for ``N`` updates per rollout batch."""
    return updates_per_rollout * gradient_accumulation_steps


def updates_from_steps(steps_per_generation: int, gradient_accumulation_steps: int) -> int | float:
    """``N`` for TRL's ``steps_per_generation``: updates per pass over one rollout batch (a fraction when one update
    spans several rollout batches)."""
    steps, accumulation = steps_per_generation, gradient_accumulation_steps
    return steps // accumulation if steps % accumulation == 0 else round(steps / accumulation, 3)


def updates_per_rollout(args) -> int | float:
    """``N`` of a config (or its ``to_dict()``): :func:`updates_from_steps` of its TRL fields."""
    steps, accumulation = _get(args, "steps_per_generation") or 1, _get(args, "gradient_accumulation_steps") or 1
    return updates_from_steps(steps, accumulation)


def micro_steps_per_cycle(steps_per_generation: int, num_iterations: int) -> int:
    """Micro-steps one rollout batch serves: ``steps_per_generation`` per pass, ``num_iterations`` (``R``) passes."""
    return steps_per_generation * num_iterations


def paper_batch(
    *,
    prompts_per_update: int,
    num_generations: int,
    per_device_train_batch_size: int,
    num_processes: int,
    gradient_accumulation_steps: int,
    accumulation_given: bool,
    respo_updates_per_rollout: int | None,
    steps_per_generation: int | None,
    epochs: int,
) -> dict:
    """The paper's batch contract on ``num_processes`` processes, from plain numbers: a mini-batch of
    ``M = prompts_per_update`` prompts x ``G`` completions per update (``per_device x processes x accumulation = M x
    G``), ``N`` updates per rollout batch, each sample used once. Returns the ``gradient_accumulation_steps`` that
    holds it (and ``respo_updates_per_rollout`` when the preset stated ``steps_per_generation`` instead), or a
    ``ValueError`` naming what to change (``accumulation_given``: the accumulation was set on the command line)."""
    if epochs != 1:
        raise ValueError(
            f"the paper's staleness N uses each sample once, so num_iterations must be 1, got "
            f"{epochs}: drop --num_iterations (epochs are the *-epochs4 presets)"
        )
    M, G, b, P, g = prompts_per_update, num_generations, per_device_train_batch_size, num_processes, gradient_accumulation_steps
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
    if g != needed and accumulation_given:
        raise ValueError(
            f"gradient_accumulation_steps {g} x per_device_train_batch_size {b} x {P} processes = {g * b * P} "
            f"completions per optimizer update, but the paper's mini-batch is {C} (prompts_per_update {M} x "
            f"num_generations {G}): pass --gradient_accumulation_steps {needed}, or leave it out (it is derived)"
        )
    derived = {"gradient_accumulation_steps": needed}
    if respo_updates_per_rollout is None:  # a contract preset that states TRL's steps_per_generation: N read once
        s = steps_per_generation or g
        if s % g:
            raise ValueError(
                f"steps_per_generation {s} is not a multiple of gradient_accumulation_steps {g}; set the staleness "
                "with --respo_updates_per_rollout N instead"
            )
        derived["respo_updates_per_rollout"] = updates_from_steps(s, g)
    return derived


def batch_plan(args, num_processes: int, sampled_eval: bool = False) -> dict:
    """The batch sizes TRL derives for ``num_processes`` processes, in its terms and the paper's, or a ``ValueError``
    naming what does not divide.

    ``GRPOConfig`` checks this for the world size it runs in; presets are checked here for the process count they were
    sized for, so a preset test on one CPU process catches arithmetic that would fail on 8 GPUs. The generation batch is
    ``per_device_train_batch_size x processes x steps_per_generation``.
    """
    per_device, accumulation = _get(args, "per_device_train_batch_size"), _get(args, "gradient_accumulation_steps")
    steps_per_generation, generations = _get(args, "steps_per_generation"), _get(args, "num_generations")
    epochs = _get(args, "num_iterations", 1)
    max_steps = _get(args, "max_steps")
    generation_batch = per_device * num_processes * steps_per_generation
    problems = []
    if generation_batch % generations:
        problems.append(
            f"generation batch {generation_batch} (= {per_device} per device x {num_processes} processes x "
            f"{steps_per_generation} steps per generation) is not divisible by num_generations {generations}"
        )
    if steps_per_generation % accumulation:
        problems.append(
            f"steps_per_generation {steps_per_generation} is not a multiple of gradient_accumulation_steps "
            f"{accumulation}: an optimizer step would straddle two generation batches"
        )
    generations_eval = _get(args, "num_generations_eval") or generations
    eval_batch = _get(args, "per_device_eval_batch_size") * num_processes
    evaluates = sampled_eval or (_get(args, "do_eval") and _get(args, "eval_strategy") not in ("no", None))
    if evaluates and eval_batch % generations_eval:
        problems.append(
            f"global eval batch {eval_batch} (per_device_eval_batch_size x processes) is not divisible by "
            f"num_generations_eval {generations_eval}"
        )
    tensor_parallel = _get(args, "vllm_tensor_parallel_size") or 1
    if _get(args, "use_vllm") and _get(args, "vllm_mode") == "colocate" and num_processes % tensor_parallel:
        problems.append(f"vllm_tensor_parallel_size {tensor_parallel} does not divide {num_processes} processes")
    if problems:
        raise ValueError(f"batch arithmetic for {num_processes} process(es): " + "; ".join(problems))
    completions_per_update = per_device * num_processes * accumulation
    optimizer_steps = micro_steps_per_cycle(steps_per_generation, epochs) // accumulation
    return {
        "num_processes": num_processes,
        "generation_batch_size": generation_batch,
        "prompts_per_generation": generation_batch // generations,
        "steps_per_generation": steps_per_generation,
        "optimizer_steps_per_generation": optimizer_steps,
        # the paper's terms: mini-batch M prompts per update, N updates per rollout batch of N x M prompts
        "completions_per_update": completions_per_update,
        "prompts_per_update": (
            completions_per_update // generations
            if completions_per_update % generations == 0
            else completions_per_update / generations
        ),
        "updates_per_rollout": updates_per_rollout(args),
        "reuse_epochs": epochs,
        "total_updates": max_steps,
        "rollout_batches": -(-max_steps // optimizer_steps) if max_steps > 0 else None,
    }
