"""recipes/qwen3_respo.py: presets, launch configs, bad input, short end-to-end runs (in-process and multi-process).

In-process runs use a ~10k-parameter tiny Qwen3 and take seconds. The multi-process runs (`slow`) launch the recipe
the way users do (`accelerate launch`), with 2 CPU processes.
"""

import dataclasses
import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from respo_trl.recipe import RecipeError

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "qwen3_respo.py"
ACCELERATE_CONFIGS = ROOT / "recipes" / "accelerate"
QWEN3_PRESETS = [f"qwen3-{size}-epochs4" for size in ("0.6b", "1.7b", "4b", "8b", "14b", "30b-a3b")]
PAPER_PRESETS = ["paper-qwen3-1.7b-base", "paper-qwen3-30b-a3b-base"]

# The smallest run of the embedded default that still exercises every stage (warm start, evaluation, reuse, plots).
SMALL = [
    "--warmstart_steps", "3", "--train_size", "200", "--heldout_size", "16", "--heldout_eval_steps", "2",
    "--per_device_train_batch_size", "8", "--tiny_hidden_size", "32", "--tiny_num_layers", "1",
    "--tiny_intermediate_size", "64", "--max_completion_length", "16", "--eval_batch_size", "16",
]  # fmt: skip


@pytest.fixture(scope="module")
def recipe():
    """The recipe as the package runs it (``recipes/qwen3_respo.py`` calls ``respo_trl.recipe.cli``)."""
    import respo_trl.recipe

    return respo_trl.recipe


def run_recipe(recipe, tmp_path, *extra, name="run"):
    args = recipe.parse_args([*SMALL, "--output_dir", str(tmp_path / name), *extra])
    return recipe.main(*args)


# -- presets ----------------------------------------------------------------------------------------------------------


def test_every_preset_is_listed(recipe):
    assert set(recipe.available_presets()) == {"tiny-cpu", *QWEN3_PRESETS, *PAPER_PRESETS, "smollm2-135m-cpu-vllm"}


def test_smollm2_preset_is_a_cpu_run_with_vllm_generation_on_the_converted_gguf(recipe):
    """The pretrained-model preset (docs/vllm.md): the checkpoint respo_trl.integrations.gguf writes, vLLM colocated
    with its sampler log-probs folded into W, the built-in task in SmolLM2's chat format, one CPU process."""
    script, training, model = recipe.parse_args(["--preset", "smollm2-135m-cpu-vllm"])
    assert model.model_name_or_path == "outputs/smollm2-135m-instruct-q4" and script.tiny_model is None
    assert training.use_cpu and not training.bf16 and script.expected_num_processes == 1
    assert training.use_vllm and training.vllm_mode == "colocate" and training.vllm_importance_sampling_correction
    assert training.loss_type == "respo" and training.steps_per_generation == 2 * training.gradient_accumulation_steps
    assert script.dataset_name == "builtin:arithmetic" and "{problem}" in script.prompt_template
    assert "\\boxed{" not in script.prompt_template  # a placeholder to copy is what it learned (docs/vllm.md)
    assert script.warmstart_steps == 0 and script.eval_mode == "greedy"
    assert "dequantised" in training.output_dir  # its card says what the weights are
    # math-verify's accuracy and a format bonus are gamed here (docs/vllm.md): the number the answer ends on, alone
    assert script.reward_funcs == ["last_integer_accuracy"]


@pytest.mark.parametrize("preset", QWEN3_PRESETS)
def test_qwen3_preset_parses_into_a_valid_config_for_the_gpus_it_names(recipe, preset):
    from trl import ModelConfig

    from respo_trl import ReSPOConfig

    # bf16 needs a GPU or use_cpu on this machine; everything else is parsed exactly as on the cluster.
    script, training, model = recipe.parse_args(["--preset", preset, "--use_cpu", "true"])
    assert isinstance(training, ReSPOConfig) and isinstance(model, ModelConfig)
    assert model.model_name_or_path.startswith("Qwen/Qwen3-") and model.dtype == "bfloat16"
    assert training.loss_type == "respo" and training.num_iterations == 4
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
    batch = recipe.batch_plan(training, script.expected_num_processes, sampled_eval=True)
    assert batch["generation_batch_size"] % training.num_generations == 0
    assert batch["optimizer_steps_per_generation"] == 4
    assert script.expected_num_processes % training.vllm_tensor_parallel_size == 0
    if preset == "qwen3-30b-a3b-epochs4":
        assert training.router_aux_loss_coef > 0  # MoE: router load-balancing loss on
    else:
        assert training.router_aux_loss_coef is None


def test_presets_fix_steps_per_generation_so_the_batch_scales_with_gpus():
    """No preset fixes the generation batch's size: it is per_device x processes x steps_per_generation, and
    steps_per_generation is TRL's default (gradient_accumulation_steps: N = 1) or N x accumulation."""
    import yaml

    for preset in QWEN3_PRESETS:
        config = yaml.safe_load((ROOT / "respo_trl" / "recipe" / "presets" / f"{preset}.yaml").read_text())
        assert "generation_batch_size" not in config, preset
        assert "steps_per_generation" not in config or config["steps_per_generation"] >= 1, preset


