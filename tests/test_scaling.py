"""Context-extension scalings against float64 formulas written here from the papers, and against transformers.

The references below are plain Python (``math``, one pair at a time), written from the published
definitions: PI (Chen et al., 2023), NTK-aware / dynamic NTK (bloc97; emozilla, 2023), YaRN (Peng et
al., 2024, section 3 and Hugging Face's defaults), LongRoPE (Ding et al., 2024), Llama 3.1 (Dubey et
al., 2024). Both sides are float64, so they agree to rounding: tolerance 1e-12 relative.
"""

from __future__ import annotations

import copy
import logging
import math
import re
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ropelib
from ropelib import RotaryEmbedding, rope_frequencies
from ropelib.config import rope_config
from ropelib.scaling import ROPE_SCALINGS, frequency_seq_len, scaled_inverse_frequencies

REL = 1e-12  # float64 vs float64, same formula evaluated differently: a few ulps


# ----------------------------------------------------------------------------- references (one pair at a time)


def ref_default(d, b):
    return [b ** (-2 * i / d) for i in range(d // 2)]


def ref_linear(d, b, s):
    return [w / s for w in ref_default(d, b)]


def ref_dynamic(d, b, s, seq_len, max_pos):
    n = max_pos if seq_len is None else max(seq_len, max_pos)
    alpha = s * n / max_pos - (s - 1)
    return ref_default(d, b * alpha ** (d / (d - 2)))


def ref_yarn_mscale(s, m=1.0):
    return 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0


def ref_yarn(
    d, b, s, L, beta_fast=32.0, beta_slow=1.0, truncate=True, mscale=None, mscale_all_dim=None, attention_factor=None
):
    # The pair index that turns r times in L tokens: L / (2 pi b^(2i/d)) = r  =>  i = d ln(L / 2 pi r) / (2 ln b).
    low = d * math.log(L / (2 * math.pi * beta_fast)) / (2 * math.log(b))
    high = d * math.log(L / (2 * math.pi * beta_slow)) / (2 * math.log(b))
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    out = []
    for i, w in enumerate(ref_default(d, b)):
        gamma = min(max((i - low) / (high - low), 0.0), 1.0)  # 0: keep the frequency, 1: interpolate
        out.append((1 - gamma) * w + gamma * w / s)
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = ref_yarn_mscale(s, mscale) / ref_yarn_mscale(s, mscale_all_dim)
        else:
            attention_factor = ref_yarn_mscale(s)
    return out, attention_factor


def ref_llama3(d, b, s, low, high, L):
    out = []
    for w in ref_default(d, b):
        wavelength = 2 * math.pi / w
        if wavelength < L / high:
            out.append(w)
        elif wavelength > L / low:
            out.append(w / s)
        else:
            mu = (L / wavelength - low) / (high - low)
            out.append((1 - mu) * w / s + mu * w)
    return out


def ref_longrope(d, b, short, long, L, seq_len, s):
    factors = long if seq_len is not None and seq_len > L else short
    attention = 1.0 if s <= 1 else math.sqrt(1 + math.log(s) / math.log(L))
    return [w / f for w, f in zip(ref_default(d, b), factors)], attention


def assert_close_list(actual: torch.Tensor, expected: list[float], rel: float = REL) -> None:
    assert actual.dtype == torch.float64
    assert actual.tolist() == pytest.approx(expected, rel=rel, abs=0)


# ----------------------------------------------------------------------------- each type vs its formula


@pytest.mark.parametrize("d,b", [(64, 10000.0), (128, 500000.0), (16, 100.0)])
@pytest.mark.parametrize("s", [1.0, 2.0, 8.0, 3.5])
def test_linear_and_dynamic_match_formulas(d, b, s):
    inv, scale = scaled_inverse_frequencies(d, b, {"rope_type": "linear", "factor": s})
    assert_close_list(inv, ref_linear(d, b, s))
    assert scale == 1.0
    for seq_len in (None, 100, 4096, 5000, 40000):
        inv, scale = scaled_inverse_frequencies(
            d, b, {"type": "dynamic", "factor": s}, max_position_embeddings=4096, seq_len=seq_len
        )
        assert_close_list(inv, ref_dynamic(d, b, s, seq_len, 4096))
        assert scale == 1.0


YARN_CASES = [
    dict(s=4.0, L=4096),
    dict(s=16.0, L=2048, beta_fast=16.0, beta_slow=2.0),
    dict(s=8.0, L=4096, truncate=False),
    dict(s=40.0, L=4096, mscale=1.0, mscale_all_dim=0.707),  # DeepSeek-style ratio
    dict(s=40.0, L=4096, mscale=1.0, mscale_all_dim=1.0),  # ratio 1
    dict(s=4.0, L=4096, attention_factor=0.9),
    dict(s=4.0, L=4096, beta_fast=4.0, beta_slow=4.0, truncate=False),  # low == high exactly: the 0.001 guard
    dict(s=4.0, L=6),  # both ends clip to pair 0 (no pair turns even once in L): low == high == 0
    dict(s=1.0, L=4096),  # factor 1: no change, temperature 1
]


@pytest.mark.parametrize("case", YARN_CASES, ids=[str(c) for c in YARN_CASES])
@pytest.mark.parametrize("d,b", [(64, 10000.0), (128, 1000000.0)])
def test_yarn_matches_formula(case, d, b):
    case = dict(case)
    s, L = case.pop("s"), case.pop("L")
    expected, expected_scale = ref_yarn(d, b, s, L, **case)
    scaling = {"rope_type": "yarn", "factor": s, "original_max_position_embeddings": L, **case}
    inv, scale = scaled_inverse_frequencies(d, b, scaling)
    assert_close_list(inv, expected)
    assert scale == pytest.approx(expected_scale, rel=REL)


def test_yarn_low_equals_high_is_a_step():
    # L = 6 < 2 pi: even pair 0 turns less than once, both ends clip to 0, and the 0.001 guard makes the
    # ramp a step: pair 0 keeps its frequency, every other pair is divided by s.
    d, b, s = 32, 10000.0, 4.0
    inv, _ = scaled_inverse_frequencies(d, b, {"rope_type": "yarn", "factor": s, "original_max_position_embeddings": 6})
    plain = ref_default(d, b)
    assert inv[0].item() == pytest.approx(plain[0], rel=REL)
    assert inv[1:].tolist() == pytest.approx([w / s for w in plain[1:]], rel=REL)


def test_yarn_original_length_defaults_to_max_position_embeddings():
    a, sa = scaled_inverse_frequencies(64, 1e4, {"rope_type": "yarn", "factor": 4.0}, max_position_embeddings=2048)
    b, sb = scaled_inverse_frequencies(
        64, 1e4, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048}
    )
    assert torch.equal(a, b) and sa == sb == pytest.approx(0.1 * math.log(4) + 1, rel=REL)


@pytest.mark.parametrize(
    "d,b,s,low,high,L",
    [
        (128, 500000.0, 8.0, 1.0, 4.0, 8192),
        (64, 10000.0, 32.0, 1.0, 4.0, 8192),
        (64, 10000.0, 4.0, 2.0, 8.0, 1024),
        (64, 1e4, 1.0, 1.0, 4.0, 8192),
    ],
)
def test_llama3_matches_formula(d, b, s, low, high, L):
    scaling = {
        "rope_type": "llama3",
        "factor": s,
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": L,
    }
    inv, scale = scaled_inverse_frequencies(d, b, scaling)
    assert_close_list(inv, ref_llama3(d, b, s, low, high, L))
    assert scale == 1.0


def test_llama31_regions():
    # Llama 3.1 (theta 500000, d 128, s 8, L 8192): the three regions of the release, by wavelength.
    inv, _ = scaled_inverse_frequencies(
        128,
        500000.0,
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    )
    plain = torch.tensor(ref_default(128, 500000.0), dtype=torch.float64)
    wavelength = 2 * math.pi / plain
    kept, divided = wavelength < 2048, wavelength > 8192
    assert torch.allclose(inv[kept], plain[kept], rtol=REL, atol=0)
    assert torch.allclose(inv[divided], plain[divided] / 8, rtol=REL, atol=0)
    middle = ~kept & ~divided
    assert middle.any() and bool(((inv[middle] < plain[middle]) & (inv[middle] > plain[middle] / 8)).all())


SHORT = [1.0 + 0.05 * i for i in range(32)]
LONG = [1.0 + 1.5 * i for i in range(32)]


@pytest.mark.parametrize("seq_len", [None, 1, 4096, 4097, 100000])
@pytest.mark.parametrize("factor", [None, 16.0, 1.0])
def test_longrope_short_vs_long(seq_len, factor):
    d, b, L, max_pos = 64, 10000.0, 4096, 131072
    scaling = {
        "rope_type": "longrope",
        "short_factor": SHORT,
        "long_factor": LONG,
        "original_max_position_embeddings": L,
    }
    if factor is not None:
        scaling["factor"] = factor
    inv, scale = scaled_inverse_frequencies(d, b, scaling, max_position_embeddings=max_pos, seq_len=seq_len)
    expected, expected_scale = ref_longrope(d, b, SHORT, LONG, L, seq_len, max_pos / L if factor is None else factor)
    assert_close_list(inv, expected)
    assert scale == pytest.approx(expected_scale, rel=REL)


def test_longrope_attention_factor_given_and_phi3_style_default():
    scaling = {"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG, "attention_factor": 1.25}
    _, scale = scaled_inverse_frequencies(64, 1e4, scaling, max_position_embeddings=4096)
    assert scale == 1.25
    # Without original_max_position_embeddings, L = max_position_embeddings and s = 1: no temperature.
    _, scale = scaled_inverse_frequencies(
        64, 1e4, {k: v for k, v in scaling.items() if k != "attention_factor"}, max_position_embeddings=4096
    )
    assert scale == 1.0


@pytest.mark.parametrize("rope_type", ["linear", "dynamic", "yarn", "llama3"])
def test_factor_one_is_plain_rope(rope_type):
    extra = {"low_freq_factor": 1.0, "high_freq_factor": 4.0} if rope_type == "llama3" else {}
    scaling = {"rope_type": rope_type, "factor": 1.0, **extra}
    # dynamic with factor 1 is plain RoPE up to max_position_embeddings only (beyond, alpha = n / L: see below)
    for seq_len in (None, 10, 512) if rope_type == "dynamic" else (None, 10, 10000):
        inv, scale = scaled_inverse_frequencies(64, 10000.0, scaling, max_position_embeddings=512, seq_len=seq_len)
        assert_close_list(inv, ref_default(64, 10000.0))
        assert scale == 1.0


@settings(max_examples=40, deadline=None)
@given(
    half=st.integers(2, 64),
    log_base=st.floats(2.0, 14.0),
    s=st.floats(1.0, 64.0),
    L=st.integers(16, 1 << 16),
)
def test_interpolating_scalings_stay_between_inv_over_s_and_inv(half, log_base, s, L):
    # PI, YaRN and Llama 3 only ever blend "keep" and "divide by s", so each frequency lies in [w/s, w].
    d, b = 2 * half, math.exp(log_base)
    plain = torch.tensor(ref_default(d, b), dtype=torch.float64)
    slack = 1e-12  # relative rounding of the blend
    for scaling in (
        {"rope_type": "linear", "factor": s},
        {"rope_type": "yarn", "factor": s, "original_max_position_embeddings": L},
        {
            "rope_type": "llama3",
            "factor": s,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": L,
        },
    ):
        inv, _ = scaled_inverse_frequencies(d, b, scaling)
        assert bool((inv <= plain * (1 + slack)).all() and (inv >= plain / s * (1 - slack)).all()), scaling
    # NTK-aware (dynamic at length s L with factor 1) keeps the highest frequency and divides the lowest by s.
    inv, _ = scaled_inverse_frequencies(
        d, b, {"rope_type": "dynamic", "factor": 1.0}, max_position_embeddings=L, seq_len=round(s * L)
    )
    alpha = round(s * L) / L
    assert inv[0].item() == pytest.approx(1.0, rel=REL)
    assert inv[-1].item() == pytest.approx(plain[-1].item() / alpha, rel=1e-9)


def test_rope_frequencies_rounds_the_scaled_float64_once():
    inv32, scale = rope_frequencies(64, 10000.0, {"rope_type": "linear", "factor": 4.0})
    assert inv32.dtype == torch.float32 and scale == 1.0
    assert torch.equal(inv32, torch.tensor(ref_linear(64, 10000.0, 4.0), dtype=torch.float64).float())
    inv32, _ = rope_frequencies(64, 10000.0, {"rope_type": "linear", "factor": 4.0}, partial_rotary_factor=0.5)
    assert inv32.shape == (16,)


def test_registry_documents_every_type():
    assert set(ROPE_SCALINGS) == {"default", "linear", "dynamic", "yarn", "longrope", "llama3", "proportional"}
    for name, entry in ROPE_SCALINGS.items():
        assert entry.compute.__doc__ and ("Keys" in entry.compute.__doc__ or name == "default"), name


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "scaling,kwargs,error,match",
    [
        ({"rope_type": "ntk"}, {}, ValueError, "rope_type"),
        ({"factor": 2.0}, {}, ValueError, "rope_type"),
        ({"rope_type": "linear", "type": "yarn", "factor": 2.0}, {}, ValueError, "agree"),
        ({"rope_type": "linear"}, {}, ValueError, "factor"),
        ({"rope_type": "linear", "factor": None}, {}, ValueError, "factor"),
        ({"rope_type": "linear", "factor": 2.0, "beta_fast": 3}, {}, ValueError, "unknown keys"),
        ({"rope_type": "linear", "factor": 0.5}, {}, ValueError, ">= 1"),
        ({"rope_type": "linear", "factor": True}, {}, TypeError, "real number"),
        ({"rope_type": "linear", "factor": "2"}, {}, TypeError, "real number"),
        ({"rope_type": "linear", "factor": float("inf")}, {}, ValueError, "finite"),
        ({"rope_type": "dynamic", "factor": 2.0}, {}, ValueError, "max_position_embeddings"),
        ({"rope_type": "yarn", "factor": 2.0}, {}, ValueError, "original"),
        ({"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 2048.5}, {}, TypeError, "int"),
        (
            {
                "rope_type": "yarn",
                "factor": 2.0,
                "original_max_position_embeddings": 64,
                "beta_fast": 1,
                "beta_slow": 2,
            },
            {},
            ValueError,
            "beta_fast",
        ),
        (
            {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64, "beta_slow": 0},
            {},
            ValueError,
            "beta_slow",
        ),
        (
            {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64, "truncate": "no"},
            {},
            TypeError,
            "truncate",
        ),
        (
            {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64, "attention_factor": 0.0},
            {},
            ValueError,
            "attention_factor",
        ),
        (
            {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 4.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
            {},
            ValueError,
            "high_freq_factor",
        ),
        (
            {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "original_max_position_embeddings": 8192},
            {},
            ValueError,
            "high_freq_factor",
        ),
        (
            {"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG[:-1]},
            {"max_position_embeddings": 8},
            ValueError,
            "32 entries",
        ),
        (
            {"rope_type": "longrope", "short_factor": SHORT, "long_factor": [-1.0] * 32},
            {"max_position_embeddings": 8, "seq_len": 9},
            ValueError,
            "> 0",
        ),
        (
            {"rope_type": "longrope", "short_factor": "1,2", "long_factor": LONG},
            {"max_position_embeddings": 8},
            TypeError,
            "list",
        ),
        (
            {
                "rope_type": "longrope",
                "short_factor": SHORT,
                "long_factor": LONG,
                "original_max_position_embeddings": 8,
            },
            {},
            ValueError,
            "factor",
        ),
        ({"rope_type": "linear", "factor": 2.0, "rope_theta": 500000.0}, {}, ValueError, "theta"),
        ({"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}, {}, ValueError, "partial_rotary_factor"),
        ([("rope_type", "linear")], {}, TypeError, "dict"),
    ],
)
def test_bad_scalings_raise(scaling, kwargs, error, match):
    with pytest.raises(error, match=match):
        rope_frequencies(64, 10000.0, scaling, **kwargs)


def test_dynamic_needs_four_rotated_features():
    with pytest.raises(ValueError, match="rotary dimension"):
        rope_frequencies(2, 10000.0, {"rope_type": "dynamic", "factor": 2.0}, max_position_embeddings=8)


def test_matching_rope_theta_in_the_dict_is_accepted():
    inv, _ = rope_frequencies(8, 500000.0, {"rope_type": "linear", "factor": 2.0, "rope_theta": 500000})
    assert inv.tolist() == pytest.approx([w / 2 for w in ref_default(8, 500000.0)], rel=1e-7)  # float32 rounding


# ----------------------------------------------------------------------------- RotaryEmbedding: length-following and configs


def rotate_reference(x: torch.Tensor, inv: list[float], positions: list[int], scale: float) -> torch.Tensor:
    """Half-layout rotation of [1, seq, 1, d] in float64 by explicit angles (independent of ropelib)."""
    d = x.shape[-1]
    out = x.clone()
    for t, p in enumerate(positions):
        for i, w in enumerate(inv):
            c, s = math.cos(p * w) * scale, math.sin(p * w) * scale
            a, b = x[0, t, 0, i].item(), x[0, t, 0, i + d // 2].item()
            out[0, t, 0, i], out[0, t, 0, i + d // 2] = a * c - b * s, b * c + a * s
    return out


def test_dynamic_rotary_embedding_follows_the_length_like_hugging_face():
    d, b, s, max_pos = 8, 10000.0, 2.0, 16
    rope = RotaryEmbedding(d, b, scaling={"rope_type": "dynamic", "factor": s}, max_position_embeddings=max_pos)
    x = torch.randn(1, 1, 1, d, dtype=torch.float64)
    for length, freq_len in [(10, None), (40, 40), (30, 40), (50, 50), (12, None)]:
        # growth to 40 and 50; 30 > max_pos keeps the 40-token frequencies; 12 <= max_pos resets to the original
        positions = torch.tensor([length - 1])
        got, _ = rope(x, x, positions)
        expected = rotate_reference(x, ref_dynamic(d, b, s, freq_len, max_pos), [length - 1], 1.0)
        assert torch.allclose(got, expected, rtol=0, atol=1e-12), length  # float64 path: rounding only
        assert frequency_seq_len(rope.scaling, length, freq_len, max_position_embeddings=max_pos) == freq_len


def test_longrope_rotary_embedding_switches_factors():
    d, L = 8, 32
    short, long = [1.0, 1.1, 1.2, 1.3], [1.0, 2.0, 4.0, 8.0]
    scaling = {
        "rope_type": "longrope",
        "short_factor": short,
        "long_factor": long,
        "original_max_position_embeddings": L,
    }
    rope = RotaryEmbedding(d, scaling=scaling, max_position_embeddings=4 * L)
    x = torch.randn(1, 1, 1, d, dtype=torch.float64)
    for last in (5, 31, 32, 100, 3):
        got, _ = rope(x, x, torch.tensor([last]))
        expected_inv, scale = ref_longrope(d, 10000.0, short, long, L, last + 1, 4.0)
        assert torch.allclose(got, rotate_reference(x, expected_inv, [last], scale), rtol=0, atol=1e-12), last
    # the float32 cache is rebuilt when the factors switch
    rope32 = RotaryEmbedding(d, scaling=scaling, max_position_embeddings=4 * L)
    cos_short, _ = rope32.cos_sin(torch.arange(L))
    cos_long, _ = rope32.cos_sin(torch.arange(L + 1))
    assert not torch.allclose(cos_short[1], cos_long[1])


LLAMA31 = {
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
}
PHI3 = {  # Phi-3-mini-128k: original length at top level, "type" key, factor inferred
    "hidden_size": 3072,
    "num_attention_heads": 32,
    "max_position_embeddings": 131072,
    "original_max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 48, "long_factor": [1.0 + i for i in range(48)]},
}


def test_from_config_llama31():
    rope = RotaryEmbedding.from_config(LLAMA31)
    assert (rope.head_dim, rope.rotary_dim, rope.theta, rope.max_position_embeddings) == (128, 128, 500000.0, 131072)
    expected = ref_llama3(128, 500000.0, 8.0, 1.0, 4.0, 8192)
    assert rope.cache.inv_freq.dtype == torch.float64
    assert rope.cache.inv_freq.tolist() == pytest.approx(expected, rel=REL)


def test_from_config_phi3_longrope():
    rope = RotaryEmbedding.from_config(PHI3)
    assert rope.scaling["original_max_position_embeddings"] == 4096
    assert rope.attention_scaling == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)), rel=REL)
    rope.cos_sin(torch.tensor([5000]), torch.float64)
    assert rope.cache.inv_freq.tolist() == pytest.approx(
        [w / (1.0 + i) for i, w in enumerate(ref_default(96, 1e4))], rel=REL
    )


def test_from_config_rope_parameters_with_theta_and_partial_factor():
    config = {
        "hidden_size": 256,
        "num_attention_heads": 4,
        "head_dim": 64,
        "max_position_embeddings": 8192,
        "rope_parameters": {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 2048,
            "rope_theta": 1e6,
            "partial_rotary_factor": 0.5,
        },
    }
    options = rope_config(config)
    assert options == {
        "head_dim": 64,
        "theta": 1e6,
        "rotary_dim": 32,
        "scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048},
        "max_position_embeddings": 8192,
    }
    plain = rope_config(
        {"hidden_size": 64, "num_attention_heads": 2, "rope_parameters": {"rope_type": "default", "rope_theta": 10.0}}
    )
    assert plain["scaling"] is None and plain["theta"] == 10.0 and plain["head_dim"] == 32
    assert rope_config({"head_dim": 8})["theta"] == 10000.0


@pytest.mark.parametrize(
    "config,error,match",
    [
        ({"hidden_size": 64}, ValueError, "num_attention_heads"),
        ({"hidden_size": 65, "num_attention_heads": 2}, ValueError, "divisible"),
        (
            {"head_dim": 8, "rope_theta": 10.0, "rope_parameters": {"rope_type": "default", "rope_theta": 20.0}},
            ValueError,
            "disagrees",
        ),
        (
            {
                "head_dim": 8,
                "rope_parameters": {
                    "full_attention": {"rope_type": "default"},
                    "sliding_attention": {"rope_type": "default"},
                },
            },
            ValueError,
            "layer type",
        ),
        (
            {
                "head_dim": 8,
                "rope_scaling": {"rope_type": "linear", "factor": 2.0},
                "rope_parameters": {"rope_type": "linear", "factor": 4.0},
            },
            ValueError,
            "differ",
        ),
        ({"head_dim": 8, "rope_scaling": {"rope_type": "su", "factor": 2.0}}, ValueError, "rope_type"),
        (
            {"head_dim": 8, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
            ValueError,
            "max_position_embeddings",
        ),
        ({"head_dim": 8, "partial_rotary_factor": 0.375}, ValueError, "even"),  # 8 * 0.375 = 3 rotated features
        (
            {
                "head_dim": 8,
                "original_max_position_embeddings": 16,
                "rope_scaling": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32},
            },
            ValueError,
            "disagrees",
        ),
        ("config.json", TypeError, "dict"),
    ],
)
def test_bad_configs_raise(config, error, match):
    with pytest.raises(error, match=match):
        RotaryEmbedding.from_config(config)


# ----------------------------------------------------------------------------- a second, independent peer: transformers

PEER_CASES = [
    ("linear", {"factor": 4.0}, 8192, None),
    ("dynamic", {"factor": 4.0}, 2048, 5000),
    ("dynamic", {"factor": 2.0}, 2048, 1000),
    ("yarn", {"factor": 8.0, "original_max_position_embeddings": 4096}, 32768, None),
    (
        "yarn",
        {"factor": 8.0, "original_max_position_embeddings": 4096, "truncate": False, "beta_fast": 16.0},
        32768,
        None,
    ),
    (
        "yarn",
        {"factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0, "mscale_all_dim": 0.707},
        163840,
        None,
    ),
    (
        "llama3",
        {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        131072,
        None,
    ),
    (
        "longrope",
        {"short_factor": SHORT, "long_factor": LONG, "factor": 32.0, "original_max_position_embeddings": 4096},
        131072,
        5000,
    ),
    (
        "longrope",
        {"short_factor": SHORT, "long_factor": LONG, "factor": 32.0, "original_max_position_embeddings": 4096},
        131072,
        100,
    ),
]


@pytest.mark.parametrize("rope_type,params,max_pos,seq_len", PEER_CASES)
def test_agrees_with_transformers(rope_type, params, max_pos, seq_len):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    parameters = {"rope_type": rope_type, "rope_theta": 500000.0, **params}
    config = transformers.LlamaConfig(
        hidden_size=512,
        num_attention_heads=8,
        head_dim=64,
        max_position_embeddings=max_pos,
        rope_parameters=dict(parameters),
    )
    peer_inv, peer_scale = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", seq_len=seq_len)
    inv, scale = rope_frequencies(64, 500000.0, parameters, max_position_embeddings=max_pos, seq_len=seq_len)
    # transformers works in float32 (powers, products and the ramp): a few float32 ulps apart.
    assert torch.allclose(inv, peer_inv.float(), rtol=1e-6, atol=0)
    assert scale == pytest.approx(float(peer_scale), rel=1e-12)


def test_exported():
    assert ropelib.rope_config is rope_config and ropelib.scaled_inverse_frequencies is scaled_inverse_frequencies


# ----------------------------------------------------------------------------- warnings as transformers gives them


def test_yarn_factor_that_disagrees_with_the_lengths_warns() -> None:
    # transformers warns when factor != max_position_embeddings / original_max_position_embeddings
    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}
    with pytest.warns(UserWarning, match="does not match max_position_embeddings"):
        scaled_inverse_frequencies(64, 10000.0, scaling, max_position_embeddings=2048)
    with pytest.warns(UserWarning, match="does not match"):  # original > max: an implicit factor below 1
        scaled_inverse_frequencies(64, 10000.0, scaling, max_position_embeddings=512)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # consistent: 4 * 1024 = 4096, no warning
        scaled_inverse_frequencies(64, 10000.0, scaling, max_position_embeddings=4096)


def test_llama3_original_not_below_max_warns() -> None:
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    with pytest.warns(UserWarning, match="should be less than max_position_embeddings"):
        scaled_inverse_frequencies(
            64, 500000.0, {**scaling, "original_max_position_embeddings": 8192}, max_position_embeddings=8192
        )


def test_longrope_factors_must_be_ordered() -> None:
    scaling = {"rope_type": "longrope", "short_factor": {1.0, 2.0}, "long_factor": [1.0, 2.0]}
    with pytest.raises(TypeError, match=r"scaling\['short_factor'\] must be a list"):
        scaled_inverse_frequencies(4, 10000.0, scaling, max_position_embeddings=64)


def test_ignore_keys_lets_model_specific_keys_through() -> None:
    scaling = {"rope_type": "linear", "factor": 2.0, "mrope_section": [1, 1]}
    with pytest.raises(ValueError, match="unknown keys \\['mrope_section'\\]"):
        scaled_inverse_frequencies(4, 100.0, scaling)
    inv, _ = scaled_inverse_frequencies(4, 100.0, scaling, ignore_keys=["mrope_section"])
    assert inv.tolist() == [0.5, 0.05]  # 1/2 and (1/10)/2 by hand


@pytest.mark.parametrize("seq_len, factors", [(64, "short"), (65, "long"), (None, "short")])
def test_longrope_switches_strictly_past_the_original_length(seq_len: int | None, factors: str) -> None:
    # seq_len == original_max_position_embeddings still uses the short factors (transformers: seq_len > original).
    short, long = [1.0, 2.0], [4.0, 8.0]
    scaling = {
        "rope_type": "longrope",
        "short_factor": short,
        "long_factor": long,
        "original_max_position_embeddings": 64,
    }
    inv, _ = scaled_inverse_frequencies(4, 100.0, scaling, max_position_embeddings=256, seq_len=seq_len)
    chosen = short if factors == "short" else long
    assert inv.tolist() == pytest.approx([1.0 / chosen[0], 0.1 / chosen[1]], rel=1e-15)


# ----------------------------------------------------------------------------- register_scaling checks its plugin


def _plugin(result):
    """A scaling function returning ``result(rotary_dim)`` whatever it is asked."""

    def compute(rotary_dim, theta, params, **_):
        return result(rotary_dim)

    return compute


def _f64(n: int, value: float = 0.5) -> torch.Tensor:
    return torch.full((n,), value, dtype=torch.float64)


@pytest.mark.parametrize(
    "result,error,match",
    [
        # rotary_dim 8 rotates 8 / 2 = 4 pairs: 3 or 8 frequencies would rotate mismatched pairs
        (lambda d: (_f64(d // 2 - 1), 1.0), ValueError, r"shape \[3\]; expected a float64 tensor .*\[4\]"),
        (lambda d: (_f64(d), 1.0), ValueError, r"shape \[8\]; expected a float64 tensor .*\[4\]"),
        (lambda d: (_f64(d // 2).float(), 1.0), TypeError, r"dtype torch.float32; expected a float64 tensor"),
        (lambda d: ([0.5] * (d // 2), 1.0), TypeError, r"inv_freq a float64 tensor"),
        (lambda d: (_f64(d // 2).to("meta"), 1.0), ValueError, r"inv_freq on meta; expected .* on the CPU"),
        (lambda d: (_f64(d // 2, math.nan), 1.0), ValueError, "non-finite or negative"),
        (lambda d: (_f64(d // 2, -1.0), 1.0), ValueError, "non-finite or negative"),
        (lambda d: (_f64(d // 2), torch.tensor(1.0)), TypeError, "attention_scaling=tensor.*expected a Python float"),
        (lambda d: (_f64(d // 2), "1.0"), TypeError, "attention_scaling='1.0'.*expected a Python float"),
        (lambda d: (_f64(d // 2), True), TypeError, "attention_scaling=True"),
        (lambda d: (_f64(d // 2), math.inf), ValueError, r"attention scaling \(inf\)"),
        (lambda d: _f64(d // 2), TypeError, "must return \\(inv_freq, attention_scaling\\)"),
    ],
)
def test_register_scaling_refuses_a_plugin_that_breaks_the_contract(result, error, match) -> None:
    before = dict(ROPE_SCALINGS)
    for required in ((), {"factor"}):  # the probe fills a required factor (2.0) itself
        with pytest.raises(error, match=match) as caught:
            ropelib.register_scaling("bad_plugin", required=required)(_plugin(result))
        assert "register_scaling('bad_plugin') refuses the scaling" in str(caught.value)
    assert ROPE_SCALINGS == before  # nothing registered


def test_register_scaling_accepts_a_good_plugin_and_checks_every_call() -> None:
    seen: list[dict] = []

    def half_pairs(rotary_dim, theta, params, **_):
        seen.append(dict(params))
        # right for the probe's rotary_dim 8, wrong for any other: 4 frequencies always
        return torch.tensor([1.0, 0.1, 0.01, 0.001], dtype=torch.float64), 1.0

    try:
        ropelib.register_scaling("four_pairs", required={"factor"})(half_pairs)
        assert seen == [{"rope_type": "four_pairs", "factor": 2.0}]  # the probe, with its factor
        inv, scale = scaled_inverse_frequencies(8, 1e4, {"rope_type": "four_pairs", "factor": 3.0})
        assert inv.tolist() == [1.0, 0.1, 0.01, 0.001] and scale == 1.0
        # rotary_dim 16 needs 16 / 2 = 8 frequencies: the call is refused, not rotated with 4
        with pytest.raises(ValueError, match=r"rope_type='four_pairs'.*shape \[4\]; expected .*\[8\]"):
            scaled_inverse_frequencies(16, 1e4, {"rope_type": "four_pairs", "factor": 3.0})
        with pytest.raises(ValueError, match=r"shape \[4\]; expected .*\[8\]"):
            RotaryEmbedding(16, scaling={"rope_type": "four_pairs", "factor": 3.0})
    finally:
        ROPE_SCALINGS.pop("four_pairs", None)


def test_register_scaling_probe_argument() -> None:
    def needs_a_list(rotary_dim, theta, params, **_):
        weights = params["weights"]
        if not isinstance(weights, list) or len(weights) != rotary_dim // 2:
            raise TypeError("scaling['weights'] must be a list of rotary_dim // 2 numbers")
        return torch.tensor(weights, dtype=torch.float64)[:-1], 1.0  # one too few

    try:
        # The guessed probe ({"weights": 1.0}) does not suit it: the registration proves nothing...
        ropelib.register_scaling("weights", required={"weights"})(needs_a_list)
        # ...and the first real call is checked all the same.
        with pytest.raises(ValueError, match=r"shape \[3\]; expected .*\[4\]"):
            scaled_inverse_frequencies(8, 1e4, {"rope_type": "weights", "weights": [1.0, 0.5, 0.25, 0.125]})
        # With a probe that suits it, the registration itself refuses it.
        with pytest.raises(ValueError, match=r"refuses the scaling.*shape \[3\]; expected .*\[4\]"):
            ropelib.register_scaling("weights", required={"weights"}, replace=True, probe={"weights": [1.0] * 4})(
                needs_a_list
            )
        with pytest.raises(ValueError, match=r"probe=\.\.\.\): needs_a_list\(8, .*raised TypeError"):
            ropelib.register_scaling("weights", required={"weights"}, replace=True, probe={"weights": 2.0})(
                needs_a_list
            )
        with pytest.raises(TypeError, match="probe must be a scaling dict or None, got list"):
            ropelib.register_scaling("weights", replace=True, probe=[1.0])  # type: ignore[arg-type]
    finally:
        ROPE_SCALINGS.pop("weights", None)


@pytest.mark.parametrize("argument", ["required", "optional"])
def test_register_scaling_refuses_a_bare_string_of_keys(argument: str) -> None:
    before = dict(ROPE_SCALINGS)
    with pytest.raises(TypeError, match=rf"{argument} must be a collection of key names .* not a bare str 'factor'"):
        ropelib.register_scaling("letters", **{argument: "factor"})
    with pytest.raises(TypeError, match=rf"{argument} must hold str key names, got 1"):
        ropelib.register_scaling("letters", **{argument: [1]})
    with pytest.raises(TypeError, match=rf"{argument} must be a collection of key names"):
        ropelib.register_scaling("letters", **{argument: 5})
    assert ROPE_SCALINGS == before
    try:  # a list or a generator of names registers the names (a generator read once)
        ropelib.register_scaling("letters", **{argument: (key for key in ["factor"])})(
            lambda d, theta, params, **_: (torch.ones(d // 2, dtype=torch.float64), 1.0)
        )
        assert getattr(ROPE_SCALINGS["letters"], argument) == frozenset({"factor"})
    finally:
        ROPE_SCALINGS.pop("letters", None)


def test_ignore_keys_refuses_a_bare_string() -> None:
    scaling = {"rope_type": "linear", "factor": 2.0, "mrope_section": [1, 1]}
    with pytest.raises(TypeError, match="ignore_keys must be a collection of key names .* not a bare str"):
        scaled_inverse_frequencies(4, 100.0, scaling, ignore_keys="mrope_section")
    inv, _ = scaled_inverse_frequencies(4, 100.0, scaling, ignore_keys=(k for k in ["mrope_section"]))
    assert inv.tolist() == [0.5, 0.05]  # a generator is read once, not consumed by the check


# ----------------------------------------------------------------------------- warnings: parity with transformers


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def transformers_rope_warnings(parameters: dict, max_positions: int, head_dim: int = 16) -> list[str]:
    """What transformers' own config validation (validate_rope, run by the config) logs for ``parameters``."""
    transformers = pytest.importorskip("transformers")
    logger = logging.getLogger("transformers.modeling_rope_utils")
    records = _Records()
    logger.addHandler(records)
    logging.Logger.warning_once.cache_clear()  # transformers' warning_once: once per message per process
    try:
        transformers.LlamaConfig(
            hidden_size=4 * head_dim,
            num_attention_heads=4,
            head_dim=head_dim,
            max_position_embeddings=max_positions,
            rope_parameters=copy.deepcopy(parameters),
        )
    finally:
        logger.removeHandler(records)
    return records.messages


def ropelib_rope_warnings(parameters: dict, max_positions: int, head_dim: int = 16) -> list[str]:
    """What ropelib warns when it reads the same config."""
    config = {
        "hidden_size": 4 * head_dim,
        "num_attention_heads": 4,
        "head_dim": head_dim,
        "max_position_embeddings": max_positions,
        "rope_parameters": copy.deepcopy(parameters),
    }
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rope_config(config)
        RotaryEmbedding.from_config(config)
    return [str(w.message) for w in caught if issubclass(w.category, UserWarning)]


_LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
_LONGROPE = {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
# (rope_parameters, max_position_embeddings, whether transformers warns, what ropelib's warning says)
WARNING_CASES = [
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}, 2048, True, "does not match"),
    # original above max: an implicit factor 512 / 1024 = 0.5 that disagrees with 4
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}, 512, True, "does not match"),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}, 4096, False, None),
    ({"rope_type": "yarn", "factor": 4.0}, 4096, False, None),  # original := max: implicit factor 1
    (
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "attention_factor": 1},
        4096,
        True,
        r"attention_factor'\]=1 is a int, not a float",
    ),
    (
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "attention_factor": 1.5},
        4096,
        False,
        None,
    ),
    ({**_LLAMA3, "original_max_position_embeddings": 8192}, 8192, True, "should be less than"),
    ({**_LLAMA3, "original_max_position_embeddings": 16384}, 8192, True, "should be less than"),
    ({**_LLAMA3, "original_max_position_embeddings": 8192}, 131072, False, None),
    (_LLAMA3, 8192, True, r"8192 \(by default\) should be less than"),  # original := max
    ({**_LONGROPE, "original_max_position_embeddings": 64}, 256, True, "has no 'factor'"),
    (_LONGROPE, 256, True, "has no 'factor'"),
    ({**_LONGROPE, "factor": 4.0, "original_max_position_embeddings": 64}, 256, False, None),
    ({"rope_type": "proportional"}, 256, True, "without scaling\\['partial_rotary_factor'\\]"),
    ({"rope_type": "proportional", "partial_rotary_factor": 0.25}, 256, False, None),
    ({"rope_type": "proportional", "partial_rotary_factor": 0.25, "factor": 2.0}, 256, True, "is not a key"),
    ({"rope_type": "linear", "factor": 2.0}, 256, False, None),
    ({"rope_type": "dynamic", "factor": 2.0}, 256, False, None),
    ({"rope_type": "default"}, 256, False, None),
]


@pytest.mark.parametrize("parameters,max_positions,warns,match", WARNING_CASES, ids=[str(c[:2]) for c in WARNING_CASES])
def test_warns_where_transformers_warns(parameters: dict, max_positions: int, warns: bool, match: str | None) -> None:
    parameters = {**parameters, "rope_theta": 10000.0}
    theirs = transformers_rope_warnings(parameters, max_positions)
    ours = ropelib_rope_warnings(parameters, max_positions)
    assert bool(theirs) == warns, theirs  # transformers' own behaviour on this dict...
    assert bool(ours) == warns, ours  # ...and ropelib's, the same
    if match is not None:
        assert all(re.search(match, message) for message in ours), ours


# ----------------------------------------------------------------------------- proportional: a fraction of pairs


@pytest.mark.parametrize("head_dim,partial", [(12, 0.25), (20, 0.25), (12, 0.75)])
@pytest.mark.parametrize("where", ["rope_parameters", "top level"])
def test_proportional_with_a_fractional_number_of_pairs_matches_transformers(
    head_dim: int, partial: float, where: str
) -> None:
    # p * d / 2 is not whole (12 * 0.25 / 2 = 1.5): transformers rotates int(p * d // 2) pairs (1 here)
    # at the full head's frequencies theta^(-2i/d), the others not at all; int(p * d) is odd.
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    parameters = {"rope_type": "proportional", "rope_theta": 10000.0, "partial_rotary_factor": partial}
    config = transformers.PretrainedConfig(
        hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim, rope_parameters=dict(parameters)
    )
    want, want_scale = ROPE_INIT_FUNCTIONS["proportional"](config, "cpu")
    assert want.shape == (head_dim // 2,) and int((want != 0).sum()) == int(partial * head_dim // 2)
    config_dict = {"hidden_size": 4 * head_dim, "num_attention_heads": 4, "head_dim": head_dim}
    if where == "top level":
        config_dict["partial_rotary_factor"] = partial
        config_dict["rope_parameters"] = {"rope_type": "proportional", "rope_theta": 10000.0}
    else:
        config_dict["rope_parameters"] = dict(parameters)
    options = rope_config(config_dict)
    assert options["rotary_dim"] == head_dim and options["scaling"]["partial_rotary_factor"] == partial
    rope = RotaryEmbedding.from_config(config_dict)
    # transformers computes in float32: one rounding of base ** (float32 exponent), ~ln(1e4) * 2^-24
    torch.testing.assert_close(rope.cache.inv_freq, want.double(), rtol=2e-6, atol=0)
    assert torch.equal(rope.cache.inv_freq == 0, want == 0) and rope.attention_scaling == want_scale == 1.0
    got, _ = scaled_inverse_frequencies(head_dim, 10000.0, parameters)
    torch.testing.assert_close(got, want.double(), rtol=2e-6, atol=0)
