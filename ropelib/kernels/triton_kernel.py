r"""The fused rotary kernel in Triton: q and k in one launch, cos/sin read once per token.

Program ``(t, j)`` handles token ``t`` (of ``batch * seq``) and the ``j``-th block of
``BLOCK_H`` heads, counting the blocks of ``q`` first and then those of ``k`` (which may have
fewer heads: GQA/MQA). It reads the token's position, gathers that row of the cos/sin cache
once, and rotates every head of its block with it:

.. math::

    x'_a = x_a \cos m\theta_i - x_b \sin m\theta_i, \qquad x'_b = x_b \cos m\theta_i + x_a \sin m\theta_i,

with ``(a, b) = (i, i + d_rot/2)`` in the ``"half"`` layout and ``(2i, 2i+1)`` in the
``"interleaved"`` one. Loads are whole contiguous rows of a head (the interleaved pairs are
split in registers with ``tl.split``), the math runs in the table's dtype (float32, or
float64 for float64 input) and the result is rounded once to the output's dtype.

The backward pass is the rotation by ``-theta`` (``R^T = R(-theta)``): the same kernel with
``CONJUGATE`` set, which negates the sine. With ``rotary_dim < head_dim`` the remaining
features are copied (not at all when writing in place).

On a machine without CUDA the kernels are defined for Triton's interpreter, so that they run,
slowly, on CPU tensors (the tests do this). That choice is made here, when this module is first
imported, and nowhere else: the kernels below are wrapped by Triton's ``InterpretedFunction`` instead
of ``triton.jit`` (what ``triton.jit`` itself returns under ``TRITON_INTERPRET=1``), without
changing the process environment or any other module's kernels. ``TRITON_INTERPRET=1`` or ``=0`` in the environment
overrides it either way (``=0`` is how the ahead-of-time compile test builds GPU code on a CPU).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .aliasing import writes_in_place


def use_interpreter() -> bool:
    """Whether the kernels run in Triton's interpreter: ``TRITON_INTERPRET`` if set, else when there is no CUDA."""
    setting = os.environ.get("TRITON_INTERPRET")
    if setting is not None:
        return setting == "1"
    return not torch.cuda.is_available()


if use_interpreter():
    from triton.runtime.interpreter import InterpretedFunction as jit
else:
    jit = triton.jit


