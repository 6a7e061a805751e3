"""The kernel microbenchmark at toy size: it times the right expressions and writes its JSON."""

import json
import pathlib

import torch

from benchmarks import kernel_microbench as bench


def test_losses_agree_on_policy_and_differ_off_policy():
    assert bench.check_on_policy_equivalence("cpu", torch.float32) < 1e-6
    x = bench.make_inputs(4, 32, "cpu", torch.float32)
    x["old"] = x["old"] + 0.5  # far off-policy: the kernels must now give different gradients
    grads = {}
    for name, fn in bench.LOSSES.items():
        x["logp"].grad = None
        fn(x).backward()
        grads[name] = x["logp"].grad.clone()
    assert not torch.allclose(grads["respo"], grads["dapo"]) and not torch.allclose(grads["respo"], grads["vespo"])
    assert not torch.allclose(grads["respo"], grads["respo_mask"])


def test_respo_times_the_papers_kernel():
    # the timed expression's gradient is -phi(W_i) A_i / num_items on every unmasked token, phi the closed forms
    x = bench.make_inputs(6, 16, "cpu", torch.float32, seed=4)
    x["old"] = x["logp"].detach() + 0.05 * torch.randn(6, 16, generator=torch.Generator().manual_seed(1))
    x["logp"].grad = None
    bench.respo_loss(x).backward()
    m = x["mask"].double()
    w = torch.exp(((x["logp"].detach() - x["old"]).double() * m).sum(-1, keepdim=True))
    a = x["advantages"].double()
    phi = torch.where(a >= 0, (1 + w) / 2 * torch.exp(1 - w), w.sqrt() * torch.exp(2 * (1 - w.sqrt())))
    expected = -phi * a * m / x["num_items"].double()
    torch.testing.assert_close(x["logp"].grad.double(), expected, rtol=1e-5, atol=1e-9)


def test_cli_writes_rows_for_every_length_and_method(tmp_path, capsys):
    out = tmp_path / "mb.json"
    bench.main(["--lengths", "32", "64", "--batch", "4", "--repeats", "3", "--warmup", "1", "--out", str(out),
                "--no-plot"])
    data = json.loads(out.read_text())
    assert [row["length"] for row in data["rows"]] == [32, 64]
    for row in data["rows"]:
        assert set(row["methods"]) == {"dapo", "vespo", "respo", "respo_mask", "diagnostics"}
        assert row["methods"]["dapo"]["ratio_to_dapo"] == 1.0
        assert all(m["peak_mb"] > 0 and len(m["samples_ms"]) == 3 for m in row["methods"].values())
    assert "goal" in data and isinstance(data["goal"]["met"], bool) and isinstance(data["goal"]["met_with_mask"], bool)
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last)["threads"] == data["machine"]["threads"]


def test_vespo_weight_compiled_from_trl_source_equals_trl():
    import trl

    source = pathlib.Path(trl.__file__).parent / "trainer" / "grpo_trainer.py"
    from_source = bench.load_trl_gamma_weights(str(source))
    imported = bench.load_trl_gamma_weights()
    gen = torch.Generator().manual_seed(3)
    args = (torch.randn(16, 1, generator=gen), 0.3 * torch.randn(16, 40, generator=gen), torch.ones(16, 40), None)
    torch.testing.assert_close(from_source(*args), imported(*args), rtol=0, atol=0)
