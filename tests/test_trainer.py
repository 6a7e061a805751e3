"""End-to-end training through ReSPOTrainer on tiny Qwen3 models (CPU, a few steps each)."""

import itertools
import math
import re
from pathlib import Path

import pytest
import torch

DIAGNOSTIC_KEYS = [
    f"starvation/{name}/{sign}"
    for name in ("grad_throughput", "clip_grad_throughput", "starved_frac", "clip_starved_frac")
    for sign in ("pos", "neg")
] + [
    "offpolicy/log_weight/mean",
    "offpolicy/log_weight/std",
    "offpolicy/log_weight/min",
    "offpolicy/log_weight/max",
    "offpolicy/ess",
    "respo/phi_mean/pos",
    "respo/phi_mean/neg",
    "respo/nonfinite_seqs",
    "respo/trust_masked_frac",
    "starvation/low_weight_pos/share",
    "starvation/low_weight_pos/mass_share",
    "starvation/low_weight_pos/mass_ratio",
    *(f"starvation/low_weight_pos/{name}" for name in ("n", "n_low", "mass", "mass_low")),
    *(f"starvation/low_weight_pos/{kernel}_{name}" for kernel in ("respo", "vespo")
      for name in ("mass", "mass_low", "mass_share", "mass_ratio")),
    "offpolicy/kl",
    "starvation/pos_length_mean",
    "starvation/zero_coef_token_frac",
    "reuse/staleness_mean",
    "reuse/staleness_max",
    "reuse/generated_tokens",
    "reuse/generated_tokens_per_step",
    "reuse/refreshes",
]


# Logged only in some runs: a reuse pass (pass, grad-norm ratio), the ESS floor, MoE Routing Replay.
OCCASIONAL_KEYS = ["reuse/pass", "reuse/grad_norm_vs_fresh", "reuse/ess_before_pass", "reuse/kl_before_pass",
                   "reuse/policy_ess_before_pass", "routing/drift",
                   "routing/drift_tokens"]
OUR_PREFIXES = ("starvation", "offpolicy", "respo", "reuse", "routing")


