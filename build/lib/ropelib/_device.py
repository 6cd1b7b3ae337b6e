"""Which device ropelib uses by default, and how to name a device beside a timing."""

from __future__ import annotations

import torch


def default_device() -> torch.device:
    """``cuda`` when a CUDA device is present, else ``cpu``."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def device_name(device: torch.device | str | None = None) -> str:
    """A human-readable name of ``device`` (the GPU's marketing name, or the CPU's model).

    Used by the book and the benchmarks to say where every timing was measured.
    """
    device = torch.device(device) if device is not None else default_device()
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = "CPU"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{model} ({torch.get_num_threads()} threads)"
