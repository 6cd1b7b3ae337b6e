r"""Multi-head self-attention with a pluggable position encoding.

:class:`MultiHeadAttention` applies one of the encodings of this library at the place it
belongs (see :mod:`ropelib.attention.plugs`): absolute ones are added to the input, RoPE rotates
queries and keys, and relative biases are added to the scores ``A_ij = q_i . k_j / sqrt(d) + b_ij``.
It calls :func:`torch.nn.functional.scaled_dot_product_attention` whenever the encoding allows it.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .._validation import check_bool, check_choice, check_float_tensor, check_heads, check_int, check_positions
from ..rotary import Rotation
from .plugs import PLUGS

#: The ``position`` argument of :class:`MultiHeadAttention` (the keys of :data:`ropelib.attention.plugs.PLUGS`).
POSITION_ENCODINGS = tuple(PLUGS)


def split_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """``[batch, seq, heads * d] -> [batch, seq, heads, d]``."""
    return x.unflatten(-1, (heads, -1))


def causal_mask(seq: int, device: torch.device) -> torch.Tensor:
    """Boolean ``[seq, seq]``, True where key ``j`` is after query ``i`` (to be masked)."""
    return torch.ones(seq, seq, dtype=torch.bool, device=device).triu(1)


class MultiHeadAttention(nn.Module):
    r"""Multi-head self-attention with one position encoding.

    Args:
        embed_dim: model width ``E``.
        num_heads: query heads ``H`` (``E`` must be divisible by it).
        position: one of ``"none"``, ``"sinusoidal"``, ``"learned"``, ``"t5"``, ``"alibi"``,
            ``"shaw"``, ``"rope"``.
        causal: mask keys after the query (decoder) or not (encoder).
        num_kv_heads: key/value heads for grouped-query attention (``H`` by default; must divide ``H``).
        max_positions: table size of the learned encoding (required for ``"learned"``).
        bias: whether the projections have a bias.
        **position_options: passed to the encoding: ``base`` (sinusoidal), ``num_buckets`` and
            ``max_distance`` (t5), ``max_relative_position`` and ``values`` (shaw), ``theta``,
            ``layout``, ``rotary_dim``, ``scaling``, ``max_position_embeddings`` and ``kernel``
            (rope), or ``rotary``: a :class:`~ropelib.RotaryEmbedding` to share with the other layers
            of a model (one table cache for all).

    Shapes:
        ``forward(x, positions=None, *, rotation=None)``: ``x`` is ``[batch, seq, E]``; ``positions``
        integers of shape ``[seq]`` or ``[batch, seq]`` (default ``0 .. seq-1``); ``rotation``: the
        :class:`~ropelib.Rotation` the model made once for all its layers
        (``rope.rotation(x, positions)``), instead of ``positions``. Returns ``[batch, seq, E]``.

    Example:
        >>> rope = RotaryEmbedding(16)
        >>> layers = [
        ...     MultiHeadAttention(64, 4, "rope", rotary=rope) for _ in range(2)
        ... ]
        >>> x = torch.randn(1, 5, 64)
        >>> rotation = rope.rotation(x)  # once per forward pass, for every layer
        >>> y = layers[1](layers[0](x, rotation=rotation), rotation=rotation)
        >>> y.shape, layers[0].encoding is layers[1].encoding
        (torch.Size([1, 5, 64]), True)
    """

    alibi_slopes: torch.Tensor  # set by the ALiBi plug (float64, a plain attribute: .half() must not round it)

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        position: str = "none",
        *,
        causal: bool = False,
        num_kv_heads: int | None = None,
        max_positions: int | None = None,
        bias: bool = False,
        **position_options: Any,
    ) -> None:
        super().__init__()
        self.embed_dim, self.num_heads, self.head_dim = check_heads(embed_dim, num_heads)
        self.num_kv_heads = (
            self.num_heads if num_kv_heads is None else check_int(num_kv_heads, "num_kv_heads", minimum=1)
        )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads={self.num_kv_heads} must divide num_heads={self.num_heads}")
        check_bool(causal, "causal")
        check_bool(bias, "bias")
        self.position = check_choice(position, "position", POSITION_ENCODINGS)
        self.plug = PLUGS[self.position]
        self.causal = causal
        kv_dim = self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(self.embed_dim, self.embed_dim, bias=bias)
        self.k_proj = nn.Linear(self.embed_dim, kv_dim, bias=bias)
        self.v_proj = nn.Linear(self.embed_dim, kv_dim, bias=bias)
        self.out_proj = nn.Linear(self.embed_dim, self.embed_dim, bias=bias)
        unknown = set(position_options) - self.plug.options
        if unknown:
            raise ValueError(
                f"position={self.position!r} takes options {sorted(self.plug.options)}, got unknown {sorted(unknown)}"
            )
        if not self.plug.needs_table and max_positions is not None:
            raise ValueError(f"max_positions applies to position='learned' only, got it with {self.position!r}")
        self.max_positions = max_positions
        self.encoding = self.plug.build(self, max_positions, position_options)

    def _positions(self, x: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor | None:
        """Validated int64 positions on ``x``'s device (None stays None: ``0 .. seq-1``)."""
        if positions is None:
            if self.plug.needs_table:
                check_int(x.shape[1], "x.shape[1] (the sequence length)", maximum=self.max_positions)
            return None
        limit = self.max_positions if self.plug.needs_table else None
        positions = check_positions(positions, "positions", batch=x.shape[0], seq_len=x.shape[1], limit=limit)
        return positions.to(x.device)

    def _project(
        self, x: torch.Tensor, positions: torch.Tensor | None, rotation: Rotation | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v as ``[batch, heads, seq, d]`` (k, v with ``num_kv_heads`` heads), encodings applied."""
        x = self.plug.embed(self, x, positions)
        q = split_heads(self.q_proj(x), self.num_heads)
        k = split_heads(self.k_proj(x), self.num_kv_heads)
        v = split_heads(self.v_proj(x), self.num_kv_heads)
        q, k = self.plug.rotate(self, q, k, positions, rotation)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def _check_input(self, x: torch.Tensor) -> torch.Tensor:
        x = check_float_tensor(x, "x", ndim=3)
        if x.shape[-1] != self.embed_dim:
            raise ValueError(f"x must have last dimension embed_dim={self.embed_dim}, got shape {tuple(x.shape)}")
        return x

    @staticmethod
    def _arange(x: torch.Tensor) -> torch.Tensor:
        return torch.arange(x.shape[1], device=x.device)

    def _logits(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``q_i . k_j / sqrt(d) + b_ij`` before the mask, or the scores the plug computes itself."""
        if self.plug.computes_logits:
            logits = self.plug.logits(self, q, k, positions)
            assert logits is not None  # a plug that computes logits returns them
            return logits
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)
        bias = self.plug.score_bias(self, q, positions)
        return scores if bias is None else scores + bias

    def scores(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        r"""Pre-softmax scores ``q_i . k_j / sqrt(d) + b_ij`` (masked entries ``-inf``), ``[batch, H, seq, seq]``."""
        x = self._check_input(x)
        positions = self._positions(x, positions)
        q, k, _ = self._project(x, positions)
        k = k.repeat_interleave(self.num_heads // self.num_kv_heads, dim=1)
        scores = self._logits(q, k, self._arange(x) if positions is None else positions)
        if self.causal:
            scores = scores.masked_fill(causal_mask(x.shape[1], x.device), float("-inf"))
        return scores

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor | None = None, *, rotation: Rotation | None = None
    ) -> torch.Tensor:
        x = self._check_input(x)
        if rotation is not None:
            if self.position != "rope" or positions is not None or not isinstance(rotation, Rotation):
                raise ValueError(
                    "rotation= (a Rotation made by the model's RotaryEmbedding) is for position='rope', without positions"
                )
            positions = None  # the rotation holds them
        else:
            positions = self._positions(x, positions)
        q, k, v = self._project(x, positions, rotation)
        groups = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        if not (self.plug.adds_bias or self.plug.computes_logits):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)  # no bias, no value term
            return self.out_proj(out.transpose(1, 2).flatten(2))
        positions = self._arange(x) if positions is None else positions
        if self.plug.computes_logits:
            logits = self._logits(q, k, positions)
            if self.causal:
                logits = logits.masked_fill(causal_mask(x.shape[1], x.device), float("-inf"))
            weights = logits.softmax(-1)
            term = self.plug.value_term(self, weights, positions)
            out = weights @ v if term is None else weights @ v + term
            return self.out_proj(out.transpose(1, 2).flatten(2))
        bias = self.plug.score_bias(self, q, positions)
        if bias is not None and self.causal:
            bias = bias.masked_fill(causal_mask(x.shape[1], x.device), float("-inf"))
        if not self.plug.adds_values:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, is_causal=self.causal and bias is None)
        else:
            assert bias is not None  # every plug that adds values adds a bias
            weights = (q @ k.transpose(-1, -2) / math.sqrt(self.head_dim) + bias).softmax(-1)
            term = self.plug.value_term(self, weights, positions)
            out = weights @ v if term is None else weights @ v + term
        return self.out_proj(out.transpose(1, 2).flatten(2))
