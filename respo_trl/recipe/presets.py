"""The recipe's presets: YAML files shipped as package data (``respo_trl/recipe/presets/``), found by name with
``--preset NAME`` from a checkout, an editable install or an installed wheel; a renamed preset is refused with its
new name (:data:`respo_trl._compat.RENAMED_PRESETS`)."""

from __future__ import annotations

import difflib
from pathlib import Path

from .._compat import RENAMED_PRESETS, renamed_message
from .arguments import RecipeError

DEFAULT_PRESET = "tiny-cpu"
# The presets are package data (respo_trl/recipe/presets/*.yaml): they resolve the same from a checkout, an editable
# install or an installed wheel.
PRESETS_DIR = Path(__file__).resolve().parent / "presets"


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
                raise RecipeError("preset " + renamed_message(name, RENAMED_PRESETS[name], "{!r}"))
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
