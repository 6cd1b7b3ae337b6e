r"""Dual chunk attention (An et al., 2024, "Training-Free Long-Context Scaling of Large Language Models").

The positions are cut into chunks of ``s``; keys sit at ``P_k = p mod s``. With ``c = s + w`` the
training window (``w`` the local window; the paper's Fig. 2 has ``s = 6``, ``w = 4``, ``c = 10``),
the query's position depends on how far back the key's chunk is:

* intra-chunk (same chunk): ``P_q = p mod s``, so ``r = p_i - p_j`` exactly;
* successive-chunk (the chunk before): ``P_q = [s, s + 1, .., s + w - 1, c - 1, .., c - 1]``
  by ``p mod s``: the first ``w`` queries of a chunk keep their exact distance to the previous one;
* inter-chunk (farther back): ``P_q = c - 1``.

The relative position is ``P_q(p_i) - P_k(p_j) <= c - 1`` at any length. Three pieces
(:mod:`~ropelib.rotary.remap`), three score matrices.
"""

from __future__ import annotations

from typing import Any

import torch

from .._validation import check_int
from .remap import Piece, RemappedRotary, check_relative_positions, check_remap_call, relative_map, remapped_scores
from .standard import RotaryEmbedding


def _check_options(chunk_size: object, local_window: object) -> tuple[int, int]:
    return check_int(chunk_size, "chunk_size", minimum=1), check_int(local_window, "local_window", minimum=0)


def dual_chunk_pieces(positions: torch.Tensor, chunk_size: int, local_window: int) -> list[Piece]:
    """The intra-chunk piece, then the successive-chunk and inter-chunk pieces (keys of earlier chunks)."""
    s, c = chunk_size, chunk_size + local_window
    chunk, offset = positions // s, positions % s
    behind = chunk.unsqueeze(-1) - chunk.unsqueeze(-2)  # chunks between query and key
    successive = torch.where(offset < local_window, s + offset, c - 1)
    return [
        Piece(offset, offset, behind == 0),
        Piece(successive, offset, behind == 1),
        Piece(torch.full_like(positions, c - 1), offset, behind > 1),
    ]


def dual_chunk_relative(positions: torch.Tensor, chunk_size: int, local_window: int) -> torch.Tensor:
    """The int64 relative positions dual chunk attention scores at, ``[.., seq, seq]`` (``r(j, i) = -r(i, j)``).

    Example:
        >>> dual_chunk_relative(torch.arange(9), 3, 1)[8].tolist()
        [3, 2, 1, 3, 2, 1, 2, 1, 0]
    """
    chunk_size, local_window = _check_options(chunk_size, local_window)
    return relative_map(dual_chunk_pieces(check_relative_positions(positions), chunk_size, local_window))


def dual_chunk_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    rope: RotaryEmbedding,
    chunk_size: int,
    local_window: int,
    positions: torch.Tensor | None = None,
    *,
    causal: bool = False,
) -> torch.Tensor:
    r"""Dual chunk attention's pre-softmax scores ``q_i R_{r(i,j)} k_j / sqrt(d)``, ``[batch, heads, seq, seq]``.

    Arguments as :func:`~ropelib.rotary.rerope.rerope_scores`, with the chunk size ``s`` and the
    local window ``w`` (``s + w`` the training window).
    """
    chunk_size, local_window = _check_options(chunk_size, local_window)
    positions = check_remap_call(q, k, rope, positions, causal)
    return remapped_scores(q, k, rope, dual_chunk_pieces(positions, chunk_size, local_window), positions, causal)


class DualChunkAttention(RemappedRotary):
    """Dual chunk attention's scores as a module: a :class:`~ropelib.RotaryEmbedding`, the chunk size, the local window.

    Args:
        head_dim: per-head width.
        chunk_size: ``s``.
        local_window: ``w`` (``s + w`` is the training window ``c``).
        **rope_options: passed to :class:`~ropelib.RotaryEmbedding`.
    """

    def __init__(self, head_dim: int, chunk_size: int, local_window: int, **rope_options: Any) -> None:
        super().__init__(head_dim, **rope_options)
        self.chunk_size, self.local_window = _check_options(chunk_size, local_window)

    def pieces(self, positions: torch.Tensor) -> list[Piece]:
        return dual_chunk_pieces(positions, self.chunk_size, self.local_window)

    def extra_repr(self) -> str:
        return f"chunk_size={self.chunk_size}, local_window={self.local_window}"
