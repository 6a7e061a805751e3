"""recipes/qwen3_respo.py: presets, launch configs, bad input, short end-to-end runs (in-process and multi-process).

In-process runs use a ~10k-parameter tiny Qwen3 and take seconds. The multi-process runs (`slow`) launch the recipe
the way users do (`accelerate launch`), with 2 CPU processes.
"""

import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "qwen3_respo.py"
ACCELERATE_CONFIGS = ROOT / "recipes" / "accelerate"
QWEN3_PRESETS = ["qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b", "qwen3-14b", "qwen3-30b-a3b"]

# The smallest run of the embedded default that still exercises every stage (warm start, evaluation, reuse, plots).
SMALL = [
    "--warmstart_steps", "3", "--train_size", "200", "--heldout_size", "16", "--heldout_eval_steps", "2",
    "--per_device_train_batch_size", "8", "--tiny_hidden_size", "32", "--tiny_num_layers", "1",
    "--tiny_intermediate_size", "64", "--max_completion_length", "16", "--eval_batch_size", "16",
]  # fmt: skip


@pytest.fixture(scope="module")
def recipe(load_script):
    return load_script("recipes/qwen3_respo.py")


def run_recipe(recipe, tmp_path, *extra, name="run"):
    args = recipe.parse_args([*SMALL, "--output_dir", str(tmp_path / name), *extra])
    return recipe.main(*args)


# -- presets ----------------------------------------------------------------------------------------------------------


def test_every_preset_is_listed(recipe):
    assert set(recipe.available_presets()) == {"tiny_cpu", *QWEN3_PRESETS}


@pytest.mark.parametrize("preset", QWEN3_PRESETS)
def test_qwen3_preset_parses_into_a_valid_config_for_the_gpus_it_names(recipe, preset):
    from trl import ModelConfig

    from respo_trl import ReSPOConfig

    # bf16 needs a GPU or use_cpu on this machine; everything else is parsed exactly as on the cluster.
    script, training, model = recipe.parse_args(["--preset", preset, "--use_cpu", "true"])
    assert isinstance(training, ReSPOConfig) and isinstance(model, ModelConfig)
    assert model.model_name_or_path.startswith("Qwen/Qwen3-") and model.dtype == "bfloat16"
    assert training.loss_type == "respo" and training.respo_reuse == training.num_iterations == 4
    assert training.use_vllm and training.vllm_mode == "colocate"
    assert training.vllm_importance_sampling_correction and training.vllm_importance_sampling_mode == "token_truncate"
    assert 8192 <= training.max_completion_length <= 32768
    assert training.vllm_max_model_length > training.max_completion_length
    assert training.bf16 and training.activation_checkpointing
    assert script.dataset_name == "open-r1/DAPO-Math-17k-Processed" and script.answer_column == "solution"
    assert script.eval_dataset_name == "HuggingFaceH4/MATH-500" and script.eval_answer_column == "answer"
    assert script.reward_funcs == ["accuracy", "format"] and script.eval_mode == "sampled"
    # The launch it was sized for exists, and TRL's batch arithmetic holds for that many processes.
    assert (ROOT / script.accelerate_config).is_file()
    batch = recipe.check_batch_arithmetic(training, script.expected_num_processes, sampled_eval=True)
    assert batch["generation_batch_size"] % training.num_generations == 0
    assert batch["optimizer_steps_per_generation"] == 4
    assert script.expected_num_processes % training.vllm_tensor_parallel_size == 0
    if preset == "qwen3-30b-a3b":
        assert training.router_aux_loss_coef > 0  # MoE: router load-balancing loss on
    else:
        assert training.router_aux_loss_coef is None


def test_presets_fix_steps_per_generation_so_the_batch_scales_with_gpus():
    import yaml

    for preset in QWEN3_PRESETS:
        config = yaml.safe_load((ROOT / "recipes" / "configs" / f"{preset}.yaml").read_text())
        assert "generation_batch_size" not in config and config["steps_per_generation"] >= 1, preset


def test_no_arguments_is_the_tiny_cpu_preset_and_overrides_apply(recipe):
    script, training, model = recipe.parse_args([])
    assert script.preset == "tiny_cpu" and script.tiny_model == "dense" and model.model_name_or_path is None
    assert training.use_cpu and not training.bf16 and not training.activation_checkpointing
    assert training.respo_reuse == 4 and training.loss_type == "respo" and script.eval_mode == "greedy"
    assert script.dataset_name == "builtin:arithmetic" and script.warmstart_steps > 0
    script, training, _ = recipe.parse_args(["--seed", "3", "--respo_reuse", "2", "--output_dir", "elsewhere"])
    assert (training.seed, training.respo_reuse, training.output_dir) == (3, 2, "elsewhere")
    assert script.preset == "tiny_cpu"


