"""The rotation's options that peers' APIs have: each against the peer's own output or a hand-written reference.

* flash-attn ``seqlen_offsets`` and differentiable ``inplace=True`` (flash-attn is not installed: its
  documented behaviour, ``apply_rotary_emb(x, cos, sin, inplace, seqlen_offsets)`` in
  ``flash_attn/layers/rotary.py``, is written here as float64 rotation matrices);
* odd ``head_dim`` with an even ``rotary_dim``;
* rotary-embedding-torch 0.9.1's ``theta_rescale_factor``, ``freqs_for="pixel"``, fractional positions
  and ``learned_freq`` (its own module's frequencies and rotations, installed);
* MPT's ``alibi_bias_max`` (MPT is not installed: ``gen_slopes`` of ``llmfoundry``'s
  ``attention.py`` is written by hand below);
* transformers' ``rope_type="proportional"`` (its own ``_compute_proportional_rope_parameters``) and a
  0-d tensor ``seq_len``.

Tolerances: float32 rotations of values ~3 are compared to float64 references with
``8 * eps32 * max|x|`` (the kernels round the float64 angles' cos/sin to float32 once, then take two
float32 products and a sum: a few ulps of the largest value), as in test_rotary.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from rotary_embedding_torch import RotaryEmbedding as PeerRotary

import ropelib as rl
from ropelib import RotaryEmbedding, alibi_bias, alibi_slopes, rope_frequencies, rotary_qk
from ropelib.frequencies import ntk_rescaled_theta, pixel_inverse_frequencies
from ropelib.kernels import native_build
from ropelib.kernels.door import offset_positions
from ropelib.scaling import ROPE_SCALINGS, scaled_inverse_frequencies
from ropelib.scaling.proportional import proportional_scaling

from hot_path import graph_breaks, tensor_to_python_calls
from references import EPS, rotate_ref, rotation_matrix_ref

# triton runs in its interpreter on the CPU; the native C kernel where it builds
KERNEL = pytest.mark.parametrize("kernel", ["torch", "triton"] + (["native"] if native_build.enabled() else []))
LAYOUT = pytest.mark.parametrize("layout", ["half", "interleaved"])
META = torch.device("meta")


def tol32(x: torch.Tensor) -> float:
    """``8 * eps32 * max|x|``: see the module docstring."""
    return 8 * EPS[torch.float32] * float(x.abs().max())


def rotate_by_angles_ref(x: torch.Tensor, angles: torch.Tensor, layout: str) -> torch.Tensor:
    """Rotate pair ``i`` of ``x`` ``[b, s, h, d]`` by ``angles[b, s, i]`` (float64, one 2x2 rotation per pair)."""
    x = x.double()
    out = x.clone()
    r2 = angles.shape[-1]
    for i in range(r2):
        a, b = (i, i + r2) if layout == "half" else (2 * i, 2 * i + 1)
        c, s = angles[..., i].cos()[..., None], angles[..., i].sin()[..., None]  # broadcast over heads
        out[..., a] = x[..., a] * c - x[..., b] * s
        out[..., b] = x[..., a] * s + x[..., b] * c
    return out


# ----------------------------------------------------------------------------- 1. seqlen_offsets (flash-attn)


@KERNEL
@LAYOUT
def test_rotary_qk_seqlen_offsets_tensor_and_int(kernel: str, layout: str) -> None:
    # flash-attn: with seqlen_offsets, token s of row b is at position offsets[b] + s.
    cos, sin = RotaryEmbedding(8).cos_sin_cache(32)
    cos, sin = cos[:32], sin[:32]
    q, k = torch.randn(3, 4, 2, 8), torch.randn(3, 4, 1, 8)
    offsets = torch.tensor([0, 5, 28])  # 28 + 3 = 31: the last row of the table
    q2, k2 = rotary_qk(q, k, cos, sin, layout=layout, kernel=kernel, seqlen_offsets=offsets)
    positions = offsets[:, None] + torch.arange(4)
    for got, x in ((q2, q), (k2, k)):
        assert (got.double() - rotate_ref(x, positions, layout=layout)).abs().max() <= tol32(x)
    q3, _ = rotary_qk(q, k, cos, sin, layout=layout, kernel=kernel, seqlen_offsets=7)
    assert (q3.double() - rotate_ref(q, torch.arange(7, 11), layout=layout)).abs().max() <= tol32(q)


@settings(max_examples=25, deadline=None)
@given(
    batch=st.integers(1, 3),
    seq=st.integers(1, 5),
    data=st.data(),
)
def test_module_seqlen_offsets_are_shifted_positions(batch: int, seq: int, data: st.DataObject) -> None:
    offsets = torch.tensor(data.draw(st.lists(st.integers(0, 2**20), min_size=batch, max_size=batch)))
    rope = RotaryEmbedding(8)
    q, k = torch.randn(batch, seq, 2, 8), torch.randn(batch, seq, 1, 8)
    q2, k2 = rope(q, k, seqlen_offsets=offsets)
    positions = offsets[:, None] + torch.arange(seq)
    # positions up to 2^20: the float64 angle is exact to ~1e-10 rad, the float32 cos/sin round once
    for got, x in ((q2, q), (k2, k)):
        assert (got.double() - rotate_ref(x, positions)).abs().max() <= tol32(x)


def test_seqlen_offsets_errors() -> None:
    rope = RotaryEmbedding(8)
    cos, sin = rope.cos_sin_cache(16)
    cos, sin = cos[:16], sin[:16]
    q, k = torch.randn(2, 4, 2, 8), torch.randn(2, 4, 1, 8)
    with pytest.raises(ValueError, match=r"seqlen_offsets must be an int or an integer tensor of shape \[batch\]"):
        rotary_qk(q, k, cos, sin, seqlen_offsets=torch.tensor([1, 2, 3]))
    with pytest.raises(TypeError, match="seqlen_offsets must be an integer tensor"):
        rotary_qk(q, k, cos, sin, seqlen_offsets=torch.tensor([1.0, 2.0]))
    with pytest.raises(TypeError, match="seqlen_offsets must be an int or an integer tensor"):
        rope(q, k, seqlen_offsets=1.5)
    with pytest.raises(TypeError, match="seqlen_offsets must be an int or an integer tensor"):
        rope(q, k, seqlen_offsets=True)
    with pytest.raises(ValueError, match="seqlen_offsets must be >= 0"):
        rotary_qk(q, k, cos, sin, seqlen_offsets=torch.tensor([0, -1]))
    with pytest.raises(ValueError, match="seqlen_offsets must be >= 0"):
        rope(q, k, seqlen_offsets=-2)
    with pytest.raises(ValueError, match=r"seqlen_offsets\[b\] \+ seq_len - 1 must be < 16"):
        rotary_qk(q, k, cos, sin, seqlen_offsets=torch.tensor([0, 13]))
    with pytest.raises(ValueError, match="seqlen_offsets \\+ seq_len = 17 exceeds the table's 16 rows"):
        rotary_qk(q, k, cos, sin, seqlen_offsets=13)
    with pytest.raises(ValueError, match="give positions or seqlen_offsets, not both"):
        rotary_qk(q, k, cos, sin, torch.arange(4), seqlen_offsets=1)
    with pytest.raises(ValueError, match="give positions or seqlen_offsets, not both"):
        rope(q, k, torch.arange(4), seqlen_offsets=torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="give seqlen_offsets or cu_seqlens, not both"):
        rope(q[:1], k[:1], cu_seqlens=torch.tensor([0, 4]), seqlen_offsets=1)
    with pytest.raises(ValueError, match="give seqlen_offsets or cu_seqlens, not both"):
        rotary_qk(q[:1], k[:1], cos, sin, cu_seqlens=torch.tensor([0, 4]), seqlen_offsets=1)


def test_seqlen_offsets_read_no_value_on_the_host_and_compile_to_one_graph() -> None:
    rope = RotaryEmbedding(8)
    q, k = torch.randn(2, 3, 2, 8, device=META), torch.randn(2, 3, 1, 8, device=META)
    cos, sin = (t[:16].to(META) for t in rope.cos_sin_cache(16))
    offsets = torch.tensor([1, 4], device=META)
    with tensor_to_python_calls() as calls:  # meta tensors take the GPU path and hold no values
        rope(q, k, seqlen_offsets=offsets)
        rotary_qk(q, k, cos, sin, seqlen_offsets=offsets)
    assert calls == []
    q, k = torch.randn(2, 3, 2, 8), torch.randn(2, 3, 1, 8)
    breaks, reasons = graph_breaks(lambda q, k, o: rope(q, k, seqlen_offsets=o), q, k, torch.tensor([1, 4]))
    assert breaks == 0, reasons


def test_offset_positions() -> None:
    assert offset_positions(torch.tensor([2, 0]), 2, 3, torch.device("cpu")).tolist() == [[2, 3, 4], [0, 1, 2]]
    assert offset_positions(3, 2, 2, torch.device("cpu")).tolist() == [3, 4]
    assert offset_positions(0, 2, 2, torch.device("cpu")) is None


# ----------------------------------------------------------------------------- 2. in-place with autograd


@KERNEL
@LAYOUT
def test_inplace_gradcheck(kernel: str, layout: str) -> None:
    cos, sin = RotaryEmbedding(4).cos_sin(torch.arange(8), torch.float64)  # float64 tables for float64 inputs
    q = torch.randn(2, 3, 2, 6, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 3, 1, 6, dtype=torch.float64, requires_grad=True)

    def f(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        qa, ka = q * 1.0, k * 1.0  # non-leaves, as a projection's output
        out = rotary_qk(
            qa, ka, cos, sin, layout=layout, kernel=kernel, inplace=True, seqlen_offsets=torch.tensor([0, 4])
        )
        assert out[0] is qa and out[1] is ka  # really in place
        return out

    assert torch.autograd.gradcheck(f, (q, k), fast_mode=True)
    if kernel == "torch":
        assert torch.autograd.gradgradcheck(f, (q, k), fast_mode=True)


def test_inplace_backward_is_the_inverse_rotation() -> None:
    # d<g, R x>/dx = R^T g = R(-theta) g, written with the float64 reference matrices.
    rope = RotaryEmbedding(8)
    cos, sin = rope.cos_sin(torch.arange(6), torch.float64)
    x = torch.randn(1, 6, 2, 8, dtype=torch.float64, requires_grad=True)
    g = torch.randn(1, 6, 2, 8, dtype=torch.float64)
    q = x * 1.0
    rotary_qk(q, q[:, :, :1].clone(), cos, sin, inplace=True)
    (q * g).sum().backward()
    positions = torch.arange(6)
    expected = torch.stack([g[0, s] @ _matrix(int(positions[s]), 8) for s in range(6)])[None]
    torch.testing.assert_close(x.grad, expected, rtol=0, atol=1e-14)  # float64 products of values ~3


def _matrix(position: int, head_dim: int) -> torch.Tensor:
    return rotation_matrix_ref(position, head_dim)


def test_inplace_refuses_leaves_that_require_grad() -> None:
    cos, sin = RotaryEmbedding(8).cos_sin_cache(4)
    q = torch.randn(1, 4, 2, 8, requires_grad=True)
    k = torch.randn(1, 4, 1, 8)
    with pytest.raises(ValueError, match="inplace=True does not support autograd on q: it is a leaf"):
        rotary_qk(q, k, cos, sin, inplace=True)
    big = torch.randn(1, 4, 3, 8, requires_grad=True)
    with pytest.raises(ValueError, match="on k: it is a leaf tensor that requires grad \\(or a view of one\\)"):
        rotary_qk(q.detach().clone(), big[:, :, :1], cos, sin, inplace=True)
    with torch.no_grad():  # no graph recorded: a leaf may be overwritten, as in PyTorch
        out = rotary_qk(q, k, cos, sin, inplace=True)
    assert out[0] is q


def test_inplace_autograd_compiles_to_one_graph_with_the_eager_gradient() -> None:
    cos, sin = RotaryEmbedding(8).cos_sin_cache(16)

    def f(x: torch.Tensor, y: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rotary_qk(x * 2.0, y * 2.0, cos, sin, inplace=True, seqlen_offsets=offsets)

    x, y, offsets = torch.randn(2, 3, 2, 8, requires_grad=True), torch.randn(2, 3, 1, 8), torch.tensor([1, 4])
    breaks, reasons = graph_breaks(f, x, y, offsets)
    assert breaks == 0, reasons
    g = torch.randn(2, 3, 2, 8)
    (f(x, y, offsets)[0] * g).sum().backward()
    eager = x.grad.clone()
    x.grad = None
    torch._dynamo.reset()
    (torch.compile(f, fullgraph=True)(x, y, offsets)[0] * g).sum().backward()
    torch.testing.assert_close(x.grad, eager, rtol=0, atol=tol32(2 * g))


# ----------------------------------------------------------------------------- 3. odd head_dim


@KERNEL
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
@LAYOUT
def test_odd_head_dim_with_even_rotary_dim(kernel: str, dtype: torch.dtype, layout: str) -> None:
    rope = RotaryEmbedding(7, rotary_dim=4, layout=layout, kernel=kernel)
    q, k = torch.randn(2, 5, 3, 7, dtype=dtype), torch.randn(2, 5, 1, 7, dtype=dtype)
    positions = torch.tensor([[0, 3, 1, 9, 2], [4, 4, 0, 1, 7]])
    for got, x in zip(rope(q, k, positions), (q, k)):
        ref = rotate_ref(x, positions, layout=layout, rotary_dim=4)
        # the float32 math, rounded once to dtype: half an ulp of dtype, plus the float32 error
        bound = (EPS[dtype] if dtype != torch.float32 else 0.0) * float(x.abs().max()) + tol32(x.float())
        assert (got.double() - ref).abs().max() <= bound
        assert torch.equal(got[..., 4:], x[..., 4:])  # the odd tail passes through untouched


def test_odd_head_dim_needs_an_explicit_rotary_dim() -> None:
    with pytest.raises(ValueError, match="head_dim must be even .* unless an even rotary_dim"):
        RotaryEmbedding(7)
    with pytest.raises(ValueError, match="rotary_dim must be even"):
        RotaryEmbedding(7, rotary_dim=3)


# ----------------------------------------------------------------------------- 4. theta_rescale_factor


@pytest.mark.parametrize("dim,factor", [(8, 2.0), (16, 4.0), (64, 1.5), (4, 8.0)])
def test_theta_rescale_factor_matches_rotary_embedding_torch(dim: int, factor: float) -> None:
    peer = PeerRotary(dim, theta_rescale_factor=factor).freqs.detach().double()
    ours = RotaryEmbedding(dim, theta_rescale_factor=factor).cache.inv_freq
    # the peer's theta ** (float32 exponent): the exponent's rounding (2^-24) times ln(theta') <= 16 -> < 1e-6
    torch.testing.assert_close(ours, peer, rtol=2e-6, atol=0)
    assert ntk_rescaled_theta(10000.0, dim, factor) == pytest.approx(10000.0 * factor ** (dim / (dim - 2)), rel=1e-15)


def test_theta_rescale_factor_rotation_matches_the_peer() -> None:
    # rotary-embedding-torch rotates interleaved pairs of [batch, heads, seq, dim]
    peer = PeerRotary(8, theta_rescale_factor=3.0)
    rope = RotaryEmbedding(8, layout="interleaved", theta_rescale_factor=3.0)
    q = torch.randn(2, 6, 3, 8)
    want = peer.rotate_queries_or_keys(q.transpose(1, 2)).transpose(1, 2)
    got = rope(q, q[:, :, :1])[0]
    # the peer forms its angles in float32 (positions < 6: error <= 6 * 2^-24 rad per angle)
    torch.testing.assert_close(got, want, rtol=0, atol=2 * tol32(q))


def test_theta_rescale_factor_errors() -> None:
    with pytest.raises(ValueError, match="theta_rescale_factor must be a finite number > 0"):
        RotaryEmbedding(8, theta_rescale_factor=0.0)
    with pytest.raises(TypeError, match="theta_rescale_factor must be a real number"):
        RotaryEmbedding(8, theta_rescale_factor="2")
    with pytest.raises(ValueError, match="theta_rescale_factor needs rotary_dim >= 4"):
        RotaryEmbedding(2, theta_rescale_factor=2.0)
    with pytest.raises(ValueError, match="theta_rescale_factor .* needs freqs_for='lang' and scaling=None"):
        RotaryEmbedding(8, theta_rescale_factor=2.0, scaling={"rope_type": "linear", "factor": 2.0})


# ----------------------------------------------------------------------------- 5. continuous positions, pixel


@pytest.mark.parametrize("dim,max_freq", [(8, 10.0), (16, 256.0), (4, 4.0)])
def test_pixel_frequencies_match_rotary_embedding_torch(dim: int, max_freq: float) -> None:
    peer = PeerRotary(dim, freqs_for="pixel", max_freq=max_freq).freqs.detach().double()
    # the peer's float32 linspace times pi: a float32 rounding of values <= 128 pi
    torch.testing.assert_close(pixel_inverse_frequencies(dim, max_freq), peer, rtol=2 * EPS[torch.float32], atol=0)
    torch.testing.assert_close(RotaryEmbedding(dim, freqs_for="pixel", max_freq=max_freq).cache.inv_freq, peer,
                               rtol=2 * EPS[torch.float32], atol=0)  # fmt: skip
    assert pixel_inverse_frequencies(2, 4.0).tolist() == [
        math.pi
    ]  # one pair: linspace(1, 2, 1) = [1] (the peer divides by d - 2 = 0)


def test_continuous_pixel_positions_match_the_peer_and_the_formula() -> None:
    rope = RotaryEmbedding(8, freqs_for="pixel", continuous_positions=True, layout="interleaved")
    coords = torch.linspace(-1, 1, 7, dtype=torch.float64)
    cos, sin = rope.cos_sin(coords, torch.float64)
    inv = [math.pi * (1 + i * (5 - 1) / 3) for i in range(4)]  # linspace(1, max_freq/2 = 5, 4) * pi, by hand
    angles = coords[:, None] * torch.tensor(inv, dtype=torch.float64)
    # float64 angles up to 5 pi: the hand linspace and torch's differ by a few ulps of 16 (~2e-15 each)
    torch.testing.assert_close(cos, angles.cos(), rtol=0, atol=1e-14)
    torch.testing.assert_close(sin, angles.sin(), rtol=0, atol=1e-14)
    peer_angles = PeerRotary(8, freqs_for="pixel")(coords.float())[..., ::2].double()  # each repeated twice
    torch.testing.assert_close(angles, peer_angles, rtol=0, atol=4 * EPS[torch.float32] * 5 * math.pi)
    q = torch.randn(1, 7, 2, 8)
    got = rope(q, q, coords.float())[0]
    want = rotate_by_angles_ref(
        q, coords.float().double()[None, :, None] * torch.tensor(inv, dtype=torch.float64), "interleaved"
    )
    assert (got.double() - want).abs().max() <= tol32(q)


def test_continuous_angles_are_float64() -> None:
    # a fractional position near 1e6: a float32 product would be off by ~0.03 rad, float64 by ~1e-10
    rope = RotaryEmbedding(4, continuous_positions=True)
    p = 1_000_000.37
    cos, sin = rope.cos_sin(torch.tensor([p], dtype=torch.float64))
    assert cos[0, 0].item() == pytest.approx(math.cos(p), abs=EPS[torch.float32])
    assert cos[0, 1].item() == pytest.approx(math.cos(p * 0.01), abs=EPS[torch.float32])
    q = torch.randn(2, 3, 1, 4)
    positions = torch.tensor([[0.5, -2.25, 3.0], [1e6 + 0.37, 7.75, -1.0]], dtype=torch.float64)
    inv = torch.tensor([1.0, 0.01], dtype=torch.float64)
    want = rotate_by_angles_ref(q, positions[..., None] * inv, "half")
    assert (rope(q, q, positions)[0].double() - want).abs().max() <= tol32(q)
    assert torch.equal(rope(q, q, torch.tensor([0, -1, 2]))[0], rope(q, q, torch.tensor([0.0, -1.0, 2.0]))[0])


def test_continuous_positions_errors_and_hot_path() -> None:
    rope = RotaryEmbedding(8, continuous_positions=True)
    q, k = torch.randn(2, 3, 2, 8), torch.randn(2, 3, 1, 8)
    with pytest.raises(ValueError, match="positions must be finite, got nan"):
        rope(q, k, torch.tensor([0.0, math.nan, 1.0]))
    with pytest.raises(ValueError, match="positions must be finite"):
        rope.cos_sin(torch.tensor([math.inf]))
    with pytest.raises(ValueError, match="positions must have shape"):
        rope(q, k, torch.rand(4))
    with pytest.raises(TypeError, match="continuous_positions must be a bool, got str"):
        RotaryEmbedding(8, continuous_positions="float")
    with pytest.raises(TypeError, match="positions must be an integer tensor"):  # the default stays integer-only
        RotaryEmbedding(8)(q, k, torch.rand(3))
    with pytest.raises(ValueError, match="does not combine with learned_freq=True or continuous_positions=True"):
        RotaryEmbedding(8, continuous_positions=True, scaling={"rope_type": "dynamic", "factor": 2.0},
                        max_position_embeddings=16)  # fmt: skip
    with pytest.raises(ValueError, match="freqs_for must be one of"):
        RotaryEmbedding(8, freqs_for="constant")
    with pytest.raises(ValueError, match="freqs_for='pixel' takes no scaling"):
        RotaryEmbedding(8, freqs_for="pixel", scaling={"rope_type": "linear", "factor": 2.0})
    with pytest.raises(ValueError, match="max_freq must be a finite number > 0"):
        RotaryEmbedding(8, freqs_for="pixel", max_freq=-1.0)
    with tensor_to_python_calls() as calls:
        rope(q.to(META), k.to(META), torch.rand(2, 3, device=META))
    assert calls == []
    breaks, reasons = graph_breaks(lambda q, k, p: rope(q, k, p), q, k, torch.rand(2, 3))
    assert breaks == 0, reasons


def test_continuous_positions_refuse_a_list_naming_both_kinds() -> None:
    # a module that takes real-valued positions says so when given a list: a tensor, integer or floating
    rope = RotaryEmbedding(8, continuous_positions=True)
    q, k = torch.randn(2, 3, 2, 8), torch.randn(2, 3, 1, 8)
    with pytest.raises(TypeError, match="positions must be a torch.Tensor"):
        rope(q, k, [0.5, 1.0, 2.0])


def test_continuous_positions_take_negative_integers_and_one_row_for_the_batch() -> None:
    # integer positions of any sign are accepted, and a [1, seq] row serves every sequence of the batch
    rope = RotaryEmbedding(4, continuous_positions=True)
    cos, sin = rope.cos_sin(torch.tensor([-3]), torch.float64)
    inv = [1.0, 0.01]  # theta^(-2i/r) by hand: 1e4 ** (-0/4), 1e4 ** (-2/4)
    assert cos[0].tolist() == pytest.approx([math.cos(-3 * w) for w in inv], abs=1e-15)
    assert sin[0].tolist() == pytest.approx([math.sin(-3 * w) for w in inv], abs=1e-15)
    q = torch.randn(2, 3, 1, 4)
    row = torch.rand(1, 3, dtype=torch.float64)
    want = rotate_by_angles_ref(q, row.expand(2, 3)[..., None] * torch.tensor(inv, dtype=torch.float64), "half")
    assert (rope(q, q, row)[0].double() - want).abs().max() <= tol32(q)
    want = rotate_by_angles_ref(
        q, torch.tensor([[-3.0, 0.0, 2.0]] * 2)[..., None] * torch.tensor(inv, dtype=torch.float64), "half"
    )
    assert (rope(q, q, torch.tensor([[-3, 0, 2]]))[0].double() - want).abs().max() <= tol32(q)


# ----------------------------------------------------------------------------- 6. learned frequencies


def rotate_learned_ref(x: torch.Tensor, positions: torch.Tensor, inv: torch.Tensor, layout: str) -> torch.Tensor:
    """The rotation at angles ``positions * inv``, differentiable in ``inv`` (float64 torch ops, pair by pair)."""
    return rotate_by_angles_ref(x, positions.double()[..., None] * inv, layout)


@LAYOUT
def test_learned_frequencies_gradcheck(layout: str) -> None:
    rope = RotaryEmbedding(8, layout=layout, learned_freq=True).double()
    q = torch.randn(2, 3, 2, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 3, 1, 8, dtype=torch.float64)
    positions = torch.tensor([[0, 2, 5], [1, 1, 7]])
    inv = rope.learned_inv_freq.detach().clone().requires_grad_()

    def f(q: torch.Tensor, inv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.func.functional_call(rope, {"learned_inv_freq": inv}, (q, k, positions))

    assert torch.autograd.gradcheck(f, (q, inv), fast_mode=True)


def test_learned_frequency_gradient_matches_the_formula_and_the_cache_is_never_stale() -> None:
    rope = RotaryEmbedding(8, learned_freq=True)
    assert [name for name, _ in rope.named_parameters()] == ["learned_inv_freq"]
    q, k = torch.randn(2, 4, 2, 8), torch.randn(2, 4, 1, 8)
    g = torch.randn(2, 4, 2, 8)
    (rope(q, k)[0] * g).sum().backward()
    inv64 = torch.tensor([10000.0 ** (-i / 4) for i in range(4)], dtype=torch.float64).requires_grad_()
    (rotate_learned_ref(q, torch.arange(4), inv64, "half") * g.double()).sum().backward()
    # float32 rotation of values ~3 summed over 2*4*2 = 16 terms times positions <= 3
    torch.testing.assert_close(rope.learned_inv_freq.grad.double(), inv64.grad, rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        rope.learned_inv_freq.mul_(1.5)  # an optimizer step
    new = rope.learned_inv_freq.detach().double()
    for grad_mode in (True, False):  # with autograd (reference path) and without (kernels)
        with torch.set_grad_enabled(grad_mode):
            got = rope(q, k)[0]
        want = rotate_learned_ref(q, torch.arange(4), new, "half")
        assert (got.double() - want).abs().max() <= tol32(q)
    cos, _ = rope.cos_sin_cache(4)
    torch.testing.assert_close(cos.double(), (torch.arange(4).double()[:, None] * new).cos(), rtol=0, atol=1e-7)
    rope.reset_parameters()
    torch.testing.assert_close(rope.learned_inv_freq.detach().double(), inv64.detach(), rtol=1e-7, atol=0)


def test_learned_frequencies_errors() -> None:
    with pytest.raises(TypeError, match="learned_freq must be a bool"):
        RotaryEmbedding(8, learned_freq=1)
    with pytest.raises(ValueError, match="does not combine with learned_freq=True"):
        RotaryEmbedding(8, learned_freq=True, scaling={"rope_type": "dynamic", "factor": 2.0},
                        max_position_embeddings=16)  # fmt: skip


# ----------------------------------------------------------------------------- 7. alibi_bias_max (MPT)


def mpt_gen_slopes(n_heads: int, alibi_bias_max: float = 8.0) -> list[float]:
    """MPT's ``gen_slopes`` (llm-foundry ``attention.py``), in float64 Python floats."""
    n_heads_pow2 = 2 ** math.ceil(math.log2(n_heads))
    m = [i * (alibi_bias_max / n_heads_pow2) for i in range(1, n_heads_pow2 + 1)]
    slopes = [1.0 / 2**x for x in m]
    if n_heads_pow2 != n_heads:
        slopes = (slopes[1::2] + slopes[::2])[:n_heads]
    return slopes


