"""What a benchmark ran on, saved next to its numbers: timings mean little without the machine, threads and load."""

from __future__ import annotations

import os
import platform
import sys


# The trainer settings every CPU benchmark run shares: no GPU, fp32, no checkpointing, no loggers, saves or progress bars.
QUIET_CPU_TRAINING = dict(
    use_cpu=True, bf16=False, activation_checkpointing=False, report_to="none", save_strategy="no", disable_tqdm=True
)


def cpu_name() -> str:
    """The CPU model (``/proc/cpuinfo``'s first ``model name``), or what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def machine_info(device: str = "cpu") -> dict:
    """Device, CPU, core count, load average (a busy machine stretches every timing), torch and its thread count."""
    import torch

    info = {
        "device": device,
        "device_name": torch.cuda.get_device_name() if device == "cuda" else cpu_name(),
        "processor": cpu_name(),
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
    }
    return info