def test_bad_preset_config_and_argument_names_fail_with_the_choices(recipe, tmp_path):
    with pytest.raises(SystemExit, match="unknown preset 'qwen3-7b'.*qwen3-8b"):
        recipe.parse_args(["--preset", "qwen3-7b"])
    with pytest.raises(SystemExit, match="is not a file"):
        recipe.parse_args(["--config", str(tmp_path / "missing.yaml")])
    typo = tmp_path / "typo.yaml"
    typo.write_text("tiny_model: dense\nuse_cpu: true\nrespo_reuze: 4\n")
    with pytest.raises(ValueError, match="respo_reuze"):
        recipe.parse_args(["--config", str(typo)])
    with pytest.raises(ValueError, match="unknown reward function 'acuracy'"):
        recipe.parse_args(["--reward_funcs", "acuracy", "format"])
    with pytest.raises(ValueError, match="unknown built-in task"):
        recipe.parse_args(["--dataset_name", "builtin:calculus"])
    with pytest.raises(ValueError, match="reward_weights has 1 values"):
        recipe.parse_args(["--reward_weights", "1.0"])
    with pytest.raises(ValueError, match="accuracy reward"):
        recipe.parse_args(["--reward_funcs", "format", "--reward_weights", "1.0"])
    with pytest.raises(ValueError, match="divisible by num_generations"):
        recipe.parse_args(["--per_device_train_batch_size", "12"])


def test_batch_arithmetic_is_checked_for_the_gpu_count_a_preset_names(recipe):
    _, training, _ = recipe.parse_args(["--preset", "qwen3-4b", "--use_cpu", "true"])
    assert recipe.check_batch_arithmetic(training, 8)["generation_batch_size"] == 256
    training.num_generations = 12  # 2 x 8 x 16 = 256 completions do not split into groups of 12
    with pytest.raises(ValueError, match="not divisible by num_generations 12"):
        recipe.check_batch_arithmetic(training, 8)
    training.num_generations, training.vllm_tensor_parallel_size = 8, 3
    with pytest.raises(ValueError, match="vllm_tensor_parallel_size 3"):
        recipe.check_batch_arithmetic(training, 8)


# -- launch configs ---------------------------------------------------------------------------------------------------


def launch_env(config_file, monkeypatch):
    """The environment `accelerate launch --config_file ...` would give the training processes."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import prepare_multi_gpu_env

    args = launch_command_parser().parse_args(["--config_file", str(config_file), str(RECIPE)])
    args, _, _ = _validate_launch_command(args)
    return args, prepare_multi_gpu_env(args)


def test_launch_configs_parse_with_accelerate(monkeypatch):
    from accelerate.commands.config.config_args import load_config_from_file

    expected = {
        "ddp.yaml": ("MULTI_GPU", 8, 1, None),
        "zero2.yaml": ("DEEPSPEED", 8, 1, 2),
        "zero3.yaml": ("DEEPSPEED", 8, 1, 3),
        "fsdp2.yaml": ("FSDP", 8, 1, None),
        "multinode_zero3.yaml": ("DEEPSPEED", 16, 2, 3),
    }
    assert {p.name for p in ACCELERATE_CONFIGS.glob("*.yaml")} == set(expected)
    for name, (kind, processes, machines, stage) in expected.items():
        config = load_config_from_file(str(ACCELERATE_CONFIGS / name))
        assert (config.distributed_type.value, config.num_processes, config.num_machines) == (
            kind,
            processes,
            machines,
        )
        assert config.mixed_precision == "bf16"
        if stage is not None:
            assert config.deepspeed_config["zero_stage"] == stage
    multinode = load_config_from_file(str(ACCELERATE_CONFIGS / "multinode_zero3.yaml"))
    assert multinode.main_process_port == 29500 and multinode.deepspeed_config["deepspeed_multinode_launcher"]


def test_fsdp2_config_builds_an_fsdp2_plugin(monkeypatch):
    """FSDP cannot run on CPU: the config is validated by building accelerate's plugin from the launch environment."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    _, env = launch_env(ACCELERATE_CONFIGS / "fsdp2.yaml", monkeypatch)
    assert env["ACCELERATE_USE_FSDP"] == "true" and env["FSDP_VERSION"] == "2"
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    plugin = FullyShardedDataParallelPlugin()
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is True
    assert plugin.state_dict_type.name == "FULL_STATE_DICT" and plugin.cpu_ram_efficient_loading


