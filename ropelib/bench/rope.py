r"""RoPE implementations side by side at one configuration: ropelib, its peers, checked against float64 first.

For every shape ``(batch, seq, q_heads, kv_heads, head_dim)``, dtype, layout and mode (forward, or
forward + backward) :func:`run_config` times every available implementation, interleaved round by
round in one process so that a noisy machine slows all of them alike, and reports

* the median time after warm-up (CUDA events on a GPU, so compilation and launch queues are
  excluded; ``time.perf_counter`` on a CPU);
* the achieved bandwidth, :func:`rope_bytes` divided by the median: the bytes the operation
  cannot avoid moving, the same numerator for every implementation;
* that bandwidth as a percentage of the *true roof* of its kind (:data:`ROOFS`), timed in the same
  rounds on the same tensors: for an in-place rotation an in-place scale ``x.mul_(c)`` of q and k
  (one read and one write of each element, as the rotation needs), for an out-of-place one a fresh
  ``torch.mul(x, c)`` (the same read, write and page faults of a new output). A copy is no roof
  for an in-place operation: it moves three streams (read, write-allocate, write) where an
  in-place update moves two.

Each implementation's output is checked against the float64 reference
(:func:`ropelib.apply_rotary`) before it is timed.
"""

from __future__ import annotations

import functools
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .._validation import check_choice
from ..complex_rope import apply_rotary_emb
from ..kernels import rotary_qk
from ..layouts import rotate_half
from ..reference import apply_rotary
from ..rotary import RotaryEmbedding
from .harness import time_interleaved

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MODES = ("fwd", "fwd+bwd")
CPU_SHAPE = (4, 2048, 32, 32, 128)
#: A prefill of one sequence with grouped key/value heads, whose q and k fit in a CPU's last-level cache.
PREFILL_SHAPE = (1, 512, 32, 8, 128)
GPU_SHAPE = (1, 8192, 32, 8, 128)

#: Every implementation :func:`implementations` may offer (which ones run depends on the device and installs).
IMPL_NAMES = (
    "ropelib",
    "ropelib (in place)",
    "ropelib (torch path)",
    "HF eager",
    "seed complex",
    "torch.compile(HF eager)",
    "rotary-embedding-torch",
    "liger-kernel",
    "flash-attn",
)

Impl = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
#: The roofs' rows: q and k scaled in place (the roof of an in-place rotation) and into fresh tensors
#: (the roof of an out-of-place one).
INPLACE_ROOF, FRESH_ROOF = "roof: x.mul_(c)", "roof: torch.mul(x, c)"
ROOFS = (INPLACE_ROOF, FRESH_ROOF)


def roof_of(impl: str) -> str:
    """The roof an implementation is measured against: the in-place one for in-place rows."""
    return INPLACE_ROOF if impl == INPLACE_ROOF or "in place" in impl else FRESH_ROOF


