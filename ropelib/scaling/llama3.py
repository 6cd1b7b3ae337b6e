r"""``rope_type="llama3"``: Llama 3.1's frequency-dependent interpolation (Llama Team, AI @ Meta, 2024)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from ..frequencies import default_inverse_frequencies
from .registry import factor as read_factor
from .registry import number, original_length, register_scaling

# Meta's rule; the reference the registry lists for ``rope_type="llama3"``.
_PAPER = (
    "Llama Team, AI @ Meta, 2024, The Llama 3 Herd of Models (arXiv:2407.21783); the rule as released in Meta's code"
)


# llama3_scaling is shown whole in book/context_extension.ipynb (literalinclude): it is laid out
# by hand to fit the book's code blocks (76 columns), so the formatter leaves it alone.
# fmt: off
@register_scaling(
    "llama3",
    required={"factor", "low_freq_factor", "high_freq_factor"},
    optional={"original_max_position_embeddings"},
    paper=_PAPER,
    for_factor=lambda s, length: {
        "rope_type": "llama3",
        "factor": s,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": length,
    },
)
def llama3_scaling(
    rotary_dim: int,
    theta: float,
    params: Mapping[str, Any],
    *,
    max_position_embeddings: int | None = None,
    **_: Any,
) -> tuple[torch.Tensor, float]:
    r"""Llama 3.1's band-wise interpolation (Llama Team, AI @ Meta, 2024).

    With ``lambda_low = L / low_freq_factor`` and
    ``lambda_high = L / high_freq_factor``:

    .. math::

        \theta'_i = \begin{cases}
          \theta_i & \lambda_i < \lambda_{high} \\
          \theta_i / s & \lambda_i > \lambda_{low} \\
          (1 - \eta_i)\, \theta_i / s + \eta_i\, \theta_i & \text{otherwise,}
        \end{cases}

    where :math:`\eta_i = \frac{L/\lambda_i - f_{low}}{f_{high} - f_{low}}`,
    with :math:`f_{low}` = ``low_freq_factor`` and
    :math:`f_{high}` = ``high_freq_factor``.

    Keys: ``factor`` (8 in Llama 3.1), ``low_freq_factor`` (1),
    ``high_freq_factor`` (4), all required, and
    ``original_max_position_embeddings`` (8192; defaults to
    ``max_position_embeddings``). Attention factor 1.
    """
    factor = read_factor(params)
    low = number(params, "low_freq_factor", minimum=0.0, strict=True)
    high = number(params, "high_freq_factor", minimum=0.0, strict=True)
    if high <= low:
        raise ValueError(
            "scaling['high_freq_factor'] must be > "
            f"scaling['low_freq_factor'], got {high} <= {low}"
        )
    original = original_length(params, max_position_embeddings, "llama3")
    inv_freq = default_inverse_frequencies(rotary_dim, theta)
    wavelength = 2 * math.pi / inv_freq
    smooth = ((original / wavelength - low) / (high - low)).clamp(0.0, 1.0)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    long_waves = wavelength > original / low  # interpolated
    short_waves = wavelength < original / high  # kept
    scaled = torch.where(long_waves, inv_freq / factor, blended)
    return torch.where(short_waves, inv_freq, scaled), 1.0
# fmt: on
