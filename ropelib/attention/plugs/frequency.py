"""The plugs of the encodings that operate on RoPE's frequencies: p-RoPE, Resonance RoPE, FoPE.

p-RoPE and Resonance RoPE are RoPE with other frequencies, so their plugs build the
:class:`~ropelib.RotaryEmbedding` subclass and rotate as ``classic.RotaryPlug`` does; FoPE's
tables are not rotations but are applied by the same operator.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

from ...rotary import Rotation
from ...rotary.fope import FourierPositionEmbedding
from ...rotary.p_rope import PRotaryEmbedding
from ...rotary.resonance import ResonanceRotaryEmbedding
from .base import AttentionLayer, PositionPlug
from .classic import RotaryPlug


class PRopePlug(RotaryPlug):
    label = "p-RoPE"
    options = frozenset({"p", "theta", "layout", "max_position_embeddings", "kernel"})

    @staticmethod
    def build(attn: AttentionLayer, max_positions: int | None, options: dict[str, Any]) -> nn.Module | None:
        return PRotaryEmbedding(attn.head_dim, **options)


class ResonancePlug(RotaryPlug):
    label = "Resonance RoPE"
    options = frozenset({"theta", "layout", "rotary_dim", "scaling", "max_position_embeddings", "kernel"})

    @staticmethod
    def build(attn: AttentionLayer, max_positions: int | None, options: dict[str, Any]) -> nn.Module | None:
        return ResonanceRotaryEmbedding(attn.head_dim, **options)


class FoPEPlug(PositionPlug):
    label = "FoPE"
    options = frozenset({"theta", "train_length", "sigma", "learned", "layout", "kernel"})

    @staticmethod
    def build(attn: AttentionLayer, max_positions: int | None, options: dict[str, Any]) -> nn.Module | None:
        return FourierPositionEmbedding(attn.head_dim, **options)

    @staticmethod
    def rotate(
        attn: AttentionLayer,
        q: torch.Tensor,
        k: torch.Tensor,
        positions: torch.Tensor | None,
        rotation: Rotation | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return cast(FourierPositionEmbedding, attn.encoding).rotation(q, positions).apply(q, k)
