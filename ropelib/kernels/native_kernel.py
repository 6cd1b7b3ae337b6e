r"""The rotation on the CPU as one compiled C loop (``rotate.c``, next to this module), built off the caller's path.

Eager PyTorch cannot rotate the "half" layout in one pass: each pair's halves lie ``r/2`` features
apart, so it takes three operations per block of tokens (:mod:`~ropelib.kernels.torch_kernel`),
and in place a buffer besides. ``rotate.c`` is the loop itself: for each token and head it reads
both halves of every pair, then writes both, so it reads ``x`` once and writes the output once
(in place: ``x`` itself), in either layout, at any strides with a unit stride on the features.
It is compiled by the system's C compiler (``$CC``, else ``cc``, ``gcc`` or ``clang``) into a
shared library loaded with ``ctypes``; a large call is split by tokens between
:func:`torch.get_num_threads` OpenMP threads, those of torch's own OpenMP runtime.

Compiling takes a fraction of a second but it is never done on a caller's call: the first call
that could use the library starts the build in a background thread and, like every call until the
build is done, is served by the eager kernel. The paths and their costs:

* **compiled** (a C compiler present, ``ROPELIB_CPU_COMPILE`` not ``0``; float32 or float64 inputs
  in the tables' dtype): one pass, at about the speed of ``clone()`` out of place and of a copy in
  place; a few microseconds per call for ``ctypes``, tens more when the call is split between
  threads (:data:`PARALLEL_ELEMENTS`); one background compile per process;
* **eager** (no compiler, turned off, not yet built, a failed build, other dtypes): the operations of
  :mod:`~ropelib.kernels.torch_kernel`, with the same results to float32 rounding (the compiler may
  fuse a product and a sum).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any

import torch

from .torch_kernel import rotate_half_few

#: ``ROPELIB_CPU_COMPILE=0`` in the environment turns the compiled path off.
ENV = "ROPELIB_CPU_COMPILE"
#: The C source, shipped with the package (it includes ``rotate_loop.h``, next to it).
SOURCE = Path(__file__).with_name("rotate.c")
#: Calls with at least this many elements of q and k together are split between threads; smaller
#: ones run in the caller's thread, where waking the others would cost more than it saves.
PARALLEL_ELEMENTS = 1 << 18
#: Out of place, the bytes of output whose pages are touched together before they are written
#: (``rotate.c``): the faults of fresh memory in runs, and the pages then in the cache.
TOUCH_BYTES = 512 << 10
#: The entry points of ``rotate.c``, by dtype.
FUNCTIONS = {torch.float32: "ropelib_rotate_f32", torch.float64: "ropelib_rotate_f64"}
#: The order of the sizes, strides (in elements) and flags of a call in ``rotate.c``'s ``struct geometry``.
GEOMETRY = (
    "batch", "seq", "heads", "dim", "r2", "length",
    "x_batch", "x_seq", "x_head", "out_batch", "out_seq", "out_head", "pos_batch", "pos_seq",
    "interleaved", "conjugate", "touch",
)  # fmt: skip
#: The compiler flags to try, in order. First OpenMP threads and code tuned for this processor,
#: then without OpenMP (Apple's clang has none, so one thread), then portable code.
FLAGS = (("-O3", "-march=native", "-fopenmp"), ("-O3", "-march=native"), ("-O3",))


def compiler() -> str | None:
    """The C compiler to build with: ``$CC`` when set, else the first of ``cc``, ``gcc``, ``clang`` found."""
    names = [os.environ["CC"]] if os.environ.get("CC") else ["cc", "gcc", "clang"]
    return next((path for path in map(shutil.which, names) if path), None)


def enabled() -> bool:
    """True when the compiled path may be used: not turned off by ``ROPELIB_CPU_COMPILE=0``, and a C compiler found."""
    return os.environ.get(ENV, "1") != "0" and compiler() is not None


class _Library:
    """The build's state: None (not asked), a thread (building), the loaded functions, or False (failed)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.state: Any = None


_LIBRARY = _Library()


def _compile(folder: str) -> ctypes.CDLL:
    """Compile ``rotate.c`` into ``folder`` with the first :data:`FLAGS` the compiler accepts, and load it."""
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler")
    target = os.path.join(folder, "rotate.so")
    for flags in FLAGS:
        command = [cc, *flags, "-fopenmp-simd", "-shared", "-fPIC", str(SOURCE), "-o", target]
        if subprocess.run(command, capture_output=True, timeout=120).returncode == 0:
            return ctypes.CDLL(target)
    raise RuntimeError(f"{cc} could not compile {SOURCE}")


def _build() -> None:
    """Build and load the library (in a background thread); on any failure the eager kernel stays."""
    functions: dict[Any, Any] | bool = False
    try:
        with tempfile.TemporaryDirectory(prefix="ropelib-") as folder:
            library = _compile(folder)  # loaded: the file may go
        functions = {}
        rows = library.ropelib_rotate_rows_f32
        pointer, integer = ctypes.c_void_p, ctypes.c_int64
        rows.argtypes = [pointer, pointer, integer, pointer, pointer, integer, pointer, pointer, integer]
        rows.restype = None
        functions["rows"] = rows
        for dtype, name in FUNCTIONS.items():
            function = getattr(library, name)
            function.argtypes = [pointer] * 5 + [ctypes.POINTER(ctypes.c_int64), integer]  # ..., geometry, threads
            function.restype = ctypes.c_int64
            functions[dtype] = function
    except Exception:  # no usable compiler, an unsupported platform: the eager kernel stays
        functions = False
    with _LIBRARY.lock:
        _LIBRARY.state = functions


