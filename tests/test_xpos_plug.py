"""``MultiHeadAttention(position="xpos")`` against a float64 reference written here, and its relative property.

The reference follows Sun et al. (2023) step by step, without ropelib's rotary code: pair ``j`` of
a head is the complex number ``z_j``; the query at ``m`` becomes ``z_j e^{i m w_j} zeta_j^{(m-c)/B}``,
the key at ``n`` becomes ``z_j e^{i n w_j} zeta_j^{-(n-c)/B}``, with ``w_j = theta^{-2j/d}`` and
``zeta_j = (2j/d + gamma) / (1 + gamma)``; then softmax attention with the causal mask.
"""

from __future__ import annotations

import math

import pytest
import torch

from ropelib import POSITION_ENCODINGS, MultiHeadAttention
from ropelib.attention.plugs import PLUGS

D_MODEL, HEADS = 16, 2
THETA, GAMMA, BASE = 100.0, 0.4, 8.0  # a short scale base: the decay is far from 1 over the test positions


def pairs(x: torch.Tensor, layout: str) -> torch.Tensor:
    """Real ``[..., d]`` -> complex ``[..., d/2]``: pair ``j`` is ``(x_j, x_{j+d/2})`` (half) or ``(x_2j, x_2j+1)``."""
    d = x.shape[-1]
    if layout == "half":
        return torch.complex(x[..., : d // 2], x[..., d // 2 :])
    return torch.complex(x[..., 0::2], x[..., 1::2])


def unpairs(z: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "half":
        return torch.cat([z.real, z.imag], dim=-1)
    return torch.stack([z.real, z.imag], dim=-1).flatten(-2)


def reference(layer: MultiHeadAttention, x: torch.Tensor, positions: list[int], layout: str, center: float):
    """The layer's output, computed in float64 from its weights: ``[batch, seq, E]``."""
    w = {name: p.detach().double() for name, p in layer.named_parameters()}
    x = x.double()
    batch, seq, _ = x.shape
    d = D_MODEL // HEADS
    q = (x @ w["q_proj.weight"].T).reshape(batch, seq, HEADS, d)
    k = (x @ w["k_proj.weight"].T).reshape(batch, seq, HEADS, d)
    v = (x @ w["v_proj.weight"].T).reshape(batch, seq, HEADS, d)
    freq = torch.tensor([THETA ** (-2 * j / d) for j in range(d // 2)], dtype=torch.float64)
    zeta = torch.tensor([(2 * j / d + GAMMA) / (1 + GAMMA) for j in range(d // 2)], dtype=torch.float64)
    pos = torch.tensor(positions, dtype=torch.float64)[:, None]  # [seq, 1]
    turn = torch.polar(torch.ones_like(pos * freq), pos * freq)[:, None, :]  # e^{i p w_j}, [seq, 1, d/2]
    decay = (zeta ** ((pos - center) / BASE))[:, None, :]
    q_enc = unpairs(pairs(q, layout) * turn * decay, layout)
    k_enc = unpairs(pairs(k, layout) * turn / decay, layout)
    out = torch.zeros(batch, seq, HEADS, d, dtype=torch.float64)
    for b in range(batch):
        for h in range(HEADS):
            for i in range(seq):
                s = [float(q_enc[b, i, h] @ k_enc[b, j, h]) / math.sqrt(d) for j in range(i + 1)]
                p = torch.softmax(torch.tensor(s, dtype=torch.float64), dim=0)
                out[b, i, h] = (p[:, None] * v[b, : i + 1, h]).sum(0)
    return out.reshape(batch, seq, D_MODEL) @ w["out_proj.weight"].T


def layer(layout: str = "half") -> MultiHeadAttention:
    torch.manual_seed(0)
    attn = MultiHeadAttention(
        D_MODEL, HEADS, "xpos", causal=True, theta=THETA, gamma=GAMMA, scale_base=BASE, layout=layout
    )
    return attn.double()


def test_xpos_is_a_registered_position_encoding_after_the_classic_ones():
    assert "xpos" in POSITION_ENCODINGS and PLUGS["xpos"].label == "xPos"
    assert POSITION_ENCODINGS.index("xpos") >= 7  # the chapters read POSITION_ENCODINGS[:7]


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_attention_with_xpos_matches_the_float64_reference(layout):
    attn = layer(layout)
    x = torch.randn(2, 7, D_MODEL, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    positions = [0, 2, 3, 7, 11, 12, 20]
    got = attn(x, torch.tensor(positions))
    # the centre cancels in every score: the reference uses one of its own choosing
    expected = reference(attn, x, positions, layout, center=-5.0)
    assert torch.allclose(got, expected, rtol=0, atol=1e-12)
    default = attn(x)  # positions 0 .. seq-1 by default
    assert torch.allclose(default, reference(attn, x, list(range(7)), layout, center=0.0), rtol=0, atol=1e-12)


def test_the_decay_acts_xpos_is_not_rope():
    attn = layer()
    rope = MultiHeadAttention(D_MODEL, HEADS, "rope", causal=True, theta=THETA).double()
    rope.load_state_dict(attn.state_dict())
    x = torch.randn(1, 9, D_MODEL, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    gap = (attn.scores(x) - rope.scores(x)).nan_to_num(posinf=0.0, neginf=0.0).abs().max()
    assert gap > 1e-2


def test_xpos_scores_depend_on_the_offset_only():
    attn = layer()
    x = torch.randn(3, 6, D_MODEL, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    positions = torch.tensor([[0, 1, 4, 5, 9, 30], [3, 4, 5, 6, 7, 8], [10, 12, 13, 40, 41, 60]])
    base = attn.scores(x, positions)
    for shift in (1, 17, 250):
        assert torch.allclose(attn.scores(x, positions + shift), base, rtol=1e-9, atol=1e-9)
    # and they do depend on the offsets: moving one key changes its scores
    moved = positions.clone()
    moved[:, 0] += 1
    assert not torch.allclose(attn.scores(x, moved), base, rtol=1e-6, atol=1e-6)


def test_xpos_in_float32_and_with_grouped_query_heads_runs_and_matches_float64():
    torch.manual_seed(4)
    attn = MultiHeadAttention(D_MODEL, 4, "xpos", causal=True, num_kv_heads=2)
    x = torch.randn(2, 12, D_MODEL)
    got = attn(x)
    want = attn.double()(x.double())
    assert got.dtype == torch.float32 and torch.allclose(got.double(), want, rtol=0, atol=1e-5)
