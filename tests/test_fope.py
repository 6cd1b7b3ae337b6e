"""FoPE (Hua et al., 2024): the Fourier series per pair against a loop over the paper's formula, the clipping
of untrained frequencies, the reduction to RoPE, every kernel, gradients (to q, k and the coefficients),
compile, the plug.

References: a float64 loop over tokens, pairs and frequencies (``z_j(m) = sum_k A^c_kj cos w_k m + i A^s_kj
sin w_k m``, ``w_k = theta^(-2k/d)`` in Python floats); ``references.rotate_ref`` for plain RoPE.
"""

from __future__ import annotations

import math

import pytest
import torch

from ropelib import MultiHeadAttention
from ropelib.kernels import native_build
from ropelib.rotary.fope import FourierPositionEmbedding

from hot_path import graph_breaks
from references import inverse_frequencies_ref, pair_indices, rotate_ref

KERNELS = ["torch", "triton"] + (["native"] if native_build.enabled() else [])


def fope_ref(x: torch.Tensor, positions: list[int], fope: FourierPositionEmbedding, train_length: int | None):
    """Hua et al.: pair j times z_j(m) (a sum over the kept frequencies), or times 1 when w_j < 2 pi / L."""
    d = x.shape[-1]
    freqs = inverse_frequencies_ref(d, fope.theta)
    kept = [k for k, f in enumerate(freqs) if train_length is None or f >= 2 * math.pi / train_length]
    cos_coef, sin_coef = fope.cos_coef.detach().double(), fope.sin_coef.detach().double()
    out = x.double().clone()
    for s, m in enumerate(positions):
        for j, (a, b) in enumerate(pair_indices(d, fope.layout)):
            if j not in kept:
                continue
            re = sum(float(cos_coef[n, j]) * math.cos(m * freqs[k]) for n, k in enumerate(kept))
            im = sum(float(sin_coef[n, j]) * math.sin(m * freqs[k]) for n, k in enumerate(kept))
            xa, xb = x[:, s, :, a].double(), x[:, s, :, b].double()
            out[:, s, :, a], out[:, s, :, b] = xa * re - xb * im, xb * re + xa * im
    return out


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_matches_the_fourier_series_on_every_kernel(kernel: str, layout: str) -> None:
    torch.manual_seed(0)
    fope = FourierPositionEmbedding(16, train_length=100, sigma=0.5, layout=layout, kernel=kernel)
    q, k = torch.randn(2, 5, 3, 16), torch.randn(2, 5, 1, 16)
    positions = [0, 7, 99, 300, 4000]
    got_q, got_k = fope(q, k, torch.tensor(positions))
    # float32 tables (a sum of 3 terms of O(1)) times O(1) inputs: a few float32 ulps
    torch.testing.assert_close(got_q.double(), fope_ref(q, positions, fope, 100), rtol=0.0, atol=1e-5)
    torch.testing.assert_close(got_k.double(), fope_ref(k, positions, fope, 100), rtol=0.0, atol=1e-5)


def test_untrained_frequencies_are_clipped_to_zero() -> None:
    # No frequency below 2 pi / L remains: the kept pairs are exactly those with w >= 2 pi / L, and the
    # clipped pairs are left as they are at every position (cos 0 = 1, sin 0 = 0).
    for train_length in (1, 7, 64, 1000, 10**6):
        fope = FourierPositionEmbedding(16, train_length=train_length)
        freqs = inverse_frequencies_ref(16, 10000.0)
        assert fope.kept == sum(f >= 2 * math.pi / train_length for f in freqs)
        used = fope.frequencies[fope.frequencies > 0]
        assert bool((used >= 2 * math.pi / train_length).all()) and used.numel() == fope.kept
        real, imag = fope.tables(torch.tensor([0, 5, 10**5]))
        assert torch.equal(real[:, fope.kept :], torch.ones_like(real[:, fope.kept :]))
        assert torch.equal(imag[:, fope.kept :], torch.zeros_like(imag[:, fope.kept :]))