def test_no_arguments_is_the_tiny_cpu_preset_and_overrides_apply(recipe, tmp_path):
    script, training, model = recipe.parse_args([])
    assert script.preset == "tiny-cpu" and script.tiny_model == "dense" and model.model_name_or_path is None
    assert training.use_cpu and not training.bf16 and not training.activation_checkpointing
    assert training.num_iterations == 4 and training.loss_type == "respo" and script.eval_mode == "greedy"
    assert script.dataset_name == "builtin:arithmetic" and script.warmstart_steps > 0
    script, training, _ = recipe.parse_args(["--seed", "3", "--num_iterations", "2", "--output_dir", "elsewhere"])
    assert (training.seed, training.num_iterations, training.output_dir) == (3, 2, "elsewhere")
    assert script.preset == "tiny-cpu"


def test_every_renamed_preset_and_flag_points_to_one_that_exists(recipe):
    from respo_trl._compat import RENAMED_OPTIONS, RENAMED_PRESETS
    from respo_trl.recipe.parsing import known_flags

    presets, flags = set(recipe.available_presets()), set(known_flags())
    assert all(renamed.new in presets and old not in presets for old, renamed in RENAMED_PRESETS.items())
    assert all(renamed.new in flags and old not in flags for old, renamed in RENAMED_OPTIONS.items())


def test_renamed_options_are_refused_with_the_new_name_on_the_command_line_and_in_a_config_file(recipe, tmp_path):
    """Epochs have one name, TRL's num_iterations: --respo_reuse, or a config file that still says respo_reuse, stops
    in one line naming the option to set (not TRL's "arguments are not used" or did-you-mean)."""
    with pytest.raises(RecipeError, match=r"^--respo_reuse was renamed --num_iterations \(TRL's name .*0\.7\)$"):
        recipe.parse_args(["--respo_reuse", "2", "--output_dir", "elsewhere"])
    config = tmp_path / "old.yaml"
    config.write_text("respo_reuse: 4\nuse_cpu: true\nbf16: false\ntiny_model: dense\n")
    with pytest.raises(RecipeError, match=r"^respo_reuse=4 was renamed num_iterations .*: set num_iterations=4 instead$"):
        recipe.parse_args(["--config", str(config), "--num_iterations", "1", "--output_dir", "elsewhere"])


def test_bad_preset_config_and_argument_names_fail_with_the_choices(recipe, tmp_path):
    with pytest.raises(RecipeError, match="unknown preset 'qwen3-7b'.*qwen3-8b-epochs4"):
        recipe.parse_args(["--preset", "qwen3-7b"])
    with pytest.raises(RecipeError, match="is not a file"):
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
    _, training, _ = recipe.parse_args(["--preset", "qwen3-4b-epochs4", "--use_cpu", "true"])
    assert recipe.batch_plan(training, 8)["generation_batch_size"] == 256
    training.num_generations = 12  # 2 x 8 x 16 = 256 completions do not split into groups of 12
    with pytest.raises(ValueError, match="not divisible by num_generations 12"):
        recipe.batch_plan(training, 8)
    training.num_generations, training.vllm_tensor_parallel_size = 8, 3
    with pytest.raises(ValueError, match="vllm_tensor_parallel_size 3"):
        recipe.batch_plan(training, 8)


def test_old_preset_names_point_to_the_renamed_presets_and_the_papers(recipe):
    with pytest.raises(RecipeError, match="'qwen3-4b' was renamed 'qwen3-4b-epochs4'.*paper-qwen3-1.7b-base"):
        recipe.parse_args(["--preset", "qwen3-4b"])


# -- the paper's presets ----------------------------------------------------------------------------------------------

PAPER_MODELS = {  # preset: (model, response cap, soft overlong ramp or None, vLLM TP, launch config)
    "paper-qwen3-1.7b-base": ("Qwen/Qwen3-1.7B-Base", 15360, None, 1, "recipes/accelerate/zero2.yaml"),
    "paper-qwen3-30b-a3b-base": ("Qwen/Qwen3-30B-A3B-Base", 8192, 4096, 4, "recipes/accelerate/zero3.yaml"),
}


def paper_args(recipe, preset, *extra, processes=8):
    # bf16 needs a GPU or use_cpu on this machine; everything else is parsed exactly as on the cluster.
    return recipe.parse_args(["--preset", preset, "--use_cpu", "true", *extra], num_processes=processes)


