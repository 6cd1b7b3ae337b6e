"""The engines' entry point, ``apply_rope_with_cos_sin_cache``, against a float64 reference of its contract.

The contract (FlashInfer's ``apply_rope_with_cos_sin_cache``, vLLM's ``RotaryEmbedding.forward_native``):
``positions`` ``[tokens]``; ``query``/``key`` ``[tokens, heads * head_size]`` or ``[tokens, heads,
head_size]``; ``cos_sin_cache`` ``[max_positions, rotary_dim]`` = ``cat(cos, sin)``; ``is_neox`` picks
pairs ``(i, i + r/2)`` (True) or ``(2i, 2i + 1)`` (False); the features past ``rotary_dim`` are kept.
The reference below multiplies each pair, as a complex number ``x_a + i x_b``, by ``c + i s`` read
from the cache, one token and head at a time in float64; the cache itself is built here from the
formula ``theta^(-2i/r)``, not by ropelib. vLLM's and FlashInfer's own functions are compared too
where they are installed.
"""

from __future__ import annotations

import math

import pytest
import torch

import ropelib
from ropelib import apply_rope_with_cos_sin_cache, apply_rope_with_cos_sin_cache_inplace, make_cos_sin_cache
from ropelib.kernels import native_build

from references import EPS, inverse_frequencies_ref, pair_indices

KERNEL = pytest.mark.parametrize("kernel", ["torch", "triton"] + (["native"] if native_build.enabled() else []))
NEOX = pytest.mark.parametrize("is_neox", [True, False])
THETA = 10000.0


def cache_by_hand(max_positions: int, rotary_dim: int, theta: float = THETA) -> torch.Tensor:
    """``cat(cos(p f_i), sin(p f_i))`` per row, each angle a Python double, rounded once to float32."""
    freqs = inverse_frequencies_ref(rotary_dim, theta)
    rows = [[math.cos(p * f) for f in freqs] + [math.sin(p * f) for f in freqs] for p in range(max_positions)]
    return torch.tensor(rows, dtype=torch.float64).float()


