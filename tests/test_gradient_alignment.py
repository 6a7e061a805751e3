"""The mechanism stage's gradient-alignment engine (benchmarks/gradient_alignment.py) on a tiny model: the losses'
gradients are the package's coefficients times ``A grad log pi``, a loss whose gradient is the reference's scores
cosine 1, and the interval respects the shared reference."""

import pytest
import torch

from benchmarks import gradient_alignment as ga
from respo_trl.builtin.tiny_model import tiny_qwen3


@pytest.fixture(scope="module")
def batch(tokenizer):
    torch.manual_seed(0)
    model = tiny_qwen3(tokenizer)
    prompts = [tokenizer.encode(p) for p in ("1+2=", "3+4=")]
    completions = [[int(t) for t in torch.randint(4, 20, (n,))] for n in (5, 3, 6, 4)]
    prompt_ids = [prompts[0], prompts[0], prompts[1], prompts[1]]  # 2 prompts x 2 completions
    return model, prompt_ids, completions, tokenizer.pad_token_id


def test_on_policy_every_loss_is_the_reinforce_gradient(batch):
    """At pi_old = pi_theta (W = 1, every token ratio 1) every coefficient is 1: with centred rewards each loss's
    gradient is REINFORCE's on the same batch up to a positive scale (the token count), so the cosine is 1."""
    model, prompt_ids, completions, pad = batch
    rewards = [1.0, 0.0, 0.0, 1.0]
    logps, mask = ga.token_logps(model, prompt_ids, completions, pad, temperature=0.7)
    advantages = ga.group_advantages(rewards, 2, scale=False)
    grads = ga.loss_gradients(model, logps, logps.detach(), advantages, mask)
    logps, mask = ga.token_logps(model, prompt_ids, completions, pad, temperature=0.7)
    reference = ga.reinforce_gradient(model, logps, rewards, 2, mask)
    assert reference.norm() > 0
    for loss, g in grads.items():
        assert ga.alignment(g, reference)["cos"] == pytest.approx(1.0, abs=1e-5), loss
        assert ga.alignment(g, reference)["gain"] == pytest.approx(reference.norm().item(), rel=1e-4), loss


def test_stale_losses_differ_by_their_coefficients_only(batch):
    """On a stale batch the losses' gradients differ (a dropped coefficient, a swapped branch would be caught by the
    exact match with a hand-built surrogate of the kernel's own coefficients)."""
    from respo_trl.kernels import respo_kernel, sequence_log_weight

    model, prompt_ids, completions, pad = batch
    logps, mask = ga.token_logps(model, prompt_ids, completions, pad, temperature=0.7)
    old = (logps.detach() + torch.tensor([[0.5], [-1.5], [1.0], [-0.3]])) * mask  # each sequence moved differently
    advantages = ga.group_advantages([1.0, 0.0, 0.0, 1.0], 2)
    grads = ga.loss_gradients(model, logps, old, advantages, mask)
    assert min(1 - ga.alignment(grads[a], grads[b])["cos"] for a in grads for b in grads if a < b) > 1e-4
    log_w = sequence_log_weight(logps.detach() - old, mask)
    for loss, c in (("respo", respo_kernel(log_w, advantages)), ("is", torch.exp(log_w))):  # phi(W), and W itself
        logps, mask = ga.token_logps(model, prompt_ids, completions, pad, temperature=0.7)
        expected = ga.flat_gradient(model, (c[:, None] * advantages[:, None] * logps * mask).sum() / mask.sum(), False)
        torch.testing.assert_close(grads[loss], expected, rtol=1e-4, atol=1e-7, msg=loss)


def test_group_advantages_are_trls():
    rewards = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0]
    a = ga.group_advantages(rewards, 4)
    first = torch.tensor([0.75, -0.25, -0.25, -0.25]) / (torch.tensor([1.0, 0, 0, 0]).std() + 1e-4)
    torch.testing.assert_close(a[:4], first)
    assert torch.equal(a[4:], torch.zeros(4))  # a group with no variance carries no gradient
    assert ga.group_advantages(rewards, 4, scale=False).tolist()[:4] == [0.75, -0.25, -0.25, -0.25]


def test_alignment_and_the_interval():
    v = torch.tensor([3.0, 4.0])
    assert ga.alignment(v, v) == {"cos": pytest.approx(1.0), "gain": pytest.approx(5.0)}
    assert ga.alignment(-v, v)["cos"] == pytest.approx(-1.0)
    assert ga.alignment(torch.tensor([4.0, -3.0]), v)["cos"] == pytest.approx(0.0, abs=1e-7)
    same = ga.hierarchical_bootstrap({1: [0.2, 0.2], 2: [0.2]}, reps=200)
    assert same["mean"] == pytest.approx(0.2) and same["ci"] == [pytest.approx(0.2), pytest.approx(0.2)]
    # one checkpoint far off: resampling checkpoints widens the interval beyond what pooled batches would give
    spread = ga.hierarchical_bootstrap({1: [0.0] * 20, 2: [0.0] * 20, 3: [1.0] * 20}, reps=2000)
    assert spread["ci"][0] <= 0.05 and spread["ci"][1] >= 0.6 and spread["groups"] == 3 and spread["n"] == 60
    assert ga.hierarchical_bootstrap({1: []}) == {"mean": None, "ci": None, "n": 0, "groups": 0}


