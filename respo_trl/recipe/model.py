"""The recipe's model: a Hub or local model checked by its config before weights load, MoE router settings, and the
default run's tiny model (:mod:`respo_trl.builtin.tiny_model`) with its warm start."""

from __future__ import annotations

import os

from trl import ModelConfig

from ..builtin.tiny_model import build_char_tokenizer, tiny_qwen3
from ..config import ReSPOConfig
from .arguments import RecipeArguments, RecipeError


def inspect_model(model_args: ModelConfig, training_args: ReSPOConfig):
    """The model's config (config file only, no weights), with a clear error for an unknown id or path."""
    from transformers import AutoConfig

    name = model_args.model_name_or_path
    try:
        return AutoConfig.from_pretrained(
            name, revision=model_args.model_revision, trust_remote_code=training_args.trust_remote_code
        )
    except (OSError, ValueError) as error:
        cause = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise RecipeError(
            f"cannot resolve model {name!r}: it is neither a local model directory nor a Hub model id whose config "
            f"could be fetched (HF_HUB_OFFLINE={os.environ.get('HF_HUB_OFFLINE', '0')}); check the spelling (the "
            f"presets use Qwen/Qwen3-0.6B ... Qwen/Qwen3-30B-A3B). Cause: {cause}"
        ) from None


def load_tokenizer(model_name_or_path: str, revision: str | None = None, trust_remote_code: bool = False):
    """A model's tokenizer (a few MB, no weights), with a pad token (its end token when it has none): what the recipe
    measures prompt lengths with before the trainer loads the model, and what ``eval_math`` generates with."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_name_or_path, revision=revision, trust_remote_code=trust_remote_code)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def is_moe(config) -> bool:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return hasattr(text, "output_router_logits") and getattr(text, "num_experts", 0) > 0


def configure_moe(config, training_args: ReSPOConfig, logger) -> dict:
    """Router auxiliary (load-balancing) loss on for MoE models; an error for a coefficient on a dense model."""
    text = config.get_text_config()
    moe = is_moe(config)
    coef = training_args.router_aux_loss_coef
    if not moe and coef:
        raise RecipeError(
            f"router_aux_loss_coef={coef} but {config.model_type} is a dense model (no router); remove the setting"
        )
    if not moe:
        return {"moe": False}
    effective = getattr(text, "router_aux_loss_coef", 0.0) if coef is None else coef
    if effective == 0:
        logger.warning("MoE model with router_aux_loss_coef=0: the router load-balancing loss is OFF.")
    return {"moe": True, "num_experts": text.num_experts, "router_aux_loss_coef": effective}


def use_one_cpu_thread(logger, why: str) -> None:
    """A small model on a CPU gains nothing from several torch threads and loses a lot on a busy machine (measured on
    a loaded 2-core box: the tiny recipe ran 3-8x slower at 2 threads, ``eval_math.py`` took 2.4 s per sampled
    sequence). Use one thread unless ``OMP_NUM_THREADS`` says otherwise; the caller decides that the model is small
    and on a CPU."""
    import torch

    if "OMP_NUM_THREADS" not in os.environ and torch.get_num_threads() > 1:
        logger.info(f"{why}: torch threads {torch.get_num_threads()} -> 1 (set OMP_NUM_THREADS to choose)")
        torch.set_num_threads(1)


def pick_cpu_threads(training_args: ReSPOConfig, tiny: bool, logger) -> None:
    """One torch thread for a tiny model on a CPU (``python recipes/qwen3_respo.py`` leaves torch at 2 threads where
    ``accelerate launch`` sets 1)."""
    import torch

    if tiny and not torch.cuda.is_available():
        use_one_cpu_thread(logger, "CPU run of a tiny model")


def build_tiny(script_args: RecipeArguments, seed: int):
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
    returns the losses. Shared with the benchmarks (benchmarks/common.py), which warm-start once per seed for all arms."""
    from .warmstart import supervised_warm_start

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


