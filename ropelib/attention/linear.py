r"""Linear attention (Katharopoulos et al., 2020) with RoPE applied to the feature maps (RoFormer, section 3.3).

The cost is linear in the sequence length: the keys and values are summed into a ``d x d_v``
state per head (a running state when causal), which each query reads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .._validation import check_bool, check_float_tensor, check_heads, check_int, check_positions, check_positive_float
from ..rotary import RotaryEmbedding
from .mha import causal_mask, split_heads


def elu_feature_map(x: torch.Tensor) -> torch.Tensor:
    r"""``phi(x) = elu(x) + 1 > 0``, the feature map of Katharopoulos et al. (2020)."""
    return F.elu(check_float_tensor(x, "x")) + 1.0


def _check_linear_qk(q: torch.Tensor, k: torch.Tensor, rope: RotaryEmbedding | None, positions: object) -> None:
    """q and k of equal shapes; positions valid even when there is no rotation to use them."""
    if q.shape != k.shape:
        raise ValueError(f"q and k must have equal shapes, got {tuple(q.shape)} and {tuple(k.shape)}")
    if q.dtype != k.dtype or q.device != k.device:
        raise ValueError(f"q and k must share dtype and device, got {q.dtype}/{q.device} and {k.dtype}/{k.device}")
    if rope is not None and not isinstance(rope, RotaryEmbedding):
        raise TypeError(f"rope must be a RotaryEmbedding or None, got {type(rope).__name__}")
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
        future = causal_mask(q_c.shape[1], q_c.device)
        inner = torch.einsum("bihd,bjhd->bhij", q_c, k_c).masked_fill(future, 0.0)
        numerators.append(torch.einsum("bhij,bjhe->bihe", inner, v_c) + torch.einsum("bihd,bhde->bihe", q_c, state))
        plain = torch.einsum("bihd,bjhd->bhij", fq_c, fk_c).masked_fill(future, 0.0)
        denominators.append(plain.sum(-1).transpose(1, 2) + torch.einsum("bihd,bhd->bih", fq_c, key_sum))
        state = state + torch.einsum("bjhd,bjhe->bhde", k_c, v_c)
        key_sum = key_sum + fk_c.sum(1)
    if not numerators:  # an empty sequence
        return rq.new_zeros(batch, 0, heads, v.shape[-1]), rq.new_zeros(batch, 0, heads)
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
    r"""Linear attention, optionally with RoPE on the feature maps
    (RoFormer eq. 19).

    .. math::

        \text{out}_i = \frac{\sum_j \big(R_i\,\phi(q_i)\big)^\top
                             \big(R_j\,\phi(k_j)\big)\, v_j}
                            {\sum_j \phi(q_i)^\top \phi(k_j)}

    The numerator is computed as ``(R_i phi(q_i))^T S`` with
    ``S = sum_j (R_j phi(k_j)) v_j^T`` (a running sum when causal), so the
    cost is ``O(n d^2)``, linear in the length ``n``. The denominator keeps
    the unrotated features so that it stays positive. The causal form runs
    over chunks of ``chunk_size`` tokens: inside a chunk the masked
    ``C x C`` products, across chunks the running state, so it costs
    ``O(n (C + d) d)`` time and ``O(d^2)`` state per head.

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
    check_bool(causal, "causal")
    eps = check_positive_float(eps, "eps")
    q = check_float_tensor(q, "q", ndim=4)
    k = check_float_tensor(k, "k", ndim=4)
    v = check_float_tensor(v, "v", ndim=4)
    if q.shape != k.shape or v.shape[:3] != q.shape[:3]:
        raise ValueError(
            "q, k must have equal shapes and v the same "
            "[batch, seq, heads]; got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if v.dtype != q.dtype or v.device != q.device:
        got = f"{v.dtype}/{v.device} and {q.dtype}/{q.device}"
        raise ValueError(f"v must share q's dtype and device, got {got}")
    _check_linear_qk(q, k, rope, positions)
    fq, fk = elu_feature_map(q), elu_feature_map(k)
    rq, rk = rope(fq, fk, positions) if rope is not None else (fq, fk)
    if causal:
        sums = _causal_linear_sums(rq, rk, fq, fk, v, chunk_size)
        numerator, denominator = sums
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
    r"""The ``N x N`` matrix that :func:`linear_attention` applies to ``v``, formed explicitly (``O(N^2)``).

    ``W[b, h, i, j] = (R_i phi(q_i))^T (R_j phi(k_j)) / (sum_j phi(q_i)^T phi(k_j) + eps)``; for checks and figures.
    """
    check_bool(causal, "causal")
    eps = check_positive_float(eps, "eps")
    q = check_float_tensor(q, "q", ndim=4)
    k = check_float_tensor(k, "k", ndim=4)
    _check_linear_qk(q, k, rope, positions)
    fq, fk = elu_feature_map(q), elu_feature_map(k)
    rq, rk = rope(fq, fk, positions) if rope is not None else (fq, fk)
    numerator = torch.einsum("bihd,bjhd->bhij", rq, rk)
    plain = torch.einsum("bihd,bjhd->bhij", fq, fk)
    if causal:
        mask = causal_mask(q.shape[1], q.device)
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
        self.embed_dim, self.num_heads, self.head_dim = check_heads(embed_dim, num_heads)
        self.causal = check_bool(causal, "causal")
        self.qkv_proj = nn.Linear(self.embed_dim, 3 * self.embed_dim, bias=bias)
        self.out_proj = nn.Linear(self.embed_dim, self.embed_dim, bias=bias)
        self.rope = RotaryEmbedding(self.head_dim, theta=theta, layout=layout) if rope else None

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        x = check_float_tensor(x, "x", ndim=3)
        if x.shape[-1] != self.embed_dim:
            raise ValueError(f"x must have last dimension embed_dim={self.embed_dim}, got shape {tuple(x.shape)}")
        q, k, v = (split_heads(t, self.num_heads) for t in self.qkv_proj(x).chunk(3, dim=-1))
        out = linear_attention(q, k, v, rope=self.rope, positions=positions, causal=self.causal)
        return self.out_proj(out.flatten(2))