@pytest.mark.parametrize("bias_max", [8.0, 4.0, 16.0, 12.5])
@pytest.mark.parametrize("n_heads", [1, 2, 3, 5, 6, 8, 12, 16, 20, 33])
def test_alibi_bias_max_matches_mpt(n_heads: int, bias_max: float) -> None:
    got = alibi_slopes(n_heads, alibi_bias_max=bias_max)
    # float64 powers of two at exponents that differ in rounding only: a few ulps
    torch.testing.assert_close(got, torch.tensor(mpt_gen_slopes(n_heads, bias_max), dtype=torch.float64),
                               rtol=4 * EPS[torch.float64], atol=0)  # fmt: skip


def test_alibi_bias_max_default_and_hand_worked_values() -> None:
    # 6 heads, B = 8: MPT takes the 8-head slopes 2^-1..2^-8, the even-indexed ones first
    assert alibi_slopes(6).tolist() == [2**-2, 2**-4, 2**-6, 2**-8, 2**-1, 2**-3]
    assert alibi_slopes(4, alibi_bias_max=4).tolist() == [2**-1, 2**-2, 2**-3, 2**-4]
    assert torch.equal(alibi_slopes(12), alibi_slopes(12, alibi_bias_max=8))
    bias = alibi_bias(2, 3, alibi_bias_max=2.0, dtype=torch.float64)
    # 2 heads, B = 2: slopes 2^(-2 * 1 / 2) = 1/2 and 2^(-2 * 2 / 2) = 1/4
    assert bias[0].tolist() == [[0.0, -0.5, -1.0], [-0.5, 0.0, -0.5], [-1.0, -0.5, 0.0]]
    assert bias[1].tolist() == [[0.0, -0.25, -0.5], [-0.25, 0.0, -0.25], [-0.5, -0.25, 0.0]]
    with pytest.raises(ValueError, match="alibi_bias_max must be a finite number > 0"):
        alibi_slopes(4, alibi_bias_max=0)
    with pytest.raises(TypeError, match="alibi_bias_max must be a real number"):
        alibi_slopes(4, alibi_bias_max="8")


