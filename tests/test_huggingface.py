"""ropelib.integrations.huggingface against the unpatched transformers models themselves.

The expected values are the logits of the same tiny, randomly initialised transformers model
before patching (transformers' own RoPE code), never ropelib's. Models are built from configs
in this file (no download): hidden 64, 2 layers, 4 query heads, 2 key/value heads, vocab 100.

Tolerance. ropelib forms the angle ``p * inv_freq`` in float64 and rounds cos/sin once;
transformers forms it in float32, which is off by up to ``p * 2 * 2^-24`` rad (about 3e-6 at the
positions used here, p < 32). Propagated through two layers to logits of magnitude ~3 (weights
drawn with std 0.1), that moves the logits by ~1e-6, and float32 summation order adds ~1e-6:
the largest difference measured over every comparison in this file is 2.7e-6. LOGIT_ATOL = 3e-5
leaves a tenfold margin over that, and is about 10 000 times smaller than the change that doubling
theta makes (test_tiny_models_are_sensitive_to_rope), so the comparison would catch any real
difference in RoPE.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

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

LOGIT_ATOL = 3e-5  # see the module docstring

FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
}

# Each scaling with its own max_position_embeddings, chosen so that the prompts and decoding
# below (positions up to 23) cross the interesting thresholds: dynamic NTK grows past 16; YaRN
# (theta 100, original 64) and Llama 3 (original 32) are chosen so that their frequency bands
# (untouched, ramped, fully scaled) are all populated at head_dim 16, the ramp with an interior.
SCALINGS = {
    "default": ({"rope_type": "default", "rope_theta": 10000.0}, 64),
    "linear": ({"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}, 64),
    "dynamic": ({"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}, 16),
    "yarn": (  # theta 100, original 64: the ramp has an interior at head_dim 16 ([0, .2, .4, .6, .8, 1, 1, 1])
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 100.0},
        256,
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


def count_calls(
    monkeypatch: pytest.MonkeyPatch, owner: object, *names: str, calls: list[int] | None = None
) -> list[int]:
    """Count the calls of ``owner``'s functions ``names`` (all together, in ``calls`` if given) while the test runs."""
    calls = [0] if calls is None else calls
    for name in names:
        inner = getattr(owner, name)

        def counted(*args: object, inner: Any = inner, **kwargs: object) -> object:
            calls[0] += 1
            return inner(*args, **kwargs)

        monkeypatch.setattr(owner, name, counted)
    return calls


