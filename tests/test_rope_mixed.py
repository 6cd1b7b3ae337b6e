"""RoPE-Mixed: a float64 loop over tokens, heads and pairs written from the paper's formula, axial RoPE as
its special case (ropelib's AxialRotaryEmbedding as the expected value), the 2-D relative property."""

from __future__ import annotations

import math

import pytest
import torch

from ropelib import AxialRotaryEmbedding, axial_positions
from ropelib.rotary.mixed import MixedRotaryEmbedding, axial_frequencies, mixed_initial_frequencies


def loop_reference(x: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor, layout: str) -> torch.Tensor:
    """Pair i of head h at (r, c) turned by r f^row_hi + c f^col_hi, one scalar at a time (float64)."""
    out = x.double().clone()
    batch, seq, heads, d = x.shape
    for b in range(batch):
        for s in range(seq):
            r, c = (float(v) for v in positions[s])
            for h in range(heads):
                for i in range(d // 2):
                    a, bb = (i, i + d // 2) if layout == "half" else (2 * i, 2 * i + 1)
                    phi = r * float(freqs[0, h, i]) + c * float(freqs[1, h, i])
                    xa, xb = float(x[b, s, h, a]), float(x[b, s, h, bb])
                    out[b, s, h, a] = xa * math.cos(phi) - xb * math.sin(phi)
                    out[b, s, h, bb] = xb * math.cos(phi) + xa * math.sin(phi)
    return out


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_mixed_rotation_equals_the_loop_reference(layout: str) -> None:
    torch.manual_seed(0)
    mixed = MixedRotaryEmbedding(8, 3, layout=layout).double()
    q, k = torch.randn(2, 6, 3, 8, dtype=torch.float64), torch.randn(2, 6, 3, 8, dtype=torch.float64)
    positions = axial_positions(2, 3)
    q2, k2 = mixed(q, k, positions)
    freqs = mixed.freqs.detach()
    # the same float64 angles, cos and sin in the same order: rounding of the two-term sums only
    torch.testing.assert_close(q2, loop_reference(q, positions, freqs, layout), rtol=0, atol=1e-14)
    torch.testing.assert_close(k2, loop_reference(k, positions, freqs, layout), rtol=0, atol=1e-14)


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_axial_rope_is_mixed_rope_with_one_frequency_per_pair(layout: str) -> None:
    freqs = axial_frequencies(8, 2, theta=100.0)
    assert bool(((freqs[0] == 0) | (freqs[1] == 0)).all())  # each pair: one axis only
    mixed = MixedRotaryEmbedding(8, 2, layout=layout).double()
    with torch.no_grad():
        mixed.freqs.copy_(freqs)
    torch.manual_seed(1)
    q, k = torch.randn(2, 12, 2, 8, dtype=torch.float64), torch.randn(2, 12, 2, 8, dtype=torch.float64)
    positions = axial_positions(3, 4)
    expected = AxialRotaryEmbedding(8, theta=100.0, layout=layout)(q, k, positions)
    # axial forms p * f in float64 and takes cos/sin of it, as here: equal up to float64 rounding
    for ours, theirs in zip(mixed(q, k, positions), expected):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-14)


def test_initial_frequencies_follow_the_paper() -> None:
    torch.manual_seed(2)
    freqs = mixed_initial_frequencies(8, 4, theta=10.0)
    norms = freqs.norm(dim=0)  # |(f^row, f^col)| per head and pair: 10^(-t/2), t = 0, 1, twice
    expected = torch.tensor([1.0, 10**-0.5, 1.0, 10**-0.5], dtype=torch.float64).expand(4, -1)
    torch.testing.assert_close(norms, expected, rtol=0, atol=1e-15)
    first, second = freqs[..., 0], freqs[..., 2]  # the two halves point along orthogonal directions
    torch.testing.assert_close((first * second).sum(0), torch.zeros(4, dtype=torch.float64), rtol=0, atol=1e-15)


def test_scores_read_the_2d_offset_only() -> None:
    torch.manual_seed(3)
    mixed = MixedRotaryEmbedding(8, 2).double()
    q, k = torch.randn(1, 12, 2, 8, dtype=torch.float64), torch.randn(1, 12, 2, 8, dtype=torch.float64)
    positions = axial_positions(3, 4)
    scores = torch.einsum("bshd,bthd->bhst", *mixed(q, k, positions))
    moved = torch.einsum("bshd,bthd->bhst", *mixed(q, k, positions + torch.tensor([5, -2])))
    torch.testing.assert_close(moved, scores, rtol=0, atol=1e-12)  # float64 angles of size < 20


def test_gradients_reach_the_frequencies() -> None:
    torch.manual_seed(4)
    mixed = MixedRotaryEmbedding(4, 1).double()
    q = torch.randn(1, 3, 1, 4, dtype=torch.float64, requires_grad=True)
    positions = torch.tensor([[0, 0], [1, 2], [2, 1]])

    def f(q: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(mixed, {"freqs": freqs}, (q, q, positions))[0]

    assert torch.autograd.gradcheck(f, (q, mixed.freqs.detach().clone().requires_grad_()))


def test_compiles_to_one_graph() -> None:
    torch.manual_seed(5)
    mixed = MixedRotaryEmbedding(8, 2)
    q = torch.randn(1, 6, 2, 8)
    positions = axial_positions(2, 3)
    compiled = torch.compile(mixed, fullgraph=True)
    # float32 cos/sin, eager vs Inductor: float32 rounding of O(1) values
    torch.testing.assert_close(compiled(q, q, positions)[0], mixed(q, q, positions)[0], rtol=0, atol=1e-5)


def test_doors_reject_bad_arguments() -> None:
    with pytest.raises(ValueError, match="head_dim"):
        MixedRotaryEmbedding(6, 2)
    with pytest.raises(ValueError, match="num_heads"):
        MixedRotaryEmbedding(8, 0)
    with pytest.raises(ValueError, match="layout"):
        MixedRotaryEmbedding(8, 2, layout="pairs")
    mixed = MixedRotaryEmbedding(8, 2)
    q = torch.randn(1, 6, 2, 8)
    with pytest.raises(ValueError, match="num_heads"):
        mixed(torch.randn(1, 6, 3, 8), torch.randn(1, 6, 3, 8), axial_positions(2, 3))
    with pytest.raises(ValueError, match="positions"):
        mixed(q, q, torch.arange(6))
    with pytest.raises(TypeError, match="positions"):
        mixed(q, q, torch.zeros(6, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="finite"):
        mixed(q, q, torch.full((6, 2), float("inf")))
