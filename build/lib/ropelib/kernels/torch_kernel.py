r"""The rotation in plain PyTorch, written to move as few bytes as eager ops allow.

Eager ``x * cos + rotate_half(x) * sin`` makes five or six full passes over memory (the
broadcast cos, the negated half, the concatenation, two products, the sum). Here:

* ``"interleaved"``, in the tables' dtype: adjacent features are one complex number, and the
  rotation is a single complex multiply ``(a + ib)(cos + i sin)`` written into the output (or
  into ``x``, in place): one read of ``x``, one write.
* ``"half"``, and every low-precision input: block by block of tokens (:data:`BLOCK_BYTES` of q
  and k), each rotated into a small float32 buffer that stays in the cache
  (``buf = x * cos``, ``buf_a -= x_b sin``, ``buf_b += x_a sin``) and copied once to its place.
  Memory sees one read of ``x`` and one write of the output, as a copy does: the passes of the
  arithmetic run in the cache. In place this is the only safe order (the halves of a pair read
  each other); out of place the single write of each output page is also where a fresh tensor
  pays its page faults, as ``clone()`` does. float16/bfloat16 are converted to float32 in the
  buffer, so the math is float32 and the result is rounded once.
* a few tokens (decoding, :func:`rotate_half_few`): four list operations for q and k together,
  because there the cost of a call is its number of operations.

All of them work on any device.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any

import torch

from ..packing import positions_in_documents

#: The bytes of q and k in one block of tokens on a CPU, so that a block and its buffers stay in
#: the last-level cache (off the CPU, where each operation is a launch, ``GPU_BLOCK_BYTES``).
BLOCK_BYTES = 4 << 20
#: The bytes of q and k in one block of tokens off the CPU (the PyTorch kernel as a GPU fallback).
GPU_BLOCK_BYTES = 256 << 20


def _token_view(x: torch.Tensor) -> torch.Tensor | None:
    """``[B, S, H, D] -> [B*S, H, D]`` as a view, or None when the strides don't allow one."""
    try:
        return x.view(x.shape[0] * x.shape[1], *x.shape[2:])
    except RuntimeError:
        return None


def _block_tokens(q: torch.Tensor, k: torch.Tensor) -> int:
    """Tokens per block: about :data:`BLOCK_BYTES` (:data:`GPU_BLOCK_BYTES` off the CPU) of q and k together."""
    per_token = (q.shape[2] + k.shape[2]) * q.shape[3] * q.element_size()
    return max(1, (BLOCK_BYTES if q.device.type == "cpu" else GPU_BLOCK_BYTES) // max(per_token, 1))


Block = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]


def _blocks(
    q: torch.Tensor, k: torch.Tensor, q_out: torch.Tensor, k_out: torch.Tensor, tables: list[torch.Tensor]
) -> Iterator[Block]:
    """Yield ``(q, k, q_out, k_out, tables)`` slices over blocks of tokens ``[T, H, D]``/``[T, r/2]``.

    Tables are ``[B, S, r/2]`` (possibly expanded over the batch).
    """
    batch, seq = q.shape[:2]
    step = _block_tokens(q, k)
    views = [v for v in (_token_view(t) for t in (q, k, q_out, k_out)) if v is not None]
    if len(views) == 4:
        flat = [t.reshape(batch * seq, t.shape[-1]) for t in tables]
        for t0 in range(0, batch * seq, step):
            sl = slice(t0, t0 + step)
            yield (views[0][sl], views[1][sl], views[2][sl], views[3][sl], [t[sl] for t in flat])
        return
    for b in range(batch):
        for s0 in range(0, seq, step):
            sl = slice(s0, s0 + step)
            yield (q[b, sl], k[b, sl], q_out[b, sl], k_out[b, sl], [t[b, sl] for t in tables])


def _rotate_half_block(
    x: torch.Tensor,
    out: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    neg_sin: torch.Tensor,
    work: torch.Tensor | None,
) -> None:
    """``out[..., :r] = R x[..., :r]`` for one block ``[T, H, D]``, "half".

    ``cos``, ``sin``, ``neg_sin``: ``[T, r/2]``; ``work``: a float32 buffer
    ``[T, H, 2, r/2]`` (in place, low precision) or None (write to out).
    """
    r2 = cos.shape[-1]
    src = x[..., : 2 * r2].unflatten(-1, (2, r2))  # [T, H, 2, r/2]: (a, b)
    target = out[..., : 2 * r2].unflatten(-1, (2, r2))
    dst = target if work is None else work
    torch.mul(src, cos[:, None, None, :], out=dst)  # (a c, b c)
    a, b = src.unbind(-2)
    dst[..., 0, :].addcmul_(b, neg_sin[:, None, :])  # a c - b s
    dst[..., 1, :].addcmul_(a, sin[:, None, :])  # b c + a s
    if work is not None:
        target.copy_(dst)


