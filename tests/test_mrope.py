"""ropelib.rotary.mrope (M-RoPE, Qwen2-VL) against a float64 reference and against transformers' own implementation.

Tolerances.
* Against the float64 reference (Python's math): ropelib forms the angles in float64 and rounds
  cos/sin once to float32, so they agree to float32 rounding of values in [-1, 1]: 2^-24 ~ 6e-8,
  checked at 1e-7; the float64 path agrees to 1e-12 (float64 cos/sin of angles below 100).
* Against transformers: it forms the angle p * inv_freq in float32, off by up to p * 2 * 2^-24
  rad (7.6e-6 at the positions p < 64 used here), so tables agree to 1e-5; the rotated q, k
  (|x| ~ 4, the same float32 products) to 1e-5 * 4 plus rounding: 5e-5.
"""

from __future__ import annotations

import math
import types

import pytest
import torch

import ropelib
from ropelib.kernels import native_build
from ropelib.rotary.mrope import MRotaryEmbedding, mrope_axes, mrope_positions, mrope_tables

transformers = pytest.importorskip("transformers")


def reference_angles(positions: torch.Tensor, section: list[int], theta: float, interleaved: bool) -> torch.Tensor:
    """Angles ``[seq, r/2]`` of ``[3, seq]`` positions in Python floats, axis of each pair written out."""
    pairs = sum(section)
    rotary_dim = 2 * pairs
    axes = []
    for i in range(pairs):
        if interleaved:
            axis = 1 if i % 3 == 1 and i < 3 * section[1] else 2 if i % 3 == 2 and i < 3 * section[2] else 0
        else:
            axis = 0 if i < section[0] else 1 if i < section[0] + section[1] else 2
        axes.append(axis)
    rows = [
        [int(positions[axes[i], s]) * theta ** (-2.0 * i / rotary_dim) for i in range(pairs)]
        for s in range(positions.shape[1])
    ]
    return torch.tensor(rows, dtype=torch.float64)


# ----------------------------------------------------------------------------- positions


def test_positions_of_text_and_an_image() -> None:
    # 2 text tokens, a 1 x 2 x 3 grid, 2 text tokens: the text after the image starts at 2 + max(1, 2, 3) = 5.
    positions = mrope_positions([2, (1, 2, 3), 2])
    assert positions.tolist() == [
        [0, 1, 2, 2, 2, 2, 2, 2, 5, 6],
        [0, 1, 2, 2, 2, 3, 3, 3, 5, 6],
        [0, 1, 2, 3, 4, 2, 3, 4, 5, 6],
    ]
    assert positions.dtype == torch.int64
    assert mrope_positions([]).shape == (3, 0)


def test_positions_match_transformers_get_rope_index() -> None:
    # Qwen2VLModel.get_rope_index on one sequence of text, an image grid of 1 x 4 x 6 patches
    # (merged 2 x 2 into 1 x 2 x 3 tokens) and text; it reads only the merge size from its model.
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel

    grid = (1, 4, 6)
    tokens = 3 + 6 + 4
    token_types = torch.tensor([[0] * 3 + [1] * 6 + [0] * 4])
    fake = types.SimpleNamespace(
        config=types.SimpleNamespace(vision_config=types.SimpleNamespace(spatial_merge_size=2)),
        get_vision_position_ids=lambda *a, **k: Qwen2VLModel.get_vision_position_ids(None, *a, **k),
    )
    want, _ = Qwen2VLModel.get_rope_index(
        fake, torch.zeros(1, tokens, dtype=torch.long), token_types, image_grid_thw=torch.tensor([grid])
    )
    assert torch.equal(mrope_positions([3, grid, 4], spatial_merge_size=2), want[:, 0])


def test_axes_of_the_two_conventions() -> None:
    assert mrope_axes([2, 3, 3]).tolist() == [0, 0, 1, 1, 1, 2, 2, 2]  # Qwen2-VL: contiguous
    assert mrope_axes([2, 3, 3], interleaved=True).tolist() == [0, 1, 2, 0, 1, 2, 0, 1]  # Qwen3-VL
    assert mrope_axes([4, 2, 2], interleaved=True).tolist() == [0, 1, 2, 0, 1, 2, 0, 0]


