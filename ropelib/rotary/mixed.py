r"""RoPE-Mixed (Heo et al., 2024): 2-D RoPE whose pairs turn with a learned mix of both axes.

A patch at ``p = (row, column)`` turns pair ``i`` of head ``h`` by

.. math:: \phi_{h i}(p) = p_\text{row} f^\text{row}_{h i} + p_\text{col} f^\text{col}_{h i},

with ``f^row``, ``f^col`` learned per head and pair. The angle is linear in ``p``, so the score of
two patches reads their 2-D offset only, as in axial RoPE; axial RoPE
(:class:`~ropelib.AxialRotaryEmbedding`) is the case where each pair has one of its two
frequencies zero (:func:`axial_frequencies`), and a mixed pair can turn along any direction of
the grid (diagonals included).

This module's door, ``forward(q, k, positions)``, takes ``(row, column)`` positions, as axial
RoPE's does. :class:`~ropelib.MultiHeadAttention`, whose positions are 1-D, carries it as
``position="rope_mixed"``: patch ``p`` of a row-major grid ``grid_width`` patches wide is at
``(p // grid_width, p % grid_width)`` (:mod:`ropelib.attention.plugs.mixed`).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .._validation import check_choice, check_int, check_positive_float, check_qk, check_real_positions
from ..frequencies import default_inverse_frequencies
from ..layouts import LAYOUTS
from ..reference import rotate


def mixed_initial_frequencies(head_dim: int, num_heads: int, theta: float = 10.0) -> torch.Tensor:
    r"""The paper's initialisation: ``[2, num_heads, d/2]`` float64 (row, column frequencies).

    Magnitudes ``theta^{-t/(d/4)}``, ``t = 0 .. d/4 - 1``, twice; head ``h`` points its first
    ``d/4`` pairs along a random direction ``a_h`` and the last ``d/4`` along ``a_h + pi/2``
    (``torch``'s global generator draws ``a_h``).
    """
    head_dim, num_heads = _check_sizes(head_dim, num_heads)
    magnitude = default_inverse_frequencies(head_dim // 2, check_positive_float(theta, "theta"))  # [d/4]
    angle = torch.rand(num_heads, 1, dtype=torch.float64) * 2 * math.pi
    directions = torch.cat((angle.expand(-1, head_dim // 4), (angle + math.pi / 2).expand(-1, head_dim // 4)), -1)
    magnitudes = magnitude.repeat(2)
    return torch.stack((magnitudes * torch.cos(directions), magnitudes * torch.sin(directions)))


def axial_frequencies(head_dim: int, num_heads: int, theta: float = 100.0) -> torch.Tensor:
    """Axial RoPE as mixed frequencies ``[2, num_heads, d/2]`` float64: the first ``d/4`` pairs turn with the
    row only, the last ``d/4`` with the column only, at ``theta^{-t/(d/4)}`` (:class:`~ropelib.AxialRotaryEmbedding`)."""
    head_dim, num_heads = _check_sizes(head_dim, num_heads)
    magnitude = default_inverse_frequencies(head_dim // 2, check_positive_float(theta, "theta"))
    zero = torch.zeros_like(magnitude)
    rows, cols = torch.cat((magnitude, zero)), torch.cat((zero, magnitude))
    return torch.stack((rows, cols))[:, None].expand(-1, num_heads, -1).clone()


def _check_sizes(head_dim: object, num_heads: object) -> tuple[int, int]:
    head_dim = check_int(head_dim, "head_dim", minimum=4)
    if head_dim % 4:
        raise ValueError(f"head_dim must be a multiple of 4 (half the pairs per direction), got {head_dim}")
    return head_dim, check_int(num_heads, "num_heads", minimum=1)


class MixedRotaryEmbedding(nn.Module):
    r"""RoPE-Mixed: pair ``i`` of head ``h`` turns by ``row f^row_{h i} + col f^col_{h i}`` (learned).

    Args:
        head_dim: per-head width ``d`` (a multiple of 4).
        num_heads: heads of ``q`` and ``k`` (each has its own frequencies).
        theta: base of the initial magnitudes (10 in the paper).
        layout: ``"half"`` or ``"interleaved"`` (which features form a pair).

    Attributes:
        freqs: the parameter ``[2, num_heads, d/2]``: ``freqs[0]`` row, ``freqs[1]`` column frequencies.

    Shapes:
        ``forward(q, k, positions)``: ``q``, ``k`` ``[batch, seq, num_heads, d]``; ``positions``
        ``[seq, 2]`` or ``[batch, seq, 2]`` of ``(row, column)``, integers or reals
        (:func:`~ropelib.axial_positions`). Returns the turned ``(q, k)``.

    Example:
        >>> mixed = MixedRotaryEmbedding(8, num_heads=2)
        >>> q = k = torch.ones(1, 6, 2, 8)
        >>> mixed(q, k, axial_positions(2, 3))[0].shape
        torch.Size([1, 6, 2, 8])
    """

    def __init__(self, head_dim: int, num_heads: int, theta: float = 10.0, layout: str = "half") -> None:
        super().__init__()
        self.head_dim, self.num_heads = _check_sizes(head_dim, num_heads)
        self.layout = check_choice(layout, "layout", LAYOUTS)
        self.freqs = nn.Parameter(mixed_initial_frequencies(self.head_dim, self.num_heads, theta).float())

    def angles(self, positions: torch.Tensor) -> torch.Tensor:
        """``phi`` ``[..., seq, num_heads, d/2]`` for positions ``[..., seq, 2]`` (in their dtype); unchecked."""
        freqs = self.freqs.to(positions.dtype)
        return positions[..., 0, None, None] * freqs[0] + positions[..., 1, None, None] * freqs[1]

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        check_qk(q, k, head_dim=self.head_dim)
        if q.shape[2] != self.num_heads or k.shape[2] != self.num_heads:
            raise ValueError(
                f"q and k must have num_heads={self.num_heads} heads (one set of frequencies each), "
                f"got {q.shape[2]} and {k.shape[2]}"
            )
        batch, seq = q.shape[:2]
        if not isinstance(positions, torch.Tensor) or list(positions.shape) not in ([seq, 2], [batch, seq, 2]):
            shape = list(positions.shape) if isinstance(positions, torch.Tensor) else type(positions).__name__
            raise ValueError(
                f"positions must have shape [{seq}, 2] or [{batch}, {seq}, 2] of (row, column), got {shape}"
            )
        if positions.dtype == torch.bool or positions.is_complex():
            raise TypeError(f"positions must be integers or reals, got {positions.dtype}")
        compute = torch.float64 if q.dtype == torch.float64 else torch.float32
        positions = check_real_positions(positions.to(device=q.device, dtype=compute), "positions")
        phi = self.angles(positions).flatten(-3, -2)  # [(batch,) seq * heads, d/2]: a row per (token, head)
        cos, sin = torch.cos(phi), torch.sin(phi)
        rows = (batch, seq * self.num_heads, 1, self.head_dim)
        q2 = rotate(q.reshape(rows), cos, sin, self.layout).view_as(q)
        k2 = rotate(k.reshape(rows), cos, sin, self.layout).view_as(k)
        return q2, k2

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, num_heads={self.num_heads}, layout={self.layout!r}"
