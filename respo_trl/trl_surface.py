"""The TRL surface the seam (:mod:`respo_trl.trainer`) relies on, declared and checked once.

TRL 1.16's ``GRPOTrainer`` has no loss hook, no reuse hook and no diagnostics hook, so the seam overrides some of its
methods and reads some of its state. Everything it touches is declared here: :data:`TRL_METHODS` (every method it
overrides or calls, with TRL 1.16's parameters and kind), :data:`TRL_CLASS_ATTRIBUTES` (the class attributes it
sets), :data:`TRL_STATE` and :data:`TRL_LOOP_STATE` (every attribute it reads or writes) and :data:`GENERATE_FIELDS`
(the length of ``_generate``'s tuple, whose first three fields it reads). :func:`check_trl_hooks` refuses, in one
line naming what moved, a TRL whose methods or class attributes differ; :func:`check_trl_state`,
:func:`check_trl_loop_state` and :func:`check_generate_output` the same for the state and the tuple when they are
first there (after ``__init__``, on the first training micro-batch, on the first generation).
"""

from __future__ import annotations

import functools
import inspect

import trl
from accelerate.logging import get_logger

logger = get_logger(__name__)

SUPPORTED_TRL = "1.16"  # the TRL minor version whose GRPOTrainer the seam was written against
_FORWARD = (
    "self", "model", "input_ids", "attention_mask", "logits_to_keep", "batch_size", "compute_entropy",
    "compute_aux_loss", "pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes",
    "num_tiles", "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids",
)  # fmt: skip
# Every GRPOTrainer (or transformers.Trainer) method the seam overrides or calls: its parameters in TRL 1.16 and
# whether it is static (an override keeps the kind). ``__init__`` is checked on the parameters the seam passes by
# position; the rest go through as they come. Which of them ReSPOTrainer overrides is read off the class
# (``respo_trl.trainer.OVERRIDDEN``).
TRL_METHODS = {
    "__init__": (("self", "model", "reward_funcs", "args"), False),
    "_prepare_inputs": (("self", "generation_batch"), False),
    "_generate": (("self", "prompts"), False),
    "_generate_and_score_completions": (("self", "inputs"), False),
    "_get_per_token_logps_and_entropies": (_FORWARD, False),
    "_compute_loss": (("self", "model", "inputs"), False),
    "log": (("self", "logs", "start_time"), False),
    "train": (("self", "resume_from_checkpoint", "trial", "ignore_keys_for_eval"), False),
    "_save_checkpoint": (("self", "model", "trial"), False),
    "_load_optimizer_and_scheduler": (("self", "checkpoint"), False),
    "create_model_card": (("self", "model_name", "dataset_name", "tags"), False),
    "_get_train_sampler": (("self", "dataset"), False),
    "get_high_entropy_mask": (("self", "entropies", "mask", "threshold"), False),
    "get_off_policy_mask": (
        ("advantages", "per_token_logps", "sampling_per_token_logps", "mask", "off_policy_threshold"), True
    ),
    "_get_output_dir": (("self", "trial"), False),
    "is_world_process_zero": (("self",), False),
}  # fmt: skip
# GRPOTrainer's class attributes that ReSPOTrainer sets (the card's and the Hub's names, tags and citation).
TRL_CLASS_ATTRIBUTES = ("_tag_names", "_name", "_paper")
# GRPOTrainer state the seam and ReSPO's loss read or write (set in TRL's and transformers' __init__), checked once a
# trainer is built. ``_step`` (the micro-step counter the buffer follows and restores on resume) and ``_metrics``
# (where every diagnostic is appended) are written; the rest are read.
TRL_STATE = (
    "loss_type", "beta", "router_aux_loss_coef", "top_entropy_quantile", "off_policy_mask_threshold", "importance_sampling_level",
    "aux_loss_enabled", "_entropy_bonus_enabled", "use_adaptive_entropy", "entropy_coef", "_last_world_entropy",
    "_entropy_window_stats", "_step", "_metrics", "num_iterations", "use_vllm", "vllm_importance_sampling_correction",
    "tools", "rollout_func", "accelerator", "state",
)  # fmt: skip
# Set by transformers' training loop, not by __init__: checked on the first training micro-batch.
TRL_LOOP_STATE = ("current_gradient_accumulation_steps",)
# Read only when ``use_vllm`` is on: the engine mode, and the colocated engine whose weights the seam inspects.
TRL_VLLM_STATE = ("vllm_mode", "vllm_generation")
# ``GRPOTrainer._generate`` returns (prompt_ids, completion_ids, tool_mask, completions, logprobs, extra_fields, images,
# tool_images) in TRL 1.16; the seam reads the first three.
GENERATE_FIELDS = 8
# The multimodal inputs TRL's loss forwards (the last ten parameters of the forward helper).
MULTIMODAL_KEYS = _FORWARD[8:]