def documented_metrics() -> set[str]:
    """Metric names in the first column of docs/diagnostics.md's tables, ``a/{b,c}`` expanded."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "diagnostics.md").read_text()
    names = set()
    for cell in re.findall(r"^\| ([^|]+) \|", text, flags=re.M):
        for name in re.findall(r"`([a-z_]+/[^`]+)`", cell):
            parts = [p.split(",") for p in re.split(r"[{}]", name)]  # "a/{b,c}" -> [["a/"], ["b", "c"], [""]]
            names |= {"".join(x) for x in itertools.product(*parts)}
    return names


def test_diagnostics_page_documents_exactly_what_is_logged():
    """Catches: a metric renamed, added or removed in the code and not on docs/diagnostics.md (or the reverse)."""
    assert documented_metrics() == set(DIAGNOSTIC_KEYS) | set(OCCASIONAL_KEYS)


def snapshot(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def changed(before, model):
    return [n for n, p in model.named_parameters() if p.requires_grad and not torch.equal(before[n], p.detach())]


def logged(trainer):
    train_logs = [h for h in trainer.state.log_history if "loss" in h]
    assert train_logs, "nothing was logged"
    return train_logs


def test_respo_trains_and_logs_every_diagnostic_on_every_step(make_trainer):
    trainer = make_trainer(num_iterations=2, max_steps=4)
    before = snapshot(trainer.model)
    trainer.train()
    assert changed(before, trainer.model)
    logs = logged(trainer)
    assert len(logs) == 4
    for key in DIAGNOSTIC_KEYS:
        assert all(key in log for log in logs), key
    ours = {key for log in logs for key in log if key.split("/")[0] in OUR_PREFIXES}
    assert ours <= set(DIAGNOSTIC_KEYS) | set(OCCASIONAL_KEYS), ours - set(DIAGNOSTIC_KEYS)
    assert "reuse/pass" in ours and "vespo/phi_seq_mean" not in logs[0]  # ReSPO's coefficient is respo/phi_mean
    for log in logs:
        assert math.isfinite(log["loss"])
    # Reuse bookkeeping: R=2 samples on steps 1 and 3 only, reuses on 2 and 4 (one optimizer step stale).
    assert [log["reuse/staleness_mean"] for log in logs] == [0, 1, 0, 1]
    per_step = [log["reuse/generated_tokens_per_step"] for log in logs]
    assert per_step[0] > 0 and per_step[2] > 0 and per_step[1] == per_step[3] == 0
    assert logs[-1]["reuse/generated_tokens"] == sum(per_step)
    # On the fresh pass every coefficient is 1; on the reused pass the weights moved.
    assert logs[0]["offpolicy/ess"] == pytest.approx(1.0) and logs[0]["offpolicy/log_weight/max"] == 0
    assert logs[1]["offpolicy/log_weight/std"] > 0
    # R=2 turns the directional trust mask on (auto): nothing masked on fresh passes, something on reuse passes
    assert logs[0]["respo/trust_masked_frac"] == 0 and logs[1]["respo/trust_masked_frac"] > 0
    assert logs[1]["starvation/zero_coef_token_frac"] >= logs[1]["respo/trust_masked_frac"]


def test_four_fold_reuse_samples_a_quarter_of_the_tokens(make_trainer):
    trainer = make_trainer(num_iterations=4, max_steps=8)
    trainer.train()
    logs = logged(trainer)
    sampled = [log["reuse/generated_tokens_per_step"] > 0 for log in logs]
    assert sampled == [True, False, False, False] * 2
    assert [log["reuse/staleness_max"] for log in logs] == [0, 1, 2, 3] * 2


def test_moe_model_trains_with_router_aux_loss(make_trainer):
    trainer = make_trainer(moe=True, num_iterations=2, max_steps=2)
    before = snapshot(trainer.model)
    trainer.train()
    assert changed(before, trainer.model)
    logs = logged(trainer)
    assert all("aux_loss" in log and math.isfinite(log["aux_loss"]) for log in logs)


def test_per_token_advantages_from_a_subclass_train(make_trainer):
    """TRL lets subclasses produce advantages of shape (B, T); ReSPO then takes the branch per token."""
    from respo_trl import ReSPOTrainer

    class PerTokenAdvantages(ReSPOTrainer):
        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            ramp = torch.linspace(1.0, -0.5, out["completion_ids"].shape[1])
            out["advantages"] = out["advantages"].unsqueeze(-1) * ramp  # sign flips along the completion
            return out

    trainer = make_trainer(trainer_cls=PerTokenAdvantages, num_iterations=2, max_steps=2)
    before = snapshot(trainer.model)
    trainer.train()
    assert changed(before, trainer.model)
    logs = logged(trainer)
    assert all(math.isfinite(log["loss"]) and math.isfinite(log["starvation/grad_throughput/pos"]) for log in logs)


def test_lora_adapter_trains(make_trainer):
    from peft import LoraConfig

    from respo_trl import ReSPOTrainer

    class LoRATrainer(ReSPOTrainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"]), **kwargs)

    trainer = make_trainer(trainer_cls=LoRATrainer, num_iterations=2, max_steps=2, learning_rate=5e-2)
    trainable = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora" in n for n in trainable)
    before = snapshot(trainer.model)
    trainer.train()
    assert set(changed(before, trainer.model)) <= set(trainable) and changed(before, trainer.model)


def test_kl_term_and_hub_style_loading_by_path(make_trainer, tiny_model_dir):
    trainer = make_trainer(model=tiny_model_dir, beta=0.05, num_iterations=2, max_steps=2)
    trainer.train()
    logs = logged(trainer)
    assert all("kl" in log and math.isfinite(log["kl"]) for log in logs)


def test_model_card_identifies_respo(make_trainer, tmp_path):
    from respo_trl.hub.card import write_trainer_card

    trainer = make_trainer(max_steps=1)
    trainer.card_writer = write_trainer_card  # as the recipe sets it (the trainer alone writes TRL's card)
    trainer.create_model_card(model_name="tiny-respo", dataset_name="org/arith", tags=["mine"])
    card = (tmp_path / "out" / "README.md").read_text()
    from huggingface_hub import ModelCard

    data = ModelCard(card).data
    assert data.model_name == "tiny-respo" and "# tiny-respo" in card  # what create_model_card was given
    assert data.datasets == ["org/arith"] and "mine" in data.tags
    assert {"respo", "trl", "rlvr", "reinforcement-learning"} <= set(data.tags)
    assert data.library_name == "transformers"
    assert "trained with ReSPO" in card and "2609.35433" in card
    assert "Reshaped Sequence Policy Optimization for Gradient Starvation" in card and "vonwerra2020trl" in card


def test_diagnostics_can_be_switched_off_but_reuse_accounting_stays(make_trainer):
    trainer = make_trainer(respo_log_diagnostics=False, num_iterations=2, max_steps=4)
    trainer.train()
    logs = logged(trainer)
    assert all("starvation/grad_throughput/pos" not in log for log in logs)
    assert [log["reuse/staleness_mean"] for log in logs] == [0, 1, 0, 1]  # steps since each batch was generated
    assert logs[-1]["reuse/generated_tokens"] > 0


def test_on_policy_respo_run_is_the_dapo_run(make_trainer):
    """R=1: every ratio is exactly 1, so ReSPO's whole training run equals TRL dapo's, step for step."""
    runs = {}
    for loss_type in ("respo", "dapo"):
        trainer = make_trainer(loss_type=loss_type, max_steps=3)
        trainer.train()
        runs[loss_type] = (snapshot(trainer.model), [log["reward"] for log in logged(trainer)])
    for name, value in runs["respo"][0].items():
        torch.testing.assert_close(value, runs["dapo"][0][name], rtol=1e-5, atol=1e-6, msg=name)
    assert runs["respo"][1] == runs["dapo"][1]  # same parameters, hence the same samples and rewards
    # (the logged loss values differ: dapo's surrogate is -w A, ReSPO's -phi A log pi; only their gradients agree)


def _signature(obj):
    import inspect

    func = obj.__func__ if isinstance(obj, (staticmethod, classmethod)) else obj
    return [(p.name, p.kind, p.default) for p in inspect.signature(func).parameters.values()]


def test_every_inherited_trl_method_keeps_its_signature_and_kind():
    """Catches an override that TRL's own code or a user calls in a way the override does not accept: 0.2 made
    TRL's @staticmethod get_off_policy_mask (and get_gamma_weights) instance methods, so the documented
    ``ReSPOTrainer.get_off_policy_mask(...)`` raised TypeError."""
    import inspect

    from trl import GRPOTrainer

    from respo_trl import ReSPOTrainer

    checked = []
    for cls in ReSPOTrainer.__mro__[: ReSPOTrainer.__mro__.index(GRPOTrainer)]:
        for name, mine in vars(cls).items():
            if name.startswith("__") or not callable(getattr(ReSPOTrainer, name, None)) or not hasattr(GRPOTrainer, name):
                continue
            theirs = inspect.getattr_static(GRPOTrainer, name)
            assert type(mine) is type(theirs), f"{cls.__name__}.{name} is a {type(mine).__name__}, TRL's a {type(theirs).__name__}"
            assert _signature(mine) == _signature(theirs), f"{cls.__name__}.{name}"
            checked.append(name)
    assert {"_compute_loss", "_prepare_inputs", "_get_per_token_logps_and_entropies", "train", "create_model_card"} <= set(checked)


def test_the_seam_overrides_each_trl_method_once_and_declares_every_one():
    """One seam (issue 41): ReSPOTrainer's only base is GRPOTrainer, so no TRL method is overridden along a chain of
    mixins, and every method it overrides is declared in trl_surface.TRL_METHODS, whose signatures check_trl_hooks
    checks; every TRL class attribute it sets is in TRL_CLASS_ATTRIBUTES. Catches an override added without declaring
    it (a TRL that moves it would then break silently)."""
    from trl import GRPOTrainer

    from respo_trl import ReSPOTrainer
    from respo_trl.trainer import OVERRIDDEN
    from respo_trl.trl_surface import TRL_CLASS_ATTRIBUTES, TRL_METHODS

    assert ReSPOTrainer.__bases__ == (GRPOTrainer,)
    overridden = {name for name, value in vars(ReSPOTrainer).items() if callable(value) and hasattr(GRPOTrainer, name)}
    overridden.discard("__init_subclass__")
    assert overridden == set(OVERRIDDEN), overridden ^ set(OVERRIDDEN)
    for name in OVERRIDDEN:
        assert name in TRL_METHODS
    attributes = {name for name, value in vars(ReSPOTrainer).items() if not callable(value) and hasattr(GRPOTrainer, name)
                  and not name.startswith("__")}  # fmt: skip
    assert attributes <= set(TRL_CLASS_ATTRIBUTES), attributes - set(TRL_CLASS_ATTRIBUTES)


def test_trl_helpers_are_callable_the_way_trl_and_its_tests_call_them():
    """TRL calls its static helpers on the class and its tests call instance helpers unbound with a Mock(spec=...)."""
    from unittest.mock import Mock

    from trl import GRPOTrainer

    from respo_trl import ReSPOTrainer

    gen = torch.Generator().manual_seed(0)
    logps, old = -torch.rand(4, 6, generator=gen), -torch.rand(4, 6, generator=gen)
    mask, adv = torch.ones(4, 6), torch.tensor([[1.0], [-1.0], [0.5], [-0.5]])
    kwargs = dict(advantages=adv, per_token_logps=logps, sampling_per_token_logps=old, mask=mask, off_policy_threshold=0.1)
    assert torch.equal(ReSPOTrainer.get_off_policy_mask(**kwargs), GRPOTrainer.get_off_policy_mask(**kwargs))
    gamma = (adv, logps - old, mask, None)
    assert torch.equal(ReSPOTrainer.get_gamma_weights(*gamma), GRPOTrainer.get_gamma_weights(*gamma))
    stand_in = Mock(spec=GRPOTrainer)  # as TRL's tests/test_grpo_trainer.py builds it
    stand_in.accelerator = Mock(num_processes=1)
    stand_in.accelerator.gather = lambda x: x
    stand_in.accelerator.pad_across_processes = lambda x, dim, pad_index: x
    entropies = torch.rand(4, 6, generator=gen)
    assert torch.equal(ReSPOTrainer.get_high_entropy_mask(stand_in, entropies, mask, 0.5),
                       GRPOTrainer.get_high_entropy_mask(stand_in, entropies, mask, 0.5))  # fmt: skip


def test_the_seam_into_trl_writes_no_helper_and_flips_nothing(make_trainer, monkeypatch):
    """0.4 wrote four helpers into the trainer's ``__dict__`` for every loss call, flipped ``loss_type`` to "vespo"
    and back, and popped TRL's ``vespo/phi_seq_mean``. The seam is now declared once (``trainer.py``): during
    the loss TRL's helpers see ``loss_type="respo"``, the call leaves data behind and no callable, no VESPO metric is
    logged, and a user's own instance patch of a TRL helper is what the loss calls."""
    from test_gradients import make_batch, prepare
    from trl import GRPOTrainer

    trainer = prepare(make_trainer(loss_type="respo", top_entropy_quantile=0.5))
    inputs = make_batch(trainer.processing_class, seed=1)
    seen, original = [], GRPOTrainer.get_high_entropy_mask

    def spy(self, entropies, mask, threshold):
        seen.append(self.loss_type)
        return original(self, entropies, mask, threshold)

    monkeypatch.setattr(GRPOTrainer, "get_high_entropy_mask", spy)
    before = dict(vars(trainer))
    trainer._compute_loss(trainer.model, inputs)
    assert seen and set(seen) == {"respo"}
    added = {k: v for k, v in vars(trainer).items() if k not in before}
    assert not [k for k, v in added.items() if callable(v)], added.keys()
    assert "vespo/phi_seq_mean" not in trainer._metrics["train"] and trainer._metrics["train"]["respo/phi_mean/pos"]
    calls = []
    trainer.get_high_entropy_mask = lambda *a, **k: calls.append(1) or spy(trainer, *a, **k)  # a user's own patch
    trainer._compute_loss(trainer.model, inputs)
    assert calls  # the loss (and the diagnostics) went through it


