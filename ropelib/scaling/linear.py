"""``rope_type="linear"``: position interpolation (Chen et al., 2023)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..frequencies import default_inverse_frequencies
from .registry import factor, register_scaling


@register_scaling(
    "linear",
    required={"factor"},
    paper="Chen et al., 2023, Extending Context Window of Large Language Models via Positional Interpolation (arXiv:2306.15595)",
    for_factor=lambda s, length: {"rope_type": "linear", "factor": s},
)
def linear_scaling(rotary_dim: int, theta: float, params: Mapping[str, Any], **_: Any) -> tuple[torch.Tensor, float]:
    r"""Position interpolation (Chen et al., 2023): positions ``m -> m / s``, i.e. ``theta_i -> theta_i / s``.

    Every pair is interpolated: a context of ``s L`` tokens is squeezed into the angles of ``L``.
    Keys: ``factor`` (``s >= 1``). Attention factor 1.
    """
    return default_inverse_frequencies(rotary_dim, theta) / factor(params), 1.0
