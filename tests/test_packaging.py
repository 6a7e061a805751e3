"""What a non-editable install ships: the wheel carries the presets, the card template and the shipped warm start, and
an installed package finds its presets by name (0.4's ``PRESETS_DIR`` pointed at the checkout's ``recipes/configs``, which a wheel lacks)."""

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT


@pytest.mark.slow
def test_an_installed_wheel_lists_and_resolves_its_presets(tmp_path):
    wheels, site = tmp_path / "wheels", tmp_path / "site"
    from importlib.metadata import PackageNotFoundError, version

    try:  # build offline with what is installed when it meets pyproject.toml's build requirements, else as pip does
        offline = int(version("setuptools").split(".")[0]) >= 68 and bool(version("wheel"))
    except (PackageNotFoundError, ValueError):
        offline = False
    isolation = ["--no-build-isolation"] if offline else []
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "-q", "-w", str(wheels), str(ROOT)]
    subprocess.run(build, check=True, capture_output=True, timeout=300)
    (wheel,) = wheels.glob("respo_trl-*.whl")
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, timeout=300)  # fmt: skip
    code = (
        "import json, respo_trl.recipe.presets as a; "
        "print(json.dumps([a.__file__, a.available_presets(), a.resolve_argv(['--preset', 'smollm2-135m-cpu-vllm'], "
        "a.PRESETS_DIR)[1], a.resolve_argv([], a.PRESETS_DIR)[1]]))"
    )
    env = {**os.environ, "PYTHONPATH": str(site)}  # the installed copy, not the checkout (cwd is elsewhere)
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    module, presets, smollm2, default = json.loads(done.stdout.strip().splitlines()[-1])
    assert module.startswith(str(site))
    shipped = sorted(p.stem for p in (ROOT / "respo_trl" / "recipe" / "presets").glob("*.yaml"))
    assert presets == shipped and {"tiny-cpu", "paper-qwen3-1.7b-base", "smollm2-135m-cpu-vllm"} <= set(presets)
    for path in (smollm2, default):
        assert path.startswith(str(site)) and os.path.isfile(path)
    assert (site / "respo_trl" / "hub" / "templates" / "model_card.md").is_file()
    # the main job's shipped warm start (respo_trl/recipe/shipped/), or an installed package would train it again
    checkout = sorted(p.name for p in (ROOT / "respo_trl" / "builtin" / "warm_starts").glob("*.safetensors"))
    assert checkout and sorted(p.name for p in (site / "respo_trl" / "builtin" / "warm_starts").iterdir()) == checkout
