r"""xPos (Sun et al., 2023, "A Length-Extrapolatable Transformer"): RoPE times an exponential decay.

What differs from RoPE: after the rotation, pair ``i`` of the query at ``m`` is scaled by
``zeta_i^{(m - c)/B}`` and that of the key at ``n`` by ``zeta_i^{-(n - c)/B}``, so the score's pair
``i`` gains ``zeta_i^{(m - n)/B}``: a decay with the distance that keeps RoPE's relative property.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .._validation import check_even, check_int, check_position_range, check_positive_float, check_qk
from ..layouts import pair_features
from .standard import RotaryEmbedding


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

    The query at position ``m`` is rotated as in RoPE and multiplied by ``zeta_i^{(m - c)/B}``; the key at
    ``n`` is rotated and *divided* by ``zeta_i^{(n - c)/B}``. Pair ``i`` of the score
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
        ``forward(q, k, positions=None, center=None)`` as :class:`~ropelib.RotaryEmbedding`.

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

    def max_offset(self, dtype: torch.dtype, *dtypes: torch.dtype) -> int:
        """The largest ``|p - center|`` whose scale, and its inverse, stay below the square root of the range.

        The range is that of the narrowest of ``dtype`` and ``dtypes`` (the smallest ``finfo.max``):
        A call of the module passes its compute dtype and the dtypes of ``q`` and ``k``, since the scaled
        values are formed in the first and stored in the others (float16 holds far less than float32).
        The fastest pair decays by ``zeta_0`` per ``B`` positions, so the scale at offset ``t`` is
        ``zeta_0^{-t/B}``; keeping it below ``sqrt(max)`` leaves room for the query's own magnitude.

        Example:
            >>> xpos = XPos(32)
            >>> xpos.max_offset(torch.float32)
            18130
            >>> xpos.max_offset(torch.float32, torch.float16)
            2266
        """
        log_max = min(math.log(torch.finfo(t).max) for t in (dtype, *dtypes))
        return int(0.5 * log_max / -self._fastest_log_rate * self.scale_base)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor | None = None, center: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        check_qk(q, k, head_dim=self.rope.head_dim)
        rotation = self.rope.rotation(q, positions)
        positions = rotation.positions
        middle: int | torch.Tensor
        if center is not None:
            middle = check_int(center, "center")
        elif positions.numel():
            middle = (positions.min() + positions.max()) // 2  # a tensor: no host round trip
        else:
            middle = 0
        compute = torch.float64 if q.dtype == torch.float64 else torch.float32
        # formed in `compute`, stored as q's and k's dtypes: the narrowest range bounds the reach
        narrowest = min((compute, q.dtype, k.dtype), key=lambda t: torch.finfo(t).max)
        reach = self.max_offset(narrowest)
        check_position_range(
            positions - middle, f"positions - center (|offset| <= {reach} keeps xPos finite in {narrowest})",
            minimum=-reach, limit=reach + 1,
        )  # fmt: skip
        q_rot, k_rot = rotation(q, k)
        scale = pair_features(self.scales(positions, middle), self.layout).unsqueeze(-2)  # [.., seq, 1, d]
        q_out = q_rot.to(compute) * scale.to(compute)
        k_out = k_rot.to(compute) / scale.to(compute)
        return q_out.to(q.dtype), k_out.to(k.dtype)

    def extra_repr(self) -> str:
        return (
            f"head_dim={self.rope.head_dim}, theta={self.rope.theta}, gamma={self.gamma}, scale_base={self.scale_base}"
        )
