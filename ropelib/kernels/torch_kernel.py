r"""The rotation in plain PyTorch, written to move as few bytes as eager ops allow.

Eager ``x * cos + rotate_half(x) * sin`` makes five or six full passes over memory (the
broadcast cos, the negated half, the concatenation, two products, the sum). Here:

* ``"interleaved"``: adjacent features are one complex number, and the rotation is a single
  complex multiply ``(a + ib)(cos + i sin)`` written into the preallocated output: one read of
  ``x``, one write.
* ``"half"``: three operations with ``out=`` into the preallocated output,
  ``out = x * cos`` (both halves at once, one contiguous pass), then ``out_a -= x_b sin`` and
  ``out_b += x_a sin`` on the halves: no temporaries, about 2.5 passes' worth of traffic
  instead of the eager version's ten.

Both work on any device. float16/bfloat16 inputs go block by block (a few MiB of tokens)
through a float32 buffer, so that the math is float32 and the result is rounded once.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ..packing import positions_in_documents

BLOCK_BYTES = 4 << 20  # per block of tokens (low-precision inputs), q and k together


def _token_view(x: torch.Tensor) -> torch.Tensor | None:
    """``[B, S, H, D] -> [B*S, H, D]`` as a view, or None when the strides don't allow one."""
    try:
        return x.view(x.shape[0] * x.shape[1], *x.shape[2:])
    except RuntimeError:
        return None


def _block_tokens(q: torch.Tensor, k: torch.Tensor) -> int:
    """Tokens per block: about ``BLOCK_BYTES`` of q and k together."""
    per_token = (q.shape[2] + k.shape[2]) * q.shape[3] * q.element_size()
    return max(1, BLOCK_BYTES // max(per_token, 1))


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
    """``out[..., :r] = R x[..., :r]`` for one block ``[T, H, D]``, "half" layout; ``cos`` etc. ``[T, r/2]``."""
    r2 = cos.shape[-1]
    src = x[..., : 2 * r2].unflatten(-1, (2, r2))  # [T, H, 2, r/2]: (x_a, x_b)
    dst = work if work is not None else out[..., : 2 * r2].unflatten(-1, (2, r2))
    torch.mul(src, cos[:, None, None, :], out=dst)
    dst[..., 0, :].addcmul_(src[..., 1, :], neg_sin[:, None, :])
    dst[..., 1, :].addcmul_(src[..., 0, :], sin[:, None, :])
    if work is not None:
        out[..., : 2 * r2].unflatten(-1, (2, r2)).copy_(dst)


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


def _rotate_whole(
    x: torch.Tensor, out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, phase: torch.Tensor | None
) -> None:
    """Rotate all of ``x`` ``[B, S, H, D]`` into ``out`` with whole-tensor operations (same dtype as the tables).

    ``cos``/``sin`` are ``[B, S, r/2]``; ``phase`` is ``cos + i sin`` for the interleaved layout (None for half).
    A few large operations: on a small shared CPU every parallel region is a barrier that a
    descheduled thread can stall, so fewer is better than cache-sized blocks.
    """
    r2 = cos.shape[-1]
    if phase is not None:
        src = torch.view_as_complex(x[..., : 2 * r2].unflatten(-1, (r2, 2)))
        if out.data_ptr() == x.data_ptr():
            src.mul_(phase[:, :, None, :])
        else:
            torch.mul(src, phase[:, :, None, :], out=torch.view_as_complex(out[..., : 2 * r2].unflatten(-1, (r2, 2))))
        return
    src = x[..., : 2 * r2].unflatten(-1, (2, r2))
    a, b = src[..., 0, :], src[..., 1, :]
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    if out.data_ptr() == x.data_ptr():  # in place: keep a copy of x_a, then update both halves
        a_old = a.clone()
        a.mul_(c).addcmul_(b, s, value=-1.0)
        b.mul_(c).addcmul_(a_old, s)
        return
    dst = out[..., : 2 * r2].unflatten(-1, (2, r2))
    torch.mul(src, c[..., None, :], out=dst)  # both halves times cos: one contiguous pass
    dst[..., 0, :].addcmul_(b, s, value=-1.0)
    dst[..., 1, :].addcmul_(a, s)


#: At most this many elements of q and k together (a decoding step: a few tokens) take the
#: few-operations path of the half layout, where the cost of a call is the number of operations.
FEW_ELEMENTS = 1 << 14


def _rotate_half_few(
    q: torch.Tensor,
    k: torch.Tensor,
    q_out: torch.Tensor,
    k_out: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    copy_rest: bool,
) -> None:
    """The "half" rotation of small ``q``/``k`` in three list operations for both (cos/sin ``[B, S, r/2]``).

    ``(a, b) -> (a c - b s, b c + a s)`` for the four halves at once: one ``_foreach_mul``, one
    ``_foreach_addcmul_`` and one ``_foreach_copy_`` (safe in place: the products are new tensors).
    """
    r2 = cos.shape[-1]
    c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)  # [B, S, 1, r/2]: broadcast over heads
    halves = [q[..., :r2], q[..., r2 : 2 * r2], k[..., :r2], k[..., r2 : 2 * r2]]
    rotated = torch._foreach_mul(halves, [c, c, c, c])
    minus_s = -s
    torch._foreach_addcmul_(rotated, [halves[1], halves[0], halves[3], halves[2]], [minus_s, s, minus_s, s])
    targets = [q_out[..., :r2], q_out[..., r2 : 2 * r2], k_out[..., :r2], k_out[..., r2 : 2 * r2]]
    torch._foreach_copy_(targets, rotated)
    if copy_rest:
        q_out[..., 2 * r2 :].copy_(q[..., 2 * r2 :])
        k_out[..., 2 * r2 :].copy_(k[..., 2 * r2 :])


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
    if q.dtype == compute and (q.numel() + k.numel()) <= FEW_ELEMENTS and not interleaved:
        _rotate_half_few(q, k, q_out, k_out, cos_t, sin_t, copy_rest=not in_place and 2 * r2 < head_dim)
        return
    if q.dtype == compute:
        phase = torch.complex(cos_t, sin_t) if interleaved else None
        for x, out in ((q, q_out), (k, k_out)):
            _rotate_whole(x, out, cos_t, sin_t, phase)
            if not in_place and 2 * r2 < head_dim:
                out[..., 2 * r2 :].copy_(x[..., 2 * r2 :])
        return
    tables = [torch.complex(cos_t, sin_t)] if interleaved else [cos_t, sin_t, -sin_t]
    step = _block_tokens(q, k)
    work = {}
    for name, x in (("q", q), ("k", k)):  # a float32 buffer per tensor, reused by every block
        shape = (step, x.shape[2], r2, 2) if interleaved else (step, x.shape[2], 2, r2)
        work[name] = torch.empty(shape, dtype=compute, device=x.device)
    for qb, kb, qob, kob, tb in _blocks(q, k, q_out, k_out, tables):
        for name, x, out in (("q", qb, qob), ("k", kb, kob)):
            buf = work[name][: x.shape[0]]
            if interleaved:
                _rotate_interleaved_block(x, out, tb[0], buf)
            else:
                _rotate_half_block(x, out, tb[0], tb[1], tb[2], buf)
            if not in_place and 2 * r2 < head_dim:
                out[..., 2 * r2 :].copy_(x[..., 2 * r2 :])
