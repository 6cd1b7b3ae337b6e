"""Every bad input raises ValueError (right kind, wrong size or range) or TypeError (wrong kind),
with a message that names the offending argument."""

from __future__ import annotations

import pytest
import torch

from ropelib import (
    LearnedPositionalEmbedding,
    LinearAttention,
    MultiHeadAttention,
    RotaryEmbedding,
    ShawRelativePosition,
    SinusoidalPositionalEncoding,
    T5RelativeBias,
    alibi_bias,
    alibi_slopes,
    apply_rotary,
    apply_rotary_emb,
    convert_rotary_layout,
    cos_sin_table,
    elu_feature_map,
    layout_permutation,
    linear_attention,
    linear_attention_weights,
    precompute_pos_cis,
    relative_positions,
    rope_frequencies,
    rotate_half,
    sinusoidal_encoding,
    sinusoidal_shift_matrix,
    t5_relative_bucket,
)

Q = torch.zeros(2, 4, 3, 8)  # [batch, seq, heads, head_dim]
COS = torch.ones(4, 4)  # [seq, head_dim / 2]
X = torch.zeros(2, 4, 8)  # [batch, seq, embed]


def rope_qk(**kw):
    return lambda: RotaryEmbedding(8)(kw.get("q", Q), kw.get("k", Q), kw.get("positions"))


# ----------------------------------------------------------------------------- odd rotary dimensions

ODD_DIM = [
    ("head_dim must be even", lambda: RotaryEmbedding(7)),
    ("rotary_dim must be even", lambda: RotaryEmbedding(8, rotary_dim=5)),
    ("rotary_dim must be <= head_dim=8", lambda: RotaryEmbedding(8, rotary_dim=10)),
    ("dim must be even", lambda: precompute_pos_cis(7)),
    (
        "xq's head_dim must be even",
        lambda: apply_rotary_emb(
            torch.zeros(1, 2, 1, 5), torch.zeros(1, 2, 1, 5), torch.ones(2, 2, dtype=torch.complex64)
        ),
    ),
    ("dim must be even", lambda: sinusoidal_encoding(4, 5)),
    ("dim must be even", lambda: sinusoidal_shift_matrix(1, 5)),
    ("dim must be even", lambda: SinusoidalPositionalEncoding(5)),
    ("head_dim must be even", lambda: rope_frequencies(9)),
    (
        r"rotary dim \(head_dim \* partial_rotary_factor\) must be even",
        lambda: rope_frequencies(12, partial_rotary_factor=0.25),
    ),
    ("partial_rotary_factor must be in", lambda: rope_frequencies(8, partial_rotary_factor=1.5)),
    ("rotary_dim must be even", lambda: layout_permutation(5, "half", "interleaved")),
    (
        "rotary_dim must be even",
        lambda: convert_rotary_layout(torch.zeros(16, 4), 2, 8, src="half", dst="interleaved", rotary_dim=3),
    ),
    (
        "rotary_dim must be <= head_dim=8",
        lambda: convert_rotary_layout(torch.zeros(16, 4), 2, 8, src="half", dst="interleaved", rotary_dim=10),
    ),
    ("head_dim must be even", lambda: MultiHeadAttention(9, 3, "rope")),
    ("head_dim must be even", lambda: LinearAttention(9, 3)),
]


@pytest.mark.parametrize("match, call", ODD_DIM)
def test_odd_rotary_dimension(match, call) -> None:
    with pytest.raises(ValueError, match=match):
        call()


# ----------------------------------------------------------------------------- shapes that do not match

