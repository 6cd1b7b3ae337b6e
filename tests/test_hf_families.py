"""Every RoPE family transformers ships: the new rows against the unpatched models, and a walk of the causal-LM registry.

Expected values are the logits and greedy tokens of the same tiny random transformers model before
patching (transformers' own RoPE code). Models are built from configs here, nothing is downloaded.
Tolerance: LOGIT_ATOL of tests/test_huggingface.py (float32 rounding: ropelib's float64 angles
against transformers' float32 ones, 2 layers; measured differences are below 1e-5).
"""

from __future__ import annotations

import importlib
import inspect
import logging
import warnings
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_huggingface import (  # noqa: E402
    LOGIT_ATOL,
    SPECIAL,
    TINY,
    assert_logits_close,
    count_ropelib_rotations,
    left_padded_batch,
    positions_from_mask,
    rotary_modules,
)

from ropelib.integrations.huggingface import families, patch_hf_rope, unpatch_hf_rope  # noqa: E402
from ropelib.integrations.huggingface.families import REFUSED, family_of  # noqa: E402
from ropelib.integrations.huggingface.patch import _replacement  # noqa: E402
from ropelib.integrations.huggingface.probes import probe_apply, probe_tables  # noqa: E402

# YaRN with a ramp that has an interior at rotary width 8..16 (theta 100, original 64), factor 4.
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 100.0}
MLA = dict(
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=16,
    n_routed_experts=2,
    num_experts_per_tok=1,
    n_shared_experts=1,
    moe_intermediate_size=32,
    first_k_dense_replace=1,
    max_position_embeddings=256,
)
MLA_TINY = {**TINY, "num_key_value_heads": TINY["num_attention_heads"]}  # MLA expands its latent to every head


def tiny_cohere2() -> torch.nn.Module:
    config = transformers.Cohere2Config(
        **TINY, **SPECIAL, logit_scale=1.0, sliding_window=4, layer_types=["sliding_attention", "full_attention"]
    )
    return transformers.Cohere2ForCausalLM(config)


def tiny_gpt_oss() -> torch.nn.Module:
    # GPT-OSS's YaRN without truncation, half tables, attention sinks, a sliding and a full layer.
    rope = {**YARN, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}
    config = transformers.GptOssConfig(
        **TINY, **SPECIAL, head_dim=16, num_local_experts=2, num_experts_per_tok=1, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"], rope_parameters=rope, max_position_embeddings=256,
    )  # fmt: skip
    return transformers.GptOssForCausalLM(config)


def tiny_ernie4_5() -> torch.nn.Module:
    return transformers.Ernie4_5ForCausalLM(transformers.Ernie4_5Config(**TINY, **SPECIAL, head_dim=16))


def tiny_gemma4() -> torch.nn.Module:
    # A sliding layer (head 16, base 10^4) and a global one (head 32, proportional: a quarter of the pairs).
    config = transformers.Gemma4TextConfig(
        **TINY, **SPECIAL, head_dim=16, global_head_dim=32, layer_types=["sliding_attention", "full_attention"],
        sliding_window=4, hidden_size_per_layer_input=8, vocab_size_per_layer_input=100,
    )  # fmt: skip
    return transformers.Gemma4ForCausalLM(config)


