r"""RoPE inside a packed QKV projection: q and k rotated where they lie, v untouched (flash-attn's ``apply_rotary_emb_qkv_``).

A fused projection writes queries, keys and values side by side, ``[batch, seq, Hq + 2 Hk,
head_dim]`` (grouped-query attention) or ``[batch, seq, 3, heads, head_dim]``. :func:`~ropelib.rotary_qkv_`
takes q and k as views of that buffer and rotates them in place with one call of the operator
``ropelib::rotary_``: no copy of q, k or v, and autograd records the rotation of each view.
"""

from __future__ import annotations

import torch

from .._validation import check_float_tensor, check_int
from ..kernels.door import rotary_qk


def qkv_views(qkv: torch.Tensor, num_heads_q: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, k, v)`` as views of a checked packed buffer (the forms of :func:`~ropelib.rotary_qkv_`).

    Single views (``select``, ``narrow``), not ``unbind``/``split``: autograd lets only those be
    modified in place.
    """
    if num_heads_q is None:  # [.., 3, heads, head_dim]
        return qkv.select(2, 0), qkv.select(2, 1), qkv.select(2, 2)
    kv_heads = (qkv.shape[2] - num_heads_q) // 2
    return (
        qkv.narrow(2, 0, num_heads_q),
        qkv.narrow(2, num_heads_q, kv_heads),
        qkv.narrow(2, num_heads_q + kv_heads, kv_heads),
    )


def _check_qkv(qkv: object, num_heads_q: object) -> tuple[torch.Tensor, int | None]:
    qkv = check_float_tensor(qkv, "qkv")
    if qkv.ndim == 5:
        if qkv.shape[2] != 3:
            raise ValueError(f"a 5-D qkv must be [batch, seq, 3, heads, head_dim], got shape {tuple(qkv.shape)}")
        if num_heads_q is not None:
            raise ValueError("num_heads_q is for the [batch, seq, Hq + 2 Hk, head_dim] form, not [.., 3, heads, ..]")
        return qkv, None
    if qkv.ndim != 4:
        raise ValueError(
            "qkv must be [batch, seq, Hq + 2 Hk, head_dim] or [batch, seq, 3, heads, head_dim], "
            f"got shape {tuple(qkv.shape)}"
        )
    if num_heads_q is None:
        raise ValueError("qkv of [batch, seq, Hq + 2 Hk, head_dim] needs num_heads_q (how many heads are queries)")
    heads = qkv.shape[2]
    num_heads_q = check_int(num_heads_q, "num_heads_q", minimum=1, maximum=max(heads - 2, 1))
    if (heads - num_heads_q) % 2 or heads - num_heads_q < 2:
        raise ValueError(
            f"qkv's {heads} heads minus num_heads_q={num_heads_q} must be 2 Hk (as many key as value heads, Hk >= 1)"
        )
    return qkv, num_heads_q


def rotary_qkv_(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor | None = None,
    *,
    num_heads_q: int | None = None,
    layout: str = "half",
    kernel: str = "auto",
    seqlen_offsets: int | torch.Tensor = 0,
    tensor_format: str = "bshd",
) -> torch.Tensor:
    r"""Rotate the queries and keys of a packed QKV buffer in place (RoPE, Su et al., 2024); the values are kept.

    ``positions``, ``layout``, ``kernel``, ``seqlen_offsets`` and ``tensor_format`` are as for
    :func:`~ropelib.rotary_qk`.

    Args:
        qkv: ``[batch, seq, 3, heads, head_dim]``, or ``[batch, seq, Hq + 2 Hk, head_dim]`` with
            ``num_heads_q = Hq`` (the query heads first, then ``Hk`` key and ``Hk`` value heads).
            With ``tensor_format="sbhd"`` the first two dimensions are ``[seq, batch]``.
        cos: a ``[table_len, d_rot/2]`` table, as for :func:`~ropelib.rotary_qk`.
        sin: the sine table, of ``cos``'s shape.
        num_heads_q: the number of query heads of the 4-D form (None for the 5-D one).

    Returns:
        ``qkv`` itself, its q and k heads rotated (its version counter moves; autograd records the
        rotation unless ``qkv`` is a leaf that requires grad, which no in-place op may overwrite).

    Example:
        >>> from ropelib import RotaryEmbedding
        >>> cos, sin = RotaryEmbedding(8).cos_sin_cache(4)
        >>> qkv = torch.randn(1, 4, 4 + 2 * 2, 8)  # 4 q heads, 2 k, 2 v
        >>> v = qkv[:, :, 6:].clone()
        >>> out = rotary_qkv_(qkv, cos, sin, num_heads_q=4)
        >>> out is qkv, torch.equal(qkv[:, :, 6:], v)
        (True, True)
    """
    qkv, num_heads_q = _check_qkv(qkv, num_heads_q)
    q, k, _ = qkv_views(qkv, num_heads_q)
    rotary_qk(
        q,
        k,
        cos,
        sin,
        positions,
        layout=layout,
        inplace=True,
        kernel=kernel,
        seqlen_offsets=seqlen_offsets,
        tensor_format=tensor_format,
    )
    return qkv