# ----------------------------------------------------------------------------- tables


@pytest.mark.parametrize("interleaved", [False, True])
def test_tables_match_the_float64_reference(interleaved: bool) -> None:
    section = [2, 3, 3]
    positions = mrope_positions([3, (2, 4, 6), 5], spatial_merge_size=2)
    rope = MRotaryEmbedding(head_dim=16, mrope_section=section, interleaved=interleaved)
    want = reference_angles(positions, section, 10000.0, interleaved)
    for dtype, atol in ((torch.float32, 1e-7), (torch.float64, 1e-12)):
        cos, sin = rope.tables(positions, dtype)
        assert cos.dtype == dtype and cos.shape == (positions.shape[1], 8)
        assert (cos.double() - want.cos()).abs().max() <= atol
        assert (sin.double() - want.sin()).abs().max() <= atol


def hf_text_rotary(kind: str, section: list[int], head_dim: int = 16) -> torch.nn.Module:
    """transformers' own M-RoPE module: Qwen2-VL (contiguous sections) or Qwen3-VL (interleaved)."""
    params = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section}
    if kind == "qwen2_vl":
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRotaryEmbedding

        config = transformers.Qwen2VLTextConfig(hidden_size=4 * head_dim, num_attention_heads=4, rope_parameters=params)
        return Qwen2VLRotaryEmbedding(config)
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    config = transformers.Qwen3VLTextConfig(
        hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim, rope_parameters=params
    )
    return Qwen3VLTextRotaryEmbedding(config)


@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen3_vl"])
def test_tables_and_rotation_match_transformers(kind: str) -> None:
    from transformers.models.qwen2_vl.modeling_qwen2_vl import apply_rotary_pos_emb

    section = [2, 3, 3]
    theirs = hf_text_rotary(kind, section)
    ours = MRotaryEmbedding(head_dim=16, mrope_section=section, interleaved=kind == "qwen3_vl", kernel="torch")
    one = mrope_positions([3, (1, 4, 6), 4], spatial_merge_size=2)
    other = mrope_positions([1, (2, 2, 4), 8], spatial_merge_size=2)
    positions = torch.stack((one, other), dim=1)  # [3, batch 2, seq 13]
    x = torch.zeros(1)
    with torch.no_grad():
        cos, sin = theirs(x, positions)  # [2, 13, 16]: each pair written twice (rotate_half layout)
    my_cos, my_sin = ours.tables(positions)
    assert torch.allclose(cos, torch.cat((my_cos, my_cos), -1), atol=1e-5, rtol=0.0)
    assert torch.allclose(sin, torch.cat((my_sin, my_sin), -1), atol=1e-5, rtol=0.0)
    generator = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 13, 4, 16, generator=generator), torch.randn(2, 13, 2, 16, generator=generator)
    want_q, want_k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    got_q, got_k = ours(q, k, positions)
    assert torch.allclose(got_q, want_q.transpose(1, 2), atol=5e-5, rtol=0.0)
    assert torch.allclose(got_k, want_k.transpose(1, 2), atol=5e-5, rtol=0.0)


