"""Two-process DDP on CPU (gloo): reuse metrics are reduced across ranks, so every rank logs the same numbers."""

import json
import os
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(shutil.which("torchrun") is None and not os.path.exists(os.path.join(os.path.dirname(sys.executable), "torchrun")), reason="torchrun not found")
def test_two_process_reuse_metrics_agree_across_ranks(tmp_path):
    torchrun = shutil.which("torchrun") or os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [torchrun, "--nproc_per_node", "2", "--master_port", "29517", "tests/workers/ddp_reuse.py", str(tmp_path)]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert all(r["world_size"] == 2 for r in ranks)
    logs0, logs1 = ranks[0]["logs"], ranks[1]["logs"]
    assert len(logs0) == len(logs1) == 5
    keys = ["reuse/staleness_mean", "reuse/staleness_max", "reuse/generated_tokens", "reuse/generated_tokens_per_step",
            "starvation/grad_throughput/pos", "offpolicy/ess", "starvation/zero_coef_token_frac"]
    for a, b in zip(logs0, logs1):
        for key in keys:
            assert key in a and a[key] == b.get(key), key
    assert [log["reuse/staleness_max"] for log in logs0] == [0, 1, 2, 3, 0]
    # the sampling-compute counter is the sum over both ranks' own completions
    total = ranks[0]["local_tokens"] + ranks[1]["local_tokens"]
    assert ranks[0]["generated_tokens"] == ranks[1]["generated_tokens"] == total == logs0[-1]["reuse/generated_tokens"]
    assert 0 < ranks[0]["local_tokens"] < total
    assert [log["reuse/generated_tokens_per_step"] > 0 for log in logs0] == [True, False, False, False, True]
