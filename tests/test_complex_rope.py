"""The seed post's complex-number RoPE API (ropelib.complex_rope).

The reference below is a literal float32 transcription of the seed's two functions
(its indentation was lost in the copy and is restored here). ropelib differs in one
deliberate way: it forms the angles ``m * theta_j`` in float64 and rounds the cosine and sine
once, whereas the seed rounds ``theta_j`` and the product ``m * theta_j`` to float32. The angle
error of the seed is therefore about ``m * theta_j * 2^-24`` rad, which grows with the position;
the tests bound the difference by exactly that.
"""

from __future__ import annotations

import math

import pytest
import torch

from ropelib import RotaryEmbedding, apply_rotary_emb, precompute_pos_cis

from references import EPS, inverse_frequencies_ref, rotate_ref

U32 = 2.0**-24  # unit roundoff of float32 (half its eps)


# ----------------------------------------------------------------------------- the seed's code, in float32


def seed_precompute_pos_cis(dim: int, end: int = int(32 * 1024), theta: float = 1e6) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end, device=freqs.device)
    freqs = torch.outer(t, freqs).float()
    pos_cis = torch.polar(torch.ones_like(freqs), freqs)
    return pos_cis


def seed_apply_rotary_emb(xq: torch.Tensor, xk: torch.Tensor, pos_cis: torch.Tensor):
    def unite_shape(pos_cis, x):
        ndim = x.ndim
        assert 0 <= 1 < ndim
        assert pos_cis.shape == (x.shape[1], x.shape[-1])
        shape = [d if i == 1 or i == ndim - 1 else 1 for i, d in enumerate(x.shape)]
        return pos_cis.view(*shape)

    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    pos_cis = unite_shape(pos_cis, xq_)
    xq_out = torch.view_as_real(xq_ * pos_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * pos_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


# ----------------------------------------------------------------------------- helpers


def seed_angle_bound(dim: int, positions: torch.Tensor) -> torch.Tensor:
    r"""Per-entry bound on ``|pos_cis_seed - pos_cis_ropelib|``, shape ``[len(positions), dim/2]``.

    The seed's float32 ``theta_j``: pow (<= 1 ulp = 2^-23 relative) then a reciprocal (2^-24), so
    <= 3 * 2^-24 relative; the float32 product ``m * theta_j`` adds 2^-24 relative: the angle is off
    by <= 4 m theta_j 2^-24. Both sides round cos and sin to float32 (<= 2^-24 each, the seed's
    float32 cos/sin <= 1 ulp): 4 * 2^-24 absolute covers that.
    """
    freqs = torch.tensor(inverse_frequencies_ref(dim, 1e6), dtype=torch.float64)
    return 4 * U32 * positions.double()[:, None] * freqs + 4 * U32


def pair_norms(x: torch.Tensor) -> torch.Tensor:
    """``|(x[2j], x[2j+1])|`` as ``[..., dim/2]`` in float64."""
    return x.double().unflatten(-1, (-1, 2)).norm(dim=-1)


# ----------------------------------------------------------------------------- precompute_pos_cis


def test_pos_cis_by_hand() -> None:
    # dim 4, theta 100: theta_j = 100^0 = 1 and 100^(-2/4) = 0.1. Row m is (e^{i m}, e^{i 0.1 m}).
    table = precompute_pos_cis(4, end=3, theta=100.0)
    assert table.dtype == torch.complex64 and table.shape == (3, 2)
    expected = torch.tensor([[complex(math.cos(m * f), math.sin(m * f)) for f in (1.0, 0.1)] for m in range(3)])
    # cos and sin are each rounded once to float32: <= 2^-24 per component.
    torch.testing.assert_close(table, expected.to(torch.complex64), rtol=0.0, atol=2 * U32)


def test_pos_cis_is_exact_at_every_position() -> None:
    # ropelib's 32k table is the float32 rounding of the exact e^{i m theta_j}: within sqrt(2) * 2^-24
    # of it at every position (the float64 angle's own error, ~m * 2^-53 <= 4e-12, is negligible).
    dim, end = 64, 32 * 1024
    table = precompute_pos_cis(dim)
    assert table.shape == (end, dim // 2)
    angles = torch.arange(end, dtype=torch.float64)[:, None] * torch.tensor(
        inverse_frequencies_ref(dim, 1e6), dtype=torch.float64
    )
    exact = torch.polar(torch.ones_like(angles), angles)
    assert (table.to(torch.complex128) - exact).abs().max() <= math.sqrt(2) * U32 + 1e-11


def test_pos_cis_small_positions_match_seed_tightly() -> None:
    dim = 128
    positions = torch.arange(16)
    diff = (
        seed_precompute_pos_cis(dim, end=16).to(torch.complex128) - precompute_pos_cis(dim, end=16).to(torch.complex128)
    ).abs()
    bound = seed_angle_bound(dim, positions)
    assert (diff <= bound).all()
    assert bound.max() <= 64 * U32  # i.e. within 4e-6: ulp-level agreement for the first positions


def test_pos_cis_full_table_within_position_bound() -> None:
    dim = 128
    end = 32 * 1024
    diff = (seed_precompute_pos_cis(dim).to(torch.complex128) - precompute_pos_cis(dim).to(torch.complex128)).abs()
    assert (diff <= seed_angle_bound(dim, torch.arange(end))).all()
    # The difference is the seed's float32 angle error: of order position * 2^-24 (up to ~2e-3 rad
    # at 32k), far above float32 rounding of the table itself.
    assert diff.max() > 100 * U32


# ----------------------------------------------------------------------------- apply_rotary_emb


def test_apply_with_seed_table_matches_seed_function() -> None:
    # Same complex64 table on both sides: the only difference is how the complex product is
    # evaluated. Each output component is a*c - b*s with one or two float32 roundings:
    # <= 4 * 2^-24 times the pair's norm.
    table = seed_precompute_pos_cis(64, end=40)
    xq, xk = torch.randn(2, 40, 4, 64), torch.randn(2, 40, 2, 64)
    out_q, out_k = apply_rotary_emb(xq, xk, table)
    ref_q, ref_k = seed_apply_rotary_emb(xq, xk, table)
    for out, ref, x in ((out_q, ref_q, xq), (out_k, ref_k, xk)):
        assert out.dtype == torch.float32 and out.shape == x.shape
        bound = 4 * U32 * pair_norms(x).repeat_interleave(2, dim=-1)
        assert ((out.double() - ref.double()).abs() <= bound).all()


@pytest.mark.parametrize("start, length", [(0, 16), (32 * 1024 - 16, 16)])
def test_apply_matches_seed_code_within_angle_bound(start: int, length: int) -> None:
    dim = 64
    ours, seeds = precompute_pos_cis(dim), seed_precompute_pos_cis(dim)
    xq, xk = torch.randn(1, length, 2, dim), torch.randn(1, length, 1, dim)
    window = slice(start, start + length)
    out_q, _ = apply_rotary_emb(xq, xk, ours[window])
    ref_q, _ = seed_apply_rotary_emb(xq, xk, seeds[window])
    # |(z * a) - (z * b)| = |z| |a - b| per pair, plus the products' own float32 rounding (4 * 2^-24 |z|).
    z = pair_norms(xq)
    bound = z * (seed_angle_bound(dim, torch.arange(start, start + length))[None, :, None, :] + 4 * U32)
    err = (out_q.double() - ref_q.double()).unflatten(-1, (-1, 2)).norm(dim=-1)
    assert (err <= bound).all()


def test_apply_float64_matches_explicit_rotation_matrices() -> None:
    # The seed API is the "interleaved" layout: (x[2j], x[2j+1]) rotated by m theta_j.
    # Input float64 -> complex128 product; the table is complex64 (cos/sin rounded to float32,
    # 2^-24 each), so the error is <= sqrt(2) 2^-24 |pair| + float64 rounding.
    dim = 16
    xq, xk = torch.randn(2, 10, 3, dim, dtype=torch.float64), torch.randn(2, 10, 3, dim, dtype=torch.float64)
    out_q, out_k = apply_rotary_emb(xq, xk, precompute_pos_cis(dim, end=10))
    assert out_q.dtype == torch.float64
    positions = torch.arange(10)
    for out, x in ((out_q, xq), (out_k, xk)):
        ref = rotate_ref(x, positions, theta=1e6, layout="interleaved")
        err = (out - ref).unflatten(-1, (-1, 2)).norm(dim=-1)
        assert (err <= (math.sqrt(2) * U32 + 1e-14) * pair_norms(x)).all()


@pytest.mark.parametrize("start", [0, 1000, 30000])
def test_agrees_with_rotary_embedding_interleaved(start: int) -> None:
    # Same float32 cos/sin (both from float64 angles), same float32 products up to evaluation
    # order: entries agree within 2 float32 roundings of the pair's norm.
    dim, seq = 32, 12
    xq, xk = torch.randn(2, seq, 4, dim), torch.randn(2, seq, 2, dim)
    out_q, out_k = apply_rotary_emb(xq, xk, precompute_pos_cis(dim)[start : start + seq])
    rope = RotaryEmbedding(dim, theta=1e6, layout="interleaved")
    rot_q, rot_k = rope(xq, xk, torch.arange(start, start + seq))
    for a, b, x in ((out_q, rot_q, xq), (out_k, rot_k, xk)):
        bound = 4 * U32 * pair_norms(x).repeat_interleave(2, dim=-1)
        assert ((a.double() - b.double()).abs() <= bound).all()


def test_decoding_step_uses_sliced_table() -> None:
    # The seed slices pos_cis[start : start + seq] for a cache step: rotating token p alone with
    # row p gives row p of the full rotation (identical float32 arithmetic, so bit-identical).
    table = precompute_pos_cis(16, end=64)
    xq, xk = torch.randn(1, 9, 2, 16), torch.randn(1, 9, 1, 16)
    full_q, full_k = apply_rotary_emb(xq, xk, table[:9])
    for p in range(9):
        q, k = apply_rotary_emb(xq[:, p : p + 1], xk[:, p : p + 1], table[p : p + 1])
        assert torch.equal(q, full_q[:, p : p + 1]) and torch.equal(k, full_k[:, p : p + 1])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_output_dtype_follows_input(dtype: torch.dtype) -> None:
    xq = torch.randn(1, 8, 2, 16).to(dtype)
    out_q, out_k = apply_rotary_emb(xq, xq, precompute_pos_cis(16, end=8, theta=10000.0))
    assert out_q.dtype == dtype and out_k.dtype == dtype
    # float64 reference from xq's own values; error: the output rounding to `dtype`
    # (eps/2 of an entry <= |pair|) plus the float32 table/products (a few 2^-24).
    ref = rotate_ref(xq, torch.arange(8), theta=10000.0, layout="interleaved")
    tol = (EPS[dtype] + 8 * U32) * float(xq.double().abs().max()) * math.sqrt(2)
    torch.testing.assert_close(out_q.double(), ref, rtol=0.0, atol=tol)


def test_gradcheck_apply_rotary_emb() -> None:
    table = precompute_pos_cis(8, end=5, theta=10000.0)
    xq = torch.randn(2, 5, 2, 8, dtype=torch.float64, requires_grad=True)
    xk = torch.randn(2, 5, 1, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda q, k: apply_rotary_emb(q, k, table), (xq, xk))