# ----------------------------------------------------------------------------- 8. proportional, seq_len tensor


@pytest.mark.parametrize("head_dim,partial,factor", [(16, 0.25, 1.0), (16, 0.25, 2.0), (64, 0.5, 8.0), (32, 1.0, 1.0),
                                                     (24, 0.75, 3.0), (16, 0.0, 1.0)])  # fmt: skip
def test_proportional_matches_transformers(head_dim: int, partial: float, factor: float) -> None:
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import _compute_proportional_rope_parameters

    params = {"rope_type": "proportional", "rope_theta": 10000.0, "factor": factor, "partial_rotary_factor": partial}
    config = transformers.PretrainedConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
                                           rope_parameters=dict(params))  # fmt: skip
    want, want_scale = _compute_proportional_rope_parameters(config)
    got, scale = scaled_inverse_frequencies(head_dim, 10000.0, params)
    # transformers computes in float32: one rounding of base ** (float32 exponent), ~ln(1e4) * 2^-24
    torch.testing.assert_close(got, want.double(), rtol=2e-6, atol=0)
    assert scale == want_scale == 1.0
    assert torch.equal(got == 0, want == 0)  # the pairs that do not rotate
    config_dict = {
        "hidden_size": 4 * head_dim,
        "num_attention_heads": 4,
        "head_dim": head_dim,
        "rope_parameters": params,
    }
    if partial > 0:  # through rope_config (which splits partial_rotary_factor into rotary_dim) and the module
        rope = RotaryEmbedding.from_config(config_dict)
        torch.testing.assert_close(rope.cache.inv_freq, want.double(), rtol=2e-6, atol=0)
        assert rope.rotary_dim == head_dim


