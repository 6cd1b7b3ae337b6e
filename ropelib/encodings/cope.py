r"""CoPE (Golovneva et al., 2024): positions counted by gates that the queries and keys decide.

Each query ``i`` gives every key ``t <= i`` a gate ``g_it = sigmoid(q_i . k_t / sqrt(d))`` in
``(0, 1)``: how much token ``t`` counts. The position of key ``j`` seen from query ``i`` is the
count of what lies between them,

.. math::

    p_{ij} = \sum_{t=j}^{i} g_{it} \qquad (j \le i),

a fractional number (``i - j + 1`` when every gate is 1: counting tokens). Its embedding is
interpolated from learned integer ones ``e[0], ..., e[npos - 1]`` through the logits
``z_i[p] = q_i . e[p]``,

.. math::

    b_{ij} = (1 - \phi_{ij})\, z_i[\lfloor p_{ij} \rfloor] + \phi_{ij}\, z_i[\lceil p_{ij} \rceil],
    \qquad \phi_{ij} = p_{ij} - \lfloor p_{ij} \rfloor,

with ``p`` clamped to ``npos - 1`` (at an integer ``p`` the bias is ``z_i[p]``; a weight ``ceil(p) - p``
on the lower term would make it 0 there), and the scores are ``q_i . k_j / sqrt(d) + b_ij``.

Scaling, as in the paper's code: the gates read the scaled logits ``q . k / sqrt(d)`` (the paper's
figure takes the gates of its ``attn_logits`` after the division; its repository divides too); the
bias ``q_i . e[p]`` is added unscaled, as in the paper's figure (the repository's default divides
it by ``sqrt(d)`` as well, the same model with ``e`` scaled by ``1 / sqrt(d)``). The embeddings are
shared by the heads, as in the paper, and start small and random (``N(0, 0.02^2)``; the paper's
code starts at 0, where CoPE is no encoding at all). In a non-causal layer (not in the paper)
ropelib counts the tokens between the two either way: ``p_ij = sum_{t=i}^{j} g_it`` for ``j > i``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .._validation import check_bool, check_float_tensor, check_int


def contextual_positions(gates: torch.Tensor, causal: bool = True) -> torch.Tensor:
    """``p_ij = sum_{t=j}^{i} g_it`` (and ``sum_{t=i}^{j}`` for ``j > i`` unless ``causal``; else 0 there).

    ``gates`` ``[..., queries, keys]`` with as many queries as keys (self-attention); no checks.
    """
    seq = gates.shape[-1]
    upto = torch.ones(seq, seq, dtype=torch.bool, device=gates.device).tril()  # t <= i
    past = gates.masked_fill(~upto, 0.0).flip(-1).cumsum(-1).flip(-1)  # sum over j <= t <= i
    if causal:
        return past
    future = gates.masked_fill(upto, 0.0).cumsum(-1) + gates.diagonal(dim1=-2, dim2=-1).unsqueeze(-1)
    return torch.where(upto, past, future)  # j > i: sum over i <= t <= j


class ContextualPosition(nn.Module):
    r"""CoPE's scores ``q_i . k_j / sqrt(d) + b_ij`` with its contextual position bias.

    Args:
        head_dim: ``d``.
        npos: number of integer position embeddings (positions are clamped to ``npos - 1``; the
            paper uses the training length + 1).

    Shapes:
        ``forward(q, k, causal=True)``: ``q``, ``k`` ``[batch, heads, seq, d]`` -> scores
        ``[batch, heads, seq, seq]`` (before the causal mask) in ``q``'s dtype.
    """

    def __init__(self, head_dim: int, npos: int = 64) -> None:
        super().__init__()
        self.head_dim = check_int(head_dim, "head_dim", minimum=1)
        self.npos = check_int(npos, "npos", minimum=2)
        self.embeddings = nn.Parameter(torch.randn(self.npos, self.head_dim) * 0.02)

    def forward(self, q: torch.Tensor, k: torch.Tensor, causal: bool = True) -> torch.Tensor:
        q = check_float_tensor(q, "q", ndim=4)
        k = check_float_tensor(k, "k", ndim=4)
        if q.shape != k.shape or q.shape[-1] != self.head_dim:
            raise ValueError(
                f"q and k must be [batch, heads, seq, {self.head_dim}] of one shape, got "
                f"{tuple(q.shape)} and {tuple(k.shape)}"
            )
        if q.dtype != k.dtype or q.device != k.device:
            raise ValueError(f"q and k must share dtype and device, got {q.dtype}/{q.device}, {k.dtype}/{k.device}")
        return self.logits(q, k, check_bool(causal, "causal"))

    def logits(self, q: torch.Tensor, k: torch.Tensor, causal: bool) -> torch.Tensor:
        """The module's call without argument checks."""
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)
        positions = contextual_positions(torch.sigmoid(scores), causal)
        return scores + self.bias(q, positions)

    def bias(self, q: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``b_ij``, ``z_i[p_ij]`` interpolated between integer positions; ``positions`` ``[b, h, seq, seq]``."""
        positions = positions.clamp(max=self.npos - 1)
        z = q @ self.embeddings.to(q.dtype).T  # [b, h, seq, npos]
        floor = positions.floor()
        weight = positions - floor  # the gradient flows through here; floor and ceil are steps
        low = z.gather(-1, floor.long())
        high = z.gather(-1, positions.ceil().long())
        return low + weight * (high - low)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, npos={self.npos}"
