"""The checks behind book/huggingface.ipynb, with the chapter's own tiny models.

The chapter shows one or two models per section and states that the others agree too; this file
runs every one of them. Expected values are the logits and greedy tokens of the same tiny random
``transformers`` model before patching, that is ``transformers``' own RoPE code, never ropelib's.
The tolerance is the chapter's, 1e-4 (float32 angles in ``transformers`` against ropelib's float64
ones, through two layers: about 1e-6 to 1e-5), and each group has a negative control: the same
comparison against a model with a different RoPE moves the logits by far more than the tolerance.
Dynamic NTK's regrown frequencies are checked against the formula, computed here in float64.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from ropelib import patch_hf_rope  # noqa: E402
from ropelib.integrations.huggingface.families import family_of  # noqa: E402

TOL = 1e-4  # the chapter's tolerance
THETA = 10000.0

SCALINGS: dict[str, tuple[dict[str, Any], int]] = {
    "default": ({"rope_type": "default", "rope_theta": THETA}, 64),
    "linear": ({"rope_type": "linear", "factor": 2.0, "rope_theta": THETA}, 64),
    "dynamic": ({"rope_type": "dynamic", "factor": 2.0, "rope_theta": THETA}, 16),
    "yarn": (
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": THETA},
        64,
    ),
    "llama3": (
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
            "rope_theta": THETA,
        },
        256,
    ),
}

SPECIAL = dict(initializer_range=0.1, pad_token_id=0, eos_token_id=1, bos_token_id=2)
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=100,
)
VISION = dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=2, spatial_merge_size=2)
MROPE = {"rope_type": "default", "rope_theta": THETA, "mrope_section": [2, 3, 3]}
YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "rope_theta": 100.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
}
LAYERS = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=4)
MLA = dict(
    kv_lora_rank=16,
    q_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=16,
    n_routed_experts=2,
    num_experts_per_tok=1,
    n_shared_experts=1,
    moe_intermediate_size=32,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
    rope_interleave=True,
)


@pytest.fixture(autouse=True)
def _quiet_transformers() -> Iterator[None]:
    """transformers' warnings off during each test, and back to what they were after it."""
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    yield
    transformers.logging.set_verbosity(verbosity)


def tiny_llama(rope_parameters: dict[str, Any], max_position_embeddings: int = 64) -> torch.nn.Module:
    config = transformers.LlamaConfig(
        **TINY,
        max_position_embeddings=max_position_embeddings,
        rope_parameters=dict(rope_parameters),
        initializer_range=0.1,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def left_padded(lengths: list[int], total: int, seed: int = 1) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 100, (len(lengths), total), generator=generator)
    mask = torch.zeros(len(lengths), total, dtype=torch.long)
    for row, length in enumerate(lengths):
        mask[row, total - length :] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids * mask, mask, positions


def prompt_then_steps(model: torch.nn.Module, steps: int = 10) -> list[torch.Tensor]:
    """Logits of real tokens of a left-padded prompt, then of `steps` cached one-token steps."""
    ids, mask, positions = left_padded([10, 7, 4], total=10)
    new_tokens = torch.randint(1, 100, (3, steps), generator=torch.Generator().manual_seed(2))
    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        out = model(ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True)
        logits = [out.logits[mask.bool()]]
        for t in range(steps):
            mask = torch.cat((mask, torch.ones(3, 1, dtype=torch.long)), dim=1)
            position = mask.sum(-1, keepdim=True) - 1
            out = model(
                new_tokens[:, t : t + 1], attention_mask=mask, position_ids=position, cache=cache, use_cache=True
            )
            logits.append(out.logits)
    return logits


def largest_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("name", list(SCALINGS))
def test_every_scaling_matches_over_prompt_and_cached_steps(name: str) -> None:
    rope_parameters, max_positions = SCALINGS[name]
    reference = tiny_llama(rope_parameters, max_positions)
    patched = patch_hf_rope(copy.deepcopy(reference))
    assert largest_difference(prompt_then_steps(reference), prompt_then_steps(patched)) <= TOL


def test_a_real_change_of_rope_is_far_above_the_tolerance() -> None:
    reference = tiny_llama(SCALINGS["default"][0])
    doubled = tiny_llama({"rope_type": "default", "rope_theta": 2 * THETA})
    assert largest_difference(prompt_then_steps(reference), prompt_then_steps(doubled)) > 100 * TOL