def _incompatible(missing: list[str], trainer: str = "GRPOTrainer") -> RuntimeError:
    return RuntimeError(
        f"respo_trl hooks ReSPO into TRL {SUPPORTED_TRL}'s {trainer}, but the installed trl {trl.__version__} "
        f"no longer has {missing}. Install a supported TRL (pip install 'trl>={SUPPORTED_TRL},<1.17') or a "
        "respo_trl release that supports this TRL. TRL's own loss types would still train, but ReSPO cannot run "
        "safely."
    )


def _parameters(helper) -> tuple[str, ...] | None:
    function = helper.__func__ if isinstance(helper, staticmethod) else helper
    try:
        return tuple(inspect.signature(function).parameters) if function is not None else None
    except (TypeError, ValueError):
        return None


@functools.cache  # once per process: the check reads TRL's signatures
def check_trl_hooks(grpo_trainer_cls=None) -> None:
    """Fail early, in one line with what to do, if the installed TRL no longer has the methods the seam overrides or
    calls, with the parameters and kind it uses, or the class attributes it sets."""
    if grpo_trainer_cls is None:
        from trl import GRPOTrainer as grpo_trainer_cls
    missing = [f"GRPOTrainer.{name}" for name in TRL_CLASS_ATTRIBUTES if not hasattr(grpo_trainer_cls, name)]
    for name, (parameters, static) in TRL_METHODS.items():
        helper = inspect.getattr_static(grpo_trainer_cls, name, None)
        found = _parameters(helper)
        if name == "__init__" and found is not None:
            found = found[: len(parameters)]
        if found != parameters or isinstance(helper, staticmethod) != static:
            kind = "static " if static else ""
            missing.append(f"{kind}GRPOTrainer.{name}({', '.join(parameters)})")
    if missing:
        raise _incompatible(missing)
    if not trl.__version__.startswith(SUPPORTED_TRL + "."):
        logger.warning(
            f"respo_trl was tested with trl {SUPPORTED_TRL}.x; trl {trl.__version__} still has the helpers ReSPO "
            "calls, but results are not verified."
        )


def check_trl_state(trainer) -> None:
    """After TRL's ``__init__``: the attributes the seam reads or writes are there (a TRL that renamed one is refused)."""
    names = TRL_STATE + (TRL_VLLM_STATE if getattr(trainer, "use_vllm", False) else ())
    missing = [f"GRPOTrainer.{name}" for name in names if not hasattr(trainer, name)]
    if missing:
        raise _incompatible(missing)


def check_trl_loop_state(trainer) -> None:
    """Inside the training loop: the attributes transformers sets there and the seam reads are there."""
    missing = [f"Trainer.{name}" for name in TRL_LOOP_STATE if not hasattr(trainer, name)]
    if missing:
        raise _incompatible(missing)


def check_generate_output(output: tuple) -> None:
    """The tuple ``_generate`` returned has TRL 1.16's fields (the seam reads ids, completion ids and tool mask)."""
    if not isinstance(output, tuple) or len(output) != GENERATE_FIELDS:
        got = len(output) if isinstance(output, tuple) else type(output).__name__
        raise _incompatible([f"GRPOTrainer._generate returning {GENERATE_FIELDS} fields (got {got})"])