@pytest.mark.slow
def test_smoke_run_of_the_mechanism_stages(tiny_model_dir, tokenizer, tmp_path):
    """pilot -> run -> read on a tiny model whose 'checkpoint-4' differs from theta_0: every batch is recorded once,
    with the four losses' alignment, and a second run redoes nothing."""
    import json
    import os
    import subprocess
    import sys

    from conftest import ROOT

    work, out = tmp_path / "work", tmp_path / "out"
    torch.manual_seed(1)
    tiny_qwen3(tokenizer).save_pretrained(work / "checkpoints" / "onpolicy_s4" / "checkpoint-4")
    base = [sys.executable, "-m", "benchmarks.smollm2_mechanism"]
    common = ["--smoke", "--model", tiny_model_dir, "--work", str(work), "--out", str(out), "--workers", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def stage(*args):
        done = subprocess.run([*base, *args, *common], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        return done

    refused = subprocess.run([*base, "run", *common], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert refused.returncode != 0 and "the pilot has not been read" in refused.stderr
    stage("pilot")
    pilot = json.loads((out / "pilot.json").read_text())
    assert pilot["batches"] == 1 and pilot["sizing"]["batches_per_checkpoint_and_n"] >= 4
    stage("run")
    (record,) = [json.loads(p.read_text()) for p in (out / "run").glob("t4-N4-b*.json")][:1]
    assert set(record["alignment"]) == {"dapo", "vespo", "respo", "is"} and record["commit"] and record["started_at"]
    assert len(record["rewards"]) == 4 and (work / "mechanism" / "reference-onpolicy_s4-t4.pt").is_file()
    again = stage("run")
    assert ": 0 batches" in again.stdout  # every batch was recorded: nothing is redone
    assert json.loads((out / "mechanism.json").read_text())["batches"] == len(list((out / "run").glob("*.json")))


def test_the_reading_counts_staleness_and_states_what_it_could_detect():
    """The read stage's staleness block counts only batches with a gradient as such and reads low-W positives from
    the records; `detectable` is the interval's half-width scaled to 80% power; `away_share` counts cos <= 0."""
    import math

    from benchmarks import smollm2_mechanism as mech

    def record(t, cos, positives, low, log_w, kl):
        return {"N": 4, "t": t, "positives": positives, "low_w_positives": low, "log_w": log_w, "kl_per_token": kl,
                "seconds": 10.0, "alignment": {k: {"cos": cos, "gain": cos} for k in ga.LOSSES}}  # fmt: skip

    rows = [record(8, math.nan, 0, 0, [0.0, -3.0], 0.1), record(8, 0.2, 4, 1, [-2.0, -4.0], 0.3),
            record(16, -0.1, 2, 2, [-5.0], 0.5), record(16, 0.3, 6, 0, [1.0], 0.7)]  # fmt: skip
    stale = mech.staleness(rows)
    assert stale["with_gradient"] == 3 and (stale["positives"], stale["low_w_positives"]) == (12, 3)
    assert stale["low_w_share"] == 0.25 and stale["median_log_w"] == -2.5 and stale["median_kl_per_token"] == 0.4
    entry = mech.reading(rows)["N4 all"]
    assert entry["losses"]["respo"]["away_share"] == pytest.approx(1 / 3)
    assert entry["losses"]["respo"]["cos"]["n"] == 3
    assert mech.detectable({"ci": [-0.1, 0.3]}) == pytest.approx(0.2 * 2.8 / 1.96)
    assert mech.detectable({"ci": None}) is None
    for r in rows:
        r["commit"] = "abc"
    fresh = mech.control_reading(rows)  # the fresh-batch control: batches without a gradient are counted, not averaged
    assert (fresh["batches"], fresh["with_gradient"]) == (4, 3) and fresh["cos"]["mean"] == pytest.approx(0.4 / 3)
    assert mech.batch_seed("control", 8, 0, 1) != mech.batch_seed("run", 8, 0, 1)


def test_the_unpaired_difference_shares_checkpoints():
    """Fresh minus stale by checkpoint: a shift of every value shifts the mean and interval by it; only checkpoints
    both sets hold are read."""
    first = {1: [0.1, 0.3, 0.2], 2: [0.5, 0.4], 3: [0.9]}
    second = {1: [0.0, 0.2], 2: [0.3, 0.2, 0.25]}
    base = ga.hierarchical_difference(first, second, reps=2000)
    shifted = ga.hierarchical_difference({k: [x + 0.5 for x in v] for k, v in first.items()}, second, reps=2000)
    assert base["groups"] == 2 and base["mean"] == pytest.approx(0.3 - 0.19)
    assert shifted["mean"] == pytest.approx(base["mean"] + 0.5)
    assert shifted["ci"] == pytest.approx([c + 0.5 for c in base["ci"]])
    assert ga.hierarchical_difference(first, {4: [0.1]})["ci"] is None
