"""Float64 references for attention with a learned score bias (KERPLE, FIRE, CoPE tests), independent of ropelib.

The projections are recomputed from a :class:`ropelib.MultiHeadAttention`'s weights, the
scores and softmax written out; each test supplies the bias (or the whole scores) from its
paper's formula by loops.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch


def softplus_ref(x: float) -> float:
    return math.log1p(math.exp(x))


def sigmoid_ref(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def heads_ref(module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v ``[batch, heads, seq, d]`` in float64 (k, v repeated to the query heads), by matrix products."""
    B, S, _ = x.shape
    H, KV, d = module.num_heads, module.num_kv_heads, module.head_dim
    x = x.double()

    def project(layer: torch.nn.Linear, heads: int) -> torch.Tensor:
        out = x @ layer.weight.detach().double().T
        if layer.bias is not None:
            out = out + layer.bias.detach().double()
        return out.view(B, S, heads, d).transpose(1, 2)

    q, k, v = project(module.q_proj, H), project(module.k_proj, KV), project(module.v_proj, KV)
    index = torch.tensor([h // (H // KV) for h in range(H)])  # query head h reads key/value head h // group
    return q, k[:, index], v[:, index]


def output_ref(
    module, x: torch.Tensor, scores_of: Callable[[int, int, torch.Tensor, torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """The layer's output with ``scores_of(b, h, q_bh, k_bh)`` ``[seq, seq]`` as the pre-softmax scores."""
    q, k, v = heads_ref(module, x)
    B, H, S, d = q.shape
    out = torch.zeros(B, H, S, d, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            scores = scores_of(b, h, q[b, h], k[b, h]).clone()
            for i in range(S):
                for j in range(S):
                    if module.causal and j > i:
                        scores[i, j] = -math.inf
            weights = (scores - scores.max(-1, keepdim=True).values).exp()
            weights = weights / weights.sum(-1, keepdim=True)
            out[b, h] = weights @ v[b, h]
    flat = out.transpose(1, 2).reshape(B, S, H * d)
    result = flat @ module.out_proj.weight.detach().double().T
    return result if module.out_proj.bias is None else result + module.out_proj.bias.detach().double()


def biased_scores(bias_of: Callable[[int, int, int, int], float], seq: int):
    """``scores_of`` for :func:`output_ref`: ``q_i . k_j / sqrt(d) + bias_of(b, h, i, j)``."""

    def scores_of(b: int, h: int, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        bias = torch.tensor([[bias_of(b, h, i, j) for j in range(seq)] for i in range(seq)], dtype=torch.float64)
        return q @ k.T / math.sqrt(q.shape[-1]) + bias

    return scores_of