# -- bad input before compute -----------------------------------------------------------------------------------------


def raising_reward(completions, **kwargs):
    raise RuntimeError("reward server unreachable")


def test_unknown_model_fails_on_its_config_before_any_weights(recipe, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    args = recipe.parse_args(
        ["--model_name_or_path", "Qwen/Qwen3-0.7B", "--use_cpu", "true", "--output_dir", str(tmp_path / "o")]
    )
    with pytest.raises(ValueError, match="cannot resolve model 'Qwen/Qwen3-0.7B'.*qwen3-0.6b"):
        recipe.main(*args)


def test_dataset_without_the_answer_column_fails_with_the_columns(recipe, tmp_path, tiny_model_dir):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"problem": f"{i}+1", "final": str(i + 1)}) + "\n" for i in range(8)))
    args = recipe.parse_args(
        ["--model_name_or_path", tiny_model_dir, "--dataset_name", str(data), "--prompt_column", "problem",
         "--eval_mode", "none", "--use_cpu", "true", "--output_dir", str(tmp_path / "o")]
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"no column 'solution' \(columns: \['problem', 'final'\]\).*--answer_column"):
        recipe.main(*args)


def test_a_raising_reward_fails_before_the_warm_start(recipe, tmp_path, monkeypatch):
    import respo_trl.demo.warmstart

    def forbidden(*args, **kwargs):
        raise AssertionError("the warm start ran before the reward functions were checked")

    monkeypatch.setattr(respo_trl.demo.warmstart, "supervised_warm_start", forbidden)
    args = recipe.parse_args(
        [*SMALL, "--reward_funcs", "accuracy", "test_recipes.raising_reward", "--output_dir", str(tmp_path / "o")]
    )
    with pytest.raises(RuntimeError, match="'raising_reward' raised RuntimeError.*reward server unreachable"):
        recipe.main(*args)


# -- end to end, in process -------------------------------------------------------------------------------------------


def test_tiny_default_runs_end_to_end_and_resumes_with_its_rollout_buffer(recipe, tmp_path):
    report = run_recipe(recipe, tmp_path, "--max_steps", "4", "--save_steps", "2", "--save_total_limit", "3")
    out = tmp_path / "run"
    assert report["heldout"]["before"] is not None and report["heldout"]["after"] is not None
    assert report["heldout"]["n"] == 16 and report["warm_start"]["steps"] == 3
    assert [p["step"] for p in report["curve"]] == [0, 2, 4]
    assert report["training"]["global_step"] == 4 and report["training"]["respo_reuse"] == 4
    assert report["training"]["generated_tokens"] > 0
    assert set(report["training"]["mean_grad_throughput"]) == {
        "grad_throughput/pos", "grad_throughput/neg", "clip_grad_throughput/pos", "clip_grad_throughput/neg"
    }  # fmt: skip
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    fresh = next(h["grad_norm"] for h in history if h.get("reuse/pass") == 1)
    # R = 4, one batch: passes 2-4 are compared with the fresh pass, unless its gradient was zero (equal rewards)
    expected = {"pass_2", "pass_3", "pass_4"} if fresh > 0 else set()
    assert set(report["training"]["mean_grad_norm_vs_fresh"]) == expected
    for name in ("report.json", "accuracy_reward_vs_tokens.png", "grad_throughput.png", "model.safetensors",
                 "trainer_state.json", "tokenizer.json"):  # fmt: skip
        assert (out / name).is_file(), name
    assert json.loads((out / "report.json").read_text())["heldout"]["after"] == report["heldout"]["after"]
    for step in (2, 4):
        assert (out / f"checkpoint-{step}" / "rollout_buffer-rank0.safetensors").is_file()
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    assert [h["reuse/staleness_max"] for h in history if "reuse/staleness_max" in h] == [0, 1, 2, 3]
    assert all("starvation/grad_throughput/pos" in h for h in history if "loss" in h)  # what the plot draws

    # Resume from step 2 (same output_dir): the buffer sampled at step 0 is reused for steps 3 and 4, so no new
    # generation happens and the sampled-token count continues from the checkpoint.
    resumed = run_recipe(
        recipe, tmp_path, "--max_steps", "4", "--save_strategy", "no",
        "--resume_from_checkpoint", str(out / "checkpoint-2"),
    )  # fmt: skip
    assert resumed["resumed_from"].endswith("checkpoint-2") and resumed["heldout"]["before"] is None
    assert resumed["warm_start"]["steps"] == 0 and resumed["training"]["global_step"] == 4
    assert resumed["training"]["generated_tokens"] == report["training"]["generated_tokens"]
    # `--resume_from_checkpoint true` picks the latest checkpoint (step 4) and continues to a new max_steps: step 5
    # samples a fresh generation batch (every R=4 steps), step 6 reuses it.
    latest = run_recipe(
        recipe, tmp_path, "--max_steps", "6", "--save_strategy", "no", "--resume_from_checkpoint", "true"
    )
    assert latest["resumed_from"] == "True" and latest["training"]["global_step"] == 6
    assert latest["training"]["generated_tokens"] > report["training"]["generated_tokens"]
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    assert [h["reuse/staleness_max"] for h in history if "reuse/staleness_max" in h][-2:] == [0, 1]


