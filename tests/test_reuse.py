"""The rollout-reuse buffer: pass composition, provenance, ESS refresh, and checkpoint/resume that loses nothing."""

import json
import os
import tempfile

import pytest
import torch
from conftest import StopAt, params_of

from respo_trl.buffer import VERSION_KEY, RolloutBuffer, buffer_files, check_contiguous_groups


def toy_batch(n=8, width=3):
    return {
        "prompt_ids": torch.arange(n * width).reshape(n, width),
        "advantages": torch.arange(n, dtype=torch.float32),
        "num_items_in_batch": torch.tensor(17),
        "tags": [f"row{i}" for i in range(n)],
        "image_grid_thw": None,
    }


def served_rows(buffer, pass_index):
    return [buffer.micro_batch(pass_index, k)["advantages"].tolist() for k in range(buffer.steps_per_generation)]


def test_each_pass_serves_every_rollout_once_with_a_new_composition():
    buffer = RolloutBuffer(reuse=4, steps_per_generation=2, reshuffle=True, seed=3)
    buffer.store(toy_batch(), version=5)
    passes = [served_rows(buffer, p) for p in range(4)]
    for chunks in passes:
        assert sorted(sum(chunks, [])) == list(range(8))
        assert all(len(c) == 4 for c in chunks)
    assert passes[0] == [[0, 1, 2, 3], [4, 5, 6, 7]]  # first pass keeps the (already shuffled) generation order
    assert len({str(p) for p in passes}) == 4  # every later pass regroups the minibatches
    micro = buffer.micro_batch(2, 1)
    assert micro["num_items_in_batch"].item() == 17 and micro["image_grid_thw"] is None
    assert [int(t[3:]) for t in micro["tags"]] == micro["advantages"].long().tolist()  # lists follow the tensors
    assert (micro[VERSION_KEY] == 5).all() and (buffer.staleness(micro, step=7) == 2).all()
    # deterministic: a second buffer with the same seed and history regroups identically
    twin = RolloutBuffer(reuse=4, steps_per_generation=2, reshuffle=True, seed=3)
    twin.store(toy_batch(), version=5)
    assert [served_rows(twin, p) for p in range(4)] == passes


def test_served_micro_batches_are_copies_of_their_rows_only():
    """An in-place edit of served inputs (the trainer's, TRL's or a user's hook) must not reach the stored batch or a
    later pass; and a pass must not copy the whole generation batch (with Routing Replay at 30B geometry the routes
    alone are ~1.8 GB per copy per GPU): each micro-batch owns exactly its own rows."""
    buffer = RolloutBuffer(reuse=2, steps_per_generation=4, reshuffle=False, seed=0)
    buffer.store(toy_batch(), version=0)
    stored = buffer.batch["prompt_ids"].untyped_storage().data_ptr()
    before = [served_rows(buffer, 0)]
    for k in range(4):
        micro = buffer.micro_batch(0, k)
        assert micro["prompt_ids"].untyped_storage().data_ptr() != stored
        assert micro["prompt_ids"].untyped_storage().nbytes() == micro["prompt_ids"].nbytes  # only its rows
        assert micro["tags"] == [f"row{i}" for i in range(2 * k, 2 * k + 2)]
        micro["advantages"].mul_(-100.0)  # an in-place edit of what was served
        micro["prompt_ids"].zero_()
    assert served_rows(buffer, 1) == before[0]  # the next pass serves the rows as sampled
    assert buffer.batch["prompt_ids"].abs().sum() > 0
    reshuffled = RolloutBuffer(reuse=2, steps_per_generation=4, reshuffle=True, seed=0)
    reshuffled.store(toy_batch(), version=0)
    micro = reshuffled.micro_batch(1, 0)
    assert micro["prompt_ids"].shape == (2, 3)  # a reshuffled pass gathers only this micro-batch's rows


def test_without_reshuffle_every_pass_repeats_trl_order():
    buffer = RolloutBuffer(reuse=3, steps_per_generation=4, reshuffle=False)
    buffer.store(toy_batch(), version=0)
    assert served_rows(buffer, 0) == served_rows(buffer, 1) == served_rows(buffer, 2)


def test_buffer_round_trips_through_safetensors_and_json(tmp_path):
    buffer = RolloutBuffer(reuse=4, steps_per_generation=2, seed=1)
    buffer.store(toy_batch(), version=2)
    buffer.generated_tokens, buffer.refreshes = 1234, 1
    buffer.save(str(tmp_path), rank=0, extra={"step": 9})
    tensor_path, meta_path = buffer_files(str(tmp_path), 0)
    assert os.path.exists(tensor_path) and json.load(open(meta_path))["extra"] == {"step": 9}
    assert not any(name.endswith((".pt", ".pkl", ".bin")) for name in os.listdir(tmp_path))  # no pickle

    restored = RolloutBuffer(reuse=4, steps_per_generation=2, seed=1)
    assert restored.load(str(tmp_path), rank=0) == {"step": 9}
    assert (restored.generated_tokens, restored.refreshes, restored.generation_index) == (1234, 1, 1)
    for p in range(4):
        assert served_rows(restored, p) == served_rows(buffer, p)
    micro = restored.micro_batch(1, 0)
    assert micro["tags"] and micro["image_grid_thw"] is None and micro["num_items_in_batch"].item() == 17


