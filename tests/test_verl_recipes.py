"""recipes/verl (the paper's two verl runs) without verl or GPUs: syntax, argument checks, the staleness arithmetic,
the DAPO-Math parquet; and the package-level promise that respo_trl never needs verl.

The launchers' overrides are also composed against verl's real config in the verl environment
(tests/verl_integration/test_recipes_compose.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes" / "verl"
LAUNCHERS = ["train_qwen3_1_7b.sh", "train_qwen3_30b_a3b.sh"]


def run(args, **env):
    import os

    return subprocess.run(args, capture_output=True, text=True, timeout=120, cwd=ROOT, env={**os.environ, **env})


def dry_run(script, *args, **env):
    result = run(["bash", str(RECIPES / script), *args, "--dry-run"], **env)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[1:3] == ["-m", "verl.trainer.main_ppo"]  # stock verl's entry point, not a fork
    return {k: v for k, _, v in (a.partition("=") for a in lines[3:] if "=" in a)}, lines


@pytest.mark.parametrize("script", [*LAUNCHERS, "common.sh"])
def test_bash_syntax(script):
    assert run(["bash", "-n", str(RECIPES / script)]).returncode == 0


@pytest.mark.parametrize("script", LAUNCHERS)
@pytest.mark.parametrize("n", [8, 16, 32])
def test_staleness_arithmetic(script, n):
    args, _ = dry_run(script, "--N", str(n))
    assert args["data.train_batch_size"] == str(32 * n)  # N x ppo_mini_batch_size prompts per rollout batch
    assert args["actor_rollout_ref.actor.ppo_mini_batch_size"] == "32"
    assert args["actor_rollout_ref.actor.ppo_epochs"] == "1"
    assert int(args["trainer.total_training_steps"]) * n == 1024  # 1,024 policy updates whatever N
    assert args["actor_rollout_ref.rollout.n"] == "8"
    assert args["actor_rollout_ref.actor.policy_loss.loss_mode"] == "respo"
    assert args["actor_rollout_ref.actor.policy_loss._target_"] == "respo_trl.integrations.verl.ReSPOPolicyLossConfig"
    # the paper's optimiser, no KL
    assert args["actor_rollout_ref.actor.optim.lr"] == "1e-6"
    assert args["actor_rollout_ref.actor.optim.lr_warmup_steps_ratio"] == "0.05"
    assert args["actor_rollout_ref.actor.optim.weight_decay"] == "0.1"
    assert args["actor_rollout_ref.actor.optim.clip_grad"] == "1.0"
    assert args["actor_rollout_ref.actor.use_kl_loss"] == "false" and args["algorithm.use_kl_in_reward"] == "false"


def test_model_specific_settings():
    small, _ = dry_run("train_qwen3_1_7b.sh")
    assert small["data.max_response_length"] == "15360" and small["actor_rollout_ref.actor.strategy"] == "fsdp"
    assert small["actor_rollout_ref.actor.ulysses_sequence_parallel_size"] == "2"
    assert small["actor_rollout_ref.rollout.tensor_model_parallel_size"] == "2"
    assert small["actor_rollout_ref.model.path"] == "Qwen/Qwen3-1.7B-Base"
    assert not any(k.startswith("+reward.reward_kwargs.overlong") for k in small)

    big, lines = dry_run("train_qwen3_30b_a3b.sh", "--model", "/models/q30b")
    assert "--config-name=ppo_megatron_trainer" in lines
    assert big["data.max_response_length"] == "8192" and big["actor_rollout_ref.model.path"] == "/models/q30b"
    assert big["actor_rollout_ref.actor.megatron.tensor_model_parallel_size"] == "2"
    assert big["actor_rollout_ref.actor.megatron.expert_model_parallel_size"] == "8"
    assert big["actor_rollout_ref.rollout.tensor_model_parallel_size"] == "4"
    # overlong penalty: 0 up to 8192 - 4096 tokens, falling linearly to -1 at 8192
    assert big["+reward.reward_kwargs.overlong_buffer_cfg.enable"] == "true"
    assert big["+reward.reward_kwargs.overlong_buffer_cfg.len"] == "4096"
    assert big["+reward.reward_kwargs.overlong_buffer_cfg.penalty_factor"] == "1.0"


def test_nodes_and_extra_overrides_pass_through():
    args, lines = dry_run("train_qwen3_1_7b.sh", "--N", "16", "+actor_rollout_ref.actor.policy_loss.respo_lambda_pos=1.0",
                          NNODES="4", GPUS_PER_NODE="8")
    assert args["trainer.nnodes"] == "4" and args["trainer.n_gpus_per_node"] == "8"
    assert lines[-1] == "+actor_rollout_ref.actor.policy_loss.respo_lambda_pos=1.0"  # last, so it wins


@pytest.mark.parametrize("script", LAUNCHERS)
@pytest.mark.parametrize("bad", ["12", "0", "-8", "eight", "2048", ""])
def test_bad_n_is_refused_with_a_clear_message(script, bad):
    result = run(["bash", str(RECIPES / script), "--N", bad, "--dry-run"])
    assert result.returncode == 2
    assert "--N must be a positive divisor of 1024" in result.stderr and result.stdout == ""


def test_unknown_option_and_bad_node_count_are_refused():
    result = run(["bash", str(RECIPES / LAUNCHERS[0]), "--nodes", "2"])
    assert result.returncode == 2 and "unknown option --nodes" in result.stderr
    result = run(["bash", str(RECIPES / LAUNCHERS[0]), "--dry-run"], NNODES="two")
    assert result.returncode == 2 and "NNODES" in result.stderr


@pytest.mark.parametrize("script", LAUNCHERS)
def test_async_trainers_take_their_entry_point_gpu_split_and_staleness(script):
    """--trainer picks verl's own async entry point and config; rollout and training split each node's GPUs."""
    result = run(["bash", str(RECIPES / script), "--N", "16", "--trainer", "fully_async", "--dry-run"],
                 ROLLOUT_GPUS_PER_NODE="2")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[1:3] == ["-m", "verl.experimental.fully_async_policy.fully_async_main"]
    assert lines[3] == f"--config-name=fully_async_{'ppo_megatron_trainer' if '30b' in script else 'ppo_trainer'}"
    args = {k: v for k, _, v in (a.partition("=") for a in lines[4:])}
    assert args["trainer.n_gpus_per_node"] == "6" and args["rollout.n_gpus_per_node"] == "2"
    assert args["async_training.trigger_parameter_sync_step"] == "16" and args["data.train_batch_size"] == "0"
    assert args["actor_rollout_ref.hybrid_engine"] == "false"
    assert args["actor_rollout_ref.actor.policy_loss.loss_mode"] == "respo"
    result = run(["bash", str(RECIPES / script), "--N", "8", "--trainer", "one_step_off", "--dry-run"])
    lines = result.stdout.splitlines()
    assert lines[2] == "verl.experimental.one_step_off_policy.main_ppo" and "data.train_batch_size=256" in lines
    assert "trainer.n_gpus_per_node=4" in lines and "rollout.n_gpus_per_node=4" in lines  # half each by default


@pytest.mark.parametrize("env, trainer, message", [
    ({}, "async", "--trainer must be sync, one_step_off or fully_async"),
    ({"ROLLOUT_GPUS_PER_NODE": "8"}, "one_step_off", "ROLLOUT_GPUS_PER_NODE must be between 1 and GPUS_PER_NODE - 1"),
    ({"GPUS_PER_NODE": "1"}, "fully_async", "ROLLOUT_GPUS_PER_NODE must be between 1 and GPUS_PER_NODE - 1"),
])
def test_bad_trainer_or_gpu_split_is_refused_in_one_line(env, trainer, message):
    result = run(["bash", str(RECIPES / LAUNCHERS[0]), "--trainer", trainer, "--dry-run"], **env)
    assert result.returncode == 2 and message in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_missing_training_data_stops_before_launch(tmp_path):
    result = run(["bash", str(RECIPES / LAUNCHERS[0]), "--N", "8"], TRAIN_FILE=str(tmp_path / "absent.parquet"),
                 PYTHON_BIN=sys.executable)
    assert result.returncode == 2
    assert "absent.parquet" in result.stderr or "plugin is not installed" in result.stderr


def test_prepare_dapo_math_writes_verls_schema(tmp_path):
    from respo_trl.recipe.data import DAPO_PREFIX, DAPO_SUFFIX  # the TRL recipe strips the same wrapper

    prepare = RECIPES / "prepare_dapo_math.py"  # run as users run it (it runs in the verl environment: no TRL import)
    instruction = " Please reason step by step, and put your final answer within \\boxed{}."  # the paper's prompt
    rows = [
        {"prompt": DAPO_PREFIX + "What is 2+3?" + DAPO_SUFFIX, "solution": "5"},  # original DAPO wrapper
        {"prompt": "Find x if 2x = 8.", "solution": "", "reward_model": {"ground_truth": "4"}},  # answer fallback
        {"prompt": [{"role": "user", "content": "Compute 7*6."}], "solution": "42"},  # chat-formatted prompt
        {"prompt": "No answer here.", "solution": ""},  # skipped
    ]
    source = tmp_path / "dapo.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out" / "train.parquet"
    result = run([sys.executable, str(prepare), "--input", str(source), "--output", str(out)])
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1]) == {"output": str(out), "rows": 3, "skipped": 1}

    from datasets import load_dataset

    data = load_dataset("parquet", data_files=str(out), split="train")
    assert set(data.column_names) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}
    first = data[0]
    assert first["data_source"] == "math_dapo"  # verl's default_compute_score routes this to math_dapo
    assert first["prompt"] == [{"role": "user", "content": "What is 2+3?" + instruction}]
    assert first["reward_model"] == {"style": "rule", "ground_truth": "5"}
    assert [r["reward_model"]["ground_truth"] for r in data] == ["5", "4", "42"]
    assert [r["extra_info"]["index"] for r in data] == [0, 1, 2]
    assert data[2]["prompt"][0]["content"].startswith("Compute 7*6.")

    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"prompt": "x", "solution": ""}) + "\n")
    result = run([sys.executable, str(prepare), "--input", str(empty), "--output", str(tmp_path / "e.parquet")])
    assert result.returncode != 0 and "no usable rows" in result.stderr


def test_respo_trl_imports_without_verl_and_the_integration_says_how_to_install():
    """Hide verl (as if not installed): the package, the kernel and the integrations package import; the verl
    integration raises an ImportError that names the install command. TRL is not imported either."""
    code = (
        "import sys, json; sys.modules['verl'] = None\n"
        "import respo_trl, respo_trl.kernels, respo_trl.diagnostics, respo_trl.integrations\n"
        "loaded = sorted(m for m in ('verl', 'trl') if sys.modules.get(m) is not None)\n"
        "try:\n    import respo_trl.integrations.verl\n    msg = None\n"
        "except ImportError as e:\n    msg = str(e)\n"
        "print(json.dumps({'loaded': loaded, 'msg': msg}))\n"
    )
    result = run([sys.executable, "-c", code])
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["loaded"] == []
    assert out["msg"] and "pip install -r requirements/verl.txt" in out["msg"] and "--no-deps" in out["msg"]
