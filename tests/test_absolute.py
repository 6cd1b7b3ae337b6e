"""Absolute encodings (ropelib.absolute): the sinusoidal table, its shift matrices, learned tables.

Expected values come from the formula of Vaswani et al. (2017, section 3.5), evaluated with
Python's math module in double precision (conftest.sinusoid_ref):

    P[p, 2i] = sin(p / base^(2i/d)),   P[p, 2i+1] = cos(p / base^(2i/d)).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ropelib import (
    LearnedPositionalEmbedding,
    SinusoidalPositionalEncoding,
    sinusoidal_encoding,
    sinusoidal_shift_matrix,
)

from references import EPS, sinusoid_ref


def test_table_matches_formula() -> None:
    table = sinusoidal_encoding(50, 16, dtype=torch.float64)
    assert table.shape == (50, 16) and table.dtype == torch.float64
    # float64 vs float64 of the same formula: a few ulps of angles <= 49 rad, far below 1e-13.
    torch.testing.assert_close(table, sinusoid_ref(list(range(50)), 16), rtol=0.0, atol=1e-13)


def test_table_by_hand() -> None:
    # d = 4, base 10000: frequencies 10000^0 = 1 and 10000^(-2/4) = 0.01.
    # Position 1: (sin 1, cos 1, sin 0.01, cos 0.01).
    row = sinusoidal_encoding(2, 4, dtype=torch.float64)[1]
    expected = [math.sin(1.0), math.cos(1.0), math.sin(0.01), math.cos(0.01)]
    torch.testing.assert_close(row, torch.tensor(expected, dtype=torch.float64), rtol=0.0, atol=1e-15)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_table_rounded_once_to_dtype(dtype: torch.dtype) -> None:
    # Entries lie in [-1, 1]; formed in float64 and rounded once: error <= eps/2 (plus 1e-12 for
    # the float64 reference's own last-bit differences, should an entry sit at a rounding midpoint).
    table = sinusoidal_encoding(1000, 32, dtype=dtype)
    assert table.dtype == dtype
    err = (table.double() - sinusoid_ref(list(range(1000)), 32)).abs().max()
    assert err <= EPS[dtype] / 2 + 1e-12


@settings(max_examples=40, deadline=None)
@given(p=st.integers(0, 10_000), k=st.integers(-10_000, 10_000), half_dim=st.integers(1, 16))
def test_shift_is_a_fixed_linear_map(p: int, k: int, half_dim: int) -> None:
    """P[p + k] = M_k P[p], with M_k independent of p (sin and cos addition formulas)."""
    dim = 2 * half_dim
    M = sinusoidal_shift_matrix(k, dim)
    assert M.shape == (dim, dim) and M.dtype == torch.float64
    # The identity is the addition formula, valid for any real p + k (negative too, so the
    # reference is evaluated there as well). Angles up to 2e4 rad: float64 cos/sin are exact to
    # ~2e4 * 2^-53 ~ 2e-12 each; a row of M has two such entries, so 1e-10 is a safe bound.
    torch.testing.assert_close(M @ sinusoid_ref([p], dim)[0], sinusoid_ref([p + k], dim)[0], rtol=0.0, atol=1e-10)


def test_shift_matrix_by_hand() -> None:
    # d = 2, omega = 1, k = 1: (sin(a+1), cos(a+1)) = [[cos 1, sin 1], [-sin 1, cos 1]] (sin a, cos a).
    c, s = math.cos(1.0), math.sin(1.0)
    expected = torch.tensor([[c, s], [-s, c]], dtype=torch.float64)
    torch.testing.assert_close(sinusoidal_shift_matrix(1, 2), expected, rtol=0.0, atol=1e-15)


def test_shift_matrices_compose_and_are_orthogonal() -> None:
    # M_a M_b = M_{a+b}, M_{-k} = M_k^T = M_k^{-1}: the shifts form a group of rotations.
    a, b = 17, -5
    torch.testing.assert_close(
        sinusoidal_shift_matrix(a, 8) @ sinusoidal_shift_matrix(b, 8),
        sinusoidal_shift_matrix(a + b, 8),
        rtol=0.0,
        atol=1e-14,
    )
    torch.testing.assert_close(sinusoidal_shift_matrix(-a, 8), sinusoidal_shift_matrix(a, 8).T, rtol=0.0, atol=1e-15)


def test_dot_product_depends_on_offset_only() -> None:
    # P[p] . P[q] = sum_i cos((p - q) omega_i): the same for every pair at the same distance.
    table = sinusoidal_encoding(300, 16, dtype=torch.float64)
    for offset in (1, 7, 40):
        dots = (table[:-offset] * table[offset:]).sum(-1)
        expected = sum(math.cos(offset / 10000 ** (2 * i / 16)) for i in range(8))
        torch.testing.assert_close(dots, torch.full_like(dots, expected), rtol=0.0, atol=1e-12)


# ----------------------------------------------------------------------------- modules


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_sinusoidal_module_adds_table(dtype: torch.dtype) -> None:
    module = SinusoidalPositionalEncoding(8, scale=0.5)
    x = torch.randn(2, 5, 8).to(dtype)
    positions = torch.tensor([[0, 1, 2, 3, 4], [10, 11, 12, 13, 400]])
    out = module(x, positions)
    assert out.dtype == dtype
    expected = torch.stack([x[b].double() + 0.5 * sinusoid_ref(positions[b].tolist(), 8) for b in range(2)])
    # float64: exact to 1e-13; lower precisions: the encoding is rounded to dtype (eps/2 * 0.5) and the
    # sum rounded again (eps/2 * |x + P|), so eps * (max|x| + 1) bounds it.
    tol = 1e-13 if dtype == torch.float64 else EPS[dtype] * (float(x.double().abs().max()) + 1.0)
    torch.testing.assert_close(out.double(), expected, rtol=0.0, atol=tol)
    # Default positions are 0..seq-1, shared by the batch.
    torch.testing.assert_close(
        module(x).double()[1], x[1].double() + 0.5 * sinusoid_ref(list(range(5)), 8), rtol=0.0, atol=tol
    )


def test_learned_module_adds_rows() -> None:
    module = LearnedPositionalEmbedding(10, 4).double()
    x = torch.randn(2, 3, 4, dtype=torch.float64)
    positions = torch.tensor([[9, 0, 3], [1, 1, 2]])
    out = module(x, positions)
    for b in range(2):
        for s in range(3):
            assert torch.equal(out[b, s], x[b, s] + module.weight[positions[b, s]])
    assert torch.equal(module(x)[0], x[0] + module.weight[:3])


def test_learned_table_limit_is_hard() -> None:
    module = LearnedPositionalEmbedding(4, 2)
    module(torch.zeros(1, 4, 2))  # exactly the table: fine
    with pytest.raises(ValueError, match="positions must be < 4"):
        module(torch.zeros(1, 1, 2), torch.tensor([4]))
    with pytest.raises(ValueError, match="learned table has only 4"):
        module(torch.zeros(1, 5, 2))


def test_gradcheck_sinusoidal_module() -> None:
    module = SinusoidalPositionalEncoding(6, scale=2.0)
    x = torch.randn(2, 4, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: module(x, torch.tensor([3, 1, 4, 1])), (x,))


def test_gradcheck_learned_module() -> None:
    module = LearnedPositionalEmbedding(8, 6).double()
    x = torch.randn(2, 4, 6, dtype=torch.float64, requires_grad=True)
    positions = torch.tensor([[0, 7, 7, 2], [1, 2, 3, 4]])

    def run(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(module, {"weight": w}, (x, positions))

    w = module.weight.detach().clone().requires_grad_()
    assert torch.autograd.gradcheck(run, (x, w))
