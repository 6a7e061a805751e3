"""ReSPOConfig: defaults, the reuse alias, upgrading a GRPOConfig, and a clear error for every bad value."""

import pytest

from conftest import CPU_ARGS


@pytest.fixture(scope="module")
def configs():
    from trl import GRPOConfig

    from respo_trl import ReSPOConfig

    return ReSPOConfig, GRPOConfig


def build(configs, tmp_path, **overrides):
    return configs[0](output_dir=str(tmp_path), **{**CPU_ARGS, **overrides})


def test_defaults(configs, tmp_path):
    args = build(configs, tmp_path)
    assert isinstance(args, configs[1])
    assert args.loss_type == "respo"
    assert (args.respo_alpha_pos, args.respo_lambda_pos, args.respo_alpha_neg, args.respo_lambda_neg) == (0.5, 0.5, 2.0, 2.0)
    assert args.respo_reuse == args.num_iterations == 1


def test_every_respo_field_has_help_text(configs):
    import dataclasses

    for f in dataclasses.fields(configs[0]):
        if f.name.startswith("respo_"):
            assert len(f.metadata.get("help", "")) > 20, f.name
            assert f.name in configs[0].__doc__, f"{f.name} is not documented in the class docstring"


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("respo_alpha_pos", -0.1, "respo_alpha_pos"),
        ("respo_lambda_pos", -1.0, "respo_lambda_pos"),
        ("respo_alpha_neg", float("nan"), "respo_alpha_neg"),
        ("respo_lambda_neg", float("inf"), "respo_lambda_neg"),
        ("respo_norm", "median", "respo_norm"),
        ("respo_rho_min", 0.0, "respo_rho_min"),
        ("respo_rho_min", 1.5, "respo_rho_min"),
        ("respo_reuse", 0, "respo_reuse"),
        ("respo_min_ess", 0.0, "respo_min_ess"),
        ("respo_min_ess", 2.0, "respo_min_ess"),
        ("respo_buffer_device", "gpu", "respo_buffer_device"),
        ("importance_sampling_level", "sequence", "importance_sampling_level"),
    ],
)
def test_invalid_values_raise_naming_the_field(configs, tmp_path, field, value, match):
    with pytest.raises(ValueError, match=match):
        build(configs, tmp_path, **{field: value})


def test_incompatible_vllm_correction_mode_raises(configs, tmp_path):
    with pytest.raises(ValueError, match="vllm_importance_sampling_mode"):
        build(configs, tmp_path, use_vllm=True, vllm_importance_sampling_mode="sequence_mask")
    # a token mode, or the correction switched off, is fine (no vLLM needed to build the config)
    build(configs, tmp_path, use_vllm=True, vllm_importance_sampling_mode="token_mask")
    build(configs, tmp_path, use_vllm=True, vllm_importance_sampling_correction=False, vllm_importance_sampling_mode="sequence_mask")
    # other loss types keep TRL's own rules
    build(configs, tmp_path, use_vllm=True, loss_type="dapo", vllm_importance_sampling_mode="sequence_mask")


def test_reuse_is_num_iterations(configs, tmp_path):
    assert build(configs, tmp_path, respo_reuse=4).num_iterations == 4
    assert build(configs, tmp_path, num_iterations=3).respo_reuse == 3
    assert build(configs, tmp_path, num_iterations=2, respo_reuse=2).num_iterations == 2
    with pytest.raises(ValueError, match="respo_reuse=4 and num_iterations=2"):
        build(configs, tmp_path, num_iterations=2, respo_reuse=4)


def test_upgrade_plain_grpo_config_keeps_its_settings(configs, tmp_path):
    ReSPOConfig, GRPOConfig = configs
    plain = GRPOConfig(output_dir=str(tmp_path), **{**CPU_ARGS, "num_iterations": 3, "beta": 0.04, "epsilon_high": 0.28})
    upgraded = ReSPOConfig.from_grpo_config(plain)
    assert isinstance(upgraded, ReSPOConfig)
    assert upgraded.loss_type == "respo" and upgraded.respo_reuse == 3 and upgraded.num_iterations == 3
    assert upgraded.beta == 0.04 and upgraded.epsilon_high == 0.28
    assert upgraded.generation_batch_size == plain.generation_batch_size
    assert upgraded.respo_norm == "sqrt"
    assert plain.loss_type == "dapo"  # the user's object is not mutated


def test_config_parses_from_command_line(configs):
    from trl import TrlParser

    (args,) = TrlParser((configs[0],)).parse_args_into_dataclasses(
        ["--output_dir", "x", "--use_cpu", "--bf16", "False", "--respo_norm", "ess", "--respo_rho_min", "0.3", "--respo_reuse", "4"]
    )
    assert args.respo_norm == "ess" and args.respo_rho_min == 0.3 and args.num_iterations == 4
