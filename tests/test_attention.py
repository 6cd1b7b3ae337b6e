"""Attention with each position encoding, and linear attention with RoPE (ropelib.attention).

The reference below recomputes multi-head attention from the module's own weights with explicit
loops over batch and heads in float64, applying every encoding from its paper's formula
(conftest's rotation matrices and sinusoid table, a scalar T5 bucket function, ALiBi slopes
written out by hand, Shaw's clipped tables by index arithmetic), and an explicit softmax.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from ropelib import (
    POSITION_ENCODINGS,
    LinearAttention,
    MultiHeadAttention,
    RotaryEmbedding,
    linear_attention,
    linear_attention_weights,
)

from hot_path import graph_breaks, tensor_to_python_calls
from references import attention_ref, rotate_ref, sinusoid_ref

# float64 module vs float64 loops: a few hundred float64 operations per entry, values O(1);
# 1e-12 is ~10^4 ulps of margin while any real discrepancy (a wrong bias, a missing rotation)
# is orders of magnitude larger.
TIGHT64 = dict(rtol=0.0, atol=1e-12)

# ALiBi slopes by the paper's rule (Press et al., 2022), written out: 4 heads 2^-2, 2^-4, 2^-6, 2^-8;
# 12 heads: 8 heads' 2^-1 .. 2^-8, then 2^-0.5, 2^-1.5, 2^-2.5, 2^-3.5 (every other of 16 heads').
ALIBI_SLOPES = {
    4: [2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8],
    12: [2.0**-h for h in range(1, 9)] + [2**-0.5, 2**-1.5, 2**-2.5, 2**-3.5],
}

# The encodings of the book's first parts, whose float64 references are written below; the later ones
# (KERPLE, FIRE, CoPE, p-RoPE, ...) are tested against their papers' definitions in their own test files.
CLASSIC = ("none", "sinusoidal", "learned", "t5", "alibi", "shaw", "rope")
ENCODED = [p for p in CLASSIC if p != "none"]


def test_the_classic_encodings_are_registered() -> None:
    assert set(CLASSIC) <= set(POSITION_ENCODINGS)


def t5_bucket_ref(rel: int, bidirectional: bool, num_buckets: int = 32, max_distance: int = 128) -> int:
    """T5's bucket of one relative position ``j - i`` (Raffel et al., 2020), scalar arithmetic."""
    n, offset = -rel, 0
    if bidirectional:
        num_buckets //= 2
        offset = num_buckets if n < 0 else 0
        n = abs(n)
    else:
        n = max(n, 0)
    max_exact = num_buckets // 2
    if n < max_exact:
        return offset + n
    log_part = int(math.log(n / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact))
    return offset + min(num_buckets - 1, max_exact + log_part)


def linear(x: torch.Tensor, layer: torch.nn.Linear) -> torch.Tensor:
    out = x @ layer.weight.double().T
    return out + layer.bias.double() if layer.bias is not None else out


