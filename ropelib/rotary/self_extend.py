r"""Self-Extend (Jin et al., 2024, "LLM Maybe LongLM: Self-Extend LLM Context Window Without Tuning").

Neighbour attention keeps RoPE's relative positions inside a window ``W``; grouped attention
beyond it floor-divides the positions by a group size ``G`` and shifts the query's so that the
two meet at the window's edge:

.. math:: r(i, j) = \begin{cases} p_i - p_j & p_i - p_j < W \\
    \lfloor p_i / G \rfloor - \lfloor p_j / G \rfloor + W - \lfloor W / G \rfloor & \text{otherwise.} \end{cases}

Two pieces (:mod:`~ropelib.rotary.remap`): RoPE's own, and the grouped one, ``q`` rotated to
``floor(p_i / G) + W - floor(W / G)`` and ``k`` to ``floor(p_j / G)``. The largest relative
position at length ``n`` is about ``(n - 1) / G + W - W / G``: it stays below a training length
``L`` up to ``n = (L - W) G + W`` (the paper's extended window, for ``G`` dividing ``W``).
"""

from __future__ import annotations

from typing import Any

import torch

from .._validation import check_int
from .remap import Piece, RemappedRotary, check_relative_positions, check_remap_call, relative_map, remapped_scores
from .standard import RotaryEmbedding


def _check_options(window: object, group: object) -> tuple[int, int]:
    return check_int(window, "window", minimum=1), check_int(group, "group", minimum=1)


def self_extend_pieces(positions: torch.Tensor, window: int, group: int) -> list[Piece]:
    """RoPE's piece for ``|p_i - p_j| < W``, then the grouped piece for ``p_i - p_j >= W``."""
    distance = positions.unsqueeze(-1) - positions.unsqueeze(-2)
    grouped = positions // group
    return [
        Piece(positions, positions, distance.abs() < window),
        Piece(grouped + (window - window // group), grouped, distance >= window),
    ]


def self_extend_relative(positions: torch.Tensor, window: int, group: int) -> torch.Tensor:
    """The int64 relative positions Self-Extend scores at, ``[.., seq, seq]`` (``r(j, i) = -r(i, j)``).

    Example:
        >>> self_extend_relative(torch.arange(8), 2, 2)[7].tolist()
        [4, 4, 3, 3, 2, 2, 1, 0]
    """
    window, group = _check_options(window, group)
    return relative_map(self_extend_pieces(check_relative_positions(positions), window, group))


def self_extend_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    rope: RotaryEmbedding,
    window: int,
    group: int,
    positions: torch.Tensor | None = None,
    *,
    causal: bool = False,
) -> torch.Tensor:
    r"""Self-Extend's pre-softmax scores ``q_i R_{r(i,j)} k_j / sqrt(d)``, ``[batch, heads, seq, seq]``.

    Arguments as :func:`~ropelib.rotary.rerope.rerope_scores`; ``window`` is the neighbour window
    ``W`` (pairs closer than it score as RoPE's, bit for bit) and ``group`` the group size ``G``.
    """
    window, group = _check_options(window, group)
    positions = check_remap_call(q, k, rope, positions, causal)
    return remapped_scores(q, k, rope, self_extend_pieces(positions, window, group), positions, causal)


class SelfExtend(RemappedRotary):
    """Self-Extend as a module: a :class:`~ropelib.RotaryEmbedding`, the neighbour window and the group size.

    Args:
        head_dim: per-head width.
        window: the neighbour window ``W``.
        group: the group size ``G``.
        **rope_options: passed to :class:`~ropelib.RotaryEmbedding`.
    """

    def __init__(self, head_dim: int, window: int, group: int, **rope_options: Any) -> None:
        super().__init__(head_dim, **rope_options)
        self.window, self.group = _check_options(window, group)

    def pieces(self, positions: torch.Tensor) -> list[Piece]:
        return self_extend_pieces(positions, self.window, self.group)

    def extra_repr(self) -> str:
        return f"window={self.window}, group={self.group}"