def test_positive_branch_diagnostic_is_pooled_over_the_logged_step(make_trainer):
    """Catches a mean of per-micro-batch ratios: with two micro-batches per logged step, share / mass share / ratio
    are formed once from the summed counts and masses."""
    from respo_trl.diagnostics import pool_low_weight_window, pooled_low_weight

    trainer = make_trainer(loss_type="dapo")
    metrics = trainer._metrics["train"]
    prefix = "starvation/low_weight_pos/"
    micro = [  # (n, n_low, mass, mass_low): 1 low of 2 with half the mass, then 1 low of 8 with a tenth
        {"n": 2.0, "n_low": 1.0, "mass": 1.0, "mass_low": 0.5},
        {"n": 8.0, "n_low": 1.0, "mass": 10.0, "mass_low": 1.0},
    ]
    for row in micro:
        for key in ("n", "n_low", "mass", "mass_low", "respo_mass", "respo_mass_low", "vespo_mass", "vespo_mass_low"):
            metrics[prefix + key].append(row[key.split("_", 1)[1]] if key.startswith(("respo", "vespo")) else row[key])
        metrics[prefix + "share"].append(row["n_low"] / row["n"])
    pool_low_weight_window(metrics)  # what ReSPOTrainer.log does with TRL's window of metrics
    assert metrics[prefix + "share"] == [pytest.approx(2 / 10)]  # not (1/2 + 1/8) / 2
    assert metrics[prefix + "mass_share"] == [pytest.approx(1.5 / 11)]
    assert metrics[prefix + "mass_ratio"] == [pytest.approx((1.5 / 11) / 0.2)]
    assert metrics[prefix + "n"] == [10.0]  # the window's total, not a per-micro-batch mean
    assert pooled_low_weight({"n": 0.0})["share"] != pooled_low_weight({"n": 0.0})["share"]  # NaN without positives