@pytest.mark.parametrize("preset", PAPER_PRESETS)
def test_paper_preset_is_the_papers_training_setup(recipe, preset):
    """Every setting of docs/recipes.md's table 'Reproducing the paper with TRL' (the paper's facts), as parsed."""
    model_id, cap, ramp, tp, launch = PAPER_MODELS[preset]
    script, training, model = paper_args(recipe, preset)
    assert model.model_name_or_path == model_id and model.dtype == "bfloat16"
    assert (script.expected_num_processes, script.accelerate_config) == (8, launch) and (ROOT / launch).is_file()
    # data: DAPO-Math-17k, DAPO's "Answer:" instruction replaced by the \boxed{} request, prompts up to 1,024 tokens
    assert (script.dataset_name, script.dataset_config, script.answer_column) == (
        "open-r1/DAPO-Math-17k-Processed", "all", "solution"
    )
    assert script.strip_dapo_instruction and script.system_prompt is None and script.max_prompt_length == 1024
    assert script.prompt_template == "{problem} Please reason step by step, and put your final answer within \\boxed{}."
    # optimiser
    assert (training.learning_rate, training.warmup_steps, training.lr_scheduler_type.value) == (
        1e-6, 0.05, "constant_with_warmup"
    )
    assert (training.weight_decay, training.max_grad_norm, training.beta) == (0.1, 1.0, 0.0)
    # batch: 32 prompts x 8 responses per update, N = 8 updates per rollout batch, each sample once, 1,024 updates
    assert (script.prompts_per_update, training.respo_updates_per_rollout, training.num_generations) == (32, 8, 8)
    assert (training.num_iterations, training.max_steps) == (1, 1024)
    assert training.scale_rewards == "group" and not training.mask_truncated_completions
    # rollouts: vLLM, temperature 1, top-p 1, response cap; no sampler correction (the paper applies none)
    assert (training.temperature, training.top_p, training.top_k) == (1.0, 1.0, 0)
    assert training.max_completion_length == cap and training.vllm_max_model_length == 1024 + cap
    assert training.use_vllm and training.vllm_mode == "colocate" and training.vllm_tensor_parallel_size == tp
    assert not training.vllm_importance_sampling_correction
    # reward: DAPO +1/-1 accuracy (and the soft overlong penalty from 4,096 to 8,192 at 30B)
    if ramp is None:
        assert script.reward_funcs == ["dapo_accuracy"] and training.router_aux_loss_coef is None
    else:
        assert script.reward_funcs == ["dapo_accuracy", "soft_overlong"] and training.reward_weights == [1.0, 1.0]
        assert script.soft_overlong_cache == ramp and training.router_aux_loss_coef > 0
    assert script.eval_mode == "none" and script.algorithm == "respo" and training.loss_type == "respo"
    # the kernel is ReSPOConfig's default, i.e. the paper's constants, on the raw sequence ratio, no trust mask
    assert training.kernel_constants == {
        "alpha_pos": 2.0, "beta_pos": 0.5, "lam_pos": 2.0, "alpha_neg": 1.0, "beta_neg": 0.5, "lam_neg": 2.0
    }  # fmt: skip
    assert not training.respo_trust_mask_active
    assert training.output_dir == f"outputs/{preset}-respo-n8-seed0" and training.save_steps == 256


@pytest.mark.parametrize("preset", PAPER_PRESETS)
def test_paper_yaml_states_the_staleness_once(recipe, preset):
    """N is stated once, under the trainer's name (respo_updates_per_rollout); the TRL fields it and M imply are derived
    for the launch (8 processes x 2 x 16 = 256; N = 8 -> 128), never stated beside them (0.3 stated N three times)."""
    import yaml

    config = yaml.safe_load((ROOT / "respo_trl" / "recipe" / "presets" / f"{preset}.yaml").read_text())
    assert config["respo_updates_per_rollout"] == 8 and config["prompts_per_update"] == 32
    assert not {"updates_per_rollout", "steps_per_generation", "gradient_accumulation_steps",
                "generation_batch_size"} & set(config)  # fmt: skip
    _, training, _ = paper_args(recipe, preset, processes=config["expected_num_processes"])
    assert (training.gradient_accumulation_steps, training.steps_per_generation) == (16, 128)


@pytest.mark.parametrize("processes", [1, 8, 16])
@pytest.mark.parametrize("n", [8, 16, 32])
@pytest.mark.parametrize("preset", PAPER_PRESETS)
def test_paper_batch_arithmetic_for_each_n_on_1_8_and_16_processes(recipe, preset, n, processes):
    """Rollout batch N x 32 prompts x 8, N updates of 32 x 8 per rollout batch, each sample once, 1,024 updates."""
    extra = ["--respo_updates_per_rollout", str(n)]
    if processes % PAPER_MODELS[preset][3]:
        extra += ["--vllm_tensor_parallel_size", "1"]  # TP 4 cannot split 1 process (checked below)
    _, training, _ = paper_args(recipe, preset, *extra, processes=processes)
    batch = recipe.batch_plan(training, processes)
    assert batch["prompts_per_generation"] == 32 * n and batch["generation_batch_size"] == 256 * n
    assert batch["updates_per_rollout"] == batch["optimizer_steps_per_generation"] == n
    assert batch["completions_per_update"] == 256 and batch["prompts_per_update"] == 32
    assert batch["reuse_epochs"] == 1 and batch["total_updates"] == 1024 and batch["rollout_batches"] == 1024 // n
    # in TRL's own terms
    assert training.per_device_train_batch_size * processes * training.gradient_accumulation_steps == 256
    assert training.steps_per_generation == n * training.gradient_accumulation_steps and training.num_iterations == 1
    assert training.output_dir.endswith(f"-respo-n{n}-seed0")


def test_dry_run_prints_the_plan_for_the_process_count_it_names(recipe):
    args = recipe.parse_args(
        ["--preset", "paper-qwen3-30b-a3b-base", "--respo_updates_per_rollout", "32", "--use_cpu", "true",
         "--dry_run", "16"]
    )
    plan = dict(line.rsplit("  ", 1) for line in recipe.plan_table(*args).splitlines())
    plan = {key.strip(): value.strip() for key, value in plan.items()}
    assert plan["processes"] == "16" and plan["gradient_accumulation_steps"] == "8"  # 2 x 16 x 8 = 256
    assert plan["steps_per_generation"] == "256" and plan["prompts per rollout batch"] == "1024"
    assert plan["updates per rollout batch (N)"] == "32" and plan["rollout batches"] == "32"
    assert plan["output_dir"] == "outputs/paper-qwen3-30b-a3b-base-respo-n32-seed0"