def _rotate_interleaved_block(
    x: torch.Tensor, out: torch.Tensor, phase: torch.Tensor, work: torch.Tensor | None
) -> None:
    """``out[..., :r] = R x[..., :r]`` for one block, "interleaved" layout, as a complex product; ``phase`` ``[T, r/2]``."""
    r2 = phase.shape[-1]
    src = x[..., : 2 * r2].unflatten(-1, (r2, 2))
    if work is not None:  # low precision: compute in a float buffer, round once
        work.copy_(src)
        src = dst = work
    else:
        dst = out[..., : 2 * r2].unflatten(-1, (r2, 2))
    torch.mul(torch.view_as_complex(src), phase[:, None, :], out=torch.view_as_complex(dst))
    if work is not None:
        out[..., : 2 * r2].unflatten(-1, (r2, 2)).copy_(work)


def _rotate_whole(x: torch.Tensor, out: torch.Tensor, phase: torch.Tensor) -> None:
    """Rotate all of ``x`` ``[B, S, H, D]`` into ``out``, "interleaved" layout, as one complex multiply.

    ``phase`` is ``cos + i sin``, ``[B, S, r/2]``, in ``x``'s (real) dtype: one read of ``x``, one write
    of ``out`` (in place: of ``x``), no block loop needed.
    """
    r2 = phase.shape[-1]
    src = torch.view_as_complex(x[..., : 2 * r2].unflatten(-1, (r2, 2)))
    if out.data_ptr() == x.data_ptr():
        src.mul_(phase[:, :, None, :])
    else:
        torch.mul(src, phase[:, :, None, :], out=torch.view_as_complex(out[..., : 2 * r2].unflatten(-1, (r2, 2))))


#: The most elements of q and k together (a decoding step of a few tokens) that take the
#: few-operations path, :func:`rotate_half_few`, where the cost of a call is its number of operations.
FEW_ELEMENTS = 1 << 14


def few_elements(q: torch.Tensor, k: torch.Tensor, r: int, dtype: torch.dtype, interleaved: bool) -> bool:
    """True when :func:`rotate_half_few` applies: a few elements, "half" layout, all ``r`` features rotated, in ``dtype``."""
    return not interleaved and q.numel() + k.numel() <= FEW_ELEMENTS and q.dtype == dtype and r == q.shape[-1]


def wide_table(cos: torch.Tensor, sin: torch.Tensor, conjugate: bool = False) -> torch.Tensor:
    """``[..., 2, r]``: ``cat(c, c)`` and ``cat(-s, s)`` (``cat(s, -s)`` for the conjugate) of ``[..., r/2]`` tables.

    The form :func:`rotate_half_few` takes: the cosine of each feature, and the sine with the sign
    of its term in the rotation.
    """
    minus = -sin
    parts = (cos, cos, sin, minus) if conjugate else (cos, cos, minus, sin)
    return torch.cat(parts, -1).unflatten(-1, (2, 2 * cos.shape[-1]))


