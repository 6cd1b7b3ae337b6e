"""Hybrid attention (iRoPE, RNoPE-SWA): the temperature, the local masks, the layer patterns, the plugs, the lab.

Expected values come from transformers' Llama 4 (its attention layers, config and mask functions),
from hand-worked numbers, and from NoPE's definition (no position enters the layer).
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers.masking_utils import chunked_causal_mask_function, sliding_window_causal_mask_function
from transformers.models.llama4.configuration_llama4 import Llama4TextConfig
from transformers.models.llama4.modeling_llama4 import Llama4TextAttention, Llama4TextRotaryEmbedding

from ropelib import MultiHeadAttention
from ropelib.attention.hybrid import (
    AttentionTemperature,
    attention_temperature,
    hybrid_layers,
    local_attention_mask,
)
from ropelib.kernels import native_build
from ropelib.lab import LabConfig, TinyTransformer

KERNELS = ["torch", "triton"] + (["native"] if native_build.enabled() else [])


def llama4_attention(layer: int, **config: object) -> Llama4TextAttention:
    cfg = Llama4TextConfig(
        hidden_size=16,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        num_hidden_layers=4,
        intermediate_size=32,
        intermediate_size_mlp=32,
        vocab_size=32,
        use_qk_norm=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        **config,
    )
    cfg._attn_implementation = "eager"
    return Llama4TextAttention(cfg, layer).double()


def with_weights_of(peer: Llama4TextAttention, position: str, **options: object) -> MultiHeadAttention:
    mha = MultiHeadAttention(16, 2, position, causal=True, num_kv_heads=1, **options).double()
    for ours, theirs in ((mha.q_proj, peer.q_proj), (mha.k_proj, peer.k_proj), (mha.v_proj, peer.v_proj)):
        ours.weight.data.copy_(theirs.weight)
    mha.out_proj.weight.data.copy_(peer.o_proj.weight)
    return mha


def allowed_by(mask_function, n: int) -> torch.Tensor:
    """transformers' ``mask_function(batch, head, q_idx, kv_idx)`` evaluated on every pair, ``[n, n]`` (True = seen)."""
    t = torch.tensor
    return torch.stack([torch.stack([mask_function(t(0), t(0), t(i), t(j)) for j in range(n)]) for i in range(n)])


def additive(allowed: torch.Tensor) -> torch.Tensor:
    return torch.zeros(allowed.shape, dtype=torch.float64).masked_fill(~allowed, float("-inf"))[None, None]


# ----------------------------------------------------------------------------- the temperature


def test_attention_temperature_hand_values() -> None:
    # floor_scale 4: p + 1 < 4 -> floor 0 -> tau 1; p = 3..6 -> floor 1 -> 1 + 0.1 log 2; p = 7 -> 1 + 0.1 log 3
    tau = attention_temperature(torch.tensor([0, 2, 3, 6, 7]), floor_scale=4, attn_scale=0.1)
    expected = [1.0, 1.0, 1 + 0.1 * math.log(2), 1 + 0.1 * math.log(2), 1 + 0.1 * math.log(3)]
    assert tau.dtype == torch.float64
    torch.testing.assert_close(tau, torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-15)  # log1p vs log
    assert torch.equal(AttentionTemperature(4, 0.1)(torch.tensor([0, 2, 3, 6, 7])), tau)


def test_nope_temperature_layer_equals_llama4_nope_layer() -> None:
    torch.manual_seed(0)
    peer = llama4_attention(3, floor_scale=4, attn_scale=0.1)  # layer 3 of 4: Llama 4's NoPE layer
    assert not peer.use_rope and peer.attn_temperature_tuning
    x = torch.randn(2, 20, 16, dtype=torch.float64)
    causal = additive(torch.ones(20, 20, dtype=torch.bool).tril())
    expected, _ = peer(x, None, causal)
    ours = with_weights_of(peer, "nope_temperature", floor_scale=4, attn_scale=0.1)
    # transformers forms the temperature in float32 (relative error ~6e-8) and multiplies the float64 query by it
    torch.testing.assert_close(ours(x), expected, rtol=0, atol=1e-6)
    plain = with_weights_of(peer, "none")
    assert (plain(x) - expected).abs().max() > 1e-3  # the temperature matters at these positions


def test_temperature_is_one_before_the_first_step() -> None:
    torch.manual_seed(1)
    layer = MultiHeadAttention(16, 2, "nope_temperature", causal=True, floor_scale=8)
    plain = MultiHeadAttention(16, 2, "none", causal=True)
    plain.load_state_dict(layer.state_dict())
    x = torch.randn(2, 7, 16)  # positions 0..6: floor(7 / 8) = 0, tau = 1 exactly
    assert torch.equal(layer(x), plain(x))


# ----------------------------------------------------------------------------- local attention