def test_missing_corrupt_or_mismatched_buffer_files_fail_loudly(tmp_path):
    buffer = RolloutBuffer(reuse=4, steps_per_generation=2)
    with pytest.raises(FileNotFoundError, match="rollout_buffer-rank0"):
        buffer.load(str(tmp_path), rank=0)
    buffer.store(toy_batch(), version=0)
    buffer.save(str(tmp_path), rank=0)
    with pytest.raises(FileNotFoundError, match="rollout_buffer-rank1"):
        buffer.load(str(tmp_path), rank=1)
    with pytest.raises(ValueError, match="reuse=4 but this run has reuse=2"):
        RolloutBuffer(reuse=2, steps_per_generation=2).load(str(tmp_path), rank=0)
    tensor_path, meta_path = buffer_files(str(tmp_path), 0)
    with open(tensor_path, "r+b") as f:
        f.write(b"\xff" * 64)
    with pytest.raises(ValueError, match="corrupt"):
        buffer.load(str(tmp_path), rank=0)
    with open(meta_path, "w") as f:
        f.write("{ not json")
    with pytest.raises(ValueError, match="corrupt"):
        buffer.load(str(tmp_path), rank=0)


def test_buffer_save_refuses_what_it_cannot_restore(tmp_path):
    """Catches: a non-JSON field silently dropped or pickled, and a tensor file missing a listed tensor accepted."""
    buffer = RolloutBuffer(reuse=2, steps_per_generation=2)
    assert (buffer.generated_tokens, buffer.refreshes, buffer.generation_index) == (0, 0, 0)  # compute counts from 0
    buffer.store({**toy_batch(), "handle": object()}, version=0)
    with pytest.raises(TypeError, match="'handle' of type object cannot be checkpointed"):
        buffer.save(str(tmp_path), rank=0)
    buffer.store(toy_batch(), version=0)
    buffer.save(str(tmp_path), rank=0)
    tensor_path, _ = buffer_files(str(tmp_path), 0)
    from safetensors.torch import load_file, save_file

    tensors = load_file(tensor_path)
    del tensors["advantages"]
    save_file(tensors, tensor_path)
    with pytest.raises(ValueError, match=r"tensors \['advantages'\] listed in .* are missing"):
        RolloutBuffer(reuse=2, steps_per_generation=2).load(str(tmp_path), rank=0)


def test_load_restores_device_emptiness_and_pre_0_2_files(tmp_path):
    """Catches: a restored batch left off the requested device, a stale batch kept when the checkpoint has none, and
    buffer files written before the process count was recorded (0.1) refused or misread."""
    empty_dir, full_dir = tmp_path / "empty", tmp_path / "full"
    RolloutBuffer(reuse=2, steps_per_generation=2).save(str(empty_dir), rank=0)  # a checkpoint between batches
    full = RolloutBuffer(reuse=2, steps_per_generation=2)
    full.store(toy_batch(), version=0)
    full.save(str(full_dir), rank=0)

    restored = RolloutBuffer(reuse=2, steps_per_generation=2)
    restored.load(str(full_dir), rank=0, device="meta")
    assert restored.batch["prompt_ids"].device.type == "meta"
    restored.load(str(empty_dir), rank=0)
    assert restored.is_empty

    _, meta_path = buffer_files(str(full_dir), 0)
    meta = json.loads(open(meta_path).read())
    del meta["num_processes"]
    open(meta_path, "w").write(json.dumps(meta))
    RolloutBuffer(reuse=2, steps_per_generation=2).load(str(full_dir), rank=0)  # one process, as 0.1 ran
    with pytest.raises(ValueError, match="saved with num_processes=1 but this run has num_processes=2"):
        RolloutBuffer(reuse=2, steps_per_generation=2, num_processes=2).load(str(full_dir), rank=0)


def test_buffer_rejects_bad_input():
    with pytest.raises(ValueError, match="reuse"):
        RolloutBuffer(reuse=0, steps_per_generation=1)
    buffer = RolloutBuffer(reuse=2, steps_per_generation=3)
    with pytest.raises(ValueError, match="cannot be split"):
        buffer.store(toy_batch(8), version=0)
    with pytest.raises(RuntimeError, match="empty"):
        buffer.micro_batch(0, 0)


def grouped_batch(groups=6, size=4):
    """A generation slice in TRL's order: each prompt's ``size`` completions in consecutive rows."""
    batch = toy_batch(groups * size)
    batch["prompt_ids"] = torch.arange(groups).repeat_interleave(size)[:, None].expand(-1, 3).clone()
    batch["prompt_mask"] = torch.ones_like(batch["prompt_ids"])
    return batch


def served_groups(buffer, pass_index):
    """Per micro-batch, {prompt: rows of it served}: whole groups iff every count equals the group size."""
    out = []
    for k in range(buffer.steps_per_generation):
        prompts = buffer.micro_batch(pass_index, k)["prompt_ids"][:, 0].tolist()
        out.append({p: prompts.count(p) for p in prompts})
    return out