def rope_bytes(
    batch: int, seq: int, q_heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, mode: str = "fwd"
) -> int:
    r"""The bytes a RoPE pass cannot avoid: read q and k once, write them once, read the cos/sin rows once.

    .. math:: B_{\text{fwd}} = 2\,b\,s\,(h_q + h_k)\,d\,e + 2\,s\,\tfrac{d}{2}\cdot 4

    with ``e`` the element size (float32 tables). The backward pass is the same rotation of the
    gradients, so ``fwd+bwd`` moves twice as much.

    Example:
        >>> rope_bytes(1, 2, 1, 1, 4, torch.float32)  # 2 * (8 + 8) * 4 + 2 * 2 * 2 * 4
        160
    """
    mode = check_choice(mode, "mode", MODES)
    tensors = 2 * batch * seq * (q_heads + kv_heads) * head_dim * torch.empty(0, dtype=dtype).element_size()
    tables = 2 * seq * (head_dim // 2) * 4
    return (tensors + tables) * (2 if mode == "fwd+bwd" else 1)


# ----------------------------------------------------------------------------- peers


def _full_width(
    cos: torch.Tensor, sin: torch.Tensor, layout: str, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[S, d_rot/2]`` tables widened to ``[S, 1, d_rot]`` in ``dtype``, the way eager code holds them."""
    if layout == "half":
        cos, sin = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
    else:
        cos, sin = cos.repeat_interleave(2, -1), sin.repeat_interleave(2, -1)
    return cos[:, None, :].to(dtype), sin[:, None, :].to(dtype)


def _rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    """GPT-J's ``rotate_every_two``: ``(x0, x1, x2, x3, ...) -> (-x1, x0, -x3, x2, ...)``."""
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def eager_peer(cos: torch.Tensor, sin: torch.Tensor, layout: str, dtype: torch.dtype) -> Impl:
    """Hugging Face-style eager RoPE: ``x * cos + rotate_half(x) * sin`` in the input dtype."""
    wide_cos, wide_sin = _full_width(cos, sin, layout, dtype)
    turn = rotate_half if layout == "half" else _rotate_pairs

    def eager(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return q * wide_cos + turn(q) * wide_sin, k * wide_cos + turn(k) * wide_sin

    return eager


def implementations(
    cos: torch.Tensor,
    sin: torch.Tensor,
    layout: str,
    dtype: torch.dtype,
    device: torch.device,
    *,
    compile_peer: bool = True,
) -> tuple[dict[str, tuple[Impl, str]], dict[str, str]]:
    """The implementations available here: name -> (function, the layout it computes), and name -> why skipped.

    ``cos``/``sin`` are the float32 ``[seq, d_rot/2]`` tables. Peers that only know the interleaved
    pairing (the seed's complex code, rotary-embedding-torch) are timed in both runs and checked
    against the interleaved reference.
    """
    impls: dict[str, tuple[Impl, str]] = {}
    skipped: dict[str, str] = {}
    impls["ropelib"] = ((lambda q, k: rotary_qk(q, k, cos, sin, layout=layout)), layout)
    impls["ropelib (in place)"] = ((lambda q, k: rotary_qk(q, k, cos, sin, layout=layout, inplace=True)), layout)
    if device.type == "cuda":
        impls["ropelib (torch path)"] = (
            (lambda q, k: rotary_qk(q, k, cos, sin, layout=layout, kernel="torch")),
            layout,
        )
    eager = eager_peer(cos, sin, layout, dtype)
    impls["HF eager"] = (eager, layout)
    pos_cis = torch.complex(cos, sin)
    impls["seed complex"] = ((lambda q, k: apply_rotary_emb(q, k, pos_cis)), "interleaved")
    if compile_peer:
        # compiled afresh for each configuration: the eager function's code is the same for all of
        # them, and past dynamo's recompile limit a cached one would silently run eagerly
        torch._dynamo.reset()
        impls["torch.compile(HF eager)"] = (torch.compile(eager), layout)
    try:
        from rotary_embedding_torch import apply_rotary_emb as ret_apply  # type: ignore[import-untyped]

        freqs = torch.atan2(sin, cos).repeat_interleave(2, -1)[:, None, :]  # [S, 1, r]: its table of angles

        def ret(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return ret_apply(freqs, q), ret_apply(freqs, k)

        impls["rotary-embedding-torch"] = (ret, "interleaved")
    except ImportError:
        skipped["rotary-embedding-torch"] = "not installed"
    if device.type != "cuda":
        skipped["liger-kernel"] = "Triton-only; on a CPU it would run in the interpreter"
        skipped["flash-attn"] = "CUDA-only"
        return impls, skipped
    try:
        from liger_kernel.ops.rope import LigerRopeFunction  # type: ignore[import-untyped]

        wide_cos, wide_sin = torch.cat((cos, cos), -1)[None], torch.cat((sin, sin), -1)[None]

        def liger(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            qo, ko = LigerRopeFunction.apply(q.transpose(1, 2), k.transpose(1, 2), wide_cos, wide_sin)
            return qo.transpose(1, 2), ko.transpose(1, 2)

        impls["liger-kernel"] = (liger, "half")
    except ImportError:
        skipped["liger-kernel"] = "not installed"
    try:
        from flash_attn.layers.rotary import apply_rotary_emb as fa_apply  # type: ignore[import-not-found]

        interleaved = layout == "interleaved"

        def flash(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return fa_apply(q, cos, sin, interleaved=interleaved), fa_apply(k, cos, sin, interleaved=interleaved)

        impls["flash-attn"] = (flash, layout)
    except ImportError:
        skipped["flash-attn"] = "not installed"
    return impls, skipped


# ----------------------------------------------------------------------------- one configuration


@dataclass
class Result:
    """One implementation at one configuration."""

    impl: str
    shape: list[int]
    dtype: str
    layout: str
    mode: str
    median_ms: float
    times_ms: list[float]
    bytes: int
    gbs: float
    roof: str
    pct_roof: float
    max_abs_error: float
    tolerance: float
    correct: bool
    ratio_to_ropelib: float = field(default=float("nan"))


def reference_tolerance(dtype: torch.dtype) -> float:
    """Largest accepted ``max|out - ref| / max(1, max|ref|)``: two units in the last place of ``dtype``
    (ropelib rounds once; eager peers working in ``dtype`` round three times, each by at most half
    a unit of a term no larger than the largest input) plus 1e-5 for float32 arithmetic."""
    return 2 * torch.finfo(dtype).eps + 1e-5


def _max_error(out: tuple[torch.Tensor, torch.Tensor], ref: tuple[torch.Tensor, torch.Tensor]) -> float:
    errors = [(o.double() - r).abs().max().item() / max(1.0, r.abs().max().item()) for o, r in zip(out, ref)]
    return max(errors)


def run_config(
    shape: Sequence[int],
    dtype: torch.dtype,
    layout: str,
    mode: str,
    device: torch.device,
    *,
    reps: int,
    warmup: int,
    only: Sequence[str] | None = None,
    compile_peer: bool = True,
    progress: Any = None,
) -> tuple[list[Result], dict[str, str]]:
    """Time every implementation and the two :data:`ROOFS` on one configuration; see the module docstring.

    The roofs' rows move q and k once (read and write), the bytes of one forward pass, and multiply
    by one (exact). In ``fwd+bwd`` mode a rotation moves twice the bytes and its percentage is of the
    same roofs (a pass forward and a pass back, each bounded by one roof pass).
    """
    batch, seq, q_heads, kv_heads, head_dim = shape
    gen = torch.Generator(device="cpu").manual_seed(0)
    q = torch.randn(batch, seq, q_heads, head_dim, generator=gen).to(device=device, dtype=dtype)
    k = torch.randn(batch, seq, kv_heads, head_dim, generator=gen).to(device=device, dtype=dtype)
    rope = RotaryEmbedding(head_dim, layout=layout)
    cos, sin = (t[:seq] for t in rope.cos_sin_cache(seq, device))
    impls, skipped = implementations(cos, sin, layout, dtype, device, compile_peer=compile_peer)
    if only is not None:
        impls = {name: v for name, v in impls.items() if name in only or name == "ropelib"}
    if mode == "fwd+bwd":  # the timed q and k are leaves, which no in-place operation may overwrite
        impls.pop("ropelib (in place)", None)
    if progress is not None:
        progress.total += len(impls) * (reps + warmup)
        progress.refresh()
    refs = {}
    for ref_layout in {impl_layout for _, impl_layout in impls.values()}:
        cos64, sin64 = RotaryEmbedding(head_dim, layout=ref_layout).cos_sin(
            torch.arange(seq, device=device), torch.float64
        )
        refs[ref_layout] = (
            apply_rotary(q.double(), cos64, sin64, layout=ref_layout),
            apply_rotary(k.double(), cos64, sin64, layout=ref_layout),
        )
    errors = {}
    with torch.no_grad():
        for name, (fn, impl_layout) in impls.items():  # on copies: some rotate in place
            errors[name] = _max_error(fn(q.clone(), k.clone()), refs[impl_layout])
    del refs
    own = (q.clone(), k.clone())  # rotated over and over in place, so that the others' q and k stay as they are
    one = torch.ones((), dtype=dtype, device=device)  # x * 1 reproduces x: the roofs change nothing
    roofs: dict[str, Callable[[], Any]] = {
        INPLACE_ROOF: lambda: torch._foreach_mul_(list(own), one),
        FRESH_ROOF: lambda: (torch.mul(q, one), torch.mul(k, one)),
    }
    errors[INPLACE_ROOF] = errors[FRESH_ROOF] = 0.0  # multiplying by one is exact
    if progress is not None:
        progress.total += len(roofs) * (reps + warmup)
    if mode == "fwd":
        calls: dict[str, Callable[[], Any]] = {
            name: functools.partial(fn, *(own if name == "ropelib (in place)" else (q, k)))
            for name, (fn, _) in impls.items()
        }
        with torch.no_grad():
            times = time_interleaved({**roofs, **calls}, device, reps=reps, warmup=warmup, progress=progress)
    else:
        qg, kg = q.clone().requires_grad_(), k.clone().requires_grad_()
        grads = (torch.randn_like(q), torch.randn_like(k))

        def step(fn: Impl) -> None:
            torch.autograd.grad(fn(qg, kg), (qg, kg), grads)

        calls = {name: functools.partial(step, fn) for name, (fn, _) in impls.items()}
        times = time_interleaved({**roofs, **calls}, device, reps=reps, warmup=warmup, progress=progress)
    fwd_bytes = rope_bytes(batch, seq, q_heads, kv_heads, head_dim, dtype)
    mode_bytes = rope_bytes(batch, seq, q_heads, kv_heads, head_dim, dtype, mode)
    roof_gbs = {name: fwd_bytes / statistics.median(times[name]) / 1e9 for name in ROOFS}
    tol = reference_tolerance(dtype)
    results = []
    for name in (*roofs, *impls):
        median = statistics.median(times[name])
        nbytes = fwd_bytes if name in roofs else mode_bytes
        gbs = nbytes / median / 1e9
        results.append(
            Result(
                impl=name,
                shape=list(shape),
                dtype=str(dtype).removeprefix("torch."),
                layout=layout,
                mode=mode,
                median_ms=median * 1e3,
                times_ms=[t * 1e3 for t in times[name]],
                bytes=nbytes,
                gbs=gbs,
                roof=roof_of(name),
                pct_roof=100.0 * gbs / roof_gbs[roof_of(name)],
                max_abs_error=errors[name],
                tolerance=tol,
                correct=errors[name] <= tol,
            )
        )
    ours = next(r.median_ms for r in results if r.impl == "ropelib")
    for r in results:
        r.ratio_to_ropelib = r.median_ms / ours
    return results, skipped
