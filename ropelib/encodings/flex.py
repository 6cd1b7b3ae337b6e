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
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from .._validation import check_bool, check_float_tensor, check_int
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


@dataclass(frozen=True)
class ScoreModSizes:
    """What a ``score_mod`` of this module was built for, kept on it (attribute :data:`~ropelib.encodings.flex.SIZES`).

    Its tables are indexed inside ``flex_attention``'s kernel, where an index past them cannot
    raise a readable error (eager: a bare :class:`IndexError`; compiled: an out-of-bounds read or
    a negative offset that wraps around the table). :func:`flex_bias_attention` compares ``q`` with
    these sizes before the call.

    Attributes:
        kind: ``"alibi"`` or ``"t5"``, the function that built it.
        heads: the number of heads it has a slope (ALiBi) or a bias column (T5) for.
        seq_len: the longest query and key length its table covers (T5), or None (any: ALiBi).
        device: where its table lives (``q`` must be there too).
    """

    kind: str
    heads: int
    seq_len: int | None
    device: torch.device


#: The attribute of a ``score_mod`` made here that holds its :class:`~ropelib.encodings.flex.ScoreModSizes`.
SIZES = "_ropelib_sizes"


def score_mod_sizes(score_mod: object) -> ScoreModSizes | None:
    """The :class:`~ropelib.encodings.flex.ScoreModSizes` of a ``score_mod`` from :func:`alibi_score_mod` / :func:`t5_score_mod`, else None."""
    sizes = getattr(score_mod, SIZES, None)
    return sizes if isinstance(sizes, ScoreModSizes) else None


def alibi_score_mod(slopes: torch.Tensor) -> ScoreMod:
    r"""A ``score_mod`` adding ALiBi's ``-mu_h |j - i|`` (the bias of :func:`ropelib.alibi_bias`).

    Args:
        slopes: ``[heads]`` (from :func:`ropelib.alibi_slopes`), one per head of the attention
            it is used in (:func:`flex_bias_attention` checks); kept in float32 for the kernel.
    """
    slopes = check_float_tensor(slopes, "slopes", ndim=1).to(torch.float32)
    if slopes.numel() == 0:
        raise ValueError("slopes must hold one slope per head, got an empty tensor")

    def alibi(score, batch, head, q_idx, kv_idx):
        return score - slopes[head] * (kv_idx - q_idx).abs()

    setattr(alibi, SIZES, ScoreModSizes("alibi", slopes.shape[0], None, slopes.device))
    return alibi


def t5_offset_table(bias: T5RelativeBias, seq_len: int) -> torch.Tensor:
    """T5's bias for every offset ``j - i`` in ``-(n-1) .. n-1``: ``[2n - 1, heads]``, row ``j - i + n - 1``."""
    return _offset_table(*_check_t5(bias, seq_len))


def _offset_table(bias: T5RelativeBias, seq_len: int) -> torch.Tensor:
    offsets = torch.arange(-(seq_len - 1), seq_len, device=bias.weight.device)
    buckets = t5_relative_bucket(offsets, bias.bidirectional, bias.num_buckets, bias.max_distance)
    return bias.weight[buckets]


def _check_t5(bias: object, seq_len: object) -> tuple[T5RelativeBias, int]:
    if not isinstance(bias, T5RelativeBias):
        raise TypeError(f"bias must be a ropelib.T5RelativeBias, got {type(bias).__name__}")
    return bias, check_int(seq_len, "seq_len", minimum=1)


def t5_score_mod(bias: T5RelativeBias, seq_len: int) -> ScoreMod:
    """A ``score_mod`` adding T5's learned bucket bias (the bias of :class:`ropelib.T5RelativeBias`).

    Args:
        bias: the module whose weights (``[num_buckets, heads]``) give the bias.
        seq_len: the longest query or key length it will be used at (an int >= 1): its table
            covers the offsets ``-(seq_len - 1) .. seq_len - 1`` (:func:`flex_bias_attention`
            checks; longer sequences would read past the table or wrap around it).
    """
    bias, seq_len = _check_t5(bias, seq_len)
    table = _offset_table(bias, seq_len).detach().to(torch.float32)
    shift = seq_len - 1

    def t5(score, batch, head, q_idx, kv_idx):
        return score + table[kv_idx - q_idx + shift, head]

    setattr(t5, SIZES, ScoreModSizes("t5", bias.num_heads, seq_len, table.device))
    return t5


def _check_score_mod(score_mod: object, q: torch.Tensor, k: torch.Tensor) -> None:
    """``score_mod`` callable and, when made here, built for ``q``'s heads, length and device (metadata only)."""
    if not callable(score_mod):
        raise TypeError(
            f"score_mod must be callable (from alibi_score_mod or t5_score_mod), got {type(score_mod).__name__}"
        )
    sizes = score_mod_sizes(score_mod)
    if sizes is None:
        return
    maker = f"{sizes.kind}_score_mod"
    heads = q.shape[1]
    if sizes.heads != heads:
        what = "slopes" if sizes.kind == "alibi" else "bias heads (columns of its weight)"
        raise ValueError(
            f"score_mod was built by {maker} for {sizes.heads} heads ({sizes.heads} {what}) but q has {heads} "
            f"heads ([batch, heads, seq, d] = {tuple(q.shape)}); build it for {heads} heads"
        )
    longest = max(q.shape[2], k.shape[2])
    if sizes.seq_len is not None and longest > sizes.seq_len:
        raise ValueError(
            f"score_mod was built by t5_score_mod for seq_len={sizes.seq_len} (offsets up to "
            f"{sizes.seq_len - 1}) but q and k have {longest} positions; build it with seq_len >= {longest}"
        )
    if sizes.device != q.device:
        raise ValueError(f"score_mod's table is on {sizes.device} but q is on {q.device}; build it on q's device")


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
        score_mod: from :func:`alibi_score_mod` or :func:`t5_score_mod` (checked against ``q``'s heads,
            length and device: see :class:`~ropelib.encodings.flex.ScoreModSizes`), or any ``flex_attention`` score_mod.
        compiled: go through one shared ``torch.compile(flex_attention)`` (the fused kernel; the
            first call per ``score_mod`` compiles, seconds on a CPU). ``False`` runs PyTorch's
            unfused reference, with its warning about that silenced.
    """
    from torch.nn.attention.flex_attention import flex_attention

    _check_qkv(q, k, v)
    _check_score_mod(score_mod, q, k)
    check_bool(compiled, "compiled")
    if compiled:
        return _compiled_flex_attention()(q, k, v, score_mod=score_mod)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return flex_attention(q, k, v, score_mod=score_mod)
