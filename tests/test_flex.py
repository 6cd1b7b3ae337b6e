"""ALiBi and T5 attention, materialized bias vs flex_attention, against an explicit float64 softmax.

Expected values: conftest.attention_ref (max-subtracted softmax written out) with biases built
by loops from the papers' formulas (ALiBi slopes 2^(-8h/H), Press et al. 2022) or from the T5
bucket function (tested by hand in test_relative.py) and the module's weight table.
"""

from __future__ import annotations

import math

import pytest
import torch

from ropelib import T5RelativeBias
from ropelib.bench.bias import benchmark_bias, bias_setups
from ropelib.encodings.flex import (
    alibi_score_mod,
    flex_bias_attention,
    materialized_bias_attention,
    t5_score_mod,
)

from references import attention_ref, t5_bucket_peer

HEADS, SEQ, DIM = 4, 12, 8
# float32 attention against float64: scores of 8-term dot products and a 12-term softmax; errors
# are a few float32 ulps of values of order 1, so 1e-5 absolute is ample.
TOL = dict(rtol=0.0, atol=1e-5)


def alibi_ref() -> torch.Tensor:
    slopes = [2.0 ** (-8.0 * (h + 1) / HEADS) for h in range(HEADS)]  # paper: geometric, power-of-two heads
    return torch.tensor(
        [[[-slopes[h] * abs(j - i) for j in range(SEQ)] for i in range(SEQ)] for h in range(HEADS)], dtype=torch.float64
    )


def t5_ref(module: T5RelativeBias) -> torch.Tensor:
    w = module.weight.detach().double()
    bias = torch.empty(HEADS, SEQ, SEQ, dtype=torch.float64)
    for i in range(SEQ):
        for j in range(SEQ):
            bucket = int(  # T5's own function (transformers), not ropelib's
                t5_bucket_peer(torch.tensor(j - i), module.bidirectional, module.num_buckets, module.max_distance)
            )
            bias[:, i, j] = w[bucket]
    return bias


def qkv() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return tuple(torch.randn(2, HEADS, SEQ, DIM) for _ in range(3))


def test_alibi_both_ways() -> None:
    q, k, v = qkv()
    expected = attention_ref(q.double(), k.double(), v.double(), alibi_ref())
    from ropelib import alibi_slopes

    build, score_mod = bias_setups("alibi", HEADS, SEQ, torch.device("cpu"))
    torch.testing.assert_close(materialized_bias_attention(q, k, v, build()).double(), expected, **TOL)
    torch.testing.assert_close(
        flex_bias_attention(q, k, v, alibi_score_mod(alibi_slopes(HEADS)), compiled=False).double(), expected, **TOL
    )
    torch.testing.assert_close(flex_bias_attention(q, k, v, score_mod, compiled=False).double(), expected, **TOL)


def test_t5_both_ways() -> None:
    q, k, v = qkv()
    module = T5RelativeBias(HEADS, num_buckets=8, max_distance=6)
    with torch.no_grad():
        module.weight.normal_(std=1.0)  # large enough that a wrong bucket would show
    expected = attention_ref(q.double(), k.double(), v.double(), t5_ref(module))
    out = flex_bias_attention(q, k, v, t5_score_mod(module, SEQ), compiled=False)
    torch.testing.assert_close(out.double(), expected, **TOL)
    from ropelib import relative_positions

    bias = module(relative_positions(SEQ)).detach()
    torch.testing.assert_close(materialized_bias_attention(q, k, v, bias).double(), expected, **TOL)


def test_compiled_flex_matches() -> None:
    # The fused path (torch.compile of flex_attention) on this device; one compile, a few seconds on a CPU.
    q, k, v = qkv()
    _, score_mod = bias_setups("alibi", HEADS, SEQ, torch.device("cpu"))
    expected = attention_ref(q.double(), k.double(), v.double(), alibi_ref())
    torch.testing.assert_close(flex_bias_attention(q, k, v, score_mod, compiled=True).double(), expected, **TOL)