def tiny_deepseek_v2() -> torch.nn.Module:
    # MLA's decoupled RoPE key (8 of 16 query features), YaRN with DeepSeek's mscale / mscale_all_dim.
    rope = {**YARN, "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}
    config = transformers.DeepseekV2Config(**MLA_TINY, **SPECIAL, **MLA, q_lora_rank=None, rope_parameters=rope)
    return transformers.DeepseekV2ForCausalLM(config)


def tiny_deepseek_v3(rope_interleave: bool = True) -> torch.nn.Module:
    rope = {**YARN, "mscale": 1.0, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}
    config = transformers.DeepseekV3Config(
        **MLA_TINY, **SPECIAL, **MLA, q_lora_rank=16, n_group=1, topk_group=1, rope_parameters=rope,
        rope_interleave=rope_interleave,
    )  # fmt: skip
    return transformers.DeepseekV3ForCausalLM(config)


def tiny_helium() -> torch.nn.Module:
    return transformers.HeliumForCausalLM(transformers.HeliumConfig(**TINY, **SPECIAL, head_dim=16))


# name -> (builder, the row that must take it, ropelib rotations per forward pass: one per RoPE layer
# for q and k together; Gemma 4 rotates q and k in separate calls)
NEW = {
    "cohere2": (tiny_cohere2, families.COHERE, 1),  # its full-attention layer has no RoPE
    "gpt_oss": (tiny_gpt_oss, families.GPT_OSS, 2),
    "ernie4_5": (tiny_ernie4_5, families.ERNIE, 2),
    "gemma4": (tiny_gemma4, families.GEMMA4, 4),
    "deepseek_v2": (tiny_deepseek_v2, families.DEEPSEEK_V2, 2),
    "deepseek_v3 interleaved": (tiny_deepseek_v3, families.DEEPSEEK_V3_INTERLEAVED, 2),
    "deepseek_v3": (lambda: tiny_deepseek_v3(False), families.LLAMA_TEMPLATE, 2),
    "helium": (tiny_helium, families.GLM, 2),
}


def build(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return NEW[name][0]().eval()


@pytest.mark.parametrize("name", list(NEW))
def test_new_family_matches_unpatched(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Prefill (left-padded with explicit positions, then default positions) and greedy generation with
    # and without a KV cache: logits within LOGIT_ATOL, the same tokens, every RoPE layer through ropelib.
    reference = build(name)
    patched = patch_hf_rope(build(name))
    (rotary,) = rotary_modules(patched)
    assert family_of(rotary.original) is NEW[name][1]
    ids, mask = left_padded_batch([12, 9, 5], total=12)
    calls = count_ropelib_rotations(monkeypatch)
    with torch.no_grad():
        for kwargs in ({"attention_mask": mask, "position_ids": positions_from_mask(mask)}, {}):
            assert_logits_close(
                reference(ids, **kwargs).logits, patched(ids, **kwargs).logits, mask if kwargs else None
            )
        assert calls[0] == 2 * NEW[name][2]
        for use_cache in (True, False):
            options: dict[str, Any] = dict(
                attention_mask=mask, max_new_tokens=5, do_sample=False, use_cache=use_cache,
                output_logits=True, return_dict_in_generate=True,
            )  # fmt: skip
            want, got = reference.generate(ids, **options), patched.generate(ids, **options)
            assert torch.equal(want.sequences, got.sequences), use_cache
            for w, g in zip(want.logits, got.logits):
                assert_logits_close(w, g)
    unpatch_hf_rope(patched)


@pytest.mark.parametrize("name", list(NEW))
def test_new_family_is_sensitive_to_rope(name: str) -> None:
    # The power of the comparison: doubled relative distances move the logits by far more than LOGIT_ATOL.
    model = build(name)
    ids, _ = left_padded_batch([12], total=12)
    with torch.no_grad():
        near = model(ids, position_ids=torch.arange(12)[None]).logits
        far = model(ids, position_ids=2 * torch.arange(12)[None]).logits
    assert (near - far).abs().max().item() > 100 * LOGIT_ATOL


def test_deepseek_yarn_attention_factor_is_the_mscale_ratio() -> None:
    # DeepSeek's YaRN: cos and sin scaled by mscale(s, mscale) / mscale(s, mscale_all_dim), mscale(s, m) = 0.1 m ln s + 1.
    import math

    rotary = patch_hf_rope(build("deepseek_v3 interleaved")).model.rotary_emb
    expected = (0.1 * 1.0 * math.log(4.0) + 1) / (0.1 * 0.707 * math.log(4.0) + 1)
    assert rotary.attention_scaling == pytest.approx(expected, rel=1e-12)
    assert rotary.original.attention_scaling == pytest.approx(expected, rel=1e-6)  # transformers' own value


# ----------------------------------------------------------------------------- the registry walk

# Model types of the causal-LM registry that this walk cannot build from their default config
# offline, with the reason. The test fails when one of them can be built (keep the list exact).
UNBUILDABLE = {
    "blt": "its rotary module reads hidden_size from a config whose text part is nested (BltConfig)",
    "cohere_compass_text": "its default config has no rope parameters for the layer types its rotary module reads",
}
# A consistent head for default configs whose hidden_size is no multiple of the heads (transformers floors).
OVERRIDES: dict[str, dict[str, Any]] = {"glm4_moe": {"head_dim": 128}, "glm4_moe_lite": {"head_dim": 64}}


def _text_rotary_classes(py_module: Any) -> list[type]:
    return [
        cls
        for name, cls in vars(py_module).items()
        if inspect.isclass(cls)
        and issubclass(cls, torch.nn.Module)
        and cls.__module__ == py_module.__name__
        and name.endswith("RotaryEmbedding")
        and "Vision" not in name
        and "Audio" not in name
    ]


def _rope_types() -> dict[str, tuple[Any, list[type]]]:
    """Causal-LM model types whose modeling module has a text rotary module: (modeling module, rotary classes)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    found = {}
    for model_type, class_name in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()):
        model_class = getattr(transformers, class_name, None)
        if model_class is None:  # a name the library lists but does not define here
            continue
        py_module = importlib.import_module(model_class.__module__)
        classes = _text_rotary_classes(py_module)
        if classes:
            found[model_type] = (py_module, classes)
    return found


def _check(model_type: str, py_module: Any, cls: type) -> str:
    """``"patched"`` when the family's probes pass on a rotary module built from the default config;
    else raises (ValueError: refused with ropelib's reason; anything else: not built)."""
    config = transformers.AutoConfig.for_model(model_type, **OVERRIDES.get(model_type, {})).get_text_config()
    module = cls(config=config)
    family = family_of(module)
    if family is None:
        return "no family"
    model_type_of = getattr(config, "model_type", model_type)
    if model_type_of in REFUSED or model_type in REFUSED:
        return "refused"
    if family is families.GPTJ:  # GPT-J's module has no config of its own: the patch reads its parent's
        module.config = config
    replacement = _replacement(module, "rotary", module, family, "torch")
    for tables, _ in probe_tables(module, replacement, torch.device("cpu")).values():
        probe_apply(py_module, family, replacement, tables)
    return "patched"


def test_every_causal_lm_with_rope_is_patched_or_refused() -> None:
    # Each causal-LM type of transformers' registry with a text *RotaryEmbedding: its module, built from the
    # default config, is taken by a family whose patch-time probes pass, or its type is REFUSED with a reason.
    outcomes: dict[str, str] = {}
    unbuilt: dict[str, str] = {}
    logging.disable(logging.WARNING)  # transformers' notes on default configs
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the same notes, and ropelib's where transformers warns
            for model_type, (py_module, classes) in _rope_types().items():
                for cls in classes:
                    try:
                        outcomes[f"{model_type}:{cls.__name__}"] = _check(model_type, py_module, cls)
                    except ValueError as error:
                        outcomes[f"{model_type}:{cls.__name__}"] = f"probe refused: {error}"
                    except Exception as error:  # noqa: BLE001  (recorded, and checked against UNBUILDABLE below)
                        unbuilt[model_type] = f"{type(error).__name__}: {error}"
    finally:
        logging.disable(logging.NOTSET)
    assert set(unbuilt) == set(UNBUILDABLE), unbuilt
    problems = {k: v for k, v in outcomes.items() if v not in ("patched", "refused")}
    assert not problems, problems  # neither patched nor refused with a reason of ropelib's list
    refused = {k.split(":")[0] for k, v in outcomes.items() if v == "refused"}
    assert refused == set(REFUSED), refused  # the list is exact: a refused type that now patches is taken off
    assert sum(v == "patched" for v in outcomes.values()) >= 100  # most of the registry, as counted in this release


@pytest.mark.parametrize("model_type", sorted(REFUSED))
def test_refused_types_are_refused_with_their_reason(model_type: str) -> None:
    py_module, classes = _rope_types()[model_type]
    module = classes[0](config=transformers.AutoConfig.for_model(model_type).get_text_config())
    holder = torch.nn.Module()
    holder.rotary_emb = module
    with pytest.raises(ValueError, match="not patched: " + REFUSED[model_type][:20]):
        patch_hf_rope(holder)
