"""Absolute position encodings: the sinusoidal table and learned embeddings.

Both give every position ``p`` its own vector ``P[p]`` that is added to the token embedding
before the first attention layer (Vaswani et al., 2017, section 3.5).
"""

from __future__ import annotations

import torch
from torch import nn

from .._validation import check_even, check_float_tensor, check_int, check_positions, check_positive_float


def _sinusoid_angles(
    positions: torch.Tensor,
    dim: int,
    base: float,
) -> torch.Tensor:
    """Angles ``p / base^(2i/dim)`` in float64, ``[..., dim // 2]``."""
    f64 = torch.float64
    pairs = torch.arange(0, dim, 2, dtype=f64, device=positions.device)
    inv_freq = base ** (-pairs / dim)
    return positions.to(f64)[..., None] * inv_freq


def _interleave_sin_cos(angles: torch.Tensor) -> torch.Tensor:
    """``[..., dim/2]`` angles -> ``[..., dim]``: sin even, cos odd."""
    return torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(-2)


def sinusoidal_encoding(
    num_positions: int,
    dim: int,
    base: float = 10000.0,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    r"""The sinusoidal position table of Vaswani et al. (2017).

    .. math::

        P_{p,\,2i} = \sin\!\left(\frac{p}{\text{base}^{2i/d}}\right), \qquad
        P_{p,\,2i+1} = \cos\!\left(\frac{p}{\text{base}^{2i/d}}\right)

    Args:
        num_positions: number of rows ``n`` (positions ``0 .. n-1``).
        dim: encoding width ``d`` (even).
        base: the wavelength base (10000 in the paper); wavelengths run from
            ``2*pi`` to ``2*pi*base^(1-2/d)``, almost ``2*pi*base``.
        dtype: floating dtype of the result; angles are always computed
            in float64.
        device: where to build the table.

    Returns:
        Tensor of shape ``[num_positions, dim]``.

    Example:
        >>> P = sinusoidal_encoding(4, 6)
        >>> P.shape
        torch.Size([4, 6])
        >>> P[0].tolist()  # position 0: sin(0) = 0 and cos(0) = 1
        [0.0, 1.0, 0.0, 1.0, 0.0, 1.0]
    """
    num_positions = check_int(num_positions, "num_positions", minimum=0)
    dim = check_even(dim, "dim")
    base = check_positive_float(base, "base")
    floating = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
    if dtype not in floating:
        raise TypeError(f"dtype must be a floating dtype, got {dtype}")
    positions = torch.arange(num_positions, device=device)
    angles = _sinusoid_angles(positions, dim, base)
    return _interleave_sin_cos(angles).to(dtype)


def sinusoidal_shift_matrix(shift: int, dim: int, base: float = 10000.0) -> torch.Tensor:
    r"""The fixed linear map ``M_r`` with ``P[p + r] = M_r P[p]`` for every position ``p``.

    ``M_r`` (``r`` the ``shift``) is block diagonal; the block acting on features ``(2i, 2i+1)`` is the rotation

    .. math::

        \begin{pmatrix} \cos r\theta_i & \sin r\theta_i \\ -\sin r\theta_i & \cos r\theta_i \end{pmatrix},
        \qquad \theta_i = \mathrm{base}^{-2i/d},

    which follows from ``sin(a+b)`` and ``cos(a+b)``. It depends on the shift ``r`` only.

    Returns:
        float64 tensor of shape ``[dim, dim]``.
    """
    shift = check_int(shift, "shift")
    dim = check_even(dim, "dim")
    base = check_positive_float(base, "base")
    angles = _sinusoid_angles(torch.tensor(shift), dim, base)
    c, s = angles.cos(), angles.sin()
    blocks = torch.stack((torch.stack((c, s), -1), torch.stack((-s, c), -1)), -2)  # [dim/2, 2, 2]
    return torch.block_diag(*blocks)


class SinusoidalPositionalEncoding(nn.Module):
    """Adds the sinusoidal encoding to token embeddings: ``x + scale * P[positions]``.

    The table is computed on the fly from the positions (in float64, then cast to ``x``'s
    dtype), so there is no maximum length. It has no parameters.

    Args:
        dim: embedding width (even).
        base: wavelength base, 10000 by default.
        scale: multiplier of the encoding (1.0; some models use ``sqrt(dim)`` on the tokens instead).

    Shapes:
        ``x``: ``[batch, seq, dim]``; ``positions``: ``[seq]`` or ``[batch, seq]`` integers
        (default ``0 .. seq-1``). Returns ``[batch, seq, dim]``.
    """

    def __init__(self, dim: int, base: float = 10000.0, scale: float = 1.0) -> None:
        super().__init__()
        self.dim = check_even(dim, "dim")
        self.base = check_positive_float(base, "base")
        self.scale = check_positive_float(scale, "scale")

    def encoding(self, positions: torch.Tensor) -> torch.Tensor:
        """``P[positions]`` in float64, shape ``positions.shape + (dim,)``."""
        return _interleave_sin_cos(_sinusoid_angles(positions, self.dim, self.base))

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        x = check_float_tensor(x, "x", ndim=3)
        if x.shape[-1] != self.dim:
            raise ValueError(f"x must have last dimension {self.dim}, got shape {tuple(x.shape)}")
        if positions is not None:
            positions = check_positions(positions, "positions", batch=x.shape[0], seq_len=x.shape[1]).to(x.device)
        return self.add(x, positions)

    def add(self, x: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        """The module's call without argument checks (int64 ``positions`` on ``x``'s device, or None)."""
        if positions is None:
            positions = torch.arange(x.shape[1], device=x.device)
        return x + (self.scale * self.encoding(positions)).to(x.dtype)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, base={self.base}, scale={self.scale}"


class LearnedPositionalEmbedding(nn.Module):
    """A trainable table ``E`` of ``num_positions`` vectors added to token embeddings (BERT, GPT-2).

    Unlike the sinusoidal table it has a hard limit: position ``num_positions`` has no row, and
    asking for it raises :class:`ValueError` instead of wrapping around or clamping.

    Shapes:
        ``x``: ``[batch, seq, dim]``; ``positions``: ``[seq]`` or ``[batch, seq]`` integers in
        ``[0, num_positions)`` (default ``0 .. seq-1``). Returns ``[batch, seq, dim]``.
    """

    def __init__(self, num_positions: int, dim: int, init_std: float = 0.02) -> None:
        super().__init__()
        self.num_positions = check_int(num_positions, "num_positions", minimum=1)
        self.dim = check_int(dim, "dim", minimum=1)
        self.weight = nn.Parameter(torch.empty(self.num_positions, self.dim))
        nn.init.normal_(self.weight, std=check_positive_float(init_std, "init_std"))

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        x = check_float_tensor(x, "x", ndim=3)
        if x.shape[-1] != self.dim:
            raise ValueError(f"x must have last dimension {self.dim}, got shape {tuple(x.shape)}")
        if positions is None:
            if x.shape[1] > self.num_positions:
                raise ValueError(f"x has {x.shape[1]} positions but the learned table has only {self.num_positions}")
        else:
            positions = check_positions(
                positions, "positions", batch=x.shape[0], seq_len=x.shape[1], limit=self.num_positions
            )
        return self.add(x, positions)

    def add(self, x: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        """The module's call without argument checks (int64 ``positions`` in range, or None for ``0 .. seq-1``)."""
        if positions is None:
            return x + self.weight[: x.shape[1]].to(x.dtype)
        return x + self.weight[positions.to(self.weight.device)].to(x.dtype)

    def extra_repr(self) -> str:
        return f"num_positions={self.num_positions}, dim={self.dim}"
