r"""2-D axial RoPE for image patches (RoPE-Axial of Heo et al., 2024).

What differs from RoPE: a patch has two positions, its row and its column; half of the pairs turn
with the row and half with the column, so the score of two patches depends on their 2-D offset
``(row_m - row_n, col_m - col_n)`` only.
"""

from __future__ import annotations

import torch
from torch import nn

from .._validation import check_choice, check_even, check_int, check_positions, check_positive_float, check_qk
from ..frequencies import cos_sin_table, default_inverse_frequencies
from ..kernels.door import rotate_token_tables
from ..layouts import LAYOUTS


def axial_positions(height: int, width: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The ``(row, column)`` of each patch of a ``height x width`` grid in row-major order, int64 ``[h*w, 2]``.

    Example:
        >>> axial_positions(2, 3).tolist()
        [[0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [1, 2]]
    """
    height = check_int(height, "height", minimum=1)
    width = check_int(width, "width", minimum=1)
    rows = torch.arange(height, device=device).repeat_interleave(width)
    cols = torch.arange(width, device=device).repeat(height)
    return torch.stack((rows, cols), dim=-1)


class AxialRotaryEmbedding(nn.Module):
    r"""2-D axial RoPE for image patches (RoPE-Axial of Heo et al., 2024).

    Of the ``d/2`` pairs, the first ``d/4`` rotate with the patch's row and the last ``d/4`` with its
    column, each set with the frequencies ``theta^{-t/(d/4)}``, ``t = 0 .. d/4 - 1`` (``theta = 100``
    in the paper). The score of patches ``m`` and ``n`` is then a function of
    ``(row_m - row_n, col_m - col_n)`` only. (The paper alternates row and column pairs; taking
    them in two blocks is a fixed permutation of features, which leaves scores unchanged.)

    Args:
        head_dim: per-head width ``d`` (a multiple of 4).
        theta: the frequency base.
        layout: ``"half"`` or ``"interleaved"`` (which features form a pair, as in RoPE).

    Shapes:
        ``forward(q, k, positions)``: ``q``, ``k`` ``[batch, seq, heads, d]``; ``positions`` integers
        ``[seq, 2]`` or ``[batch, seq, 2]`` holding ``(row, column)`` (see :func:`axial_positions`).

    Example:
        >>> rope2d = AxialRotaryEmbedding(8)
        >>> q = k = torch.ones(1, 6, 2, 8)
        >>> q2, k2 = rope2d(q, k, axial_positions(2, 3))
        >>> q2.shape
        torch.Size([1, 6, 2, 8])
    """

    def __init__(self, head_dim: int, theta: float = 100.0, layout: str = "half") -> None:
        super().__init__()
        self.head_dim = check_even(head_dim, "head_dim")
        if self.head_dim % 4:
            raise ValueError(f"head_dim must be a multiple of 4 (half the pairs per axis), got {self.head_dim}")
        self.theta = check_positive_float(theta, "theta")
        self.layout = check_choice(layout, "layout", LAYOUTS)
        self._inv_freq64 = default_inverse_frequencies(self.head_dim // 2, self.theta)  # [d/4]

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` of shape ``positions.shape[:-1] + (d/2,)``: row pairs first, then column pairs."""
        cos_r, sin_r = cos_sin_table(self._inv_freq64, positions[..., 0], dtype=dtype)
        cos_c, sin_c = cos_sin_table(self._inv_freq64, positions[..., 1], dtype=dtype)
        return torch.cat((cos_r, cos_c), dim=-1), torch.cat((sin_r, sin_c), dim=-1)

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        check_qk(q, k, head_dim=self.head_dim)
        if not isinstance(positions, torch.Tensor) or positions.ndim not in (2, 3) or positions.shape[-1] != 2:
            shape = tuple(positions.shape) if isinstance(positions, torch.Tensor) else type(positions).__name__
            raise ValueError(
                f"positions must be an integer tensor [seq, 2] or [batch, seq, 2] of (row, column), got {shape}"
            )
        for axis in (0, 1):
            check_positions(positions[..., axis], "positions", batch=q.shape[0], seq_len=q.shape[1])
        positions = positions.long().to(q.device)
        cos, sin = self.cos_sin(positions, torch.float64 if q.dtype == torch.float64 else torch.float32)
        return rotate_token_tables(q, k, cos, sin, interleaved=self.layout == "interleaved", kernel="auto")

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, theta={self.theta}, layout={self.layout!r}"