def build_model(script_args: RecipeArguments, training_args: ReSPOConfig, model_args: ModelConfig, logger):
    """(model, tokenizer, name, MoE info). A tiny model is built here (with its tokenizer); a Hub or local model is
    only inspected (its config, no weights): the trainer loads it, with ``model_init_kwargs`` from ``model_args``."""
    if script_args.tiny_model:
        model, tokenizer = build_tiny(script_args, seed=training_args.seed)
        return model, tokenizer, model.config._name_or_path, configure_moe(model.config, training_args, logger)
    info = configure_moe(inspect_model(model_args, training_args), training_args, logger)
    init_kwargs = {"revision": model_args.model_revision, "trust_remote_code": training_args.trust_remote_code,
                   "attn_implementation": model_args.attn_implementation, "dtype": model_args.dtype}  # fmt: skip
    training_args.model_init_kwargs = {**init_kwargs, **(training_args.model_init_kwargs or {})}
    return model_args.model_name_or_path, None, model_args.model_name_or_path, info


def run_warm_start(model, tokenizer, train_dataset, script_args: RecipeArguments, training_args: ReSPOConfig,
                   accuracy_fn, resume, show_progress: bool) -> dict:  # fmt: skip
    """The warm start of a model built here (skipped when resuming), with a progress bar, and how good the
    demonstrations it imitated are: ``{"steps", "final_loss", "demonstration_accuracy", "seconds", "shipped"}``. Where
    the package ships the result for exactly this model, data and settings (:mod:`.shipped`), it is loaded instead of
    trained (``shipped``: its file name)."""
    import time

    from tqdm.auto import tqdm

    from ..grading import accuracy_scores
    from . import shipped

    done = {"steps": 0, "final_loss": None, "demonstration_accuracy": None, "seconds": 0.0, "shipped": None}
    if not script_args.warmstart_steps or resume:
        return done
    if "completion" not in train_dataset.column_names:
        raise RecipeError("--warmstart_steps needs a 'completion' column of reference answers in the dataset")
    if isinstance(model, str):
        raise RecipeError("--warmstart_steps is for a model built here (--tiny_model); start from an SFT checkpoint")
    start = time.time()
    model.to(training_args.device)
    found = None
    if script_args.warmstart_shipped:
        found = shipped.find(shipped.fingerprint(
            model, tokenizer, train_dataset["prompt"], train_dataset["completion"], steps=script_args.warmstart_steps,
            batch_size=script_args.warmstart_batch_size, learning_rate=script_args.warmstart_learning_rate,
            seed=training_args.seed))  # fmt: skip
    if found is not None:
        info = shipped.load(model, found)
        done.update(steps=info["steps"], final_loss=info["final_loss"], seconds=time.time() - start, shipped=found.name)
        if show_progress:
            print(f"warm start (SFT): loaded the {info['steps']}-step warm start the package ships for exactly this "
                  f"model, data and seed ({found.name}; --warmstart_shipped false trains it here)")  # fmt: skip
    else:
        bar = tqdm(total=script_args.warmstart_steps, desc="warm start (SFT)", disable=not show_progress)

        def on_step(step, loss):
            bar.update(1)
            if step % 10 == 0:
                bar.set_postfix(loss=f"{loss:.3f}", refresh=False)

        losses = warm_start(model, tokenizer, train_dataset, script_args, seed=training_args.seed, on_step=on_step)
        bar.close()
        done.update(steps=len(losses), final_loss=losses[-1] if losses else None, seconds=time.time() - start)
    if accuracy_fn is not None:  # how good the demonstrations the warm start imitated are
        sample = train_dataset.select(range(min(500, len(train_dataset))))
        correct = accuracy_scores(sample["completion"], sample["solution"], accuracy_fn)
        done["demonstration_accuracy"] = sum(correct) / len(sample)
    return done