@pytest.mark.parametrize("size", [1, 3, 4, 16])
@pytest.mark.parametrize("offset", [0, 5])
def test_chunk_mask_equals_transformers_chunked_causal_mask(size: int, offset: int) -> None:
    n = 13
    causal = torch.ones(n, n, dtype=torch.bool).triu(1)
    ours = ~(local_attention_mask(torch.arange(n) + offset, "chunk", size) | causal)
    # positions starting at `offset` are transformers' indices with left padding -offset
    peer = allowed_by(chunked_causal_mask_function(size, torch.tensor([-offset])), n)
    assert torch.equal(ours, peer)


@pytest.mark.parametrize("size", [1, 3, 16])
def test_window_mask_equals_transformers_sliding_window_mask(size: int) -> None:
    n = 13
    causal = torch.ones(n, n, dtype=torch.bool).triu(1)
    ours = ~(local_attention_mask(torch.arange(n) + 7, "window", size) | causal)
    assert torch.equal(ours, allowed_by(sliding_window_causal_mask_function(size), n))


@pytest.mark.parametrize("kernel", KERNELS)
def test_chunked_rope_layer_equals_llama4_rope_layer(kernel: str) -> None:
    torch.manual_seed(2)
    peer = llama4_attention(0, attention_chunk_size=4)  # a RoPE layer (no QK-norm), chunked attention
    assert peer.use_rope
    n = 10
    x = torch.randn(2, n, 16, dtype=torch.float64)
    freqs = Llama4TextRotaryEmbedding(peer.config)(x, torch.arange(n)[None].expand(2, n))
    mask = additive(allowed_by(chunked_causal_mask_function(4, torch.zeros(2, dtype=torch.long)), n))
    expected, _ = peer(x, freqs, mask)
    ours = with_weights_of(peer, "rope_chunked", chunk_size=4, layout="interleaved", kernel=kernel)
    # Llama 4 rotates through complex64 tables (float32 cos/sin): float32 rounding of O(1) values
    torch.testing.assert_close(ours(x), expected, rtol=0, atol=1e-6)


def test_window_layer_scores_are_shift_invariant_and_chunked_ones_are_not() -> None:
    torch.manual_seed(3)
    x = torch.randn(1, 12, 16, dtype=torch.float64)
    base = torch.arange(12)
    swa = MultiHeadAttention(16, 2, "rope_swa", causal=True, window=3).double()
    # RoPE and a window both read p_i - p_j only; float64 rotations at positions < 120: rounding only
    torch.testing.assert_close(swa.scores(x, base + 100), swa.scores(x, base), rtol=0, atol=1e-12)
    assert bool(torch.isinf(swa.scores(x, base)[0, 0, 5, 2])) and not torch.isinf(swa.scores(x, base)[0, 0, 5, 3])
    chunked = MultiHeadAttention(16, 2, "rope_chunked", causal=True, chunk_size=4).double()
    seen = torch.isfinite(chunked.scores(x, base))
    assert torch.equal(torch.isfinite(chunked.scores(x, base + 8)), seen)  # a shift by whole chunks
    assert not torch.equal(torch.isfinite(chunked.scores(x, base + 1)), seen)  # chunk boundaries are absolute


def test_batched_positions_give_each_row_its_mask() -> None:
    torch.manual_seed(4)
    layer = MultiHeadAttention(16, 2, "rope_chunked", causal=True, chunk_size=4).double()
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    positions = torch.stack((torch.arange(6), torch.arange(6) + 2))
    both = layer.scores(x, positions)
    for row in range(2):
        alone = layer.scores(x[row : row + 1], positions[row])[0]
        assert torch.equal(torch.isinf(both[row]), torch.isinf(alone))
        torch.testing.assert_close(both[row], alone, rtol=0, atol=1e-14)  # batched vs single matmul: float64 ulps
    assert not torch.equal(torch.isinf(both[0]), torch.isinf(both[1]))  # rows 0 and 1 chunk differently


# ----------------------------------------------------------------------------- NoPE and the causal mask


def test_nope_layer_reads_no_position_only_the_causal_mask_orders_it() -> None:
    torch.manual_seed(5)
    layer = MultiHeadAttention(16, 2, "none", causal=True).double()
    x = torch.randn(1, 8, 16, dtype=torch.float64)
    out = layer(x)
    assert torch.equal(layer(x, torch.arange(8) + 1000), out)  # positions shifted: nothing changes
    # the output at i depends on the prefix as a set: shuffle x_0..x_{i-1}, keep x_i last
    i = 6
    shuffled = torch.cat((x[:, torch.randperm(i)], x[:, i : i + 1]), dim=1)
    torch.testing.assert_close(layer(shuffled)[:, -1], out[:, i], rtol=0, atol=1e-12)  # float64 sum order
    encoder = MultiHeadAttention(16, 2, "none").double()
    perm = torch.randperm(8)
    torch.testing.assert_close(encoder(x[:, perm]), encoder(x)[:, perm], rtol=0, atol=1e-12)  # equivariant
    rope = MultiHeadAttention(16, 2, "rope", causal=True).double()
    assert (rope(shuffled)[:, -1] - rope(x)[:, i]).abs().max() > 1e-6  # RoPE reads the order


