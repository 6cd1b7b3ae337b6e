r"""Two relatives of RoPE: xPos (rotation with exponential decay) and 2-D axial RoPE for image patches.

Both keep RoPE's defining property, that the score of a query and a key depends on their positions
only through the difference: for xPos ``m - n`` along a sequence, for axial RoPE the 2-D offset
``(row_m - row_n, col_m - col_n)`` between patches.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .._validation import (
    check_choice,
    check_even,
    check_int,
    check_position_range,
    check_positions,
    check_positive_float,
    check_qk,
)
from ..frequencies import cos_sin_table, default_inverse_frequencies
from ..layouts import LAYOUTS, pair_features
from ..reference import rotate
from ..rotary import RotaryEmbedding

# ----------------------------------------------------------------------------- xPos


def xpos_decay_rates(head_dim: int, gamma: float = 0.4) -> torch.Tensor:
    r"""xPos's per-pair rates ``zeta_i = (2i/d + gamma) / (1 + gamma)`` in float64, ``[d/2]`` (Sun et al., 2023).

    All lie in ``(0, 1)``: the highest frequency (``i = 0``) decays fastest, the lowest barely.

    Example:
        >>> xpos_decay_rates(4, gamma=0.4).tolist()
        [0.28571428571428575, 0.6428571428571429]
    """
    head_dim = check_even(head_dim, "head_dim")
    gamma = check_positive_float(gamma, "gamma")
    return (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim + gamma) / (1 + gamma)


class XPos(nn.Module):
    r"""xPos (Sun et al., 2023, "A Length-Extrapolatable Transformer"): RoPE times an exponential decay.

    The query at position ``m`` is rotated as in RoPE and scaled up by ``zeta_i^{(m - c)/B}``; the key at
    ``n`` is rotated and scaled *down* by ``zeta_i^{(n - c)/B}``. Pair ``i`` of the score
    ``q_m . k_n`` is therefore multiplied by

    .. math:: \zeta_i^{(m - n) / B},

    which depends on ``m - n`` only (the centre ``c`` cancels) and decays with the distance for the
    keys of a causal model (``n <= m``, ``zeta_i < 1``). ``c`` only keeps the factors in floating-point
    range: by default it is the middle of the positions of the call, so q and k must be encoded in the
    same call or with the same explicit ``center``.

    Args:
        head_dim: per-head width ``d`` (even); all features are rotated.
        theta: RoPE's base.
        gamma: the rate offset of :func:`xpos_decay_rates` (0.4 in the paper).
        scale_base: ``B``, the distance over which pair ``i`` decays by ``zeta_i`` (512 in the paper).
        layout: ``"half"`` or ``"interleaved"``.

    Shapes:
        ``forward(q, k, positions=None, center=None)`` as :class:`~ropelib.rotary.RotaryEmbedding`.

    Example:
        >>> xpos = XPos(8)
        >>> q = k = torch.ones(1, 4, 1, 8)
        >>> q2, k2 = xpos(q, k)
        >>> q2.shape, k2.shape
        (torch.Size([1, 4, 1, 8]), torch.Size([1, 4, 1, 8]))
    """

    def __init__(
        self,
        head_dim: int,
        theta: float = 10000.0,
        *,
        gamma: float = 0.4,
        scale_base: float = 512.0,
        layout: str = "half",
    ) -> None:
        super().__init__()
        self.rope = RotaryEmbedding(head_dim, theta, layout)
        self.gamma = check_positive_float(gamma, "gamma")
        self.scale_base = check_positive_float(scale_base, "scale_base")
        self.layout = layout
        self._rates64 = xpos_decay_rates(head_dim, self.gamma)
        self._fastest_log_rate = math.log(float(self._rates64[0]))  # ln zeta_0 < 0, read once here

    def scales(self, positions: torch.Tensor, center: int | torch.Tensor = 0) -> torch.Tensor:
        """``zeta_i^{(p - center)/B}`` in float64, shape ``positions.shape + (head_dim/2,)``."""
        exponent = (positions.to(torch.float64) - center)[..., None] / self.scale_base
        return self._rates64.to(positions.device) ** exponent

    def max_offset(self, dtype: torch.dtype) -> int:
        """The largest ``|p - center|`` whose scale, and its inverse, stay below the square root of ``dtype``'s range.

        The fastest pair decays by ``zeta_0`` per ``B`` positions, so the scale at offset ``t`` is
        ``zeta_0^{-t/B}``; keeping it below ``sqrt(max)`` leaves room for the query's own magnitude.
        """
        log_max = math.log(torch.finfo(dtype).max)
        return int(0.5 * log_max / -self._fastest_log_rate * self.scale_base)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor | None = None, center: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        positions = self.rope.check_qk(q, k, positions)
        if positions is None:
            positions = torch.arange(q.shape[1], device=q.device)
        middle: int | torch.Tensor
        if center is not None:
            middle = check_int(center, "center")
        elif positions.numel():
            middle = (positions.min() + positions.max()) // 2  # a tensor: no host round trip
        else:
            middle = 0
        compute = torch.float64 if q.dtype == torch.float64 else torch.float32
        reach = self.max_offset(compute)
        check_position_range(
            positions - middle, f"positions - center (|offset| <= {reach} keeps xPos finite in {compute})",
            minimum=-reach, limit=reach + 1,
        )  # fmt: skip
        q_rot, k_rot = self.rope.rotate(q, k, positions)
        scale = pair_features(self.scales(positions, middle), self.layout).unsqueeze(-2)  # [.., seq, 1, d]
        q_out = q_rot.to(compute) * scale.to(compute)
        k_out = k_rot.to(compute) / scale.to(compute)
        return q_out.to(q.dtype), k_out.to(k.dtype)

    def extra_repr(self) -> str:
        return (
            f"head_dim={self.rope.head_dim}, theta={self.rope.theta}, gamma={self.gamma}, scale_base={self.scale_base}"
        )


# ----------------------------------------------------------------------------- 2-D axial RoPE


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
        return rotate(q, cos, sin, self.layout), rotate(k, cos, sin, self.layout)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, theta={self.theta}, layout={self.layout!r}"
