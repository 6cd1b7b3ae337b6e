r"""The out-of-place "half" rotation on the CPU as one loop compiled by Inductor, built off the caller's path.

Eager PyTorch cannot rotate the "half" layout in one pass: each pair's halves lie ``r/2`` features
apart, so the rotation is three operations (:mod:`~ropelib.kernels.torch_kernel`), and out of place
the first of them also pays the page faults of the fresh output. :func:`torch.compile` turns
:func:`rotation` (gather the cos/sin rows, rotate both halves, keep the rest) into one vectorised,
multi-threaded C++ loop that reads ``x`` once and writes each output page once, as ``clone()``
does. The "interleaved" layout needs none of this: it is one complex multiply already.

Compiling takes seconds, so it never happens on a caller's call. The first large call
(:data:`MIN_ELEMENTS`) of each kind (:func:`variant`: the sizes equal to 1 and the sizes equal to
each other, on which :func:`torch.compile` specialises) starts the build in a background
thread and is served by the eager kernel, as is every call until that kind is ready; the compiled
function is then called with recompilation forbidden, so a call whose guards do not match falls
back to eager rather than compiling in the caller's thread. The paths and their costs:

* **compiled** (a C++ compiler present, ``ROPELIB_CPU_COMPILE`` not ``0``): one pass, at about the
  speed of ``clone()``; a few seconds of one background thread per kind, once per process;
* **eager** (no compiler, disabled, not yet built, or a failed build: the failure is kept and the
  eager kernel serves every later call): three operations per cache-sized block.

Both give the rotation to float32 rounding: the products and the sum are the same, possibly fused
differently (within a few float32 ulps of ``|x|``).
"""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Callable
from typing import Any

import torch

#: Calls with fewer elements of q and k together are left to the eager kernel (its fixed costs are
#: small there, and a compiled call has its own: guards, dispatch).
MIN_ELEMENTS = 1 << 22
#: The most kinds built in one process, each a graph of its own. Calls of other kinds stay eager,
#: rather than growing the compiled function's cache towards its recompile limit.
MAX_KINDS = 4
#: ``ROPELIB_CPU_COMPILE=0`` in the environment turns the compiled path off.
ENV = "ROPELIB_CPU_COMPILE"

#: The compiled rotation's entry: ``(q_out, k_out)``, or None when the call must go to the eager kernel.
Rotation = Callable[..., tuple[torch.Tensor, torch.Tensor] | None]