@pytest.mark.parametrize("reshuffle", [True, False])
def test_whole_group_passes_serve_each_group_whole_and_each_row_once(reshuffle):
    """Catches a group split across micro-batches, a row served twice or never, an unseeded (unreproducible) group
    order, and a group order that ignores ``reshuffle``."""
    buffer = RolloutBuffer(reuse=3, steps_per_generation=3, reshuffle=reshuffle, seed=4, group_size=4)
    buffer.store(grouped_batch(), version=0)
    passes = [served_groups(buffer, p) for p in range(3)]
    for p, chunks in enumerate(passes):
        assert all(set(c.values()) == {4} and len(c) == 2 for c in chunks)  # 2 whole groups of 4 per micro-batch
        assert sorted(sum(served_rows(buffer, p), [])) == list(range(24))  # every row exactly once per pass
    assert [sorted(c) for c in passes[0]] != [[0, 1], [2, 3], [4, 5]]  # the first pass is shuffled by group too
    assert (len({str(p) for p in passes}) == 3) == reshuffle  # new compositions only when reshuffling
    twin = RolloutBuffer(reuse=3, steps_per_generation=3, reshuffle=reshuffle, seed=4, group_size=4)
    twin.store(grouped_batch(), version=0)
    assert [served_rows(twin, p) for p in range(3)] == [served_rows(buffer, p) for p in range(3)]
    other = RolloutBuffer(reuse=3, steps_per_generation=3, reshuffle=reshuffle, seed=5, group_size=4)
    other.store(grouped_batch(), version=0)
    assert [served_rows(other, p) for p in range(3)] != [served_rows(buffer, p) for p in range(3)]


def test_whole_group_order_survives_a_checkpoint_and_a_mismatched_group_size_is_refused(tmp_path):
    buffer = RolloutBuffer(reuse=2, steps_per_generation=3, seed=1, group_size=4)
    buffer.store(grouped_batch(), version=3)
    buffer.save(str(tmp_path), rank=0)
    restored = RolloutBuffer(reuse=2, steps_per_generation=3, seed=1, group_size=4)
    restored.load(str(tmp_path), rank=0)
    assert [served_rows(restored, p) for p in range(2)] == [served_rows(buffer, p) for p in range(2)]
    with pytest.raises(ValueError, match="group_size=4 but this run has group_size=None"):
        RolloutBuffer(reuse=2, steps_per_generation=3, seed=1).load(str(tmp_path), rank=0)


def test_whole_groups_refuse_split_micro_batches_and_scattered_groups():
    with pytest.raises(ValueError, match="not whole groups of 4.*per_device_train_batch_size"):
        RolloutBuffer(reuse=1, steps_per_generation=4, group_size=4).store(grouped_batch(), version=0)  # 6-row chunks
    check_contiguous_groups(grouped_batch(), 4)
    scattered = grouped_batch()
    scattered["prompt_ids"] = scattered["prompt_ids"][torch.randperm(24, generator=torch.Generator().manual_seed(0))]
    with pytest.raises(ValueError, match=r"respo_whole_groups: rows .* not one prompt's num_generations=4"):
        check_contiguous_groups(scattered, 4)


def test_cpu_buffer_device_trains(make_trainer):
    # On this CPU-only machine this checks the code path (store on CPU, serve on the training device), not the saving.
    trainer = make_trainer(num_iterations=2, max_steps=2, respo_buffer_device="cpu")
    trainer.train()
    assert trainer.rollouts.storage_device == "cpu"
    assert all(v.device.type == "cpu" for v in trainer.rollouts.batch.values() if torch.is_tensor(v))


# -- through the trainer ----------------------------------------------------------------------------------------------


RESUME_SETUPS = {
    # R=2 passes of 2 mini-batches each (a generation every 4 steps): the resume lands inside a reshuffled pass
    "epochs": (dict(num_iterations=2, steps_per_generation=2), [3, 0, 1]),
    # the paper's N=4, each sample once: the resume lands on the last, 3-step-stale mini-batch of a rollout batch
    "staleness": (dict(respo_updates_per_rollout=4), [3, 0, 1]),
    # both: N=2 mini-batches per pass, R=2 passes
    "both": (dict(respo_updates_per_rollout=2, num_iterations=2), [3, 0, 1]),
    # R=2 of one mini-batch: the checkpoint (step 3) falls one micro-step into a cycle, with a pass still to come
    "epochs-odd": (dict(num_iterations=2), [1, 0, 1]),
    # the paper's N=4 with whole groups (4 rows = 2 groups of 2): the seeded group order must resume exactly
    "staleness-groups": (dict(respo_updates_per_rollout=4, respo_whole_groups=True, num_generations=2), [3, 0, 1]),
}