def wide_rows(
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    *,
    conjugate: bool = False,
    position: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The :func:`wide_table` rows at ``positions`` (int64 ``[B, S]``) of ``[L, r/2]`` tables, for :func:`rotate_half_few`.

    ``[r]`` each for one token (they broadcast as they are), else ``[B, S, 1, r]`` (over the heads).
    ``position``: the one position of a single-token call, when the caller has read it on the
    host; the rows of the last such call are kept (``_LAST_ROWS``), so that the layers of one
    decoding step, which share tables and position, build them once.
    """
    if position is not None:
        rows = _LAST_ROWS.get((cos, sin), (position, conjugate))
        if rows is None:
            rows = split_wide(wide_table(cos[position], sin[position], conjugate))
            _LAST_ROWS.put((cos, sin), (position, conjugate), rows)
        return rows
    index = positions.reshape(-1)
    rows = wide_table(cos.index_select(0, index), sin.index_select(0, index), conjugate)  # [T, 2, r]
    return split_wide(rows[0] if index.shape[0] == 1 else rows.view(*positions.shape, 1, *rows.shape[1:]))


def split_wide(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The cosine and signed-sine halves of :func:`wide_table` rows ``[..., 2, r]``, as views."""
    cos, signed_sin = rows.unbind(-2)
    return cos, signed_sin


class LastCall:
    """The value made for the last key: tensors (held weakly, with their version counters) and plain values.

    One entry, for values that consecutive calls share (the layers of one decoding step ask for
    the same rows in turn). A key's tensors must be the very same objects, unchanged: an in-place
    change bumps a version counter and misses. Inference tensors have no version counter, so a
    key with one is never kept (each such call makes its value again).
    """

    def __init__(self) -> None:
        self._entry: tuple[Any, ...] | None = None

    def get(self, tensors: tuple[torch.Tensor, ...], key: object) -> Any:
        """The value kept for ``tensors`` and ``key``, or None."""
        entry = self._entry  # one read: a concurrent put replaces the whole entry
        if entry is None or entry[2] != key:
            return None
        refs, versions, _, value = entry
        for ref, version, tensor in zip(refs, versions, tensors, strict=True):
            if ref() is not tensor or tensor._version != version:
                return None
        return value

    def put(self, tensors: tuple[torch.Tensor, ...], key: object, value: Any) -> None:
        """Keep ``value`` for ``tensors`` and ``key`` (not for inference tensors), replacing the entry."""
        if any(t.is_inference() for t in tensors):
            return
        self._entry = (tuple(weakref.ref(t) for t in tensors), tuple(t._version for t in tensors), key, value)


#: The rows of the last single-position call of :func:`wide_rows`, keyed by its tables, position
#: and direction.
_LAST_ROWS = LastCall()


def rotate_half_few(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    signed_sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The "half" rotation of a few tokens (decoding); new outputs.

    ``R x = x * cat(c, c) + roll(x, r/2) * cat(-s, s)``, where ``roll``
    swaps the halves: ``(a c - b s, b c + a s)``, as Hugging Face's
    ``x * cos + rotate_half(x) * sin`` (the product and the sum may be
    fused, within one rounding of it). One ``_foreach_mul``, two rolls and
    one ``_foreach_addcmul_`` for q and k, where the eager formula takes
    fourteen operations: at a decode shape the cost of a call is its number
    of operations, not its bytes.

    Shapes: ``q``/``k`` ``[..., r]`` (every feature rotated); ``cos`` and
    ``signed_sin`` the halves of a :func:`wide_table`, broadcastable to
    both. Unchecked.
    """
    half = q.shape[-1] // 2
    q_out, k_out = torch._foreach_mul([q, k], [cos, cos])
    rolled = [q.roll(half, -1), k.roll(half, -1)]
    signs = [signed_sin, signed_sin]
    torch._foreach_addcmul_([q_out, k_out], rolled, signs)
    return q_out, k_out


def rotate_qk_torch(
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
    cu_seqlens: torch.Tensor | None = None,
) -> None:
    """Write the rotation of ``q``/``k`` into ``q_out``/``k_out`` (which may be ``q``/``k``: in place).

    With ``cu_seqlens`` (a packed row of batch 1) the positions are those of the documents,
    :func:`ropelib.packing.positions_in_documents`, and ``positions`` is not read.

    Same contract as :func:`~ropelib.kernels.triton_kernel.launch_rotary_qk`: ``q`` ``[B, S, Hq, D]``,
    ``k`` ``[B, S, Hk, D]`` with unit stride on ``D``; ``cos``/``sin`` the ``[L, r/2]`` cache
    (float32, or float64 for float64 input); ``positions`` int64 ``[B, S]``. Validation is the
    caller's. Inputs in the tables' dtype are rotated with whole-tensor operations; float16 and
    bfloat16 ones block by block through a float32 buffer, so that the math is float32 and the
    result is rounded once.
    """
    r2 = cos.shape[-1]
    compute = cos.dtype
    if cu_seqlens is not None:
        positions = positions_in_documents(cu_seqlens, q.shape[1])[None]
    cos_t, sin_t = cos[positions], sin[positions]  # [B, S, r/2]: gathered once for q and k
    if conjugate:
        sin_t = -sin_t
    in_place = q_out.data_ptr() == q.data_ptr()
    head_dim = q.shape[-1]
    if q.dtype == compute and interleaved:  # one complex multiply: one pass already
        phase = torch.complex(cos_t, sin_t)
        for x, out in ((q, q_out), (k, k_out)):
            _rotate_whole(x, out, phase)
            if not in_place and 2 * r2 < head_dim:
                out[..., 2 * r2 :].copy_(x[..., 2 * r2 :])
        return
    tables = [torch.complex(cos_t, sin_t)] if interleaved else [cos_t, sin_t, -sin_t]
    step = _block_tokens(q, k)
    work: dict[str, torch.Tensor] = {}
    if in_place or q.dtype != compute:  # a float32 buffer per tensor, reused by every block
        for name, x in (("q", q), ("k", k)):
            shape = (step, x.shape[2], r2, 2) if interleaved else (step, x.shape[2], 2, r2)
            work[name] = torch.empty(shape, dtype=compute, device=x.device)
    for qb, kb, qob, kob, tb in _blocks(q, k, q_out, k_out, tables):
        for name, x, out in (("q", qb, qob), ("k", kb, kob)):
            buf = work[name][: x.shape[0]] if work else None  # out of place in float32: straight into out
            if interleaved:
                _rotate_interleaved_block(x, out, tb[0], buf)
            else:
                _rotate_half_block(x, out, tb[0], tb[1], tb[2], buf)
            if not in_place and 2 * r2 < head_dim:
                out[..., 2 * r2 :].copy_(x[..., 2 * r2 :])
