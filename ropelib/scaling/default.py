"""``rope_type="default"``: plain RoPE, no scaling (Su et al., RoFormer, 2024, eq. 15)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..frequencies import default_inverse_frequencies
from .registry import register_scaling


@register_scaling("default", paper="Su et al., 2021, RoFormer (arXiv:2104.09864), eq. 15")
def default_scaling(rotary_dim: int, theta: float, params: Mapping[str, Any], **_: Any) -> tuple[torch.Tensor, float]:
    r"""No scaling: ``theta_i = base^{-2i/d_rot}`` (Su et al., RoFormer, eq. 15); attention factor 1. Keys: none."""
    return default_inverse_frequencies(rotary_dim, theta), 1.0