def contract_ref(
    positions: torch.Tensor, x: torch.Tensor, head_size: int, cache: torch.Tensor, is_neox: bool
) -> torch.Tensor:
    """The contract in float64: ``x`` ``[tokens, heads * head_size]`` (or 3-D), pair by pair as complex numbers."""
    rotary_dim = cache.shape[1]
    layout = "half" if is_neox else "interleaved"
    heads = x.double().reshape(x.shape[0], -1, head_size)
    out = heads.clone()
    for t, p in enumerate(positions.tolist()):
        c, s = cache[p, : rotary_dim // 2].double(), cache[p, rotary_dim // 2 :].double()
        for h in range(heads.shape[1]):
            for i, (a, b) in enumerate(pair_indices(rotary_dim, layout)):
                z = complex(heads[t, h, a], heads[t, h, b]) * complex(c[i], s[i])
                out[t, h, a], out[t, h, b] = z.real, z.imag
    return out.reshape(x.shape)


def close(got: torch.Tensor, want: torch.Tensor, x: torch.Tensor) -> bool:
    # one rounding to the output dtype, plus float32 products and sum: a few float32 ulps of max|x|
    # (the cache's values are the reference's, so its own rounding does not count)
    bound = EPS[x.dtype] * want.abs() + 8 * EPS[torch.float32] * x.double().abs().max()
    return got.dtype == x.dtype and got.shape == x.shape and bool(((got.double() - want).abs() <= bound).all())


@KERNEL
@NEOX
@pytest.mark.parametrize("rotary_dim", [16, 8])  # full and partial rotary, head_size 16
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_the_contract(kernel: str, is_neox: bool, rotary_dim: int, dtype: torch.dtype) -> None:
    tokens, head_size = 7, 16
    positions = torch.tensor([0, 3, 3, 17, 1, 30, 9])  # any order, repeats: several requests' tokens
    cache = cache_by_hand(32, rotary_dim)
    query = torch.randn(tokens, 4 * head_size).to(dtype)
    key = torch.randn(tokens, 2 * head_size).to(dtype)
    q, k = apply_rope_with_cos_sin_cache(positions, query, key, head_size, cache, is_neox, kernel=kernel)
    assert close(q, contract_ref(positions, query, head_size, cache, is_neox), query)
    assert k is not None and close(k, contract_ref(positions, key, head_size, cache, is_neox), key)
    if rotary_dim < head_size:  # the tail of every head kept bit for bit
        tail = slice(rotary_dim, head_size)
        assert torch.equal(q.view(tokens, 4, head_size)[..., tail], query.view(tokens, 4, head_size)[..., tail])
    q_in, k_in = query.clone(), key.clone()
    apply_rope_with_cos_sin_cache_inplace(positions, q_in, k_in, head_size, cache, is_neox, kernel=kernel)
    assert torch.equal(q_in, q) and torch.equal(k_in, k)  # in place: the same bits


@NEOX
def test_three_dimensional_query_and_key_none(is_neox: bool) -> None:
    positions, cache = torch.tensor([5, 0, 2]), cache_by_hand(8, 16)
    query = torch.randn(3, 4, 16)  # [tokens, heads, head_size]
    q, k = apply_rope_with_cos_sin_cache(positions, query, None, 16, cache, is_neox)
    assert k is None and q.shape == query.shape
    assert close(q, contract_ref(positions, query, 16, cache, is_neox), query)
    before = query.clone()
    assert apply_rope_with_cos_sin_cache_inplace(positions, query, None, 16, cache, is_neox) is None
    assert torch.equal(query, q) and not torch.equal(query, before)


def test_batched_positions_as_vllm_allows() -> None:
    # vLLM flattens positions [batch, seq] and query [batch, seq, heads * head_size]: the same rotation
    positions, cache = torch.tensor([[0, 1, 2], [7, 8, 9]]), cache_by_hand(16, 8)
    query, key = torch.randn(2, 3, 32), torch.randn(2, 3, 8)
    q, k = apply_rope_with_cos_sin_cache(positions, query, key, 8, cache)
    flat_q, flat_k = apply_rope_with_cos_sin_cache(
        positions.flatten(), query.flatten(0, 1), key.flatten(0, 1), 8, cache
    )
    assert k is not None and flat_k is not None
    assert torch.equal(q, flat_q.view(2, 3, 32)) and torch.equal(k, flat_k.view(2, 3, 8))


@KERNEL
def test_slices_of_a_packed_projection_in_place_without_copies(kernel: str) -> None:
    # query and key as engines hand them: column slices of one [tokens, (Hq + 2 Hk) * head_size] output
    tokens, head_size, hq, hk = 5, 16, 4, 2
    qkv = torch.randn(tokens, (hq + 2 * hk) * head_size)
    original = qkv.clone()
    query, key = qkv[:, : hq * head_size], qkv[:, hq * head_size : (hq + hk) * head_size]
    assert not query.is_contiguous() and not key.is_contiguous()
    positions, cache = torch.tensor([4, 0, 9, 2, 2]), cache_by_hand(10, 16)
    storage = qkv.untyped_storage().data_ptr()
    apply_rope_with_cos_sin_cache_inplace(positions, query, key, head_size, cache, kernel=kernel)
    assert qkv.untyped_storage().data_ptr() == storage
    assert close(query, contract_ref(positions, original[:, : hq * head_size], head_size, cache, True), query)
    assert close(
        key, contract_ref(positions, original[:, hq * head_size : (hq + hk) * head_size], 16, cache, True), key
    )
    assert torch.equal(qkv[:, (hq + hk) * head_size :], original[:, (hq + hk) * head_size :])  # v untouched
    # out of place, the same slices: the same values, and the inputs kept
    again = original.clone()
    q, k = apply_rope_with_cos_sin_cache(
        positions, again[:, : hq * head_size], again[:, hq * head_size : (hq + hk) * head_size], 16, cache
    )
    assert torch.equal(again, original) and torch.equal(q, query) and k is not None and torch.equal(k, key)


def test_non_contiguous_query_of_any_strides() -> None:
    positions, cache = torch.tensor([1, 6, 3]), cache_by_hand(8, 16)
    query = torch.randn(32, 3).t()  # [3, 32], feature stride 3
    key = torch.randn(3, 2, 16)[:, ::2]  # [3, 1, 16], head stride 32
    q, k = apply_rope_with_cos_sin_cache(positions, query, key, 16, cache)
    assert close(q, contract_ref(positions, query, 16, cache, True), query)
    assert k is not None and close(k, contract_ref(positions, key, 16, cache, True), key)


def test_gradients_flow_to_query_and_key() -> None:
    # d/dx R(theta) x = R(-theta): checked numerically in float64 (a float64 cache for float64 inputs)
    positions = torch.tensor([3, 0, 5])
    cache = cache_by_hand(8, 8).double()
    query = torch.randn(3, 16, dtype=torch.float64, requires_grad=True)
    key = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda q, k: apply_rope_with_cos_sin_cache(positions, q, k, 8, cache, False), (query, key)
    )


