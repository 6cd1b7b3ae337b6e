"""``rope_type="dynamic"``: dynamic NTK-aware scaling (emozilla, 2023; bloc97, 2023)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..frequencies import default_inverse_frequencies
from .registry import factor, register_scaling


def dynamic_length(
    scaling: Mapping[str, Any], needed: int, current: int | None, max_position_embeddings: int | None
) -> int | None:
    """Hugging Face's ``dynamic_rope_update`` rule: grow past the longest length seen, reset below the original.

    The frequencies follow the longest length seen (``needed`` when it exceeds ``current``) and
    return to the original ones (``None``) only for a sequence strictly shorter than
    ``max_position_embeddings`` (a sequence of exactly that length keeps grown frequencies).
    """
    if max_position_embeddings is None:
        raise ValueError("dynamic scaling needs max_position_embeddings (the length the model was trained for)")
    if needed > (max_position_embeddings if current is None else current):
        return needed
    return None if needed < max_position_embeddings else current


@register_scaling(
    "dynamic",
    required={"factor"},
    paper="emozilla, 2023, Dynamically Scaled RoPE further increases performance of long context LLaMA (Reddit)",
    follow_length=dynamic_length,
    for_factor=lambda s, length: {"rope_type": "dynamic", "factor": s},
)
def dynamic_ntk_scaling(
    rotary_dim: int,
    theta: float,
    params: Mapping[str, Any],
    *,
    max_position_embeddings: int | None = None,
    seq_len: int | None = None,
    **_: Any,
) -> tuple[torch.Tensor, float]:
    r"""Dynamic NTK (emozilla, 2023), built on NTK-aware scaling (bloc97, 2023): a larger base.

    NTK-aware scaling raises the base so that the lowest frequency is interpolated by ``s_N``
    while the highest is unchanged: ``base' = base * s_N^{d_rot/(d_rot-2)}``. Dynamic NTK chooses ``s_N``
    from the current length ``N = max(seq_len, L)`` with ``L = max_position_embeddings``:

    .. math:: \mathrm{base}' = \mathrm{base} \left(\frac{s\,N}{L} - (s - 1)\right)^{d_{\mathrm{rot}}/(d_{\mathrm{rot}}-2)}, \qquad \theta_i = \mathrm{base}'^{-2i/d_{\mathrm{rot}}},

    which is the original base for ``N <= L``. Keys: ``factor`` (``s >= 1``). Needs
    ``max_position_embeddings`` and ``d_rot >= 4``; ``seq_len`` defaults to ``L``. Attention factor 1.
    """
    s = factor(params)
    if max_position_embeddings is None:
        raise ValueError("rope_type='dynamic' needs max_position_embeddings (the length it was trained at)")
    if rotary_dim < 4:
        raise ValueError(
            f"rope_type='dynamic' needs a rotary dimension >= 4 (the exponent is d/(d-2)), got {rotary_dim}"
        )
    length = max_position_embeddings if seq_len is None else max(seq_len, max_position_embeddings)
    base = theta * ((s * length / max_position_embeddings) - (s - 1)) ** (rotary_dim / (rotary_dim - 2))
    return default_inverse_frequencies(rotary_dim, base), 1.0