@pytest.mark.parametrize("kind", sorted(RESUME_SETUPS))
def test_resume_mid_batch_continues_with_the_same_rollouts(make_trainer, tmp_path, kind):
    """6 steps straight == 3 steps, checkpoint, resume, 3 steps, for epochs, staleness N and both."""
    fields, staleness_after = RESUME_SETUPS[kind]
    setup = dict(gradient_accumulation_steps=1, per_device_train_batch_size=4, max_steps=6, **fields)
    straight = make_trainer(**setup)
    straight.train()
    expected = params_of(straight.model)
    straight_logs = [h for h in straight.state.log_history if "loss" in h]

    first = make_trainer(**setup, save_strategy="steps", save_steps=3, output_dir=str(tmp_path / "run"))
    first.add_callback(StopAt(3))
    first.train()
    checkpoint = tmp_path / "run" / "checkpoint-3"
    meta = json.loads((checkpoint / "rollout_buffer-rank0.json").read_text())
    assert meta["has_batch"] and meta["extra"]["step"] == 3

    resumed = make_trainer(**setup, output_dir=str(tmp_path / "run"))
    resumed.train(resume_from_checkpoint=str(checkpoint))
    got = params_of(resumed.model)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=1e-6, msg=name)
    resumed_logs = [h for h in resumed.state.log_history if "loss" in h][3:]  # the history holds steps 1-3 too
    assert [h["reuse/staleness_mean"] for h in resumed_logs] == staleness_after
    for key in ("reuse/generated_tokens", "reuse/generated_tokens_per_step", "loss"):
        assert [h[key] for h in resumed_logs] == pytest.approx([h[key] for h in straight_logs[3:]], rel=1e-5), key


def test_resume_with_a_partial_buffer_is_an_error_not_a_resample(make_trainer, tmp_path):
    trainer = make_trainer(num_iterations=4, max_steps=2, save_strategy="steps", save_steps=2,
                           output_dir=str(tmp_path / "run"))
    trainer.train()
    checkpoint = tmp_path / "run" / "checkpoint-2"
    os.remove(checkpoint / "rollout_buffer-rank0.safetensors")
    resumed = make_trainer(num_iterations=4, max_steps=4, output_dir=str(tmp_path / "run"))
    with pytest.raises(ValueError, match=r"rollout buffer files of rank\(s\) \[0\] are missing"):
        resumed.train(resume_from_checkpoint=str(checkpoint))
    resumed.rollouts.position = 2  # what a resume that skipped the buffer would leave: serving must refuse
    resumed.current_gradient_accumulation_steps = 1
    resumed.model.train()
    with pytest.raises(RuntimeError, match=r"No buffered rollouts to reuse at micro-batch 0 of pass 3 of 4"):
        resumed._prepare_inputs([])


def test_resume_with_another_seed_or_shuffle_is_refused_naming_the_field(make_trainer, tmp_path):
    """Catches: a resume under another --seed (or respo_reshuffle) accepted; with whole groups the first pass's group
    order is seeded, so the rest of the batch would serve some groups twice and others never, silently."""
    setup = dict(respo_updates_per_rollout=4, respo_whole_groups=True, num_generations=2, max_steps=2,
                 per_device_train_batch_size=4, gradient_accumulation_steps=1, save_strategy="steps", save_steps=2)
    make_trainer(**setup, seed=0, output_dir=str(tmp_path / "run")).train()
    checkpoint = str(tmp_path / "run" / "checkpoint-2")
    other_seed = make_trainer(**{**setup, "max_steps": 4}, seed=1, output_dir=str(tmp_path / "run"))
    with pytest.raises(ValueError, match=r"saved with seed=0 but this run has seed=1; resume with seed as it was"):
        other_seed.train(resume_from_checkpoint=checkpoint)
    same_seed = make_trainer(**{**setup, "max_steps": 4}, seed=0, output_dir=str(tmp_path / "run"))
    same_seed.train(resume_from_checkpoint=checkpoint)
    assert same_seed.state.global_step == 4
    buffer = RolloutBuffer(reuse=2, steps_per_generation=2, reshuffle=True)
    buffer.store(toy_batch(), version=0)
    buffer.save(str(tmp_path / "shuffle"), rank=0)
    with pytest.raises(ValueError, match="reshuffle=True but this run has reshuffle=False; resume with respo_reshuffle"):
        RolloutBuffer(reuse=2, steps_per_generation=2, reshuffle=False).load(str(tmp_path / "shuffle"), rank=0)
    # where neither decides anything, another seed resumes: no stored batch left, or one pass in its stored order
    buffer.save(str(tmp_path / "empty"), rank=0, include_batch=False)
    RolloutBuffer(reuse=2, steps_per_generation=2, reshuffle=True, seed=7).load(str(tmp_path / "empty"), rank=0)
    once = RolloutBuffer(reuse=1, steps_per_generation=2, reshuffle=False)
    once.store(toy_batch(), version=0)
    once.save(str(tmp_path / "once"), rank=0)
    RolloutBuffer(reuse=1, steps_per_generation=2, reshuffle=False, seed=7).load(str(tmp_path / "once"), rank=0)


def test_resuming_a_finished_run_is_refused_not_trained_one_step_more(make_trainer, tmp_path):
    """Catches: transformers checks the stop only after a step, so a run resumed from its last checkpoint (a job
    relaunched after it finished) trained update max_steps + 1 silently; raising max_steps still resumes."""
    setup = dict(respo_updates_per_rollout=2, max_steps=2, per_device_train_batch_size=4, gradient_accumulation_steps=1,
                 save_strategy="steps", save_steps=2, output_dir=str(tmp_path / "run"))  # fmt: skip
    make_trainer(**setup).train()
    again = make_trainer(**setup)
    with pytest.raises(ValueError, match=r"checkpoint-2: the checkpoint is at step 2, already at or past max_steps 2"):
        again.train(resume_from_checkpoint=True)
    assert again.state.global_step == 0
    longer = make_trainer(**{**setup, "max_steps": 3})
    longer.train(resume_from_checkpoint=True)
    assert longer.state.global_step == 3


