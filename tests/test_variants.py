"""xPos and 2-D axial RoPE against complex-number references written here, and their relative property.

Each pair ``(x_a, x_b)`` of the "half" layout is the complex number ``z = x_a + i x_b`` with
``x_a = x[j]``, ``x_b = x[j + d/2]``; a rotation by ``phi`` is ``z e^{i phi}`` and the dot product of
two rotated vectors is ``sum_j Re(z_q conj(z_k) e^{i (phi_q - phi_k)})``. All float64: tolerance
1e-10 absolute on scores of order 10 (a few hundred ulps of accumulated rounding).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ropelib.rotary.axial import AxialRotaryEmbedding, axial_positions
from ropelib.rotary.xpos import XPos, xpos_decay_rates

ATOL = 1e-10


def as_complex(x: torch.Tensor) -> torch.Tensor:
    """[..., d] half layout -> [..., d/2] complex128."""
    half = x.shape[-1] // 2
    return torch.complex(x[..., :half].double(), x[..., half:].double())


def scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """q, k [1, seq, 1, d] -> [seq, seq] dot products."""
    return q[0, :, 0] @ k[0, :, 0].T


# ----------------------------------------------------------------------------- xPos


def xpos_zeta(j, d, gamma):
    """xPos's decay rate of pair ``j`` of ``d`` features (Sun et al., 2023), written out by hand."""
    return (2 * j / d + gamma) / (1 + gamma)


