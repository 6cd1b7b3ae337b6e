"""The plug of RoPE-Mixed (Heo et al., 2024) on image patches in row-major order.

A vision transformer's patches come as a sequence, row after row: patch ``p`` of a grid
``grid_width`` patches wide sits at ``(row, column) = (p // grid_width, p % grid_width)``. The
plug gives :class:`~ropelib.rotary.mixed.MixedRotaryEmbedding` those 2-D positions, so that
:class:`~ropelib.MultiHeadAttention` (whose positions are 1-D) carries RoPE-Mixed.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

from ..._validation import check_int
from ...rotary import Rotation
from ...rotary.mixed import MixedRotaryEmbedding
from .base import AttentionLayer, PositionPlug


class GridMixedRotary(MixedRotaryEmbedding):
    """:class:`~ropelib.rotary.mixed.MixedRotaryEmbedding` whose positions are patch indices on a grid."""

    def __init__(self, head_dim: int, num_heads: int, grid_width: int, **options: Any) -> None:
        super().__init__(head_dim, num_heads, **options)
        self.grid_width = check_int(grid_width, "grid_width", minimum=1)

    def grid(self, positions: torch.Tensor) -> torch.Tensor:
        """``(row, column)`` ``[..., seq, 2]`` of patch indices ``[..., seq]`` (row-major)."""
        return torch.stack((positions // self.grid_width, positions % self.grid_width), dim=-1)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, grid_width={self.grid_width}"


class RopeMixedPlug(PositionPlug):
    """``q``, ``k`` turned by RoPE-Mixed at the grid position of each patch; one frequency set per head."""

    label = "RoPE-Mixed"
    options = frozenset({"grid_width", "theta", "layout"})

    @staticmethod
    def build(attn: AttentionLayer, max_positions: int | None, options: dict[str, Any]) -> nn.Module | None:
        kv_heads = getattr(attn, "num_kv_heads", attn.num_heads)
        if kv_heads != attn.num_heads:
            raise ValueError(
                f"position='rope_mixed' turns each key head by its own query head's frequencies: it needs "
                f"num_kv_heads == num_heads = {attn.num_heads}, got num_kv_heads={kv_heads}"
            )
        options = {"grid_width": 16, **options}
        return GridMixedRotary(attn.head_dim, attn.num_heads, **options)

    @staticmethod
    def rotate(
        attn: AttentionLayer,
        q: torch.Tensor,
        k: torch.Tensor,
        positions: torch.Tensor | None,
        rotation: Rotation | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        mixed = cast(GridMixedRotary, attn.encoding)
        if positions is None:
            positions = torch.arange(q.shape[1], device=q.device)
        return mixed(q, k, mixed.grid(positions))
