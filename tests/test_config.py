"""ReSPOConfig: defaults, renamed fields refused with the new name, upgrading a GRPOConfig, and a clear error for
every bad value."""

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
    fields = ("alpha_pos", "beta_pos", "lambda_pos", "alpha_neg", "beta_neg", "lambda_neg")
    assert tuple(getattr(args, f"respo_{f}") for f in fields) == (2.0, 0.5, 2.0, 1.0, 0.5, 2.0)  # the paper's
    assert args.num_iterations == 1 and not hasattr(args, "respo_reuse")  # one name for epochs: TRL's
    assert args.kernel_constants == {"alpha_pos": 2.0, "beta_pos": 0.5, "lam_pos": 2.0, "alpha_neg": 1.0,
                                     "beta_neg": 0.5, "lam_neg": 2.0}
    from respo_trl.kernels import CONSTANT_KEYS  # the one map, shared with the verl plugin's config keys

    assert set(CONSTANT_KEYS) <= set(configs[0].__dataclass_fields__) and "respo_lambda_neg" in CONSTANT_KEYS
    # baselines keep TRL's own defaults (the sampler-correction mode among them)
    trl_default = configs[1].__dataclass_fields__["vllm_importance_sampling_mode"].default
    assert args.vllm_importance_sampling_mode == trl_default == "sequence_mask"


def test_trust_mask_auto_is_on_exactly_when_samples_are_reused(configs, tmp_path):
    assert not build(configs, tmp_path).respo_trust_mask_active
    assert not build(configs, tmp_path, respo_updates_per_rollout=8).respo_trust_mask_active  # paper-pure: N, R = 1
    assert build(configs, tmp_path, num_iterations=2).respo_trust_mask_active
    assert not build(configs, tmp_path, num_iterations=2, respo_trust_mask="none").respo_trust_mask_active
    assert build(configs, tmp_path, respo_trust_mask="directional").respo_trust_mask_active


def test_reshuffle_default_is_respo_only(configs, tmp_path):
    assert build(configs, tmp_path).respo_reshuffle_active
    assert not build(configs, tmp_path, loss_type="dapo").respo_reshuffle_active  # TRL replays its mini-batches
    assert build(configs, tmp_path, loss_type="dapo", respo_reshuffle=True).respo_reshuffle_active


def test_updates_per_rollout_is_the_papers_n(configs, tmp_path):
    args = build(configs, tmp_path, respo_updates_per_rollout=4, gradient_accumulation_steps=2)
    assert args.steps_per_generation == 8 and args.num_iterations == 1
    assert args.generation_batch_size == 8 * args.per_device_train_batch_size
    with pytest.raises(ValueError, match="steps_per_generation"):
        build(configs, tmp_path, respo_updates_per_rollout=4, steps_per_generation=3)
    with pytest.raises(ValueError, match="both size the rollout batch"):  # ours, before TRL's less specific error
        build(configs, tmp_path, respo_updates_per_rollout=4, generation_batch_size=64)


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
        ("respo_alpha_pos", 0.0, "respo_alpha_pos"),
        ("respo_beta_pos", 1.2, "respo_beta_pos"),
        ("respo_beta_neg", -0.2, "respo_beta_neg"),
        ("respo_lambda_pos", -1.0, "respo_lambda_pos"),
        ("respo_alpha_neg", float("nan"), "respo_alpha_neg"),
        ("respo_lambda_neg", float("inf"), "respo_lambda_neg"),
        ("num_iterations", 0, "num_iterations"),
        ("respo_min_ess", 0.0, "respo_min_ess"),
        ("respo_min_ess", 2.0, "respo_min_ess"),
        ("respo_min_ess", 1.01, "respo_min_ess"),
        ("respo_buffer_device", "gpu", "respo_buffer_device"),
        ("respo_trust_mask", "symmetric", "respo_trust_mask"),
        ("respo_updates_per_rollout", 0, "respo_updates_per_rollout"),
        ("respo_reshuffle", "yes", "respo_reshuffle"),
        ("respo_trust_epsilon", 0.0, "respo_trust_epsilon"),
        ("respo_trust_epsilon", 1.0, "respo_trust_epsilon"),
        ("respo_trust_epsilon_high", -0.1, "respo_trust_epsilon_high"),
        ("respo_neg_branch", "gamma", "respo_neg_branch"),
        ("respo_pos_branch", None, "respo_pos_branch"),
        ("respo_whole_groups", "yes", "respo_whole_groups"),
    ],
)
def test_invalid_values_raise_naming_the_field(configs, tmp_path, field, value, match):
    with pytest.raises(ValueError, match=match):
        build(configs, tmp_path, **{field: value})


