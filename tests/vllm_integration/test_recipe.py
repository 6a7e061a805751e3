"""The recipe as users launch it, with vLLM generation: ``accelerate launch recipes/qwen3_respo.py --use_vllm ...`` on
a tiny model saved to disk (vLLM loads models by path), in a subprocess that gets the test environment's CPU
weight-sync workaround through ``site/sitecustomize.py`` on ``PYTHONPATH``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SITE = Path(__file__).resolve().parent / "site"


def test_recipe_trains_with_vllm_colocated_and_reports(tiny_model_dir, tmp_path):
    """Catches: the recipe refusing or mis-wiring --use_vllm for a model path, vLLM not generating (no sampler
    log-prob metrics), the run ending without its report, held-out numbers or card."""
    out = tmp_path / "run"
    command = [
        str(Path(sys.executable).parent / "accelerate"), "launch", "--num_processes", "1", "--num_machines", "1",
        "--mixed_precision", "no", "--dynamo_backend", "no", str(ROOT / "recipes" / "qwen3_respo.py"),
        "--model_name_or_path", tiny_model_dir, "--use_vllm", "true", "--vllm_mode", "colocate",
        "--vllm_max_model_length", "256", "--dataset_name", "builtin:arithmetic", "--task_operators", "+",
        "--train_size", "64", "--heldout_size", "8", "--eval_mode", "greedy", "--eval_batch_size", "8",
        "--max_steps", "2", "--respo_updates_per_rollout", "2", "--per_device_train_batch_size", "8",
        "--num_generations", "4", "--max_completion_length", "16", "--use_cpu", "true", "--bf16", "false",
        "--activation_checkpointing", "false", "--save_strategy", "no", "--report_to", "none", "--logging_steps", "1",
        "--output_dir", str(out),
    ]  # fmt: skip
    python_path = os.pathsep.join([str(SITE), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env = {**os.environ, "PYTHONPATH": python_path}
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["training"]["global_step"] == 2 and report["training"]["generated_tokens"] > 0
    assert report["training"]["batch"]["updates_per_rollout"] == 2
    heldout = report["heldout"]
    assert heldout["n"] == 8 and heldout["before"] is not None and heldout["after"] is not None
    logs = json.loads((out / "trainer_state.json").read_text())["log_history"]
    assert any("sampling/sampling_logp_difference/mean" in h for h in logs)  # completions and log-probs from vLLM
    assert (out / "README.md").is_file() and (out / "model.safetensors").is_file()
