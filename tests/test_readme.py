"""The README's Python snippets run where the README says they run: on the CPU machine its set-up section targets.

Only what cannot run offline is substituted: the Hub model id becomes a local tiny Qwen3, ``load_dataset`` returns a
local toy dataset, and the run is cut to one optimizer step of tiny batches. Everything else executes verbatim.
"""

import ast
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def python_blocks(section: str) -> list[str]:
    text = README.read_text()
    body = text.split(f"## {section}", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", body, flags=re.S)


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the snippets write to relative output_dirs
    return tmp_path


def test_drop_in_snippet_trains_respo_on_cpu(in_tmp, tiny_model_dir, toy_dataset, monkeypatch):
    import datasets

    drop_in = python_blocks("Swap it into an existing TRL script")[0]
    assert 'model="Qwen/Qwen3-0.6B"' in drop_in and 'output_dir="out"' in drop_in
    monkeypatch.setattr(datasets, "load_dataset", lambda *args, **kwargs: toy_dataset)
    code = drop_in.replace('"Qwen/Qwen3-0.6B"', repr(tiny_model_dir)).replace(
        'output_dir="out"',
        'output_dir="out", max_steps=1, per_device_train_batch_size=8, num_generations=4, max_completion_length=8, '
        'report_to="none", save_strategy="no"',
    )
    namespace = {}
    exec(compile(code, "README.md", "exec"), namespace)  # noqa: S102
    trainer = namespace["trainer"]
    assert trainer.loss_type == "respo" and trainer.state.global_step == 1
    assert trainer.args.steps_per_generation == 8  # the snippet's N = 8 (gradient_accumulation_steps = 1)


def test_offline_snippet_trains_verbatim(in_tmp):
    """The documented offline way to try the swap-in: demo model, tokenizer and task, nothing downloaded."""
    offline = python_blocks("Swap it into an existing TRL script")[1]
    assert "respo_trl.builtin" in offline and "load_dataset" not in offline
    namespace = {}
    exec(compile(offline, "README.md", "exec"), namespace)  # noqa: S102
    trainer = namespace["trainer"]
    assert trainer.state.global_step == 4 and trainer.loss_type == "respo"
    assert {"prompt", "solution"} <= set(namespace["dataset"].column_names)


def test_config_and_kernel_snippets_run_verbatim(in_tmp):
    config_block, kernel_block = python_blocks("Swap it into an existing TRL script")[2:4]
    namespace = {}
    exec(compile(config_block, "README.md", "exec"), namespace)  # noqa: S102
    assert namespace["args"].loss_type == "respo" and namespace["args"].steps_per_generation == 8
    assert namespace["epochs"].respo_trust_mask_active and not namespace["args"].respo_trust_mask_active
    assert namespace["baseline"].loss_type == "dapo"
    exec(compile(kernel_block, "README.md", "exec"), namespace)  # noqa: S102
    assert namespace["phi"].shape == (4,) and namespace["loss"].isfinite()


def benchmark_modules() -> dict[str, ast.Module]:
    """benchmarks/'s modules by name, parsed (``__init__`` aside)."""
    return {p.stem: ast.parse(p.read_text()) for p in sorted((ROOT / "benchmarks").glob("*.py")) if p.stem != "__init__"}


def has_main(tree: ast.Module) -> bool:
    return any(isinstance(node, ast.FunctionDef) and node.name == "main" for node in tree.body)


def test_every_benchmark_and_script_runs_as_documented_from_the_repository_root():
    """`python benchmarks/starvation_lab.py` failed with ModuleNotFoundError: benchmarks unless PYTHONPATH=. was set.
    Every benchmark (a module of benchmarks/ with a ``main``) prints its --help as ``python -m benchmarks.NAME`` from
    the repository root with no PYTHONPATH, and every script in scripts/ as ``python scripts/NAME.py``."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    benchmarks = [name for name, tree in benchmark_modules().items() if has_main(tree)]
    assert len(benchmarks) >= 10 and "smollm2_staleness" in benchmarks and "common" not in benchmarks
    commands = [["-m", f"benchmarks.{name}"] for name in benchmarks]
    commands += [[str(p.relative_to(ROOT))] for p in sorted((ROOT / "scripts").glob("*.py"))]
    failed = []
    for command in commands:
        result = subprocess.run([sys.executable, *command, "--help"], cwd=ROOT, env=env, capture_output=True, text=True,
                                timeout=120)  # fmt: skip
        if result.returncode != 0:
            failed.append(f"{' '.join(command)}: {result.stderr.strip().splitlines()[-1:]}")
    assert not failed, failed


def test_no_benchmark_imports_another_and_the_shared_modules_are_no_benchmarks():
    """Shared code lives in modules without a ``main`` (``benchmarks/common.py`` and the engines two benchmarks build
    on); a benchmark imports those, never another benchmark."""
    modules = benchmark_modules()
    benchmarks = {name for name, tree in modules.items() if has_main(tree)}
    assert {"common", "regime_runs", "starvation_sim"} <= set(modules) - benchmarks
    imported = {}
    for name, tree in modules.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "benchmarks":
                imported.setdefault(name, set()).update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("benchmarks."):
                imported.setdefault(name, set()).add(node.module.split(".")[1])
            elif isinstance(node, ast.Import):
                imported.setdefault(name, set()).update(
                    alias.name.split(".")[1] for alias in node.names if alias.name.startswith("benchmarks."))
    wrong = {name: sorted(found & benchmarks) for name, found in imported.items() if found & benchmarks}
    assert not wrong, wrong


# a change of the interpreter's module path: assignment, insert/append/extend/remove, augmented, item assignment
PATH_EDIT = re.compile(
    r"\bsys\.path\s*(?:\[[^]]*\]\s*)?(?:=(?!=)|\+=)|\bsys\.path\.(?:insert|append|extend|remove)\(|addsitedir\("
)
# the only ones allowed: test workers run by path in processes of their own, each under a comment saying why
ALLOWED_PATH_EDITS = {"tests/workers/ddp_reuse.py", "tests/verl_integration/actor_update.py"}


def test_no_sys_path_edits_in_benchmarks_recipes_scripts_and_tests():
    """Benchmarks run as modules from the repository root and import the package (``respo_trl/rewards.py``'s
    insertion of the working directory, for a user's ``module:function`` reward, is the package's own)."""
    found, allowed = [], {}
    for folder in ("benchmarks", "recipes", "scripts", "tests"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            lines = path.read_text().splitlines()
            for i, line in enumerate(lines):
                if PATH_EDIT.search(line):
                    where = str(path.relative_to(ROOT))
                    if where in ALLOWED_PATH_EDITS and i > 0 and lines[i - 1].lstrip().startswith("# "):
                        allowed[where] = allowed.get(where, 0) + 1
                    else:
                        found.append(f"{where}:{i + 1}: {line.strip()}")
    assert not found, found
    assert all(count == 1 for count in allowed.values()), allowed  # one line each, two at most


def test_the_readme_is_a_five_minute_page_whose_names_and_links_are_real():
    """<= 130 lines with the two commands, the swap-in, the reuse table and the verdict; the table's TRL names are
    ReSPOConfig fields and its verl keys are what the launchers set; every relative link resolves."""
    from respo_trl import ReSPOConfig

    text = README.read_text()
    root = README.parent
    assert len(text.splitlines()) <= 130
    sections = re.findall(r"^## (.+)$", text, flags=re.M)
    assert sections[:2] == ["Set up", "Swap it into an existing TRL script"] and "What the evidence says" in sections
    assert "Status" not in sections  # the project's status is CHANGELOG.md's
    for marker in ("<!-- main-job-command -->", "<!-- test-command -->"):
        assert re.search(re.escape(marker) + r"\n```bash\n.+\n```", text)
    table = text.split("## The two reuse settings", 1)[1].split("\n## ", 1)[0]
    trl_names = set(re.findall(r"`(respo_\w+|num_iterations|steps_per_generation)", table))
    assert {"respo_updates_per_rollout", "num_iterations"} <= trl_names
    assert trl_names <= set(ReSPOConfig.__dataclass_fields__)  # one name each, the config's (no renamed one)
    launcher = (root / "recipes" / "verl" / "common.sh").read_text()
    assert "actor_rollout_ref.actor.ppo_epochs=1" in launcher and "data.train_batch_size=$TRAIN_BATCH_SIZE" in launcher
    links = re.findall(r"\]\(((?!https?:)[^)#]+)\)", text)
    assert links and all((root / link).exists() for link in links), [link for link in links if not (root / link).exists()]
    evidence = text.split("## What the evidence says", 1)[1]
    assert "(docs/benchmarks.md)" in evidence and len([p for p in evidence.split("\n\n") if p.strip()]) == 1


def test_the_package_imports_in_no_circle():
    """Issue 52, item 6: no module of ``respo_trl`` imports, directly or through others, one that imports it back, at
    module level or inside a function (a lazy import still ties the two). Read from the source, nothing imported."""
    root = Path(__file__).resolve().parents[1]
    package = root / "respo_trl"

    def name_of(path: Path) -> str:
        parts = path.relative_to(root).with_suffix("").parts
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    modules = {name_of(p): p for p in package.rglob("*.py")}
    edges = {}
    for name, path in modules.items():
        base = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.ImportFrom):
                origin = node.module or ""
                if node.level:
                    anchor = base.split(".")
                    anchor = anchor[: len(anchor) - node.level + 1]
                    origin = ".".join([*anchor, *([origin] if origin else [])])
                submodules = [f"{origin}.{alias.name}" for alias in node.names if f"{origin}.{alias.name}" in modules]
                targets = submodules or [origin]  # `from . import shipped` depends on shipped, not on the package
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            # a module's own packages run their __init__ when it is imported: that is no dependency of its design
            found.update(t for t in targets if t in modules and t != name and not name.startswith(t + "."))
        edges[name] = found

    def circle_from(start):
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for nxt in edges[node]:
                if nxt == start:
                    return path
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, [*path, nxt]))
        return None

    circles = {tuple(sorted(c)) for m in modules if (c := circle_from(m))}
    assert not circles, circles