def test_a_bare_dry_run_plans_for_the_launch(recipe, monkeypatch, capsys):
    """``--dry_run`` without a count (0.3: argparse's usage and 'expected one argument') takes the launch's process
    count; ``--help`` prints the full usage (0.3 refused it as an unknown option)."""
    import respo_trl.recipe.parsing as parsing

    assert recipe.parse_args(["--preset", "paper-qwen3-1.7b-base", "--dry_run"])[0].dry_run == 1  # no launcher; no GPU
    argv = ["--preset", "paper-qwen3-1.7b-base", "--use_cpu", "true", "--dry_run"]
    monkeypatch.setattr(parsing, "launch_processes", lambda: 16)
    script, training, model = recipe.parse_args(argv + ["--seed", "3"])
    assert script.dry_run == 16 and training.seed == 3  # the bare flag does not swallow the next one
    plan = dict(line.split(None, 1) if line.startswith("processes") else ("", "") for line in
                recipe.plan_table(script, training, model).splitlines())  # fmt: skip
    assert plan["processes"] == "16" and training.gradient_accumulation_steps == 8  # 2 per device x 16 x 8 = 256
    with pytest.raises(SystemExit) as exit_info:
        recipe.cli(["--help"])
    assert exit_info.value.code == 0 and "--dry_run [DRY_RUN]" in capsys.readouterr().out


def test_paper_preset_on_fewer_gpus_than_vllm_tensor_parallelism_names_the_field(recipe):
    with pytest.raises(ValueError, match="vllm_tensor_parallel_size 4 does not divide 1 processes"):
        paper_args(recipe, "paper-qwen3-30b-a3b-base", processes=1)


@pytest.mark.parametrize(
    ("extra", "processes", "message"),
    [
        (["--per_device_train_batch_size", "3"], 8,
         r"per_device_train_batch_size 3 x 8 processes = 24 completions per micro-step does not divide the paper's "
         r"mini-batch of 256 completions \(prompts_per_update 32 x num_generations 8\): use a "
         r"per_device_train_batch_size that divides 32: one of \[1, 2, 4, 8, 16, 32\]"),
        ([], 3, r"3 processes = 6 completions .* launch on a number of processes that divides 256"),
        (["--gradient_accumulation_steps", "4"], 8,
         r"gradient_accumulation_steps 4 x per_device_train_batch_size 2 x 8 processes = 64 completions per optimizer "
         r"update, but the paper's mini-batch is 256 .*pass --gradient_accumulation_steps 16"),
        (["--steps_per_generation", "64"], 8,
         r"respo_updates_per_rollout=8 means steps_per_generation = 8 x gradient_accumulation_steps \(16\) = 128, "
         r"but steps_per_generation=64 was also set"),
        (["--num_iterations", "4"], 8, r"num_iterations must be 1, got 4"),
        (["--generation_batch_size", "512"], 8,
         r"respo_updates_per_rollout=8 and generation_batch_size=512 both size the rollout batch: set only one"),
        (["--algorithm", "gspo", "--loss_type", "dapo"], 8,
         r"--algorithm gspo sets loss_type='grpo' but the command line also sets loss_type='dapo'"),
        (["--prompts_per_update", "3"], 8, r"8 processes = 16 completions per micro-step does not divide the paper's "
         r"mini-batch of 24 completions \(prompts_per_update 3 x num_generations 8\).* divides 3: one of \[1, 3\]"),
    ],
)  # fmt: skip
def test_overrides_that_break_the_papers_arithmetic_fail_at_parse_time(recipe, extra, processes, message):
    """Before any model, tokenizer or dataset is touched: parse_args is the first thing the recipe runs."""
    with pytest.raises(ValueError, match=message):
        paper_args(recipe, "paper-qwen3-1.7b-base", *extra, processes=processes)