def test_every_config_trl_accepts_is_accepted(configs, tmp_path):
    """TRL's default vLLM mode (sequence_mask), every other mode, and GSPO-style configs build (no vLLM needed)."""
    from respo_trl.config import SAMPLER_MODES, respo_notes

    for mode in SAMPLER_MODES:
        args = build(configs, tmp_path, use_vllm=True, vllm_importance_sampling_mode=mode)
        (note,) = respo_notes(args)
        assert mode in note and "multiplied by the ratio again" in note
    gspo = build(configs, tmp_path, importance_sampling_level="sequence")
    (note,) = respo_notes(gspo)
    assert "raw sequence ratio W" in note and "loss_type='grpo' with importance_sampling_level='sequence'" in note
    assert respo_notes(build(configs, tmp_path)) == []
    assert respo_notes(build(configs, tmp_path, loss_type="dapo", use_vllm=True)) == []


def test_boundary_values_are_accepted(configs, tmp_path):
    args = build(configs, tmp_path, respo_min_ess=1.0, respo_beta_pos=1.0, respo_beta_neg=0.0, respo_lambda_pos=0.0)
    assert args.respo_min_ess == 1.0 and args.respo_beta_pos == 1.0 and args.respo_lambda_pos == 0.0


def test_respo_errors_come_before_trls(configs, tmp_path):
    """On a CPU, GRPOConfig's default bf16 fails; a bad ReSPO value must still be the error the user sees."""
    with pytest.raises(ValueError, match="respo_beta_pos"):
        configs[0](output_dir=str(tmp_path), respo_beta_pos=2.0)  # bf16 defaults on: TRL would fail too


def test_renamed_fields_are_refused_naming_the_new_one(configs, tmp_path):
    """Epochs have one name, TRL's num_iterations: a config that still says respo_reuse (or the recipe's old
    updates_per_rollout) is refused in one line naming the field to set, not as an unexpected keyword argument, in
    the constructor and in from_grpo_config; a misspelt field stays Python's own TypeError."""
    ReSPOConfig, GRPOConfig = configs
    expected = r"^respo_reuse=4 was renamed num_iterations \(TRL's name .*\): set num_iterations=4 instead$"
    with pytest.raises(ValueError, match=expected):
        build(configs, tmp_path, respo_reuse=4)
    with pytest.raises(ValueError, match="updates_per_rollout=8 was renamed respo_updates_per_rollout"):
        build(configs, tmp_path, updates_per_rollout=8)
    plain = GRPOConfig(output_dir=str(tmp_path), **CPU_ARGS)
    with pytest.raises(ValueError, match=expected):
        ReSPOConfig.from_grpo_config(plain, respo_reuse=4)
    with pytest.raises(TypeError, match="respo_reuze"):
        build(configs, tmp_path, respo_reuze=4)


def test_every_renamed_option_points_to_a_field_that_exists(configs):
    """respo_trl._compat's tables name live replacements, and no old name is still accepted under its own name."""
    from respo_trl._compat import RENAMED_OPTIONS, RENAMED_VERL_KEYS
    from respo_trl.kernels import CONSTANT_KEYS  # the verl plugin's config keys are ReSPOConfig's constant fields

    fields = set(configs[0].__dataclass_fields__)
    assert all(renamed.new in fields and old not in fields for old, renamed in RENAMED_OPTIONS.items())
    assert all(renamed.new in CONSTANT_KEYS and old not in fields for old, renamed in RENAMED_VERL_KEYS.items())