@pytest.mark.parametrize("kernel", KERNELS)
def test_zero_extra_coefficients_give_rope(kernel: str) -> None:
    fope = FourierPositionEmbedding(16, sigma=0.0, kernel=kernel).double()
    assert torch.equal(fope.cos_coef, torch.eye(8, dtype=torch.float64))
    q, k = torch.randn(1, 6, 2, 16, dtype=torch.float64), torch.randn(1, 6, 2, 16, dtype=torch.float64)
    positions = torch.tensor([0, 1, 2, 50, 999, 3])
    got_q, got_k = fope(q, k, positions)
    # float64 tables and products: ~1e-15
    torch.testing.assert_close(got_q, rotate_ref(q, positions), rtol=0.0, atol=1e-12)
    torch.testing.assert_close(got_k, rotate_ref(k, positions), rtol=0.0, atol=1e-12)


def test_gradcheck_to_q_k_and_the_coefficients() -> None:
    fope = FourierPositionEmbedding(8, train_length=20, sigma=0.3, learned=True, kernel="torch").double()
    names = ("cos_coef", "sin_coef")
    q = torch.randn(1, 3, 2, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 3, 1, 8, dtype=torch.float64, requires_grad=True)
    coefs = tuple(getattr(fope, n).detach().clone().requires_grad_() for n in names)

    def run(q, k, cos_coef, sin_coef):
        params = dict(zip(names, (cos_coef, sin_coef)))
        return torch.func.functional_call(fope, params, (q, k, torch.tensor([0, 4, 9])))

    assert torch.autograd.gradcheck(run, (q, k, *coefs))
    fixed = FourierPositionEmbedding(8, kernel="torch").double()
    assert torch.autograd.gradcheck(lambda q, k: fixed(q, k), (q, k))
    assert not any(p.requires_grad for p in fixed.parameters()) and len(list(fixed.buffers())) == 2


def test_attention_layer_compiles_to_one_graph() -> None:
    module = MultiHeadAttention(32, 4, "fope", causal=True, num_kv_heads=2, train_length=16)
    x = torch.randn(2, 6, 32)
    breaks, reasons = graph_breaks(module, x, torch.arange(6) + 3)
    assert breaks == 0, reasons
    torch._dynamo.reset()
    compiled = torch.compile(module, fullgraph=True)
    # float32 attention, eager vs Inductor: a few float32 ulps of O(1) values
    torch.testing.assert_close(compiled(x), module(x), rtol=0.0, atol=1e-5)


def test_attention_plug_defaults_and_options() -> None:
    default = MultiHeadAttention(16, 2, "fope").encoding
    assert isinstance(default, FourierPositionEmbedding)
    assert default.train_length is None and default.sigma == 0.3 and not default.learned
    learned = MultiHeadAttention(16, 2, "fope", learned=True, train_length=32).encoding
    assert isinstance(learned, FourierPositionEmbedding) and learned.cos_coef.requires_grad


@pytest.mark.parametrize(
    "kwargs,error,name",
    [
        ({"sigma": -1.0}, ValueError, "sigma"),
        ({"sigma": float("inf")}, ValueError, "sigma"),
        ({"train_length": 0}, ValueError, "train_length"),
        ({"learned": 1}, TypeError, "learned"),
        ({"sigma": True}, TypeError, "sigma"),
        ({"layout": "x"}, ValueError, "layout"),
        ({"theta": -1.0}, ValueError, "theta"),
    ],
)
def test_arguments_are_checked(kwargs: dict, error: type[Exception], name: str) -> None:
    with pytest.raises(error, match=name):
        FourierPositionEmbedding(8, **kwargs)


def test_positions_are_checked() -> None:
    fope = FourierPositionEmbedding(8)
    q = torch.randn(1, 3, 1, 8)
    with pytest.raises(ValueError, match="positions"):
        fope(q, q, torch.tensor([0, 1]))
    with pytest.raises(TypeError, match="positions"):
        fope(q, q, torch.tensor([0.0, 1.0, 2.0]))
    with pytest.raises(ValueError, match="positions"):
        fope(q, q, torch.tensor([0, -1, 2]))
