"""Test-only: a CPU "platform" for verl 0.9.1, so its FSDP2 training engine runs on a CPU-only machine (gloo).

verl 0.9.1 ships CUDA, NPU and ROCm platforms only and falls back to CUDA when none is found; its FSDP engine is
registered for ``cuda``/``npu`` devices. This module registers a ``cpu`` platform through verl's own
``PlatformRegistry`` (selected with ``VERL_PLATFORM=cpu`` before verl first asks for its platform) and maps the FSDP
engine to it. Nothing here changes the loss or the engine's code paths: it only answers "which device" with "cpu".
It is not part of the package and is never imported outside ``tests/verl_integration``.
"""

from __future__ import annotations

import contextlib
import types

import torch
from verl.plugin.platform.platform_base import PlatformBase
from verl.plugin.platform.platform_manager import PlatformRegistry


def _zero(*args, **kwargs):
    return 0


def _none(*args, **kwargs):
    return None


# torch.cpu lacks the allocator statistics verl logs after each step; they read as 0 here.
_DEVICE_MODULE = types.SimpleNamespace(
    is_available=lambda: True, current_device=_zero, device_count=lambda: 1, set_device=_none, synchronize=_none,
    empty_cache=_none, manual_seed=torch.manual_seed, manual_seed_all=torch.manual_seed, max_memory_allocated=_zero,
    max_memory_reserved=_zero, memory_allocated=_zero, memory_reserved=_zero, reset_peak_memory_stats=_none,
    mem_get_info=lambda *a, **k: (0, 0), get_rng_state=torch.get_rng_state, set_rng_state=torch.set_rng_state,
    is_initialized=lambda: True,
)


@PlatformRegistry.register(platform="cpu")
class PlatformCPU(PlatformBase):
    device_name = "cpu"
    vendor_name = "cpu"
    device_module = _DEVICE_MODULE

    def is_available(self):
        return True

    def current_device(self):
        return "cpu"  # verl passes this to .to(device=...)

    def device_count(self):
        return 1

    def set_device(self, device_index):
        pass

    def synchronize(self, device_index=None):
        pass

    def manual_seed(self, seed):
        torch.manual_seed(seed)

    def manual_seed_all(self, seed):
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings):
        pass

    def empty_cache(self):
        pass

    def get_device_capability(self, device_index=0):
        return None, None

    def communication_backend_name(self):
        return "gloo"

    def visible_devices_envvar(self):
        return "CPU_VISIBLE_DEVICES"

    @contextlib.contextmanager
    def nvtx_range(self, msg):
        yield

    def profiler_start(self):
        pass

    def profiler_stop(self):
        pass

    def ray_resource_name(self):
        return "CPU"

    def ray_noset_envvars(self):
        return []

    def is_ipc_supported(self):
        return False

    def cudart(self):
        return None


def register_cpu_fsdp_engine() -> None:
    """Map verl's FSDP/FSDP2 language-model engine to the ``cpu`` device."""
    from verl.workers.engine import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    for backend in ("fsdp", "fsdp2"):
        EngineRegistry._engines["language_model"][backend]["cpu"] = FSDPEngineWithLMHead
