r"""The rotation fused with the KV-cache write against the two-step path, at serving shapes.

A shape is ``(tokens, q_heads, kv_heads, head_dim, block_size)``: ``tokens`` new tokens (vLLM's
flattened batch) whose q and k are rotated and whose rotated k and v go into a paged cache
``[num_blocks, block_size, kv_heads, head_dim]`` with :data:`SPARE` times more slots than
tokens (the other sequences' rows). A ``decode`` shape puts each token in its own sequence, at
a random slot; a ``prefill`` shape is one sequence, its rows consecutive within blocks taken in
a random order, as a block allocator hands them out. All slots are valid (no padding).

Rows, timed interleaved round by round in one process (:func:`~ropelib.bench.time_interleaved`):

* ``fused``: :func:`ropelib.rotary_kv_cache_write` (the kernel ``"auto"`` picks), and on the CPU
  the same with ``kernel="torch"`` (PyTorch ops: a rotation, then one ``index_put_`` per cache);
* ``fused, q in place``: the same with ``inplace=True`` (``ropelib::rotary_kv_write_inplace_``:
  q rotated where it lies, as vLLM rotates it);
* ``two-step``: ``rotary_qk`` (a fresh q and k), then ``index_copy_`` of the rotated k and of v
  into the caches: the baseline, the same result bit for bit (checked), and the same contract
  (a fresh rotated q); and ``two-step (in place)``, vLLM's order: q and k rotated in place, then
  the copy;
* the roof (:data:`KV_ROOF`): PyTorch's own elementwise ops moving the fused write's streams,
  each into the kind of memory the fused op writes: ``torch.mul(q, 1)`` into a fresh tensor (as
  the rotated q is; read, page faults, write) and ``torch.mul(k, 1, out=...)``,
  ``torch.mul(v, 1, out=...)`` into as many rows of the caches themselves (read k and v, write
  memory already in use, the cache rows' cost). It is the true roof of the fused op in the sense
  of :mod:`ropelib.bench.rope`: what the operation's unavoidable bytes cost when moved by a
  kernel that does nothing else; the cos/sin rows and the slots are left out of it (they are
  1/64 of the bytes at head_dim 128 or less). The rows that rotate q in place are measured
  against the in-place roof (:data:`KV_ROOF_INPLACE`: ``q.mul_(1)``, the same k and v streams),
  and their speedup is over the in-place two-step path; the others against the fresh roof and
  the fresh two-step path.

Bytes (:func:`kv_write_bytes`), the numerator of every row's GB/s: read q, write q out, read k
and v, write their cache rows, read the tokens' cos/sin rows, positions and slots. The two-step
path moves more (:func:`two_step_bytes`): the rotated k is written to a fresh tensor and read
again by the copy.
"""

from __future__ import annotations

import functools
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .._validation import check_choice
from ..kernels import rotary_qk
from ..kernels.registry import resolve
from ..rotary import RotaryEmbedding
from ..serving.kv_cache import rotary_kv_cache_write
from .harness import time_interleaved

#: ``(tokens, q_heads, kv_heads, head_dim, block_size)``.
KVShape = tuple[int, int, int, int, int]
#: How tokens find their slots: ``decode`` (one per sequence, scattered) or ``prefill`` (one sequence).
KINDS = ("decode", "prefill")
#: The CPU shapes: a decoding step of 64 sequences and a 2048-token prefill, Llama-3-8B's heads.
CPU_KV_SHAPES: tuple[tuple[str, KVShape], ...] = (("decode", (64, 32, 8, 128, 16)), ("prefill", (2048, 32, 8, 128, 16)))
#: The GPU shapes: a decoding step of 256 sequences and a 16384-token prefill.
GPU_KV_SHAPES: tuple[tuple[str, KVShape], ...] = (
    ("decode", (256, 32, 8, 128, 16)),
    ("prefill", (16384, 32, 8, 128, 16)),
)
#: The cache holds this many times the tokens' slots.
SPARE = 4
KV_ROOF = "roof: mul(q) fresh, mul(k, v) into cache rows"
KV_ROOF_INPLACE = "roof: q.mul_(1), mul(k, v) into cache rows"
FUSED, FUSED_TORCH = "fused rotary_kv_cache_write", "fused (kernel='torch')"
FUSED_INPLACE = "fused, q in place (inplace=True)"
TWO_STEP, TWO_STEP_INPLACE = "two-step: rotary_qk + index_copy_", "two-step (in place) + index_copy_"


