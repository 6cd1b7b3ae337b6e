"""The plugs of the encodings of the book's first parts: absolute, relative biases, RoPE."""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

from ...encodings.absolute import LearnedPositionalEmbedding, SinusoidalPositionalEncoding
from ...encodings.relative import ShawRelativePosition, T5RelativeBias, alibi_bias_from_relative, alibi_slopes
from ...rotary import RotaryEmbedding, Rotation
from .base import AttentionLayer, PositionPlug, relative_from_positions


class SinusoidalPlug(PositionPlug):
    options = frozenset({"base"})

    @staticmethod
    def build(attn: AttentionLayer, max_positions: int | None, options: dict[str, Any]) -> nn.Module | None:
        return SinusoidalPositionalEncoding(attn.embed_dim, **options)

    @staticmethod
    def embed(attn: AttentionLayer, x: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        return cast(SinusoidalPositionalEncoding, attn.encoding).add(x, positions)


class LearnedPlug(PositionPlug):
    needs_table = True

    @staticmethod
    def build(attn: AttentionLayer, max_positions: int | None, options: dict[str, Any]) -> nn.Module | None:
        if max_positions is None:
            raise ValueError("position='learned' needs max_positions (the size of the learned table)")
        return LearnedPositionalEmbedding(max_positions, attn.embed_dim)

    @staticmethod
    def embed(attn: AttentionLayer, x: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        return cast(LearnedPositionalEmbedding, attn.encoding).add(x, positions)


class RotaryPlug(PositionPlug):
    options = frozenset({"theta", "layout", "rotary_dim", "scaling", "max_position_embeddings", "kernel", "rotary"})

    @staticmethod
    def build(attn: AttentionLayer, max_positions: int | None, options: dict[str, Any]) -> nn.Module | None:
        shared = options.get("rotary")
        if shared is None:
            return RotaryEmbedding(attn.head_dim, **options)
        if len(options) > 1:
            raise ValueError(f"rotary= shares a RotaryEmbedding: give no other RoPE options, got {sorted(options)}")
        if not isinstance(shared, RotaryEmbedding) or shared.head_dim != attn.head_dim:
            raise ValueError(f"rotary must be a RotaryEmbedding of head_dim={attn.head_dim}, got {shared!r}")
        return shared

    @staticmethod
    def rotate(
        attn: AttentionLayer,
        q: torch.Tensor,
        k: torch.Tensor,
        positions: torch.Tensor | None,
        rotation: Rotation | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if rotation is None:
            rotation = cast(RotaryEmbedding, attn.encoding).rotation(q, positions)
        return rotation(q, k)


class T5Plug(PositionPlug):
    options = frozenset({"num_buckets", "max_distance"})
    adds_bias = True

    @staticmethod
    def build(attn: AttentionLayer, max_positions: int | None, options: dict[str, Any]) -> nn.Module | None:
        return T5RelativeBias(attn.num_heads, bidirectional=not attn.causal, **options)

    @staticmethod
    def score_bias(attn: AttentionLayer, q: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        bias = cast(T5RelativeBias, attn.encoding).bias(relative_from_positions(positions))
        return (bias if bias.ndim == 4 else bias.unsqueeze(0)).to(q.dtype)


class AlibiPlug(PositionPlug):
    adds_bias = True

    @staticmethod
    def build(attn: AttentionLayer, max_positions: int | None, options: dict[str, Any]) -> nn.Module | None:
        # float64 plain attribute, not a buffer: .float()/.half() must not round the slopes.
        attn.alibi_slopes = alibi_slopes(attn.num_heads)
        return None

    @staticmethod
    def score_bias(attn: AttentionLayer, q: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        slopes = attn.alibi_slopes.to(q.device)
        bias = alibi_bias_from_relative(slopes, relative_from_positions(positions), dtype=torch.float64)
        return (bias if bias.ndim == 4 else bias.unsqueeze(0)).to(q.dtype)  # rounded once


class ShawPlug(PositionPlug):
    options = frozenset({"max_relative_position", "values"})
    adds_bias = adds_values = True

    @staticmethod
    def build(attn: AttentionLayer, max_positions: int | None, options: dict[str, Any]) -> nn.Module | None:
        return ShawRelativePosition(attn.head_dim, **options)

    @staticmethod
    def score_bias(attn: AttentionLayer, q: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        return cast(ShawRelativePosition, attn.encoding).score_bias(q, relative_from_positions(positions))

    @staticmethod
    def value_term(attn: AttentionLayer, weights: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        shaw = cast(ShawRelativePosition, attn.encoding)
        if shaw.value_table is None:
            return None
        return shaw.value_term(weights, relative_from_positions(positions))