def test_upgrade_plain_grpo_config_keeps_its_settings(configs, tmp_path):
    ReSPOConfig, GRPOConfig = configs
    plain = GRPOConfig(output_dir=str(tmp_path), **{**CPU_ARGS, "num_iterations": 3, "beta": 0.04, "epsilon_high": 0.28})
    upgraded = ReSPOConfig.from_grpo_config(plain)
    assert isinstance(upgraded, ReSPOConfig)
    assert upgraded.loss_type == "respo" and upgraded.num_iterations == 3
    assert upgraded.beta == 0.04 and upgraded.epsilon_high == 0.28
    assert upgraded.generation_batch_size == plain.generation_batch_size
    assert upgraded.respo_alpha_pos == 2.0
    assert upgraded.respo_trust_mask_active  # num_iterations=3 reuses samples
    # TRL's default vLLM mode and GSPO-style settings are kept, not refused
    vllm = GRPOConfig(output_dir=str(tmp_path), **{**CPU_ARGS, "use_vllm": True, "importance_sampling_level": "sequence"})
    upgraded = ReSPOConfig.from_grpo_config(vllm)
    assert upgraded.vllm_importance_sampling_mode == "sequence_mask" and upgraded.importance_sampling_level == "sequence"
    assert plain.loss_type == "dapo"  # the user's object is not mutated


def test_config_parses_from_command_line(configs):
    from trl import TrlParser

    (args,) = TrlParser((configs[0],)).parse_args_into_dataclasses(
        ["--output_dir", "x", "--use_cpu", "--bf16", "False", "--respo_trust_mask", "directional", "--respo_min_ess", "0.3",
         "--num_iterations", "4"]
    )
    assert args.respo_trust_mask == "directional" and args.respo_min_ess == 0.3 and args.num_iterations == 4


def test_removed_normalisation_option_is_an_error_naming_it(configs, tmp_path):
    """respo_norm / respo_rho_min were removed (docs/benchmarks/ablation_lab.md): passing them fails loudly, by name."""
    from trl import TrlParser

    from respo_trl.config import describe_kernel

    with pytest.raises(TypeError, match="respo_norm"):
        build(configs, tmp_path, respo_norm="mean")
    with pytest.raises(ValueError, match="respo_rho_min"):
        TrlParser((configs[0],)).parse_args_into_dataclasses(
            ["--output_dir", "x", "--use_cpu", "--bf16", "False", "--respo_rho_min", "0.3"]
        )
    line = describe_kernel(build(configs, tmp_path))
    assert "raw sequence ratio W (the paper)" in line and "respo_norm" not in line


def test_gspo_style_epsilons_do_not_become_the_trust_masks_token_bounds(configs, tmp_path):
    """The 0.3 training bug: a GSPO-style GRPOConfig (sequence-level epsilon 3e-4 / 4e-4) upgraded to ReSPO with
    num_iterations=2 turned the trust mask on with those bounds on *token* ratios, zeroing 74-98% of the tokens of
    every reuse pass. The mask now uses TRL's token default there, says so, and prints its bounds."""
    from respo_trl.config import describe_kernel, respo_notes
    from respo_trl.kernels import LossParams

    ReSPOConfig, GRPOConfig = configs
    plain = GRPOConfig(output_dir=str(tmp_path), **{**CPU_ARGS, "loss_type": "grpo", "importance_sampling_level":
                       "sequence", "epsilon": 3e-4, "epsilon_high": 4e-4, "num_iterations": 2})  # fmt: skip
    upgraded = ReSPOConfig.from_grpo_config(plain)
    assert upgraded.respo_trust_mask_active
    assert LossParams.from_config(upgraded).trust_bounds() == (0.2, 0.2, None)
    assert "[1 - 0.2, 1 + 0.2]" in describe_kernel(upgraded)
    assert any("sequence-level epsilon 0.0003 / 0.0004" in note for note in respo_notes(upgraded))
    # token-level epsilons (and TRL's two-sided delta) are the mask's bounds; its own fields override them
    token = build(configs, tmp_path, num_iterations=2, epsilon_high=0.28, delta=1.5)
    assert LossParams.from_config(token).trust_bounds() == (0.2, 0.28, 1.5)
    assert "A < 0 above 1.5" in describe_kernel(token)
    own = build(configs, tmp_path, num_iterations=2, respo_trust_epsilon=0.1, importance_sampling_level="sequence")
    assert LossParams.from_config(own).trust_bounds() == (0.1, 0.1, None)
    assert not any("sequence-level epsilon" in note for note in respo_notes(own))


