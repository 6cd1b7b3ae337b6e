r"""The native CPU kernel: one pass of ``rotate.c`` over q and k, called from inside ropelib's operators.

Eager PyTorch cannot rotate the "half" layout in one pass (each pair's halves lie ``d_rot/2`` features
apart); ``rotate.c`` is the loop itself: for each token it reads the position and that row of the
tables, and for each head of q and then of k it reads both halves of every pair and writes both.
One read of each input, one write of each output (in place: the input itself), either layout, any
strides with a unit stride on the features, float16, bfloat16 (computed in float32, rounded once
to nearest even), float32 and float64. It computes exactly the expression of the PyTorch kernel
(:mod:`~ropelib.kernels.torch_kernel`), so the two give the same bits.

The library is built and cached by :mod:`~ropelib.kernels.native_build`. A call is split by
tokens between :func:`torch.get_num_threads` threads of torch's own OpenMP runtime when it is
large (:data:`~ropelib.kernels.native_kernel.PARALLEL_ELEMENTS`); a decoding step runs in the caller's thread. Out of place
into fresh memory the loop touches the pages of a run of tokens before writing them
(:data:`~ropelib.kernels.native_kernel.TOUCH_BYTES`), so that their page faults come together.

With a slot mapping the same pass writes the rotated k into a key/value cache, at each token's
slot, and copies v beside it (``write_kv``).

This module's :func:`launch` and ``write_kv`` are the only code that hands tensors' memory to C,
and they run only inside the ``ropelib`` operators' CPU kernels.
"""

from __future__ import annotations

import functools
import itertools

import torch

from . import torch_kernel
from .native_build import ABI, PACKED_CALL, BuildFailed, Library, NativeBuild

#: Calls with at least this many elements of q and k together are split between threads; smaller
#: ones run in the caller's thread, where waking the others would cost more than it saves.
PARALLEL_ELEMENTS = 1 << 18
#: Out of place, the bytes of output whose pages are touched together before they are written.
TOUCH_BYTES = 512 << 10
#: The dtypes the loop rotates (the tables are float32, float64 for float64).
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def supports(x: torch.Tensor) -> bool:
    """True when the loop can rotate ``x``: on the CPU, one of :data:`~ropelib.kernels.native_kernel.DTYPES`."""
    return x.device.type == "cpu" and x.dtype in DTYPES


def _position_strides(positions: torch.Tensor, batch: int) -> tuple[int, int]:
    """The strides of ``[S]``, ``[1, S]`` or ``[B, S]`` positions over ``[B, S]`` (0 where broadcast)."""
    if positions.ndim == 1:
        return 0, positions.stride(0)
    return (positions.stride(0) if positions.shape[0] == batch else 0), positions.stride(1)


def _fresh(x: torch.Tensor, out: torch.Tensor) -> bool:
    return out.data_ptr() != x.data_ptr() and out.is_contiguous()


#: The cache part of a call without a cache write: no slots, no v (the C loop writes ``k_out``).
NO_CACHE = (0,) * 14


def _cache_fields(
    slots: torch.Tensor, v: torch.Tensor, v_cache: torch.Tensor, k_cache: torch.Tensor
) -> tuple[int, ...]:
    """The cache part of :class:`~ropelib.kernels.native_build.Call` for a write into paged caches."""
    blocks, block_size = k_cache.shape[:2]
    return (
        slots.data_ptr(),
        v.data_ptr(),
        v_cache.data_ptr(),
        v.shape[3],
        block_size,
        blocks * block_size,
        *v.stride()[:3],
        *v_cache.stride()[:3],
        *slots.stride(),
    )


def _launch(
    library: Library,
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
    cache: tuple[int, ...] = NO_CACHE,
) -> None:
    batch, seq, q_heads, dim = q.shape  # each read once: a shape or stride read is a call into torch
    k_heads = k.shape[2]
    size = q.element_size()
    per_token = (q_heads + k_heads) * dim
    elements = batch * seq * per_token
    touch = threads = 1
    if elements >= PARALLEL_ELEMENTS:
        threads = torch.get_num_threads()
    cached = cache is not NO_CACHE  # k_out is a cache: memory in use, never touched
    fresh_k = k_heads == 0 or cached or _fresh(k, k_out)
    if elements * size < TOUCH_BYTES or not (_fresh(q, q_out) and fresh_k):
        touch = 0  # small, or not fresh memory: nothing to gain from touching pages first
    else:
        touch = max(1, TOUCH_BYTES // max(1, per_token * size))
    length, r2 = cos.shape
    call = PACKED_CALL.pack(
        ABI,
        q.data_ptr(),
        k.data_ptr(),
        q_out.data_ptr(),
        k_out.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        positions.data_ptr(),
        batch,
        seq,
        dim,
        r2,
        length,
        q_heads,
        k_heads,
        *q.stride()[:3],
        *k.stride()[:3],
        *q_out.stride()[:3],
        *k_out.stride()[:3],
        *_position_strides(positions, batch),
        int(interleaved),
        int(conjugate),
        touch,
        threads,
        *cache,
    )
    bad = library.functions[q.dtype](call)
    if bad < 0:
        raise RuntimeError(f"{library.path} refused a call of ABI {ABI}")
    if bad:
        raise IndexError(
            f"{bad} tokens have positions outside the table's [0, {cos.shape[0]}) rows or slots past the cache; "
            "the operator's kernel computes rows for positions before calling the loop, its door checks the slots"
        )


def launch(
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
) -> None:
    """Write the rotation of ``q``/``k`` into ``q_out``/``k_out`` (which may be ``q``/``k``).

    Shapes: ``q`` ``[B, S, Hq, D]``, ``k`` ``[B, S, Hk, D]`` (``Hk`` may be 0), outputs alike, all
    with unit stride on ``D``; ``cos``/``sin`` contiguous ``[L, d_rot/2]`` in the compute dtype;
    ``positions`` int64 ``[S]``, ``[1, S]`` or ``[B, S]`` (any strides) in ``[0, L)``. Unchecked: the operator's kernel
    (:mod:`~ropelib.kernels.registry`) prepares all of this.
    """
    _launch(BUILD.library(), q, k, q_out, k_out, cos, sin, positions, interleaved=interleaved, conjugate=conjugate)


def write_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_out: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    *,
    interleaved: bool,
) -> None:
    """Rotate ``q`` into ``q_out`` and ``k`` into its cache slots, copying ``v`` into its own, in one pass of the loop.

    The contract of :func:`~ropelib.kernels.registry.run_kv_write` (paged caches, int64
    ``[B, S]`` slots, negative ones skipped); the same bits as the PyTorch kernel's
    :func:`~ropelib.kernels.torch_kernel.write_kv`.
    """
    _write_kv(BUILD.library(), q, k, v, q_out, k_cache, v_cache, slot_mapping, cos, sin, positions, interleaved)


