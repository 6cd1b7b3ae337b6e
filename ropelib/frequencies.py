r"""RoPE's rotation frequencies: ``inv_freq[i] = base^(-2i/d_rot)`` for the pairs ``i = 0 .. d_rot/2 - 1``.

Pair ``i`` of a vector at position ``m`` is rotated by the angle ``m * inv_freq[i]``
(Su et al., RoFormer, 2024, eq. 15). This module is the leaf of the package: the plain
frequencies, the number of rotated features, and the cos/sin tables of given positions.
Everything that changes the frequencies (context-extension scaling, dynamic NTK) lives in
:mod:`ropelib.scaling` and its entry point :func:`~ropelib.rope_frequencies`.
"""

from __future__ import annotations

import math

import torch

from ._validation import check_even, check_float_dtype, check_float_tensor, check_integer_tensor, check_positive_float


def default_inverse_frequencies(rotary_dim: int, theta: float) -> torch.Tensor:
    r"""``theta^(-2i/rotary_dim)`` for ``i = 0 .. rotary_dim/2 - 1``, in float64 (RoFormer eq. 15)."""
    exponent = torch.arange(0, rotary_dim, 2, dtype=torch.float64, device="cpu") / rotary_dim
    return theta ** (-exponent)


def ntk_rescaled_theta(theta: float, rotary_dim: int, theta_rescale_factor: float) -> float:
    r"""Static NTK-aware scaling of the base: ``theta * factor^(d / (d - 2))`` for ``d = rotary_dim``.

    rotary-embedding-torch's ``theta_rescale_factor`` (after bloc97's "NTK-aware" RoPE): the lowest
    frequency ``theta^{-(d-2)/d}`` is divided by ``factor`` while the highest (1) is kept.

    Example:
        >>> ntk_rescaled_theta(10000.0, 4, 2.0)
        40000.0
    """
    theta = check_positive_float(theta, "theta")
    rotary_dim = check_even(rotary_dim, "rotary_dim")
    factor = check_positive_float(theta_rescale_factor, "theta_rescale_factor")
    if factor == 1.0:
        return theta
    if rotary_dim == 2:
        raise ValueError("theta_rescale_factor needs rotary_dim >= 4 (the exponent d / (d - 2) is undefined for d = 2)")
    return theta * factor ** (rotary_dim / (rotary_dim - 2))


