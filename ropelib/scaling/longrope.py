r"""``rope_type="longrope"``: searched per-frequency rescale factors (Ding et al., 2024)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

import torch

from ..frequencies import default_inverse_frequencies
from .registry import number, original_length, register_scaling


def longrope_length(
    scaling: Mapping[str, Any], needed: int, current: int | None, max_position_embeddings: int | None
) -> int | None:
    """The long factors beyond the original length (``L + 1`` stands for any longer length), the short ones within."""
    original = original_length(scaling, max_position_embeddings, "longrope")
    return original + 1 if needed > original else None


@register_scaling(
    "longrope",
    required={"short_factor", "long_factor"},
    optional={"factor", "attention_factor", "original_max_position_embeddings"},
    paper="Ding et al., 2024, LongRoPE: Extending LLM Context Window Beyond 2 Million Tokens (ICML; arXiv:2402.13753)",
    follow_length=longrope_length,
)
def longrope_scaling(
    rotary_dim: int,
    theta: float,
    params: Mapping[str, Any],
    *,
    max_position_embeddings: int | None = None,
    seq_len: int | None = None,
    **_: Any,
) -> tuple[torch.Tensor, float]:
    r"""LongRoPE (Ding et al., 2024): one searched rescale factor per frequency, ``theta'_i = theta_i / long_factor[i]``.

    Two lists of ``d_rot/2`` factors are found by evolutionary search: ``short_factor`` for
    sequences within ``L`` and ``long_factor`` beyond it (used when ``seq_len > L``); the paper calls them
    ``lambda_i``, which in this module is the wavelength. cos and sin are
    multiplied by ``attention_factor``, by default ``sqrt(1 + ln s / ln L)`` (1 when ``s <= 1``).

    Keys: ``short_factor``, ``long_factor`` (required; ``d_rot/2`` positive numbers each), ``factor``
    (``s``; defaults to ``max_position_embeddings / L``), ``attention_factor``,
    ``original_max_position_embeddings`` (``L``; defaults to ``max_position_embeddings``).
    """
    original = original_length(params, max_position_embeddings, "longrope")
    if params.get("factor") is not None:
        factor = number(params, "factor", minimum=1.0)
    elif max_position_embeddings is not None:
        factor = max_position_embeddings / original
    else:
        raise ValueError("rope_type='longrope' needs scaling['factor'] or max_position_embeddings to infer it")
    if params.get("attention_factor") is not None:
        attention_factor = number(params, "attention_factor", minimum=0.0, strict=True)
    elif factor <= 1.0:
        attention_factor = 1.0
    elif original < 2:
        raise ValueError(
            f"rope_type='longrope' needs original_max_position_embeddings >= 2 for its default attention factor "
            f"sqrt(1 + ln s / ln L), got L={original}; give scaling['attention_factor']"
        )
    else:
        attention_factor = math.sqrt(1 + math.log(factor) / math.log(original))
    short, long = (_factor_list(params, key, rotary_dim // 2) for key in ("short_factor", "long_factor"))
    factors = long if seq_len is not None and seq_len > original else short
    return default_inverse_frequencies(rotary_dim, theta) / factors, float(attention_factor)


def _factor_list(params: Mapping[str, Any], key: str, length: int) -> torch.Tensor:
    values = params[key]
    if not isinstance(values, (list, tuple)):  # ordered: a set would scramble the pairs
        raise TypeError(f"scaling[{key!r}] must be a list of {length} numbers, got {type(values).__name__}")
    if len(values) != length:
        raise ValueError(f"scaling[{key!r}] must have rotary_dim // 2 = {length} entries, got {len(values)}")
    for value in values:
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (0 < float(value) < math.inf):
            raise ValueError(f"scaling[{key!r}] must hold finite numbers > 0, got {value!r}")
    return torch.tensor([float(v) for v in values], dtype=torch.float64, device="cpu")
