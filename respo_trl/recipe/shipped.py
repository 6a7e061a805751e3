"""The warm start the package ships: the embedded default's supervised warm start, made once and loaded by every run
whose model, data and warm-start settings are exactly those it was made from.

Why: on two CPU cores the warm start of ``accelerate launch recipes/qwen3_respo.py`` (500 steps of 64 sequences)
took about as long as the RL that follows it (docs/recipes.md, "Where the time goes"), and it is the same for every
run of the embedded default at one seed. Shipping its result makes the main job about RL.

How it is matched: :func:`fingerprint` hashes everything the warm-started weights are a function of: the initial
weights as built (so a torch or transformers release that initialises differently misses), the (prompt, completion)
rows the warm start draws from, the tokenizer and its chat template, the warm-start settings and seed, and the source
of the loop that trains it. A file named by that fingerprint is loaded; any difference, however small, finds no file
and the recipe trains the warm start itself, as it always did (``--warmstart_shipped false`` does so on purpose).
``tests/test_shipped_warmstart.py`` holds the shipped file to the fingerprint the current code computes, so a change
to any of those inputs fails there until the file is made again.

How it is made (about three minutes on one core)::

    python -m respo_trl.recipe.shipped --write          # the embedded default, seed 0
    python -m respo_trl.recipe.shipped --write --seed 1

It runs the recipe's own warm start (:func:`respo_trl.recipe.model.warm_start`) on the default preset's model and
data, and writes ``respo_trl/builtin/warm_starts/<fingerprint>.safetensors`` with what it was made from in the
file's metadata (torch version, CPU, seconds, final loss). The weights are what the warm start gives on the machine
that made them; on another CPU type it would give weights that differ in the last bits (docs/recipes.md).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import platform
from pathlib import Path

SHIPPED_DIR = Path(__file__).resolve().parents[1] / "builtin" / "warm_starts"
MAKE_COMMAND = "python -m respo_trl.recipe.shipped --write"


def fingerprint(model, tokenizer, prompts, completions, *, steps: int, batch_size: int, learning_rate: float,
                seed: int) -> str:  # fmt: skip
    """sha256 over everything :func:`respo_trl.recipe.warmstart.supervised_warm_start` makes the weights from."""
    from . import warmstart
    from .generation import prompt_ids

    digest = hashlib.sha256()

    def add(label: str, payload: bytes) -> None:
        digest.update(label.encode())
        digest.update(hashlib.sha256(payload).digest())

    settings = {"steps": steps, "batch_size": batch_size, "learning_rate": learning_rate, "seed": seed}
    add("settings", json.dumps(settings, sort_keys=True).encode())
    state = model.state_dict()
    add("initial weights", b"".join(name.encode() + state[name].detach().cpu().contiguous().numpy().tobytes()
                                    for name in sorted(state)))  # fmt: skip
    add("data", json.dumps([list(prompts), list(completions)], sort_keys=True).encode())
    vocab = sorted(tokenizer.get_vocab().items())
    add("tokenizer", json.dumps([vocab, tokenizer.chat_template, tokenizer.eos_token_id, tokenizer.pad_token_id]).encode())
    code = [warmstart.supervised_warm_start, warmstart.sft_examples, warmstart._collate, prompt_ids]
    add("code", "".join(inspect.getsource(f) for f in code).encode())
    return digest.hexdigest()


def path_for(print_: str) -> Path:
    return SHIPPED_DIR / f"{print_[:24]}.safetensors"


def find(print_: str) -> Path | None:
    """The shipped warm start made from exactly these inputs, or None."""
    path = path_for(print_)
    return path if path.is_file() else None


def load(model, path: Path) -> dict:
    """Load the shipped weights into ``model`` (every tensor, strictly) and return what the file says it was made
    from (``fingerprint``, ``final_loss``, ``steps``, ``torch``, ``cpu``, ``seconds``)."""
    from safetensors import safe_open
    from safetensors.torch import load_model

    load_model(model, str(path), strict=True)
    with safe_open(str(path), "pt") as f:
        return json.loads(f.metadata()["warm_start"])


def write(model, print_: str, info: dict) -> Path:
    """Write ``model``'s weights as the shipped warm start for ``print_``, with ``info`` in the metadata."""
    import torch
    from safetensors.torch import save_model

    SHIPPED_DIR.mkdir(parents=True, exist_ok=True)
    path = path_for(print_)
    meta = {**info, "fingerprint": print_, "torch": torch.__version__, "cpu": _cpu_name(), "made_with": MAKE_COMMAND}
    save_model(model, str(path), metadata={"warm_start": json.dumps(meta, sort_keys=True)})
    return path


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main(argv: list[str] | None = None) -> Path:
    """Make the shipped warm start of the embedded default (``--write``), at ``--seed`` (default 0)."""
    import argparse
    import time

    from accelerate import PartialState
    from accelerate.logging import get_logger

    from .data import load_datasets
    from .model import build_model, use_one_cpu_thread, warm_start
    from .parsing import parse_args

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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