SHAPES = [
    ("q and k must have head_dim=8", rope_qk(q=torch.zeros(2, 4, 3, 6), k=torch.zeros(2, 4, 3, 6))),
    ("q and k must have head_dim=8", rope_qk(k=torch.zeros(2, 4, 3, 6))),
    (r"q and k must share \[batch, seq\]", rope_qk(k=torch.zeros(2, 5, 3, 8))),
    (r"q and k must share \[batch, seq\]", rope_qk(k=torch.zeros(1, 4, 3, 8))),
    ("cos and sin must have the same shape", lambda: apply_rotary(Q, COS, torch.ones(4, 3))),
    (r"cos and sin must have shape \[4, r/2\]", lambda: apply_rotary(Q, torch.ones(5, 4), torch.ones(5, 4))),
    (
        r"cos and sin must have shape \[4, r/2\] or \[2, 4, r/2\]",
        lambda: apply_rotary(Q, torch.ones(3, 4, 4), torch.ones(3, 4, 4)),
    ),
    ("cos has 5 pairs but x has only 8 features", lambda: apply_rotary(Q, torch.ones(4, 5), torch.ones(4, 5))),
    (
        "xq and xk must share",
        lambda: apply_rotary_emb(Q, torch.zeros(2, 5, 3, 8), torch.ones(4, 4, dtype=torch.complex64)),
    ),
    (
        "xq and xk must share",
        lambda: apply_rotary_emb(Q, torch.zeros(2, 4, 3, 6), torch.ones(4, 4, dtype=torch.complex64)),
    ),
    (
        r"pos_cis must have shape \[seq_len, head_dim // 2\]",
        lambda: apply_rotary_emb(Q, Q, precompute_pos_cis(8, end=16)),
    ),
    (
        r"pos_cis must have shape \[seq_len, head_dim // 2\]",
        lambda: apply_rotary_emb(Q, Q, precompute_pos_cis(16, end=4)),
    ),
    (r"positions must have shape \[4\] or \[2, 4\]", rope_qk(positions=torch.arange(5))),
    (r"positions must have shape \[4\] or \[2, 4\]", rope_qk(positions=torch.zeros(3, 4, dtype=torch.long))),
    ("q, k must have equal shapes", lambda: linear_attention(Q, torch.zeros(2, 5, 3, 8), Q)),
    ("q, k must have equal shapes and v the same", lambda: linear_attention(Q, Q, torch.zeros(2, 4, 2, 8))),
    ("q and k must have equal shapes", lambda: linear_attention_weights(Q, torch.zeros(2, 5, 3, 8))),
    ("x must have last dimension embed_dim=8", lambda: MultiHeadAttention(8, 2)(torch.zeros(2, 4, 6))),
    ("x must have last dimension 8", lambda: SinusoidalPositionalEncoding(8)(torch.zeros(2, 4, 6))),
    ("x must have last dimension 8", lambda: LearnedPositionalEmbedding(16, 8)(torch.zeros(2, 4, 6))),
    (
        "q must have last dimension 4",
        lambda: ShawRelativePosition(4).score_bias(torch.zeros(1, 2, 3, 5), relative_positions(3)),
    ),
    (
        r"relative_position must have shape \[3, key_len\]",
        lambda: ShawRelativePosition(4).score_bias(torch.zeros(1, 2, 3, 4), relative_positions(2)),
    ),
    (
        r"weight must have shape \[16, in_features\]",
        lambda: convert_rotary_layout(torch.zeros(12, 4), 2, 8, src="half", dst="interleaved"),
    ),
]


@pytest.mark.parametrize("match, call", SHAPES)
def test_mismatched_shapes(match, call) -> None:
    with pytest.raises(ValueError, match=match):
        call()


# ----------------------------------------------------------------------------- wrong rank

RANK = [
    ("x must have 4 dimensions", lambda: apply_rotary(torch.zeros(4, 3, 8), COS, COS)),
    ("q must have 4 dimensions", rope_qk(q=torch.zeros(4, 3, 8))),
    ("k must have 4 dimensions", rope_qk(k=torch.zeros(2, 4, 3, 8, 1))),
    (
        "xq must have 4 dimensions",
        lambda: apply_rotary_emb(torch.zeros(4, 8), Q, torch.ones(4, 4, dtype=torch.complex64)),
    ),
    ("x must have 3 dimensions", lambda: MultiHeadAttention(8, 2)(Q)),
    ("x must have 3 dimensions", lambda: LinearAttention(8, 2)(Q)),
    ("x must have 3 dimensions", lambda: SinusoidalPositionalEncoding(8)(torch.zeros(4, 8))),
    ("x must have 3 dimensions", lambda: LearnedPositionalEmbedding(8, 8)(torch.zeros(4, 8))),
    ("v must have 4 dimensions", lambda: linear_attention(Q, Q, torch.zeros(2, 4, 24))),
    ("q must have 4 dimensions", lambda: linear_attention_weights(torch.zeros(4, 3, 8), Q)),
    (r"positions must have shape \[4\] or \[2, 4\]", rope_qk(positions=torch.zeros(2, 4, 1, dtype=torch.long))),
    (r"positions must have shape \[4\] or \[2, 4\]", rope_qk(positions=torch.tensor(0))),
    ("relative_position must have at least 2 dimensions", lambda: T5RelativeBias(2)(torch.arange(3))),
    ("inv_freq must have 1 dimensions", lambda: cos_sin_table(torch.ones(2, 4), torch.arange(3))),
    (
        "q must have 4 dimensions",
        lambda: ShawRelativePosition(4).score_bias(torch.zeros(2, 3, 4), relative_positions(3)),
    ),
]


