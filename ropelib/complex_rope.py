r"""RoPE as complex multiplication: the seed post's API (Meta's LLaMA code style).

Adjacent features ``(x[2i], x[2i+1])`` are read as one complex number ``z_i = x[2i] + i x[2i+1]``;
rotating it by ``m theta_i`` is the product ``z_i e^{i m theta_i}``. This is the ``"interleaved"``
layout of :class:`ropelib.RotaryEmbedding`, and gives the same numbers.
"""

from __future__ import annotations

import torch

from ._validation import check_even, check_int, check_positive_float, check_qk, check_same_device
from .frequencies import cos_sin_table, default_inverse_frequencies


def precompute_pos_cis(
    dim: int,
    end: int = 32 * 1024,
    theta: float = 1e6,
) -> torch.Tensor:
    r"""The unit complex numbers ``e^{i m theta_i}`` for positions
    ``m < end``, ``theta_i = base^{-2i/dim}``.

    Args:
        dim: head dimension (even); there are ``dim // 2`` frequencies.
        end: number of positions (32768 by default, as in the seed).
        theta: the base (``1e6`` by default, as in the seed).

    Returns:
        complex64 tensor of shape ``[end, dim // 2]``. The angles are formed
        in float64 and rounded once, so ``|pos_cis| = 1`` to float32
        rounding and the phase is exact to float32 precision at every
        position.

    Example:
        >>> precompute_pos_cis(4, end=2)[0]
        tensor([1.+0.j, 1.+0.j])
    """
    dim = check_even(dim, "dim")
    end = check_int(end, "end", minimum=1)
    theta = check_positive_float(theta, "theta")
    inv_freq = default_inverse_frequencies(dim, theta)
    cos, sin = cos_sin_table(inv_freq, torch.arange(end))
    return torch.complex(cos, sin)


def _check_pos_cis(pos_cis: object, x: torch.Tensor) -> torch.Tensor:
    if not isinstance(pos_cis, torch.Tensor) or not pos_cis.is_complex():
        raise TypeError(
            f"pos_cis must be a complex tensor from precompute_pos_cis, got {getattr(pos_cis, 'dtype', type(pos_cis).__name__)}"
        )
    expected = (x.shape[1], x.shape[-1] // 2)
    if tuple(pos_cis.shape) != expected:
        raise ValueError(
            f"pos_cis must have shape [seq_len, head_dim // 2] = {list(expected)} for xq of shape "
            f"{list(x.shape)}, got {list(pos_cis.shape)}; slice it as pos_cis[start : start + seq_len]"
        )
    return pos_cis


def apply_rotary_emb(
    xq: torch.Tensor,
    xk: torch.Tensor,
    pos_cis: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Rotate ``xq`` and ``xk`` by complex multiplication with ``pos_cis``
    (the seed's function).

    Args:
        xq: ``[batch, seq, q_heads, head_dim]``.
        xk: ``[batch, seq, kv_heads, head_dim]``.
        pos_cis: ``[seq, head_dim // 2]`` complex, the rows for these
            positions (``precompute_pos_cis(...)[start : start + seq]``).

    Returns:
        ``(xq_out, xk_out)`` in the input dtypes; the product runs in
        complex64 (complex128 for float64 input).
    """
    check_qk(xq, xk, names=("xq", "xk"))
    if xq.shape[-1] % 2:
        msg = "xq's head_dim must be even (features are paired)"
        raise ValueError(f"{msg}, got {xq.shape[-1]}")
    pos_cis = _check_pos_cis(pos_cis, xq)
    check_same_device("pos_cis", pos_cis, "xq", xq)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        real = torch.float64 if x.dtype == torch.float64 else torch.float32
        paired = x.to(real).reshape(*x.shape[:-1], x.shape[-1] // 2, 2)
        pairs = torch.view_as_complex(paired.contiguous())
        # [seq, d/2] -> [1, seq, 1, d/2]: broadcast over batch and heads
        factor = pos_cis.to(dtype=pairs.dtype)[None, :, None, :]
        return torch.view_as_real(pairs * factor).flatten(3).to(x.dtype)

    return rotate(xq), rotate(xk)
