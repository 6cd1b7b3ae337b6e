r"""The PyTorch kernel: the rotation in PyTorch operations only, on any device.

For each pair, in the tables' dtype (float32; float64 for float64 inputs),

.. math:: (a, b) \mapsto (a c - b s,\; b c + a s),

with every product rounded and then the sum, and the result rounded once to the input's dtype:
the native kernel (``rotate.c``, built without fused multiply-adds) computes the same expression,
so the two give the same bits. The operations, per block of tokens:

* ``buf = x * cos`` over both halves of each pair (``(a c, b c)``), into the output or, in place
  and in low precision, into a float buffer;
* ``tmp = b * s``, ``buf_a -= tmp``; ``tmp = a * s``, ``buf_b += tmp``;
* the buffer copied to its place (rounded there to float16/bfloat16).

Blocks are :data:`~ropelib.kernels.torch_kernel.BLOCK_BYTES` of q and k (:data:`~ropelib.kernels.torch_kernel.GPU_BLOCK_BYTES` off the CPU), so that the
passes after the first find the block in the cache and memory sees about one read of ``x`` and
one write of the output. In place the buffer is needed because the halves of a pair read each
other. A decoding step (:data:`~ropelib.kernels.torch_kernel.FEW_ELEMENTS`) takes the list operations of :func:`rotate_few`,
because there the cost of a call is its number of operations.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

#: The bytes of q and k in one block of tokens on a CPU, so that a block and its buffers stay in
#: the last-level cache.
BLOCK_BYTES = 4 << 20
#: The bytes of q and k in one block off the CPU, where each operation is a kernel launch.
GPU_BLOCK_BYTES = 256 << 20
#: The most elements of q and k together (a decoding step) that take :func:`rotate_few`.
FEW_ELEMENTS = 1 << 14


def _pairs(x: torch.Tensor, r2: int, interleaved: bool) -> torch.Tensor:
    """The rotated features of ``x`` ``[..., D]`` as pairs: ``[..., 2, r2]`` (half) or ``[..., r2, 2]`` (interleaved)."""
    if interleaved:
        return x[..., : 2 * r2].unflatten(-1, (r2, 2))
    return x[..., : 2 * r2].unflatten(-1, (2, r2))


def _members(pairs: torch.Tensor, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The first and second members ``(a, b)`` of every pair of :func:`_pairs`, as views ``[..., r2]``."""
    if interleaved:
        return pairs[..., 0], pairs[..., 1]
    return pairs[..., 0, :], pairs[..., 1, :]


Buffers = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]


def _rotate_block(
    x: torch.Tensor,
    out: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool,
    buffers: Buffers,
) -> None:
    """``out[..., :r] = R x[..., :r]`` for a block ``[T, H, D]``.

    ``cos``/``sin``: ``[T, d_rot/2]``. ``buffers``: a ``[T', H, d_rot/2]``
    temporary, then float ``[T', H, d_rot]`` buffers for the result (in
    place, low precision) and for the inputs in the compute dtype (low
    precision), or None.
    """
    r2, n = cos.shape[-1], x.shape[0]
    tmp_buffer, result_buffer, input_buffer = buffers
    src = _pairs(x, r2, interleaved)
    target = _pairs(out, r2, interleaved)
    if input_buffer is not None:  # low precision: to float first
        src_f = _pairs(input_buffer[:n], r2, interleaved)
        src = src_f.copy_(src)
    dst = target
    if result_buffer is not None:
        dst = _pairs(result_buffer[:n], r2, interleaved)
    tmp = tmp_buffer[:n]
    c, s = cos[:, None, :], sin[:, None, :]  # over the heads
    a, b = _members(src, interleaved)
    dst_a, dst_b = _members(dst, interleaved)
    c_pairs = c.unsqueeze(-1 if interleaved else -2)
    torch.mul(src, c_pairs, out=dst)  # (a c, b c)
    torch.mul(b, s, out=tmp)
    dst_a.sub_(tmp)  # a c - b s
    torch.mul(a, s, out=tmp)
    dst_b.add_(tmp)  # b c + a s
    if dst is not target:
        target.copy_(dst)  # rounded once to out's dtype


def _token_view(x: torch.Tensor) -> torch.Tensor | None:
    """``[B, S, H, D] -> [B*S, H, D]`` as a view, or None when the strides don't allow one."""
    try:
        return x.view(x.shape[0] * x.shape[1], *x.shape[2:])
    except RuntimeError:
        return None


def _blocks(
    tensors: tuple[torch.Tensor, ...], tables: tuple[torch.Tensor, torch.Tensor], step: int
) -> Iterator[tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, torch.Tensor]]]:
    """Slices ``[T, H, D]`` of ``tensors`` (each ``[B, S, H, D]``) and ``[T, d_rot/2]`` of ``tables`` (``[B, S, d_rot/2]``)."""
    batch, seq = tensors[0].shape[:2]
    views = [_token_view(t) for t in tensors]
    if all(v is not None for v in views):
        flat = [t.reshape(batch * seq, t.shape[-1]) for t in tables]
        for t0 in range(0, batch * seq, step):
            yield tuple(v[t0 : t0 + step] for v in views), (flat[0][t0 : t0 + step], flat[1][t0 : t0 + step])  # type: ignore[index]
        return
    for b in range(batch):
        for s0 in range(0, seq, step):
            sl = slice(s0, s0 + step)
            yield tuple(t[b, sl] for t in tensors), (tables[0][b, sl], tables[1][b, sl])


