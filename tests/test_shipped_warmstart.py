"""The warm start the package ships (respo_trl/recipe/shipped/): loaded only for exactly the inputs it was made
from, equal to what the recipe would train from them, and made again whenever the code or data it depends on moves."""

import pytest
import torch
from accelerate.logging import get_logger

from respo_trl.recipe import shipped
from respo_trl.recipe.data import load_datasets
from respo_trl.recipe.model import build_model, run_warm_start
from respo_trl.recipe.parsing import parse_args

LOGGER = get_logger(__name__)


def default_run(tmp_path, *extra):
    """The embedded default's model and training rows, as the recipe builds them (plus ``extra`` arguments)."""
    script_args, training_args, model_args = parse_args(["--output_dir", str(tmp_path / "out"), *extra])
    model, tokenizer, *_ = build_model(script_args, training_args, model_args, LOGGER)
    train, _, _ = load_datasets(script_args, training_args, model_args, tokenizer, LOGGER)
    return script_args, training_args, model, tokenizer, train


def print_of(script_args, training_args, model, tokenizer, train, **changed):
    settings = {"steps": script_args.warmstart_steps, "batch_size": script_args.warmstart_batch_size,
                "learning_rate": script_args.warmstart_learning_rate, "seed": training_args.seed, **changed}  # fmt: skip
    return shipped.fingerprint(model, tokenizer, train["prompt"], train["completion"], **settings)


def test_the_shipped_file_is_the_one_the_current_code_and_data_would_train(tmp_path):
    """The main job's warm start (the default preset, seed 0) finds its shipped file; the file says it was made from
    this fingerprint, for 500 steps; its weights imitate the teacher (the loss on demonstrations a random model has
    above 3 is near the warm start's own final loss). A change to the warm-start loop, the tokenizer, the task's
    rows, the model's initialisation or the settings makes the file unreachable, and this test fails until
    ``python -m respo_trl.recipe.shipped --write`` makes it again."""
    script_args, training_args, model, tokenizer, train = default_run(tmp_path)
    print_ = print_of(script_args, training_args, model, tokenizer, train)
    path = shipped.find(print_)
    assert path is not None, f"no shipped warm start for the default preset: run `{shipped.MAKE_COMMAND}`"
    from respo_trl.recipe.warmstart import _collate, sft_examples

    examples = sft_examples(tokenizer, train["prompt"][:64], train["completion"][:64])
    batch = _collate(examples, tokenizer.pad_token_id)

    def demonstration_loss():
        with torch.no_grad():
            return model(input_ids=batch[0], attention_mask=batch[1], labels=batch[2]).loss.item()

    assert demonstration_loss() > 3.0  # the model as built
    info = shipped.load(model, path)
    assert info["fingerprint"] == print_ and info["steps"] == script_args.warmstart_steps == 500
    assert demonstration_loss() < 0.2 and info["final_loss"] < 0.2
    # any input that differs finds no file: the recipe then trains the warm start itself
    assert shipped.find(print_of(script_args, training_args, model, tokenizer, train)) is None  # trained weights
    script_args, training_args, model, tokenizer, train = default_run(tmp_path)
    for changed in ({"steps": 499}, {"seed": 1}, {"learning_rate": 3.1e-3}, {"batch_size": 32}):
        assert shipped.find(print_of(script_args, training_args, model, tokenizer, train, **changed)) is None, changed
    flipped = train.select(range(1, len(train)))
    assert shipped.find(print_of(script_args, training_args, model, tokenizer, flipped)) is None


def test_the_recipe_loads_a_shipped_warm_start_equal_to_the_one_it_trains(tmp_path, monkeypatch):
    """At a few steps, on this machine: the warm start trained here, written as a shipped file, is what a second run
    with the same inputs loads instead of training (bit for bit, reported as shipped, no steps run), and what
    ``--warmstart_shipped false`` trains again. Catches: a fingerprint that misses an input the weights depend on
    (the loaded weights would differ from the trained ones), a load that is not strict, the switch ignored."""
    monkeypatch.setattr(shipped, "SHIPPED_DIR", tmp_path / "shipped")
    args = ("--warmstart_steps", "3", "--warmstart_batch_size", "8", "--train_size", "300", "--heldout_size", "20")
    script_args, training_args, model, tokenizer, train = default_run(tmp_path, *args)
    print_ = print_of(script_args, training_args, model, tokenizer, train)
    trained = run_warm_start(model, tokenizer, train, script_args, training_args, None, None, show_progress=False)
    assert trained["shipped"] is None and trained["steps"] == 3
    shipped.write(model, print_, {"steps": 3, "final_loss": trained["final_loss"]})
    expected = {k: v.clone() for k, v in model.state_dict().items()}

    script_args, training_args, model, tokenizer, train = default_run(tmp_path, *args)
    loaded = run_warm_start(model, tokenizer, train, script_args, training_args, None, None, show_progress=False)
    assert loaded["shipped"] == shipped.path_for(print_).name and loaded["final_loss"] == trained["final_loss"]
    assert all(torch.equal(model.state_dict()[k], v) for k, v in expected.items())

    script_args, training_args, model, tokenizer, train = default_run(tmp_path, *args, "--warmstart_shipped", "false")
    again = run_warm_start(model, tokenizer, train, script_args, training_args, None, None, show_progress=False)
    assert again["shipped"] is None and again["steps"] == 3
    assert all(torch.equal(model.state_dict()[k], v) for k, v in expected.items())  # deterministic on one machine


def test_making_needs_write(capsys):
    from respo_trl.recipe.shipped.__main__ import main

    with pytest.raises(SystemExit):
        main([])
    assert "pass --write" in capsys.readouterr().err
