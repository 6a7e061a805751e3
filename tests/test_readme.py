"""The README's Python snippets run where the README says they run: on the CPU machine its set-up section targets.

Only what cannot run offline is substituted: the Hub model id becomes a local tiny Qwen3, ``load_dataset`` returns a
local toy dataset, and the run is cut to one optimizer step of tiny batches. Everything else executes verbatim.
"""

import os
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


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
    assert "respo_trl.demo" in offline and "load_dataset" not in offline
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


def test_every_benchmark_and_script_runs_as_documented_from_the_repository_root():
    """`python benchmarks/starvation_lab.py` failed with ModuleNotFoundError: benchmarks unless PYTHONPATH=. was set.
    Every script prints its --help from the repository root with no PYTHONPATH."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    scripts = [p for folder in ("benchmarks", "scripts") for p in sorted((root / folder).glob("*.py"))
               if p.name not in ("__init__.py", "machine.py")]  # fmt: skip
    assert len(scripts) >= 10
    failed = []
    for script in scripts:
        result = subprocess.run([sys.executable, str(script.relative_to(root)), "--help"], cwd=root, env=env,
                                capture_output=True, text=True, timeout=120)  # fmt: skip
        if result.returncode != 0:
            failed.append(f"{script.name}: {result.stderr.strip().splitlines()[-1:]}")
    assert not failed, failed


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
    assert {"respo_updates_per_rollout", "num_iterations", "respo_reuse"} <= trl_names
    assert trl_names <= set(ReSPOConfig.__dataclass_fields__)
    launcher = (root / "recipes" / "verl" / "common.sh").read_text()
    assert "actor_rollout_ref.actor.ppo_epochs=1" in launcher and "data.train_batch_size=$TRAIN_BATCH_SIZE" in launcher
    links = re.findall(r"\]\(((?!https?:)[^)#]+)\)", text)
    assert links and all((root / link).exists() for link in links), [link for link in links if not (root / link).exists()]
    evidence = text.split("## What the evidence says", 1)[1]
    assert "(docs/benchmarks.md)" in evidence and len([p for p in evidence.split("\n\n") if p.strip()]) == 1
