"""benchmarks/smollm2_staleness.py: the gate's rule, the staleness probe's log-probabilities, the comparison's rule,
the refusals (a gate read early, a resume with other settings) and a smoke run of every stage on a tiny model."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from conftest import ROOT

from benchmarks import smollm2_staleness as study


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from respo_trl.demo.tiny import build_char_tokenizer, tiny_qwen3

    path = tmp_path_factory.mktemp("tiny-model")
    tokenizer = build_char_tokenizer()
    torch.manual_seed(0)
    tiny_qwen3(tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def gate_runs(shares: dict, gains: dict, n_pos: int = 40):
    """Specs and finished records of a gate: ``shares[(lr, k)]`` the probe's low-W share, ``gains[lr]`` the on-policy
    run's validation accuracy minus the base model's 0.10."""
    specs, runs = [], {}
    for lr in gains:
        stale, onpolicy = study.run_name("gate_stale", lr, 32, 1), study.run_name("gate_onpolicy", lr, 1, 1)
        specs += [{"name": stale, "kind": "stale", "lr": lr}, {"name": onpolicy, "kind": "onpolicy", "lr": lr}]
        probe = {str(k): {"share_pos": shares[(lr, k)], "n_pos": n_pos, "share_all": 0.5, "kl_per_token": 0.01}
                 for k in (7, 15, 31)}  # fmt: skip
        runs[stale] = {"probe": probe}
        runs[onpolicy] = {"validation": {"accuracy": 0.10 + gains[lr]}}
    return specs, runs


def test_the_gate_passes_a_setting_in_the_band_whose_on_policy_run_learns():
    shares = {(1e-5, 7): 0.05, (1e-5, 15): 0.12, (1e-5, 31): 0.20, (3e-5, 7): 0.16, (3e-5, 15): 0.30, (3e-5, 31): 0.45}
    specs, runs = gate_runs(shares, {1e-5: 0.12, 3e-5: 0.20})
    reading = study.gate_reading(specs, runs, base_accuracy=0.10)
    passing = {(s["N"], s["lr"]) for s in reading["settings"] if s["passes"]}
    assert passing == {(32, 1e-5), (8, 3e-5), (16, 3e-5)}  # k = N - 1: the stale end of N
    assert reading["chosen"]["N"] == 32 and reading["chosen"]["lr"] == 1e-5  # nearest the paper's 22.8%
    # an lr whose on-policy run does not gain 10 points passes nothing, whatever its shares
    specs, runs = gate_runs(shares, {1e-5: 0.09, 3e-5: 0.20})
    reading = study.gate_reading(specs, runs, base_accuracy=0.10)
    assert {s["lr"] for s in reading["settings"] if s["passes"]} == {3e-5}
    assert reading["chosen"]["N"] == 8  # 16% is nearer 22.8% than 30%
    specs, runs = gate_runs({key: 0.05 for key in shares}, {1e-5: 0.5, 3e-5: 0.5})
    reading = study.gate_reading(specs, runs, base_accuracy=0.10)
    assert not reading["passed"] and reading["chosen"] is None


def test_a_gate_read_before_its_runs_finish_stops_in_one_line():
    specs, runs = gate_runs({(1e-5, k): 0.2 for k in (7, 15, 31)}, {1e-5: 0.2})
    del runs[study.run_name("gate_onpolicy", 1e-5, 1, 1)]
    with pytest.raises(SystemExit, match=r"^the gate cannot be read: 1 of its runs have not finished "
                                         r"\(gate_onpolicy_N1_lr1e-05_s1\)$"):  # fmt: skip
        study.gate_reading(specs, runs, base_accuracy=0.1)


def test_a_run_resumed_with_other_settings_stops_naming_the_field(tmp_path):
    spec = {"name": "respo_s1", "arm": "respo", "lr": 1e-5, "N": 16, "seed": 1, "updates": 48, "template": "t",
            "argv": ["--loss_type", "respo"]}  # fmt: skip
    study.check_resume(str(tmp_path / "run"), spec)
    study.check_resume(str(tmp_path / "run"), dict(spec))  # the same settings resume
    with pytest.raises(SystemExit, match=r"^respo_s1: cannot resume .* with N=8: it was started with N=16 "):
        study.check_resume(str(tmp_path / "run"), {**spec, "N": 8})
    with pytest.raises(SystemExit, match=r"with argv=\['--loss_type', 'dapo'\]: it was started with argv=\["):
        study.check_resume(str(tmp_path / "run"), {**spec, "argv": ["--loss_type", "dapo"]})


def test_probe_log_probs_are_the_unpadded_sequences_at_the_training_temperature(tiny_model_dir):
    """Catches: padding that leaks into a sequence, positions counted from the padding, a missing temperature."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    samples = {"prompt_ids": [[5, 6, 7, 8, 9], [11, 12]], "completion_ids": [[20, 21], [22, 23, 24, 25]]}
    got = study.sequence_logps(model, samples, pad_id=0)
    for i, (prompt, completion) in enumerate(zip(samples["prompt_ids"], samples["completion_ids"])):
        ids = torch.tensor([prompt + completion])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float() / study.TEMPERATURE
        expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None]).sum().item()
        assert got[i] == pytest.approx(expected, abs=1e-4)


