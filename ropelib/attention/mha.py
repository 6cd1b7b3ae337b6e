r"""Attention with a pluggable position encoding, and linear attention with RoPE.

:class:`MultiHeadAttention` applies one of the encodings of this library at the place it
belongs: absolute ones are added to the input, RoPE rotates queries and keys, and relative
biases are added to the scores ``A_ij = q_i . k_j / sqrt(d) + b_ij``. It calls
:func:`torch.nn.functional.scaled_dot_product_attention` whenever the encoding allows it.

:class:`LinearAttention` is the kernelised attention of Katharopoulos et al. (2020) with RoPE
applied to the feature maps as in RoFormer (section 3.3), linear in the sequence length.
"""

from __future__ import annotations

import math
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from ._validation import check_choice, check_float_tensor, check_int, check_positions
from .absolute import LearnedPositionalEmbedding, SinusoidalPositionalEncoding
from .relative import ShawRelativePosition, T5RelativeBias, alibi_bias_from_relative, alibi_slopes
from .rotary import RotaryEmbedding

#: The ``position`` argument of :class:`MultiHeadAttention`. No encoding, the two absolute ones,
#: the three relative biases, or RoPE.
POSITION_ENCODINGS = ("none", "sinusoidal", "learned", "t5", "alibi", "shaw", "rope")


def _split_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """``[batch, seq, heads * d] -> [batch, seq, heads, d]``."""
    return x.unflatten(-1, (heads, -1))


def _relative_from_positions(positions: torch.Tensor) -> torch.Tensor:
    """``positions[..., j] - positions[..., i]``: ``[seq] -> [seq, seq]``, ``[b, seq] -> [b, seq, seq]``."""
    return positions.unsqueeze(-2) - positions.unsqueeze(-1)


