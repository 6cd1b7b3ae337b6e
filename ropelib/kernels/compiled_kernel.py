r"""The out-of-place "half" rotation on the CPU as one loop compiled by Inductor, built off the caller's path.

Eager PyTorch cannot rotate the "half" layout in one pass: each pair's halves lie ``r/2`` features
apart, so the rotation is three operations (:mod:`~ropelib.kernels.torch_kernel`), and out of place
the first of them also pays the page faults of the fresh output. :func:`torch.compile` turns
:func:`rotation` (gather the cos/sin rows, rotate both halves, keep the rest) into one vectorised,
multi-threaded C++ loop that reads ``x`` once and writes each output page once, as ``clone()``
does. The "interleaved" layout needs none of this: it is one complex multiply already.

Compiling takes seconds, so it never happens on a caller's call. The first large call
(:data:`MIN_ELEMENTS`) of each kind (:func:`variant`: which of the head counts are 1, partial
rotary or not, sizes that :func:`torch.compile` specialises) starts the build in a background
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
#: ``ROPELIB_CPU_COMPILE=0`` in the environment turns the compiled path off.
ENV = "ROPELIB_CPU_COMPILE"

#: The compiled rotation's entry: ``(q_out, k_out)``, or None when the call must go to the eager kernel.
Rotation = Callable[..., tuple[torch.Tensor, torch.Tensor] | None]


def rotation(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The "half" rotation of ``q``/``k`` ``[B, S, H, D]`` by rows ``positions`` ``[B, S]`` of ``[L, r/2]`` tables.

    Written for :func:`torch.compile` (the eager kernels are :mod:`~ropelib.kernels.torch_kernel`):
    ``(a, b) -> (a c - b s, b c + a s)`` on the first ``r`` features, the rest copied.
    """
    r2 = cos.shape[-1]
    c, s = cos[positions].unsqueeze(2), sin[positions].unsqueeze(2)  # [B, S, 1, r/2]

    def one(x: torch.Tensor) -> torch.Tensor:
        a, b = x[..., :r2], x[..., r2 : 2 * r2]
        return torch.cat((a * c - b * s, b * c + a * s, x[..., 2 * r2 :]), -1)

    return one(q), one(k)


def enabled() -> bool:
    """True when the compiled path may be used: not turned off by ``ROPELIB_CPU_COMPILE=0``, and a C++ compiler found."""
    if os.environ.get(ENV, "1") == "0":
        return False
    return any(shutil.which(name) for name in ("g++", "c++", "clang++"))


def variant(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor) -> tuple[bool, ...]:
    """What a compiled graph is specialised on besides dtype and device: sizes equal to 1, partial rotary."""
    return (q.shape[0] == 1, q.shape[1] == 1, q.shape[2] == 1, k.shape[2] == 1, 2 * cos.shape[-1] < q.shape[-1])


class _Builds:
    """The compiled function and the state of each kind: absent (not asked), a thread (building), True, False (failed)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.function: Any = None
        self.kinds: dict[tuple[bool, ...], threading.Thread | bool] = {}


_BUILDS = _Builds()


def _example(kind: tuple[bool, ...]) -> tuple[torch.Tensor, ...]:
    """Small random inputs of one kind (sizes 1 where the kind has them), to check a build against eager."""
    batch1, seq1, q1, k1, partial = kind
    batch, seq = 1 if batch1 else 2, 1 if seq1 else 3
    head_dim, rotary = 16, 12 if partial else 16
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(batch, seq, 1 if q1 else 5, head_dim, generator=gen)
    k = torch.randn(batch, seq, 1 if k1 else 3, head_dim, generator=gen)
    angles = torch.rand(7, rotary // 2, generator=gen, dtype=torch.float64)
    positions = torch.randint(0, 7, (batch, seq), generator=gen)
    return q, k, angles.cos().float(), angles.sin().float(), positions


def _build(kind: tuple[bool, ...], shapes: tuple[torch.Size, ...]) -> None:
    """Compile for ``kind``, then check the compiled function against :func:`rotation` eager.

    The first graph is traced at the sizes of the call that asked for it (``shapes`` of q, k and the
    tables; inputs of ``torch.empty``, which a read maps to the zero page): the code generator
    chooses its loops and threads by the sizes it sees, and small stand-ins give a slower loop.
    Sizes that happen to be equal are not assumed equal later (no "duck" sizing).
    """
    ok = False
    try:
        with _BUILDS.lock:
            if _BUILDS.function is None:
                _BUILDS.function = torch.compile(rotation, dynamic=True)
            function = _BUILDS.function
        q_shape, k_shape, table_shape = shapes
        stand_ins = (
            torch.empty(q_shape),
            torch.empty(k_shape),
            torch.empty(table_shape),
            torch.empty(table_shape),
            torch.zeros(q_shape[:2], dtype=torch.int64),
        )
        example = _example(kind)
        with torch.no_grad(), torch.fx.experimental._config.patch(use_duck_shape=False):  # type: ignore[attr-defined]
            function(*stand_ins)
            got = function(*example)
        want = rotation(*example)
        ok = all(torch.allclose(g, w, rtol=0, atol=1e-5) for g, w in zip(got, want))
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
            if kind not in _BUILDS.kinds:
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
