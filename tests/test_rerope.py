"""ReRoPE and Leaky ReRoPE (:mod:`ropelib.rotary.rerope`) against Su's (2023) definition, written here."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from remap_helpers import KERNELS, OFFSET_POSITIONS, pairs_closer_than, plain_scores, qk

from ropelib import MultiHeadAttention, RotaryEmbedding
from ropelib.rotary.rerope import ReRoPE, rerope_relative, rerope_scores

from hot_path import graph_breaks
from references import remapped_scores_ref


def rerope_ref(pi: int, pj: int, window: int, k: float | None = None) -> float:
    """Su: ``p_i - p_j`` inside the window, ``w`` (ReRoPE) or ``w + (p_i - p_j - w) / k`` beyond; the future mirrored."""
    d = pi - pj
    if d < 0:
        return -rerope_ref(pj, pi, window, k)
    if d < window:
        return d
    return window if k is None else window + (d - window) / k


@pytest.mark.parametrize("factor", [None, 2.0, 16.0])
@pytest.mark.parametrize("positions", [torch.arange(12), OFFSET_POSITIONS])
def test_relative_map_is_su_formula(factor, positions):
    got = rerope_relative(positions, 3, factor=factor)
    rows = positions.expand(1, -1) if positions.ndim == 1 else positions
    expected = [[[rerope_ref(int(a), int(b), 3, factor) for b in row] for a in row] for row in rows]
    # exact for ReRoPE (integers); Leaky's float64 (p_i - w)/k + w - p_j/k vs w + (d - w)/k: a few ulps of ~10
    assert torch.allclose(got.double(), torch.tensor(expected).view_as(got).double(), rtol=0, atol=1e-13)


@pytest.mark.parametrize("factor", [None, 3.0])
@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_scores_are_the_rotations_at_the_remapped_positions(factor, layout):
    q, k = qk()
    rope = RotaryEmbedding(8, theta=100.0, layout=layout)
    got = rerope_scores(q, k, rope, 3, OFFSET_POSITIONS, factor=factor)
    pos = OFFSET_POSITIONS.tolist()
    expected = remapped_scores_ref(
        q, k, lambda b, i, j: rerope_ref(pos[b][i], pos[b][j], 3, factor), theta=100.0, layout=layout
    )
    # float64: angles up to ~16 rad formed two ways (table rows vs math.cos per pair), |scores| ~ 3
    assert torch.allclose(got, expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("factor", [None, 4.0])
def test_inside_the_window_the_scores_are_ropes_bit_for_bit(kernel, dtype, factor):
    q, k = qk(dtype=dtype)
    rope = RotaryEmbedding(8, kernel=kernel)
    got = rerope_scores(q, k, rope, 4, OFFSET_POSITIONS, factor=factor)
    plain = plain_scores(rope, q, k, OFFSET_POSITIONS)
    inside = pairs_closer_than(OFFSET_POSITIONS, 4).expand_as(got)
    assert torch.equal(got[inside], plain[inside])  # the same rotation and product: no tolerance
    assert not torch.equal(got[~inside], plain[~inside])  # and beyond it the scores are not RoPE's


def test_a_window_past_the_sequence_is_rope_and_k_1_is_rope():
    q, k = qk()
    rope = RotaryEmbedding(8)
    assert torch.equal(rerope_scores(q, k, rope, 10), plain_scores(rope, q, k))  # no pair beyond the window
    # slope 1: r = p_i - p_j everywhere, with the keys rotated to p_j / 1 through computed rows (float64 rounding)
    assert torch.allclose(rerope_scores(q, k, rope, 2, factor=1.0), plain_scores(rope, q, k), rtol=0, atol=1e-12)


@pytest.mark.parametrize("factor", [None, 2.0])
def test_causal_skips_the_future_and_keeps_the_past(factor):
    q, k = qk()
    rope = RotaryEmbedding(8)
    full = rerope_scores(q, k, rope, 3, factor=factor)
    causal = rerope_scores(q, k, rope, 3, factor=factor, causal=True)
    past = torch.ones(10, 10, dtype=torch.bool).tril().expand_as(full)
    assert torch.equal(causal[past], full[past])
    assert bool((causal[~past] == float("-inf")).all())


@settings(max_examples=25, deadline=None)
@given(length=st.integers(1, 600), window=st.integers(1, 64))
def test_rerope_never_asks_for_a_distance_past_the_window(length, window):
    r = rerope_relative(torch.arange(length), window)
    assert int(r.abs().max()) <= window  # at any length: the defining property
    assert int(r.max()) == min(length - 1, window)


@settings(max_examples=25, deadline=None)
@given(window=st.integers(1, 32), extra=st.integers(1, 32), k=st.sampled_from([2.0, 4.0, 16.0]))
def test_leaky_rerope_stays_in_training_range_up_to_its_extended_length(window, extra, k):
    train = window + extra  # positions 0 .. train - 1 seen in training
    longest = math.floor(window + k * (train - 1 - window)) + 1  # from w + (n - 1 - w) / k <= train - 1
    assert float(rerope_relative(torch.arange(longest), window, factor=k).max()) <= train - 1
    assert float(rerope_relative(torch.arange(longest + 1), window, factor=k).max()) > train - 1


@pytest.mark.parametrize("factor", [None, 2.0])
def test_gradients(factor):
    q, k = (t.requires_grad_() for t in qk(batch=1, seq=5, heads=1, dim=4))
    rope = RotaryEmbedding(4)
    assert torch.autograd.gradcheck(lambda a, b: rerope_scores(a, b, rope, 2, factor=factor), (q, k))


def test_no_graph_breaks():
    q, k = qk(batch=1, seq=6, dtype=torch.float32)
    rope = RotaryEmbedding(8, kernel="torch")
    count, reasons = graph_breaks(lambda a, b, p: rerope_scores(a, b, rope, 2, p, factor=2.0), q, k, torch.arange(6))
    assert count == 0, reasons


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(window=0), ValueError, "window"),
        (dict(window=2.0), TypeError, "window"),
        (dict(factor=0.5), ValueError, "factor"),
        (dict(factor="2"), TypeError, "factor"),
        (dict(rope="rope"), TypeError, "rope"),
        (dict(rope=RotaryEmbedding(8, learned_freq=True)), ValueError, "rope"),
        (dict(rope=RotaryEmbedding(4)), ValueError, "head_dim"),
        (dict(positions=torch.arange(10.0)), TypeError, "positions"),
        (dict(positions=torch.arange(9)), ValueError, "positions"),
        (dict(positions=torch.arange(10) - 1), ValueError, "positions"),
        (dict(causal=1), TypeError, "causal"),
        (dict(k=torch.zeros(2, 10, 1, 8, dtype=torch.float64)), ValueError, "heads"),
    ],
)
def test_door(kwargs, error, match):
    q, k = qk()
    args = {**dict(q=q, k=k, rope=RotaryEmbedding(8), window=2), **kwargs}
    with pytest.raises(error, match=match):
        rerope_scores(**args)


def test_module_door_and_relative_door():
    with pytest.raises(ValueError, match="dynamic"):
        ReRoPE(8, 4, scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(ValueError, match="window"):
        ReRoPE(8, 0)
    with pytest.raises(ValueError, match="positions"):
        rerope_relative(torch.zeros(2, 3, 4, dtype=torch.long), 2)


@pytest.mark.parametrize(("position", "options"), [("rerope", {}), ("leaky_rerope", dict(window=4, factor=8.0))])
@pytest.mark.parametrize("causal", [True, False])
def test_layer_matches_the_rope_layer_inside_the_window(position, options, causal):
    torch.manual_seed(0)
    layer = MultiHeadAttention(32, 2, position, causal=causal, num_kv_heads=1, **options)
    rope = MultiHeadAttention(32, 2, "rope", causal=causal, num_kv_heads=1)
    rope.load_state_dict(layer.state_dict())
    x = torch.randn(2, 40, 32)
    window = layer.encoding.window
    inside = (torch.arange(40)[:, None] - torch.arange(40)[None, :]).abs() < window
    got, plain = layer.scores(x), rope.scores(x)
    assert torch.equal(got[..., inside], plain[..., inside])
    weights = got.softmax(-1)  # the layer's output is the softmax of those scores over v, projected
    v = layer.v_proj(x).unflatten(-1, (1, 16)).transpose(1, 2)
    expected = layer.out_proj((weights @ v).transpose(1, 2).flatten(2))
    assert torch.allclose(layer(x), expected, rtol=0, atol=1e-6)  # float32, two summation orders of 40 terms
