"""RoPE (ropelib.rotary, ropelib.frequencies) against float64 references built from the formula.

References (conftest.py) build one explicit 2x2 rotation per pair in float64, with
``phi = m * theta^(-2i/r)`` (RoFormer eq. 15), and a block-diagonal ``R_m`` per position.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ropelib import (
    RotaryEmbedding,
    apply_rotary,
    convert_rotary_layout,
    cos_sin_table,
    layout_permutation,
    rope_frequencies,
    rotate_half,
)

from hot_path import graph_breaks, tensor_to_python_calls
from references import EPS, inverse_frequencies_ref, rotate_ref, rotation_matrix_ref

LAYOUT = pytest.mark.parametrize("layout", ["half", "interleaved"])
# float64 vs float64 reference: both evaluate a handful of products and one cos/sin per pair;
# the results agree to a few ulps of float64 (2.2e-16), so 1e-12 leaves a wide margin.
TIGHT64 = dict(rtol=0.0, atol=1e-12)


def randn64(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64)


# ----------------------------------------------------------------------------- the formula


def test_frequencies_match_roformer_formula() -> None:
    # RoFormer eq. 15 with d = 8, theta = 10000: 10000^(-0/8), ^(-2/8), ^(-4/8), ^(-6/8)
    # = 1, 0.1, 0.01, 0.001, rounded once to float32.
    inv_freq, scale = rope_frequencies(8, theta=10000.0)
    assert inv_freq.dtype == torch.float32 and scale == 1.0
    expected = torch.tensor([1.0, 0.1, 0.01, 0.001], dtype=torch.float64).to(torch.float32)
    assert torch.equal(inv_freq, expected)


def test_partial_rotary_frequencies_use_rotated_width() -> None:
    # partial_rotary_factor 0.5 of head_dim 16 rotates r = 8 features: theta^(-2i/8), not theta^(-2i/16).
    inv_freq, _ = rope_frequencies(16, theta=10000.0, partial_rotary_factor=0.5)
    assert torch.equal(inv_freq, torch.tensor(inverse_frequencies_ref(8, 10000.0), dtype=torch.float32))


def test_rotate_half_by_hand() -> None:
    # (x1, x2) -> (-x2, x1) on the halves: [1, 2, 3, 4] -> [-3, -4, 1, 2].
    assert rotate_half(torch.tensor([1.0, 2.0, 3.0, 4.0])).tolist() == [-3.0, -4.0, 1.0, 2.0]


def test_single_pair_by_hand() -> None:
    # d = 2, one pair, inv_freq = 1: position 1 turns (1, 0) by 1 rad to (cos 1, sin 1),
    # and position 2 turns (0, 1) to (-sin 2, cos 2).
    rope = RotaryEmbedding(2)
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=torch.float64).reshape(1, 2, 1, 2)
    q, _ = rope(x, x, torch.tensor([1, 2]))
    expected = torch.tensor([[math.cos(1), math.sin(1)], [-math.sin(2), math.cos(2)]], dtype=torch.float64)
    torch.testing.assert_close(q.reshape(2, 2), expected, **TIGHT64)


def test_position_zero_is_identity() -> None:
    x = randn64(2, 3, 2, 8)
    q, k = RotaryEmbedding(8)(x, x, torch.zeros(3, dtype=torch.long))
    assert torch.equal(q, x) and torch.equal(k, x)


@LAYOUT
@pytest.mark.parametrize("rotary_dim", [None, 4])
def test_module_matches_explicit_rotation_matrices(layout: str, rotary_dim: int | None) -> None:
    q, k = randn64(2, 5, 3, 8), randn64(2, 5, 1, 8)
    positions = torch.tensor([0, 1, 7, 100, 4096])
    rope = RotaryEmbedding(8, theta=500.0, layout=layout, rotary_dim=rotary_dim)
    q2, k2 = rope(q, k, positions)
    kw = dict(theta=500.0, layout=layout, rotary_dim=rotary_dim)
    torch.testing.assert_close(q2, rotate_ref(q, positions, **kw), **TIGHT64)
    torch.testing.assert_close(k2, rotate_ref(k, positions, **kw), **TIGHT64)


@LAYOUT
def test_apply_rotary_matches_explicit_rotation_matrices(layout: str) -> None:
    x = randn64(1, 4, 2, 6)
    positions = torch.tensor([3, 0, 9, 2])
    inv_freq = torch.tensor(inverse_frequencies_ref(6, 10000.0), dtype=torch.float64)
    cos, sin = cos_sin_table(inv_freq, positions, dtype=torch.float64)
    out = apply_rotary(x, cos, sin, layout=layout)
    torch.testing.assert_close(out, rotate_ref(x, positions, layout=layout), **TIGHT64)


def test_cos_sin_table_angles_are_formed_in_float64() -> None:
    # At p = 2^20 + 1 a float32 product p * inv_freq is off by up to p * 2^-24 ~ 0.06 rad;
    # ropelib multiplies in float64, so after rounding cos/sin to float32 the error is within
    # one float32 rounding (2^-24) of the exact value plus the float64 angle error (~p * 2^-53).
    p = 2**20 + 1
    inv_freq = torch.tensor(inverse_frequencies_ref(64, 10000.0), dtype=torch.float64)
    cos, sin = cos_sin_table(inv_freq, torch.tensor([p]))
    assert cos.dtype == torch.float32
    exact_cos = torch.tensor([math.cos(p * f) for f in inverse_frequencies_ref(64, 10000.0)], dtype=torch.float64)
    exact_sin = torch.tensor([math.sin(p * f) for f in inverse_frequencies_ref(64, 10000.0)], dtype=torch.float64)
    tol = EPS[torch.float32] + 1e-9
    assert (cos[0].double() - exact_cos).abs().max() <= tol
    assert (sin[0].double() - exact_sin).abs().max() <= tol


# ----------------------------------------------------------------------------- what the book leans on


@settings(max_examples=40, deadline=None)
@given(
    m=st.integers(0, 5000),
    n=st.integers(0, 5000),
    shift=st.integers(-5000, 5000),
    layout=st.sampled_from(["half", "interleaved"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_relative_property(m: int, n: int, shift: int, layout: str, seed: int) -> None:
    """<R_m q, R_n k> = <R_{m+s} q, R_{n+s} k> = q^T R_{n-m} k: the score sees only n - m."""
    shift = max(shift, -min(m, n))  # positions stay >= 0
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 1, 1, 16, dtype=torch.float64, generator=g)
    k = torch.randn(1, 1, 1, 16, dtype=torch.float64, generator=g)
    rope = RotaryEmbedding(16, layout=layout)

    def score(pq: int, pk: int) -> torch.Tensor:
        rq, _ = rope(q, q, torch.tensor([pq]))
        rk, _ = rope(k, k, torch.tensor([pk]))
        return (rq * rk).sum()

    # q^T R_{n-m} k from the reference matrix: R_m^T R_n = R_{n-m} for block rotations.
    relative = q.flatten() @ rotation_matrix_ref(n - m, 16, layout=layout) @ k.flatten()
    # Angles up to 10^4 rad: cos/sin of a float64 angle of that size are exact to ~1e4 * 2^-53
    # ~ 1e-12 each; |q| |k| ~ 16, so 1e-9 is a safe bound on the accumulated difference.
    torch.testing.assert_close(score(m, n), relative, rtol=0.0, atol=1e-9)
    torch.testing.assert_close(score(m + shift, n + shift), relative, rtol=0.0, atol=1e-9)


@LAYOUT
def test_rotation_preserves_norms(layout: str) -> None:
    # Each 2x2 block is orthogonal, so every pair's norm (hence the vector's) is unchanged.
    x = randn64(3, 50, 4, 16)
    positions = torch.randint(0, 100_000, (3, 50))
    q, _ = RotaryEmbedding(16, layout=layout)(x, x, positions)
    torch.testing.assert_close(q.norm(dim=-1), x.norm(dim=-1), rtol=1e-13, atol=0.0)


@pytest.mark.parametrize("rotary_dim", [16, 8])
@pytest.mark.parametrize("bias", [False, True])
def test_layout_conversion_gives_identical_scores(rotary_dim: int, bias: bool) -> None:
    """A q/k projection for "interleaved" RoPE, permuted by convert_rotary_layout, gives the same
    attention scores under "half" RoPE (and back again)."""
    heads, head_dim, embed = 3, 16, 24
    q_proj = torch.nn.Linear(embed, heads * head_dim, bias=bias).double()
    k_proj = torch.nn.Linear(embed, heads * head_dim, bias=bias).double()
    x = randn64(2, 7, embed)
    positions = torch.tensor([0, 1, 2, 3, 50, 51, 900])

    def scores(qp: torch.nn.Linear, kp: torch.nn.Linear, layout: str) -> torch.Tensor:
        rope = RotaryEmbedding(head_dim, layout=layout, rotary_dim=rotary_dim)
        q, k = rope(qp(x).unflatten(-1, (heads, head_dim)), kp(x).unflatten(-1, (heads, head_dim)), positions)
        return torch.einsum("bihd,bjhd->bhij", q, k)

    def converted(proj: torch.nn.Linear, src: str, dst: str) -> torch.nn.Linear:
        new = torch.nn.Linear(embed, heads * head_dim, bias=bias).double()
        kw = dict(src=src, dst=dst, rotary_dim=rotary_dim)
        with torch.no_grad():
            new.weight.copy_(convert_rotary_layout(proj.weight, heads, head_dim, **kw))
            if bias:
                new.bias.copy_(convert_rotary_layout(proj.bias, heads, head_dim, **kw))
        return new

    reference = scores(q_proj, k_proj, "interleaved")
    q_half, k_half = converted(q_proj, "interleaved", "half"), converted(k_proj, "interleaved", "half")
    torch.testing.assert_close(scores(q_half, k_half, "half"), reference, rtol=1e-12, atol=1e-12)
    # The permutation really moves rows (it is not the identity), and converting back restores them.
    assert not torch.equal(q_half.weight, q_proj.weight)
    back = converted(q_half, "half", "interleaved")
    assert torch.equal(back.weight, q_proj.weight)
    # Rows past rotary_dim in each head are left where they were.
    blocks, old = q_half.weight.view(heads, head_dim, embed), q_proj.weight.view(heads, head_dim, embed)
    assert torch.equal(blocks[:, rotary_dim:], old[:, rotary_dim:])


def test_layout_permutation_by_hand() -> None:
    # interleaved pairs (0,1),(2,3),(4,5) must land on half pairs (0,3),(1,4),(2,5):
    # the half layout lists the first members then the second members.
    assert layout_permutation(6, "interleaved", "half").tolist() == [0, 2, 4, 1, 3, 5]
    assert layout_permutation(6, "half", "interleaved").tolist() == [0, 3, 1, 4, 2, 5]
    assert layout_permutation(6, "half", "half").tolist() == [0, 1, 2, 3, 4, 5]


# ----------------------------------------------------------------------------- shapes, dtypes, cache


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@LAYOUT
def test_dtypes_against_float64_reference(dtype: torch.dtype, layout: str) -> None:
    x = torch.randn(2, 9, 2, 16).to(dtype)
    positions = torch.tensor([0, 1, 2, 3, 10, 100, 1000, 5000, 30000])
    q, k = RotaryEmbedding(16, layout=layout)(x, x, positions)
    assert q.dtype == dtype and k.dtype == dtype
    expected = rotate_ref(x, positions, layout=layout)  # x's own (already rounded) values, in float64
    # Error sources: rounding the output to `dtype` (<= eps/2 relative to each entry, |entry| <= the pair's
    # norm <= sqrt(2) max|x|), plus float32 cos/sin and products (a few 2^-24 max|x|, relevant
    # only for float32 itself). Bound: (eps(dtype) + 8 eps32) max|x|.
    scale = x.double().abs().max()
    if dtype == torch.float64:
        tol = 1e-12
    else:
        tol = float((EPS[dtype] + 8 * EPS[torch.float32]) * scale)
    torch.testing.assert_close(q.double(), expected, rtol=0.0, atol=tol)


def test_batched_positions_equal_per_row_rotation() -> None:
    x = randn64(3, 6, 2, 8)
    positions = torch.tensor([[0, 1, 2, 3, 4, 5], [7, 8, 9, 10, 11, 12], [0, 0, 0, 5, 9, 2]])
    q, _ = RotaryEmbedding(8)(x, x, positions)
    for b in range(3):
        torch.testing.assert_close(q[b : b + 1], rotate_ref(x[b : b + 1], positions[b]), **TIGHT64)


@LAYOUT
def test_kv_cache_single_token_equals_row_of_full_sequence(layout: str) -> None:
    # Decoding: the token at position p is rotated alone (seq = 1, positions = [p]) and must
    # equal row p of rotating the whole sequence at once. Same float32 tables, same ops:
    # bit-identical.
    rope = RotaryEmbedding(32, layout=layout)
    q, k = torch.randn(2, 20, 4, 32), torch.randn(2, 20, 2, 32)
    full_q, full_k = rope(q, k)
    fresh = RotaryEmbedding(32, layout=layout)  # its cache grows as decoding proceeds
    for p in range(20):
        step_q, step_k = fresh(q[:, p : p + 1], k[:, p : p + 1], torch.tensor([p]))
        assert torch.equal(step_q, full_q[:, p : p + 1]) and torch.equal(step_k, full_k[:, p : p + 1])


def test_left_padded_batch() -> None:
    # Row 1 has 3 pad tokens on the left; its real tokens take positions 0..4, as they would alone.
    rope = RotaryEmbedding(8)
    x = torch.randn(2, 8, 2, 8)
    positions = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7], [0, 0, 0, 0, 1, 2, 3, 4]])
    q, _ = rope(x, x, positions)
    alone, _ = rope(x[1:, 3:], x[1:, 3:])
    assert torch.equal(q[1:, 3:], alone)
    unpadded, _ = rope(x[:1], x[:1])
    assert torch.equal(q[:1], unpadded)


def test_cache_grows_on_demand() -> None:
    rope = RotaryEmbedding(8)
    x = randn64(1, 1, 1, 8).float()
    rope(x, x, torch.tensor([3]))
    small = rope.cache.tables(torch.device("cpu"), torch.float32).length
    assert small >= 4
    p = 10 * small + 7  # far beyond the current cache
    q, _ = rope(x, x, torch.tensor([p]))
    assert rope.cache.tables(torch.device("cpu"), torch.float32).length > p
    # Tolerance as in test_dtypes_against_float64_reference for float32.
    tol = float(9 * EPS[torch.float32] * x.abs().max())
    torch.testing.assert_close(q.double(), rotate_ref(x, torch.tensor([p])), rtol=0.0, atol=tol)
    cos, sin = rope.cos_sin_cache(p + 1)
    exact = torch.tensor([[math.cos(p * f), math.sin(p * f)] for f in inverse_frequencies_ref(8, 10000.0)])
    torch.testing.assert_close(cos[p].double(), exact[:, 0].double(), rtol=0.0, atol=EPS[torch.float32])
    torch.testing.assert_close(sin[p].double(), exact[:, 1].double(), rtol=0.0, atol=EPS[torch.float32])


def test_gqa_head_counts_may_differ() -> None:
    q, k = randn64(2, 5, 8, 16), randn64(2, 5, 2, 16)
    q2, k2 = RotaryEmbedding(16)(q, k)
    assert q2.shape == q.shape and k2.shape == k.shape
    positions = torch.arange(5)
    torch.testing.assert_close(q2, rotate_ref(q, positions), **TIGHT64)
    torch.testing.assert_close(k2, rotate_ref(k, positions), **TIGHT64)


@LAYOUT
def test_partial_rotary_leaves_tail_unchanged(layout: str) -> None:
    x = torch.randn(2, 6, 3, 16)
    for dtype in (torch.float16, torch.float32, torch.float64):
        xd = x.to(dtype)
        q, _ = RotaryEmbedding(16, layout=layout, rotary_dim=6)(xd, xd, torch.arange(100, 106))
        assert torch.equal(q[..., 6:], xd[..., 6:])  # bit for bit: not even a dtype round trip
        assert not torch.equal(q[..., :6], xd[..., :6])


# ----------------------------------------------------------------------------- autograd


@LAYOUT
@pytest.mark.parametrize("pairs", [4, 2])  # full rotary (r = 8 = head_dim) and partial (r = 4)
def test_gradcheck_apply_rotary(layout: str, pairs: int) -> None:
    x = randn64(2, 3, 2, 8).requires_grad_()
    angles = randn64(3, pairs) * 3
    cos, sin = angles.cos().requires_grad_(), angles.sin().requires_grad_()
    assert torch.autograd.gradcheck(lambda x, c, s: apply_rotary(x, c, s, layout=layout), (x, cos, sin))


@LAYOUT
def test_gradcheck_rotary_embedding(layout: str) -> None:
    rope = RotaryEmbedding(8, layout=layout, rotary_dim=6)
    q, k = randn64(2, 4, 2, 8).requires_grad_(), randn64(2, 4, 1, 8).requires_grad_()
    positions = torch.tensor([[0, 5, 9, 20], [3, 3, 4, 1000]])
    assert torch.autograd.gradcheck(lambda q, k: rope(q, k, positions), (q, k))


def test_module_built_under_meta_device_works_on_real_tensors() -> None:
    # Frequencies are plain CPU attributes, built on the CPU even under torch.device("meta"), so a module
    # built there (as large models are) rotates real tensors once they arrive; reset_parameters rebuilds.
    with torch.device("meta"):
        rope = RotaryEmbedding(8, scaling={"rope_type": "linear", "factor": 2.0})
    expected = [f / 2 for f in inverse_frequencies_ref(8, 10000.0)]
    assert rope.inv_freq.tolist() == pytest.approx(expected, rel=1e-7)
    rope.reset_parameters()
    q = torch.randn(1, 3, 2, 8)
    # linear scaling: position m turns as position m / 2 would (the matrices take fractional positions)
    want = torch.stack([q[0, s].double() @ rotation_matrix_ref(s / 2, 8).T for s in range(3)])[None]
    torch.testing.assert_close(rope(q, q)[0].double(), want, rtol=0.0, atol=1e-6)


def test_far_positions_cost_rows_not_a_table() -> None:
    # One token at 2^31 used to build a float32 table for every position from 0 (17 GB).
    rope = RotaryEmbedding(8)
    q = torch.randn(1, 1, 1, 8)
    out, _ = rope(q, q, torch.tensor([2**31]))
    assert rope.cache.tables(torch.device("cpu"), torch.float32).length <= rope.cache.limit
    assert rope.cache.nbytes() < 1 << 20  # the far row is computed, not tabled with all those before it
    torch.testing.assert_close(out.double(), rotate_ref(q, torch.tensor([2**31])), rtol=0.0, atol=1e-5)


# ----------------------------------------------------------------------------- the hot path: no host reads, whole graphs


@pytest.mark.parametrize("positions", [torch.arange(5) + 7, torch.arange(10).view(2, 5) * 3, torch.arange(5)[None]])
@LAYOUT
def test_compiles_to_one_graph_with_explicit_positions(positions: torch.Tensor, layout: str) -> None:
    rope = RotaryEmbedding(16, layout=layout)
    q, k = torch.randn(2, 5, 4, 16), torch.randn(2, 5, 2, 16)
    breaks, reasons = graph_breaks(lambda q, k, p: rope(q, k, p), q, k, positions)
    assert breaks == 0, reasons
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, p: rope(q, k, p), fullgraph=True)
    for got, want, x in zip(compiled(q, k, positions), rope(q, k, positions), (q, k)):
        # eager and compiled use the same float64 angles; the float32 products may be fused differently
        torch.testing.assert_close(got, want, rtol=0.0, atol=8 * EPS[torch.float32] * x.abs().max().item())
        ref = rotate_ref(x, positions.expand(2, 5) if positions.ndim == 2 else positions, layout=layout)
        assert (got.double() - ref).abs().max() <= 8 * EPS[torch.float32] * x.abs().max()


def test_no_tensor_to_python_conversion_off_the_cpu() -> None:
    # On a GPU (here: meta tensors, which have no values and take the same path) a call reads no
    # tensor value on the host: no .item(), int(), bool(). On the CPU, reading positions is free
    # (they are host memory) and ropelib does, to choose its cache: that is the documented exception.
    rope = RotaryEmbedding(16)
    meta = torch.device("meta")
    q, k = torch.randn(2, 5, 4, 16, device=meta), torch.randn(2, 5, 2, 16, device=meta)
    with tensor_to_python_calls() as calls:
        rope(q, k, torch.arange(10, device=meta).view(2, 5))
        rope(q, k)
        rope(q.double(), k.double(), torch.arange(5, device=meta))
    assert calls == []