def test_benchmark_rows() -> None:
    rows = benchmark_bias(torch.device("cpu"), shape=(1, 2, 16, 8), kinds=("alibi",), reps=1, warmup=0, compiled=False)
    assert [(r["bias"], r["method"]) for r in rows] == [("alibi", "materialized"), ("alibi", "flex_attention")]
    assert rows[0]["bias_bytes"] == 2 * 16 * 16 * 4 and rows[1]["bias_bytes"] == 0
    assert all(r["median_ms"] > 0 and math.isfinite(r["max_abs_diff"]) and r["max_abs_diff"] < 1e-5 for r in rows)


def test_rejects_bad_arguments() -> None:
    q, k, v = qkv()
    with pytest.raises(ValueError, match="kind"):
        bias_setups("shaw", HEADS, SEQ, torch.device("cpu"))
    with pytest.raises(ValueError, match="q, k must be"):
        materialized_bias_attention(q, k[:, :, :5], v, torch.zeros(HEADS, SEQ, SEQ))


# ----------------------------------------------------------------------------- score_mods checked against their use


def test_alibi_score_mod_needs_one_slope_per_head() -> None:
    from ropelib import alibi_slopes

    q, k, v = qkv()  # 4 heads
    for heads in (2, 8):  # 2: past the slopes inside the kernel; 8: the first 4 of 8 heads' slopes, silently
        with pytest.raises(ValueError, match=f"built by alibi_score_mod for {heads} heads .* q has {HEADS} heads"):
            flex_bias_attention(q, k, v, alibi_score_mod(alibi_slopes(heads)), compiled=False)
    with pytest.raises(ValueError, match="slopes must hold one slope per head, got an empty tensor"):
        alibi_score_mod(torch.zeros(0))
    with pytest.raises(ValueError, match="score_mod's table is on meta but q is on cpu"):
        flex_bias_attention(q, k, v, alibi_score_mod(alibi_slopes(HEADS).to("meta")), compiled=False)
    with pytest.raises(TypeError, match="score_mod must be callable"):
        flex_bias_attention(q, k, v, None, compiled=False)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="compiled must be a bool"):
        flex_bias_attention(q, k, v, alibi_score_mod(alibi_slopes(HEADS)), compiled="no")  # type: ignore[arg-type]


def test_t5_score_mod_is_checked_against_the_length_and_heads_it_was_built_for() -> None:
    q, k, v = qkv()  # 4 heads, 12 positions
    module = T5RelativeBias(HEADS, num_buckets=8, max_distance=6)
    with torch.no_grad():
        module.weight.normal_(std=1.0)
    # Built for 8 positions, used at 12: offsets down to -11 would wrap around the 15-row table.
    with pytest.raises(ValueError, match="built by t5_score_mod for seq_len=8 .* q and k have 12 positions"):
        flex_bias_attention(q, k, v, t5_score_mod(module, 8), compiled=False)
    with pytest.raises(ValueError, match="built by t5_score_mod for 2 heads .* q has 4 heads"):
        flex_bias_attention(q, k, v, t5_score_mod(T5RelativeBias(2), SEQ), compiled=False)
    # A table built for a longer length covers the shorter one: the same attention as the reference.
    expected = attention_ref(q.double(), k.double(), v.double(), t5_ref(module))
    out = flex_bias_attention(q, k, v, t5_score_mod(module, SEQ + 5), compiled=False)
    torch.testing.assert_close(out.double(), expected, **TOL)


@pytest.mark.parametrize(
    "bias,seq_len,error,match",
    [
        ("module", 0, ValueError, "seq_len must be >= 1, got 0"),
        ("module", 4.0, TypeError, "seq_len must be an int, got float"),
        ("module", True, TypeError, "seq_len must be an int, got bool"),
        (None, 4, TypeError, "bias must be a ropelib.T5RelativeBias, got NoneType"),
        (torch.zeros(8, 4), 4, TypeError, "bias must be a ropelib.T5RelativeBias, got Tensor"),
    ],
)
def test_t5_score_mod_rejects_bad_arguments(bias, seq_len, error, match) -> None:
    from ropelib.encodings.flex import t5_offset_table

    bias = T5RelativeBias(HEADS) if isinstance(bias, str) else bias
    with pytest.raises(error, match=match):
        t5_score_mod(bias, seq_len)
    with pytest.raises(error, match=match):
        t5_offset_table(bias, seq_len)