def pixel_inverse_frequencies(rotary_dim: int, max_freq: float = 10.0) -> torch.Tensor:
    r"""rotary-embedding-torch's ``freqs_for="pixel"``: ``linspace(1, max_freq / 2, d / 2) * pi``, float64 ``[d/2]``.

    Linearly spaced angular frequencies for continuous coordinates in ``[-1, 1]`` (images, as in
    ViT-style axial RoPE), rather than RoPE's geometric ``theta^{-2i/d}`` for token indices.

    Example:
        >>> (pixel_inverse_frequencies(4, 4.0) / math.pi).tolist()
        [1.0, 2.0]
    """
    rotary_dim = check_even(rotary_dim, "rotary_dim")
    max_freq = check_positive_float(max_freq, "max_freq")
    return torch.linspace(1.0, max_freq / 2, rotary_dim // 2, dtype=torch.float64, device="cpu") * math.pi


def rotary_dim_for(head_dim: int, partial_rotary_factor: float) -> int:
    """The number of rotated features, ``int(head_dim * partial_rotary_factor)`` (as in model configs); must be even."""
    head_dim = check_even(head_dim, "head_dim")
    factor = check_positive_float(partial_rotary_factor, "partial_rotary_factor")
    if factor > 1.0:
        raise ValueError(f"partial_rotary_factor must be in (0, 1], got {factor}")
    return check_even(int(head_dim * factor), "rotary dim (head_dim * partial_rotary_factor)")


def angle_tables(
    inv_freq64: torch.Tensor, positions: torch.Tensor, attention_scaling: float | torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`~ropelib.cos_sin_table` without argument checks: ``inv_freq64`` float64 on ``positions``' device.

    ``positions`` may be floating (continuous coordinates): they are converted to float64 first.
    ``attention_scaling`` may be a float64 0-d tensor (multiplying by 1 changes no bit).
    """
    angles = positions.to(torch.float64)[..., None] * inv_freq64
    cos, sin = angles.cos(), angles.sin()
    if isinstance(attention_scaling, torch.Tensor) or attention_scaling != 1.0:
        cos, sin = cos * attention_scaling, sin * attention_scaling
    return cos.to(dtype), sin.to(dtype)


def cos_sin_table(
    inv_freq: torch.Tensor,
    positions: torch.Tensor,
    attention_scaling: float = 1.0,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""``cos`` and ``sin`` of ``p * inv_freq``, times ``attention_scaling``, for integer ``positions``.

    The product ``p * inv_freq`` is formed in float64 and rounded to ``dtype`` only after the
    cosine: the usual float32 path (a float32 frequency, a float32 product) loses up to about
    ``2 p 2^-24`` radians, one rounding each, which grows with the position (the book's section
    "Long positions and float32", in the context-extension chapter, measures it against a
    float64 reference).
    Only the rows of the given positions are computed, so memory follows ``positions.numel()``,
    not the largest position.

    Args:
        inv_freq: ``[d_rot/2]`` inverse frequencies (float64 recommended), finite.
        positions: integer tensor of any shape (negative positions rotate backwards).
        attention_scaling: the factor on both tables (YaRN's temperature; 1 otherwise), finite and > 0.
        dtype: floating dtype of the returned tables.

    Returns:
        ``(cos, sin)``, each of shape ``positions.shape + (d_rot/2,)``.
    """
    check_float_tensor(inv_freq, "inv_freq", ndim=1)
    if not isinstance(positions, torch.Tensor) or positions.dtype.is_floating_point or positions.dtype.is_complex:
        raise TypeError(
            f"positions must be an integer torch.Tensor, got {getattr(positions, 'dtype', type(positions).__name__)}"
        )
    check_integer_tensor(positions, "positions")
    attention_scaling = check_positive_float(attention_scaling, "attention_scaling")
    dtype = check_float_dtype(dtype)
    return angle_tables(inv_freq.to(device=positions.device, dtype=torch.float64), positions, attention_scaling, dtype)


def relative_decay_bound(inv_freq: torch.Tensor, distances: torch.Tensor) -> torch.Tensor:
    r"""RoFormer's long-term decay bound of RoPE's scores, :math:`\frac{1}{d/2}\sum_{i=1}^{d/2} |U_i(r)|`.

    For a query and key at distance ``r`` the score is :math:`\mathrm{Re}\sum_i h_i e^{\mathrm{i} r \theta_i}`;
    summing by parts (Su et al., 2024, section 3.4.3) bounds it by
    :math:`\max_i |h_{i+1} - h_i| \sum_i |U_i(r)|` with the partial sums
    :math:`U_i(r) = \sum_{l < i} e^{\mathrm{i} r \theta_l}`. This returns the mean :math:`\frac{1}{d/2}\sum_i |U_i(r)|`
    (the quantity RoFormer plots): ``(d/2 + 1) / 2`` at ``r = 0``, shrinking on average, with ripples,
    as ``r`` grows. Computed in float64 (complex128).

    Args:
        inv_freq: ``[d/2]`` inverse frequencies :math:`\theta_i` (any floating dtype; used in float64).
        distances: ``[n]`` relative distances ``r`` (integer or floating).

    Returns:
        float64 ``[n]``.

    Example:
        >>> inv_freq = torch.tensor([1.0, 0.01])
        >>> relative_decay_bound(inv_freq, torch.tensor([0, 100]))[0].item()
        1.5
    """
    check_float_tensor(inv_freq, "inv_freq", ndim=1)
    if not isinstance(distances, torch.Tensor) or distances.ndim != 1 or distances.dtype.is_complex:
        raise TypeError(
            f"distances must be a 1-D real torch.Tensor, got {getattr(distances, 'shape', type(distances))}"
        )
    if distances.dtype == torch.bool:
        raise TypeError("distances must be a 1-D real torch.Tensor, got a bool tensor")
    angles = distances.to(torch.float64)[:, None] * inv_freq.to(device=distances.device, dtype=torch.float64)[None, :]
    return torch.polar(torch.ones_like(angles), angles).cumsum(-1).abs().mean(-1)