@pytest.mark.parametrize("match, call", RANK)
def test_wrong_rank(match, call) -> None:
    with pytest.raises(ValueError, match=match):
        call()


# ----------------------------------------------------------------------------- positions

NEGATIVE = torch.tensor([0, 1, -1, 2])
FLOATING = torch.tensor([0.0, 1.0, 2.0, 3.0])


def mha_call(kind: str, positions: torch.Tensor):
    options = {"max_positions": 16} if kind == "learned" else {}
    return lambda: MultiHeadAttention(8, 2, kind, **options)(X, positions)


def position_consumers(positions: torch.Tensor):
    """Every public entry point that takes positions, called with ``positions``."""
    return [
        rope_qk(positions=positions),
        lambda: SinusoidalPositionalEncoding(8)(X, positions),
        lambda: LearnedPositionalEmbedding(16, 8)(X, positions),
        *[mha_call(kind, positions) for kind in ("none", "sinusoidal", "learned", "t5", "alibi", "shaw", "rope")],
        lambda: linear_attention(Q, Q, Q, rope=RotaryEmbedding(8), positions=positions),
        lambda: linear_attention(Q, Q, Q, positions=positions),  # checked even without a rotation
        lambda: linear_attention_weights(Q, Q, rope=RotaryEmbedding(8), positions=positions),
        lambda: linear_attention_weights(Q, Q, positions=positions),
        lambda: LinearAttention(8, 2)(X, positions),
        lambda: LinearAttention(8, 2, rope=False)(X, positions),
    ]


@pytest.mark.parametrize("call", position_consumers(NEGATIVE))
def test_negative_positions(call) -> None:
    with pytest.raises(ValueError, match="positions must be >= 0, got a minimum of -1"):
        call()


@pytest.mark.parametrize("call", position_consumers(FLOATING))
def test_floating_positions(call) -> None:
    with pytest.raises(TypeError, match="positions must be an integer tensor, got torch.float32"):
        call()


@pytest.mark.parametrize(
    "bad", [torch.tensor([True, False, True, True]), [0, 1, 2, 3], torch.tensor([0, 1, 2, 3], dtype=torch.complex64)]
)
def test_positions_of_other_kinds(bad) -> None:
    with pytest.raises(TypeError, match="positions must be an integer"):
        RotaryEmbedding(8)(Q, Q, bad)


def test_cos_sin_table_rejects_floating_positions() -> None:
    with pytest.raises(TypeError, match="positions must be an integer torch.Tensor"):
        cos_sin_table(torch.ones(4), torch.tensor([0.5]))


def test_positions_past_learned_table() -> None:
    with pytest.raises(ValueError, match=r"positions must be < 8 \(the table's size\), got a maximum of 8"):
        LearnedPositionalEmbedding(8, 8)(X, torch.tensor([5, 6, 7, 8]))
    with pytest.raises(ValueError, match="positions must be < 8"):
        MultiHeadAttention(8, 2, "learned", max_positions=8)(X, torch.tensor([[0, 1, 2, 3], [6, 7, 8, 9]]))
    with pytest.raises(ValueError, match="x has 9 positions but the learned table has only 8"):
        LearnedPositionalEmbedding(8, 8)(torch.zeros(1, 9, 8))


# ----------------------------------------------------------------------------- choices

