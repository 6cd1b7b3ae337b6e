"""``python -m ropelib``: the version, the device ropelib sees, and which ways of running the rotation work here.

::

    python -m ropelib           # quick: what is installed and what the device supports
    python -m ropelib --check   # also run each one once on a small input against the reference

The ways (:data:`RUN_PATHS`) are the kernels of :data:`ropelib.kernels.KERNELS` (``torch``: PyTorch
operations, any device; ``native``: the compiled C loop on a CPU, with its cache folder and the
state of its build; ``triton``: the fused Triton kernel, which on a machine without CUDA runs in
Triton's interpreter, correct but slow) and ``compile`` (:func:`torch.compile` of the operator).
This is a tool on top of the library; nothing in the library imports it.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

import ropelib
import ropelib.kernels
from ropelib.kernels import native_build, native_kernel

#: Each kernel, and torch.compile of the PyTorch kernel.
RUN_PATHS = (*ropelib.kernels.KERNELS, "compile")


@dataclass(frozen=True)
class PathStatus:
    """Whether a way of running the rotation works here, and why (or why not)."""

    name: str
    usable: bool
    detail: str


def _version(module_name: str) -> str | None:
    """The installed version of a distribution, or None when it is not installed."""
    if importlib.util.find_spec(module_name) is None:
        return None
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(module_name)
    except PackageNotFoundError:
        return "unknown version"


def _detect(name: str, device: torch.device) -> PathStatus:
    """What can be said without running anything."""
    if name == "torch":
        return PathStatus(name, True, f"PyTorch {torch.__version__} operations on {device.type}")
    if name == "native":
        if device.type != "cpu":
            return PathStatus(name, False, f"the C loop runs on the CPU, and the device is {device.type}")
        if not native_build.enabled():
            return PathStatus(name, False, f"no C compiler, or {native_build.ENV}=0")
        return PathStatus(
            name, True, f"{native_build.compiler()}, cache {native_build.cache_dir()}; {native_kernel.BUILD.status()}"
        )
    if name == "triton":
        triton_version = _version("triton")
        if triton_version is None:
            return PathStatus(name, False, "triton is not installed")
        if device.type == "cuda":
            return PathStatus(name, True, f"Triton {triton_version}, compiled for the GPU")
        if os.environ.get("TRITON_INTERPRET", "1") == "1":
            return PathStatus(name, True, f"Triton {triton_version} in the interpreter (no CUDA device): correct, slow")
        return PathStatus(name, False, "no CUDA device and TRITON_INTERPRET=0")
    if device.type == "cuda":
        if _version("triton") is None:
            return PathStatus(name, False, "torch.compile on CUDA needs triton, which is not installed")
        return PathStatus(name, True, "torch.compile (inductor, Triton code for the GPU)")
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("clang++")
    if not compiler:
        return PathStatus(name, False, "torch.compile on CPU needs a C++ compiler (g++ or clang++), none found")
    return PathStatus(name, True, f"torch.compile (inductor, C++ code built with {compiler})")


def _run(name: str, device: torch.device) -> PathStatus:
    """Rotate a small q and k that way and compare with :func:`ropelib.apply_rotary`."""
    rotary_qk = ropelib.kernels.rotary_qk
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 16, 4, 32, generator=generator).to(device)
    k = torch.randn(2, 16, 2, 32, generator=generator).to(device)
    rope = ropelib.RotaryEmbedding(32)
    cos, sin = rope.cos_sin_cache(16, device)
    start = time.perf_counter()
    if name == "compile":
        compiled = torch.compile(lambda a, b: rotary_qk(a, b, cos[:16], sin[:16]), fullgraph=True)
        got_q, got_k = compiled(q, k)
    else:
        got_q, got_k = rotary_qk(q, k, cos[:16], sin[:16], kernel=name)
    seconds = time.perf_counter() - start
    if name == "native":  # the build, or the cache, is part of the first call
        detail = native_kernel.BUILD.status()
    want_q = ropelib.apply_rotary(q, cos[:16], sin[:16])
    want_k = ropelib.apply_rotary(k, cos[:16], sin[:16])
    # float32 products of values ~3 with cos/sin in [-1, 1]: a few ulps (1e-7 relative) apart at most.
    error = max((got_q - want_q).abs().max().item(), (got_k - want_k).abs().max().item())
    ok = error <= 1e-5
    verdict = "matches" if ok else "DIFFERS from"
    ran = f"ran in {seconds:.2g} s (first call) and {verdict} the reference (max |diff| {error:.1e})"
    return PathStatus(name, ok, f"{ran}; {detail}" if name == "native" else ran)


def check_paths(
    names: Sequence[str] = RUN_PATHS, *, run: bool = False, device: torch.device | None = None
) -> list[PathStatus]:
    """The status of each way in ``names`` on ``device`` (ropelib's default device).

    With ``run=True`` every way that looks usable is also run once on a small input and
    compared with :func:`ropelib.apply_rotary`; a failure or a wrong result marks it unusable.

    Example:
        >>> [status.usable for status in check_paths(["torch"])]
        [True]
    """
    device = ropelib.default_device() if device is None else device
    statuses = []
    for name in names:
        if name not in RUN_PATHS:
            raise ValueError(f"names must be drawn from {list(RUN_PATHS)}, got {name!r}")
        status = _detect(name, device)
        if run and status.usable:
            try:
                status = _run(name, device)
            except Exception as error:  # any failure is the answer: this way does not work here
                status = PathStatus(name, False, f"failed: {type(error).__name__}: {error}")
        statuses.append(status)
    return statuses


def report(*, run: bool = False) -> str:
    """The text that ``python -m ropelib`` prints."""
    device = ropelib.default_device()
    optional = ", ".join(f"{name} {_version(name) or 'not installed'}" for name in ("triton", "transformers"))
    lines = [
        f"ropelib {ropelib.__version__}",
        f"python {platform.python_version()}, torch {torch.__version__}, {optional}",
        f"device: {device.type} ({ropelib.device_name(device)})",
        "ways to run the rotation:",
    ]
    for status in check_paths(run=run, device=device):
        lines.append(f"  {status.name:<8} {'usable' if status.usable else 'not usable':<11} {status.detail}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ropelib", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="run each way once and compare with the reference")
    parser.add_argument("--version", action="version", version=f"ropelib {ropelib.__version__}")
    args = parser.parse_args(argv)
    print(report(run=args.check))
    return 0


if __name__ == "__main__":
    sys.exit(main())