def test_the_staleness_has_one_name_from_preset_to_trainer(recipe, capsys):
    """The recipe's old flag --updates_per_rollout was a second name of ReSPOConfig's respo_updates_per_rollout: it is
    refused in one line naming the field; the field sets TRL's steps_per_generation once, in ReSPOConfig."""
    script, training, _ = paper_args(recipe, "paper-qwen3-1.7b-base", "--respo_updates_per_rollout", "32")
    assert training.respo_updates_per_rollout == 32 and training.steps_per_generation == 32 * 16
    assert training.output_dir.endswith("-respo-n32-seed0") and not hasattr(script, "updates_per_rollout")
    with pytest.raises(SystemExit) as exit_info:
        recipe.cli(["--preset", "paper-qwen3-1.7b-base", "--updates_per_rollout", "16", "--dry_run", "8"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip() == ("error: --updates_per_rollout was renamed --respo_updates_per_rollout "
                                                "(ReSPOConfig's field, the one name of the paper's staleness N from "
                                                "preset to trainer; the old name is refused since respo_trl 0.4)")  # fmt: skip


def test_consistent_explicit_overrides_are_accepted(recipe):
    _, training, _ = paper_args(
        recipe, "paper-qwen3-1.7b-base", "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "8",
        "--respo_updates_per_rollout", "16", "--steps_per_generation", "128", processes=8,
    )  # fmt: skip
    assert (training.gradient_accumulation_steps, training.steps_per_generation) == (8, 128)
    _, training, _ = paper_args(recipe, "paper-qwen3-1.7b-base", "--per_device_train_batch_size", "4", processes=8)
    assert training.gradient_accumulation_steps == 8  # derived: 4 x 8 x 8 = 256


@pytest.mark.parametrize(
    ("algorithm", "fields"),
    [
        ("respo", {"loss_type": "respo", "importance_sampling_level": "token"}),
        ("grpo", {"loss_type": "dapo", "importance_sampling_level": "token", "epsilon": 0.2, "epsilon_high": 0.2}),
        ("gspo", {"loss_type": "grpo", "importance_sampling_level": "sequence", "epsilon": 3e-4, "epsilon_high": 4e-4}),
        ("vespo", {"loss_type": "vespo", "importance_sampling_level": "token"}),
    ],
)
def test_one_flag_switches_to_each_baseline_and_nothing_else(recipe, algorithm, fields):
    _, reference, _ = paper_args(recipe, "paper-qwen3-1.7b-base")
    _, training, _ = paper_args(recipe, "paper-qwen3-1.7b-base", "--algorithm", algorithm)
    for key, value in fields.items():
        assert getattr(training, key) == value, key
    assert training.output_dir == f"outputs/paper-qwen3-1.7b-base-{algorithm}-n8-seed0"
    from trl import GRPOConfig

    defaults = GRPOConfig(output_dir="x", use_cpu=True)
    for key in ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"):
        assert getattr(training, key) == getattr(defaults, key)  # VESPO at TRL's own defaults
    changed = {
        f.name for f in dataclasses.fields(reference)
        if f.name != "output_dir" and getattr(reference, f.name) != getattr(training, f.name)
    }  # fmt: skip
    assert changed <= set(fields), changed


def test_soft_overlong_penalty_is_zero_to_4096_then_linear_to_minus_one_at_8192(recipe):
    script, training, _ = paper_args(recipe, "paper-qwen3-30b-a3b-base")
    penalty = recipe.build_reward("soft_overlong", script, training)
    lengths = [1, 4096, 4097, 5120, 6144, 8191, 8192]
    assert penalty([[0] * n for n in lengths]) == pytest.approx([0, 0, -1 / 4096, -0.25, -0.5, -4095 / 4096, -1])
    script.soft_overlong_cache = 0
    with pytest.raises(ValueError, match="soft_overlong_cache"):
        recipe.build_reward("soft_overlong", script, training)


def test_dapo_accuracy_reward_is_plus_minus_one_on_the_training_grade():
    from respo_trl.grading import dapo_accuracy_reward, gold_solution, grade

    texts = ["\\boxed{34}", "\\boxed{35}", "Answer: 34", "\\boxed{34.0}", ""]
    completions = [[{"role": "assistant", "content": text}] for text in texts]
    rewards = dapo_accuracy_reward(completions, ["34"] * 5)
    assert rewards == [1.0, -1.0, -1.0, 1.0, -1.0]
    assert rewards == [2 * g.reward - 1 for g in grade(texts, [gold_solution("34")] * 5)]
    assert dapo_accuracy_reward([[{"content": "\\boxed{1}"}]], [""]) == [None]  # unparseable gold: skipped


DAPO_ROW = (
    "Solve the following math problem step by step. The last line of your response should be of the form Answer: "
    "$Answer (without quotes) where $Answer is the answer to the problem.\n\n{problem}\n\nRemember to put your "
    'answer on its own line after "Answer:".'
)


def test_paper_data_preparation_strips_the_dapo_instruction_and_drops_long_prompts(recipe, tmp_path, tokenizer):
    data = tmp_path / "dapo.jsonl"
    problems = [f"What is {i}+{i}?" for i in range(6)] + ["x" * 200]
    data.write_text("".join(json.dumps({"prompt": DAPO_ROW.format(problem=p), "solution": "1"}) + "\n" for p in problems))
    script, _, _ = paper_args(recipe, "paper-qwen3-1.7b-base", "--dataset_name", str(data))
    train, heldout = recipe.build_datasets(script)
    assert heldout is None and len(train) == 7
    assert train[0]["prompt"] == [
        {"role": "user", "content": "What is 0+0? Please reason step by step, and put your final answer within \\boxed{}."}
    ]
    kept, dropped = recipe.drop_long_prompts(train, tokenizer, max_tokens=150)  # the character tokenizer: 1 token/char
    assert dropped == 1 and len(kept) == 6 and all("xxx" not in row["prompt"][0]["content"] for row in kept)


def test_builtin_task_prompts_take_the_template_and_the_system_turn(recipe):
    """The built-in task in a pretrained chat model's format (the smollm2 preset); catches the template ignored."""
    from respo_trl.recipe import RecipeArguments

    plain = recipe.build_datasets(RecipeArguments(train_size=20, heldout_size=5))
    worded = recipe.build_datasets(RecipeArguments(train_size=20, heldout_size=5, system_prompt="Be brief.",
                                                   prompt_template="Calculate {problem} as \\boxed{result}."))
    for (plain_rows, worded_rows) in zip(plain, worded):
        problem = plain_rows[0]["prompt"][0]["content"]  # the default template is the bare expression
        assert worded_rows[0]["prompt"] == [{"role": "system", "content": "Be brief."},
                                            {"role": "user", "content": f"Calculate {problem} as \\boxed{{result}}."}]
        assert worded_rows["solution"] == plain_rows["solution"]


def test_paper_preset_trains_end_to_end_on_the_tiny_model(recipe, tmp_path, tiny_model_dir):
    """The paper path on local files: DAPO-formatted prompts, long prompts dropped, +1/-1 reward plus the soft overlong
    penalty, N = 2 updates per rollout batch of 2 prompts x 4 (each sample once: staleness 0, 1, 0, 1)."""
    data = tmp_path / "dapo.jsonl"
    rows = [{"prompt": DAPO_ROW.format(problem=f"{i}+{i % 3}"), "solution": str(i + i % 3)} for i in range(16)]
    rows += [{"prompt": DAPO_ROW.format(problem="9" * 400), "solution": "9"}] * 2
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    args = recipe.parse_args(
        ["--preset", "paper-qwen3-1.7b-base", "--model_name_or_path", tiny_model_dir, "--dataset_name", str(data),
         "--use_vllm", "false", "--use_cpu", "true", "--bf16", "false", "--activation_checkpointing", "false",
         "--prompts_per_update", "2", "--num_generations", "4", "--per_device_train_batch_size", "4",
         "--respo_updates_per_rollout", "2", "--max_steps", "4", "--max_completion_length", "8",
         "--max_prompt_length", "300", "--reward_funcs", "dapo_accuracy", "soft_overlong",
         "--reward_weights", "1.0", "1.0", "--soft_overlong_cache", "4", "--save_strategy", "no",
         "--output_dir", str(tmp_path / "paper")]
    )  # fmt: skip
    script, training, _ = args
    assert (training.gradient_accumulation_steps, training.steps_per_generation) == (2, 4)
    report = recipe.main(*args)
    assert report["data"] == {"train_rows": 16, "max_prompt_length": 300, "dropped_long_prompts": 2}
    batch = report["training"]["batch"]
    assert (batch["updates_per_rollout"], batch["prompts_per_generation"], batch["rollout_batches"]) == (2, 4, 2)
    history = json.loads((tmp_path / "paper" / "trainer_state.json").read_text())["log_history"]
    assert [h["reuse/staleness_max"] for h in history if "reuse/staleness_max" in h] == [0, 1, 0, 1]
    accuracy = [h["rewards/dapo_accuracy_reward/mean"] for h in history if "rewards/dapo_accuracy_reward/mean" in h]
    penalty = [h[key] for h in history if (key := "rewards/soft_overlong_punishment_reward/mean") in h]
    assert accuracy and all(-1.0 <= a <= 1.0 for a in accuracy)
    assert penalty and all(-1.0 <= p <= 0.0 for p in penalty)


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
    with pytest.raises(RecipeError, match="cannot resolve model 'Qwen/Qwen3-0.7B'.*Qwen/Qwen3-0.6B") as error:
        recipe.main(*args)
    assert "\n" not in str(error.value)  # one line, not the Hub client's traceback text


def test_dataset_without_the_answer_column_fails_with_the_columns(recipe, tmp_path, tiny_model_dir):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"problem": f"{i}+1", "final": str(i + 1)}) + "\n" for i in range(8)))
    args = recipe.parse_args(
        ["--model_name_or_path", tiny_model_dir, "--dataset_name", str(data), "--prompt_column", "problem",
         "--eval_mode", "none", "--use_cpu", "true", "--output_dir", str(tmp_path / "o")]
    )  # fmt: skip
    with pytest.raises(RecipeError, match=r"no column 'solution' \(set --answer_column\); its columns: \['problem', 'final'\]"):
        recipe.main(*args)
    args = recipe.parse_args(
        ["--model_name_or_path", tiny_model_dir, "--dataset_name", str(data), "--eval_mode", "none", "--use_cpu",
         "true", "--output_dir", str(tmp_path / "o")]
    )  # fmt: skip
    with pytest.raises(RecipeError, match=r"no column 'prompt' \(set --prompt_column\) and no column 'solution'"):
        recipe.main(*args)  # both missing columns in one message