def count_ropelib_rotations(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Calls of the patched apply function that ropelib served: each is one ``rotate_token_tables`` call."""
    return count_calls(monkeypatch, hf.apply, "rotate_token_tables")


class OperatorCalls(TorchDispatchMode):
    """Counts the calls of ropelib's operators ``ropelib::rotary`` and ``ropelib::rotary_`` that reach dispatch."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in (torch.ops.ropelib.rotary.default, torch.ops.ropelib.rotary_.default):
            self.calls += 1
        return func(*args, **(kwargs or {}))


# ----------------------------------------------------------------------------- logits


@pytest.mark.parametrize("scaling", list(SCALINGS))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_prefill_logits_match_unpatched(family: str, scaling: str, monkeypatch: pytest.MonkeyPatch) -> None:
    reference = tiny_model(family, scaling)
    patched = patched_copy(reference)
    assert isinstance(patched.model.rotary_emb, HFRotaryEmbedding)
    ids, mask = left_padded_batch([24, 17, 9], total=24)
    positions = positions_from_mask(mask)
    ropelib_calls = count_ropelib_rotations(monkeypatch)
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
    ropelib_calls = count_ropelib_rotations(monkeypatch)
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


def test_cached_decoding_under_inference_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    # Under torch.inference_mode the tables are inference tensors, which have no version counter:
    # the patched apply then recognises ropelib's tables by identity alone, and the model still decodes and agrees.
    reference = tiny_model("llama", "default")
    patched = patched_copy(reference)
    prompt = torch.randint(1, 100, (2, 6), generator=torch.Generator().manual_seed(3))
    steps = torch.randint(1, 100, (2, 4), generator=torch.Generator().manual_seed(4))
    caches = [transformers.DynamicCache(config=m.config) for m in (reference, patched)]
    ropelib_calls = count_ropelib_rotations(monkeypatch)
    with torch.inference_mode():
        outs = [m(prompt, cache=c, use_cache=True).logits for m, c in zip((reference, patched), caches)]
        assert_logits_close(outs[0], outs[1])
        for step in range(steps.shape[1]):
            token = steps[:, step : step + 1]
            outs = [m(token, cache=c, use_cache=True).logits for m, c in zip((reference, patched), caches)]
            assert_logits_close(outs[0], outs[1])
    assert ropelib_calls[0] == (1 + steps.shape[1]) * 2  # every pass of the patched model, 2 layers each


def test_triton_kernel_matches_unpatched() -> None:
    # The fused Triton kernel that "auto" picks on CUDA; without CUDA it runs in Triton's interpreter
    # (TRITON_INTERPRET=1, set by ropelib), slowly, hence one small prefill with per-row positions.
    pytest.importorskip("triton")
    reference = tiny_model("qwen2", "yarn")
    patched = patched_copy(reference, kernel="triton")
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
    ropelib_calls = count_ropelib_rotations(monkeypatch)
    original_calls = count_calls(monkeypatch, wrapper, "original")
    for length in (8, 1):  # a prompt, and a single token (a decoding step): the same path
        before = ropelib_calls[0]
        with torch.no_grad(), OperatorCalls() as operator:
            model(torch.arange(1, 1 + length)[None])
        # q and k of each of the 2 layers: one call of ropelib's fused operator each; transformers' function
        # is never reached.
        assert ropelib_calls[0] - before == 2 and operator.calls == 2 and original_calls[0] == 0, length
    unpatch_hf_rope(model)


def patched_llama_apply() -> tuple[torch.nn.Module, Any, Any]:
    """A patched tiny Llama, the patched ``apply_rotary_pos_emb`` and transformers' own function."""
    from transformers.models.llama import modeling_llama

    original = hf.probes.unwrapped(modeling_llama, "apply_rotary_pos_emb")
    model = patch_hf_rope(tiny_model("llama"))
    wrapper = modeling_llama.apply_rotary_pos_emb
    assert isinstance(wrapper, hf.apply.RopelibApply) and not isinstance(original, hf.apply.RopelibApply)
    return model, wrapper, original


def random_qk(seq: int, seed: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama's q and k of the tiny model, ``[batch 2, heads, seq, head_dim 16]`` (4 query, 2 key/value heads)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(2, 4, seq, 16, generator=generator), torch.randn(2, 2, seq, 16, generator=generator)


def test_negated_sin_gives_the_inverse_rotation(monkeypatch: pytest.MonkeyPatch) -> None:
    # apply_rotary_pos_emb(q, k, cos, -sin) rotates by -theta. The -sin is a new tensor, not the one the
    # installed module returned beside cos: the call must go to transformers' function with these very
    # arguments (a stand-in that knew ropelib's tables by cos alone would rotate by +theta instead).
    model, wrapper, original = patched_llama_apply()
    positions = torch.tensor([[0, 1, 2, 5, 9, 17], [3, 4, 5, 6, 7, 8]])
    cos, sin = model.model.rotary_emb(torch.zeros(1), positions)
    q, k = random_qk(6)
    ropelib_calls = count_ropelib_rotations(monkeypatch)
    with torch.no_grad():
        q_rot, k_rot = wrapper(q, k, cos, sin)  # the module's own pair: ropelib rotates by +theta
        assert ropelib_calls[0] == 1
        want = original(q_rot, k_rot, cos, -sin)
        got = wrapper(q_rot, k_rot, cos, -sin)
    assert ropelib_calls[0] == 1  # the inverse went to transformers' function
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    # and it is the inverse: R(-theta) R(theta) q = q, to float32 rounding of |q| ~ 4 (two rotations)
    assert torch.allclose(got[0], q, atol=1e-5, rtol=0.0) and torch.allclose(got[1], k, atol=1e-5, rtol=0.0)
    unpatch_hf_rope(model)


def test_sin_of_another_call_goes_to_transformers(monkeypatch: pytest.MonkeyPatch) -> None:
    # cos of one call with sin of another (of other positions) are not a pair the module returned.
    model, wrapper, original = patched_llama_apply()
    rotary = model.model.rotary_emb
    cos, _ = rotary(torch.zeros(1), torch.arange(6)[None])
    _, sin_elsewhere = rotary(torch.zeros(1), torch.arange(6)[None] + 10)
    q, k = random_qk(6)
    ropelib_calls = count_ropelib_rotations(monkeypatch)
    with torch.no_grad():
        want = original(q, k, cos, sin_elsewhere)
        got = wrapper(q, k, cos, sin_elsewhere)
    assert ropelib_calls[0] == 0
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    unpatch_hf_rope(model)


@pytest.mark.parametrize("changed", ["cos", "sin"])
def test_tables_changed_in_place_are_applied_as_changed(changed: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # A caller that scales the returned tables in place (cos.mul_(0.5)) gets transformers' rotation by the
    # scaled tables, not ropelib's float tables from before the change.
    model, wrapper, original = patched_llama_apply()
    positions = torch.arange(7)[None] + 2
    cos, sin = model.model.rotary_emb(torch.zeros(1), positions)
    q, k = random_qk(7)
    ropelib_calls = count_ropelib_rotations(monkeypatch)
    with torch.no_grad():
        # unchanged: ropelib's rotation, equal to transformers' to float32 rounding (same float32 tables)
        unchanged = wrapper(q, k, cos, sin)
        assert ropelib_calls[0] == 1
        for have, want in zip(unchanged, original(q, k, cos, sin)):
            assert torch.allclose(have, want, atol=1e-5, rtol=0.0)
        (cos if changed == "cos" else sin).mul_(0.5)
        want = original(q, k, cos, sin)
        got = wrapper(q, k, cos, sin)
    assert ropelib_calls[0] == 1  # the changed tables went to transformers' function
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert (got[0] - unchanged[0]).abs().max() > 0.1  # the change matters
    unpatch_hf_rope(model)


def test_inference_mode_prefill_matches_unpatched(monkeypatch: pytest.MonkeyPatch) -> None:
    # Under torch.inference_mode the returned tables are inference tensors, which have no version counter
    # (reading one raises): the patched model must still run, be served by ropelib, and agree.
    reference = tiny_model("llama", "yarn")
    patched = patched_copy(reference)
    ids, mask = left_padded_batch([12, 7], total=12)
    kwargs = {"attention_mask": mask, "position_ids": positions_from_mask(mask)}
    ropelib_calls = count_ropelib_rotations(monkeypatch)
    with torch.inference_mode():
        expected = reference(ids, **kwargs).logits
        got = patched(ids, **kwargs).logits
    assert_logits_close(expected, got, mask)
    assert ropelib_calls[0] == 2  # both layers went through ropelib


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

    original_function = hf.probes.unwrapped(modeling_llama, "apply_rotary_pos_emb")  # transformers' own
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
    # YaRN (Peng et al., 2024): sqrt(1/t) = 0.1 ln(s) + 1 with s = 4.
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
    with pytest.raises(ValueError, match="kernel must be one of"):
        patch_hf_rope(tiny_model("llama"), kernel="cuda")


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


class InterleavedTablesRotaryEmbedding(transformers.models.llama.modeling_llama.LlamaRotaryEmbedding):
    """Llama's rotary module writing each angle twice side by side (Cohere's tables) for Llama's rotate_half."""

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(x.device)
        emb = torch.repeat_interleave(freqs, 2, dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def tiny_unknown_tables() -> torch.nn.Module:
    """A one-layer Llama whose rotary module (of no known family) repeats each angle side by side, not in halves.

    (Cohere does this with its own interleaved rotation, and is now a family of its own: see
    test_new_families_match_unpatched; this module pairs such tables with the Llama template.)
    """
    model = tiny_model("llama", num_hidden_layers=1)
    model.model.rotary_emb = InterleavedTablesRotaryEmbedding(model.config)
    return model


def test_rejects_a_model_with_interleaved_tables() -> None:
    # The module writes each angle twice side by side (repeat_interleave), not in two halves: the
    # patch-time probe sees that ropelib's tables for the Llama template differ and refuses.
    model = tiny_unknown_tables()
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
    model = tiny_unknown_tables().to(torch.bfloat16)
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


def test_ignore_keys_advice_is_an_argument_the_module_takes() -> None:
    # A model-specific key in the rope parameters (transformers lets such keys through with its
    # ignore_keys): the error advises ignore_keys=, which HFRotaryEmbedding takes.
    model = tiny_model("llama", "linear")
    config = model.config.to_dict()
    config["rope_parameters"] = {**config["rope_parameters"], "vendor_key": 3}
    with pytest.raises(
        ValueError, match="unknown keys \\['vendor_key'\\].*ignore_keys= \\(of rope_config, HFRotaryEmbedding"
    ):
        HFRotaryEmbedding(config)
    ours = HFRotaryEmbedding(config, ignore_keys=["vendor_key"])
    positions = torch.arange(24)[None]
    want = model.model.rotary_emb(torch.zeros(1), positions)  # transformers' module, without the key
    got = ours(torch.zeros(1), positions)
    # float32 angles of transformers: up to 24 * 2 * 2^-24 ~ 3e-6 rad (module docstring), plus rounding
    for w, g in zip(want, got):
        assert g.shape == w.shape and torch.allclose(g, w, atol=1e-5, rtol=0.0)
    with pytest.raises(TypeError, match="ignore_keys must be a collection of key names .* not a bare str"):
        HFRotaryEmbedding(config, ignore_keys="vendor_key")
    with pytest.raises(ValueError, match="ignore_keys is for the config read here"):
        HFRotaryEmbedding(config, rope_options={None: {"head_dim": 16}}, ignore_keys=["vendor_key"])


@pytest.mark.parametrize("shape", [(1, 0), (2, 0), (0,)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_empty_position_ids_give_empty_tables_like_transformers(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    model = tiny_model("llama")
    positions = torch.zeros(shape, dtype=torch.long)
    x = torch.zeros(1, dtype=dtype)
    want = model.model.rotary_emb(x, positions if len(shape) == 2 else positions[None])  # transformers: [batch, seq]
    got = HFRotaryEmbedding(model.config)(x, positions)
    assert [(t.shape, t.dtype) for t in got] == [(t.shape, t.dtype) for t in want]
    assert want[0].shape == (shape[0] if len(shape) == 2 else 1, 0, 16)


def test_empty_mrope_position_ids_give_empty_tables_like_transformers() -> None:
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRotaryEmbedding

    text = transformers.Qwen2VLTextConfig(**mrope_text([2, 3, 3]))
    theirs = Qwen2VLRotaryEmbedding(text)
    ours = HFRotaryEmbedding(text, mrope_section=[2, 3, 3], rope_options=hf.families.mrope_options(text.to_dict()))
    for positions in (torch.zeros(3, 1, 0, dtype=torch.long), torch.zeros(3, 2, 0, dtype=torch.long)):
        want, got = theirs(torch.zeros(1), positions), ours(torch.zeros(1), positions)
        assert [t.shape for t in got] == [t.shape for t in want] == [(positions.shape[1], 0, 16)] * 2


def test_exported_from_the_package() -> None:
    for name in ("HFRotaryEmbedding", "patch_hf_rope", "unpatch_hf_rope", "use_ropelib_rope"):
        assert getattr(ropelib, name) is getattr(hf, name)


# ----------------------------------------------------------------------------- families beyond the Llama template

# Token ids 0 (pad), 1 (eos) and 2 (bos) inside the vocabulary of 100, so that configs don't warn.
SPECIAL = dict(initializer_range=0.1, pad_token_id=0, eos_token_id=1, bos_token_id=2)


def tiny_glm() -> torch.nn.Module:
    # GLM's default partial_rotary_factor of 0.5: the first 8 of 16 features, rotated in interleaved pairs.
    return transformers.GlmForCausalLM(transformers.GlmConfig(**TINY, **SPECIAL))


def tiny_cohere() -> torch.nn.Module:
    # logit_scale 1 (not Cohere's 0.0625), so that the logits are as sensitive as the other models'.
    return transformers.CohereForCausalLM(transformers.CohereConfig(**TINY, **SPECIAL, logit_scale=1.0))


def tiny_gptj() -> torch.nn.Module:
    config = transformers.GPTJConfig(
        n_embd=64, n_head=4, n_layer=2, rotary_dim=8, vocab_size=100, n_positions=64, **SPECIAL
    )
    return transformers.GPTJForCausalLM(config)


def tiny_llama4() -> torch.nn.Module:
    # Layer 0 with RoPE, layer 1 without (NoPE, as every fourth layer of Llama 4): ropelib must leave it alone.
    config = transformers.Llama4TextConfig(
        **TINY, **SPECIAL, intermediate_size_mlp=128, head_dim=16, num_local_experts=2, no_rope_layers=[1, 0]
    )
    return transformers.Llama4ForCausalLM(config)


def tiny_gemma3() -> torch.nn.Module:
    # A local layer (sliding window 4, base 10 000) and a global one (base 10^6, linear scaling by 4).
    rope_parameters = {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
    }
    config = transformers.Gemma3TextConfig(
        **TINY,
        **SPECIAL,
        head_dim=16,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=4,
        rope_parameters=rope_parameters,
    )
    return transformers.Gemma3ForCausalLM(config)


def mrope_text(mrope_section: list[int], **extra: Any) -> dict[str, Any]:
    """The text config of the tiny Qwen-VL models: TINY with M-RoPE sections over base 10^4."""
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": mrope_section}
    return dict(**TINY, **extra, initializer_range=0.1, rope_parameters=rope)


def tiny_qwen2_vl() -> torch.nn.Module:
    # M-RoPE with mrope_section (2, 3, 3) of the 8 frequency pairs; a one-block vision tower (unused by text).
    text = mrope_text([2, 3, 3])
    vision = dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=2, spatial_merge_size=2)
    config = transformers.Qwen2VLConfig(text_config=text, vision_config=vision, **SPECIAL)
    return transformers.Qwen2VLForConditionalGeneration(config)


def tiny_qwen2_5_vl() -> torch.nn.Module:
    text = mrope_text([2, 3, 3])
    vision = dict(
        depth=1,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        out_hidden_size=64,
        patch_size=2,
        spatial_merge_size=2,
        fullatt_block_indexes=[0],
    )
    config = transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, **SPECIAL)
    return transformers.Qwen2_5_VLForConditionalGeneration(config)


def tiny_qwen3_vl() -> torch.nn.Module:
    # Qwen3-VL's interleaved M-RoPE: pairs 1, 4 to height, 2, 5 to width (3 * 2 < 8), the rest to time.
    text = mrope_text([4, 2, 2], head_dim=16)
    vision = dict(
        depth=1,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        out_hidden_size=64,
        patch_size=2,
        spatial_merge_size=2,
        deepstack_visual_indexes=[0],
        num_position_embeddings=16,
    )
    config = transformers.Qwen3VLConfig(text_config=text, vision_config=vision, **SPECIAL)
    return transformers.Qwen3VLForConditionalGeneration(config)


# name -> (builder, rotate_qk calls per forward pass): one per RoPE layer (q and k together), two for
# GPT-J (which rotates q and k in separate calls), one for Llama 4 (its second layer is NoPE).
NEW_FAMILIES = {
    "glm": (tiny_glm, 2),
    "cohere": (tiny_cohere, 2),
    "gptj": (tiny_gptj, 4),
    "llama4": (tiny_llama4, 1),
    "gemma3": (tiny_gemma3, 2),
    "qwen2_vl": (tiny_qwen2_vl, 2),
    "qwen2_5_vl": (tiny_qwen2_5_vl, 2),
    "qwen3_vl": (tiny_qwen3_vl, 2),
}


def new_family_model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return NEW_FAMILIES[name][0]().eval()


def rotary_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if isinstance(m, HFRotaryEmbedding)]


@pytest.mark.parametrize("name", list(NEW_FAMILIES))
def test_new_families_match_unpatched(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Prefill (left-padded with explicit positions, then default positions), and greedy generation
    # with and without a KV cache: same logits (LOGIT_ATOL, module docstring) and the same tokens.
    reference = new_family_model(name)
    patched = patched_copy(reference)
    assert len(rotary_modules(patched)) == 1
    ids, mask = left_padded_batch([12, 9, 5], total=12)
    ropelib_calls = count_ropelib_rotations(monkeypatch)
    with torch.no_grad():
        for kwargs in ({"attention_mask": mask, "position_ids": positions_from_mask(mask)}, {}):
            assert_logits_close(
                reference(ids, **kwargs).logits, patched(ids, **kwargs).logits, mask if kwargs else None
            )
        assert ropelib_calls[0] == 2 * NEW_FAMILIES[name][1]  # every RoPE layer went through ropelib
        for use_cache in (True, False):
            options = dict(
                attention_mask=mask,
                max_new_tokens=6,
                do_sample=False,
                use_cache=use_cache,
                output_logits=True,
                return_dict_in_generate=True,
            )
            expected = reference.generate(ids, **options)
            got = patched.generate(ids, **options)
            assert torch.equal(expected.sequences, got.sequences), use_cache
            for want, have in zip(expected.logits, got.logits):
                assert_logits_close(want, have)


@pytest.mark.parametrize("name", list(NEW_FAMILIES))
def test_new_families_are_sensitive_to_rope(name: str) -> None:
    # The power of the comparison above, for each family: positions spread twice as far apart
    # (relative distances doubled) change the logits by far more than LOGIT_ATOL.
    model = new_family_model(name)
    ids, _ = left_padded_batch([12], total=12)
    with torch.no_grad():
        near = model(ids, position_ids=torch.arange(12)[None]).logits
        far = model(ids, position_ids=2 * torch.arange(12)[None]).logits
    assert (near - far).abs().max().item() > 100 * LOGIT_ATOL


def test_gemma3_builds_one_rope_per_layer_type() -> None:
    model = patch_hf_rope(new_family_model("gemma3"))
    rotary = model.model.rotary_emb
    assert rotary.layer_types == ["full_attention", "sliding_attention"]
    assert rotary.ropes["sliding_attention"].theta == 10000.0 and rotary.ropes["sliding_attention"].scaling is None
    assert rotary.ropes["full_attention"].theta == 1e6
    assert rotary.ropes["full_attention"].scaling == {"rope_type": "linear", "factor": 4.0}
    with pytest.raises(ValueError, match="layer_type must be one of"):
        rotary(torch.zeros(1), torch.arange(3)[None])
    unpatch_hf_rope(model)


@pytest.mark.parametrize("name", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_qwen_vl_multimodal_positions_match_unpatched(name: str) -> None:
    # Three-axis positions of text, a 1 x 4 x 6 patch grid (2 x 3 tokens after the 2 x 2 merge), text:
    # each frequency pair takes the position of its axis, in transformers as in ropelib.
    reference = new_family_model(name)
    patched = patched_copy(reference)
    positions = ropelib.rotary.mrope.mrope_positions([3, (1, 4, 6), 4], spatial_merge_size=2)[:, None].expand(3, 2, -1)
    ids, _ = left_padded_batch([13, 13], total=13)
    with torch.no_grad():
        expected = reference(ids, position_ids=positions).logits
        got = patched(ids, position_ids=positions).logits
        text_only = reference(ids).logits
    assert_logits_close(expected, got)
    assert (expected - text_only).abs().max().item() > 100 * LOGIT_ATOL  # the image positions matter


def test_qwen2_vl_vision_rotary_module_is_left_alone() -> None:
    model = patch_hf_rope(new_family_model("qwen2_vl"))
    assert type(model.model.visual.rotary_pos_emb).__name__ == "Qwen2VLVisionRotaryEmbedding"
    assert model.model.language_model.rotary_emb.mrope.mrope_section == (2, 3, 3)
    unpatch_hf_rope(model)


def test_probe_refuses_an_apply_function_of_another_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    # GLM's row says "interleaved"; a modeling module whose function rotates halves is refused.
    from transformers.models.glm import modeling_glm
    from transformers.models.llama import modeling_llama

    monkeypatch.setattr(modeling_glm, "apply_rotary_pos_emb", modeling_llama.apply_rotary_pos_emb)
    model = new_family_model("glm")
    original_module = model.model.rotary_emb
    with pytest.raises(ValueError, match="is not the 'interleaved'-layout rotation"):
        patch_hf_rope(model)
    assert model.model.rotary_emb is original_module
    assert modeling_glm.apply_rotary_pos_emb is modeling_llama.apply_rotary_pos_emb


def test_probe_refuses_an_mrope_section_that_does_not_fit() -> None:
    # Qwen2-VL's default mrope_section (16, 24, 24) is for 64 pairs; this model has 8.
    model = new_family_model("qwen2_vl")
    model.model.language_model.rotary_emb.mrope_section = [16, 24, 24]
    with pytest.raises(ValueError, match="mrope_section must sum to"):
        patch_hf_rope(model)
    assert type(model.model.language_model.rotary_emb).__name__ == "Qwen2VLRotaryEmbedding"


@pytest.mark.parametrize("name", ["gptj", "llama4"])
def test_unpatch_restores_other_signatures(name: str) -> None:
    # The two families whose functions have signatures of their own get their originals back.
    import importlib

    py_module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    apply_name = "apply_rotary_emb" if name == "llama4" else "apply_rotary_pos_emb"
    # transformers' own function (an earlier test may have left ropelib's wrapper, with no users, in place)
    original_function = hf.probes.unwrapped(py_module, apply_name)
    model = new_family_model(name)
    original_module = model.model.rotary_emb if name == "llama4" else model.transformer.rotary_emb
    ids, _ = left_padded_batch([8], total=8)
    with torch.no_grad():
        before = model(ids).logits
        patch_hf_rope(model)
        assert isinstance(getattr(py_module, apply_name), hf.apply.RopelibApply)
        unpatch_hf_rope(model)
        after = model(ids).logits
    assert getattr(py_module, apply_name) is original_function
    assert original_module in list(model.modules())
    assert torch.equal(before, after)


def test_new_arguments_are_checked() -> None:
    config = tiny_model("llama").config
    with pytest.raises(ValueError, match="output must be one of"):
        HFRotaryEmbedding(config, output="halves")
    with pytest.raises(TypeError, match="rope_options must be a non-empty dict"):
        HFRotaryEmbedding(config, rope_options={})
    two = {t: ropelib.rope_config(hf.module.config_dict(config)) for t in ("full_attention", "sliding_attention")}
    with pytest.raises(ValueError, match="mrope_section needs a single RoPE setting"):
        HFRotaryEmbedding(config, rope_options=two, mrope_section=[2, 3, 3])
    with pytest.raises(TypeError, match="mrope_interleaved must be a bool"):
        HFRotaryEmbedding(config, mrope_section=[2, 3, 3], mrope_interleaved="yes")  # type: ignore[arg-type]
    mrope = HFRotaryEmbedding(config, mrope_section=[2, 3, 3])
    with pytest.raises(ValueError, match=r"position_ids must have shape \[3, batch, seq\]"):
        mrope(torch.zeros(1), torch.zeros(2, 1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="layout must be one of"):
        hf.families.Family("x", lambda m: False, "apply_rotary_pos_emb", "diagonal")
    with pytest.raises(ValueError, match="signature must be one of"):
        hf.families.Family("x", lambda m: False, "apply_rotary_pos_emb", "half", signature="q_only")


@pytest.mark.parametrize("output", ["cat", "repeat", "sin_cos", "complex"])
def test_every_output_form_holds_the_same_angles(output: str) -> None:
    # The four forms of tables transformers' families use, all from ropelib's half-width float tables.
    config = tiny_model("llama").config
    rotary = HFRotaryEmbedding(config, output=output)
    positions = torch.tensor([[0, 3, 7]])
    want_cos, want_sin = reference_tables(positions.flatten().tolist(), 16, 10000.0)
    out = rotary(torch.zeros(1), positions)
    if output == "complex":
        cos, sin = out.real[0], out.imag[0]
    elif output == "sin_cos":
        sin, cos = out[0][0], out[1][0]
    else:
        cos, sin = out[0][0], out[1][0]
    if output == "repeat":
        cos, sin = cos[..., 0::2], sin[..., 0::2]
    elif output == "cat":
        cos, sin = cos[..., :8], sin[..., :8]
    assert torch.allclose(cos.double(), want_cos[:, :8], atol=1e-7, rtol=0.0)
    assert torch.allclose(sin.double(), want_sin[:, :8], atol=1e-7, rtol=0.0)
    # The patched apply recognises exactly these tensors, returned together (sin first for GPT-J's "sin_cos").
    returned = (out,) if output == "complex" else out
    assert hf.module.returned_tables(*returned) is not None
    assert hf.module.returned_tables(torch.zeros(1)) is None
    if output != "complex":  # one of the two alone, or beside another tensor, is not what the module returned
        assert hf.module.returned_tables(out[0]) is None
        assert hf.module.returned_tables(out[0], out[1].clone()) is None
        assert hf.module.returned_tables(out[1], out[0]) is None
