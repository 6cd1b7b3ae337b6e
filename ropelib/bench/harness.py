"""The timing harness: interleaved rounds in one process."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from .._validation import check_int


def synchronize(device: torch.device) -> None:
    """Wait for queued work on ``device`` (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_interleaved(
    fns: dict[str, Callable[[], Any]],
    device: torch.device,
    *,
    reps: int = 5,
    warmup: int = 2,
    progress: Any = None,
) -> dict[str, list[float]]:
    """Seconds per call of each function, round-robin: round ``i`` runs every function once.

    Warm-up rounds (compilation, allocator, caches) are run first and discarded. On CUDA each
    call is bracketed by CUDA events; on CPU by ``time.perf_counter``.

    Args:
        fns: name -> zero-argument callable.
        device: where the functions run.
        reps: timed rounds (>= 1).
        warmup: untimed rounds before.
        progress: an object with ``update(n)`` (a tqdm bar), advanced once per call.

    Returns:
        name -> list of ``reps`` durations in seconds.
    """
    reps = check_int(reps, "reps", minimum=1)
    warmup = check_int(warmup, "warmup", minimum=0)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for round_index in range(warmup + reps):
        for name, fn in fns.items():
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                elapsed = start.elapsed_time(end) / 1e3
            else:
                begin = time.perf_counter()
                fn()
                elapsed = time.perf_counter() - begin
            if round_index >= warmup:
                times[name].append(elapsed)
            if progress is not None:
                progress.update(1)
    return times