@pytest.mark.parametrize("kind,section", [("qwen2_vl", [2, 1, 3]), ("qwen3_vl", [3, 2, 1])])
def test_unequal_height_and_width_sections_match_transformers(kind: str, section: list[int]) -> None:
    # Height and width get different numbers of pairs (1 and 3; 2 and 1), and the image grids
    # have different heights and widths: swapping the two axes' sections (or positions) changes
    # the tables, so this comparison with transformers' own module and apply would catch it.
    from transformers.models.qwen2_vl.modeling_qwen2_vl import apply_rotary_pos_emb

    from ropelib.integrations.huggingface import HFRotaryEmbedding

    interleaved = kind == "qwen3_vl"
    theirs = hf_text_rotary(kind, section, head_dim=12)
    one = mrope_positions([2, (1, 4, 6), 3], spatial_merge_size=2)  # a 1 x 2 x 3 grid of tokens
    other = mrope_positions([1, (2, 2, 4), 6], spatial_merge_size=2)  # a 2 x 1 x 2 grid
    positions = torch.stack((one, other), dim=1)  # [3, batch 2, seq 11]
    assert not torch.equal(positions[1], positions[2])  # height and width positions differ
    x = torch.zeros(1)
    with torch.no_grad():
        cos, sin = theirs(x, positions)  # [2, 11, 12]
    ours = MRotaryEmbedding(head_dim=12, mrope_section=section, interleaved=interleaved, kernel="torch")
    my_cos, my_sin = ours.tables(positions)
    assert torch.allclose(cos, torch.cat((my_cos, my_cos), -1), atol=1e-5, rtol=0.0)
    assert torch.allclose(sin, torch.cat((my_sin, my_sin), -1), atol=1e-5, rtol=0.0)
    module = HFRotaryEmbedding({"head_dim": 12}, mrope_section=section, mrope_interleaved=interleaved)
    hf_cos, hf_sin = module(x, positions)
    assert torch.allclose(cos, hf_cos, atol=1e-5, rtol=0.0) and torch.allclose(sin, hf_sin, atol=1e-5, rtol=0.0)
    generator = torch.Generator().manual_seed(5)
    q, k = torch.randn(2, 11, 4, 12, generator=generator), torch.randn(2, 11, 2, 12, generator=generator)
    want_q, want_k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    got_q, got_k = ours(q, k, positions)
    assert torch.allclose(got_q, want_q.transpose(1, 2), atol=5e-5, rtol=0.0)
    assert torch.allclose(got_k, want_k.transpose(1, 2), atol=5e-5, rtol=0.0)


