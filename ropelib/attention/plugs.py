r"""How each position encoding enters attention: one small protocol, one class per encoding.

An encoding can act at three places of ``softmax(q k^T / sqrt(d) + b) v``:

* :meth:`PositionPlug.embed`: on the input ``x`` before the projections (absolute encodings);
* :meth:`PositionPlug.rotate`: on ``q`` and ``k`` (RoPE);
* :meth:`PositionPlug.score_bias` and :meth:`PositionPlug.value_term`: a bias ``b_ij`` on the
  scores and a term added to the output (the relative encodings).

Each method's default does nothing, so a plug overrides only where its encoding acts.
:data:`PLUGS` maps the ``position`` argument of :class:`~ropelib.MultiHeadAttention` to its plug;
a new encoding is one class and one entry. Plugs hold no state: the encoding's module (if any)
is the attention layer's ``encoding`` attribute, which they receive with the layer.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, ClassVar, Protocol, cast

import torch
from torch import nn

from ..encodings.absolute import LearnedPositionalEmbedding, SinusoidalPositionalEncoding
from ..encodings.relative import ShawRelativePosition, T5RelativeBias, alibi_bias_from_relative, alibi_slopes
from ..rotary import RotaryEmbedding, Rotation


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

    #: keyword options of :class:`~ropelib.MultiHeadAttention` that this encoding reads
    options: ClassVar[frozenset[str]] = frozenset()
    #: whether the encoding reads the positions' values through a table (so they must be in range)
    needs_table = False
    #: whether :meth:`score_bias` returns a bias, and whether :meth:`value_term` may return a term
    adds_bias = False
    adds_values = False

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
    def value_term(attn: AttentionLayer, weights: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """A term added to ``weights @ v`` (``[batch, heads, seq, d]``), or None."""
        return None


class SinusoidalPlug(PositionPlug):
    options = frozenset({"base"})

    @staticmethod
    def build(attn: AttentionLayer, max_positions: int | None, options: dict[str, Any]) -> nn.Module | None:
        return SinusoidalPositionalEncoding(attn.embed_dim, **options)

    @staticmethod
    def embed(attn: AttentionLayer, x: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        return cast(SinusoidalPositionalEncoding, attn.encoding).add(x, positions)


class LearnedPlug(PositionPlug):
    needs_table = True

    @staticmethod
    def build(attn: AttentionLayer, max_positions: int | None, options: dict[str, Any]) -> nn.Module | None:
        if max_positions is None:
            raise ValueError("position='learned' needs max_positions (the size of the learned table)")
        return LearnedPositionalEmbedding(max_positions, attn.embed_dim)

    @staticmethod
    def embed(attn: AttentionLayer, x: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        return cast(LearnedPositionalEmbedding, attn.encoding).add(x, positions)


class RotaryPlug(PositionPlug):
    options = frozenset({"theta", "layout", "rotary_dim", "scaling", "max_position_embeddings", "kernel", "rotary"})

    @staticmethod
    def build(attn: AttentionLayer, max_positions: int | None, options: dict[str, Any]) -> nn.Module | None:
        shared = options.get("rotary")
        if shared is None:
            return RotaryEmbedding(attn.head_dim, **options)
        if len(options) > 1:
            raise ValueError(f"rotary= shares a RotaryEmbedding: give no other RoPE options, got {sorted(options)}")
        if not isinstance(shared, RotaryEmbedding) or shared.head_dim != attn.head_dim:
            raise ValueError(f"rotary must be a RotaryEmbedding of head_dim={attn.head_dim}, got {shared!r}")
        return shared

    @staticmethod
    def rotate(
        attn: AttentionLayer,
        q: torch.Tensor,
        k: torch.Tensor,
        positions: torch.Tensor | None,
        rotation: Rotation | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if rotation is None:
            rotation = cast(RotaryEmbedding, attn.encoding).rotation(q, positions)
        return rotation(q, k)


class T5Plug(PositionPlug):
    options = frozenset({"num_buckets", "max_distance"})
    adds_bias = True

    @staticmethod
    def build(attn: AttentionLayer, max_positions: int | None, options: dict[str, Any]) -> nn.Module | None:
        return T5RelativeBias(attn.num_heads, bidirectional=not attn.causal, **options)

    @staticmethod
    def score_bias(attn: AttentionLayer, q: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        bias = cast(T5RelativeBias, attn.encoding).bias(relative_from_positions(positions))
        return (bias if bias.ndim == 4 else bias.unsqueeze(0)).to(q.dtype)


class AlibiPlug(PositionPlug):
    adds_bias = True

    @staticmethod
    def build(attn: AttentionLayer, max_positions: int | None, options: dict[str, Any]) -> nn.Module | None:
        # float64 plain attribute, not a buffer: .float()/.half() must not round the slopes.
        attn.alibi_slopes = alibi_slopes(attn.num_heads)
        return None

    @staticmethod
    def score_bias(attn: AttentionLayer, q: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        slopes = attn.alibi_slopes.to(q.device)
        bias = alibi_bias_from_relative(slopes, relative_from_positions(positions), dtype=torch.float64)
        return (bias if bias.ndim == 4 else bias.unsqueeze(0)).to(q.dtype)  # rounded once


class ShawPlug(PositionPlug):
    options = frozenset({"max_relative_position", "values"})
    adds_bias = adds_values = True

    @staticmethod
    def build(attn: AttentionLayer, max_positions: int | None, options: dict[str, Any]) -> nn.Module | None:
        return ShawRelativePosition(attn.head_dim, **options)

    @staticmethod
    def score_bias(attn: AttentionLayer, q: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        return cast(ShawRelativePosition, attn.encoding).score_bias(q, relative_from_positions(positions))

    @staticmethod
    def value_term(attn: AttentionLayer, weights: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        shaw = cast(ShawRelativePosition, attn.encoding)
        if shaw.value_table is None:
            return None
        return shaw.value_term(weights, relative_from_positions(positions))


#: ``position`` name -> plug. No encoding, the two absolute ones, the three relative biases, RoPE.
PLUGS: MappingProxyType[str, type[PositionPlug]] = MappingProxyType(
    {
        "none": PositionPlug,
        "sinusoidal": SinusoidalPlug,
        "learned": LearnedPlug,
        "t5": T5Plug,
        "alibi": AlibiPlug,
        "shaw": ShawPlug,
        "rope": RotaryPlug,
    }
)
