"""The plugs of the learned rotations of :mod:`ropelib.rotary.lie`: ComRoPE and LieRE on token positions."""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

from ...rotary import Rotation
from ...rotary.lie import ComRoPE, LieRE
from .base import AttentionLayer, PositionPlug


class _LiePlug(PositionPlug):
    """``q``, ``k`` turned by ``exp(p A)``, one generator set shared by the heads (so any ``num_kv_heads``)."""

    options = frozenset({"block_size", "theta", "init_std"})
    module: type[ComRoPE] | type[LieRE] = ComRoPE

    @classmethod
    def build(cls, attn: AttentionLayer, max_positions: int | None, options: dict[str, Any]) -> nn.Module | None:
        return cls.module(attn.head_dim, **options)

    @staticmethod
    def rotate(
        attn: AttentionLayer,
        q: torch.Tensor,
        k: torch.Tensor,
        positions: torch.Tensor | None,
        rotation: Rotation | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return cast(ComRoPE, attn.encoding)(q, k, positions)


class ComRoPEPlug(_LiePlug):
    """The plug of :class:`~ropelib.rotary.lie.ComRoPE` (Yu et al., 2025) on token positions.

    ``q``, ``k`` turned by ``exp(p A)``, ``A`` commuting block-diagonal generators shared by the heads;
    options ``block_size``, ``theta`` (the base), ``init_std``.
    """

    label = "ComRoPE"
    module = ComRoPE


class LieREPlug(_LiePlug):
    """The plug of :class:`~ropelib.rotary.lie.LieRE` (Ostmeier et al., 2025) on token positions.

    ``q``, ``k`` turned by ``exp(p A)``, ``A`` a learned skew-symmetric generator shared by the heads;
    options ``block_size`` (``None``: one dense generator), ``theta`` (the base), ``init_std``.
    """

    label = "LieRE"
    module = LieRE
