r"""The rotation in plain PyTorch, written to move as few bytes as eager ops allow.

Eager ``x * cos + rotate_half(x) * sin`` makes five or six full passes over memory (the
broadcast cos, the negated half, the concatenation, two products, the sum). Here:

* ``"interleaved"``: adjacent features are one complex number, and the rotation is a single
  complex multiply ``(a + ib)(cos + i sin)`` written into the preallocated output: one read of
  ``x``, one write.
* ``"half"``: three operations with ``out=`` into the preallocated output,
  ``out = x * cos`` (both halves at once), then ``out_a -= x_b sin`` and ``out_b += x_a sin``,
  run over blocks of tokens of about 1 MiB so that the second and third operations re-read
  data that is still in cache. Main memory sees roughly one read and one write.

Both work on any device; float16/bfloat16 blocks are computed in float32 and rounded once.
"""

from __future__ import annotations

import torch

BLOCK_BYTES = 1 << 20  # per block of tokens: fits in a core's L2 with its output


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


def _blocks(q: torch.Tensor, k: torch.Tensor, q_out: torch.Tensor, k_out: torch.Tensor, tables: list[torch.Tensor]):
    """Yield ``(q, k, q_out, k_out, tables)`` slices over blocks of tokens ``[T, H, D]``/``[T, r/2]``.

    Tables are ``[B, S, r/2]`` (possibly expanded over the batch).
    """
    batch, seq = q.shape[:2]
    step = _block_tokens(q, k)
    views = [_token_view(t) for t in (q, k, q_out, k_out)]
    if all(v is not None for v in views):
        flat = [t.reshape(batch * seq, t.shape[-1]) for t in tables]
        for t0 in range(0, batch * seq, step):
            sl = slice(t0, t0 + step)
            yield (*(v[sl] for v in views), [t[sl] for t in flat])
        return
    for b in range(batch):
        for s0 in range(0, seq, step):
            sl = slice(s0, s0 + step)
            yield (q[b, sl], k[b, sl], q_out[b, sl], k_out[b, sl], [t[b, sl] for t in tables])


def _rotate_half_block(x: torch.Tensor, out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neg_sin: torch.Tensor, work: torch.Tensor | None) -> None:
    """``out[..., :r] = R x[..., :r]`` for one block ``[T, H, D]``, "half" layout; ``cos`` etc. ``[T, r/2]``."""
    r2 = cos.shape[-1]
    src = x[..., : 2 * r2].unflatten(-1, (2, r2))  # [T, H, 2, r/2]: (x_a, x_b)
    dst = work if work is not None else out[..., : 2 * r2].unflatten(-1, (2, r2))
    torch.mul(src, cos[:, None, None, :], out=dst)
    dst[..., 0, :].addcmul_(src[..., 1, :], neg_sin[:, None, :])
    dst[..., 1, :].addcmul_(src[..., 0, :], sin[:, None, :])
    if work is not None:
        out[..., : 2 * r2].unflatten(-1, (2, r2)).copy_(dst)


def _rotate_interleaved_block(x: torch.Tensor, out: torch.Tensor, phase: torch.Tensor, work: torch.Tensor | None) -> None:
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
) -> None:
    """Write the rotation of ``q``/``k`` into ``q_out``/``k_out`` (which may be ``q``/``k``: in place).

    Same contract as :func:`ropelib.kernels.triton_rope.launch_rotary_qk`: ``q`` ``[B, S, Hq, D]``,
    ``k`` ``[B, S, Hk, D]`` with unit stride on ``D``; ``cos``/``sin`` the ``[L, r/2]`` cache
    (float32, or float64 for float64 input); ``positions`` int64 ``[B, S]``. Validation is the
    caller's.
    """
    r2 = cos.shape[-1]
    compute = cos.dtype
    cos_t, sin_t = cos[positions], sin[positions]  # [B, S, r/2]: gathered once for q and k
    if conjugate:
        sin_t = -sin_t
    in_place = q_out.data_ptr() == q.data_ptr()
    head_dim = q.shape[-1]
    if interleaved:
        tables = [torch.complex(cos_t, sin_t)]
    else:
        tables = [cos_t, sin_t, -sin_t]
    work = {}
    if q.dtype != compute or (in_place and not interleaved):  # a float buffer per tensor, reused by every block
        step = _block_tokens(q, k)
        for name, x in (("q", q), ("k", k)):
            shape = (step, x.shape[2], r2, 2) if interleaved else (step, x.shape[2], 2, r2)
            work[name] = torch.empty(shape, dtype=compute, device=x.device)
    for qb, kb, qob, kob, tb in _blocks(q, k, q_out, k_out, tables):
        for name, x, out in (("q", qb, qob), ("k", kb, kob)):
            buf = work[name][: x.shape[0]] if work else None
            if interleaved:
                _rotate_interleaved_block(x, out, tb[0], buf)
            else:
                _rotate_half_block(x, out, tb[0], tb[1], tb[2], buf)
            if not in_place and 2 * r2 < head_dim:
                out[..., 2 * r2 :].copy_(x[..., 2 * r2 :])
