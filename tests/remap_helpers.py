"""Shared inputs of the remapping tests (ReRoPE, Self-Extend, dual chunk attention): q/k, RoPE's plain scores."""

from __future__ import annotations

import math

import torch

from ropelib import RotaryEmbedding
from ropelib.kernels import native_build

KERNELS = ["torch", "triton"] + (["native"] if native_build.enabled() else [])
OFFSET_POSITIONS = torch.stack([torch.arange(10), torch.arange(10) + 7])  # two rows, the second shifted


def plain_scores(rope: RotaryEmbedding, q: torch.Tensor, k: torch.Tensor, positions=None) -> torch.Tensor:
    """RoPE's scores as MultiHeadAttention computes them: rotate, then ``q k^T / sqrt(d)``."""
    q2, k2 = rope(q, k, positions)
    return q2.transpose(1, 2) @ k2.transpose(1, 2).transpose(-1, -2) / math.sqrt(q.shape[-1])


def qk(batch=2, seq=10, heads=2, dim=8, dtype=torch.float64, seed=0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(batch, seq, heads, dim, generator=g, dtype=dtype) for _ in range(2))
    return q, k


def pairs_closer_than(positions: torch.Tensor, distance: int) -> torch.Tensor:
    """Bool ``[batch, 1, seq, seq]``: ``|p_i - p_j| < distance``."""
    return ((positions[:, :, None] - positions[:, None, :]).abs() < distance).unsqueeze(1)
