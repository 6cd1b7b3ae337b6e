r"""The rotation fused with the key/value-cache write in Triton: q, k and v in one launch.

Program ``(t, j)`` handles token ``t`` (of ``batch * seq``) and the ``j``-th block of
``BLOCK_H`` heads, counting the blocks of ``q`` first and then those of ``k``, as
:mod:`~ropelib.kernels.triton_kernel` does. A ``q`` block is rotated into ``q_out``; a ``k``
block is rotated straight into the token's cache slot, block ``slot // block_size`` and row
``slot % block_size`` of ``[num_blocks, block_size, Hk, D]`` (vLLM's paged layout), and the
same heads of ``v`` are copied into the value cache beside it. A padding token (a negative slot)
writes nothing: its stores are masked. The rotation of a block is
the Triton kernel's own ``_rotate_head_block``, without fused multiply-adds, so
the bits are those of ``rotary_qk(kernel="triton")`` followed by ``index_copy_``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_kernel import _rotate_head_block, block_heads, jit


@jit
def _copy_head_block(  # type: ignore[no-untyped-def]
    X, OUT, head0, num_heads, stride_xh, stride_oh, DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr
):
    """Copy heads ``head0 .. head0 + BLOCK_H - 1`` (``DIM`` features each) of one token."""
    heads = head0 + tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_D)
    mask = (heads < num_heads)[:, None] & (cols < DIM)[None, :]
    x = tl.load(X + heads[:, None] * stride_xh + cols[None, :], mask=mask)
    tl.store(OUT + heads[:, None] * stride_oh + cols[None, :], x, mask=mask)


@jit
def rotary_kv_write_kernel(  # type: ignore[no-untyped-def]
    Q,
    K,
    V,
    Q_OUT,
    K_CACHE,
    V_CACHE,
    SLOTS,
    COS,
    SIN,
    POS,
    seq_len,
    table_len,
    q_heads,
    k_heads,
    q_blocks,
    block_size,
    num_slots,
    stride_qb,
    stride_qs,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_qob,
    stride_qos,
    stride_qoh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_pb,
    stride_ps,
    stride_sb,
    stride_ss,
    stride_table,
    ROTARY_DIM: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    V_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_R2: tl.constexpr,
    BLOCK_REST: tl.constexpr,
    BLOCK_V: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    COPY_REST: tl.constexpr,
):
    """Grid ``(batch * seq, q_blocks + k_blocks)``; see the module
    docstring."""
    token = tl.program_id(0)
    block = tl.program_id(1)
    b = token // seq_len
    s = token % seq_len
    pos = tl.load(POS + b * stride_pb + s * stride_ps)
    # the host checks the range; outside it the row reads as zeros
    inside = (pos >= 0) & (pos < table_len)
    row = tl.minimum(tl.maximum(pos, 0), table_len - 1)
    pairs = tl.arange(0, BLOCK_R2)
    row_ok = (pairs < ROTARY_DIM // 2) & inside
    cos = tl.load(COS + row * stride_table + pairs, mask=row_ok, other=0.0)
    sin = tl.load(SIN + row * stride_table + pairs, mask=row_ok, other=0.0)
    if block < q_blocks:
        _rotate_head_block(
            Q + b * stride_qb + s * stride_qs,
            Q_OUT + b * stride_qob + s * stride_qos,
            block * BLOCK_H,
            q_heads,
            stride_qh,
            stride_qoh,
            cos,
            sin,
            ROTARY_DIM,
            HEAD_DIM,
            BLOCK_H,
            BLOCK_R2,
            BLOCK_REST,
            INTERLEAVED,
            COPY_REST,
        )
    else:
        slot = tl.load(SLOTS + b * stride_sb + s * stride_ss)
        written = (slot >= 0) & (slot < num_slots)
        heads = tl.where(written, k_heads, 0)  # padding: every store masked
        safe = tl.where(written, slot, 0)
        page = safe // block_size
        offset = safe % block_size
        head0 = (block - q_blocks) * BLOCK_H
        _rotate_head_block(
            K + b * stride_kb + s * stride_ks,
            K_CACHE + page * stride_kcb + offset * stride_kcs,
            head0,
            heads,
            stride_kh,
            stride_kch,
            cos,
            sin,
            ROTARY_DIM,
            HEAD_DIM,
            BLOCK_H,
            BLOCK_R2,
            BLOCK_REST,
            INTERLEAVED,
            COPY_REST,
        )
        _copy_head_block(
            V + b * stride_vb + s * stride_vs,
            V_CACHE + page * stride_vcb + offset * stride_vcs,
            head0,
            heads,
            stride_vh,
            stride_vch,
            V_DIM,
            BLOCK_H,
            BLOCK_V,
        )


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
    """Rotate ``q`` into ``q_out`` and ``k`` into its cache slots, copying ``v`` into its own, in one launch.

    The contract of :func:`~ropelib.kernels.registry.run_kv_write`: ``q`` ``[B, S, Hq, D]``,
    ``k``/``v`` ``[B, S, Hk, D or Dv]`` with unit stride on the features, paged caches
    ``[num_blocks, block_size, Hk, D or Dv]``, ``slot_mapping`` int64 ``[B, S]``, ``positions``
    int64 ``[S]``, ``[1, S]`` or ``[B, S]`` rows of the ``[L, d_rot/2]`` tables. Unchecked.
    """
    batch, seq, q_heads, head_dim = q.shape
    k_heads, v_dim = k.shape[2], v.shape[3]
    rotary_dim = 2 * cos.shape[-1]
    bh = block_heads(q_heads, k_heads, max(head_dim, v_dim))
    q_blocks = triton.cdiv(q_heads, bh)
    grid = (batch * seq, q_blocks + triton.cdiv(k_heads, bh))
    if grid[0] == 0:
        return
    blocks, block_size = k_cache.shape[:2]
    rest = head_dim - rotary_dim
    positions = positions.expand(batch, seq)
    rotary_kv_write_kernel[grid](
        q,
        k,
        v,
        q_out,
        k_cache,
        v_cache,
        slot_mapping,
        cos,
        sin,
        positions,
        seq,
        cos.shape[0],
        q_heads,
        k_heads,
        q_blocks,
        max(block_size, 1),
        blocks * block_size,
        *q.stride()[:3],
        *k.stride()[:3],
        *v.stride()[:3],
        *q_out.stride()[:3],
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        *positions.stride(),
        *slot_mapping.stride(),
        cos.stride(0),
        ROTARY_DIM=rotary_dim,
        HEAD_DIM=head_dim,
        V_DIM=v_dim,
        BLOCK_H=bh,
        BLOCK_R2=triton.next_power_of_2(rotary_dim // 2),
        BLOCK_REST=triton.next_power_of_2(max(rest, 1)),
        BLOCK_V=triton.next_power_of_2(v_dim),
        INTERLEAVED=interleaved,
        COPY_REST=rest > 0,
        num_warps=4,
        enable_fp_fusion=False,  # a c - b s as two roundings, as the PyTorch kernel
    )
