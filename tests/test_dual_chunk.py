"""Dual chunk attention (:mod:`ropelib.rotary.dual_chunk`) against An et al.'s (2024) three rules, written here."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from remap_helpers import KERNELS, OFFSET_POSITIONS, pairs_closer_than, plain_scores, qk

from ropelib import MultiHeadAttention, RotaryEmbedding
from ropelib.rotary.dual_chunk import DualChunkAttention, dual_chunk_relative, dual_chunk_scores

from hot_path import graph_breaks
from references import remapped_scores_ref


def dca_ref(pi: int, pj: int, s: int, w: int) -> int:
    """An et al., sec. 3: ``M[i][j] = P_q[i] - P_k[j]`` with ``P_k = p mod s`` and the query's index set chosen by
    ``floor(i/s) - floor(j/s)``: 0 intra (``p mod s``), 1 successive (``[s, .., s + w - 1, c - 1, ..]``), more inter
    (``c - 1``); ``c = s + w``. The future mirrored."""
    if pi < pj:
        return -dca_ref(pj, pi, s, w)
    c = s + w
    behind = pi // s - pj // s
    if behind == 0:
        query = pi % s
    elif behind == 1:
        successive = (list(range(s, s + w)) + [c - 1] * s)[:s]  # the paper's P_q^Succ, one chunk long
        query = successive[pi % s]
    else:
        query = c - 1
    return query - pj % s


def exact_pairs(positions: torch.Tensor, s: int, w: int) -> torch.Tensor:
    """``[batch, 1, seq, seq]``: the same chunk, or closer than both the local window and a chunk (then the key is in
    the chunk before, and the query among its chunk's first ``w``): where DCA keeps ``p_i - p_j``."""
    chunk = positions // s
    return (chunk[:, :, None] == chunk[:, None, :]).unsqueeze(1) | pairs_closer_than(positions, min(s, w))


@pytest.mark.parametrize(("s", "w"), [(6, 4), (3, 1), (4, 0), (2, 5)])
@pytest.mark.parametrize("positions", [torch.arange(20), OFFSET_POSITIONS])
def test_relative_map_is_the_papers(s, w, positions):
    got = dual_chunk_relative(positions, s, w)
    rows = positions.expand(1, -1) if positions.ndim == 1 else positions
    expected = [[[dca_ref(int(a), int(b), s, w) for b in row] for a in row] for row in rows]
    assert torch.equal(got, torch.tensor(expected).view_as(got))  # integers: exact


def test_the_papers_figure():
    # An et al., Fig. 2: s = 6, c = 10, w = 4; the last query row of a 20-token sequence (chunks 0-2 and 18, 19)
    row = dual_chunk_relative(torch.arange(20), 6, 4)[19].tolist()
    assert row == [9, 8, 7, 6, 5, 4] * 2 + [7, 6, 5, 4, 3, 2] + [1, 0]


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_scores_are_the_rotations_at_the_remapped_positions(layout):
    q, k = qk()
    rope = RotaryEmbedding(8, theta=100.0, layout=layout)
    got = dual_chunk_scores(q, k, rope, 3, 2, OFFSET_POSITIONS)
    pos = OFFSET_POSITIONS.tolist()
    expected = remapped_scores_ref(
        q, k, lambda b, i, j: dca_ref(pos[b][i], pos[b][j], 3, 2), theta=100.0, layout=layout
    )
    # float64: angles up to ~5 rad formed two ways (table rows vs math.cos per pair), |scores| ~ 3
    assert torch.allclose(got, expected, rtol=0, atol=1e-12)


@settings(max_examples=25, deadline=None)
@given(length=st.integers(1, 400), s=st.integers(1, 40), w=st.integers(0, 40))
def test_no_relative_position_reaches_the_training_window_at_any_length(length, s, w):
    positions = torch.arange(length)
    r = dual_chunk_relative(positions, s, w)
    past = r[positions[:, None] >= positions[None, :]]
    assert int(past.max()) <= s + w - 1  # c - 1: the defining property
    assert int(past.min()) >= 0
    exact = exact_pairs(positions[None], s, w)[0, 0]
    assert torch.equal(r[exact], (positions[:, None] - positions[None, :])[exact])  # the neighbours keep theirs


@pytest.mark.parametrize("kernel", KERNELS)
def test_within_a_chunk_the_scores_are_ropes(kernel):
    q, k = qk()
    rope = RotaryEmbedding(8, kernel=kernel)
    got = dual_chunk_scores(q, k, rope, 4, 3, OFFSET_POSITIONS)
    plain = plain_scores(rope, q, k, OFFSET_POSITIONS)
    exact = exact_pairs(OFFSET_POSITIONS, 4, 3).expand_as(got)
    # the same relative position from rotations at p mod s instead of p: float64 rounding of angles <= 16 rad
    assert torch.allclose(got[exact], plain[exact], rtol=0, atol=1e-12)
    assert not torch.allclose(got[~exact], plain[~exact], rtol=0, atol=1e-3)
    first = (OFFSET_POSITIONS < 4)[:, None, :, None] & (OFFSET_POSITIONS < 4)[:, None, None, :]
    first = first.expand_as(got)
    q32, k32 = q.float(), k.float()
    got32, plain32 = (
        dual_chunk_scores(q32, k32, rope, 4, 3, OFFSET_POSITIONS),
        plain_scores(rope, q32, k32, OFFSET_POSITIONS),
    )
    assert torch.equal(got32[first], plain32[first])  # the first chunk: the very same rotations, bit for bit


def test_causal_keeps_the_past():
    q, k = qk()
    rope = RotaryEmbedding(8)
    full, causal = (dual_chunk_scores(q, k, rope, 3, 1, causal=c) for c in (False, True))
    past = torch.ones(10, 10, dtype=torch.bool).tril().expand_as(full)
    assert torch.equal(causal[past], full[past])
    assert bool((causal[~past] == float("-inf")).all())


def test_gradients():
    q, k = (t.requires_grad_() for t in qk(batch=1, seq=7, heads=1, dim=4))
    rope = RotaryEmbedding(4)
    assert torch.autograd.gradcheck(lambda a, b: dual_chunk_scores(a, b, rope, 3, 1), (q, k))


def test_no_graph_breaks():
    q, k = qk(batch=1, seq=7, dtype=torch.float32)
    rope = RotaryEmbedding(8, kernel="torch")
    count, reasons = graph_breaks(lambda a, b, p: dual_chunk_scores(a, b, rope, 3, 1, p), q, k, torch.arange(7))
    assert count == 0, reasons


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(chunk_size=0), ValueError, "chunk_size"),
        (dict(local_window=-1), ValueError, "local_window"),
        (dict(local_window=1.0), TypeError, "local_window"),
        (dict(q=torch.zeros(2, 10, 2, 8, dtype=torch.int64)), TypeError, "q"),
    ],
)
def test_door(kwargs, error, match):
    q, k = qk()
    args = {**dict(q=q, k=k, rope=RotaryEmbedding(8), chunk_size=3, local_window=1), **kwargs}
    with pytest.raises(error, match=match):
        dual_chunk_scores(**args)
    with pytest.raises(ValueError, match="chunk_size"):
        DualChunkAttention(8, 0, 1)


def test_layer_keeps_ropes_scores_within_chunks():
    torch.manual_seed(0)
    layer = MultiHeadAttention(32, 2, "dual_chunk", causal=True, chunk_size=8, local_window=4).double()
    rope = MultiHeadAttention(32, 2, "rope", causal=True).double()
    rope.load_state_dict(layer.state_dict())
    x = torch.randn(2, 30, 32, dtype=torch.float64)
    exact = exact_pairs(torch.arange(30)[None], 8, 4)[0, 0]
    got, plain = layer.scores(x), rope.scores(x)
    # float64 rounding of the rotations at p mod s; the future is -inf in both (equal_nan does not apply to inf)
    assert torch.allclose(got[..., exact], plain[..., exact], rtol=0, atol=1e-12)
    assert layer(x).shape == x.shape