def rotation(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The "half" rotation, written for :func:`torch.compile`.

    ``q``/``k`` ``[B, S, H, D]``; rows ``positions`` ``[B, S]`` of the
    ``[L, r/2]`` tables. ``(a, b) -> (a c - b s, b c + a s)`` on the first
    ``r`` features, the rest copied. The eager kernels are in
    :mod:`~ropelib.kernels.torch_kernel`.
    """
    r2 = cos.shape[-1]
    c = cos[positions].unsqueeze(2)  # [B, S, 1, r/2]
    s = sin[positions].unsqueeze(2)

    def one(x: torch.Tensor) -> torch.Tensor:
        a, b = x[..., :r2], x[..., r2 : 2 * r2]
        rest = x[..., 2 * r2 :]
        return torch.cat((a * c - b * s, b * c + a * s, rest), -1)

    return one(q), one(k)


def enabled() -> bool:
    """True when the compiled path may be used: not turned off by ``ROPELIB_CPU_COMPILE=0``, and a C++ compiler found."""
    if os.environ.get(ENV, "1") == "0":
        return False
    return any(shutil.which(name) for name in ("g++", "c++", "clang++"))


def variant(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor) -> tuple[int, ...]:
    """What a compiled graph is specialised on besides dtype and device: which sizes are 1 and which are equal.

    :func:`torch.compile` treats sizes 0 and 1 as constants and assumes sizes that were equal when it
    traced to stay equal, so calls that differ in these get a graph (a build) of their own.
    """
    sizes = (*q.shape, k.shape[2], *cos.shape)
    return tuple(-1 if size == 1 else sizes.index(size) for size in sizes)


class _Builds:
    """The compiled function and the state of each kind: absent (not asked), a thread (building), True, False (failed)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.function: Any = None
        self.kinds: dict[tuple[int, ...], threading.Thread | bool] = {}


_BUILDS = _Builds()


def _stand_ins(shapes: tuple[torch.Size, ...]) -> tuple[torch.Tensor, ...]:
    """Inputs of the caller's shapes for the build, from ``torch.empty``: only the first tokens of the
    first row are set (random values, positions in the first rows of the tables), so memory is
    spent on the outputs alone; those tokens check the build against eager."""
    q_shape, k_shape, table_shape = shapes
    gen = torch.Generator().manual_seed(0)
    q, k = torch.empty(q_shape), torch.empty(k_shape)
    cos, sin = torch.empty(table_shape), torch.empty(table_shape)
    positions = torch.zeros(q_shape[:2], dtype=torch.int64)
    rows = min(7, table_shape[0])
    angles = torch.rand(rows, table_shape[1], generator=gen, dtype=torch.float64)
    cos[:rows], sin[:rows] = angles.cos(), angles.sin()
    tokens = min(3, q_shape[1])
    q[0, :tokens] = torch.randn(q[0, :tokens].shape, generator=gen)
    k[0, :tokens] = torch.randn(k[0, :tokens].shape, generator=gen)
    positions[0, :tokens] = torch.randint(0, rows, (tokens,), generator=gen)
    return q, k, cos, sin, positions


def _build(kind: tuple[int, ...], shapes: tuple[torch.Size, ...]) -> None:
    """Compile for ``kind`` at the sizes of the call that asked for it, and check against eager.

    The code generator chooses its loops and threads by the sizes it sees (a graph traced on small
    stand-ins is markedly slower on large inputs), so the one graph of a kind is traced on inputs of
    the caller's shapes (:func:`_stand_ins`). The first tokens are compared with :func:`rotation` run
    eagerly on them.
    """
    ok = False
    try:
        with _BUILDS.lock:
            if _BUILDS.function is None:
                _BUILDS.function = torch.compile(rotation, dynamic=True)
            function = _BUILDS.function
        q, k, cos, sin, positions = _stand_ins(shapes)
        tokens = min(3, q.shape[1])
        with torch.no_grad():
            got = function(q, k, cos, sin, positions)
            want = rotation(q[:1, :tokens], k[:1, :tokens], cos, sin, positions[:1, :tokens])
        ok = all(torch.allclose(g[:1, :tokens], w, rtol=0, atol=1e-5) for g, w in zip(got, want))
    except Exception:  # no usable compiler, an unsupported platform: the eager kernel stays
        ok = False
    with _BUILDS.lock:
        _BUILDS.kinds[kind] = ok


def ready(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor) -> Rotation | None:
    """The compiled rotation for this call if it is built; else None, starting the build when the call is large.

    The caller has checked the rest: CPU, float32 q/k and tables, out of place, no gradient recorded,
    eager (not under :func:`torch.compile`), unit strides.
    """
    if q.numel() + k.numel() < MIN_ELEMENTS or not (q.is_contiguous() and k.is_contiguous()):
        return None
    kind = variant(q, k, cos)
    state = _BUILDS.kinds.get(kind)
    if state is True:
        return _call
    if state is None and enabled():
        with _BUILDS.lock:
            if kind not in _BUILDS.kinds and len(_BUILDS.kinds) < MAX_KINDS:
                shapes = (q.shape, k.shape, cos.shape)
                thread = threading.Thread(target=_build, args=(kind, shapes), name="ropelib-cpu-compile", daemon=True)
                _BUILDS.kinds[kind] = thread
                thread.start()
    return None


def _call(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The compiled function, never compiling in the caller's thread: None when its guards would need a new graph."""
    try:
        with torch.no_grad(), torch.compiler.set_stance("fail_on_recompile"):  # no_grad: as built (a guard)
            q_out, k_out = _BUILDS.function(q, k, cos, sin, positions)
    except Exception:
        return None
    return q_out, k_out


def wait(timeout: float | None = None) -> bool:
    """Wait for the builds started so far (a benchmark does, before timing); True when all of them succeeded."""
    with _BUILDS.lock:
        threads = [t for t in _BUILDS.kinds.values() if isinstance(t, threading.Thread)]
    for thread in threads:
        thread.join(timeout)
    with _BUILDS.lock:
        return all(state is True for state in _BUILDS.kinds.values())