LAYOUT_ERRORS = [
    (
        ValueError,
        r"layout must be one of \['half', 'interleaved'\], got 'neox'",
        lambda: RotaryEmbedding(8, layout="neox"),
    ),
    (ValueError, "layout must be one of", lambda: apply_rotary(Q, COS, COS, layout="gptj")),
    (TypeError, "layout must be a str", lambda: RotaryEmbedding(8, layout=1)),
    (ValueError, "src must be one of", lambda: convert_rotary_layout(torch.zeros(16, 4), 2, 8, src="meta", dst="half")),
    (ValueError, "dst must be one of", lambda: layout_permutation(8, "half", "hf")),
    (ValueError, "layout must be one of", lambda: MultiHeadAttention(8, 2, "rope", layout="complex")),
    (
        ValueError,
        r"kernel must be one of \['auto', 'torch', 'native', 'triton'\], got 'cuda'",
        lambda: RotaryEmbedding(8, kernel="cuda"),
    ),
    (ValueError, "position must be one of", lambda: MultiHeadAttention(8, 2, "xpos2")),
    (
        ValueError,
        r"position='t5' takes options .* got unknown \['theta'\]",
        lambda: MultiHeadAttention(8, 2, "t5", theta=10.0),
    ),
    (ValueError, "position='learned' needs max_positions", lambda: MultiHeadAttention(8, 2, "learned")),
    (
        ValueError,
        "max_positions applies to position='learned' only",
        lambda: MultiHeadAttention(8, 2, "rope", max_positions=8),
    ),
]


@pytest.mark.parametrize("error, match, call", LAYOUT_ERRORS)
def test_unknown_choices(error, match, call) -> None:
    with pytest.raises(error, match=match):
        call()


# ----------------------------------------------------------------------------- head counts

HEADS = [
    ("num_heads=3 must divide embed_dim=8", lambda: MultiHeadAttention(8, 3)),
    ("num_kv_heads=3 must divide num_heads=4", lambda: MultiHeadAttention(8, 4, num_kv_heads=3)),
    ("num_kv_heads must be >= 1", lambda: MultiHeadAttention(8, 4, num_kv_heads=0)),
    ("num_heads must be >= 1", lambda: MultiHeadAttention(8, 0)),
    ("num_heads=4 must divide embed_dim=10", lambda: LinearAttention(10, 4)),
    ("num_heads must be >= 1", lambda: alibi_slopes(0)),
    ("num_heads must be >= 1", lambda: alibi_bias(0, 3)),
    ("num_heads must be >= 1", lambda: T5RelativeBias(0)),
]


@pytest.mark.parametrize("match, call", HEADS)
def test_head_counts(match, call) -> None:
    with pytest.raises(ValueError, match=match):
        call()


# ----------------------------------------------------------------------------- integers where floats belong

INT = torch.zeros(2, 4, 3, 8, dtype=torch.long)
INT_ERRORS = [
    ("x must be a floating-point tensor", lambda: apply_rotary(INT, COS, COS)),
    ("cos must be a floating-point tensor", lambda: apply_rotary(Q, COS.long(), COS)),
    ("sin must be a floating-point tensor", lambda: apply_rotary(Q, COS, COS.int())),
    ("q must be a floating-point tensor", rope_qk(q=INT)),
    ("k must be a floating-point tensor", rope_qk(k=INT.int())),
    ("xq must be a floating-point tensor", lambda: apply_rotary_emb(INT, Q, torch.ones(4, 4, dtype=torch.complex64))),
    ("xk must be a floating-point tensor", lambda: apply_rotary_emb(Q, INT, torch.ones(4, 4, dtype=torch.complex64))),
    ("pos_cis must be a complex tensor", lambda: apply_rotary_emb(Q, Q, torch.ones(4, 4))),
    ("x must be a floating-point tensor", lambda: SinusoidalPositionalEncoding(8)(X.long())),
    ("x must be a floating-point tensor", lambda: LearnedPositionalEmbedding(8, 8)(X.long())),
    ("x must be a floating-point tensor", lambda: MultiHeadAttention(8, 2)(X.long())),
    ("x must be a floating-point tensor", lambda: LinearAttention(8, 2)(X.long())),
    ("v must be a floating-point tensor", lambda: linear_attention(Q, Q, INT)),
    ("k must be a floating-point tensor", lambda: linear_attention_weights(Q, INT)),
    (
        "weight must be a floating-point tensor",
        lambda: convert_rotary_layout(torch.zeros(16, 4, dtype=torch.long), 2, 8, src="half", dst="interleaved"),
    ),
    (
        "inv_freq must be a floating-point tensor",
        lambda: cos_sin_table(torch.ones(4, dtype=torch.long), torch.arange(3)),
    ),
    (
        "q must be a floating-point tensor",
        lambda: ShawRelativePosition(4).score_bias(torch.zeros(1, 2, 3, 4, dtype=torch.long), relative_positions(3)),
    ),
    ("dtype must be a floating dtype", lambda: sinusoidal_encoding(4, 8, dtype=torch.int64)),
    ("x must be a torch.Tensor", lambda: apply_rotary([[1.0]], COS, COS)),
]