def test_moe_tiny_model_trains_with_the_router_loss(recipe, tmp_path):
    report = run_recipe(recipe, tmp_path, "--tiny_model", "moe", "--max_steps", "2", "--save_strategy", "no",
                        "--eval_mode", "none", "--heldout_eval_steps", "0")  # fmt: skip
    assert report["model"]["moe"] and report["model"]["router_aux_loss_coef"] > 0
    history = json.loads((tmp_path / "run" / "trainer_state.json").read_text())["log_history"]
    assert any("aux_loss" in h for h in history)


def test_hub_loading_path_on_local_model_and_data_files_with_sampled_eval(recipe, tmp_path, tiny_model_dir):
    """The preset code path (model and datasets by name, held-out accuracy by trainer.evaluate) on local files."""
    train, heldout = tmp_path / "train.jsonl", tmp_path / "math500.jsonl"
    train.write_text(
        "".join(json.dumps({"prompt": f"{i}+{i % 5}", "solution": str(i + i % 5)}) + "\n" for i in range(32))
    )
    heldout.write_text("".join(json.dumps({"problem": f"{i}-1", "answer": str(i - 1)}) + "\n" for i in range(8)))
    args = recipe.parse_args(
        ["--model_name_or_path", tiny_model_dir, "--dataset_name", str(train), "--eval_dataset_name", str(heldout),
         "--system_prompt", "Put the answer in \\boxed{}.", "--eval_mode", "sampled", "--num_generations_eval", "2",
         "--per_device_eval_batch_size", "4", "--eval_strategy", "steps", "--eval_steps", "2",
         "--max_steps", "2", "--per_device_train_batch_size", "8", "--num_generations", "4",
         "--max_completion_length", "8",
         "--use_cpu", "true", "--bf16", "false", "--save_strategy", "no", "--report_to", "none",
         "--output_dir", str(tmp_path / "hub")]
    )  # fmt: skip
    report = recipe.main(*args)
    assert report["model"]["name"] == tiny_model_dir and report["heldout"]["n"] == 8
    assert report["heldout"]["mode"] == "sampled" and 0 <= report["heldout"]["after"] <= 1
    assert report["heldout"]["after_detail"]["from"] == "last eval_strategy evaluation"  # not evaluated twice
    assert [p["step"] for p in report["curve"]] == [0, 2]
    assert report["warm_start"]["demonstration_accuracy"] is None


# -- multi-process launches (what users run) -------------------------------------------------------------------------


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(tmp_path, *launch_args):
    out = tmp_path / "launched"
    command = [
        sys.executable, "-m", "accelerate.commands.launch", *launch_args, "--num_processes", "2",
        "--mixed_precision", "no", "--main_process_port", str(free_port()), str(RECIPE),
        *SMALL, "--max_steps", "2", "--save_strategy", "no", "--output_dir", str(out),
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "OMP_NUM_THREADS": "1"}  # fmt: skip
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["num_processes"] == 2 and report["training"]["global_step"] == 2
    assert report["training"]["batch"]["generation_batch_size"] == 16  # 8 per process x 2 processes
    assert report["heldout"]["n"] == 16 and report["heldout"]["after_detail"]["n"] == 16  # both shards counted
    return report, result


@pytest.mark.slow
def test_two_process_ddp_on_cpu(tmp_path):
    report, _ = launch(tmp_path, "--multi_gpu")
    assert report["distributed_type"] == "MULTI_CPU"


@pytest.mark.slow
def test_two_process_deepspeed_zero2_on_cpu(tmp_path):
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed (pip install --no-build-isolation deepspeed, see docs/recipes.md)")
    report, _ = launch(tmp_path, "--config_file", str(ACCELERATE_CONFIGS / "zero2.yaml"))
    assert report["distributed_type"] == "DEEPSPEED"