# ----------------------------------------------------------------------------- the patterns and the lab


def test_irope_pattern_equals_llama4_no_rope_layers() -> None:
    for layers in (4, 8, 6):
        cfg = Llama4TextConfig(num_hidden_layers=layers)
        expected = tuple(
            "rope_chunked" if kind == "chunked_attention" else "nope_temperature" for kind in cfg.layer_types
        )
        assert tuple("rope_chunked" if r else "nope_temperature" for r in cfg.no_rope_layers) == expected
        assert hybrid_layers("irope", layers) == expected


def test_rnope_swa_pattern() -> None:
    assert hybrid_layers("rnope_swa", 8) == ("rope_swa", "rope_swa", "rope_swa", "none") * 2
    assert hybrid_layers("rnope_swa", 3, interval=3) == ("rope_swa", "rope_swa", "none")


LAB = LabConfig(train_length=8, vocab_size=16, embed_dim=16, num_heads=2, num_layers=4, steps=2, batch_size=2)


@pytest.mark.parametrize("hybrid", ["irope", "rnope_swa"])
def test_lab_builds_each_layer_with_its_plug(hybrid: str) -> None:
    torch.manual_seed(6)
    model = TinyTransformer(LAB, hybrid)
    positions = tuple(block.attn.position for block in model.blocks)
    assert positions == model.layer_positions == hybrid_layers(hybrid, 4)
    local = [block.attn.encoding for block in model.blocks if block.attn.position != positions[-1]]
    assert {enc.size for enc in local} == {2} and len({id(enc.rotary) for enc in local}) == 1  # L / 4, shared
    tokens = torch.randint(0, 16, (2, 8))
    logits = model(tokens)
    assert logits.shape == (2, 8, 16)
    logits.sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    two = TinyTransformer(LabConfig(train_length=8, vocab_size=16, embed_dim=16, num_heads=2, num_layers=2), hybrid)
    assert two.layer_positions[-1] in ("nope_temperature", "none")  # one global layer in min(4, layers)


# ----------------------------------------------------------------------------- doors, autograd, compile


def test_doors_reject_bad_arguments() -> None:
    with pytest.raises(ValueError, match="chunk_size"):
        MultiHeadAttention(16, 2, "rope_chunked", chunk_size=0)
    with pytest.raises(TypeError, match="chunk_size"):
        MultiHeadAttention(16, 2, "rope_chunked", chunk_size=1.5)
    with pytest.raises(ValueError, match="unknown"):
        MultiHeadAttention(16, 2, "rope_chunked", window=3)
    with pytest.raises(ValueError, match="floor_scale"):
        MultiHeadAttention(16, 2, "nope_temperature", floor_scale=0)
    with pytest.raises(ValueError, match="attn_scale"):
        attention_temperature(torch.arange(3), attn_scale=-1.0)
    with pytest.raises(TypeError, match="positions"):
        attention_temperature(torch.arange(3.0))
    with pytest.raises(ValueError, match="kind"):
        local_attention_mask(torch.arange(3), "block", 2)
    with pytest.raises(ValueError, match="positions"):
        local_attention_mask(torch.zeros(1, 1, 3, dtype=torch.long), "chunk", 2)
    with pytest.raises(ValueError, match="name"):
        hybrid_layers("gemma", 4)
    with pytest.raises(ValueError, match="num_layers"):
        hybrid_layers("irope", 0)


@pytest.mark.parametrize("position", ["rope_chunked", "rope_swa", "nope_temperature"])
def test_gradcheck(position: str) -> None:
    torch.manual_seed(7)
    options = {"nope_temperature": {"floor_scale": 2}, "rope_chunked": {"chunk_size": 2}, "rope_swa": {"window": 2}}
    layer = MultiHeadAttention(8, 2, position, causal=True, **options[position]).double()
    x = torch.randn(1, 5, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(layer, (x,))


def test_chunked_layer_compiles_to_one_graph() -> None:
    torch.manual_seed(8)
    layer = MultiHeadAttention(16, 2, "rope_chunked", causal=True, chunk_size=3, kernel="torch")
    x = torch.randn(1, 7, 16)
    compiled = torch.compile(layer, fullgraph=True)
    # float32 attention of 7 keys, eager vs Inductor: a few float32 ulps of values O(1)
    torch.testing.assert_close(compiled(x), layer(x), rtol=0, atol=1e-5)