def _causal_mask(seq: int, device: torch.device) -> torch.Tensor:
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
            ``layout``, ``rotary_dim``, ``scaling`` and ``backend`` (rope).

    Shapes:
        ``forward(x, positions=None)``: ``x`` is ``[batch, seq, E]``; ``positions`` integers of shape
        ``[seq]`` or ``[batch, seq]`` (default ``0 .. seq-1``). Returns ``[batch, seq, E]``.
    """

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
        self.embed_dim = check_int(embed_dim, "embed_dim", minimum=1)
        self.num_heads = check_int(num_heads, "num_heads", minimum=1)
        if self.embed_dim % self.num_heads:
            raise ValueError(f"num_heads={self.num_heads} must divide embed_dim={self.embed_dim}")
        self.num_kv_heads = (
            self.num_heads if num_kv_heads is None else check_int(num_kv_heads, "num_kv_heads", minimum=1)
        )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads={self.num_kv_heads} must divide num_heads={self.num_heads}")
        if not isinstance(causal, bool):
            raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
        self.position = check_choice(position, "position", POSITION_ENCODINGS)
        self.causal = causal
        self.head_dim = self.embed_dim // self.num_heads
        kv_dim = self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(self.embed_dim, self.embed_dim, bias=bias)
        self.k_proj = nn.Linear(self.embed_dim, kv_dim, bias=bias)
        self.v_proj = nn.Linear(self.embed_dim, kv_dim, bias=bias)
        self.out_proj = nn.Linear(self.embed_dim, self.embed_dim, bias=bias)
        self.encoding = self._build_encoding(max_positions, position_options)

    def _build_encoding(self, max_positions: int | None, options: dict[str, Any]) -> nn.Module | None:
        kind = self.position
        allowed = {
            "none": set(),
            "sinusoidal": {"base"},
            "learned": set(),
            "t5": {"num_buckets", "max_distance"},
            "alibi": set(),
            "shaw": {"max_relative_position", "values"},
            "rope": {"theta", "layout", "rotary_dim", "scaling", "max_position_embeddings", "backend"},
        }[kind]
        unknown = set(options) - allowed
        if unknown:
            raise ValueError(f"position={kind!r} takes options {sorted(allowed)}, got unknown {sorted(unknown)}")
        if kind != "learned" and max_positions is not None:
            raise ValueError(f"max_positions applies to position='learned' only, got it with {kind!r}")
        if kind == "sinusoidal":
            return SinusoidalPositionalEncoding(self.embed_dim, **options)
        if kind == "learned":
            if max_positions is None:
                raise ValueError("position='learned' needs max_positions (the size of the learned table)")
            return LearnedPositionalEmbedding(max_positions, self.embed_dim)
        if kind == "t5":
            return T5RelativeBias(self.num_heads, bidirectional=not self.causal, **options)
        if kind == "alibi":
            # float64 plain attribute, not a buffer: .float()/.half() must not round the slopes.
            self.alibi_slopes = alibi_slopes(self.num_heads)
            return None
        if kind == "shaw":
            return ShawRelativePosition(self.head_dim, **options)
        if kind == "rope":
            return RotaryEmbedding(self.head_dim, **options)
        return None

    def _positions(self, x: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        if positions is None:
            return torch.arange(x.shape[1], device=x.device)
        return check_positions(positions, "positions", batch=x.shape[0], seq_len=x.shape[1]).to(x.device)

    def _project(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v as ``[batch, heads, seq, d]`` (k, v with ``num_kv_heads`` heads), encodings applied."""
        if self.position in ("sinusoidal", "learned"):
            x = cast(nn.Module, self.encoding)(x, positions)
        q = _split_heads(self.q_proj(x), self.num_heads)
        k = _split_heads(self.k_proj(x), self.num_kv_heads)
        v = _split_heads(self.v_proj(x), self.num_kv_heads)
        if self.position == "rope":
            q, k = cast(RotaryEmbedding, self.encoding)(q, k, positions)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def _score_bias(self, q: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """``b_ij`` as ``[batch or 1, heads, seq, seq]`` (or None when the encoding adds no bias)."""
        if self.position not in ("t5", "alibi", "shaw"):
            return None
        rel = _relative_from_positions(positions)
        if self.position == "t5":
            bias = cast(T5RelativeBias, self.encoding)(rel)
        elif self.position == "alibi":
            bias = alibi_bias_from_relative(self.alibi_slopes, rel, dtype=torch.float64)  # rounded once below
        else:
            return cast(ShawRelativePosition, self.encoding).score_bias(q, rel)
        return (bias if bias.ndim == 4 else bias.unsqueeze(0)).to(q.dtype)

    def _check_input(self, x: torch.Tensor) -> torch.Tensor:
        x = check_float_tensor(x, "x", ndim=3)
        if x.shape[-1] != self.embed_dim:
            raise ValueError(f"x must have last dimension embed_dim={self.embed_dim}, got shape {tuple(x.shape)}")
        return x

    def scores(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        r"""Pre-softmax scores ``q_i . k_j / sqrt(d) + b_ij`` (masked entries ``-inf``), ``[batch, H, seq, seq]``."""
        x = self._check_input(x)
        positions = self._positions(x, positions)
        q, k, _ = self._project(x, positions)
        k = k.repeat_interleave(self.num_heads // self.num_kv_heads, dim=1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)
        bias = self._score_bias(q, positions)
        if bias is not None:
            scores = scores + bias
        if self.causal:
            scores = scores.masked_fill(_causal_mask(x.shape[1], x.device), float("-inf"))
        return scores

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        x = self._check_input(x)
        positions = self._positions(x, positions)
        q, k, v = self._project(x, positions)
        groups = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        bias = self._score_bias(q, positions)
        shaw = self.encoding if isinstance(self.encoding, ShawRelativePosition) else None
        if shaw is not None and shaw.value_table is not None and bias is not None:
            scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim) + bias
            if self.causal:
                scores = scores.masked_fill(_causal_mask(x.shape[1], x.device), float("-inf"))
            weights = scores.softmax(-1)
            out = weights @ v + shaw.value_term(weights, _relative_from_positions(positions))
        elif bias is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        else:
            if self.causal:
                bias = bias.masked_fill(_causal_mask(x.shape[1], x.device), float("-inf"))
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return self.out_proj(out.transpose(1, 2).flatten(2))


def elu_feature_map(x: torch.Tensor) -> torch.Tensor:
    r"""``phi(x) = elu(x) + 1 > 0``, the feature map of Katharopoulos et al. (2020)."""
    return F.elu(check_float_tensor(x, "x")) + 1.0


def _check_linear_qk(q: torch.Tensor, k: torch.Tensor, rope: RotaryEmbedding | None, positions: object) -> None:
    """q and k of equal shapes; positions valid even when there is no rotation to use them."""
    if q.shape != k.shape:
        raise ValueError(f"q and k must have equal shapes, got {tuple(q.shape)} and {tuple(k.shape)}")
    if rope is None and positions is not None:
        check_positions(positions, "positions", batch=q.shape[0], seq_len=q.shape[1])


def _causal_linear_sums(
    rq: torch.Tensor, rk: torch.Tensor, fq: torch.Tensor, fk: torch.Tensor, v: torch.Tensor, chunk_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal numerator ``[b, s, h, d_v]`` and denominator ``[b, s, h]`` of linear attention, chunk by chunk."""
    batch, seq, heads, dim = rq.shape
    state = rq.new_zeros(batch, heads, dim, v.shape[-1])  # sum of (R_j phi(k_j)) v_j^T over past chunks
    key_sum = fk.new_zeros(batch, heads, dim)  # sum of phi(k_j) over past chunks
    numerators, denominators = [], []
    for start in range(0, seq, chunk_size):
        chunk = slice(start, min(start + chunk_size, seq))
        q_c, k_c, fq_c, fk_c, v_c = rq[:, chunk], rk[:, chunk], fq[:, chunk], fk[:, chunk], v[:, chunk]
        future = _causal_mask(q_c.shape[1], q_c.device)
        inner = torch.einsum("bihd,bjhd->bhij", q_c, k_c).masked_fill(future, 0.0)
        numerators.append(torch.einsum("bhij,bjhe->bihe", inner, v_c) + torch.einsum("bihd,bhde->bihe", q_c, state))
        plain = torch.einsum("bihd,bjhd->bhij", fq_c, fk_c).masked_fill(future, 0.0)
        denominators.append(plain.sum(-1).transpose(1, 2) + torch.einsum("bihd,bhd->bih", fq_c, key_sum))
        state = state + torch.einsum("bjhd,bjhe->bhde", k_c, v_c)
        key_sum = key_sum + fk_c.sum(1)
    return torch.cat(numerators, 1), torch.cat(denominators, 1)


def linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    rope: RotaryEmbedding | None = None,
    positions: torch.Tensor | None = None,
    causal: bool = False,
    eps: float = 1e-6,
    chunk_size: int = 64,
) -> torch.Tensor:
    r"""Linear attention, optionally with RoPE on the feature maps (RoFormer eq. 19).

    .. math::

        \text{out}_i = \frac{\sum_j \big(R_i\,\phi(q_i)\big)^\top \big(R_j\,\phi(k_j)\big)\, v_j}
                            {\sum_j \phi(q_i)^\top \phi(k_j)}

    The numerator is computed as ``(R_i phi(q_i))^T S`` with ``S = sum_j (R_j phi(k_j)) v_j^T``
    (a running sum when causal), so the cost is ``O(n d^2)``, linear in the length ``n``. The
    denominator keeps the unrotated features so that it stays positive. The causal form runs
    over chunks of ``chunk_size`` tokens: inside a chunk the masked ``C x C`` products, across
    chunks the running state, so it costs ``O(n (C + d) d)`` time and ``O(d^2)`` state per head.

    Args:
        q, k: ``[batch, seq, heads, d]``; v: ``[batch, seq, heads, d_v]``.
        rope: the rotation (None for plain linear attention).
        positions: ``[seq]`` or ``[batch, seq]`` integers for the rotation.
        causal: each query sees keys up to its own position only.
        eps: added to the denominator.
        chunk_size: tokens per chunk of the causal form.

    Returns:
        ``[batch, seq, heads, d_v]``.
    """
    chunk_size = check_int(chunk_size, "chunk_size", minimum=1)
    q = check_float_tensor(q, "q", ndim=4)
    k = check_float_tensor(k, "k", ndim=4)
    v = check_float_tensor(v, "v", ndim=4)
    if q.shape != k.shape or v.shape[:3] != q.shape[:3]:
        raise ValueError(
            f"q, k must have equal shapes and v the same [batch, seq, heads]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    _check_linear_qk(q, k, rope, positions)
    fq, fk = elu_feature_map(q), elu_feature_map(k)
    rq, rk = rope(fq, fk, positions) if rope is not None else (fq, fk)
    if causal:
        numerator, denominator = _causal_linear_sums(rq, rk, fq, fk, v, chunk_size)
    else:
        state = torch.einsum("bshd,bshe->bhde", rk, v)
        numerator = torch.einsum("bshd,bhde->bshe", rq, state)
        denominator = torch.einsum("bshd,bhd->bsh", fq, fk.sum(1))
    return numerator / (denominator.unsqueeze(-1) + eps)


def linear_attention_weights(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    rope: RotaryEmbedding | None = None,
    positions: torch.Tensor | None = None,
    causal: bool = False,
    eps: float = 1e-6,
) -> torch.Tensor:
    r"""The ``n x n`` matrix that :func:`linear_attention` applies to ``v``, formed explicitly (``O(n^2)``).

    ``W[b, h, i, j] = (R_i phi(q_i))^T (R_j phi(k_j)) / (sum_j phi(q_i)^T phi(k_j) + eps)``; for checks and figures.
    """
    q = check_float_tensor(q, "q", ndim=4)
    k = check_float_tensor(k, "k", ndim=4)
    _check_linear_qk(q, k, rope, positions)
    fq, fk = elu_feature_map(q), elu_feature_map(k)
    rq, rk = rope(fq, fk, positions) if rope is not None else (fq, fk)
    numerator = torch.einsum("bihd,bjhd->bhij", rq, rk)
    plain = torch.einsum("bihd,bjhd->bhij", fq, fk)
    if causal:
        mask = _causal_mask(q.shape[1], q.device)
        numerator, plain = numerator.masked_fill(mask, 0.0), plain.masked_fill(mask, 0.0)
    return numerator / (plain.sum(-1, keepdim=True) + eps)


class LinearAttention(nn.Module):
    """Multi-head linear attention (Katharopoulos et al., 2020), with RoPE by default.

    Args:
        embed_dim, num_heads: as in :class:`MultiHeadAttention`.
        rope: rotate the feature maps (RoFormer section 3.3).
        causal: running sums instead of full sums.
        theta, layout: passed to :class:`RotaryEmbedding`.

    Shapes:
        ``forward(x, positions=None)``: ``[batch, seq, E] -> [batch, seq, E]``.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        rope: bool = True,
        causal: bool = False,
        theta: float = 10000.0,
        layout: str = "half",
        bias: bool = False,
    ) -> None:
        super().__init__()
        self.embed_dim = check_int(embed_dim, "embed_dim", minimum=1)
        self.num_heads = check_int(num_heads, "num_heads", minimum=1)
        if self.embed_dim % self.num_heads:
            raise ValueError(f"num_heads={self.num_heads} must divide embed_dim={self.embed_dim}")
        self.causal = causal
        self.head_dim = self.embed_dim // self.num_heads
        self.qkv_proj = nn.Linear(self.embed_dim, 3 * self.embed_dim, bias=bias)
        self.out_proj = nn.Linear(self.embed_dim, self.embed_dim, bias=bias)
        self.rope = RotaryEmbedding(self.head_dim, theta=theta, layout=layout) if rope else None

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        x = check_float_tensor(x, "x", ndim=3)
        if x.shape[-1] != self.embed_dim:
            raise ValueError(f"x must have last dimension embed_dim={self.embed_dim}, got shape {tuple(x.shape)}")
        q, k, v = (_split_heads(t, self.num_heads) for t in self.qkv_proj(x).chunk(3, dim=-1))
        out = linear_attention(q, k, v, rope=self.rope, positions=positions, causal=self.causal)
        return self.out_proj(out.flatten(2))
