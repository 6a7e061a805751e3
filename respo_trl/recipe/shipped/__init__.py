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

How it is made (about three minutes on one core; ``__main__.py`` here, so that this module imports nothing of the
recipe that imports it)::

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

SHIPPED_DIR = Path(__file__).resolve().parents[2] / "builtin" / "warm_starts"
MAKE_COMMAND = "python -m respo_trl.recipe.shipped --write"


def fingerprint(model, tokenizer, prompts, completions, *, steps: int, batch_size: int, learning_rate: float,
                seed: int) -> str:  # fmt: skip
    """sha256 over everything :func:`respo_trl.recipe.warmstart.supervised_warm_start` makes the weights from."""
    from .. import warmstart
    from ..generation import prompt_ids

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