# -- TRL's experimental AsyncGRPOTrainer (respo_trl.async_trainer and respo_trl.integrations.async_cpu) --------------
# Every name of trl.experimental.async_grpo the async seam overrides, calls, reads or replaces, in one place:
# methods with their TRL 1.16 parameters, module attributes (the CPU adaptations replace the first two of each), the
# trainer state read after __init__ and the collated batch's keys its loss reads.
ASYNC_TRAINER_MODULE = "trl.experimental.async_grpo.async_grpo_trainer"
ASYNC_PACKING_MODULE = "trl.experimental.async_grpo.packing"
ASYNC_METHODS = {
    "__init__": (("self", "model", "reward_funcs", "args", "train_dataset", "processing_class", "callbacks",
                  "optimizers", "peft_config", "tools", "environment_factory", "rollout_worker", "weight_transfer"),
                 False),
    "compute_loss": (("self", "model", "inputs", "return_outputs", "num_items_in_batch"), False),
    "get_train_dataloader": (("self",), False),
}  # fmt: skip
ASYNC_MODULE_ATTRIBUTES = {
    ASYNC_TRAINER_MODULE: ("get_peak_flops_per_device", "AsyncGRPOTrainer", "RolloutQueueDataset"),
    ASYNC_PACKING_MODULE: ("_flash_attn", "TREE_ATTENTION", "TreeRow"),
}
ASYNC_STATE = ("model_version", "rollout_queue", "rollout_worker", "_metrics", "accelerator", "aux_loss_enabled",
               "router_aux_loss_coef", "epsilon_low", "epsilon_high")  # fmt: skip
# The packed batch TRL's collator builds and its compute_loss reads (one row per rank).
ASYNC_BATCH_KEYS = ("token_index", "old_log_probs", "advantages", "segment_id", "global_n_tokens")


def async_modules():
    """TRL's async trainer module and its packing module (imports TRL's experimental package, quietly)."""
    import importlib
    import os

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    return importlib.import_module(ASYNC_TRAINER_MODULE), importlib.import_module(ASYNC_PACKING_MODULE)


@functools.cache
def check_async_surface() -> None:
    """Refuse, in one line, a TRL whose async trainer no longer has a name the async seam relies on."""
    trainer_module, packing = async_modules()
    missing = [f"{module}.{name}" for module, names in ASYNC_MODULE_ATTRIBUTES.items() for name in names
               if not hasattr({ASYNC_TRAINER_MODULE: trainer_module, ASYNC_PACKING_MODULE: packing}[module], name)]  # fmt: skip
    cls = getattr(trainer_module, "AsyncGRPOTrainer", None)
    for name, (parameters, static) in ASYNC_METHODS.items():
        helper = inspect.getattr_static(cls, name, None) if cls is not None else None
        if _parameters(helper) != parameters or isinstance(helper, staticmethod) != static:
            missing.append(f"AsyncGRPOTrainer.{name}({', '.join(parameters)})")
    if missing:
        raise _incompatible(missing, "AsyncGRPOTrainer")


def check_async_state(trainer) -> None:
    """After TRL's ``AsyncGRPOTrainer.__init__``: the state the async seam reads is there."""
    missing = [f"AsyncGRPOTrainer.{name}" for name in ASYNC_STATE if not hasattr(trainer, name)]
    if missing:
        raise _incompatible(missing, "AsyncGRPOTrainer")


def check_async_batch(inputs) -> None:
    """The collated batch has the keys the async loss reads (checked on the first micro-batch)."""
    missing = [f"AsyncGRPOTrainer batch[{key!r}]" for key in ASYNC_BATCH_KEYS if key not in inputs]
    if missing:
        raise _incompatible(missing, "AsyncGRPOTrainer")