def test_buffer_saved_by_another_number_of_processes_is_refused(tmp_path):
    buffer = RolloutBuffer(reuse=2, steps_per_generation=2, num_processes=4)
    buffer.store(toy_batch(), version=0)
    buffer.save(str(tmp_path), rank=0)
    with pytest.raises(ValueError, match="num_processes=4 but this run has num_processes=2"):
        RolloutBuffer(reuse=2, steps_per_generation=2, num_processes=2).load(str(tmp_path), rank=0)
    assert not [name for name in os.listdir(tmp_path) if ".tmp" in name]  # written atomically, nothing left over
    with pytest.raises(FileNotFoundError, match="filesystem every node shares"):  # rank 1's file is on another node
        RolloutBuffer(reuse=2, steps_per_generation=2, num_processes=4).load(str(tmp_path), rank=1)


def test_interrupted_save_is_skipped_on_resume_and_refused_by_path(make_trainer, tmp_path, caplog):
    """A kill during a save leaves a folder without trainer_state.json: `resume_from_checkpoint=True` must take the
    last complete checkpoint (and say so), and naming the incomplete one must fail with the reason."""
    import logging
    import shutil

    setup = dict(num_iterations=2, steps_per_generation=2, gradient_accumulation_steps=1, per_device_train_batch_size=4)
    run = tmp_path / "run"
    first = make_trainer(**setup, max_steps=4, save_strategy="steps", save_steps=2, output_dir=str(run))
    first.train()
    broken = run / "checkpoint-4"
    for name in os.listdir(broken):  # what a kill right after the rollout buffer was written leaves behind
        if not name.startswith("rollout_buffer"):
            path = broken / name
            shutil.rmtree(path) if path.is_dir() else os.remove(path)
    resumed = make_trainer(**setup, max_steps=4, output_dir=str(run))
    with pytest.raises(ValueError, match="incomplete checkpoint"):
        resumed.train(resume_from_checkpoint=str(broken))
    with caplog.at_level(logging.WARNING):
        resumed.train(resume_from_checkpoint=True)
    assert any("Skipping" in r.getMessage() and "checkpoint-4" in r.getMessage() for r in caplog.records)
    assert resumed.state.global_step == 4  # resumed from checkpoint-2 and trained steps 3-4 again


@pytest.mark.parametrize("stop_at,boundary", [(2, True), (1, False)])
def test_resume_from_a_plain_grpo_trainer_checkpoint(make_trainer, tmp_path, caplog, stop_at, boundary):
    """TRL's own checkpoints hold no rollout buffer: at a generation boundary nothing is lost; mid-cycle the rest of
    the interrupted batch is replaced by fresh rollouts (TRL's behaviour), with a warning, not an error."""
    import logging

    from trl import GRPOConfig, GRPOTrainer

    setup = dict(num_iterations=2, steps_per_generation=1, gradient_accumulation_steps=1, per_device_train_batch_size=8)
    run = tmp_path / "run"
    plain = make_trainer(config_cls=GRPOConfig, trainer_cls=GRPOTrainer, **setup, max_steps=stop_at,
                         save_strategy="steps", save_steps=stop_at, output_dir=str(run))
    plain.train()
    checkpoint = run / f"checkpoint-{stop_at}"
    assert not [n for n in os.listdir(checkpoint) if n.startswith("rollout_buffer")]
    resumed = make_trainer(**setup, max_steps=4, output_dir=str(run))
    with caplog.at_level(logging.INFO):
        resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.state.global_step == 4
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert ("nothing is lost" in messages) == boundary and ("replaced by fresh rollouts" in messages) == (not boundary)
    assert (f"{checkpoint} has no rollout buffer" in messages)  # the folder is named
    if not boundary:  # stopped after pass 1 of 2: one micro-batch of the batch was left
        assert "the 1 remaining micro-batches of its rollout batch" in messages
    logs = [h for h in resumed.state.log_history if "loss" in h and h["step"] > stop_at]
    assert logs[0]["reuse/staleness_mean"] == 0  # the resumed run starts with a fresh batch either way


def test_ess_floor_refreshes_drifted_batches(make_trainer):
    trainer = make_trainer(num_iterations=4, max_steps=4, respo_min_ess=0.999, learning_rate=5e-2)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert trainer.rollouts.refreshes >= 1
    assert logs[-1]["reuse/refreshes"] == trainer.rollouts.refreshes
    refreshed_steps = sum(1 for h in logs[1:] if h["reuse/generated_tokens_per_step"] > 0)
    assert refreshed_steps == trainer.rollouts.refreshes
    assert all("reuse/ess_before_pass" in h for h in logs[1:])


