"""The plugs of the position remappings without training: ReRoPE, Leaky ReRoPE, Self-Extend, dual chunk attention.

Each computes the whole score matrix (:meth:`~ropelib.attention.plugs.PositionPlug.logits`) from the unrotated
``q`` and ``k``, through its module of :mod:`ropelib.rotary` (several rotations per matrix). Their
defaults are sized for the lab's models, trained at 32 positions: windows of 16, a training window
of 32 for dual chunk attention.
"""

from __future__ import annotations

from typing import Any, ClassVar, cast

import torch
from torch import nn

from ...rotary.dual_chunk import DualChunkAttention
from ...rotary.remap import RemappedRotary
from ...rotary.rerope import ReRoPE
from ...rotary.self_extend import SelfExtend
from .base import AttentionLayer, PositionPlug

#: The options of the remapping plugs that configure their :class:`~ropelib.RotaryEmbedding`.
ROPE_OPTIONS = frozenset({"theta", "layout", "rotary_dim", "scaling", "max_position_embeddings", "kernel"})


class RemapPlug(PositionPlug):
    """A remapped RoPE: its module (``module``) built from ``defaults`` and the layer's options; no rotate hook."""

    computes_logits = True
    module: ClassVar[type[RemappedRotary]]
    defaults: ClassVar[dict[str, Any]] = {}

    @classmethod
    def build(cls, attn: AttentionLayer, max_positions: int | None, options: dict[str, Any]) -> nn.Module | None:
        return cls.module(attn.head_dim, **{**cls.defaults, **options})

    @staticmethod
    def logits(attn: AttentionLayer, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        remapped = cast(RemappedRotary, attn.encoding)
        return remapped(q.transpose(1, 2), k.transpose(1, 2), positions, causal=attn.causal)


class ReRoPEPlug(RemapPlug):
    label = "ReRoPE"
    options = ROPE_OPTIONS | {"window"}
    module = ReRoPE
    defaults = {"window": 16}


class LeakyReRoPEPlug(RemapPlug):
    label = "Leaky ReRoPE"
    options = ROPE_OPTIONS | {"window", "factor"}
    module = ReRoPE
    defaults = {"window": 16, "factor": 16.0}


class SelfExtendPlug(RemapPlug):
    label = "Self-Extend"
    options = ROPE_OPTIONS | {"window", "group"}
    module = SelfExtend
    defaults = {"window": 16, "group": 8}


class DualChunkPlug(RemapPlug):
    label = "DCA"
    options = ROPE_OPTIONS | {"chunk_size", "local_window"}
    module = DualChunkAttention
    defaults = {"chunk_size": 24, "local_window": 8}