def test_a_raising_reward_fails_before_the_warm_start(recipe, tmp_path, monkeypatch):
    import respo_trl.recipe.warmstart

    def forbidden(*args, **kwargs):
        raise AssertionError("the warm start ran before the reward functions were checked")

    monkeypatch.setattr(respo_trl.recipe.warmstart, "supervised_warm_start", forbidden)
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
    assert report["training"]["global_step"] == 4 and report["training"]["num_iterations"] == 4
    assert report["training"]["generated_tokens"] > 0
    reuse = report["training"]["reuse"]  # one batch served its 4 passes
    assert (reuse["batches"], reuse["refreshes"], reuse["passes_per_batch"]) == (1, 0, 4.0)
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
    best = report["heldout"]["best"]  # the best in-training point, measured on the whole held-out set too
    assert best["step"] in (2, 4)
    if not best["is_final"]:
        assert best["accuracy"] is not None and best["n"] == 16 and (out / "checkpoint-best-heldout" / "model.safetensors").is_file()
    assert str(out / "training_curves.png") in report["plots"]
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
    assert resumed["resumed_from"].endswith("checkpoint-2")
    # the first run's starting accuracy and its curve up to the checkpoint survive the resume (heldout_curve.json)
    assert resumed["heldout"]["before"] == report["heldout"]["before"]
    assert [p["step"] for p in resumed["curve"]] == [0, 2, 4]
    assert resumed["warm_start"]["steps"] == 0 and resumed["training"]["global_step"] == 4
    assert resumed["training"]["generated_tokens"] == report["training"]["generated_tokens"]
    assert resumed["training"]["reuse"] == report["training"]["reuse"]  # the buffer's counters come back with it
    # `--resume_from_checkpoint true` picks the latest checkpoint (step 4) and continues to a new max_steps: step 5
    # samples a fresh generation batch (every R=4 steps), step 6 reuses it.
    latest = run_recipe(
        recipe, tmp_path, "--max_steps", "6", "--save_strategy", "no", "--resume_from_checkpoint", "true"
    )
    assert latest["resumed_from"] == "True" and latest["training"]["global_step"] == 6
    assert latest["training"]["generated_tokens"] > report["training"]["generated_tokens"]
    assert (latest["training"]["reuse"]["batches"], latest["training"]["reuse"]["passes_per_batch"]) == (2, 3.0)
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    assert [h["reuse/staleness_max"] for h in history if "reuse/staleness_max" in h][-2:] == [0, 1]


