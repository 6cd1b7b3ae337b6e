"""``rope_type="proportional"``: partial RoPE whose frequencies span the whole head (Hugging Face, Gemma-family models)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .registry import optional_number, register_scaling


@register_scaling(
    "proportional",
    optional={"factor", "partial_rotary_factor"},
    paper="transformers' modeling_rope_utils._compute_proportional_rope_parameters (Gemma-family configs)",
)
def proportional_scaling(
    rotary_dim: int, theta: float, params: Mapping[str, Any], **_: Any
) -> tuple[torch.Tensor, float]:
    r"""Proportional RoPE: the first ``n = int(p d_rot // 2)`` pairs rotate at ``base^{-2i/d_rot}``, the rest not at all; all ``/ s``.

    As transformers' ``_compute_proportional_rope_parameters``: with ``d_rot = rotary_dim`` the full
    width (here the whole head: the pairs are ``(i, i + d_rot/2)`` over all ``d_rot`` features) and
    ``p = partial_rotary_factor`` (a key of the dict, as in ``rope_parameters``),

    .. math:: \theta_i = \begin{cases} \mathrm{base}^{-2i/d_{\mathrm{rot}}} / s & i < n \\ 0 & n \le i < d_{\mathrm{rot}}/2 \end{cases}

    so the rotated pairs keep the frequencies of the full head (unlike ``partial_rotary_factor``
    elsewhere, which rescales the exponent to ``2i/(p d_rot)``) and a zero frequency leaves its pair
    unrotated. Keys: ``factor`` (``s > 0``, default 1), ``partial_rotary_factor`` (``p`` in
    ``[0, 1]``, default 1). Attention factor 1. Returns float64 ``[d_rot/2]``.
    """
    s = optional_number(params, "factor", 1.0, minimum=0.0, strict=True)
    p = optional_number(params, "partial_rotary_factor", 1.0, minimum=0.0)
    assert s is not None and p is not None
    if p > 1.0:
        raise ValueError(f"scaling['partial_rotary_factor'] must be in [0, 1], got {p}")
    rotated = int(p * rotary_dim // 2)
    exponent = torch.arange(0, 2 * rotated, 2, dtype=torch.float64, device="cpu") / rotary_dim
    inv_freq = torch.zeros(rotary_dim // 2, dtype=torch.float64, device="cpu")
    inv_freq[:rotated] = theta ** (-exponent)
    return inv_freq / s, 1.0