def test_reuse_passes_are_reshuffled_for_respo_and_replayed_for_trls_losses(make_trainer):
    """Catches: respo_reshuffle ignored by the trainer (the buffer test alone cannot see it)."""
    setup = dict(num_iterations=2, steps_per_generation=2, gradient_accumulation_steps=1, per_device_train_batch_size=4,
                 max_steps=4)
    served = {}
    for loss in ("respo", "dapo"):
        trainer = make_trainer(loss_type=loss, **setup)
        rows = []
        original = trainer.rollouts.micro_batch

        def record(pass_index, micro_index, device=None, original=original, rows=rows):
            batch = original(pass_index, micro_index, device)
            rows.append(sorted(map(tuple, batch["completion_ids"].tolist())))
            return batch

        trainer.rollouts.micro_batch = record
        trainer.train()
        served[loss] = rows
    for loss, rows in served.items():  # 4 micro-batches: pass 1 (a, b), pass 2 over the same 8 rollouts
        assert sorted(rows[0] + rows[1]) == sorted(rows[2] + rows[3]), loss
    assert served["dapo"][0] == served["dapo"][2] and served["dapo"][1] == served["dapo"][3]  # TRL's order
    assert served["respo"][0] != served["respo"][2]  # a new composition on the reuse pass


def test_staleness_n_uses_each_sample_once(make_trainer):
    """The paper's N: one rollout batch feeds N updates, each sample once; mini-batch k is k updates stale."""
    trainer = make_trainer(respo_updates_per_rollout=4, per_device_train_batch_size=4, max_steps=8)
    assert trainer.args.steps_per_generation == 4 and trainer.num_iterations == 1
    assert not trainer.args.respo_trust_mask_active  # paper-pure: no sample is used twice
    seen = []
    original = trainer.rollouts.micro_batch

    def record(pass_index, micro_index, device=None):
        batch = original(pass_index, micro_index, device)
        seen.append((trainer.rollouts.generation_index, pass_index, tuple(map(tuple, batch["completion_ids"].tolist()))))
        return batch

    trainer.rollouts.micro_batch = record
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["reuse/staleness_max"] for h in logs] == [0, 1, 2, 3] * 2
    assert [h["reuse/generated_tokens_per_step"] > 0 for h in logs] == [True, False, False, False] * 2
    assert [h["reuse/pass"] for h in logs] == [1] * 8 and all("reuse/grad_norm_vs_fresh" not in h for h in logs)
    assert all(p == 0 for _, p, _ in seen) and len({rows for _, _, rows in seen}) == 8  # every sample used once
    assert logs[1]["offpolicy/log_weight/std"] > 0  # later mini-batches are off-policy


def test_one_optimizer_step_spanning_two_passes_logs_the_mean_pass_and_no_ratio(make_trainer):
    """steps_per_generation < gradient_accumulation_steps: both passes fall in one optimizer step."""
    trainer = make_trainer(num_iterations=2, steps_per_generation=1, gradient_accumulation_steps=2,
                           per_device_train_batch_size=8, max_steps=2)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "grad_norm" in h]
    assert [h["reuse/pass"] for h in logs] == [1.5, 1.5]
    assert all("reuse/grad_norm_vs_fresh" not in h for h in logs)


def test_reuse_passes_log_grad_norm_against_the_fresh_pass(make_trainer):
    trainer = make_trainer(num_iterations=2, max_steps=4)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "grad_norm" in h]
    assert [h["reuse/pass"] for h in logs] == [1, 2, 1, 2]
    assert "reuse/grad_norm_vs_fresh" not in logs[0] and "reuse/grad_norm_vs_fresh" not in logs[2]
    for fresh, reused in ((logs[0], logs[1]), (logs[2], logs[3])):
        assert reused["reuse/grad_norm_vs_fresh"] == pytest.approx(reused["grad_norm"] / fresh["grad_norm"])


def test_grad_norm_ratio_never_compares_with_another_batch(make_trainer):
    # logging_steps=3 with R=2: logged are step 3 (fresh pass of the second batch) and step 6 (reuse pass of the
    # third batch, whose fresh step 5 was not logged); step 6 must not be divided by step 3's norm
    trainer = make_trainer(num_iterations=2, max_steps=6, logging_steps=3)
    trainer.train()
    logs = {h["step"]: h for h in trainer.state.log_history if "grad_norm" in h}
    assert logs[3]["reuse/pass"] == 1 and logs[6]["reuse/pass"] == 2
    assert "reuse/grad_norm_vs_fresh" not in logs[6]


def test_no_refresh_without_a_floor(make_trainer):
    trainer = make_trainer(num_iterations=4, max_steps=4, learning_rate=5e-2)
    trainer.train()
    assert trainer.rollouts.refreshes == 0


def test_buffer_serves_on_the_requested_device_and_sizes_any_batch():
    """Catches: micro-batches not moved to the training device (invisible on one CPU: the meta device shows it)."""
    from respo_trl.buffer import _batch_size

    buffer = RolloutBuffer(reuse=2, steps_per_generation=2)
    buffer.store(toy_batch(), version=0)
    micro = buffer.micro_batch(1, 0, device="meta")
    assert micro["prompt_ids"].device.type == "meta" and micro["tags"] == buffer.micro_batch(1, 0)["tags"]
    assert _batch_size({"advantages": torch.zeros(6), "ids": torch.zeros(6, 2)}) == 6  # a 1-D tensor first
    assert _batch_size({"advantages": torch.zeros(6)}) == 6  # a 1-D tensor alone has a batch dimension too
    assert _batch_size({"n": torch.tensor(3), "tags": ["a", "b"]}) == 2  # 0-dim tensors are shared, lists count