@pytest.mark.parametrize("kernel", ["torch", "triton"] + (["native"] if native_build.enabled() else []))
def test_rotation_float64_and_kernels_agree_with_the_reference(kernel: str) -> None:
    # Each kernel's float64 rotation against float64 tables from Python's math; its float32 result
    # against it to float32 rounding of |x| ~ 4 values (1e-5).
    if kernel == "triton":
        pytest.importorskip("triton")
    section = [2, 3, 3]
    positions = mrope_positions([2, (1, 4, 4), 3], spatial_merge_size=2)  # [3, 9]
    angles = reference_angles(positions, section, 10000.0, False)
    q = torch.randn(1, 9, 2, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    want = ropelib.apply_rotary(q, angles.cos(), angles.sin(), layout="half")
    rope = MRotaryEmbedding(head_dim=16, mrope_section=section, kernel=kernel)
    got64, _ = rope(q, q, positions)
    got32, _ = rope(q.float(), q.float(), positions)
    assert (got64 - want).abs().max() <= 1e-12
    assert (got32.double() - want).abs().max() <= 1e-5


def test_text_only_positions_are_plain_rope() -> None:
    # The same position on all three axes: M-RoPE is 1-D RoPE, whatever the sections.
    q = torch.randn(2, 7, 2, 16, generator=torch.Generator().manual_seed(2))
    positions = torch.arange(7).expand(3, 7)
    for interleaved in (False, True):
        mrope = MRotaryEmbedding(head_dim=16, theta=500.0, mrope_section=[4, 2, 2], interleaved=interleaved)
        assert torch.allclose(mrope(q, q, positions)[0], ropelib.RotaryEmbedding(16, 500.0)(q, q)[0], atol=1e-6)


def test_unchecked_tables_broadcast_over_batch() -> None:
    inv = ropelib.RotaryEmbedding(8).cache.inv_freq
    positions = torch.arange(5).expand(3, 2, 5)
    cos, sin = mrope_tables(inv, positions, mrope_axes([2, 1, 1]))
    assert cos.shape == sin.shape == (2, 5, 4)


# ----------------------------------------------------------------------------- argument checks


def test_argument_checks() -> None:
    with pytest.raises(ValueError, match="mrope_section must sum to rotary_dim / 2 = 8"):
        MRotaryEmbedding(head_dim=16, mrope_section=[16, 24, 24])
    with pytest.raises(ValueError, match="mrope_section must have 3 entries"):
        MRotaryEmbedding(head_dim=16, mrope_section=[4, 4])
    with pytest.raises(TypeError, match="mrope_section must be a sequence"):
        mrope_axes(8)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="interleaved must be a bool"):
        mrope_axes([2, 1, 1], interleaved=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="scaling must not be 'dynamic'"):
        MRotaryEmbedding(
            head_dim=8,
            mrope_section=[2, 1, 1],
            scaling={"rope_type": "dynamic", "factor": 2.0},
            max_position_embeddings=64,
        )
    with pytest.raises(TypeError, match="segments must be a sequence"):
        mrope_positions(5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"segments\[1\] must be a \(t, h, w\) grid"):
        mrope_positions([2, (1, 2)])
    with pytest.raises(ValueError, match="divisible by spatial_merge_size=2"):
        mrope_positions([(1, 3, 4)], spatial_merge_size=2)
    with pytest.raises(ValueError, match=r"segments\[0\] must be >= 0"):
        mrope_positions([-1])
    rope = MRotaryEmbedding(head_dim=8, mrope_section=[2, 1, 1])
    q = torch.zeros(1, 4, 2, 8)
    with pytest.raises(TypeError, match="positions must be an integer"):
        rope(q, q, torch.zeros(3, 4))
    with pytest.raises(ValueError, match=r"positions must have shape \[3, seq\]"):
        rope(q, q, torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="4 positions per axis"):
        rope(q, q, torch.zeros(3, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="positions must be >= 0"):
        rope(q, q, torch.full((3, 4), -1))
    with pytest.raises(ValueError, match="head_dim"):
        rope(torch.zeros(1, 4, 2, 6), torch.zeros(1, 4, 2, 6), torch.zeros(3, 4, dtype=torch.long))


def test_float_angles_of_large_positions() -> None:
    # At position 100 000 a float32 angle is off by up to 0.012 rad; ropelib's tables are exact to 1e-7.
    rope = MRotaryEmbedding(head_dim=8, mrope_section=[2, 1, 1])
    positions = torch.tensor([[100_000], [7], [100_003]])
    cos, _ = rope.tables(positions)
    want = [
        math.cos(100_000),
        math.cos(100_000 * 10000**-0.25),
        math.cos(7 * 10000**-0.5),
        math.cos(100_003 * 10000**-0.75),
    ]
    assert (cos[0].double() - torch.tensor(want, dtype=torch.float64)).abs().max() <= 1e-7


@pytest.mark.parametrize("kernel", ["triton"] + (["native"] if native_build.enabled() else []))
def test_kernels_take_per_token_tables(kernel: str) -> None:
    # The C loop and the fused Triton kernel (Triton's interpreter without CUDA) with one table row
    # per token, against the PyTorch kernel.
    if kernel == "triton":
        pytest.importorskip("triton")
    positions = torch.stack((mrope_positions([2, (1, 2, 4), 1], spatial_merge_size=2),) * 2, dim=1)  # [3, 2, 5]
    q = torch.randn(2, 5, 2, 16, generator=torch.Generator().manual_seed(3))
    k = torch.randn(2, 5, 1, 16, generator=torch.Generator().manual_seed(4))
    torch_rope = MRotaryEmbedding(head_dim=16, mrope_section=[2, 3, 3], kernel="torch")
    other_rope = MRotaryEmbedding(head_dim=16, mrope_section=[2, 3, 3], kernel=kernel)
    for want, got in zip(torch_rope(q, k, positions), other_rope(q, k, positions)):
        assert torch.allclose(want, got, atol=1e-6, rtol=0.0)  # the same float32 products, in another order
