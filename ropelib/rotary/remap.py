r"""Position remapping: RoPE asked for other relative positions than ``p_i - p_j``, piece by piece.

RoPE's score of query ``i`` and key ``j`` depends on the two rotations only through the difference of
the positions they are rotated to. A remapping scheme (ReRoPE, :mod:`~ropelib.rotary.rerope`;
Self-Extend, :mod:`~ropelib.rotary.self_extend`; dual chunk attention,
:mod:`~ropelib.rotary.dual_chunk`) splits the ``seq x seq`` score matrix into regions, and in each
:class:`Piece` rotates the query at ``p_i`` to ``a(p_i)`` and the key at ``p_j`` to ``b(p_j)``:

.. math:: s_{ij} = \frac{(R_{a(p_i)} q_i) \cdot (R_{b(p_j)} k_j)}{\sqrt d}, \quad
    \text{relative position } a(p_i) - b(p_j),

one score matrix per piece, selected entry by entry. The first piece is RoPE itself
(``a = b = identity``) near the diagonal, so those entries are RoPE's scores, bit for bit. The
schemes define the pieces of the past (``p_i >= p_j``); the future mirrors them
(``r(i, j) = -r(j, i)``), and a causal call skips it. Tensors are ``[batch, seq, heads, d]`` in,
scores ``[batch, heads, seq, seq]`` out, as :class:`~ropelib.MultiHeadAttention`'s logits.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .._validation import check_bool, check_positions, check_qk
from ..frequencies import angle_tables
from ..kernels.door import check_kernel
from .cache import table_dtype
from .rotation import Rotation
from .standard import RotaryEmbedding


@dataclass(frozen=True)
class Piece:
    """One region of a remapped score matrix and the positions its queries and keys are rotated to.

    Attributes:
        query_positions: ``a(p)``, int64 or float64 ``[seq]`` / ``[batch, seq]``; None: not rotated (``a = 0``).
        key_positions: ``b(p)``, likewise.
        region: bool ``[seq, seq]`` / ``[batch, seq, seq]``, where this piece's scores are used.
    """

    query_positions: torch.Tensor | None
    key_positions: torch.Tensor | None
    region: torch.Tensor

    def mirrored(self) -> Piece:
        """The piece of the transposed region with the roles of queries and keys swapped: ``r(i, j) = -r(j, i)``."""
        return Piece(self.key_positions, self.query_positions, self.region.transpose(-1, -2))

    def relative(self) -> torch.Tensor:
        """``a(p_i) - b(p_j)`` for every pair, ``[.., seq, seq]`` (float64 if either side is real-valued)."""
        a, b = self.query_positions, self.key_positions
        if a is None:
            assert b is not None  # a piece rotates at least one side
            a = torch.zeros_like(b)
        b = torch.zeros_like(a) if b is None else b
        return a.unsqueeze(-1) - b.unsqueeze(-2)


def with_mirrors(pieces: Sequence[Piece]) -> list[Piece]:
    """The first (symmetric, RoPE's own) piece, the past pieces after it, then their mirrors."""
    return [*pieces, *(piece.mirrored() for piece in pieces[1:])]


def relative_map(pieces: Sequence[Piece]) -> torch.Tensor:
    """The relative position each pair of the score matrix is scored at, ``[.., seq, seq]``, both halves."""
    pieces = with_mirrors(pieces)
    out = pieces[0].relative()
    for piece in pieces[1:]:
        out = torch.where(piece.region, piece.relative(), out)
    return out


def check_remap_call(
    q: torch.Tensor, k: torch.Tensor, rope: object, positions: torch.Tensor | None, causal: object
) -> torch.Tensor:
    """The checks of every remapped-scores door; returns the int64 positions (``0 .. seq-1`` by default)."""
    if not isinstance(rope, RotaryEmbedding):
        raise TypeError(f"rope must be a ropelib.RotaryEmbedding, got {type(rope).__name__}")
    if rope.learned_freq or rope.spec.follows_length:
        raise ValueError("rope must have fixed frequencies (no learned_freq, no dynamic or longrope scaling)")
    check_qk(q, k, head_dim=rope.head_dim)
    if q.shape[2] != k.shape[2]:
        raise ValueError(
            f"q and k must have the same heads (repeat k for grouped queries), got {q.shape} and {k.shape}"
        )
    check_bool(causal, "causal")
    if positions is None:
        return torch.arange(q.shape[1], device=q.device)
    return check_positions(positions, "positions", batch=q.shape[0], seq_len=q.shape[1]).to(q.device)


def _rotation(rope: RotaryEmbedding, x: torch.Tensor, positions: torch.Tensor) -> Rotation:
    """The rotation of ``x``'s tokens to ``positions``: the cache's rows for integers, computed rows for reals."""
    if not positions.is_floating_point():
        return rope.rotation(x, positions)
    cos, sin = angle_tables(rope.cache.inv_freq.to(x.device), positions, rope.attention_scaling, table_dtype(x.dtype))
    rows = torch.arange(positions.numel(), device=x.device).view(positions.shape)
    kernel = check_kernel(rope.kernel, x.device, x.dtype)
    flat = cos.shape[-1]
    return Rotation(
        cos.reshape(-1, flat),
        sin.reshape(-1, flat),
        rows,
        rope.layout == "interleaved",
        kernel,
        rope.head_dim,
        x.shape[1],
    )


def _rotated(
    rope: RotaryEmbedding, q: torch.Tensor, k: torch.Tensor, piece: Piece
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q`` and ``k`` rotated to the piece's positions (one operator call when they share them)."""
    a, b = piece.query_positions, piece.key_positions
    if a is not None and a is b:
        return _rotation(rope, q, a).apply(q, k)
    none = q.narrow(2, 0, 0)  # a partner with no heads: the operator rotates one tensor
    q = q if a is None else _rotation(rope, q, a).apply(q, none)[0]
    k = k if b is None else _rotation(rope, k, b).apply(k, none)[0]
    return q, k


def remapped_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    rope: RotaryEmbedding,
    pieces: Sequence[Piece],
    positions: torch.Tensor,
    causal: bool,
) -> torch.Tensor:
    """The scores of checked ``q``, ``k`` (``[batch, seq, heads, d]``) over ``pieces``: ``[batch, heads, seq, seq]``.

    With ``causal``, the mirrored pieces are not computed and keys after the query
    (``p_j > p_i``) score ``-inf``.
    """
    out: torch.Tensor | None = None
    for piece in pieces if causal else with_mirrors(pieces):
        q_rot, k_rot = _rotated(rope, q, k, piece)
        scores = q_rot.transpose(1, 2) @ k_rot.transpose(1, 2).transpose(-1, -2) / math.sqrt(q.shape[-1])
        out = scores if out is None else torch.where(_per_head(piece.region), scores, out)
    assert out is not None  # every scheme has RoPE's piece first
    if causal:
        later = positions.unsqueeze(-2) > positions.unsqueeze(-1)
        out = out.masked_fill(_per_head(later), float("-inf"))
    return out


def _per_head(region: torch.Tensor) -> torch.Tensor:
    """``[seq, seq]`` stays (broadcast), ``[batch, seq, seq]`` gains the heads axis."""
    return region if region.ndim == 2 else region.unsqueeze(1)


def check_relative_positions(positions: object) -> torch.Tensor:
    """Integer positions ``[seq]`` or ``[batch, seq]``, >= 0, as int64 (the door of the relative maps)."""
    if not isinstance(positions, torch.Tensor):
        raise TypeError(f"positions must be an integer torch.Tensor, got {type(positions).__name__}")
    if positions.ndim not in (1, 2):
        raise ValueError(f"positions must have shape [seq] or [batch, seq], got {list(positions.shape)}")
    batch = positions.shape[0] if positions.ndim == 2 else None
    return check_positions(positions, "positions", batch=batch, seq_len=positions.shape[-1])


class RemappedRotary(nn.Module, abc.ABC):
    """A RoPE scored at remapped relative positions: its :class:`~ropelib.RotaryEmbedding` and a scheme's pieces.

    Subclasses (:class:`~ropelib.rotary.rerope.ReRoPE`, :class:`~ropelib.rotary.self_extend.SelfExtend`,
    :class:`~ropelib.rotary.dual_chunk.DualChunkAttention`) define :meth:`pieces`.

    Shapes:
        ``forward(q, k, positions=None, *, causal=False)``: ``q``, ``k`` ``[batch, seq, heads, d]``
        (the same heads), ``positions`` integers ``[seq]`` or ``[batch, seq]``, >= 0 (default
        ``0 .. seq-1``); returns the scores ``[batch, heads, seq, seq]`` (divided by ``sqrt(d)``).
    """

    def __init__(self, head_dim: int, **rope_options: Any) -> None:
        super().__init__()
        self.rope = RotaryEmbedding(head_dim, **rope_options)
        if self.rope.spec.follows_length:
            raise ValueError("a remapped RoPE needs fixed frequencies: no dynamic or longrope scaling")

    @abc.abstractmethod
    def pieces(self, positions: torch.Tensor) -> list[Piece]:
        """The scheme's pieces for checked int64 ``positions``: RoPE's own first, then the past's."""

    def relative(self, positions: torch.Tensor) -> torch.Tensor:
        """The relative position each pair is scored at, ``[.., seq, seq]`` (:func:`relative_map`)."""
        return relative_map(self.pieces(check_relative_positions(positions)))

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor | None = None, *, causal: bool = False
    ) -> torch.Tensor:
        positions = check_remap_call(q, k, self.rope, positions, causal)
        return remapped_scores(q, k, self.rope, self.pieces(positions), positions, causal)