def rotate_few(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotation of a few tokens (decoding) in three list operations for q and k together, rows widened first; new outputs.

    ``R x = x * (c, c) + swap(x) * (-s, s)`` with ``swap`` exchanging the members of each pair: one
    ``_foreach_mul`` for the products with ``c``, one for those with the signed ``s``, one
    ``_foreach_add_``, where the formula written out takes a dozen operations per tensor. Every
    feature rotated, ``q``/``k`` ``[B, S, H, d_rot]``; ``cos``/``sin`` ``[B, S, d_rot/2]`` rows of the
    tokens, in the inputs' dtype (float32 or float64). Same bits as :func:`launch`.
    """
    if interleaved:
        wide_c = cos.repeat_interleave(2, -1)
        wide_s = torch.stack((-sin, sin), -1).flatten(-2)
        swapped = [x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2) for x in (q, k)]
    else:
        wide_c, wide_s = torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1)
        swapped = [x.roll(x.shape[-1] // 2, -1) for x in (q, k)]
    wide_c, wide_s = wide_c.unsqueeze(-2), wide_s.unsqueeze(-2)  # over the heads
    outs = torch._foreach_mul([q, k], [wide_c, wide_c])
    torch._foreach_add_(outs, torch._foreach_mul(swapped, [wide_s, wide_s]))
    return outs[0], outs[1]


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
    """Write the rotation of ``q``/``k`` into ``q_out``/``k_out`` (which may be ``q``/``k``: in place).

    Same contract as :func:`~ropelib.kernels.native_kernel.launch`: ``q`` ``[B, S, Hq, D]``, ``k``
    ``[B, S, Hk, D]`` (``Hk`` may be 0); ``cos``/``sin`` ``[L, d_rot/2]`` in the compute dtype;
    ``positions`` int64 ``[S]``, ``[1, S]`` or ``[B, S]`` in ``[0, L)``. Unchecked.
    """
    r2 = cos.shape[-1]
    positions = positions.expand(q.shape[0], q.shape[1])
    cos_t, sin_t = cos[positions], sin[positions]  # [B, S, r/2]: gathered once for q and k
    if conjugate:
        sin_t = -sin_t
    head_dim = q.shape[-1]
    # per tensor: the fused cache write rotates q in place and k into a fresh tensor
    in_place = [out.data_ptr() == x.data_ptr() and x.numel() > 0 for x, out in ((q, q_out), (k, k_out))]
    if q.numel() + k.numel() <= FEW_ELEMENTS and q.dtype == cos.dtype and 2 * r2 == head_dim:
        q_new, k_new = rotate_few(q, k, cos_t, sin_t, interleaved=interleaved)
        torch._foreach_copy_([q_out, k_out], [q_new, k_new])
        return
    per_token = (q.shape[2] + k.shape[2]) * head_dim * q.element_size()
    step = max(1, (BLOCK_BYTES if q.device.type == "cpu" else GPU_BLOCK_BYTES) // max(per_token, 1))
    buffers = []
    for x, same in zip((q, k), in_place):  # per tensor, reused by every block
        rows = min(step, x.shape[0] * x.shape[1])

        def buffer(width: int, x: torch.Tensor = x, rows: int = rows) -> torch.Tensor:
            return torch.empty((rows, x.shape[2], width), dtype=cos.dtype, device=x.device)

        low = q.dtype != cos.dtype
        buffers.append((buffer(r2), buffer(2 * r2) if same or low else None, buffer(2 * r2) if low else None))
    for (qb, kb, qob, kob), (cb, sb) in _blocks((q, k, q_out, k_out), (cos_t, sin_t), step):
        for index, (x, out) in enumerate(((qb, qob), (kb, kob))):
            if x.numel() == 0:
                continue
            _rotate_block(x, out, cb, sb, interleaved, buffers[index])
            if not in_place[index] and 2 * r2 < head_dim:
                out[..., 2 * r2 :].copy_(x[..., 2 * r2 :])


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
    """Rotate ``q`` into ``q_out`` and ``k`` into its cache slots, ``v`` into its own (contract: :func:`~ropelib.kernels.registry.run_kv_write`).

    :func:`launch` rotates ``q`` and ``k`` (``k`` into a temporary), then one ``index_put_`` per
    cache writes the tokens' rows. Padding (a negative slot) is skipped without reading a value
    on the host: a padding token writes the row of the first valid token into that token's slot
    (the same bits twice), or, when every token is padding, the cache's row 0 into itself.
    """
    k_rotated = torch.empty_like(k)
    launch(q, k, q_out, k_rotated, cos, sin, positions, interleaved=interleaved, conjugate=False)
    slots = slot_mapping.reshape(-1)
    block_size = k_cache.shape[1]
    if slots.numel() == 0 or k_cache.shape[0] * block_size == 0:
        return  # nothing to write, or no slot a token could name (only padding)
    valid = slots >= 0
    first = valid.to(torch.uint8).argmax()  # the first valid token, or 0 when there is none
    anchored = valid[first]
    targets = torch.where(valid, slots, torch.where(anchored, slots[first], 0))
    index = (targets // block_size, targets % block_size)
    for rows, cache in ((k_rotated, k_cache), (v, v_cache)):
        rows = rows.reshape(-1, *rows.shape[2:])  # [T, Hk, D]
        stand_in = torch.where(anchored, rows[first], cache[0, 0])
        cache.index_put_(index, torch.where(valid[:, None, None], rows, stand_in))
