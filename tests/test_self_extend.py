"""Self-Extend (:mod:`ropelib.rotary.self_extend`) against Jin et al.'s (2024) definition, written here."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from remap_helpers import KERNELS, OFFSET_POSITIONS, pairs_closer_than, plain_scores, qk

from ropelib import MultiHeadAttention, RotaryEmbedding
from ropelib.rotary.self_extend import SelfExtend, self_extend_relative, self_extend_scores

from hot_path import graph_breaks
from references import remapped_scores_ref


def self_extend_ref(pi: int, pj: int, window: int, group: int) -> int:
    """Jin et al.: neighbour ``p_i - p_j`` below ``W``, else ``p_i // G - p_j // G + W - W // G``; the future mirrored."""
    if pi < pj:
        return -self_extend_ref(pj, pi, window, group)
    if pi - pj < window:
        return pi - pj
    return pi // group - pj // group + window - window // group


@pytest.mark.parametrize(("window", "group"), [(3, 2), (4, 4), (2, 5)])
@pytest.mark.parametrize("positions", [torch.arange(16), OFFSET_POSITIONS])
def test_relative_map_is_the_papers(window, group, positions):
    got = self_extend_relative(positions, window, group)
    rows = positions.expand(1, -1) if positions.ndim == 1 else positions
    expected = [[[self_extend_ref(int(a), int(b), window, group) for b in row] for a in row] for row in rows]
    assert torch.equal(got, torch.tensor(expected).view_as(got))  # integers: exact


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_scores_are_the_rotations_at_the_remapped_positions(layout):
    q, k = qk()
    rope = RotaryEmbedding(8, theta=100.0, layout=layout)
    got = self_extend_scores(q, k, rope, 3, 2, OFFSET_POSITIONS)
    pos = OFFSET_POSITIONS.tolist()
    expected = remapped_scores_ref(
        q, k, lambda b, i, j: self_extend_ref(pos[b][i], pos[b][j], 3, 2), theta=100.0, layout=layout
    )
    # float64: angles up to ~16 rad formed two ways (table rows vs math.cos per pair), |scores| ~ 3
    assert torch.allclose(got, expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_inside_the_neighbour_window_the_scores_are_ropes_bit_for_bit(kernel, dtype):
    q, k = qk(dtype=dtype)
    rope = RotaryEmbedding(8, kernel=kernel)
    got = self_extend_scores(q, k, rope, 4, 3, OFFSET_POSITIONS)
    plain = plain_scores(rope, q, k, OFFSET_POSITIONS)
    inside = pairs_closer_than(OFFSET_POSITIONS, 4).expand_as(got)
    assert torch.equal(got[inside], plain[inside])  # the same rotation and product: no tolerance
    assert not torch.equal(got[~inside], plain[~inside])


def test_group_1_is_rope_and_causal_keeps_the_past():
    q, k = qk()
    rope = RotaryEmbedding(8)
    # G = 1: r = p_i - p_j everywhere (the grouped piece rotates q to p_i + W - W = p_i)
    assert torch.equal(self_extend_scores(q, k, rope, 2, 1), plain_scores(rope, q, k))
    full, causal = (self_extend_scores(q, k, rope, 3, 2, causal=c) for c in (False, True))
    past = torch.ones(10, 10, dtype=torch.bool).tril().expand_as(full)
    assert torch.equal(causal[past], full[past])
    assert bool((causal[~past] == float("-inf")).all())


@settings(max_examples=25, deadline=None)
@given(train=st.integers(8, 64), window_groups=st.integers(1, 4), group=st.integers(1, 8))
def test_positions_stay_in_training_range_up_to_the_extended_window(train, window_groups, group):
    window = min(window_groups * group, train - 1)  # G divides W, as the paper's settings
    window -= window % group
    if window == 0:
        return
    longest = (train - window) * group + window  # the paper's extended context window
    r = self_extend_relative(torch.arange(longest), window, group)
    assert int(r.max()) <= train - 1  # every relative position one the model was trained at
    assert int(r.max()) == (longest - 1) // group + window - window // group  # the farthest pair's
    beyond = self_extend_relative(torch.arange(longest + group), window, group)
    assert group == 1 or int(beyond.max()) > train - 1  # and a group longer goes past it


def test_gradients():
    q, k = (t.requires_grad_() for t in qk(batch=1, seq=6, heads=1, dim=4))
    rope = RotaryEmbedding(4)
    assert torch.autograd.gradcheck(lambda a, b: self_extend_scores(a, b, rope, 2, 2), (q, k))


def test_no_graph_breaks():
    q, k = qk(batch=1, seq=6, dtype=torch.float32)
    rope = RotaryEmbedding(8, kernel="torch")
    count, reasons = graph_breaks(lambda a, b, p: self_extend_scores(a, b, rope, 2, 2, p), q, k, torch.arange(6))
    assert count == 0, reasons


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(window=0), ValueError, "window"),
        (dict(group=0), ValueError, "group"),
        (dict(group=True), TypeError, "group"),
        (dict(rope=None), TypeError, "rope"),
        (dict(positions=torch.arange(10).view(1, 1, 10)), ValueError, "positions"),
    ],
)
def test_door(kwargs, error, match):
    q, k = qk()
    args = {**dict(q=q, k=k, rope=RotaryEmbedding(8), window=2, group=2), **kwargs}
    with pytest.raises(error, match=match):
        self_extend_scores(**args)
    with pytest.raises(ValueError, match="group"):
        SelfExtend(8, 4, -1)


@pytest.mark.parametrize("causal", [True, False])
def test_layer_matches_the_rope_layer_inside_the_window(causal):
    torch.manual_seed(0)
    layer = MultiHeadAttention(32, 2, "self_extend", causal=causal, window=5, group=3)
    rope = MultiHeadAttention(32, 2, "rope", causal=causal)
    rope.load_state_dict(layer.state_dict())
    x = torch.randn(2, 30, 32)
    inside = pairs_closer_than(torch.arange(30)[None], 5)[0, 0]
    got, plain = layer.scores(x), rope.scores(x)
    assert torch.equal(got[..., inside], plain[..., inside])
    assert not torch.equal(got[..., ~inside], plain[..., ~inside])