def _write_kv(
    library: Library,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_out: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    interleaved: bool,
) -> None:
    cache = _cache_fields(slot_mapping, v, v_cache, k_cache)
    _launch(library, q, k, q_out, k_cache, cos, sin, positions, interleaved=interleaved, conjugate=False, cache=cache)


def _verify_kv_write(library: Library, dtype: torch.dtype, generator: torch.Generator) -> bool:
    """True when the loop's cache write gives the PyTorch kernel's bits: paged, padding, a partial rotation."""
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    q, k, v = (torch.randn(1, 5, heads, 14, generator=generator).to(dtype) for heads in (2, 1, 1))
    angles = torch.rand(7, 5, generator=generator, dtype=torch.float64) * 100
    cos, sin = angles.cos().to(compute), angles.sin().to(compute)
    positions = torch.randint(0, 7, (1, 5), generator=generator)
    slots = torch.tensor([[7, -1, 0, 4, 9]])
    outs = []
    for write in (torch_kernel.write_kv, functools.partial(_write_kv, library)):
        q_out, k_cache, v_cache = (
            torch.empty_like(q),
            torch.zeros(3, 4, 1, 14, dtype=dtype),
            torch.zeros(3, 4, 1, 14, dtype=dtype),
        )
        write(q, k, v, q_out, k_cache, v_cache, slots, cos, sin, positions, interleaved=False)
        outs.append((q_out, k_cache, v_cache))
    return all(torch.equal(a, b) for a, b in zip(*outs))


def verify(library: Library) -> None:
    """Raise :class:`~ropelib.kernels.native_build.BuildFailed` unless ``library`` gives the PyTorch kernel's bits.

    Run once per process on the library just loaded: every dtype, both layouts, an odd number of
    pairs (the vector loops' tails), 16 pairs (the half layout's loop of held tables), a partial
    rotation and both directions, and a write into a paged cache. A compiler that fuses a multiply and an add behind the flags' back is caught
    here, and the PyTorch kernel serves.
    """
    generator = torch.Generator().manual_seed(0)
    for dtype, (dim, pairs) in itertools.product(DTYPES, ((14, 5), (36, 16))):
        compute = torch.float64 if dtype == torch.float64 else torch.float32
        q = torch.randn(2, 3, 3, dim, generator=generator).to(dtype)
        k = torch.randn(2, 3, 1, dim, generator=generator).to(dtype)
        angles = torch.rand(7, pairs, generator=generator, dtype=torch.float64) * 100
        cos, sin = angles.cos().to(compute), angles.sin().to(compute)
        positions = torch.randint(0, 7, (2, 3), generator=generator)
        for interleaved in (False, True):
            for conjugate in (False, True):
                want_q, want_k, got_q, got_k = (torch.empty_like(x) for x in (q, k, q, k))
                torch_kernel.launch(
                    q, k, want_q, want_k, cos, sin, positions, interleaved=interleaved, conjugate=conjugate
                )
                _launch(library, q, k, got_q, got_k, cos, sin, positions, interleaved=interleaved, conjugate=conjugate)
                if not (torch.equal(want_q, got_q) and torch.equal(want_k, got_k)):
                    raise BuildFailed(
                        f"{library.path} does not compute the PyTorch kernel's bits ({dtype}, interleaved="
                        f"{interleaved}): the compiler changed the rounding"
                    )
        if not _verify_kv_write(library, dtype, generator):
            raise BuildFailed(f"{library.path} does not write the PyTorch kernel's bits into a cache ({dtype})")


#: This process's native library, verified on loading.
BUILD = NativeBuild(verify)


def build() -> Library:
    """Build (or load from the cache) the native kernel now, blocking; :class:`~ropelib.kernels.native_build.BuildFailed` if it cannot be.

    Example:
        >>> from ropelib.kernels import native_build, native_kernel
        >>> library = native_kernel.build()  # where a C compiler builds it
        >>> library.functions.keys() == native_build.ENTRY_POINTS.keys()
        True
    """
    return BUILD.library()