def functions() -> dict[Any, Any] | None:
    """The loaded entry points (by dtype, and ``"rows"`` for :func:`rotate_few`) if the library is built; else
    None, starting the build on the first call (or, when :func:`enabled` is False then, marking it failed:
    the environment and the compiler are looked at once)."""
    state = _LIBRARY.state
    if isinstance(state, dict):
        return state
    if state is None:
        with _LIBRARY.lock:
            if _LIBRARY.state is None:
                if enabled():
                    _LIBRARY.state = threading.Thread(target=_build, name="ropelib-cpu-compile", daemon=True)
                    _LIBRARY.state.start()
                else:
                    _LIBRARY.state = False
    return None


def wait(timeout: float | None = None) -> bool:
    """Wait for a build in progress (a benchmark does, before timing); True when the library is loaded."""
    state = _LIBRARY.state
    if isinstance(state, threading.Thread):
        state.join(timeout)
    return isinstance(_LIBRARY.state, dict)


def fits(x: torch.Tensor, out: torch.Tensor, cos: torch.Tensor, positions: torch.Tensor) -> bool:
    """True when ``rotate.c`` can rotate ``x`` into ``out``: CPU, float32/float64 in the tables' dtype, unit feature strides, ``[B, S]`` positions."""
    return (
        x.device.type == "cpu"
        and x.dtype == cos.dtype
        and x.dtype in FUNCTIONS
        and out.dtype == x.dtype
        and x.stride(-1) == 1
        and out.stride(-1) == 1
        and positions.dtype == torch.int64
        and positions.shape == x.shape[:2]
    )


def _touch(x: torch.Tensor, out: torch.Tensor) -> int:
    """Tokens per run of page touching (``rotate_loop.h``): about :data:`TOUCH_BYTES` of a fresh contiguous output, else 0."""
    if out.data_ptr() == x.data_ptr() or not out.is_contiguous():
        return 0
    return max(1, TOUCH_BYTES // (out.shape[2] * out.shape[3] * out.element_size()))


def rotate_qk(
    q: torch.Tensor,
    k: torch.Tensor,
    q_out: torch.Tensor,
    k_out: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    *,
    interleaved: bool,
    conjugate: bool,
) -> bool:
    """Rotate ``q``/``k`` into ``q_out``/``k_out`` (which may be ``q``/``k``) with ``rotate.c``; False when it cannot.

    Same contract as :func:`~ropelib.kernels.torch_kernel.rotate_qk_torch`: ``q`` ``[B, S, Hq, D]``,
    ``k`` ``[B, S, Hk, D]``, contiguous ``[L, r/2]`` tables, int64 ``positions`` ``[B, S]`` in
    ``[0, L)``. False (nothing written) when the library is not built yet, a tensor does not
    :func:`fits` or the tables are not contiguous tables of one shape and dtype; then the caller
    uses the eager kernel.
    """
    table = functions()
    tables_fit = cos.is_contiguous() and sin.is_contiguous() and sin.shape == cos.shape and sin.dtype == cos.dtype
    if table is None or not (tables_fit and fits(q, q_out, cos, positions) and fits(k, k_out, cos, positions)):
        return False
    function = table[q.dtype]
    batch, seq = q.shape[:2]
    threads = torch.get_num_threads() if q.numel() + k.numel() >= PARALLEL_ELEMENTS else 1
    flags = (int(interleaved), int(conjugate))
    bad = 0
    for x, out in ((q, q_out), (k, k_out)):
        values = (batch, seq, x.shape[2], x.shape[3], cos.shape[1], cos.shape[0], *x.stride()[:3])
        values += (*out.stride()[:3], *positions.stride(), *flags, _touch(x, out))
        shape = (ctypes.c_int64 * len(GEOMETRY))(*values)
        pointers = (x.data_ptr(), out.data_ptr(), cos.data_ptr(), sin.data_ptr(), positions.data_ptr())
        bad += function(*pointers, shape, threads)
    if bad:
        raise IndexError(
            f"{bad} tokens of q and k (counted per tensor) have positions outside [0, {cos.shape[0]}): "
            "the caller skipped its check"
        )
    return True


def rotate_few(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`~ropelib.kernels.torch_kernel.rotate_half_few` (same arguments, same result to float32
    rounding), in one call of ``rotate.c`` when the library is built and the call is one position's:
    float32 contiguous ``q``/``k`` on the CPU and one wide row each of ``cos`` and ``signed_sin``
    (``[r]``, ``r = head_dim``), in eager mode. About a third of the four list operations' cost at a
    decode shape. Under :func:`torch.compile` the list operations are traced instead.
    """
    if torch.compiler.is_compiling():  # traced: the list operations are what a graph can hold
        return rotate_half_few(q, k, cos, signed_sin)
    table = functions()  # None until built (the first call starts the build)
    dim = q.shape[-1]
    if (
        table is not None
        and q.dtype == torch.float32
        and cos.dtype == torch.float32
        and signed_sin.dtype == torch.float32
        and q.device.type == "cpu"
        and cos.numel() == dim
        and signed_sin.numel() == dim
        and cos.stride(-1) == 1
        and signed_sin.stride(-1) == 1
        and q.is_contiguous()
        and k.is_contiguous()
    ):
        q_out, k_out = torch.empty_like(q), torch.empty_like(k)
        table["rows"](
            q.data_ptr(),
            q_out.data_ptr(),
            q.numel() // dim,
            k.data_ptr(),
            k_out.data_ptr(),
            k.numel() // dim,
            cos.data_ptr(),
            signed_sin.data_ptr(),
            dim,
        )
        return q_out, k_out
    return rotate_half_few(q, k, cos, signed_sin)