def test_whole_groups_need_micro_batches_of_whole_groups(configs, tmp_path):
    """One line naming both fields, at construction, before any model is loaded."""
    with pytest.raises(ValueError, match=r"per_device_train_batch_size \(6\).*num_generations \(4\)"):
        build(configs, tmp_path, respo_whole_groups=True, per_device_train_batch_size=6, num_generations=4)
    assert build(configs, tmp_path, respo_whole_groups=True, per_device_train_batch_size=8, num_generations=4)


def test_epochs_warn_once_outside_the_measured_safe_setting(configs, tmp_path):
    """Issue 40: ReSPO epochs were measured safe only at num_iterations <= 4 with learning_rate <= 3e-5 (tiny model,
    docs/benchmarks/reuse_lm.md 2.7.2); outside it the config says so in one line naming that setting, and only once."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # inside the setting, on-policy at any rate, and TRL's losses: no warning
        build(configs, tmp_path, num_iterations=4, learning_rate=3e-5)
        build(configs, tmp_path, num_iterations=1, learning_rate=1e-3)
        build(configs, tmp_path, loss_type="dapo", num_iterations=4, learning_rate=1e-4)
    for overrides in ({"num_iterations": 2, "learning_rate": 1e-4}, {"num_iterations": 8, "learning_rate": 1e-6}):
        with pytest.warns(UserWarning, match=r"is outside num_iterations <= 4 at learning_rate <= 3e-05: epochs were "
                                             r"measured safe for ReSPO at one point only"):  # fmt: skip
            build(configs, tmp_path, **overrides)
    ReSPOConfig, GRPOConfig = configs
    plain = GRPOConfig(output_dir=str(tmp_path), **{**CPU_ARGS, "num_iterations": 3, "learning_rate": 5e-5})
    with pytest.warns(UserWarning, match="num_iterations=3 at learning_rate=5e-05"):  # the upgrade path too
        ReSPOConfig.from_grpo_config(plain)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")  # Python's default filter: the same line warns once per process
        for _ in range(3):
            build(configs, tmp_path, num_iterations=2, learning_rate=2e-4)
    assert sum("measured safe" in str(w.message) for w in caught) == 1


def test_the_epochs_warning_names_what_adaptive_reuse_was_measured_to_do(configs, tmp_path):
    """Issue 52, item 8: with respo_adaptive_reuse on, the warning outside the measured-safe setting says what the
    option was measured to do (docs/benchmarks/adaptive_reuse.md 4.2): it saved at 3e-5 and was not safe at 1e-4, so
    it is not shown to make the setting safe. Without the option the warning does not mention it."""
    import warnings

    adaptive = {"respo_adaptive_reuse": "kl", "respo_adaptive_threshold": 5e-4, "max_steps": 8}
    with pytest.warns(UserWarning) as caught:
        build(configs, tmp_path, num_iterations=4, learning_rate=1e-4, **adaptive)
    message = " ".join(str(w.message) for w in caught if "measured safe" in str(w.message))
    assert "num_iterations=4 at learning_rate=0.0001 is outside" in message
    for measured in ("median 0.19 of num_iterations=1's generated tokens", "mean final 1.8 (dapo) and 2.5 points",
                     "lower ends -4.7 and -5.4 against the rule's -3", "is not shown to make this setting safe",
                     "docs/benchmarks/adaptive_reuse.md"):  # fmt: skip
        assert measured in message, measured
    assert message.index("is not shown to make this setting safe") < message.index("lower learning_rate")
    with pytest.warns(UserWarning) as caught:
        build(configs, tmp_path, num_iterations=4, learning_rate=1e-4)
    plain = " ".join(str(w.message) for w in caught if "measured safe" in str(w.message))
    assert plain and "respo_adaptive_reuse" not in plain
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # inside the measured-safe setting the option adds no warning
        build(configs, tmp_path, num_iterations=4, learning_rate=3e-5, **adaptive)
