"""RoPE-Mixed in MultiHeadAttention: patches in row-major order on a grid, against the paper's formula.

Heo et al. (2024): pair ``i`` of head ``h`` at patch ``(row, column)`` turns by
``row f^row_{h i} + column f^col_{h i}``. The reference below builds each 2 x 2 rotation in float64 from
that formula and the layer's own weights and frequencies (the model's parameters, not its computation).
"""

from __future__ import annotations

import math

import pytest
import torch

from ropelib import MultiHeadAttention

TIGHT64 = dict(rtol=0.0, atol=1e-12)  # float64 loops against float64 tensors: far below any real slip


def layer(grid_width: int = 4, heads: int = 2, dim: int = 16) -> MultiHeadAttention:
    torch.manual_seed(0)
    attn = MultiHeadAttention(dim, heads, "rope_mixed", grid_width=grid_width).double()
    with torch.no_grad():
        attn.encoding.freqs.normal_()  # frequencies of both axes on every pair: a true mix
    return attn


def scores_ref(attn: MultiHeadAttention, x: torch.Tensor, patches: list[int]) -> torch.Tensor:
    """``q_i . k_j / sqrt(d)`` with each pair of each head rotated by the paper's angle, one token at a time."""
    heads, d = attn.num_heads, attn.head_dim
    q = (x @ attn.q_proj.weight.detach().T).view(len(patches), heads, d)
    k = (x @ attn.k_proj.weight.detach().T).view(len(patches), heads, d)
    freqs = attn.encoding.freqs.detach().double()
    width = attn.encoding.grid_width
    out = torch.empty(heads, len(patches), len(patches), dtype=torch.float64)

    def turned(v: torch.Tensor, h: int, p: int) -> torch.Tensor:
        row, col = divmod(p, width)
        w = v.clone()
        for i in range(d // 2):  # the half layout: pair (i, i + d/2)
            phi = row * float(freqs[0, h, i]) + col * float(freqs[1, h, i])
            a, b = float(v[i]), float(v[i + d // 2])
            w[i], w[i + d // 2] = a * math.cos(phi) - b * math.sin(phi), a * math.sin(phi) + b * math.cos(phi)
        return w

    for h in range(heads):
        qs = [turned(q[t, h], h, p) for t, p in enumerate(patches)]
        ks = [turned(k[t, h], h, p) for t, p in enumerate(patches)]
        for i in range(len(patches)):
            for j in range(len(patches)):
                out[h, i, j] = qs[i] @ ks[j] / math.sqrt(d)
    return out


def test_scores_follow_the_papers_formula_on_the_grid() -> None:
    attn = layer()
    x = torch.randn(1, 6, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    patches = [0, 1, 5, 6, 9, 14]
    got = attn.scores(x, torch.tensor(patches))[0]
    assert torch.allclose(got, scores_ref(attn, x[0], patches), **TIGHT64)


def test_scores_depend_on_the_offset_between_patches_only() -> None:
    # The relative property on the grid: moving every patch by whole rows, or by columns within the grid,
    # leaves the scores unchanged; a move that wraps a row does not.
    attn = layer(grid_width=8)
    x = torch.randn(1, 5, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    base = torch.tensor([0, 1, 2, 9, 10])  # rows 0-1, columns 0-2
    at = attn.scores(x, base)
    assert torch.allclose(attn.scores(x, base + 3 * 8), at, **TIGHT64)  # three rows down
    assert torch.allclose(attn.scores(x, base + 5), at, **TIGHT64)  # five columns right, no wrap
    assert (attn.scores(x, base + 6) - at).abs().max() > 1e-3  # columns 6-8: the last one wraps to the next row


def test_a_shared_key_head_is_refused() -> None:
    with pytest.raises(ValueError, match="num_kv_heads == num_heads"):
        MultiHeadAttention(16, 4, "rope_mixed", num_kv_heads=2)
    with pytest.raises(ValueError, match="grid_width"):
        MultiHeadAttention(16, 2, "rope_mixed", grid_width=0)