def kv_write_bytes(tokens: int, q_heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    r"""The bytes the fused write cannot avoid: q read and written, k and v read and written into the caches,
    the tokens' cos/sin rows (float32) and their int64 positions and slots read.

    .. math:: B = 2\,T\,(h_q + 2 h_k)\,d\,e + T\,(2 \cdot \tfrac{d}{2} \cdot 4 + 2 \cdot 8)

    Example:
        >>> kv_write_bytes(1, 2, 1, 4, torch.float32)  # 2 * (2 + 2) * 4 * 4 + (2 * 2 * 4 + 16)
        160
    """
    element = torch.empty(0, dtype=dtype).element_size()
    return 2 * tokens * (q_heads + 2 * kv_heads) * head_dim * element + tokens * (2 * (head_dim // 2) * 4 + 2 * 8)


def two_step_bytes(tokens: int, q_heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """:func:`kv_write_bytes` plus the rotated k written to a fresh tensor and read back by the copy.

    Example:
        >>> two_step_bytes(1, 2, 1, 4, torch.float32) - kv_write_bytes(1, 2, 1, 4, torch.float32)
        32
    """
    element = torch.empty(0, dtype=dtype).element_size()
    return kv_write_bytes(tokens, q_heads, kv_heads, head_dim, dtype) + 2 * tokens * kv_heads * head_dim * element


@dataclass
class KVResult:
    """One row at one configuration."""

    impl: str
    kind: str
    shape: list[int]
    cache_slots: int
    dtype: str
    layout: str
    median_ms: float
    times_ms: list[float]
    bytes: int
    path_bytes: int
    gbs: float
    roof: str
    pct_roof: float
    speedup_over_two_step: float
    #: The rotated q and both caches equal to the two-step path's with ``kernel="torch"``; None for the roof.
    bitwise_equal_to_two_step: bool | None


def slot_mapping(kind: str, tokens: int, block_size: int, num_blocks: int, generator: torch.Generator) -> torch.Tensor:
    """Distinct slots for ``tokens`` tokens: scattered (``decode``) or one sequence's blocks (``prefill``)."""
    kind = check_choice(kind, "kind", KINDS)
    if kind == "decode":
        return torch.randperm(num_blocks * block_size, generator=generator)[:tokens]
    blocks = torch.randperm(num_blocks, generator=generator)[: -(-tokens // block_size)]
    return (blocks[:, None] * block_size + torch.arange(block_size)).flatten()[:tokens]


def _two_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_rows: torch.Tensor,
    v_rows: torch.Tensor,
    slots: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    *,
    layout: str,
    inplace: bool = False,
    kernel: str = "auto",
) -> torch.Tensor:
    """``rotary_qk`` on ``[1, T, H, D]`` views, then ``index_copy_`` into the caches' ``[slots, H, D]`` views."""
    q_rot, k_rot = rotary_qk(q[None], k[None], cos, sin, positions, layout=layout, inplace=inplace, kernel=kernel)
    k_rows.index_copy_(0, slots, k_rot[0])
    v_rows.index_copy_(0, slots, v)
    return q_rot[0]


def run_kv_config(
    kind: str,
    shape: Sequence[int],
    dtype: torch.dtype,
    layout: str,
    device: torch.device,
    *,
    reps: int,
    warmup: int,
) -> list[KVResult]:
    """Time the rows of the module docstring at one configuration, after checking their bits."""
    tokens, q_heads, kv_heads, head_dim, block_size = shape
    gen = torch.Generator().manual_seed(0)
    num_blocks = -(-SPARE * tokens // block_size)
    q, k, v = (torch.randn(tokens, h, head_dim, generator=gen).to(device, dtype) for h in (q_heads, kv_heads, kv_heads))
    k_cache, v_cache = (
        torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(device, dtype) for _ in "kv"
    )
    length = 8 * tokens
    positions = torch.randint(0, length, (tokens,), generator=gen).to(device)
    slots = slot_mapping(kind, tokens, block_size, num_blocks, gen).to(device)
    cos, sin = RotaryEmbedding(head_dim).cos_sin_cache(length, device)
    k_rows, v_rows = k_cache.view(-1, kv_heads, head_dim), v_cache.view(-1, kv_heads, head_dim)
    fused = functools.partial(rotary_kv_cache_write, layout=layout)
    args = (q, k, v, k_cache, v_cache, slots, cos, sin, positions)
    impls: dict[str, Callable[[], Any]] = {
        FUSED: functools.partial(fused, *args),
        TWO_STEP: functools.partial(_two_step, q, k, v, k_rows, v_rows, slots, cos, sin, positions, layout=layout),
    }
    if resolve("auto", device, dtype) != "torch":
        impls[FUSED_TORCH] = functools.partial(fused, *args, kernel="torch")
    q_own, k_own = q.clone(), k.clone()  # rotated over and over in place: the others' q and k stay as they are
    impls[TWO_STEP_INPLACE] = functools.partial(
        _two_step, q_own, k_own, v, k_rows, v_rows, slots, cos, sin, positions, layout=layout, inplace=True
    )
    impls[FUSED_INPLACE] = functools.partial(fused, q.clone(), *args[1:], inplace=True)
    one = torch.ones((), dtype=dtype, device=device)  # x * 1 is x: the roof moves bytes, nothing else
    k_slab, v_slab = k_rows[:tokens], v_rows[:tokens]  # as many cache rows as the tokens write

    q_scaled = q.clone()

    def roof() -> None:
        torch.mul(q, one)
        torch.mul(k, one, out=k_slab)
        torch.mul(v, one, out=v_slab)

    def roof_inplace() -> None:
        q_scaled.mul_(one)
        torch.mul(k, one, out=k_slab)
        torch.mul(v, one, out=v_slab)

    with torch.no_grad():
        same = _check_bits(impls, args, layout)
        roofs = {KV_ROOF: roof, KV_ROOF_INPLACE: roof_inplace}
        times = time_interleaved({**roofs, **impls}, device, reps=reps, warmup=warmup)
    nbytes = kv_write_bytes(tokens, q_heads, kv_heads, head_dim, dtype)
    roof_bytes = nbytes - tokens * (2 * (head_dim // 2) * 4 + 2 * 8)
    paths = {
        KV_ROOF: roof_bytes,
        KV_ROOF_INPLACE: roof_bytes,
        TWO_STEP: two_step_bytes(tokens, q_heads, kv_heads, head_dim, dtype),
        TWO_STEP_INPLACE: two_step_bytes(tokens, q_heads, kv_heads, head_dim, dtype),
    }
    medians = {name: statistics.median(values) for name, values in times.items()}
    results = []
    for name, values in times.items():
        in_place = name in (KV_ROOF_INPLACE, TWO_STEP_INPLACE, FUSED_INPLACE)
        roof_name, baseline = (KV_ROOF_INPLACE, TWO_STEP_INPLACE) if in_place else (KV_ROOF, TWO_STEP)
        results.append(
            KVResult(
                impl=name,
                kind=kind,
                shape=list(shape),
                cache_slots=num_blocks * block_size,
                dtype=str(dtype).removeprefix("torch."),
                layout=layout,
                median_ms=medians[name] * 1e3,
                times_ms=[t * 1e3 for t in values],
                bytes=nbytes,
                path_bytes=paths.get(name, nbytes),
                gbs=nbytes / medians[name] / 1e9,
                roof=roof_name,
                pct_roof=100.0 * medians[roof_name] / medians[name],
                speedup_over_two_step=medians[baseline] / medians[name],
                bitwise_equal_to_two_step=same.get(name),
            )
        )
    return results


def _check_bits(impls: dict[str, Callable[[], Any]], args: tuple[torch.Tensor, ...], layout: str) -> dict[str, bool]:
    """Each row's rotated q and caches, on copies of the caches, against the two-step path's (torch kernel)."""
    q, k, v, k_cache, v_cache, slots, cos, sin, positions = args

    def outputs(name: str) -> tuple[torch.Tensor, ...]:
        kc, vc = k_cache.clone(), v_cache.clone()
        if name in (FUSED, FUSED_TORCH, FUSED_INPLACE):
            kernel = "torch" if name == FUSED_TORCH else "auto"
            q_out = rotary_kv_cache_write(
                q.clone(), k, v, kc, vc, slots, cos, sin, positions, layout=layout, kernel=kernel,
                inplace=name == FUSED_INPLACE,
            )  # fmt: skip
        else:
            rows = (kc.view(-1, *kc.shape[2:]), vc.view(-1, *vc.shape[2:]))
            inplace = name == TWO_STEP_INPLACE
            q_out = _two_step(
                q.clone(), k.clone(), v, *rows, slots, cos, sin, positions, layout=layout, inplace=inplace
            )
        return q_out, kc, vc

    kc, vc = k_cache.clone(), v_cache.clone()
    rows = (kc.view(-1, *kc.shape[2:]), vc.view(-1, *vc.shape[2:]))
    want = (_two_step(q, k, v, *rows, slots, cos, sin, positions, layout=layout, kernel="torch"), kc, vc)
    return {name: all(torch.equal(a, b) for a, b in zip(outputs(name), want)) for name in impls}


def kv_write_rows(
    device: torch.device,
    *,
    shapes: Sequence[tuple[str, KVShape]] | None = None,
    dtypes: Sequence[torch.dtype] = (torch.float32, torch.bfloat16),
    layouts: Sequence[str] = ("half",),
    reps: int = 7,
    warmup: int = 2,
) -> list[dict]:
    """:func:`run_kv_config` at every ``(kind, shape)``, dtype and layout, as JSON-ready dicts."""
    from dataclasses import asdict

    shapes = shapes or (GPU_KV_SHAPES if device.type == "cuda" else CPU_KV_SHAPES)
    rows = []
    for kind, shape in shapes:
        for dtype in dtypes:
            for layout in layouts:
                rows += [asdict(r) for r in run_kv_config(kind, shape, dtype, layout, device, reps=reps, warmup=warmup)]
    return rows


def format_kv_table(rows: Sequence[dict]) -> str:
    """One block per configuration, the roof first, at most 76 characters wide."""
    lines = [
        "% roof: of torch.mul moving the same streams (q into fresh memory, or",
        "q.mul_ for the rows that rotate q in place; k and v into cache rows);",
        "x 2-step: speedup over rotary_qk + index_copy_ (in place for those rows)",
    ]
    header = f"{'row':<34}{'ms':>8}{'GB/s':>7}{'% roof':>8}{'x 2-step':>9}{'bits':>5}"
    last = None
    for r in rows:
        key = (r["kind"], tuple(r["shape"]), r["dtype"], r["layout"])
        if key != last:
            lines += ["", f"{r['kind']} {tuple(r['shape'])} {r['dtype']} {r['layout']}", header]
            last = key
        bits = {True: "=", False: "NO", None: ""}[r["bitwise_equal_to_two_step"]]
        roof_names = {KV_ROOF: "roof: torch.mul, the same streams", KV_ROOF_INPLACE: "roof in place: q.mul_, the same"}
        name = roof_names.get(r["impl"], r["impl"][:33])
        lines.append(
            f"{name:<34}{r['median_ms']:>8.3f}{r['gbs']:>7.2f}{r['pct_roof']:>8.1f}"
            f"{r['speedup_over_two_step']:>9.2f}{bits:>5}"
        )
    return "\n".join(lines)
