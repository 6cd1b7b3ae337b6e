"""The plugs of the hybrids' layers (:mod:`ropelib.attention.hybrid`): local RoPE, NoPE with a temperature."""

from __future__ import annotations

import math
from typing import Any, ClassVar, cast

import torch
from torch import nn

from ..._validation import check_int
from ...rotary import Rotation
from ..hybrid import AttentionTemperature, LocalRotary
from .base import AttentionLayer, PositionPlug
from .classic import RotaryPlug


class LocalRotaryPlug(RotaryPlug):
    """RoPE on ``q``, ``k`` and local attention: scores ``q_i . k_j / sqrt(d)``, ``-inf`` outside the local span."""

    kind: ClassVar[str] = ""
    size_option: ClassVar[str] = ""
    default_size: ClassVar[int] = 0
    computes_logits = True

    @classmethod
    def build(cls, attn: AttentionLayer, max_positions: int | None, options: dict[str, Any]) -> nn.Module | None:
        rope_options = {k: v for k, v in options.items() if k != cls.size_option}
        rotary = RotaryPlug.build(attn, max_positions, rope_options)
        size = check_int(options.get(cls.size_option, cls.default_size), cls.size_option, minimum=1)
        return LocalRotary(cast(Any, rotary), cls.kind, size)

    @staticmethod
    def rotate(
        attn: AttentionLayer,
        q: torch.Tensor,
        k: torch.Tensor,
        positions: torch.Tensor | None,
        rotation: Rotation | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if rotation is None:
            rotation = cast(LocalRotary, attn.encoding).rotary.rotation(q, positions)
        return rotation(q, k)

    @staticmethod
    def logits(attn: AttentionLayer, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        local = cast(LocalRotary, attn.encoding)
        scores = q @ k.transpose(-1, -2) / math.sqrt(attn.head_dim)
        mask = local.mask(positions)  # [seq, seq] or [batch, seq, seq]
        return scores.masked_fill(mask if mask.ndim == 2 else mask.unsqueeze(1), float("-inf"))


class ChunkedRotaryPlug(LocalRotaryPlug):
    """Llama 4's RoPE layers: chunked attention, ``chunk_size`` positions per chunk (8192)."""

    label = "RoPE (chunked)"
    options = RotaryPlug.options | {"chunk_size"}
    kind, size_option, default_size = "chunk", "chunk_size", 8192


class SlidingRotaryPlug(LocalRotaryPlug):
    """RNoPE-SWA's RoPE layers: sliding-window attention over the last ``window`` positions (4096)."""

    label = "RoPE (sliding window)"
    options = RotaryPlug.options | {"window"}
    kind, size_option, default_size = "window", "window", 4096


class TemperaturePlug(PositionPlug):
    """Llama 4's NoPE layers: no encoding, queries scaled by :func:`~ropelib.attention.hybrid.attention_temperature`."""

    label = "NoPE (temperature)"
    options = frozenset({"floor_scale", "attn_scale"})

    @staticmethod
    def build(attn: AttentionLayer, max_positions: int | None, options: dict[str, Any]) -> nn.Module | None:
        return AttentionTemperature(**options)

    @staticmethod
    def rotate(
        attn: AttentionLayer,
        q: torch.Tensor,
        k: torch.Tensor,
        positions: torch.Tensor | None,
        rotation: Rotation | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if positions is None:
            positions = torch.arange(q.shape[1], device=q.device)
        tau = cast(AttentionTemperature, attn.encoding)(positions)  # [seq] or [batch, seq], float64
        return (q * tau[..., None, None].to(q.dtype)), k
