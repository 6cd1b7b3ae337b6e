r"""Relative biases as ``flex_attention`` score modifications, beside the materialized ``n x n`` bias.

ALiBi (Press et al., 2022) and T5 (Raffel et al., 2020) add a bias ``b_ij`` that depends on
``j - i`` (and the head) to the attention scores,

.. math:: \operatorname{softmax}\!\big(q_i \cdot k_j / \sqrt{d} + b_{h,ij}\big).

* :func:`materialized_bias_attention` builds ``b`` as an ``[heads, n, n]`` tensor and passes it as
  ``attn_mask`` to :func:`torch.nn.functional.scaled_dot_product_attention`: ``O(h n^2)`` memory
  written and read once more.
* :func:`flex_bias_attention` hands :func:`torch.nn.attention.flex_attention.flex_attention` a
  ``score_mod`` that adds the bias to each score as it is computed. ALiBi needs one slope per
  head; T5 one value per (offset, head), looked up from a ``[2n - 1, heads]`` table.

On a CPU, ``flex_attention`` runs fused only under :func:`torch.compile` (``compiled=True``);
without it PyTorch falls back to an unfused reference that materializes the scores (useful for
checking, not for speed). Tensors here are ``[batch, heads, seq, head_dim]``, as in SDPA.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from .._validation import check_float_tensor
from .relative import T5RelativeBias, t5_relative_bucket

ScoreMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_float_tensor(t, name, ndim=4)
    if q.shape != k.shape or q.shape[:3] != v.shape[:3]:
        raise ValueError(
            f"q, k must be [batch, heads, seq, d] of equal shape and v [batch, heads, seq, d_v]; got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )


def alibi_score_mod(slopes: torch.Tensor) -> ScoreMod:
    r"""A ``score_mod`` adding ALiBi's ``-m_h |j - i|`` (the bias of :func:`ropelib.alibi_bias`).

    Args:
        slopes: ``[heads]`` (from :func:`ropelib.alibi_slopes`); kept in float32 for the kernel.
    """
    slopes = check_float_tensor(slopes, "slopes", ndim=1).to(torch.float32)

    def alibi(score, batch, head, q_idx, kv_idx):
        return score - slopes[head] * (kv_idx - q_idx).abs()

    return alibi


def t5_offset_table(bias: T5RelativeBias, seq_len: int) -> torch.Tensor:
    """T5's bias for every offset ``j - i`` in ``-(n-1) .. n-1``: ``[2n - 1, heads]``, row ``j - i + n - 1``."""
    offsets = torch.arange(-(seq_len - 1), seq_len, device=bias.weight.device)
    buckets = t5_relative_bucket(offsets, bias.bidirectional, bias.num_buckets, bias.max_distance)
    return bias.weight[buckets]


def t5_score_mod(bias: T5RelativeBias, seq_len: int) -> ScoreMod:
    """A ``score_mod`` adding T5's learned bucket bias (the bias of :class:`ropelib.T5RelativeBias`)."""
    table = t5_offset_table(bias, seq_len).detach().to(torch.float32)
    shift = seq_len - 1

    def t5(score, batch, head, q_idx, kv_idx):
        return score + table[kv_idx - q_idx + shift, head]

    return t5


def materialized_bias_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """SDPA with the bias as an ``attn_mask``: ``bias`` is ``[heads, n, n]`` (or broadcastable to the scores)."""
    _check_qkv(q, k, v)
    check_float_tensor(bias, "bias")
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(q.dtype))


@functools.cache
def _compiled_flex_attention() -> Any:
    """One ``torch.compile(flex_attention)`` for every call (compiled graphs are process-wide, as torch's own)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


def flex_bias_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, score_mod: ScoreMod, *, compiled: bool = True
) -> torch.Tensor:
    """``flex_attention`` with ``score_mod`` (no ``n x n`` tensor when ``compiled``).

    Args:
        q, k, v: ``[batch, heads, seq, d]``.
        score_mod: from :func:`alibi_score_mod` or :func:`t5_score_mod`.
        compiled: go through one shared ``torch.compile(flex_attention)`` (the fused kernel; the
            first call per ``score_mod`` compiles, seconds on a CPU). ``False`` runs PyTorch's
            unfused reference, with its warning about that silenced.
    """
    from torch.nn.attention.flex_attention import flex_attention

    _check_qkv(q, k, v)
    if compiled:
        return _compiled_flex_attention()(q, k, v, score_mod=score_mod)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return flex_attention(q, k, v, score_mod=score_mod)