def test_a_token_budget_stops_where_a_batch_ends_and_the_curve_follows_tokens(recipe, tmp_path, capsys):
    """``--max_generated_tokens``: the run stops at the first cycle end past the budget (under R = 2 an even step;
    the batch before the last had not reached it), and ``--heldout_eval_tokens`` puts one point in each interval.
    report.json and the summary table give the batches sampled, refreshes and passes per batch (issue 52, item 8)."""
    report = run_recipe(recipe, tmp_path, "--num_iterations", "2", "--max_steps", "100", "--heldout_eval_steps", "0",
                        "--heldout_eval_tokens", "150", "--max_generated_tokens", "400", "--save_strategy", "no")  # fmt: skip
    training, curve = report["training"], report["curve"]
    assert training["global_step"] % 2 == 0 and training["global_step"] < 100
    batches = training["global_step"] // 2
    assert training["reuse"] == {"adaptive_reuse": None, "adaptive_threshold": None, "batches": batches,
                                 "refreshes": 0, "passes_per_batch": 2.0}  # fmt: skip
    table = capsys.readouterr().out
    assert "| rollout batches sampled " in table and "| passes per batch " in table
    row = next(line for line in table.splitlines() if line.startswith("| passes per batch "))
    assert row.split("|")[2].strip() == "2.00"
    assert training["generated_tokens"] >= 400
    per_batch = training["generated_tokens"] / (training["global_step"] // 2)
    assert training["generated_tokens"] - per_batch < 400  # not a cycle later than needed (batches vary a little)
    inner = [p["generated_tokens"] // 150 for p in curve[1:-1]]  # between the start and the final measurement
    assert inner and inner == sorted(set(inner)) and all(k >= 1 for k in inner)


def test_the_summary_table_shows_refreshes_and_passes_per_batch_only_under_reuse(capsys):
    """Issue 52, item 8: under epochs the table has the batches sampled, the refreshes (with the adaptive stop's
    signal and threshold) and the passes per batch; without reuse it has none of these rows."""
    from respo_trl.recipe.heldout import print_summary

    def table(num_iterations, reuse):
        report = {
            "model": {"name": "tiny", "parameters": 10_000}, "output_dir": "out",
            "heldout": {"dataset": "arithmetic", "n": 16, "mode": "greedy", "before": 0.1, "after": 0.5},
            "warm_start": {"demonstration_accuracy": 0.9}, "time_s": {"warm_start": 1.0, "train": 2.0, "total": 3.0},
            "training": {"global_step": 12, "generated_tokens": 1000, "num_iterations": num_iterations,
                         "mean_grad_norm_vs_fresh": {}, "reuse": reuse},
        }  # fmt: skip
        print_summary(report)
        return {line.split("|")[1].strip(): line.split("|")[2].strip()
                for line in capsys.readouterr().out.splitlines() if line.startswith("| ")}  # fmt: skip

    rows = table(4, {"adaptive_reuse": "kl", "adaptive_threshold": 5e-4, "batches": 5, "refreshes": 3,
                     "passes_per_batch": 12 / 5})  # fmt: skip
    assert rows["rollout batches sampled"] == "5"
    assert rows["refreshes (sampled before a cycle ended)"] == "3 (kl 0.0005)"
    assert rows["passes per batch"] == "2.40"
    rows = table(1, None)
    assert not {"rollout batches sampled", "passes per batch"} & set(rows) and rows["optimizer steps"] == "12"


def test_an_output_dir_that_is_a_file_fails_before_the_warm_start(recipe, tmp_path):
    blocker = tmp_path / "taken"
    blocker.write_text("not a directory")
    with pytest.raises(ValueError, match="exists and is a file"):
        recipe.validate_args(*recipe.parse_args(["--output_dir", str(blocker)]))
    with pytest.raises(ValueError, match="cannot be created"):
        recipe.validate_args(*recipe.parse_args(["--output_dir", str(blocker / "run")]))
    fresh = tmp_path / "new" / "run"
    recipe.validate_args(*recipe.parse_args(["--output_dir", str(fresh)]))
    assert not fresh.exists()  # checking creates nothing


def test_the_tiny_recipe_on_cpu_uses_one_torch_thread(recipe, monkeypatch):
    import logging

    import torch

    threads = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    try:
        torch.set_num_threads(2)
        recipe.pick_cpu_threads(None, tiny=True, logger=logging.getLogger("test"))
        assert torch.get_num_threads() == 1
        torch.set_num_threads(2)
        monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the user's choice wins
        recipe.pick_cpu_threads(None, tiny=True, logger=logging.getLogger("test"))
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)


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
@pytest.mark.parametrize("config", ["zero2.yaml", "zero3.yaml"])
def test_two_process_deepspeed_on_cpu(tmp_path, config):
    """The launch configs users run, trained for two steps on two CPU processes (the README's test command installs
    deepspeed, so CI runs them; a machine without it skips with the install line)."""
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed (pip install --no-build-isolation deepspeed, see docs/recipes.md)")
    report, _ = launch(tmp_path, "--config_file", str(ACCELERATE_CONFIGS / config))
    assert report["distributed_type"] == "DEEPSPEED"


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--learning_rte", "1e-4"], "unknown option --learning_rte (did you mean --learning_rate?)"),
        (["--respo_beta_pos", "2"], "respo_beta_pos must be a finite number in [0, 1], got 2.0"),
        (["--model_name_or_path", "./no-such-model"], "--model_name_or_path './no-such-model': no such directory"),
        (["--preset", "tiny_cpu"], "preset 'tiny_cpu' was renamed 'tiny-cpu'"),
        (["--resume_from_checkpoint", "true"], "holds no complete checkpoint-N folder"),
        (["--resume_from_checkpoint", "true", "--max_steps", "3"], "at step 3, already at or past max_steps 3"),
        (["--seed"], "argument --seed: expected one argument; see --help"),  # argparse's own: no 270-line usage
        (["--seed", "x"], "argument --seed: invalid int value: 'x'; see --help"),
        (["--heldout_eval_tokens", "1000"], "heldout_eval_steps and heldout_eval_tokens both schedule"),
        (["--max_generated_tokens", "0"], "max_generated_tokens must be a positive number of tokens or unset"),
        (["--respo_adaptive_reuse", "kl"], "respo_adaptive_reuse='kl' needs respo_adaptive_threshold"),
    ],
)
def test_bad_input_ends_in_one_line_and_exit_status_2(recipe, tmp_path, capsys, argv, message):
    """Each case of issue 18 item 6: one line naming what to change, before any model loads, and no output_dir left."""
    out = tmp_path / "run"
    if "true" in argv:
        out.mkdir()  # an existing but empty output_dir: nothing to resume (0.2 said "interrupted")
    if "--max_steps" in argv:  # a run that finished: resuming it would train one step past max_steps
        (out / "checkpoint-3").mkdir()
        (out / "checkpoint-3" / "trainer_state.json").write_text(json.dumps({"global_step": 3}))
    with pytest.raises(SystemExit) as exit_info:
        recipe.cli([*argv, "--output_dir", str(out)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if line.startswith("error: ")]
    assert len(errors) == 1 and err[-1] == errors[0] and message in errors[0], err
    assert "Traceback" not in "\n".join(err)
    assert out.exists() == ("true" in argv)  # nothing created by a failed start


def test_missing_columns_stop_before_the_model_loads_and_leave_no_output_dir(recipe, tmp_path, capsys, tiny_model_dir):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"question": f"{i}+1", "final": str(i + 1)}) + "\n" for i in range(4)))
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        recipe.cli(["--model_name_or_path", tiny_model_dir, "--dataset_name", str(data), "--eval_mode", "none",
                    "--use_cpu", "true", "--output_dir", str(out)])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and err[-1].startswith("error: ") and "Traceback" not in "\n".join(err)
    assert "no column 'prompt' (set --prompt_column) and no column 'solution' (set --answer_column)" in err[-1]
    assert not out.exists()