def test_evaluation_goes_through_trls_own_path(make_trainer, toy_dataset):
    """trainer.evaluate() is TRL's generation and scoring, not the reuse buffer (which is for training only)."""
    trainer = make_trainer(max_steps=1, per_device_eval_batch_size=8, num_generations_eval=4)
    metrics = trainer.evaluate(eval_dataset=toy_dataset.select(range(8)))
    assert "eval_reward" in metrics and trainer.rollouts.is_empty  # nothing was buffered


def test_generated_tokens_count_model_tokens_only_when_tools_insert_some(make_trainer, monkeypatch):
    """With tool calls TRL marks the tool's tokens in ``tool_mask``: sampling cost counts the model's own tokens."""
    from trl import GRPOTrainer

    trainer = make_trainer(max_steps=1)
    completions = [[5, 6, 7, 8], [9, 10]]
    rest = (None,) * 5  # TRL 1.16's other five fields (completions, logprobs, extra_fields, images, tool_images)
    outputs = {"tools": (None, completions, [[1, 0, 0, 1], [1, 1]], *rest), "plain": (None, completions, None, *rest)}
    for kind, expected in (("tools", 4), ("plain", 6)):
        monkeypatch.setattr(GRPOTrainer, "_generate", lambda self, prompts, out=outputs[kind]: out)
        trainer.model.train()
        before = trainer.rollouts.generated_tokens
        assert trainer._generate(["p", "q"]) is outputs[kind]
        assert trainer.rollouts.generated_tokens - before == expected, kind
    # a TRL whose _generate returns another tuple is refused in one line before its fields are read by position
    monkeypatch.setattr(GRPOTrainer, "_generate", lambda self, prompts: (None, completions, None))
    with pytest.raises(RuntimeError, match=r"no longer has \['GRPOTrainer._generate returning 8 fields \(got 3\)'\]"):
        trainer._generate(["p", "q"])


def test_without_args_the_output_dir_is_named_after_the_model(monkeypatch):
    """As TRL's GRPOTrainer names it ``<model>-GRPO``: the last path component of a Hub id or a local path (a
    trailing slash included). The default config needs a GPU (bf16), so the config class is stood in for."""
    import respo_trl.trainer as trainer_module

    class Stop(Exception):
        pass

    seen = []

    def config(output_dir):
        seen.append(output_dir)
        raise Stop

    monkeypatch.setattr(trainer_module, "ReSPOConfig", config)
    for model in ("Qwen/Qwen3-1.7B", "/ckpts/qwen3-tiny/", "org/Qwen3-MAX/"):
        with pytest.raises(Stop):
            trainer_module.ReSPOTrainer(model, reward_funcs=lambda **_: [])
    assert seen == ["Qwen3-1.7B-ReSPO", "qwen3-tiny-ReSPO", "Qwen3-MAX-ReSPO"]  # only the slash is stripped
