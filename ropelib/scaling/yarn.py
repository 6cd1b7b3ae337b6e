r"""``rope_type="yarn"``: NTK-by-parts interpolation with an attention temperature (Peng et al., 2024)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from ..frequencies import default_inverse_frequencies
from .registry import factor as read_factor
from .registry import number, original_length, register_scaling


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    r"""YaRN's temperature factor ``0.1 * mscale * ln(s) + 1`` for ``s > 1``, else 1 (Peng et al., 2024)."""
    if scale <= 1.0:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def yarn_correction_dim(num_rotations: float, rotary_dim: int, theta: float, original_length: int) -> float:
    r"""The (fractional) pair index whose wavelength fits ``num_rotations`` times in ``L`` tokens.

    Solving ``L / lambda_i = nu`` for ``i``, with ``lambda_i = 2 pi base^{2i/d_rot}``, gives

    .. math:: i(\nu) = \frac{d_{\mathrm{rot}} \, \ln\!\big(L / (2 \pi \nu)\big)}{2 \ln \mathrm{base}}.

    Returned as in Hugging Face's ``find_correction_dim``: a fractional pair index, compared
    directly with ``i = 0 .. d_rot/2 - 1``; :func:`yarn_ramp` clips it to ``[0, d_rot - 1]`` as
    Hugging Face does (a range on the scale of ``d_rot``, wider than the pairs').
    """
    return rotary_dim * math.log(original_length / (num_rotations * 2 * math.pi)) / (2 * math.log(theta))


def yarn_ramp(
    rotary_dim: int,
    theta: float,
    original_length: int,
    beta_fast: float,
    beta_slow: float,
    truncate: bool = True,
) -> torch.Tensor:
    r"""YaRN's ramp as the weight of interpolation, ``1 - eta_i``,
    float64 ``[d_rot/2]``: 0 = keep (extrapolate), 1 = divide by ``s``
    (interpolate).

    ``low = i(beta_fast)``, ``high = i(beta_slow)`` (floored / ceiled when
    ``truncate``), clipped to ``[0, d_rot - 1]``;
    ``1 - eta_i = clamp((i - low) / (high - low), 0, 1)``; when
    ``low == high`` the denominator is 0.001, as in Hugging Face. (The
    paper's ramp gamma is ``eta_i``, the weight of the kept frequency.)
    """
    shape = (rotary_dim, theta, original_length)
    low = yarn_correction_dim(beta_fast, *shape)
    high = yarn_correction_dim(beta_slow, *shape)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high = high + 0.001
    index = torch.arange(rotary_dim // 2, dtype=torch.float64, device="cpu")
    return ((index - low) / (high - low)).clamp(0.0, 1.0)


@register_scaling(
    "yarn",
    required={"factor"},
    optional={
        "original_max_position_embeddings",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "attention_factor",
        "truncate",
    },
    paper="Peng et al., 2024, YaRN: Efficient Context Window Extension of Large Language Models (ICLR; arXiv:2309.00071)",
    for_factor=lambda s, length: {"rope_type": "yarn", "factor": s, "original_max_position_embeddings": length},
)
def yarn_scaling(
    rotary_dim: int,
    theta: float,
    params: Mapping[str, Any],
    *,
    max_position_embeddings: int | None = None,
    **_: Any,
) -> tuple[torch.Tensor, float]:
    r"""YaRN (Peng et al., 2024): "NTK-by-parts" interpolation plus an attention temperature.

    Pairs that turn many times within ``L`` (high frequency) keep their frequency; pairs whose
    wavelength exceeds ``L`` are interpolated as in PI; in between, a linear ramp ``eta_i``
    (``1 -`` :func:`yarn_ramp`, bounded by the pairs that make ``beta_fast`` and ``beta_slow``
    turns in ``L``) blends the two:

    .. math:: \theta'_i = \eta_i\, \theta_i + (1 - \eta_i)\, \theta_i / s .

    cos and sin are multiplied by ``attention_factor`` (``sqrt(1/t)`` in the paper), by default
    ``0.1 ln s + 1`` or, when ``mscale`` and ``mscale_all_dim`` are both set (DeepSeek),
    ``mscale(s, mscale) / mscale(s, mscale_all_dim)`` (:func:`yarn_get_mscale`).

    Keys: ``factor`` (required), ``original_max_position_embeddings`` (``L``; defaults to
    ``max_position_embeddings``), ``beta_fast`` (32), ``beta_slow`` (1), ``mscale``,
    ``mscale_all_dim``, ``attention_factor``, ``truncate`` (True: floor/ceil the ramp's ends).
    """
    factor = read_factor(params)
    if theta <= 1.0:
        raise ValueError(f"rope_type='yarn' needs theta > 1 (its ramp divides by ln theta), got {theta}")
    original = original_length(params, max_position_embeddings, "yarn")
    beta_fast = number(params, "beta_fast", minimum=0.0, strict=True) if params.get("beta_fast") is not None else 32.0
    beta_slow = number(params, "beta_slow", minimum=0.0, strict=True) if params.get("beta_slow") is not None else 1.0
    if beta_fast < beta_slow:
        raise ValueError(f"scaling['beta_fast'] must be >= scaling['beta_slow'], got {beta_fast} < {beta_slow}")
    truncate = params.get("truncate", True)
    if not isinstance(truncate, bool):
        raise TypeError(f"scaling['truncate'] must be a bool, got {type(truncate).__name__}")
    if params.get("attention_factor") is not None:
        attention_factor = number(params, "attention_factor", minimum=0.0, strict=True)
    else:
        mscale = number(params, "mscale", minimum=0.0) if params.get("mscale") is not None else None
        mscale_all_dim = (
            number(params, "mscale_all_dim", minimum=0.0) if params.get("mscale_all_dim") is not None else None
        )
        if mscale and mscale_all_dim:
            attention_factor = yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_get_mscale(factor)
    inv_freq = default_inverse_frequencies(rotary_dim, theta)
    ramp = yarn_ramp(rotary_dim, theta, original, beta_fast, beta_slow, truncate)
    return inv_freq * (1 - ramp) + (inv_freq / factor) * ramp, float(attention_factor)
