"""ropelib.integrations.huggingface against the unpatched transformers models themselves.

The expected values are the logits of the same tiny, randomly initialised transformers model
before patching (transformers' own RoPE code), never ropelib's. Models are built from configs
in this file (no download): hidden 64, 2 layers, 4 query heads, 2 key/value heads, vocab 100.

Tolerance. ropelib forms the angle ``p * inv_freq`` in float64 and rounds cos/sin once;
transformers forms it in float32, which is off by up to ``p * 2 * 2^-24`` rad (about 3e-6 at the
positions used here, p < 32). Propagated through two layers to logits of magnitude ~3 (weights
drawn with std 0.1), that moves the logits by ~1e-6 to 1e-5, and float32 summation order adds
~1e-6. LOGIT_ATOL = 1e-4 leaves a tenfold margin, and is about 3000 times smaller than the change
that doubling theta makes (test_tiny_models_are_sensitive_to_rope), so the comparison would
catch any real difference in RoPE.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

import ropelib  # noqa: E402
import ropelib.integrations.huggingface.apply  # noqa: E402,F401
from ropelib.integrations import huggingface as hf  # noqa: E402
from ropelib.integrations.huggingface import (  # noqa: E402
    HFRotaryEmbedding,
    patch_hf_rope,
    unpatch_hf_rope,
    use_ropelib_rope,
)

LOGIT_ATOL = 1e-4  # see the module docstring

FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
}

# Each scaling with its own max_position_embeddings, chosen so that the prompts and decoding
# below (positions up to 23) cross the interesting thresholds: dynamic NTK grows past 16; YaRN
# and Llama 3 have original lengths of 16 and 32 so that their frequency bands (untouched,
# ramped, fully scaled) are all populated at head_dim 16.
SCALINGS = {
    "default": ({"rope_type": "default", "rope_theta": 10000.0}, 64),
    "linear": ({"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}, 64),
    "dynamic": ({"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}, 16),
    "yarn": (
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 10000.0},
        64,
    ),
    "llama3": (
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
            "rope_theta": 10000.0,
        },
        256,
    ),
}


# The size of every model built in these tests: small enough for a CPU, two layers so that errors compound.
TINY: dict[str, int] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=100,
)


def tiny_model(family: str = "llama", scaling: str = "default", **overrides: object) -> torch.nn.Module:
    config_cls, model_cls = FAMILIES[family]
    rope_parameters, max_positions = SCALINGS[scaling]
    options = dict(
        **TINY,
        max_position_embeddings=max_positions,
        rope_parameters=copy.deepcopy(rope_parameters),
        initializer_range=0.1,  # std 0.1 rather than 0.02: attention is sharp enough to depend on position
        pad_token_id=0,
    )
    if family == "mistral":
        options["sliding_window"] = None
    options.update(overrides)
    torch.manual_seed(0)
    return model_cls(config_cls(**options)).eval()


def patched_copy(model: torch.nn.Module, **options: object) -> torch.nn.Module:
    return patch_hf_rope(copy.deepcopy(model), **options)


def left_padded_batch(lengths: list[int], total: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids`` and ``attention_mask`` of shape ``[len(lengths), total]``, real tokens on the right."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 100, (len(lengths), total), generator=generator)
    mask = torch.zeros(len(lengths), total, dtype=torch.long)
    for row, length in enumerate(lengths):
        mask[row, total - length :] = 1
        ids[row, : total - length] = 0
    return ids, mask


def positions_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """The position of each real token among the real tokens of its row; padding gets 1 (as in generate)."""
    return (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)


def assert_logits_close(expected: torch.Tensor, got: torch.Tensor, mask: torch.Tensor | None = None) -> None:
    if mask is not None:  # padded rows attend to nothing meaningful: compare real tokens only
        expected, got = expected[mask.bool()], got[mask.bool()]
    diff = (expected - got).abs().max().item()
    assert diff <= LOGIT_ATOL, f"max |logit difference| = {diff:.3g} > {LOGIT_ATOL}"


def count_calls(monkeypatch: pytest.MonkeyPatch, owner: object, name: str) -> list[int]:
    calls = [0]
    inner = getattr(owner, name)

    def counted(*args: object, **kwargs: object) -> object:
        calls[0] += 1
        return inner(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return calls


# ----------------------------------------------------------------------------- logits


@pytest.mark.parametrize("scaling", list(SCALINGS))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_prefill_logits_match_unpatched(family: str, scaling: str, monkeypatch: pytest.MonkeyPatch) -> None:
    reference = tiny_model(family, scaling)
    patched = patched_copy(reference)
    assert isinstance(patched.model.rotary_emb, HFRotaryEmbedding)
    ids, mask = left_padded_batch([24, 17, 9], total=24)
    positions = positions_from_mask(mask)
    ropelib_calls = count_calls(monkeypatch, hf.apply, "rotate_qk")
    with torch.no_grad():
        for kwargs in ({"attention_mask": mask, "position_ids": positions}, {}):  # padded, then default positions
            expected = reference(ids, **kwargs).logits
            got = patched(ids, **kwargs).logits
            assert_logits_close(expected, got, mask if kwargs else None)
    assert ropelib_calls[0] == 2 * 2  # 2 forward passes x 2 layers went through ropelib


@pytest.mark.parametrize("scaling", list(SCALINGS))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_cached_decoding_with_left_padding_matches_unpatched(
    family: str, scaling: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A left-padded prompt of 10 tokens, then 10 teacher-forced steps with a KV cache (positions
    # up to 19, past dynamic NTK's 16); both models see the same tokens, so their logits must agree
    # at every step.
    reference = tiny_model(family, scaling)
    patched = patched_copy(reference)
    prompt, mask = left_padded_batch([10, 7, 4], total=10)
    steps = torch.randint(1, 100, (3, 10), generator=torch.Generator().manual_seed(2))
    caches = [transformers.DynamicCache(config=m.config) for m in (reference, patched)]
    ropelib_calls = count_calls(monkeypatch, hf.apply, "rotate_qk")
    with torch.no_grad():
        outs = [
            m(prompt, attention_mask=mask, position_ids=positions_from_mask(mask), cache=c, use_cache=True).logits
            for m, c in zip((reference, patched), caches)
        ]
        assert_logits_close(outs[0], outs[1], mask)
        for step in range(steps.shape[1]):
            mask = torch.cat((mask, torch.ones(3, 1, dtype=torch.long)), dim=1)
            position = positions_from_mask(mask)[:, -1:]
            token = steps[:, step : step + 1]
            outs = [
                m(token, attention_mask=mask, position_ids=position, cache=c, use_cache=True).logits
                for m, c in zip((reference, patched), caches)
            ]
            assert_logits_close(outs[0], outs[1])
    assert ropelib_calls[0] == (1 + steps.shape[1]) * 2  # every pass of the patched model, 2 layers each
    if scaling == "dynamic":  # the decoding really went past the original length and regrew the frequencies
        assert reference.model.rotary_emb.max_seq_len_cached == 20
        assert not torch.equal(patched.model.rotary_emb.inv_freq, reference.model.rotary_emb.original_inv_freq)
        assert torch.allclose(patched.model.rotary_emb.inv_freq, reference.model.rotary_emb.inv_freq, rtol=1e-6, atol=0)


def test_triton_backend_matches_unpatched() -> None:
    # The fused Triton kernel that "auto" picks on CUDA; without CUDA it runs in Triton's interpreter
    # (TRITON_INTERPRET=1, set by ropelib), slowly, hence one small prefill with per-row positions.
    pytest.importorskip("triton")
    reference = tiny_model("qwen2", "yarn")
    patched = patched_copy(reference, backend="triton")
    ids, mask = left_padded_batch([12, 7], total=12)
    kwargs = {"attention_mask": mask, "position_ids": positions_from_mask(mask)}
    with torch.no_grad():
        assert_logits_close(reference(ids, **kwargs).logits, patched(ids, **kwargs).logits, mask)


def test_training_gradients_match_unpatched() -> None:
    # Backpropagation through the patched rotation (ropelib's operator has its own backward,
    # the rotation by -theta) gives the weights the same gradients as transformers' autograd.
    reference = tiny_model("llama", "llama3")
    patched = patched_copy(reference)
    ids, _ = left_padded_batch([16, 16], total=16)
    for model in (reference, patched):
        model.train()
        model(ids, labels=ids).loss.backward()
    for (name, want), (_, got) in zip(reference.named_parameters(), patched.named_parameters()):
        assert want.grad is not None and got.grad is not None, name
        # same float32 argument as the logits, relative to the gradient's own scale
        assert (want.grad - got.grad).abs().max() <= 1e-4 * max(1.0, want.grad.abs().max().item()), name


def test_generate_with_left_padding_matches_unpatched() -> None:
    reference = tiny_model("llama", "yarn")
    patched = patched_copy(reference)
    ids, mask = left_padded_batch([8, 5], total=8)
    options = dict(
        attention_mask=mask, max_new_tokens=8, do_sample=False, output_logits=True, return_dict_in_generate=True
    )
    with torch.no_grad():
        expected = reference.generate(ids, **options)
        got = patched.generate(ids, **options)
    assert torch.equal(expected.sequences, got.sequences)
    for want, have in zip(expected.logits, got.logits):
        assert_logits_close(want, have)


@pytest.mark.parametrize("rope_type", ["default", "longrope"])
def test_phi3_partial_rotary_matches_unpatched(rope_type: str) -> None:
    # Phi-3 rotates only the first r = 0.5 * head_dim = 8 features, and LongRoPE switches from the
    # short to the long factors once the sequence is longer than original_max_position_embeddings (16).
    rope_parameters: dict[str, object] = {"rope_type": rope_type, "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    if rope_type == "longrope":
        rope_parameters.update(short_factor=[1.0, 1.1, 1.3, 1.6], long_factor=[1.0, 2.0, 4.0, 8.0])
    config = transformers.Phi3Config(
        **TINY,
        max_position_embeddings=64,
        original_max_position_embeddings=16,
        initializer_range=0.1,
        pad_token_id=0,
        rope_parameters=rope_parameters,
    )
    torch.manual_seed(0)
    reference = transformers.Phi3ForCausalLM(config).eval()
    patched = patched_copy(reference)
    assert patched.model.rotary_emb.rope.rotary_dim == 8
    ids, mask = left_padded_batch([24, 13], total=24)
    with torch.no_grad():
        for length in (12, 24):  # within and beyond the original length
            kwargs = {"attention_mask": mask[:, -length:], "position_ids": positions_from_mask(mask[:, -length:])}
            expected = reference(ids[:, -length:], **kwargs).logits
            got = patched(ids[:, -length:], **kwargs).logits
            assert_logits_close(expected, got, mask[:, -length:])


def test_tiny_models_are_sensitive_to_rope() -> None:
    # The power of the comparisons above: the same weights with theta doubled change the logits
    # by far more than LOGIT_ATOL.
    base = tiny_model("llama", "default")
    other = tiny_model("llama", "default", rope_parameters={"rope_type": "default", "rope_theta": 20000.0})
    ids, _ = left_padded_batch([24], total=24)
    with torch.no_grad():
        change = (base(ids).logits - other(ids).logits).abs().max().item()
    assert change > 100 * LOGIT_ATOL


# ----------------------------------------------------------------------------- the mechanism


def test_patched_attention_rotates_with_ropelib(monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers.models.llama import modeling_llama

    model = patch_hf_rope(tiny_model("llama"))
    wrapper = modeling_llama.apply_rotary_pos_emb
    assert isinstance(wrapper, hf.apply.RopelibApply)
    ropelib_calls = count_calls(monkeypatch, hf.apply, "rotate_qk")
    original_calls = count_calls(monkeypatch, wrapper, "original")
    with torch.no_grad():
        model(torch.arange(1, 9)[None])
    # q and k of each of the 2 layers go through ropelib's fused operator; transformers' function is never reached.
    assert ropelib_calls[0] == 2 and original_calls[0] == 0
    unpatch_hf_rope(model)


def test_unpatched_model_in_same_process_is_bitwise_unchanged() -> None:
    bystander = tiny_model("llama", "linear")
    ids, _ = left_padded_batch([12], total=12)
    with torch.no_grad():
        before = bystander(ids).logits
        patched = patch_hf_rope(tiny_model("llama", "default"))
        during = bystander(ids).logits
    unpatch_hf_rope(patched)
    assert torch.equal(before, during)


def test_unpatch_restores_modules_functions_and_logits() -> None:
    from transformers.models.llama import modeling_llama

    original_function = modeling_llama.apply_rotary_pos_emb
    model = tiny_model("llama", "yarn")
    original_module = model.model.rotary_emb
    ids, _ = left_padded_batch([12], total=12)
    with torch.no_grad():
        before = model(ids).logits
        assert patch_hf_rope(model) is model
        assert patch_hf_rope(model) is model  # a second patch is a no-op
        assert modeling_llama.apply_rotary_pos_emb is not original_function
        assert unpatch_hf_rope(model) is model
        after = model(ids).logits
    assert model.model.rotary_emb is original_module
    assert modeling_llama.apply_rotary_pos_emb is original_function
    assert torch.equal(before, after)


def test_context_manager_restores_after_an_exception() -> None:
    model = tiny_model("qwen2")
    original_module = model.model.rotary_emb
    with pytest.raises(RuntimeError, match="inside"):
        with use_ropelib_rope(model) as same:
            assert same is model and isinstance(model.model.rotary_emb, HFRotaryEmbedding)
            raise RuntimeError("inside")
    assert model.model.rotary_emb is original_module


def test_state_dict_is_unchanged() -> None:
    model = tiny_model("mistral", "llama3")
    before = model.state_dict()
    patch_hf_rope(model)
    after = model.state_dict()
    assert list(before) == list(after)
    assert all(torch.equal(before[key], after[key]) for key in before)
    unpatch_hf_rope(model)


# ----------------------------------------------------------------------------- the tables


def reference_tables(positions: list[int], rotary_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of ``p * theta^(-2i/r)`` in double precision (Python's math), each pair written twice."""
    angles = [[p * theta ** (-2.0 * i / rotary_dim) for i in range(rotary_dim // 2)] for p in positions]
    cos = torch.tensor([[math.cos(a) for a in row] * 2 for row in angles], dtype=torch.float64)
    sin = torch.tensor([[math.sin(a) for a in row] * 2 for row in angles], dtype=torch.float64)
    return cos, sin


def test_tables_are_float64_accurate_where_float32_angles_drift() -> None:
    # At position 100000 the float32 angle of transformers is off by up to 1e5 * 2 * 2^-24 = 0.012 rad;
    # ropelib's tables are the float64 values rounded once to float32 (error <= 2^-24 ~ 6e-8).
    model = tiny_model("llama")
    positions = [0, 1, 4097, 100_000, 100_003]
    want_cos, want_sin = reference_tables(positions, 16, 10000.0)
    ids = torch.tensor([positions])
    x = torch.zeros(1)
    theirs = model.model.rotary_emb(x, ids)
    ours = HFRotaryEmbedding(model.config)(x, ids)
    assert (ours[0][0].double() - want_cos).abs().max() <= 1e-7
    assert (ours[1][0].double() - want_sin).abs().max() <= 1e-7
    assert (theirs[0][0].double() - want_cos).abs().max() > 1e-4  # the drift this integration removes


def test_tables_with_one_dimensional_and_negative_positions() -> None:
    # transformers accepts any integer positions, including negative ones at padded slots.
    model = tiny_model("llama")
    ours = HFRotaryEmbedding(model.config)
    x = torch.zeros(1)
    for positions in (torch.arange(5), torch.tensor([[-3, -1, 0, 2, 7]])):
        want_cos, want_sin = reference_tables(positions.flatten().tolist(), 16, 10000.0)
        cos, sin = ours(x, positions)
        assert cos.shape == (1, positions.shape[-1], 16)
        # float32 rounding of values in [-1, 1]: 2^-24 ~ 6e-8
        assert torch.allclose(cos[0].double(), want_cos, atol=1e-7, rtol=0.0)
        assert torch.allclose(sin[0].double(), want_sin, atol=1e-7, rtol=0.0)


def test_dynamic_state_follows_transformers() -> None:
    # transformers regrows the frequencies when a sequence is longer than any seen (and than
    # max_position_embeddings = 16), keeps them for shorter ones, and resets below 16.
    model = tiny_model("llama", "dynamic")
    theirs = model.model.rotary_emb
    ours = HFRotaryEmbedding(model.config)
    x = torch.zeros(1)
    for seq_len in (8, 20, 18, 30, 12, 16, 40, 16, 17):
        positions = torch.arange(seq_len)[None]
        want, got = theirs(x, positions), ours(x, positions)
        # float32 rounding of the same frequencies (transformers computes them in float32)
        assert torch.allclose(ours.inv_freq, theirs.inv_freq, rtol=1e-6, atol=0.0), seq_len
        # 3e-6 rad at p < 40 from transformers' float32 angles (module docstring), plus rounding.
        assert torch.allclose(want[0], got[0], atol=1e-5, rtol=0.0)
        assert torch.allclose(want[1], got[1], atol=1e-5, rtol=0.0)


def test_yarn_attention_scaling_matches_the_paper() -> None:
    # YaRN (Peng et al., 2023, eq. 22): sqrt(1/t) = 0.1 ln(s) + 1 with s = 4.
    rotary = patch_hf_rope(tiny_model("llama", "yarn")).model.rotary_emb
    assert rotary.attention_scaling == pytest.approx(0.1 * math.log(4.0) + 1.0, rel=1e-12)
    cos, _ = rotary(torch.zeros(1), torch.zeros(1, 1, dtype=torch.long))
    assert torch.allclose(cos, torch.full_like(cos, 0.1 * math.log(4.0) + 1.0), atol=1e-7, rtol=0.0)


# ----------------------------------------------------------------------------- refusals


def test_rejects_non_modules_and_models_without_rope() -> None:
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        patch_hf_rope("llama")  # type: ignore[type-var]
    with pytest.raises(ValueError, match="RotaryEmbedding"):
        patch_hf_rope(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="backend"):
        patch_hf_rope(tiny_model("llama"), backend="cuda")


def test_rejects_per_layer_rope_parameters_and_leaves_model_unchanged() -> None:
    # Gemma 3 style: one RoPE setting per attention kind; HFRotaryEmbedding takes a single setting.
    model = tiny_model("llama")
    original_module = model.model.rotary_emb
    model.config.layer_types = ["full_attention", "sliding_attention"]
    model.config.rope_parameters = {
        "full_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    }
    with pytest.raises(ValueError, match="per layer type"):
        patch_hf_rope(model)
    assert model.model.rotary_emb is original_module


def tiny_cohere() -> torch.nn.Module:
    """A one-layer Cohere model: its tables repeat each angle side by side (interleaved), not in halves."""
    config = transformers.CohereConfig(**{**TINY, "num_hidden_layers": 1})
    return transformers.CohereForCausalLM(config)


def test_rejects_a_model_with_interleaved_tables() -> None:
    # Cohere writes each angle twice side by side (repeat_interleave), not in two halves: the
    # patch-time probe sees that ropelib's tables differ and refuses.
    model = tiny_cohere()
    original_module = model.model.rotary_emb
    with pytest.raises(ValueError, match="does not reproduce"):
        patch_hf_rope(model)
    assert model.model.rotary_emb is original_module


def test_model_cast_to_bfloat16_is_patched_with_exact_tables() -> None:
    # model.to(torch.bfloat16) also rounds transformers' inv_freq buffer (8 significant bits), so its
    # tables agree with ropelib's only to ~p * 2^-8; the patch-time probe then compares the first 4
    # positions with that tolerance, accepts the model, and the new tables are exact again.
    model = tiny_model("llama").to(torch.bfloat16)
    assert model.model.rotary_emb.inv_freq.dtype == torch.bfloat16
    patch_hf_rope(model)
    positions = [0, 1, 100, 1000]
    want_cos, _ = reference_tables(positions, 16, 10000.0)
    cos, _ = model.model.rotary_emb(torch.zeros(1), torch.tensor([positions]))  # float32 x: float32 tables
    assert (cos[0].double() - want_cos).abs().max() <= 1e-7
    with torch.no_grad():
        assert torch.isfinite(model(torch.arange(1, 9)[None]).logits).all()
    unpatch_hf_rope(model)


def test_coarse_probe_still_refuses_a_different_layout() -> None:
    model = tiny_cohere().to(torch.bfloat16)
    with pytest.raises(ValueError, match="does not reproduce"):
        patch_hf_rope(model)


def test_rotary_module_input_checks() -> None:
    rotary = HFRotaryEmbedding(tiny_model("llama").config)
    with pytest.raises(TypeError, match="position_ids must be an integer"):
        rotary(torch.zeros(1), torch.zeros(1, 3))
    with pytest.raises(ValueError, match="position_ids must have shape"):
        rotary(torch.zeros(1), torch.zeros(1, 1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="layer_type"):
        rotary(torch.zeros(1), torch.zeros(1, 3, dtype=torch.long), layer_type="sliding_attention")
    with pytest.raises(TypeError, match="config must be a transformers config"):
        HFRotaryEmbedding(object())


def test_exported_from_the_package() -> None:
    for name in ("HFRotaryEmbedding", "patch_hf_rope", "unpatch_hf_rope", "use_ropelib_rope"):
        assert getattr(ropelib, name) is getattr(hf, name)