def test_probe_reading_counts_correct_answers_below_log_w_minus_one():
    reading = study.probe_reading(base_logps=[-5.0, -5.0, -5.0, -5.0], logps=[-7.0, -5.5, -4.0, -9.0],
                                  rewards=[1.0, 1.0, 0.0, 0.0], lengths=[10, 10, 10, 10])  # fmt: skip
    assert reading["n_pos"] == 2 and reading["share_pos"] == 0.5  # log W = -2 and -0.5 on the correct ones
    assert reading["share_all"] == 0.5 and reading["kl_per_token"] == pytest.approx((2 + 0.5 - 1 + 4) / 40)


def record(arm, seed, late, test, n=16):
    history = [{"step": 1, "reward": 0.0}, {"step": 40, "reward": late, "reuse/generated_tokens": 1000.0}]
    return {"name": f"{arm}_s{seed}", "arm": arm, "seed": seed, "N": n, "lr": 1e-5, "updates": 48, "history": history,
            "test": {"accuracy": test, "mean_length": 30.0}, "generated_tokens": 1000, "wall_s": 1.0, "train_s": 1.0}  # fmt: skip


def test_the_comparison_reads_paired_seeds_by_the_rule():
    runs = {}
    for seed, (respo, vespo, dapo) in enumerate([(0.50, 0.40, 0.45), (0.55, 0.44, 0.50), (0.52, 0.45, 0.53),
                                                  (0.60, 0.50, 0.58)], start=1):  # fmt: skip
        for arm, late in (("respo", respo), ("vespo", vespo), ("dapo", dapo)):
            runs[f"{arm}_s{seed}"] = record(arm, seed, late, test=late)
    summary = study.summarize(runs, gate=None)
    vs_vespo = summary["comparisons"]["respo - vespo"]["late_mean"]
    assert vs_vespo["per_seed"] == pytest.approx({1: 10.0, 2: 11.0, 3: 7.0, 4: 10.0})
    assert vs_vespo["reading"] == "holds" and vs_vespo["ci"][0] > 0
    assert summary["comparisons"]["respo - dapo"]["late_mean"]["reading"] == "no difference shown"  # +0.25 points
    assert summary["comparisons"]["vespo - dapo"]["test"]["reading"] == "reversed"
    assert "respo - onpolicy" not in summary["comparisons"]  # an arm with no run is not compared
    del runs["vespo_s4"], runs["vespo_s3"], runs["vespo_s2"]
    assert study.summarize(runs, None)["comparisons"]["respo - vespo"]["test"]["reading"].startswith("not read")


@pytest.mark.slow
def test_smoke_run_of_every_stage(tiny_model_dir, tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    base = [sys.executable, "-m", "benchmarks.smollm2_staleness"]
    common = ["--smoke", "--model", tiny_model_dir, "--out", str(out), "--work", str(work), "--workers", "1"]

    def stage(*args):
        done = subprocess.run([*base, *args, *common], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0 or args[0] == "compare", done.stderr[-3000:]
        return done

    stage("prompts")
    assert json.loads((out / "prompts.json").read_text())["chosen"] in study.TEMPLATES
    refused = stage("compare")
    assert refused.returncode != 0 and "the gate has not been read" in refused.stderr.strip().splitlines()[-1]
    stage("gate")
    gate = json.loads((out / "gate.json").read_text())
    assert gate["settings"] and gate["settings"][0]["N"] == 2 and (out / "gate.png").is_file()  # N = 2, probed at k = 1
    stale = json.loads((out / "gate" / "gate_stale_N2_lr0.0001_s1.json").read_text())
    assert set(stale["probe"]) == {"1"} and stale["probe"]["1"]["n"] == study.SMOKE["eval_problems"]
    gate.update(passed=True, chosen={"N": 2, "lr": 1e-4})  # a tiny random model learns nothing: pass it by hand
    (out / "gate.json").write_text(json.dumps(gate))
    stage("compare", "--arms", "respo", "onpolicy")
    again = stage("compare", "--arms", "respo", "onpolicy")
    assert "2 runs, 2 done, 0 to run" in again.stdout  # finished runs are never rerun
    summary = json.loads((out / "smollm2_staleness.json").read_text())
    assert summary["arms"]["onpolicy"]["N"] == 1 and summary["arms"]["respo"]["N"] == 2
    row = summary["arms"]["respo"]["per_seed"]["1"]
    assert row["test"] is not None and row["generated_tokens"] > 0 and not math.isnan(row["wall_s"])
    assert (out / "smollm2_staleness.png").is_file()