def test_make_cos_sin_cache_is_the_formula_and_the_modules_rotation() -> None:
    rope = ropelib.RotaryEmbedding(16, rotary_dim=8)
    cache = make_cos_sin_cache(rope, 40)
    # rounded once from float64 angles: half a float32 ulp of values <= 1
    assert cache.dtype == torch.float32 and cache.shape == (40, 8)
    assert float((cache.double() - cache_by_hand(40, 8).double()).abs().max()) <= 2**-24
    q, k = torch.randn(1, 6, 4, 16), torch.randn(1, 6, 2, 16)
    positions = torch.tensor([0, 39, 2, 8, 8, 1])
    want_q, want_k = rope(q, k, positions)
    got_q, got_k = apply_rope_with_cos_sin_cache(positions, q[0], k[0], 16, cache)
    # the same float32 rows and arithmetic: equal to the module's rotation
    assert torch.equal(got_q, want_q[0]) and got_k is not None and torch.equal(got_k, want_k[0])


def test_make_cos_sin_cache_keeps_a_scalings_factor() -> None:
    # YaRN: cos and sin times the attention factor 0.1 ln(s) + 1, as the engines' caches hold them
    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    rope = ropelib.RotaryEmbedding(8, scaling=scaling, max_position_embeddings=128)
    cache = make_cos_sin_cache(rope, 4)
    assert float(cache[0, 0]) == pytest.approx(0.1 * math.log(4.0) + 1.0, rel=1e-7)


# ----------------------------------------------------------------------------- refused


