"""Resonance RoPE (Wang et al., 2024): the rounded wavelengths from the paper's formula, integer periodicity,
Resonance YaRN, every kernel, gradients, compile, the plug.

References: wavelengths and tables written from the formula in Python floats (``2 pi / round(2 pi / f)``),
YaRN's frequencies from ``references.yarn_ref``; the rotation as complex multiplication in float64.
"""

from __future__ import annotations

import math

import pytest
import torch

from ropelib import MultiHeadAttention
from ropelib.kernels import native_build
from ropelib.rotary.resonance import ResonanceRotaryEmbedding, resonance_frequencies

from hot_path import graph_breaks
from references import inverse_frequencies_ref, yarn_ref

KERNELS = ["torch", "triton"] + (["native"] if native_build.enabled() else [])


def rounded(freqs: list[float]) -> list[float]:
    """Wang et al., Algorithm 1: lambda = 2 pi / f, rounded; f' = 2 pi / round(lambda)."""
    return [2 * math.pi / round(2 * math.pi / f) for f in freqs]


@pytest.mark.parametrize("head_dim,theta", [(8, 10000.0), (16, 500.0), (64, 10000.0)])
def test_frequencies_have_rounded_wavelengths(head_dim: int, theta: float) -> None:
    rope = ResonanceRotaryEmbedding(head_dim, theta)
    want = torch.tensor(rounded(inverse_frequencies_ref(head_dim, theta)), dtype=torch.float64)
    # float64 divisions on both sides: a few ulps
    torch.testing.assert_close(rope.cache.inv_freq, want, rtol=1e-15, atol=0.0)
    assert torch.equal(rope.wavelengths, torch.tensor([round(2 * math.pi / f) for f in want.tolist()]).double())


def test_resonance_yarn_rounds_yarn_and_keeps_its_temperature() -> None:
    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    rope = ResonanceRotaryEmbedding(16, scaling=scaling)
    freqs, mscale = yarn_ref(16, 10000.0, 4.0, 64)
    # yarn_ref in Python floats against ropelib's float64 YaRN: a few ulps before rounding; the wavelengths
    # are far from half-integers, so the rounding agrees
    torch.testing.assert_close(
        rope.cache.inv_freq, torch.tensor(rounded(freqs), dtype=torch.float64), rtol=1e-12, atol=0.0
    )
    assert rope.attention_scaling == pytest.approx(mscale, rel=1e-15)


def test_rotation_is_periodic_with_the_integer_wavelength() -> None:
    # R(m + lambda_i) = R(m) on pair i, for every position m (float64 tables, positions up to 4 * 10^4).
    rope = ResonanceRotaryEmbedding(16, 10000.0)
    for i, wavelength in enumerate(int(w) for w in rope.wavelengths.tolist()):
        m = torch.arange(0, 40000, 997)
        cos_m, sin_m = rope.cos_sin(m, torch.float64)
        cos_p, sin_p = rope.cos_sin(m + wavelength, torch.float64)
        # float64 angles of at most ~1e5 rad: the error of f_i * (m + lambda) is below 1e-10
        torch.testing.assert_close(cos_p[:, i], cos_m[:, i], rtol=0.0, atol=1e-10)
        torch.testing.assert_close(sin_p[:, i], sin_m[:, i], rtol=0.0, atol=1e-10)


def test_angles_past_the_training_length_repeat_angles_inside_it() -> None:
    # Every pre-critical pair (wavelength <= L) shows at positions L .. 4L only angles (mod 2 pi) it saw in 0 .. L-1.
    rope, length = ResonanceRotaryEmbedding(16, 10000.0), 256
    seen = torch.arange(length)
    for i, wavelength in enumerate(rope.wavelengths.tolist()):
        if wavelength > length:
            continue
        beyond = torch.arange(length, 4 * length)
        inside = {(p * 2 * math.pi / wavelength) % (2 * math.pi) for p in range(int(wavelength))}
        assert {(int(p) % int(wavelength)) for p in beyond} <= {int(p) % int(wavelength) for p in seen}
        cos_b = rope.cos_sin(beyond, torch.float64)[0][:, i]
        nearest = torch.tensor([min(abs(math.cos(c) - float(v)) for c in inside) for v in cos_b])
        assert nearest.max() < 1e-9  # float64 angles below 2e3 rad


@pytest.mark.parametrize("kernel", KERNELS)
def test_rotation_matches_the_reference_on_every_kernel(kernel: str) -> None:
    rope = ResonanceRotaryEmbedding(8, 100.0, kernel=kernel)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 4, 2, 8, generator=g), torch.randn(1, 4, 1, 8, generator=g)
    positions = torch.tensor([0, 5, 63, 5000])
    freqs = torch.tensor(rounded(inverse_frequencies_ref(8, 100.0)), dtype=torch.float64)
    turn = torch.polar(torch.ones(4, 4, dtype=torch.float64), positions.double()[:, None] * freqs)  # [seq, pair]
    for x, got in zip((q, k), rope(q, k, positions)):
        z = torch.complex(x[..., :4].double(), x[..., 4:].double()) * turn[None, :, None, :]  # "half" pairs (i, i+4)
        # float32 tables and inputs O(1): a few float32 ulps
        torch.testing.assert_close(got.double(), torch.cat((z.real, z.imag), -1), rtol=0.0, atol=2e-6)


def test_zero_frequencies_stay_zero_and_too_fast_ones_are_refused() -> None:
    freqs = torch.tensor([1.0, 0.0], dtype=torch.float64)
    assert resonance_frequencies(freqs).tolist() == [2 * math.pi / 6, 0.0]
    with pytest.raises(ValueError, match="4 pi"):
        resonance_frequencies(torch.tensor([20.0], dtype=torch.float64))
    with pytest.raises(TypeError, match="inv_freq must be a float64"):
        resonance_frequencies(torch.tensor([1.0]))
    with pytest.raises(ValueError, match="finite"):
        resonance_frequencies(torch.tensor([float("nan")], dtype=torch.float64))


def test_gradcheck_float64() -> None:
    rope = ResonanceRotaryEmbedding(8, kernel="torch")
    q = torch.randn(1, 3, 2, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 3, 1, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda q, k: rope(q, k, torch.tensor([0, 6, 9])), (q, k))


def test_attention_layer_has_no_graph_break_and_takes_a_scaling() -> None:
    scaling = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 16}
    module = MultiHeadAttention(32, 4, "resonance_rope", causal=True, scaling=scaling)
    assert isinstance(module.encoding, ResonanceRotaryEmbedding) and module.encoding.scaling == scaling
    breaks, reasons = graph_breaks(module, torch.randn(2, 6, 32))
    assert breaks == 0, reasons


def test_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="head_dim"):
        ResonanceRotaryEmbedding(7)
    with pytest.raises(TypeError, match="scaling"):
        ResonanceRotaryEmbedding(8, scaling="yarn")  # type: ignore[arg-type]