def mha_ref(module: MultiHeadAttention, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
    """MultiHeadAttention.forward, recomputed in float64 with loops."""
    B, S, E = x.shape
    H, KV, d = module.num_heads, module.num_kv_heads, module.head_dim
    pos = torch.arange(S) if positions is None else positions
    pos = pos.expand(B, S) if pos.ndim == 1 else pos
    kind, enc = module.position, module.encoding
    x = x.double()
    if kind == "sinusoidal":
        x = x + torch.stack([sinusoid_ref(pos[b].tolist(), E, enc.base) for b in range(B)])
    if kind == "learned":
        x = x + enc.weight.double()[pos]
    q = linear(x, module.q_proj).view(B, S, H, d)
    k = linear(x, module.k_proj).view(B, S, KV, d)
    v = linear(x, module.v_proj).view(B, S, KV, d)
    if kind == "rope":
        kw = dict(theta=enc.theta, layout=enc.layout, rotary_dim=enc.rotary_dim)
        q, k = rotate_ref(q, pos, **kw), rotate_ref(k, pos, **kw)
    out = torch.zeros(B, S, H, d, dtype=torch.float64)
    for b in range(B):
        rel = [[int(pos[b, j] - pos[b, i]) for j in range(S)] for i in range(S)]
        for h in range(H):
            kv = h // (H // KV)  # query head h reads key/value head h // group_size (GQA)
            qh, kh, vh = q[b, :, h], k[b, :, kv], v[b, :, kv]
            bias = torch.zeros(S, S, dtype=torch.float64)
            value_extra = torch.zeros(S, d, dtype=torch.float64)
            if kind == "t5":
                w = enc.weight.detach().double()
                bias = torch.tensor(
                    [
                        [
                            float(w[t5_bucket_ref(r, enc.bidirectional, enc.num_buckets, enc.max_distance), h])
                            for r in row
                        ]
                        for row in rel
                    ],
                    dtype=torch.float64,
                )
            elif kind == "alibi":
                bias = torch.tensor([[-ALIBI_SLOPES[H][h] * abs(r) for r in row] for row in rel], dtype=torch.float64)
            elif kind == "shaw":
                kmax = enc.max_relative_position
                rows = torch.tensor([[min(max(r, -kmax), kmax) + kmax for r in row] for row in rel])
                bias = (qh[:, None, :] * enc.key_table.double()[rows]).sum(-1) / math.sqrt(d)
            o = attention_ref(qh[None], kh[None], vh[None], bias, causal=module.causal)[0]
            if kind == "shaw" and enc.value_table is not None:
                weights = attention_ref(
                    qh[None], kh[None], torch.eye(S, dtype=torch.float64)[None], bias, causal=module.causal
                )[0]
                value_extra = torch.einsum("ij,ijd->id", weights, enc.value_table.double()[rows])
            out[b, :, h] = o + value_extra
    return linear(out.reshape(B, S, E), module.out_proj)


def build(position: str, *, embed: int = 16, heads: int = 4, causal: bool = False, **kw) -> MultiHeadAttention:
    if position == "learned":
        kw.setdefault("max_positions", 64)
    return MultiHeadAttention(embed, heads, position, causal=causal, **kw).double()


# ----------------------------------------------------------------------------- MultiHeadAttention


@pytest.mark.parametrize("position", CLASSIC)
@pytest.mark.parametrize("causal", [False, True])
def test_forward_matches_reference(position: str, causal: bool) -> None:
    module = build(position, causal=causal, bias=True)
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    torch.testing.assert_close(module(x), mha_ref(module, x), **TIGHT64)


@pytest.mark.parametrize("causal", [False, True])
def test_t5_attention_over_log_and_clamped_buckets(causal: bool) -> None:
    # Positions spread over 0 .. 300 with max_distance 32: offsets in the exact, the logarithmic and
    # the clamped range (beyond max_distance), not only the exact buckets of short sequences.
    module = build("t5", causal=causal, num_buckets=16, max_distance=32)
    torch.nn.init.normal_(module.encoding.weight, std=1.0)  # buckets far apart, so a wrong bucket shows
    x = torch.randn(1, 12, 16, dtype=torch.float64)
    positions = torch.tensor([0, 1, 3, 7, 12, 20, 33, 50, 90, 150, 220, 300])
    torch.testing.assert_close(module(x, positions), mha_ref(module, x, positions), **TIGHT64)


@pytest.mark.parametrize("position", CLASSIC)
def test_forward_with_batched_positions_and_gqa(position: str) -> None:
    # Two query heads per key/value head; per-row positions (left padding in row 1).
    module = build(position, num_kv_heads=2, causal=True)
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    positions = torch.tensor([[0, 1, 2, 3, 4], [0, 0, 0, 1, 2]])
    torch.testing.assert_close(module(x, positions), mha_ref(module, x, positions), **TIGHT64)


def test_alibi_twelve_heads_matches_paper_slopes() -> None:
    # Non-power-of-two head count, with slopes such as 2^-0.5 that float32 cannot hold exactly.
    module = build("alibi", embed=24, heads=12)
    x = torch.randn(1, 7, 24, dtype=torch.float64)
    torch.testing.assert_close(module(x), mha_ref(module, x), **TIGHT64)


@pytest.mark.parametrize("options", [dict(layout="interleaved", theta=500.0), dict(rotary_dim=2)])
def test_rope_options_reach_the_rotation(options: dict) -> None:
    module = build("rope", **options)
    x = torch.randn(1, 5, 16, dtype=torch.float64)
    torch.testing.assert_close(module(x), mha_ref(module, x), **TIGHT64)


@pytest.mark.parametrize("position", CLASSIC)
def test_scores_are_the_pre_softmax_path(position: str) -> None:
    # forward(x) == softmax(scores(x)) @ v, with v and the output projection applied by hand.
    module = build(position, values=False) if position == "shaw" else build(position)
    module.causal = True
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    scores = module.scores(x)
    assert scores.shape == (2, 4, 5, 5)
    assert torch.isinf(scores[..., 0, 1:]).all()  # query 0 sees key 0 only
    weights = torch.softmax(scores, dim=-1)
    encoded = x
    if position in ("sinusoidal", "learned"):
        encoded = module.encoding(x)
    v = linear(encoded, module.v_proj).view(2, 5, 4, 4).transpose(1, 2)
    out = linear((weights @ v).transpose(1, 2).reshape(2, 5, 16), module.out_proj)
    torch.testing.assert_close(module(x), out, **TIGHT64)
    torch.testing.assert_close(module(x), mha_ref(module, x), **TIGHT64)


def test_without_position_attention_is_permutation_equivariant() -> None:
    module = build("none")
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    perm = torch.randperm(7)
    torch.testing.assert_close(module(x[:, perm]), module(x)[:, perm], **TIGHT64)


@pytest.mark.parametrize("position", ENCODED)
def test_each_encoding_breaks_permutation_equivariance(position: str) -> None:
    module = build(position)
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    perm = torch.tensor([3, 0, 6, 1, 5, 2, 4])
    gap = (module(x[:, perm]) - module(x)[:, perm]).abs().max()
    # Without the encoding the two agree to ~1e-15 (previous test); every encoding moves
    # them apart by far more (the smallest, T5/Shaw with 0.02-scale tables, by ~1e-4).
    assert gap > 1e-7


@pytest.mark.parametrize("position", CLASSIC)
def test_gradcheck_multi_head_attention(position: str) -> None:
    # Gradients with respect to the input and to the encoding's own parameters (learned table,
    # T5 bucket weights, Shaw tables); the projections are plain nn.Linear layers.
    small = {
        "learned": dict(max_positions=6),
        "t5": dict(num_buckets=8, max_distance=20),
        "shaw": dict(max_relative_position=2),
    }
    module = build(position, embed=8, heads=2, causal=position in ("alibi", "rope"), **small.get(position, {}))
    x = torch.randn(1, 4, 8, dtype=torch.float64, requires_grad=True)
    named = [(n, p) for n, p in module.named_parameters() if n.startswith("encoding.")]
    names = [n for n, _ in named]
    params = [p.detach().clone().requires_grad_() for _, p in named]

    def run(x: torch.Tensor, *values: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(module, dict(zip(names, values)), (x,), strict=False)

    # fast_mode checks u^T J v for random u, v against finite differences instead of all of J:
    # the same analytic-vs-numerical test at a fraction of the cost of ~100 forward passes.
    assert torch.autograd.gradcheck(run, (x, *params), fast_mode=True)


# ----------------------------------------------------------------------------- linear attention


def feature_map_ref(x: torch.Tensor) -> torch.Tensor:
    """elu(x) + 1 written out: x + 1 for x > 0, e^x otherwise."""
    return torch.where(x > 0, x + 1.0, x.exp())


def linear_attention_ref(q, k, v, positions=None, rope_kwargs=None, causal=False, eps=1e-6) -> torch.Tensor:
    """out_i = sum_j (R_i phi(q_i)) . (R_j phi(k_j)) v_j / (sum_j phi(q_i) . phi(k_j) + eps), by loops."""
    q, k, v = q.detach(), k.detach(), v.detach()
    B, S, H, _ = q.shape
    fq, fk = feature_map_ref(q), feature_map_ref(k)
    rq, rk = fq, fk
    if rope_kwargs is not None:
        pos = torch.arange(S) if positions is None else positions
        rq, rk = rotate_ref(fq, pos, **rope_kwargs), rotate_ref(fk, pos, **rope_kwargs)
    out = torch.zeros(B, S, H, v.shape[-1], dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            for i in range(S):
                keys = range(i + 1) if causal else range(S)
                num = sum(float(rq[b, i, h] @ rk[b, j, h]) * v[b, j, h] for j in keys)
                den = sum(float(fq[b, i, h] @ fk[b, j, h]) for j in keys) + eps
                out[b, i, h] = num / den
    return out


@pytest.mark.parametrize("use_rope", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_linear_attention_matches_reference_and_weights(use_rope: bool, causal: bool) -> None:
    q, k = torch.randn(2, 6, 2, 8, dtype=torch.float64), torch.randn(2, 6, 2, 8, dtype=torch.float64)
    v = torch.randn(2, 6, 2, 3, dtype=torch.float64)
    positions = torch.tensor([2, 3, 4, 5, 9, 30])
    rope = RotaryEmbedding(8, layout="interleaved") if use_rope else None
    out = linear_attention(q, k, v, rope=rope, positions=positions, causal=causal)
    expected = linear_attention_ref(q, k, v, positions, dict(layout="interleaved") if use_rope else None, causal)
    torch.testing.assert_close(out, expected, **TIGHT64)
    # The explicit n x n matrix applied to v gives the same output (O(n^2) vs O(n) evaluation).
    weights = linear_attention_weights(q, k, rope=rope, positions=positions, causal=causal)
    assert weights.shape == (2, 2, 6, 6)
    torch.testing.assert_close(torch.einsum("bhij,bjhe->bihe", weights, v), out, **TIGHT64)


@pytest.mark.parametrize("causal", [False, True])
def test_linear_attention_with_rope_depends_on_relative_positions_only(causal: bool) -> None:
    # Shifting every position by c multiplies R_i^T R_j = R_{j-i} by nothing: same numerator,
    # and the denominator has no rotation at all. Angles up to ~1.2e5 rad: float64 cos/sin exact to
    # ~1e5 * 2^-53 ~ 1e-11 relative; the outputs are O(1), so 1e-9.
    rope = RotaryEmbedding(8)
    q, k = torch.randn(1, 7, 2, 8, dtype=torch.float64), torch.randn(1, 7, 2, 8, dtype=torch.float64)
    v = torch.randn(1, 7, 2, 4, dtype=torch.float64)
    positions = torch.arange(7)
    base = linear_attention(q, k, v, rope=rope, positions=positions, causal=causal)
    base_w = linear_attention_weights(q, k, rope=rope, positions=positions, causal=causal)
    for c in (1, 1000, 123_456):
        shifted = linear_attention(q, k, v, rope=rope, positions=positions + c, causal=causal)
        torch.testing.assert_close(shifted, base, rtol=0.0, atol=1e-9)
        torch.testing.assert_close(
            linear_attention_weights(q, k, rope=rope, positions=positions + c, causal=causal),
            base_w,
            rtol=0.0,
            atol=1e-9,
        )
    # ...while changing the gaps between positions does change it: the rotation is really there.
    spread = linear_attention(q, k, v, rope=rope, positions=positions * 3, causal=causal)
    assert (spread - base).abs().max() > 1e-3


@pytest.mark.parametrize("use_rope", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_gradcheck_linear_attention(use_rope: bool, causal: bool) -> None:
    rope = RotaryEmbedding(4) if use_rope else None
    q = torch.randn(1, 4, 2, 4, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 4, 2, 4, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 4, 2, 3, dtype=torch.float64, requires_grad=True)
    positions = torch.tensor([0, 2, 5, 6])
    assert torch.autograd.gradcheck(
        lambda q, k, v: linear_attention(q, k, v, rope=rope, positions=positions, causal=causal), (q, k, v)
    )


@pytest.mark.parametrize("causal", [False, True])
def test_linear_attention_module_composes_projections(causal: bool) -> None:
    module = LinearAttention(16, 2, causal=causal, bias=True).double()
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    q, k, v = linear(x, module.qkv_proj).view(2, 5, 3, 2, 8).unbind(2)
    inner = linear_attention_ref(q, k, v, None, dict(theta=10000.0), causal)
    torch.testing.assert_close(module(x), linear(inner.reshape(2, 5, 16), module.out_proj), **TIGHT64)


@pytest.mark.parametrize("positions", [None, torch.arange(6) + 4])
def test_rope_attention_compiles_to_one_graph(positions: torch.Tensor | None) -> None:
    module = MultiHeadAttention(32, 4, "rope", causal=True, num_kv_heads=2)
    x = torch.randn(2, 6, 32)
    args = (x,) if positions is None else (x, positions)
    breaks, reasons = graph_breaks(module, *args)
    assert breaks == 0, reasons
    torch._dynamo.reset()
    compiled = torch.compile(module, fullgraph=True)
    # float32 attention of 6 keys, eager vs Inductor's fused kernels: a few float32 ulps of values O(1)
    torch.testing.assert_close(compiled(*args), module(*args), rtol=0.0, atol=1e-5)


def test_rope_attention_reads_no_tensor_value_off_the_cpu() -> None:
    with torch.device("meta"):
        module = MultiHeadAttention(32, 4, "rope", causal=True)
        x = torch.randn(2, 6, 32)
        positions = torch.arange(6)
    with tensor_to_python_calls() as calls:
        module(x, positions)
    assert calls == []


def test_a_plug_that_computes_the_logits_gives_the_layer_its_scores() -> None:
    # The logits hook: a plug returning q k^T / sqrt(d) + ALiBi's bias itself must give ALiBi's layer output
    # (computed by the layer from score_bias) to float64 rounding, in forward and in scores.
    from ropelib.attention.plugs import PLUGS

    class AlibiByLogits(PLUGS["alibi"]):  # type: ignore[misc,valid-type]
        adds_bias = False
        computes_logits = True

        @staticmethod
        def logits(attn: Any, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            bias = PLUGS["alibi"].score_bias(attn, q, positions)
            return q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5 + bias

    torch.manual_seed(0)
    attn = MultiHeadAttention(16, 4, "alibi", causal=True).double()
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    want_out, want_scores = attn(x), attn.scores(x)
    attn.plug = AlibiByLogits
    assert torch.allclose(attn(x), want_out, rtol=0, atol=1e-12)
    assert torch.equal(attn.scores(x).isinf(), want_scores.isinf())
    assert torch.allclose(attn.scores(x).nan_to_num(0.0, 0.0, 0.0), want_scores.nan_to_num(0.0, 0.0, 0.0), atol=1e-12)