Q, K, CACHE, POS = torch.randn(3, 32), torch.randn(3, 16), cache_by_hand(8, 16), torch.tensor([0, 1, 2])


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (
            lambda: apply_rope_with_cos_sin_cache(torch.tensor([0, 8, 1]), Q, K, 16, CACHE),
            ValueError,
            "positions must be < 8",
        ),
        (
            lambda: apply_rope_with_cos_sin_cache(torch.tensor([0, -1, 1]), Q, K, 16, CACHE),
            ValueError,
            "positions must be >= 0",
        ),
        (
            lambda: apply_rope_with_cos_sin_cache(POS.float(), Q, K, 16, CACHE),
            TypeError,
            "positions must be an integer",
        ),
        (lambda: apply_rope_with_cos_sin_cache(POS[:2], Q, K, 16, CACHE), ValueError, "query must be \\[2,"),
        (lambda: apply_rope_with_cos_sin_cache(POS, Q, K, 12, CACHE), ValueError, "a multiple of head_size=12"),
        (lambda: apply_rope_with_cos_sin_cache(POS, Q, K[:, :15], 16, CACHE), ValueError, "key's last dimension"),
        (lambda: apply_rope_with_cos_sin_cache(POS, Q, K.double(), 16, CACHE), ValueError, "share dtype"),
        (lambda: apply_rope_with_cos_sin_cache(POS, Q, K, 16, CACHE[:, :15]), ValueError, "cos_sin_cache must be"),
        (lambda: apply_rope_with_cos_sin_cache(POS, Q, K, 8, CACHE), ValueError, "rotary_dim <= head_size=8"),
        (
            lambda: apply_rope_with_cos_sin_cache(POS, Q, K, 16, CACHE.half()),
            TypeError,
            "cos_sin_cache must be torch.float32",
        ),
        (lambda: apply_rope_with_cos_sin_cache(POS, Q, K, 16, CACHE[:0]), ValueError, "non-empty"),
        (lambda: apply_rope_with_cos_sin_cache(POS, Q, K, 16, CACHE[None]), ValueError, "cos_sin_cache must have 2"),
        (lambda: apply_rope_with_cos_sin_cache(POS, Q, K, 16, CACHE, 1), TypeError, "is_neox must be a bool"),
        (lambda: apply_rope_with_cos_sin_cache(POS, Q, K, 16.0, CACHE), TypeError, "head_size must be an int"),
        (
            lambda: apply_rope_with_cos_sin_cache(POS, Q, K, 16, CACHE.clone().requires_grad_()),
            ValueError,
            "must not require",
        ),
        (lambda: apply_rope_with_cos_sin_cache(POS, Q, K, 16, CACHE, kernel="cuda"), ValueError, "kernel must be"),
        (lambda: apply_rope_with_cos_sin_cache(POS, [1.0], K, 16, CACHE), TypeError, "query must be a torch.Tensor"),
        (lambda: apply_rope_with_cos_sin_cache(POS, Q, K, 16, CACHE.to("meta")), ValueError, "query's device"),
        (lambda: apply_rope_with_cos_sin_cache_inplace(POS, Q, Q[:, :16], 16, CACHE), ValueError, "overlap"),
    ],
)
def test_bad_input_is_refused_naming_the_argument(call, error, match) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(error, match=match):
        call()


# ----------------------------------------------------------------------------- the peers, where installed


def test_vllm_reference_agrees() -> None:
    rotary = pytest.importorskip("vllm.model_executor.layers.rotary_embedding")
    apply = getattr(rotary, "apply_rotary_emb_torch", None) or getattr(rotary, "_apply_rotary_emb_torch", None)
    if apply is None:
        pytest.skip("this vLLM has no pure-PyTorch apply_rotary_emb_torch")
    positions, cache = torch.tensor([0, 3, 7, 2]), cache_by_hand(8, 16)
    query = torch.randn(4, 2, 16)
    cos, sin = cache[positions].chunk(2, dim=-1)
    for is_neox in (True, False):
        want = apply(query, cos, sin, is_neox)
        got, _ = apply_rope_with_cos_sin_cache(positions, query, None, 16, cache, is_neox)
        torch.testing.assert_close(got, want, rtol=0, atol=8 * EPS[torch.float32] * float(query.abs().max()))


def test_flashinfer_agrees() -> None:
    rope = pytest.importorskip("flashinfer.rope")
    if not torch.cuda.is_available():
        pytest.skip("FlashInfer's kernels need CUDA")
    positions = torch.tensor([0, 3, 7, 2], device="cuda")
    cache = cache_by_hand(8, 16).cuda()
    query, key = torch.randn(4, 32, device="cuda"), torch.randn(4, 16, device="cuda")
    for is_neox in (True, False):
        want = rope.apply_rope_with_cos_sin_cache(positions, query, key, 16, cache, is_neox)
        got = apply_rope_with_cos_sin_cache(positions, query, key, 16, cache, is_neox)
        for g, w in zip(got, want):
            # both round float32 products and sums; FlashInfer may fuse multiply-adds: a few ulps
            torch.testing.assert_close(g, w, rtol=0, atol=8 * EPS[torch.float32] * float(query.abs().max()))