def xpos_reference_scores(q, k, positions, theta, gamma, base):
    d = q.shape[-1]
    zq, zk = as_complex(q[0, :, 0]), as_complex(k[0, :, 0])
    out = torch.zeros(len(positions), len(positions), dtype=torch.float64)
    for a, m in enumerate(positions):
        for b, n in enumerate(positions):
            total = 0.0
            for j in range(d // 2):
                w = theta ** (-2 * j / d)
                zeta = xpos_zeta(j, d, gamma)
                term = zq[a, j] * zk[b, j].conj() * complex(math.cos((m - n) * w), math.sin((m - n) * w))
                total += zeta ** ((m - n) / base) * term.real.item()
            out[a, b] = total
    return out


def test_xpos_decay_rates_formula():
    rates = xpos_decay_rates(8, gamma=0.4)
    assert rates.tolist() == pytest.approx([(2 * j / 8 + 0.4) / 1.4 for j in range(4)], rel=1e-15)
    assert bool(((rates > 0) & (rates < 1)).all())


def test_xpos_matches_reference_scores():
    torch.manual_seed(0)
    d, theta, gamma, base = 8, 100.0, 0.4, 16.0
    xpos = XPos(d, theta, gamma=gamma, scale_base=base)
    q, k = torch.randn(1, 6, 1, d, dtype=torch.float64), torch.randn(1, 6, 1, d, dtype=torch.float64)
    positions = [0, 3, 4, 9, 20, 41]
    q2, k2 = xpos(q, k, torch.tensor(positions))
    expected = xpos_reference_scores(q, k, positions, theta, gamma, base)
    assert torch.allclose(scores(q2, k2), expected, rtol=0, atol=ATOL)


@settings(max_examples=30, deadline=None)
@given(shift=st.integers(0, 5000), center=st.integers(-100, 6000), seed=st.integers(0, 2**16))
def test_xpos_scores_depend_on_the_offset_only(shift, center, seed):
    g = torch.Generator().manual_seed(seed)
    d = 16
    xpos = XPos(d, scale_base=64.0)
    q, k = (
        torch.randn(1, 5, 1, d, generator=g, dtype=torch.float64),
        torch.randn(1, 5, 1, d, generator=g, dtype=torch.float64),
    )
    positions = torch.tensor([0, 1, 2, 7, 30])
    base_scores = scores(*xpos(q, k, positions))
    shifted = scores(*xpos(q, k, positions + shift, center=center))
    # float64 with factors zeta^(+-(p - c)/B) up to ~e^(1.25 * 94): relative rounding ~1e-16 * product sizes
    assert torch.allclose(shifted, base_scores, rtol=1e-9, atol=ATOL)


def test_xpos_scales_q_up_and_k_down():
    # With the rotation taken out (pair norms), q at p carries zeta^((p - c)/B) and k its inverse.
    d, base = 8, 32.0
    xpos = XPos(d, scale_base=base)
    x = torch.randn(1, 4, 1, d, dtype=torch.float64)
    positions = torch.tensor([10, 20, 30, 40])
    q2, k2 = xpos(x, x, positions, center=0)
    rates = [(2 * j / d + 0.4) / 1.4 for j in range(d // 2)]
    norm = lambda t: as_complex(t[0, :, 0]).abs()  # noqa: E731
    for a, p in enumerate(positions.tolist()):
        expected_q = [norm(x)[a, j].item() * rates[j] ** (p / base) for j in range(d // 2)]
        expected_k = [norm(x)[a, j].item() * rates[j] ** (-p / base) for j in range(d // 2)]
        assert norm(q2)[a].tolist() == pytest.approx(expected_q, rel=1e-12)
        assert norm(k2)[a].tolist() == pytest.approx(expected_k, rel=1e-12)


def test_xpos_decays_with_distance_for_causal_keys():
    # Aligned q and k at every position: the score at offset m - n >= 0 is sum_j zeta_j^((m-n)/B) cos((m-n) w_j) |z_j|^2,
    # bounded by sum_j zeta_j^((m-n)/B) |z_j|^2, which shrinks with the offset.
    d = 16
    xpos = XPos(d, scale_base=8.0)
    x = torch.ones(1, 64, 1, d, dtype=torch.float64)
    q2, k2 = xpos(x, x)
    row = scores(q2, k2)[63, :].flip(0)  # offsets 0, 1, ..., 63
    envelope = torch.tensor(
        [sum(2 * r ** (o / 8.0) for r in xpos_decay_rates(d).tolist()) for o in range(64)], dtype=torch.float64
    )
    assert bool((row.abs() <= envelope + ATOL).all())
    assert envelope[63] < 0.2 * envelope[0]


def test_xpos_float32_long_positions_stay_finite():
    xpos = XPos(64)
    q = torch.randn(1, 128, 2, 64)
    positions = torch.arange(100_000, 100_128)  # uncentred, zeta_0^(1e5/512) ~ 1e-106 would underflow float32
    q2, k2 = xpos(q, q, positions)
    assert bool(torch.isfinite(q2).all() and torch.isfinite(k2).all())


def xpos_reference_vectors(x, positions, center, theta, gamma, base, key=False):
    """Pair ``j`` of ``x`` at ``p`` times ``e^{i p w_j} zeta_j^{+-(p - center)/B}`` in float64 (``-`` for a key)."""
    d = x.shape[-1]
    z = as_complex(x[0, :, 0])
    out = torch.zeros(len(positions), d // 2, dtype=torch.complex128)
    for a, p in enumerate(positions):
        for j in range(d // 2):
            w = theta ** (-2 * j / d)
            factor = xpos_zeta(j, d, gamma) ** ((-1 if key else 1) * (p - center) / base)
            out[a, j] = z[a, j] * complex(math.cos(p * w), math.sin(p * w)) * factor
    return out


REACH_DTYPES = [torch.float16, torch.bfloat16, torch.float32]


@pytest.mark.parametrize("dtype", REACH_DTYPES)
def test_xpos_reach_is_set_by_the_narrower_of_compute_and_output_dtype(dtype):
    xpos = XPos(32)
    zeta_0 = 0.4 / 1.4  # xpos_decay_rates(32)[0] with gamma = 0.4
    expected = math.floor(0.5 * math.log(torch.finfo(dtype).max) / -math.log(zeta_0) * 512.0)
    assert xpos.max_offset(torch.float32, dtype) == expected
    assert xpos.max_offset(dtype, torch.float32) == expected  # the order does not matter
    assert xpos.max_offset(torch.float32, torch.float16) == 2266  # float16: the scale's sqrt-range bound
    assert xpos.max_offset(torch.float64) > xpos.max_offset(torch.float32)


@pytest.mark.parametrize("dtype", REACH_DTYPES)
def test_xpos_is_finite_and_exact_at_its_reach_and_refuses_one_past_it(dtype):
    theta, gamma, base = 10000.0, 0.4, 512.0
    xpos = XPos(32, theta, gamma=gamma, scale_base=base)
    reach = xpos.max_offset(torch.float32, dtype)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 3, 1, 32, generator=gen).to(dtype)
    k = torch.randn(1, 3, 1, 32, generator=gen).to(dtype)
    positions = [0, reach // 2, 2 * reach]  # offsets -reach, .., +reach about the centre
    q2, k2 = xpos(q, k, torch.tensor(positions), center=reach)
    assert q2.dtype == k2.dtype == dtype
    assert bool(torch.isfinite(q2).all() and torch.isfinite(k2).all())
    # against float64 from the rounded inputs; the error measured in units of each pair's scale:
    # the rotation, the scale and the product each round once, so a few ulps of ``dtype``
    scale = torch.tensor(
        [[xpos_zeta(j, 32, gamma) ** ((p - reach) / base) for j in range(16)] for p in positions],
        dtype=torch.float64,
    )
    for got, x, key in ((q2, q, False), (k2, k, True)):
        want = xpos_reference_vectors(x.double(), positions, reach, theta, gamma, base, key=key)
        err = (as_complex(got.double()[0, :, 0]) - want).abs() * (scale if key else 1 / scale)
        assert float(err.max()) < 8 * torch.finfo(dtype).eps
    far = torch.tensor([0, 2 * reach + 1])  # the default centre is reach: the last offset is reach + 1
    with pytest.raises(ValueError, match=rf"positions - center .*<= {reach} .*{str(dtype).split('.')[1]}"):
        xpos(q[:, :2], k[:, :2], far)
    with pytest.raises(ValueError, match="positions - center"):
        xpos(q[:, :2], k[:, :2], torch.tensor([0, 2 * reach]), center=reach + 1)  # -(reach + 1) on the left


def test_xpos_float16_refuses_the_offsets_that_overflowed_it():
    """The float32 guard let float16 outputs reach inf: ones at offsets 5000 and 10000 from the centre 0."""
    xpos = XPos(32)
    ones = torch.ones(1, 2, 1, 32)
    positions = torch.tensor([5000, 10000])
    with pytest.raises(ValueError, match="float16"):
        xpos(ones.half(), ones.half(), positions, center=0)
    q2, k2 = xpos(ones, ones, positions, center=0)  # float32 holds them
    assert bool(torch.isfinite(q2).all() and torch.isfinite(k2).all())


def test_xpos_gradcheck_and_errors():
    xpos = XPos(4, scale_base=4.0)
    q = torch.randn(1, 3, 1, 4, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 3, 1, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: xpos(a, b), (q, k))
    with pytest.raises(TypeError, match="center"):
        xpos(q, k, center=1.5)
    with pytest.raises(ValueError, match="gamma"):
        XPos(4, gamma=-1.0)
    with pytest.raises(ValueError, match="layout"):
        XPos(4, layout="complex")


# ----------------------------------------------------------------------------- axial 2-D RoPE


def axial_reference_scores(q, k, pos, theta):
    d = q.shape[-1]
    zq, zk = as_complex(q[0, :, 0]), as_complex(k[0, :, 0])
    quarter = d // 4
    out = torch.zeros(len(pos), len(pos), dtype=torch.float64)
    for a, (rm, cm) in enumerate(pos):
        for b, (rn, cn) in enumerate(pos):
            total = 0.0
            for j in range(d // 2):
                t = j % quarter
                w = theta ** (-t / quarter)
                delta = (rm - rn) if j < quarter else (cm - cn)  # first d/4 pairs: rows; last d/4: columns
                total += (zq[a, j] * zk[b, j].conj() * complex(math.cos(delta * w), math.sin(delta * w))).real.item()
            out[a, b] = total
    return out


def test_axial_positions_grid():
    assert axial_positions(3, 2).tolist() == [[0, 0], [0, 1], [1, 0], [1, 1], [2, 0], [2, 1]]


def test_axial_matches_reference_scores():
    torch.manual_seed(1)
    d, theta = 8, 100.0
    rope2d = AxialRotaryEmbedding(d, theta)
    pos = axial_positions(2, 3)
    q, k = torch.randn(1, 6, 1, d, dtype=torch.float64), torch.randn(1, 6, 1, d, dtype=torch.float64)
    q2, k2 = rope2d(q, k, pos)
    assert torch.allclose(scores(q2, k2), axial_reference_scores(q, k, pos.tolist(), theta), rtol=0, atol=ATOL)


@settings(max_examples=30, deadline=None)
@given(
    dr=st.integers(0, 500),
    dc=st.integers(0, 500),
    seed=st.integers(0, 2**16),
    layout=st.sampled_from(["half", "interleaved"]),
)
def test_axial_scores_depend_on_the_2d_offset_only(dr, dc, seed, layout):
    g = torch.Generator().manual_seed(seed)
    rope2d = AxialRotaryEmbedding(16, layout=layout)
    q, k = (
        torch.randn(1, 12, 1, 16, generator=g, dtype=torch.float64),
        torch.randn(1, 12, 1, 16, generator=g, dtype=torch.float64),
    )
    pos = axial_positions(3, 4)
    base_scores = scores(*rope2d(q, k, pos))
    shifted = scores(*rope2d(q, k, pos + torch.tensor([dr, dc])))
    assert torch.allclose(shifted, base_scores, rtol=0, atol=ATOL)


def test_axial_axes_are_separate():
    # Moving along a row (column offset only) leaves the row pairs' contribution at its unrotated value.
    d = 8
    rope2d = AxialRotaryEmbedding(d)
    q, k = torch.randn(1, 2, 1, d, dtype=torch.float64), torch.randn(1, 2, 1, d, dtype=torch.float64)
    q2, k2 = rope2d(q, k, torch.tensor([[5, 0], [5, 3]]))
    zq, zk = as_complex(q2[0, :, 0]), as_complex(k2[0, :, 0])
    zq0, zk0 = as_complex(q[0, :, 0]), as_complex(k[0, :, 0])
    row_part = (zq[0, :2] * zk[1, :2].conj()).real.sum()
    assert row_part.item() == pytest.approx((zq0[0, :2] * zk0[1, :2].conj()).real.sum().item(), abs=ATOL)


def test_axial_batched_positions_and_errors():
    rope2d = AxialRotaryEmbedding(8)
    q = torch.randn(2, 4, 1, 8, dtype=torch.float64)
    batched = torch.stack((axial_positions(2, 2), axial_positions(2, 2) + 1))
    q2, _ = rope2d(q, q, batched)
    q_first, _ = rope2d(q[:1], q[:1], axial_positions(2, 2))
    assert torch.allclose(q2[:1], q_first, rtol=0, atol=1e-15)
    qg = torch.randn(1, 4, 1, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a: rope2d(a, a, axial_positions(2, 2))[0], (qg,))
    with pytest.raises(ValueError, match="multiple of 4"):
        AxialRotaryEmbedding(6)
    with pytest.raises(ValueError, match=r"\[seq, 2\]"):
        rope2d(q, q, torch.arange(4))
    with pytest.raises(ValueError, match=">= 0"):
        rope2d(q, q, axial_positions(2, 2) - 1)
    with pytest.raises(TypeError, match="integer"):
        rope2d(q, q, axial_positions(2, 2).float())