def test_ctrl_c_says_where_the_run_stands_and_how_to_resume(recipe, tmp_path, capsys, monkeypatch):
    import respo_trl.trainer

    calls = {"n": 0}
    real = respo_trl.trainer.ReSPOTrainer.training_step

    def interrupt_at_step_3(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(self, *args, **kwargs)

    monkeypatch.setattr(respo_trl.trainer.ReSPOTrainer, "training_step", interrupt_at_step_3)
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        recipe.cli([*SMALL, "--max_steps", "4", "--save_steps", "2", "--eval_mode", "none", "--heldout_eval_steps",
                    "0", "--output_dir", str(out)])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 130 and err[-1].startswith("error: ") and "Traceback" not in "\n".join(err)
    assert "interrupted at step 2 of 4" in err[-1] and "checkpoint-2: resume with --resume_from_checkpoint true" in err[-1]
    assert (out / "checkpoint-2").is_dir()  # kept: it is what the resume needs


def test_the_script_itself_prints_one_line_without_a_traceback(tmp_path):
    result = subprocess.run([sys.executable, str(RECIPE), "--learning_rte", "1e-4"], cwd=ROOT, capture_output=True,
                            text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == "error: unknown option --learning_rte (did you mean --learning_rate?); see --help"


def test_long_response_presets_compute_the_lm_head_in_fp32(recipe):
    """ReSPO's log W sums token log-ratios over the response: bf16 logits add rounding noise that grows with length
    (docs/benchmarks.md, section 6), so every preset with responses of 4K tokens or more casts the lm_head to fp32."""
    import yaml

    long_presets = []
    for preset in recipe.available_presets():
        config = yaml.safe_load((ROOT / "respo_trl" / "recipe" / "presets" / f"{preset}.yaml").read_text())
        if config.get("max_completion_length", 0) >= 4096:
            long_presets.append(preset)
            assert config.get("cast_lm_head_to_fp32") is True, preset
    assert len(long_presets) == 8