@pytest.mark.parametrize("match, call", INT_ERRORS)
def test_integer_tensors_where_floats_belong(match, call) -> None:
    with pytest.raises(TypeError, match=match):
        call()


# ----------------------------------------------------------------------------- scalar arguments

SCALAR_TYPE = [
    ("head_dim must be an int, got float", lambda: RotaryEmbedding(8.0)),
    ("head_dim must be an int, got bool", lambda: RotaryEmbedding(True)),
    ("shift must be an int, got float", lambda: sinusoidal_shift_matrix(1.5, 4)),
    ("num_positions must be an int, got float", lambda: sinusoidal_encoding(4.0, 8)),
    ("num_positions must be an int, got float", lambda: MultiHeadAttention(8, 2, "learned", max_positions=4.0)),
    ("end must be an int", lambda: precompute_pos_cis(8, end=10.0)),
    ("theta must be a real number", lambda: RotaryEmbedding(8, theta="1e4")),
    ("bidirectional must be a bool", lambda: t5_relative_bucket(torch.arange(3), bidirectional=1)),
    ("causal must be a bool", lambda: MultiHeadAttention(8, 2, causal=1)),
    ("relative_position must be an integer tensor", lambda: t5_relative_bucket(torch.zeros(3))),
    ("relative_position must be an integer torch.Tensor", lambda: T5RelativeBias(2)([[0, 1], [-1, 0]])),
    ("scale must be a real number", lambda: SinusoidalPositionalEncoding(8, scale="a")),
]


@pytest.mark.parametrize("match, call", SCALAR_TYPE)
def test_scalar_types(match, call) -> None:
    with pytest.raises(TypeError, match=match):
        call()


SCALAR_VALUE = [
    ("theta must be a finite number > 0, got -1.0", lambda: RotaryEmbedding(8, theta=-1.0)),
    ("theta must be a finite number > 0, got inf", lambda: rope_frequencies(8, theta=float("inf"))),
    ("base must be a finite number > 0", lambda: sinusoidal_encoding(4, 8, base=0.0)),
    ("end must be >= 1", lambda: precompute_pos_cis(8, end=0)),
    ("num_positions must be >= 0", lambda: sinusoidal_encoding(-1, 8)),
    ("query_len must be >= 0", lambda: relative_positions(-1)),
    ("offset must be >= 0", lambda: relative_positions(3, offset=-1)),
    ("length must be >= 0", lambda: RotaryEmbedding(8).cos_sin_cache(-1)),
    ("num_buckets must be even when bidirectional", lambda: t5_relative_bucket(torch.arange(3), True, 31)),
    ("max_distance must be > 8", lambda: t5_relative_bucket(torch.arange(3), True, 32, 8)),
    ("max_relative_position must be >= 1", lambda: ShawRelativePosition(4, max_relative_position=0)),
    (
        "this ShawRelativePosition was built with values=False",
        lambda: ShawRelativePosition(4, values=False).value_term(torch.zeros(1, 1, 3, 3), relative_positions(3)),
    ),
    ("scale must be a finite number > 0", lambda: SinusoidalPositionalEncoding(8, scale=float("nan"))),
]


@pytest.mark.parametrize("match, call", SCALAR_VALUE)
def test_scalar_values(match, call) -> None:
    with pytest.raises(ValueError, match=match):
        call()


def test_q_and_k_must_share_dtype() -> None:
    with pytest.raises(ValueError, match="q and k must share dtype and device"):
        RotaryEmbedding(8)(Q, Q.double())


def test_rotate_half_needs_an_even_floating_last_dimension() -> None:
    with pytest.raises(ValueError, match="x must have an even last dimension"):
        rotate_half(torch.zeros(2, 5))
    with pytest.raises(TypeError, match="x must be a floating-point tensor"):
        rotate_half(torch.zeros(2, 4, dtype=torch.long))


def test_elu_feature_map_needs_a_floating_tensor() -> None:
    with pytest.raises(TypeError, match="x must be a floating-point tensor"):
        elu_feature_map(torch.ones(3, dtype=torch.int32))
