r"""RoPE's rotation frequencies: ``inv_freq[i] = theta^(-2i/d)`` for the pairs ``i = 0 .. d/2 - 1``.

Pair ``i`` of a vector at position ``m`` is rotated by the angle ``m * inv_freq[i]``
(Su et al., RoFormer, 2021, eq. 15). Everything that changes the angles (context-extension
scaling, dynamic NTK) goes through :func:`~ropelib.rope_frequencies`, so the module, the kernels and the
book agree on one definition.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ._validation import check_even, check_float_tensor, check_int, check_positive_float


def default_inverse_frequencies(rotary_dim: int, theta: float) -> torch.Tensor:
    r"""``theta^(-2i/rotary_dim)`` for ``i = 0 .. rotary_dim/2 - 1``, in float64 (RoFormer eq. 15)."""
    exponent = torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim
    return theta ** (-exponent)


def rotary_dim_for(head_dim: int, partial_rotary_factor: float) -> int:
    """The number of rotated features, ``int(head_dim * partial_rotary_factor)`` (as in model configs); must be even."""
    head_dim = check_even(head_dim, "head_dim")
    factor = check_positive_float(partial_rotary_factor, "partial_rotary_factor")
    if factor > 1.0:
        raise ValueError(f"partial_rotary_factor must be in (0, 1], got {factor}")
    return check_even(int(head_dim * factor), "rotary dim (head_dim * partial_rotary_factor)")


def inverse_frequencies64(
    head_dim: int,
    theta: float = 10000.0,
    scaling: Mapping[str, Any] | None = None,
    *,
    max_position_embeddings: int | None = None,
    seq_len: int | None = None,
    partial_rotary_factor: float = 1.0,
) -> tuple[torch.Tensor, float]:
    """Like :func:`~ropelib.rope_frequencies` but in float64: the tables are built from these."""
    rotary_dim = rotary_dim_for(head_dim, partial_rotary_factor)
    theta = check_positive_float(theta, "theta")
    if max_position_embeddings is not None:
        check_int(max_position_embeddings, "max_position_embeddings", minimum=1)
    if seq_len is not None:
        check_int(seq_len, "seq_len", minimum=0)
    if scaling is None:
        return default_inverse_frequencies(rotary_dim, theta), 1.0
    from .scaling import scaled_inverse_frequencies

    return scaled_inverse_frequencies(
        rotary_dim, theta, scaling, max_position_embeddings=max_position_embeddings, seq_len=seq_len
    )


def rope_frequencies(
    head_dim: int,
    theta: float = 10000.0,
    scaling: Mapping[str, Any] | None = None,
    *,
    max_position_embeddings: int | None = None,
    seq_len: int | None = None,
    partial_rotary_factor: float = 1.0,
) -> tuple[torch.Tensor, float]:
    r"""RoPE's inverse frequencies and the factor that multiplies cos and sin.

    Without scaling, ``inv_freq[i] = theta^{-2i/r}`` with ``r = int(head_dim * partial_rotary_factor)``
    the number of rotated features (RoFormer eq. 15), and the factor is 1.

    Args:
        head_dim: per-head width ``d`` (even).
        theta: the base (10000 in RoFormer, 500000 in Llama 3, 1e6 in the seed and Qwen2).
        scaling: a Hugging Face-style ``rope_scaling`` dict, or ``None``. See :mod:`ropelib.scaling`.
        max_position_embeddings: the model's context length (read by some scalings).
        seq_len: the current sequence length (read by dynamic NTK).
        partial_rotary_factor: fraction of ``head_dim`` that is rotated.

    Returns:
        ``(inv_freq, attention_scaling)``: a float32 tensor of ``r // 2`` inverse frequencies
        (computed in float64, then rounded once) and a Python float.

    Example:
        >>> inv_freq, scale = rope_frequencies(8, theta=10000.0)
        >>> inv_freq.tolist(), scale
        ([1.0, 0.10000000149011612, 0.009999999776482582, 0.0010000000474974513], 1.0)
    """
    inv_freq, attention_scaling = inverse_frequencies64(
        head_dim,
        theta,
        scaling,
        max_position_embeddings=max_position_embeddings,
        seq_len=seq_len,
        partial_rotary_factor=partial_rotary_factor,
    )
    return inv_freq.to(torch.float32), attention_scaling


def cos_sin_table(
    inv_freq: torch.Tensor,
    positions: torch.Tensor,
    attention_scaling: float = 1.0,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""``cos(p * inv_freq) * s`` and ``sin(p * inv_freq) * s`` for integer ``positions``.

    The product ``p * inv_freq`` is formed in float64 and rounded to ``dtype`` only after the
    cosine: the usual float32 product loses ``p * 2^-24`` radians, about 0.06 at ``p = 2^20``.

    Args:
        inv_freq: ``[r/2]`` inverse frequencies (float64 recommended).
        positions: integer tensor of any shape.
        attention_scaling: the factor ``s`` (YaRN's temperature; 1 otherwise).
        dtype: dtype of the returned tables.

    Returns:
        ``(cos, sin)``, each of shape ``positions.shape + (r/2,)``.
    """
    check_float_tensor(inv_freq, "inv_freq", ndim=1)
    if (
        not isinstance(positions, torch.Tensor)
        or positions.dtype.is_floating_point
        or positions.dtype.is_complex
        or positions.dtype == torch.bool
    ):
        raise TypeError(
            f"positions must be an integer torch.Tensor, got {getattr(positions, 'dtype', type(positions).__name__)}"
        )
    angles = positions.to(torch.float64)[..., None] * inv_freq.to(device=positions.device, dtype=torch.float64)
    cos, sin = angles.cos(), angles.sin()
    if attention_scaling != 1.0:
        cos, sin = cos * attention_scaling, sin * attention_scaling
    return cos.to(dtype), sin.to(dtype)
