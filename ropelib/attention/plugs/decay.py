r"""The plug of xPos (Sun et al., 2023): RoPE's rotation times a decay with the distance.

:class:`~ropelib.XPos` rotates ``q`` and ``k`` as RoPE does and scales pair ``i`` of the query at
``m`` by ``zeta_i^{(m - c)/B}`` and that of the key at ``n`` by ``zeta_i^{-(n - c)/B}``, so the
score's pair ``i`` carries ``zeta_i^{(m - n)/B}``. The plug hands it the layer's positions; ``q``
and ``k`` are encoded in one call, so the centre ``c`` is the same for both and cancels.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

from ...rotary import Rotation
from ...rotary.xpos import XPos
from .base import AttentionLayer, PositionPlug


class XPosPlug(PositionPlug):
    """``q``, ``k`` rotated and scaled by :class:`~ropelib.XPos` at the positions given (``0 .. seq-1`` by default)."""

    label = "xPos"
    options = frozenset({"theta", "gamma", "scale_base", "layout"})

    @staticmethod
    def build(attn: AttentionLayer, max_positions: int | None, options: dict[str, Any]) -> nn.Module | None:
        return XPos(attn.head_dim, **options)

    @staticmethod
    def rotate(
        attn: AttentionLayer,
        q: torch.Tensor,
        k: torch.Tensor,
        positions: torch.Tensor | None,
        rotation: Rotation | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return cast(XPos, attn.encoding)(q, k, positions)