def test_checkpoint_format_is_pinned_and_unknown_versions_are_refused(tmp_path):
    buffer = RolloutBuffer(reuse=2, steps_per_generation=2)
    buffer.store(toy_batch(), version=0)
    buffer.save(str(tmp_path), rank=0)
    _, meta_path = buffer_files(str(tmp_path), 0)
    meta = json.loads(open(meta_path).read())
    assert meta["format_version"] == 1  # files written by 0.1 and 0.2 load: bump it only with a migration
    meta["format_version"] = 99
    open(meta_path, "w").write(json.dumps(meta))
    with pytest.raises(ValueError, match="unsupported format_version 99"):
        RolloutBuffer(reuse=2, steps_per_generation=2).load(str(tmp_path), rank=0)


def test_no_checkpoint_folder_at_all(make_trainer, tmp_path):
    from respo_trl.checkpoints import last_complete_checkpoint

    assert last_complete_checkpoint(str(tmp_path / "missing"), 1) == (None, [])
    trainer = make_trainer(output_dir=str(tmp_path / "never-written"), max_steps=1)
    with pytest.raises(ValueError, match="No valid checkpoint found"):
        trainer.train(resume_from_checkpoint=True)


@pytest.mark.parametrize("loss", ["respo", "dapo"])
def test_whole_groups_through_the_trainer_keep_each_group_in_one_update(make_trainer, loss):
    """The paper's N with whole groups, for ReSPO and a TRL loss: every served micro-batch holds whole groups whose
    advantages sum to 0 (GRPO normalises within a group), every rollout is used once per cycle; with TRL's row
    shuffle (the default) the same run splits groups, so the assertion can fail."""
    served = {}
    for whole in (True, False):
        trainer = make_trainer(loss_type=loss, respo_updates_per_rollout=4, per_device_train_batch_size=8,
                               num_generations=4, max_steps=4, respo_whole_groups=whole)  # fmt: skip
        rows, original = [], trainer.rollouts.micro_batch

        def record(pass_index, micro_index, device=None, original=original, rows=rows):
            batch = original(pass_index, micro_index, device)
            rows.append((batch["prompt_ids"].tolist(), batch["advantages"].tolist(), batch["completion_ids"].tolist()))
            return batch

        trainer.rollouts.micro_batch = record
        trainer.train()
        served[whole] = rows

    def counts(prompts):
        keys = [tuple(p) for p in prompts]
        return sorted(keys.count(k) for k in set(keys))

    for prompts, advantages, _ in served[True]:
        assert counts(prompts) == [4, 4]  # two whole groups of 4 in each 8-row micro-batch
        for key in set(map(tuple, prompts)):
            assert abs(sum(a for p, a in zip(prompts, advantages) if tuple(p) == key)) < 1e-4
    assert len({tuple(map(tuple, c)) for _, _, c in served[True]}) == 4  # 4 distinct micro-batches of one cycle
    assert any(counts(prompts) != [4, 4] for prompts, _, _ in served[False])  # TRL's row shuffle splits groups


def test_first_pass_weight_keeps_each_samples_first_w_on_its_later_passes(make_trainer, monkeypatch):
    """respo_epoch_weight="first_pass" (issue 40): on pass 1 a row's phi comes from its current W, which the buffer
    keeps; on passes 2..R phi comes from that kept W, not from the W the policy has moved to since. Catches: the
    current W used on later passes (the 0.5 kernel under epochs), the kept value overwritten by a later pass, the
    rows' identities lost in a reshuffled pass, the diagnostics reporting another coefficient than the loss's."""
    from respo_trl.buffer import FIRST_LOG_W_KEY, ROW_KEY
    from respo_trl.kernels import respo_weights

    trainer = make_trainer(num_iterations=3, max_steps=3, respo_epoch_weight="first_pass", learning_rate=5e-2)
    assert trainer.args.respo_first_pass_weight and trainer.rollouts.track_first_weight
    import respo_trl.trl_loss as loss_module

    calls, real = [], loss_module.respo_weights

    def spy(log_ratio, advantages, mask, params, *, sampler_ratio=None, log_w=None):  # what the loss's phi is built from
        calls.append((advantages, log_ratio.detach().clone(), mask, None if log_w is None else log_w.clone()))
        return real(log_ratio, advantages, mask, params, sampler_ratio=sampler_ratio, log_w=log_w)

    monkeypatch.setattr(loss_module, "respo_weights", spy)
    rows_seen = []
    compute = trainer._compute_loss

    def loss_and_rows(model, inputs):
        rows_seen.append(inputs[ROW_KEY].clone())
        return compute(model, inputs)

    trainer._compute_loss = loss_and_rows
    trainer.train()
    assert len(calls) == 3 and all(c[3] is not None for c in calls)
    first = calls[0]
    assert torch.isnan(first[3]).all()  # pass 1: nothing kept yet, the current W is used (and kept)
    kept = trainer.rollouts.batch[FIRST_LOG_W_KEY]
    assert torch.isfinite(kept).all()
    current_pass1 = (first[1] * first[2]).sum(-1)  # no sampler ratio: log W = sum of the token log-ratios
    torch.testing.assert_close(kept[rows_seen[0]], current_pass1.clamp(-20, 20), rtol=0, atol=1e-6)
    params = trainer.loss_params
    for rows, (advantages, log_ratio, mask, log_w) in zip(rows_seen[1:], calls[1:]):  # passes 2-3
        torch.testing.assert_close(log_w, kept[rows], rtol=0, atol=0)  # each row's own first-pass W
        current = (log_ratio * mask).sum(-1)
        assert (current - log_w).abs().max() > 1e-4, "the policy did not move: the test cannot tell the two apart"
        kept_coef = respo_weights(log_ratio, advantages, mask, params, log_w=log_w).coefficients
        assert not torch.allclose(kept_coef, respo_weights(log_ratio, advantages, mask, params).coefficients)
    logged = [h["respo/phi_mean/pos"] for h in trainer.state.log_history if "respo/phi_mean/pos" in h]
    assert len(logged) == 3  # the diagnostics log the phi the loss applied (kept W): checked in test_diagnostics
    # under the default ("current") nothing is kept and each pass weighs the W of the moment
    plain = make_trainer(num_iterations=3, max_steps=3)
    assert not plain.args.respo_first_pass_weight and not plain.rollouts.track_first_weight


