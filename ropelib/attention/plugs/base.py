r"""The protocol every position encoding's plug follows, and the plug of no encoding.

An encoding can act at four places of ``softmax(q k^T / sqrt(d) + b) v``:

* :meth:`PositionPlug.embed`: on the input ``x`` before the projections (absolute encodings);
* :meth:`PositionPlug.rotate`: on ``q`` and ``k`` (RoPE and its relatives);
* :meth:`PositionPlug.score_bias` and :meth:`PositionPlug.value_term`: a bias ``b_ij`` on the
  scores and a term added to the output (the relative encodings);
* :meth:`PositionPlug.logits`: the whole score matrix, for encodings that read ``q`` and ``k``
  together (contextual positions, position remapping that mixes two rotations).

Each method's default does nothing, so a plug overrides only where its encoding acts. Plugs
hold no state: the encoding's module (if any) is the attention layer's ``encoding`` attribute,
which they receive with the layer.
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol

import torch
from torch import nn

from ...rotary import Rotation


class AttentionLayer(Protocol):
    """What a plug reads of the attention layer it serves (:class:`ropelib.MultiHeadAttention`)."""

    embed_dim: int
    num_heads: int
    head_dim: int
    causal: bool
    encoding: nn.Module | None
    alibi_slopes: torch.Tensor


def relative_from_positions(positions: torch.Tensor) -> torch.Tensor:
    """``positions[..., j] - positions[..., i]``: ``[seq] -> [seq, seq]``, ``[b, seq] -> [b, seq, seq]``."""
    return positions.unsqueeze(-2) - positions.unsqueeze(-1)


class PositionPlug:
    """No position encoding; the base of every plug. Subclasses override what their encoding does."""

    #: the encoding's name in tables and figures (the paper's, e.g. ``"ALiBi"``); the ``position`` key if empty
    label: ClassVar[str] = ""
    #: keyword options of :class:`~ropelib.MultiHeadAttention` that this encoding reads
    options: ClassVar[frozenset[str]] = frozenset()
    #: whether the encoding reads the positions' values through a table (so they must be in range)
    needs_table = False
    #: whether :meth:`score_bias` returns a bias, and whether :meth:`value_term` may return a term
    adds_bias = False
    adds_values = False
    #: whether :meth:`logits` computes the scores itself (then the layer does not, and uses no bias)
    computes_logits = False

    @staticmethod
    def build(attn: AttentionLayer, max_positions: int | None, options: dict[str, Any]) -> nn.Module | None:
        """The encoding's module for ``attn`` (its ``encoding`` attribute), or None."""
        return None

    @staticmethod
    def embed(attn: AttentionLayer, x: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        """``x`` ``[batch, seq, E]`` with the encoding added (absolute encodings)."""
        return x

    @staticmethod
    def rotate(
        attn: AttentionLayer,
        q: torch.Tensor,
        k: torch.Tensor,
        positions: torch.Tensor | None,
        rotation: Rotation | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``q``, ``k`` ``[batch, seq, heads, d]`` after the encoding (RoPE rotates them, by ``rotation``
        when the model made one for all its layers)."""
        return q, k

    @staticmethod
    def score_bias(attn: AttentionLayer, q: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """``b_ij`` as ``[batch or 1, heads, seq, seq]`` in ``q``'s dtype, or None. ``q`` is ``[batch, heads, seq, d]``."""
        return None

    @staticmethod
    def logits(attn: AttentionLayer, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """The pre-softmax scores ``[batch, heads, seq, seq]`` (before the causal mask), or None.

        ``q`` and ``k`` are ``[batch, heads, seq, d]`` after :meth:`rotate` (``k`` repeated to the
        query heads); ``positions`` ``[seq]`` or ``[batch, seq]``. Only for plugs with
        ``computes_logits``; the layer masks, takes the softmax and adds :meth:`value_term`.
        """
        return None

    @staticmethod
    def value_term(attn: AttentionLayer, weights: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """A term added to ``weights @ v`` (``[batch, heads, seq, d]``), or None."""
        return None
