"""``rerotate_keys`` (cached keys moved by ``R(p + δ) = R(δ) R(p)``) and the attention-sink cache built on it.

Expected values: keys encoded from scratch at the new positions, by the float64 rotation
matrices of ``tests/references.py`` (unscaled frequencies) or by the module's own forward pass
(scaled ones, whose frequencies ``tests/test_scaling.py`` checks against the formulas); the
group law itself is checked on the reference matrices. The streaming check decodes with a
:class:`~ropelib.SinkCache` and compares, at every step, with attention over the kept tokens
encoded from scratch at their cache positions (the reference softmax of ``tests/references.py``).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from ropelib import RotaryEmbedding, SinkCache, rerotate_keys
from ropelib.kernels import native_build

from references import EPS, attention_ref, pair_indices, rotate_ref, rotation_matrix_ref

KERNEL = pytest.mark.parametrize("kernel", ["torch", "triton"] + (["native"] if native_build.enabled() else []))
LAYOUT = pytest.mark.parametrize("layout", ["half", "interleaved"])
HEAD_DIM = 16
#: positions of the cached keys, [batch, seq], and per-token shifts keeping p + shift >= 0
POSITIONS = torch.tensor([[3, 10, 0, 7, 40], [50, 2, 2, 9, 31]])
SHIFTS = torch.tensor([[-3, 5, 0, -7, 100], [-50, 1, 9, 2, -31]])
#: float64 angles p f (|p f| <= 150) carry ~150 * 2^-53 ~ 2e-14 of error; 1e-12 of max|k| is a wide margin
F64_TOL = 1e-12
#: three float32 rotations (the key encoded at p, moved by δ; the comparison's key encoded at p + δ),
#: each within 8 float32 ulps of max|k| of the exact one (tables rounded once, products and sum)
F32_TOL = 3 * 8 * EPS[torch.float32]
SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
}


def keys(dtype: torch.dtype = torch.float64, heads: int = 2) -> torch.Tensor:
    return torch.randn(*POSITIONS.shape, heads, HEAD_DIM, dtype=dtype)


def rotate_by_frequencies(x: torch.Tensor, angles_of: torch.Tensor, inv_freq: list[float], layout: str) -> torch.Tensor:
    """``x`` ``[batch, seq, heads, d]`` with pair ``i`` of token ``(b, s)`` turned by ``angles_of[b, s] * inv_freq[i]``."""
    out = x.double().clone()
    for (a, b), f in zip(pair_indices(2 * len(inv_freq), layout), inv_freq):
        phi = angles_of.double()[..., None] * f
        c, s = torch.cos(phi), torch.sin(phi)
        out[..., a], out[..., b] = x[..., a] * c - x[..., b] * s, x[..., a] * s + x[..., b] * c
    return out


def test_the_group_law_of_the_reference_rotations() -> None:
    # R(p + δ) = R(δ) R(p): each pair turns by δ f + p f; float64 matrices, angles <= 150 rad
    for layout in ("half", "interleaved"):
        for p, delta in ((3, 4), (50, -31), (0, 7), (40, 100)):
            both = rotation_matrix_ref(delta, HEAD_DIM, layout=layout) @ rotation_matrix_ref(p, HEAD_DIM, layout=layout)
            assert (both - rotation_matrix_ref(p + delta, HEAD_DIM, layout=layout)).abs().max() < F64_TOL


@LAYOUT
@pytest.mark.parametrize("rotary_dim", [HEAD_DIM, 10])  # full and partial rotary
@pytest.mark.parametrize("shift", [7, -2, "seq", "one_seq", "batch_seq"])
def test_float64_equals_encoding_at_the_new_positions(layout: str, rotary_dim: int, shift: object) -> None:
    rope = RotaryEmbedding(HEAD_DIM, rotary_dim=rotary_dim, layout=layout)
    shifts = {"seq": SHIFTS[0], "one_seq": SHIFTS[:1], "batch_seq": SHIFTS}.get(shift, shift)  # type: ignore[call-overload]
    k = keys()
    cached = rotate_ref(k, POSITIONS + 2, layout=layout, rotary_dim=rotary_dim)  # p >= 2: a shift of -2 stays >= 0
    moved = rerotate_keys(cached, shifts, rope=rope)
    want = rotate_ref(k, POSITIONS + 2 + torch.as_tensor(shifts), layout=layout, rotary_dim=rotary_dim)
    assert moved.dtype == torch.float64 and moved.shape == k.shape
    assert (moved - want).abs().max() <= F64_TOL * k.abs().max()
    if rotary_dim < HEAD_DIM:  # the rest of each head kept, bit for bit
        assert torch.equal(moved[..., rotary_dim:], cached[..., rotary_dim:])


@KERNEL
@LAYOUT
def test_partial_rotary_with_each_kernel(kernel: str, layout: str) -> None:
    # the tail of each head must come through an out-of-place move on every kernel
    rope = RotaryEmbedding(HEAD_DIM, rotary_dim=10, layout=layout, kernel=kernel)
    k = keys()
    cached = rotate_ref(k, POSITIONS, layout=layout, rotary_dim=10)
    moved = rerotate_keys(cached, SHIFTS, rope=rope)
    want = rotate_ref(k, POSITIONS + SHIFTS, layout=layout, rotary_dim=10)
    assert (moved - want).abs().max() <= F64_TOL * k.abs().max()
    assert torch.equal(moved[..., 10:], cached[..., 10:])


@KERNEL
@LAYOUT
def test_float32_within_three_rotations_of_rounding(kernel: str, layout: str) -> None:
    rope = RotaryEmbedding(HEAD_DIM, layout=layout, kernel=kernel)
    k = keys(torch.float32)
    _, cached = rope(k, k, POSITIONS)
    moved = rerotate_keys(cached, SHIFTS, rope=rope)
    _, encoded = rope(k, k, POSITIONS + SHIFTS)
    assert moved.dtype == torch.float32
    assert (moved.double() - encoded.double()).abs().max() <= F32_TOL * k.abs().max()
    exact = rotate_ref(k, POSITIONS + SHIFTS, layout=layout)  # two float32 rotations from the exact key
    assert (moved.double() - exact).abs().max() <= 2 * 8 * EPS[torch.float32] * k.abs().max()


@pytest.mark.parametrize("name", list(SCALINGS))
@LAYOUT
def test_scaled_frequencies(name: str, layout: str) -> None:
    rope = RotaryEmbedding(HEAD_DIM, layout=layout, scaling=SCALINGS[name], max_position_embeddings=256)
    if name == "yarn":  # the attention factor scales cos and sin: a R(p); the shift must not apply it again
        assert rope.attention_scaling > 1.05
    k = keys()
    _, cached = rope(k, k, POSITIONS)
    _, encoded = rope(k, k, POSITIONS + SHIFTS)
    moved = rerotate_keys(cached, SHIFTS, rope=rope)
    assert (moved - encoded).abs().max() <= F64_TOL * k.abs().max()
    _, at_four = rope(k, k, POSITIONS + 4)
    assert (rerotate_keys(cached, 4, rope=rope) - at_four).abs().max() <= F64_TOL * k.abs().max()


def test_a_shift_of_zero_changes_nothing_in_value() -> None:
    rope, k = RotaryEmbedding(HEAD_DIM), keys()
    # cos 0 = 1 and sin 0 = 0 exactly: x * 1 - y * 0 = x
    assert torch.equal(rerotate_keys(k, 0, rope=rope), k)


@KERNEL
def test_in_place(kernel: str) -> None:
    rope = RotaryEmbedding(HEAD_DIM, kernel=kernel)
    k = keys(torch.float32)
    want = rerotate_keys(k, SHIFTS, rope=rope)
    cache = torch.zeros(2, 8, 2, HEAD_DIM)
    cache[:, 1:6] = k
    view = cache[:, 1:6]  # a view of a cache, not contiguous over the batch
    version = cache._version
    out = rerotate_keys(view, SHIFTS, rope=rope, inplace=True)
    assert out is view and cache._version > version
    assert torch.equal(view, want)  # the same operator in place: the same bits
    assert not cache[:, 0].any() and not cache[:, 6:].any()  # nothing else written


@LAYOUT
@pytest.mark.parametrize("inplace", [False, True])
def test_seq_first(layout: str, inplace: bool) -> None:
    rope = RotaryEmbedding(HEAD_DIM, layout=layout)
    k_sbhd = keys(torch.float32).transpose(0, 1).contiguous()  # [seq, batch, heads, d]
    want = rerotate_keys(k_sbhd.transpose(0, 1).contiguous(), SHIFTS, rope=rope)
    got = rerotate_keys(k_sbhd, SHIFTS, rope=rope, tensor_format="sbhd", inplace=inplace)
    assert got.shape == k_sbhd.shape and (got is k_sbhd) == inplace
    assert torch.equal(got.transpose(0, 1), want)


def test_gradients_reach_the_keys() -> None:
    rope = RotaryEmbedding(8)
    k = torch.randn(1, 3, 1, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: rerotate_keys(t, torch.tensor([1, -4, 9]), rope=rope), (k,))


def test_dynamic_scaling_uses_the_frequencies_in_use_now() -> None:
    # The documented caveat: dynamic NTK's frequencies follow the length. While they do not change
    # (here: below max_position_embeddings), the move is exact; after they change, the keys cached
    # earlier were rotated by other frequencies, and rerotate_keys turns them by the current ones.
    rope = RotaryEmbedding(HEAD_DIM, scaling={"rope_type": "dynamic", "factor": 2.0}, max_position_embeddings=64)
    k = keys()
    positions = POSITIONS.clamp(max=20)
    _, cached = rope(k, k, positions)
    original = rope.cache.inv_freq.tolist()
    _, encoded = rope(k, k, positions + 3)
    assert (rerotate_keys(cached, 3, rope=rope) - encoded).abs().max() <= F64_TOL * k.abs().max()

    rope(k[:, :1], k[:, :1], torch.tensor([200]))  # a long request: the frequencies follow 201 positions
    now = rope.cache.inv_freq.tolist()
    assert now != original
    moved = rerotate_keys(cached, 3, rope=rope)
    by_hand = rotate_by_frequencies(cached, torch.full(positions.shape, 3), now, "half")
    assert (moved - by_hand).abs().max() <= F64_TOL * k.abs().max()
    # not a key encoded at p + 3 with either set of frequencies: R_now(3) R_then(p) is neither
    for freqs in (original, now):
        at_new = rotate_by_frequencies(k, positions + 3, freqs, "half")
        assert (moved - at_new).abs().max() > 1e-3


def test_errors_name_the_argument() -> None:
    rope, k = RotaryEmbedding(HEAD_DIM), keys(torch.float32)
    cases = [
        (lambda: rerotate_keys(k, 1, rope="rope"), TypeError, "rope must be a ropelib.RotaryEmbedding"),
        (lambda: rerotate_keys(k, 1), TypeError, "rope"),
        (lambda: rerotate_keys(k.tolist(), 1, rope=rope), TypeError, "keys must be a torch.Tensor"),
        (lambda: rerotate_keys(k.long(), 1, rope=rope), TypeError, "keys must be a floating"),
        (lambda: rerotate_keys(k[0], 1, rope=rope), ValueError, "keys must have 4 dimensions"),
        (lambda: rerotate_keys(k[..., :8], 1, rope=rope), ValueError, "keys must have head_dim=16"),
        (lambda: rerotate_keys(k, 1.5, rope=rope), TypeError, "shift must be an int or an integer tensor"),
        (lambda: rerotate_keys(k, True, rope=rope), TypeError, "shift must be an int or an integer tensor"),
        (lambda: rerotate_keys(k, torch.ones(5), rope=rope), TypeError, "shift must be an integer tensor"),
        (lambda: rerotate_keys(k, torch.arange(4), rope=rope), ValueError, r"shift must have shape \[5\]"),
        (lambda: rerotate_keys(k, SHIFTS.T, rope=rope), ValueError, r"shift must have shape"),
        (lambda: rerotate_keys(k, 1, rope=rope, inplace=1), TypeError, "inplace must be a bool"),
        (lambda: rerotate_keys(k, 1, rope=rope, tensor_format="bhsd"), ValueError, "tensor_format must be one of"),
        (
            lambda: rerotate_keys(k, SHIFTS, rope=rope, tensor_format="sbhd"),  # [5, 2] keys in sbhd: seq 2
            ValueError,
            r"shift must have shape \[2\]",
        ),
        (
            lambda: rerotate_keys(k[:, :, :1].expand(2, 5, 2, HEAD_DIM), 1, rope=rope, inplace=True),
            ValueError,
            "keys.*do not share memory",
        ),
        (
            lambda: rerotate_keys(k.clone().requires_grad_(), 1, rope=rope, inplace=True),
            ValueError,
            "keys.*leaf tensor that requires grad",
        ),
    ]
    for call, error, match in cases:
        with pytest.raises(error, match=match):
            call()


# ---------------------------------------------------------------------------------------- SinkCache

D_MODEL, Q_HEADS, KV_HEADS, SINK_HEAD_DIM = 16, 2, 1, 8
#: tokens per step: prefill chunks and single tokens, one of a whole window
STEPS = [3, 1, 1, 2, 1, 4, 1, 1, 3, 1, 1, 2, 1, 1, 1]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_positions: torch.Tensor) -> torch.Tensor:
    """The model's attention (PyTorch's kernel): query at cache position i sees cache positions <= i."""
    k, v = (t.repeat_interleave(Q_HEADS // KV_HEADS, dim=2) for t in (k, v))
    allowed = torch.arange(k.shape[1])[None, :] <= q_positions[:, None]
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=allowed)
    return out.transpose(1, 2)


@pytest.mark.parametrize(
    ("sink", "window", "layout", "rotary_dim"),
    [(2, 4, "half", SINK_HEAD_DIM), (1, 5, "interleaved", 6), (0, 4, "half", SINK_HEAD_DIM)],
)
def test_streaming_generation_equals_encoding_the_kept_tokens_from_scratch(
    sink: int, window: int, layout: str, rotary_dim: int
) -> None:
    rope = RotaryEmbedding(SINK_HEAD_DIM, layout=layout, rotary_dim=rotary_dim)
    cache = SinkCache(rope, sink=sink, window=window)
    w_q, w_k, w_v = (torch.randn(D_MODEL, h * SINK_HEAD_DIM, dtype=torch.float64) for h in (Q_HEADS, KV_HEADS, 1))
    seen_k: list[torch.Tensor] = []  # every token's unrotated key and value, [kv_heads, d]
    seen_v: list[torch.Tensor] = []
    for step, tokens in enumerate(STEPS):
        x = torch.randn(1, tokens, D_MODEL, dtype=torch.float64)
        q = (x @ w_q).view(1, tokens, Q_HEADS, SINK_HEAD_DIM)
        k = (x @ w_k).view(1, tokens, KV_HEADS, SINK_HEAD_DIM)
        v = (x @ w_v).view(1, tokens, KV_HEADS, SINK_HEAD_DIM)
        positions = cache.make_room(tokens)
        rq, rk = rope(q, k, positions)
        cache.append(rk, v)
        out = attend(rq, cache.keys, cache.values, positions)

        seen_k += list(k[0])
        seen_v += list(v[0])
        seen = len(seen_k)
        assert cache.length == min(seen, sink + window) and cache.evicted == seen - cache.length
        kept = list(range(min(sink, seen))) + list(range(seen - (cache.length - min(sink, seen)), seen))
        assert positions.tolist() == list(range(cache.length - tokens, cache.length))
        # from scratch: the kept tokens' keys encoded at their cache positions 0 .. n-1
        keys_now = rotate_ref(
            torch.stack([seen_k[i] for i in kept])[None],
            torch.arange(cache.length),
            layout=layout,
            rotary_dim=rotary_dim,
        )
        values_now = torch.stack([seen_v[i] for i in kept])[None]
        assert (cache.keys - keys_now).abs().max() <= F64_TOL, step  # moved keys: float64 rounding
        assert torch.equal(cache.values, values_now)
        q_now = rotate_ref(q, positions, layout=layout, rotary_dim=rotary_dim)
        allowed = torch.arange(cache.length)[None, :] <= positions[:, None]
        bias = torch.zeros(allowed.shape, dtype=torch.float64).masked_fill(~allowed, -math.inf)
        want = attention_ref(
            q_now.transpose(1, 2),
            keys_now.repeat_interleave(Q_HEADS, 2).transpose(1, 2),
            values_now.repeat_interleave(Q_HEADS, 2).transpose(1, 2),
            bias,
        ).transpose(1, 2)
        # float64 softmax of at most 9 scores: rounding ~1e-15; 1e-10 leaves room
        assert (out - want).abs().max() <= 1e-10, step
    assert cache.evicted == sum(STEPS) - (sink + window)


def test_sink_cache_in_float32_stays_within_rounding() -> None:
    # each eviction moves the window once more: the error grows with the number of moves, slowly
    rope = RotaryEmbedding(SINK_HEAD_DIM)
    cache = SinkCache(rope, sink=1, window=3)
    seen = []
    for _ in range(40):
        k = torch.randn(1, 1, 1, SINK_HEAD_DIM)
        _, rk = rope(k, k, cache.make_room(1))
        cache.append(rk, k)
        seen.append(k[0, 0])
    kept = torch.stack([seen[0], *seen[-3:]])[None]
    exact = rotate_ref(kept, torch.arange(4))
    # the last window token moved 0 times, the first of the window ~3 times (one shift of -1 per
    # step while it is held); each float32 rotation is within 8 ulps of max|k|: 4 rotations
    assert (cache.keys.double() - exact).abs().max() <= 4 * 8 * EPS[torch.float32] * kept.abs().max()


def test_sink_cache_errors() -> None:
    rope = RotaryEmbedding(SINK_HEAD_DIM)
    kv = torch.randn(1, 2, 1, SINK_HEAD_DIM)
    with pytest.raises(TypeError, match="rope must be a ropelib.RotaryEmbedding"):
        SinkCache("rope", sink=1, window=2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="sink must be >= 0"):
        SinkCache(rope, sink=-1, window=2)
    with pytest.raises(ValueError, match="window must be >= 1"):
        SinkCache(rope, sink=1, window=0)
    with pytest.raises(TypeError, match="window must be an int"):
        SinkCache(rope, sink=1, window=2.0)  # type: ignore[arg-type]
    cache = SinkCache(rope, sink=1, window=2)
    with pytest.raises(ValueError, match="the cache is empty"):
        _ = cache.keys
    with pytest.raises(ValueError, match="tokens must be >= 1"):
        cache.make_room(0)
    with pytest.raises(ValueError, match="tokens must be <= 2"):
        cache.make_room(3)
    with pytest.raises(ValueError, match="keys and values must share shape"):
        cache.append(kv, kv[:, :1])
    with pytest.raises(ValueError, match="keys must have head_dim=8"):
        cache.append(kv[..., :6], kv[..., :6])
    with pytest.raises(TypeError, match="values must be a floating"):
        cache.append(kv, kv.long())
    cache.append(kv, kv)
    with pytest.raises(ValueError, match=r"call make_room\(2\) first"):
        cache.append(kv, kv)
    cache.make_room(1)
    with pytest.raises(ValueError, match="as before"):
        cache.append(kv[:, :1].double(), kv[:, :1].double())
    with pytest.raises(ValueError, match="as before"):
        cache.append(torch.randn(2, 1, 1, SINK_HEAD_DIM), torch.randn(2, 1, 1, SINK_HEAD_DIM))
