"""The plugs of the learned and contextual biases: KERPLE's two kernels, FIRE and CoPE."""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

from ...encodings.cope import ContextualPosition
from ...encodings.fire import FireBias
from ...encodings.kerple import KerpleBias
from .base import AttentionLayer, PositionPlug, relative_from_positions


def _batched(bias: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``[heads, n, n]`` or ``[batch, heads, n, n]`` -> 4-d, in ``q``'s dtype."""
    return (bias if bias.ndim == 4 else bias.unsqueeze(0)).to(q.dtype)


class KerpleLogPlug(PositionPlug):
    """``position="kerple_log"``: KERPLE's ``-r1 log(1 + r2 |i - j|)`` on the scores (:class:`~ropelib.encodings.kerple.KerpleBias`)."""

    label = "KERPLE (log)"
    adds_bias = True
    kind = "log"

    @classmethod
    def build(cls, attn: AttentionLayer, max_positions: int | None, options: dict[str, Any]) -> nn.Module | None:
        return KerpleBias(attn.num_heads, cls.kind)

    @staticmethod
    def score_bias(attn: AttentionLayer, q: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        return _batched(cast(KerpleBias, attn.encoding).bias(relative_from_positions(positions)), q)


class KerplePowerPlug(KerpleLogPlug):
    """``position="kerple_power"``: KERPLE's ``-r1 |i - j|^r2`` on the scores (ALiBi at ``r2 = 1``)."""

    label = "KERPLE (power)"
    kind = "power"


class FirePlug(PositionPlug):
    """``position="fire"``: FIRE's MLP of the normalised distance on the scores (:class:`~ropelib.encodings.fire.FireBias`)."""

    label = "FIRE"
    options = frozenset({"mlp_width", "init_c", "init_threshold"})
    adds_bias = True

    @staticmethod
    def build(attn: AttentionLayer, max_positions: int | None, options: dict[str, Any]) -> nn.Module | None:
        return FireBias(attn.num_heads, **options)

    @staticmethod
    def score_bias(attn: AttentionLayer, q: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        return _batched(cast(FireBias, attn.encoding).bias(positions, attn.causal), q)


class CopePlug(PositionPlug):
    """``position="cope"``: the whole scores with CoPE's gate-counted position bias
    (:class:`~ropelib.encodings.cope.ContextualPosition`)."""

    label = "CoPE"
    options = frozenset({"npos"})
    computes_logits = True

    @staticmethod
    def build(attn: AttentionLayer, max_positions: int | None, options: dict[str, Any]) -> nn.Module | None:
        return ContextualPosition(attn.head_dim, **options)

    @staticmethod
    def logits(attn: AttentionLayer, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """CoPE reads no position indices: its positions are counted by its gates (the order of the
        tokens enters through which keys lie between ``j`` and ``i``)."""
        return cast(ContextualPosition, attn.encoding).logits(q, k, attn.causal)
