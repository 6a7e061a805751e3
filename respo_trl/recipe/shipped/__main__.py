"""``python -m respo_trl.recipe.shipped --write [--seed S]``: train the embedded default's warm start as the recipe
does and write it as the shipped file (:mod:`respo_trl.recipe.shipped` says how it is matched and checked)."""

from __future__ import annotations

from pathlib import Path

from . import fingerprint, write


def main(argv: list[str] | None = None) -> Path:
    """Make the shipped warm start of the embedded default (``--write``), at ``--seed`` (default 0)."""
    import argparse
    import time

    from accelerate import PartialState
    from accelerate.logging import get_logger

    from ..data import load_datasets
    from ..model import build_model, use_one_cpu_thread, warm_start
    from ..parsing import parse_args

    parser = argparse.ArgumentParser(description="Make the warm start the package ships for the embedded default.")
    parser.add_argument("--write", action="store_true", help="train the default preset's warm start and write it")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not args.write:
        parser.error("nothing to do: pass --write (it trains for about three minutes)")
    logger = get_logger(__name__)
    PartialState()
    use_one_cpu_thread(logger, "the shipped warm start")  # as the recipe trains the tiny model
    script_args, training_args, model_args = parse_args(["--seed", str(args.seed), "--output_dir", "/tmp/unused"])
    model, tokenizer, *_ = build_model(script_args, training_args, model_args, logger)
    train_dataset, _, _ = load_datasets(script_args, training_args, model_args, tokenizer, logger)
    prompts, completions = train_dataset["prompt"], train_dataset["completion"]
    print_ = fingerprint(model, tokenizer, prompts, completions, steps=script_args.warmstart_steps,
                         batch_size=script_args.warmstart_batch_size,
                         learning_rate=script_args.warmstart_learning_rate, seed=args.seed)  # fmt: skip
    started = time.time()
    losses = warm_start(model, tokenizer, train_dataset, script_args, seed=args.seed)
    info = {"steps": len(losses), "final_loss": losses[-1], "seconds": round(time.time() - started, 1), "seed": args.seed}
    path = write(model, print_, info)
    print(f"wrote {path} ({info['steps']} steps, final loss {info['final_loss']:.4f}, {info['seconds']} s)")
    return path


if __name__ == "__main__":
    main()
