r"""ReRoPE and Leaky ReRoPE (Su, 2023, "ReRoPE: rectified rotary position embeddings"): relative positions capped.

ReRoPE scores query ``i`` and key ``j`` at the relative position ``min(p_i - p_j, w)``: RoPE inside
the window ``w``, and every key farther away seen at distance ``w``. Leaky ReRoPE lets the
positions beyond the window advance at the slope ``1/k`` instead:

.. math:: r(i, j) = \begin{cases} p_i - p_j & p_i - p_j < w \\
    w + (p_i - p_j - w) / k & \text{otherwise} \end{cases} \qquad (\text{ReRoPE: } k = \infty).

Two pieces (:mod:`~ropelib.rotary.remap`): RoPE's own (``q`` at ``p_i``, ``k`` at ``p_j``), and
beyond the window ``q`` rotated to ``w`` with ``k`` unrotated (ReRoPE), or ``q`` to
``w + (p_i - w)/k`` with ``k`` at ``p_j / k`` (Leaky ReRoPE, real-valued positions). Two score
matrices, so no single fused attention kernel computes it.
"""

from __future__ import annotations

from typing import Any

import torch

from .._validation import check_int, check_positive_float
from .remap import Piece, RemappedRotary, check_relative_positions, check_remap_call, relative_map, remapped_scores
from .standard import RotaryEmbedding


def _check_options(window: object, factor: object) -> tuple[int, float | None]:
    window = check_int(window, "window", minimum=1)
    if factor is None:
        return window, None
    factor = check_positive_float(factor, "factor")
    if factor < 1.0:
        raise ValueError(f"factor (Su's k: the slope beyond the window is 1/k) must be >= 1, got {factor}")
    return window, factor


def rerope_pieces(positions: torch.Tensor, window: int, factor: float | None) -> list[Piece]:
    """RoPE's piece for ``|p_i - p_j| < w``, then the capped (or leaky) piece for ``p_i - p_j >= w``."""
    distance = positions.unsqueeze(-1) - positions.unsqueeze(-2)
    inside = Piece(positions, positions, distance.abs() < window)
    beyond = distance >= window
    if factor is None:
        return [inside, Piece(torch.full_like(positions, window), None, beyond)]
    real = positions.to(torch.float64)
    return [inside, Piece(window + (real - window) / factor, real / factor, beyond)]


def rerope_relative(positions: torch.Tensor, window: int, *, factor: float | None = None) -> torch.Tensor:
    """The relative positions ReRoPE (or Leaky ReRoPE, with ``factor`` = Su's ``k``) scores at.

    ``positions`` int ``[seq]`` or ``[batch, seq]``; returns ``[.., seq, seq]``: int64 ``r(i, j)`` of the
    module docstring for ReRoPE, float64 for Leaky ReRoPE; ``r(j, i) = -r(i, j)``.

    Example:
        >>> rerope_relative(torch.arange(5), 2)[4].tolist()
        [2, 2, 2, 1, 0]
    """
    window, factor = _check_options(window, factor)
    return relative_map(rerope_pieces(check_relative_positions(positions), window, factor))


def rerope_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    rope: RotaryEmbedding,
    window: int,
    positions: torch.Tensor | None = None,
    *,
    factor: float | None = None,
    causal: bool = False,
) -> torch.Tensor:
    r"""ReRoPE's (Leaky ReRoPE's, with ``factor``) pre-softmax scores ``q_i R_{r(i,j)} k_j / sqrt(d)``.

    Args:
        q, k: ``[batch, seq, heads, d]`` (the same heads), not rotated.
        rope: the RoPE whose rotations are used (fixed frequencies).
        window: ``w``: pairs closer than it are scored as RoPE scores them, bit for bit.
        positions: integers ``[seq]`` or ``[batch, seq]``, >= 0 (default ``0 .. seq-1``).
        factor: Su's ``k >= 1`` (Leaky ReRoPE); None for ReRoPE.
        causal: skip the keys after the query (their scores are ``-inf``): two matrices, not three.

    Returns:
        ``[batch, heads, seq, seq]`` in ``q``'s dtype.
    """
    window, factor = _check_options(window, factor)
    positions = check_remap_call(q, k, rope, positions, causal)
    return remapped_scores(q, k, rope, rerope_pieces(positions, window, factor), positions, causal)


class ReRoPE(RemappedRotary):
    """ReRoPE (Leaky ReRoPE with ``factor``) as a module: a :class:`~ropelib.RotaryEmbedding` and its window.

    Args:
        head_dim: per-head width.
        window: ``w`` of the module docstring.
        factor: Su's ``k`` (Leaky ReRoPE), or None (ReRoPE).
        **rope_options: passed to :class:`~ropelib.RotaryEmbedding` (``theta``, ``layout``, ...).

    Example:
        >>> rerope = ReRoPE(8, window=4)
        >>> q = k = torch.randn(1, 6, 2, 8)
        >>> rerope(q, k).shape
        torch.Size([1, 2, 6, 6])
    """

    def __init__(self, head_dim: int, window: int, *, factor: float | None = None, **rope_options: Any) -> None:
        super().__init__(head_dim, **rope_options)
        self.window, self.factor = _check_options(window, factor)

    def pieces(self, positions: torch.Tensor) -> list[Piece]:
        return rerope_pieces(positions, self.window, self.factor)

    def extra_repr(self) -> str:
        return f"window={self.window}, factor={self.factor}"