def test_resume_mid_batch_with_another_epoch_weight_is_refused(tmp_path):
    """The kept first-pass weights decide the rest of a stored batch: a mid-batch resume under the other
    respo_epoch_weight stops in one line naming it (a cycle boundary may change it)."""
    from respo_trl.buffer import RolloutBuffer

    saved = RolloutBuffer(reuse=2, steps_per_generation=1, track_first_weight=True)
    saved.store({"x": torch.zeros(4, 3)}, version=0)
    saved.save(str(tmp_path), rank=0)
    with pytest.raises(ValueError, match=r"saved mid-batch with respo_epoch_weight 'first_pass' .* but this run has 'current'"):
        RolloutBuffer(reuse=2, steps_per_generation=1).load(str(tmp_path), rank=0)
    RolloutBuffer(reuse=2, steps_per_generation=1, track_first_weight=True).load(str(tmp_path), rank=0)
    saved.save(str(tmp_path / "boundary"), rank=0, include_batch=False)  # nothing left of the batch: either resumes
    RolloutBuffer(reuse=2, steps_per_generation=1).load(str(tmp_path / "boundary"), rank=0)


def test_the_buffer_counts_its_own_steps_and_reports_them():
    """Issue 52, item 4: the buffer knows which micro-batch starts an optimizer step from its own count (every
    ``accumulation``-th served), reports the tokens sampled for a step on that micro-batch only, serves each row's
    staleness, and keeps the count across a save and load; its reuse metrics are a read (asking twice changes
    nothing) and its step summary gives the pass. Catches: a step boundary taken from the trainer's counter, tokens
    reported twice or on the wrong micro-batch, a count lost on resume."""
    from respo_trl.buffer import STALENESS_KEY

    def make():
        return RolloutBuffer(reuse=2, steps_per_generation=4, reshuffle=False, accumulation=2)

    buffer, sampled = make(), []

    def sample():
        buffer.count_generated(100)
        sampled.append(1)
        return {"x": torch.arange(8.0)}

    reports = []
    for step in range(3):
        for _ in range(2):  # two micro-batches per optimizer step
            served = buffer.next_micro_batch(step, sample, lambda rows: None)
            assert served.batch[STALENESS_KEY].tolist() == [step - 0] * 2
            staleness = served.batch[STALENESS_KEY].float()
            first = buffer.reuse_metrics(staleness)
            assert buffer.reuse_metrics(staleness) == first  # a read
            reports.append(first.get("reuse/generated_tokens_per_step"))
    assert reports == [100.0, None, 0.0, None, 0.0, None] and buffer.served == 6 and len(sampled) == 1
    assert buffer.step_summary(grad_norm=1.0) == {"reuse/pass": 2.0}  # step 3 is the batch's second pass
    assert make().step_summary(grad_norm=1.0) == {}

    with tempfile.TemporaryDirectory() as folder:
        buffer.save(folder, rank=0, extra={"step": 6})
        resumed = make()
        resumed.load(folder, rank=0)
    assert resumed.served == 6
    resumed.next_micro_batch(3, sample, lambda rows: None)
    assert resumed.reuse_metrics(torch.zeros(2)).get("reuse/generated_tokens_per_step") == 0.0  # a step's first
    resumed.next_micro_batch(3, sample, lambda rows: None)
    assert "reuse/generated_tokens_per_step" not in resumed.reuse_metrics(torch.zeros(2))

    adaptive = RolloutBuffer(reuse=2, steps_per_generation=4, adaptive="kl", threshold=0.1)
    assert adaptive.prompt_repeat_count() == 4 and make().prompt_repeat_count() is None