def test_proportional_is_registered_and_checked() -> None:
    assert ROPE_SCALINGS["proportional"].compute is proportional_scaling
    assert ROPE_SCALINGS["proportional"].optional == {"factor", "partial_rotary_factor"}
    inv, _ = proportional_scaling(8, 100.0, {"partial_rotary_factor": 0.5, "factor": 2.0})
    assert inv.tolist()[2:] == [0.0, 0.0]  # int(0.5 * 8 // 2) = 2 rotated pairs of 4
    assert inv[:2].tolist() == pytest.approx([1.0 / 2, 100.0 ** (-2 / 8) / 2], rel=1e-15)
    with pytest.raises(ValueError, match=r"scaling\['partial_rotary_factor'\] must be in \[0, 1\]"):
        scaled_inverse_frequencies(8, 1e4, {"rope_type": "proportional", "partial_rotary_factor": 1.5})
    with pytest.raises(ValueError, match=r"scaling\['factor'\] must be > 0"):
        scaled_inverse_frequencies(8, 1e4, {"rope_type": "proportional", "factor": 0.0})
    with pytest.raises(ValueError, match="pass partial_rotary_factor=1.0 here"):
        rope_frequencies(8, 1e4, {"rope_type": "proportional"}, partial_rotary_factor=0.5)
    with pytest.raises(ValueError, match="is not read here"):  # other types still refuse the key
        scaled_inverse_frequencies(8, 1e4, {"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5})
    with pytest.raises(ValueError, match="give the fraction once"):
        RotaryEmbedding(16, rotary_dim=8, scaling={"rope_type": "proportional", "partial_rotary_factor": 0.5})


def test_seq_len_as_a_0d_integer_tensor() -> None:
    dynamic = {"rope_type": "dynamic", "factor": 2.0}
    for fn in (rope_frequencies, scaled_inverse_frequencies):
        want = fn(8, 1e4, dynamic, max_position_embeddings=16, seq_len=40)
        got = fn(8, 1e4, dynamic, max_position_embeddings=16, seq_len=torch.tensor(40))
        assert torch.equal(got[0], want[0]) and got[1] == want[1]
        with pytest.raises(ValueError, match="seq_len must be an int or a 0-d integer tensor, got shape \\[1\\]"):
            fn(8, 1e4, dynamic, max_position_embeddings=16, seq_len=torch.tensor([40]))
        with pytest.raises(TypeError, match="seq_len must be an integer tensor"):
            fn(8, 1e4, dynamic, max_position_embeddings=16, seq_len=torch.tensor(40.0))
        with pytest.raises(ValueError, match="seq_len must be >= 0"):
            fn(8, 1e4, dynamic, max_position_embeddings=16, seq_len=torch.tensor(-1))
    # the dynamic NTK base by hand: theta * ((s * L_now / L - (s - 1)) ^ (d / (d - 2)))
    base = 1e4 * ((2.0 * 40 / 16) - 1) ** (8 / 6)
    got, _ = scaled_inverse_frequencies(8, 1e4, dynamic, max_position_embeddings=16, seq_len=torch.tensor(40))
    assert got.tolist() == pytest.approx([base ** (-i / 4) for i in range(4)], rel=1e-12)


def test_new_names_are_reachable() -> None:
    assert rl.scaling.proportional_scaling is proportional_scaling