def test_dynamic_ntk_regrows_the_frequencies_by_the_formula() -> None:
    """After decoding past max_position_embeddings = 16, the base is base * (s N/L - (s - 1))^(d/(d-2))."""
    rope_parameters, max_positions = SCALINGS["dynamic"]
    patched = patch_hf_rope(tiny_llama(rope_parameters, max_positions))
    prompt_then_steps(patched)  # the prompt of 10 and 10 steps: the longest row reaches N = 20
    rotary = patched.model.rotary_emb
    x = torch.zeros(1, 1, 16)
    n_tokens, train_length, factor, head_dim = 20, 16, 2.0, 16
    cos, _ = rotary(x, torch.tensor([[n_tokens - 1]]))
    stretch = factor * n_tokens / train_length - (factor - 1)
    base = THETA * stretch ** (head_dim / (head_dim - 2))
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    expected = torch.cos((n_tokens - 1) * inv_freq)
    torch.testing.assert_close(cos[0, 0, : head_dim // 2].double(), expected, atol=2e-7, rtol=0)
    default = torch.cos((n_tokens - 1) * THETA ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    assert (default - expected).abs().max() > 1e-3  # the regrowth is visible at this position


def tiny_family(name: str) -> torch.nn.Module:
    """The chapter's tiny random model of each family, from a config (seeded)."""
    torch.manual_seed(0)
    if name == "GLM":
        return transformers.GlmForCausalLM(transformers.GlmConfig(**TINY, **SPECIAL))
    if name == "Cohere":
        return transformers.CohereForCausalLM(transformers.CohereConfig(**TINY, **SPECIAL, logit_scale=1.0))
    if name == "GPT-J":
        config = transformers.GPTJConfig(n_embd=64, n_head=4, n_layer=2, rotary_dim=8, vocab_size=100, **SPECIAL)
        return transformers.GPTJForCausalLM(config)
    if name == "Llama 4":
        config = transformers.Llama4TextConfig(
            **TINY, **SPECIAL, intermediate_size_mlp=128, head_dim=16, num_local_experts=2, no_rope_layers=[1, 0]
        )
        return transformers.Llama4ForCausalLM(config)
    if name == "Gemma 3":
        config = transformers.Gemma3TextConfig(
            **TINY,
            **SPECIAL,
            head_dim=16,
            **LAYERS,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": THETA},
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
            },
        )
        return transformers.Gemma3ForCausalLM(config)
    if name == "Qwen2-VL":
        text = dict(**TINY, initializer_range=0.1, rope_parameters=dict(MROPE))
        config = transformers.Qwen2VLConfig(text_config=text, vision_config=VISION, **SPECIAL)
        return transformers.Qwen2VLForConditionalGeneration(config)
    if name == "Cohere 2":
        config = transformers.Cohere2Config(**TINY, **SPECIAL, **LAYERS, logit_scale=1.0)
        return transformers.Cohere2ForCausalLM(config)
    if name == "GPT-OSS":
        config = transformers.GptOssConfig(
            **TINY,
            **SPECIAL,
            **LAYERS,
            head_dim=16,
            num_local_experts=2,
            num_experts_per_tok=1,
            max_position_embeddings=256,
            rope_parameters={**YARN, "truncate": False},
        )
        return transformers.GptOssForCausalLM(config)
    if name == "Ernie 4.5":
        return transformers.Ernie4_5ForCausalLM(transformers.Ernie4_5Config(**TINY, **SPECIAL, head_dim=16))
    assert name == "DeepSeek V3"
    config = transformers.DeepseekV3Config(
        **{**TINY, "num_key_value_heads": 4},
        **SPECIAL,
        **MLA,
        max_position_embeddings=256,
        rope_parameters={**YARN, "mscale": 1.0, "mscale_all_dim": 0.707},
    )
    return transformers.DeepseekV3ForCausalLM(config)


FAMILIES = ["GLM", "Cohere", "GPT-J", "Llama 4", "Gemma 3", "Qwen2-VL"]
NEWER = ["Cohere 2", "GPT-OSS", "Ernie 4.5", "DeepSeek V3"]
# the row of FAMILIES that each should be taken by (what differs in each: the chapter's table)
ROW_OF_NEWER = {
    "Cohere 2": "Cohere",
    "GPT-OSS": "GPT-OSS",
    "Ernie 4.5": "Ernie 4.5",
    "DeepSeek V3": "DeepSeek V3 interleaved (MLA)",
}


def family_logits(model: torch.nn.Module) -> torch.Tensor:
    ids, mask, positions = left_padded([12, 9, 5], total=12)
    with torch.no_grad():
        return model(ids, attention_mask=mask, position_ids=positions).logits[mask.bool()]


@pytest.mark.parametrize("name", FAMILIES + NEWER)
def test_family_matches_unpatched(name: str) -> None:
    reference = tiny_family(name).eval()
    patched = patch_hf_rope(copy.deepcopy(reference))
    assert (family_logits(reference) - family_logits(patched)).abs().max().item() <= TOL


@pytest.mark.parametrize("name", NEWER)
def test_newer_family_generates_the_same_tokens_and_is_taken_by_its_row(name: str) -> None:
    reference = tiny_family(name).eval()
    patched = patch_hf_rope(copy.deepcopy(reference))
    assert family_of(patched.model.rotary_emb.original).name == ROW_OF_NEWER[name]
    ids, mask, _ = left_padded([12, 9, 5], total=12)
    greedy = dict(attention_mask=mask, max_new_tokens=4, do_sample=False)
    with torch.no_grad():
        assert torch.equal(reference.generate(ids, **greedy), patched.generate(ids, **greedy))


def test_families_see_a_change_of_rope() -> None:
    """Negative control: Gemma 3 with its global base changed moves the logits far beyond TOL."""
    reference = tiny_family("Gemma 3").eval()
    config = copy.deepcopy(reference.config)
    config.rope_parameters["full_attention"] = {"rope_type": "default", "rope_theta": 1e6}
    torch.manual_seed(0)
    changed = transformers.Gemma3ForCausalLM(config).eval()
    changed.load_state_dict(reference.state_dict())
    assert (family_logits(reference) - family_logits(changed)).abs().max().item() > 100 * TOL