@jit
def _rotate_head_block(  # type: ignore[no-untyped-def]
    X,
    OUT,
    head0,
    num_heads,
    stride_xh,
    stride_oh,
    cos,
    sin,
    ROTARY_DIM: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_R2: tl.constexpr,
    BLOCK_REST: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    COPY_REST: tl.constexpr,
):
    """Rotate heads ``head0 .. head0 + BLOCK_H - 1`` of one token
    (``X``/``OUT`` point at its head 0)."""
    heads = head0 + tl.arange(0, BLOCK_H)
    pairs = tl.arange(0, BLOCK_R2)
    head_ok = heads < num_heads
    out_dtype = OUT.dtype.element_ty
    if INTERLEAVED:
        # a contiguous row of 2 * BLOCK_R2 features per head, split into
        # pairs in registers
        col = tl.arange(0, 2 * BLOCK_R2)
        mask2 = head_ok[:, None] & (col[None, :] < ROTARY_DIM)
        x_ptr = X + heads[:, None] * stride_xh + col[None, :]
        x = tl.load(x_ptr, mask=mask2, other=0.0).to(cos.dtype)
        a, b = tl.split(tl.reshape(x, [BLOCK_H, BLOCK_R2, 2]))
        ra = a * cos[None, :] - b * sin[None, :]
        rb = b * cos[None, :] + a * sin[None, :]
        y = tl.reshape(tl.join(ra, rb), [BLOCK_H, 2 * BLOCK_R2])
        y = y.to(out_dtype)
        o_ptr = OUT + heads[:, None] * stride_oh + col[None, :]
        tl.store(o_ptr, y, mask=mask2)
    else:  # two contiguous half-rows per head
        mask = head_ok[:, None] & (pairs[None, :] < ROTARY_DIM // 2)
        col = pairs[None, :]
        x_ptr = X + heads[:, None] * stride_xh + col
        a = tl.load(x_ptr, mask=mask, other=0.0).to(cos.dtype)
        b = tl.load(x_ptr + ROTARY_DIM // 2, mask=mask, other=0.0)
        b = b.to(cos.dtype)
        ra = a * cos[None, :] - b * sin[None, :]
        rb = b * cos[None, :] + a * sin[None, :]
        o_ptr = OUT + heads[:, None] * stride_oh + col
        tl.store(o_ptr, ra.to(out_dtype), mask=mask)
        tl.store(o_ptr + ROTARY_DIM // 2, rb.to(out_dtype), mask=mask)
    if COPY_REST:
        rest = ROTARY_DIM + tl.arange(0, BLOCK_REST)
        rest_mask = head_ok[:, None] & (rest[None, :] < HEAD_DIM)
        rest_x = X + heads[:, None] * stride_xh + rest[None, :]
        kept = tl.load(rest_x, mask=rest_mask)
        rest_out = OUT + heads[:, None] * stride_oh + rest[None, :]
        tl.store(rest_out, kept, mask=rest_mask)


@jit
def _document_start(CU, token, num_docs, SEARCH_STEPS: tl.constexpr):  # type: ignore[no-untyped-def]
    """``cu[j]`` for the largest ``j < num_docs`` with ``cu[j] <= token``: a binary search of ``SEARCH_STEPS`` steps.

    Empty documents (equal neighbours) are skipped because the search takes the largest such ``j``.
    """
    lo = token * 0
    hi = lo + num_docs - 1
    for _ in tl.static_range(SEARCH_STEPS):
        mid = (lo + hi + 1) // 2
        go = tl.load(CU + mid) <= token
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid - 1)
    return tl.load(CU + lo)


@jit
def rotary_qk_kernel(  # type: ignore[no-untyped-def]
    Q,
    K,
    Q_OUT,
    K_OUT,
    COS,
    SIN,
    POS,
    seq_len,
    table_len,
    q_heads,
    k_heads,
    q_blocks,
    stride_qb,
    stride_qs,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_qob,
    stride_qos,
    stride_qoh,
    stride_kob,
    stride_kos,
    stride_koh,
    stride_pb,
    stride_ps,
    stride_table,
    FREQ,
    ROTARY_DIM: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_R2: tl.constexpr,
    BLOCK_REST: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    CONJUGATE: tl.constexpr,
    COPY_REST: tl.constexpr,
    VARLEN: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
    HAS_FREQ: tl.constexpr,
):
    """Grid ``(batch * seq, q_blocks + k_blocks)``; see the module
    docstring."""
    token = tl.program_id(0)
    block = tl.program_id(1)
    b = token // seq_len
    s = token % seq_len
    if VARLEN:
        # POS is cu_seqlens [num_docs + 1] of a packed row (batch 1): find
        # the token's document; stride_pb holds num_docs here
        pos = s - _document_start(POS, s, stride_pb, SEARCH_STEPS)
    else:
        pos = tl.load(POS + b * stride_pb + s * stride_ps)
    # a row of the table; the host checks the range, or FREQ covers the rest
    inside = (pos >= 0) & (pos < table_len)
    row = tl.minimum(tl.maximum(pos, 0), table_len - 1)
    pairs = tl.arange(0, BLOCK_R2)
    pair_ok = pairs < ROTARY_DIM // 2
    row_ok = pair_ok & inside
    cos = tl.load(COS + row * stride_table + pairs, mask=row_ok, other=0.0)
    sin = tl.load(SIN + row * stride_table + pairs, mask=row_ok, other=0.0)
    if HAS_FREQ:
        if not inside:
            # beyond the table: the row from the float64 frequencies,
            # as the table's rows were made, then the attention factor
            inv = tl.load(FREQ + pairs, mask=pair_ok, other=0.0)
            factor = tl.load(FREQ + ROTARY_DIM // 2)
            angle = pos.to(tl.float64) * inv
            cos = (tl.cos(angle) * factor).to(cos.dtype)
            sin = (tl.sin(angle) * factor).to(sin.dtype)
    if CONJUGATE:
        sin = -sin
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
        _rotate_head_block(
            K + b * stride_kb + s * stride_ks,
            K_OUT + b * stride_kob + s * stride_kos,
            (block - q_blocks) * BLOCK_H,
            k_heads,
            stride_kh,
            stride_koh,
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


def block_heads(q_heads: int, k_heads: int, head_dim: int) -> int:
    """Heads per program: a power of two holding about 2048 features (16 heads of 128), at most the head count."""
    most = triton.next_power_of_2(max(q_heads, k_heads))
    return max(1, min(most, triton.next_power_of_2(max(1, 2048 // head_dim))))


def launch(
    q: torch.Tensor,
    k: torch.Tensor,
    q_out: torch.Tensor,
    k_out: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    *,
    frequencies: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    interleaved: bool,
    conjugate: bool,
) -> None:
    """Write the rotation of ``q``/``k`` into ``q_out``/``k_out`` (which may be ``q``/``k``: in place).

    Shapes: ``q`` ``[B, S, Hq, D]``, ``k`` ``[B, S, Hk, D]`` (``Hk`` may be 0) with unit stride on
    ``D``; ``cos``/``sin`` ``[L, d_rot/2]`` contiguous rows; ``positions`` int64 ``[B, S]`` (any
    strides, 0 for a shared row; ``[S]`` and ``[1, S]`` are broadcast). With ``cu_seqlens`` (``[num_docs + 1]``, a packed row of batch 1)
    ``positions`` is not read: each program finds its token's document by a binary search of
    ``cu_seqlens`` and counts from its start. With ``frequencies`` (float64 ``[d_rot/2 + 1]``: the
    inverse frequencies, then the factor on cos and sin) a position outside ``[0, L)`` gets its row
    computed in the kernel; without, positions must lie in the table. Unchecked.
    """
    batch, seq, q_heads, head_dim = q.shape
    k_heads = k.shape[2]
    rotary_dim = 2 * cos.shape[-1]
    bh = block_heads(q_heads, max(k_heads, 1), head_dim)
    q_blocks = triton.cdiv(q_heads, bh)
    grid = (batch * seq, q_blocks + triton.cdiv(k_heads, bh))
    if grid[0] == 0:
        return
    rest = head_dim - rotary_dim
    varlen = cu_seqlens is not None
    positions = positions.expand(batch, seq)
    cu = cu_seqlens.to(torch.int64) if cu_seqlens is not None else positions
    num_docs = cu.shape[0] - 1 if varlen else 0
    rotary_qk_kernel[grid](
        q,
        k,
        q_out,
        k_out,
        cos,
        sin,
        cu if varlen else positions,
        seq,
        cos.shape[0],
        q_heads,
        k_heads,
        q_blocks,
        *q.stride()[:3],
        *k.stride()[:3],
        *q_out.stride()[:3],
        *k_out.stride()[:3],
        *((num_docs, 0) if varlen else positions.stride()),
        cos.stride(0),
        cos if frequencies is None else frequencies,
        ROTARY_DIM=rotary_dim,
        HEAD_DIM=head_dim,
        BLOCK_H=bh,
        BLOCK_R2=triton.next_power_of_2(rotary_dim // 2),
        BLOCK_REST=triton.next_power_of_2(max(rest, 1)),
        INTERLEAVED=interleaved,
        CONJUGATE=conjugate,
        VARLEN=varlen,
        SEARCH_STEPS=max(1, (num_docs - 1).bit_length()) if varlen else 1,
        HAS_FREQ=frequencies is not None,
        COPY_REST=rest > 0 and not writes_in_place(q, k, q_out, k_out),
        num_warps=4,
        enable_fp_fusion=False,  # a c - b s as two roundings, as the PyTorch kernel
    )
