"""Configs as released: the legacy forms transformers accepts, read by rope_config, HFRotaryEmbedding and the patch.

Expected values: what transformers' own config object reports for the same dict (its
``rope_parameters``, the head and rotated width its rotary module builds), and the logits and
greedy tokens of the same tiny Qwen2-VL / Qwen2.5-VL models unpatched. Tolerance: LOGIT_ATOL of
tests/test_huggingface.py (float32 rounding of transformers' angles; see there).
"""

from __future__ import annotations

import copy
import logging
import warnings
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_huggingface import LOGIT_ATOL, assert_logits_close, rotary_modules  # noqa: E402

from ropelib import rope_config  # noqa: E402
from ropelib.integrations.huggingface import HFRotaryEmbedding, patch_hf_rope  # noqa: E402
from ropelib.integrations.huggingface.module import config_dict  # noqa: E402

# The keys of the released Qwen2-VL-7B-Instruct / Qwen2.5-VL-7B-Instruct config.json files, at tiny sizes:
# hidden 64, 4 heads (head_dim 16, 8 pairs), mrope_section [16, 24, 24] scaled to [2, 3, 3] (sum 8).
QWEN2_VL = {
    "architectures": ["Qwen2VLForConditionalGeneration"],
    "attention_dropout": 0.0,
    "bos_token_id": 2,
    "eos_token_id": 1,
    "vision_start_token_id": 90,
    "vision_end_token_id": 91,
    "vision_token_id": 92,
    "image_token_id": 93,
    "video_token_id": 94,
    "hidden_act": "silu",
    "hidden_size": 64,
    "initializer_range": 0.1,
    "intermediate_size": 128,
    "max_position_embeddings": 256,
    "max_window_layers": 2,
    "model_type": "qwen2_vl",
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 256,
    "tie_word_embeddings": False,
    "use_cache": True,
    "use_sliding_window": False,
    "vision_config": {
        "depth": 1, "embed_dim": 32, "mlp_ratio": 2, "num_heads": 2, "in_chans": 3, "hidden_size": 64,
        "patch_size": 2, "spatial_merge_size": 2, "spatial_patch_size": 2, "temporal_patch_size": 2,
    },
    "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
    "vocab_size": 100,
}  # fmt: skip
QWEN2_5_VL = {
    **QWEN2_VL,
    "architectures": ["Qwen2_5_VLForConditionalGeneration"],
    "model_type": "qwen2_5_vl",
    "vision_config": {
        "depth": 1, "hidden_act": "silu", "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
        "in_chans": 3, "out_hidden_size": 64, "patch_size": 2, "spatial_merge_size": 2, "spatial_patch_size": 2,
        "window_size": 8, "fullatt_block_indexes": [0], "tokens_per_second": 2, "temporal_patch_size": 2,
    },
}  # fmt: skip
RELEASED = {
    "qwen2_vl": (QWEN2_VL, transformers.Qwen2VLConfig, transformers.Qwen2VLForConditionalGeneration),
    "qwen2_5_vl": (QWEN2_5_VL, transformers.Qwen2_5_VLConfig, transformers.Qwen2_5_VLForConditionalGeneration),
}


def released_model(name: str) -> torch.nn.Module:
    released, config_cls, model_cls = RELEASED[name]
    torch.manual_seed(0)
    return model_cls(config_cls(**copy.deepcopy(released))).eval()


@pytest.mark.parametrize("name", list(RELEASED))
def test_released_config_reads_as_transformers_reads_it(name: str) -> None:
    released, config_cls, _ = RELEASED[name]
    text = config_cls(**copy.deepcopy(released)).text_config
    # transformers keeps type='mrope' beside the rope_type='default' it writes
    assert text.rope_parameters["rope_type"] == "default" and text.rope_parameters["type"] == "mrope"
    for source in (released, config_dict(text)):  # the config.json dict, and transformers' own dict of it
        options = rope_config(source)
        assert options["scaling"] is None and options["theta"] == text.rope_parameters["rope_theta"]
        assert options["head_dim"] == text.hidden_size // text.num_attention_heads
    rotary = HFRotaryEmbedding(text, mrope_section=text.rope_parameters["mrope_section"])
    assert rotary.rope_type == "default" and rotary.mrope.mrope_section == (2, 3, 3)


def _image_inputs(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A 1 x 4 x 4 patch grid (2 x 2 = 4 tokens after the merge) between text tokens, as the processor lays it out."""
    config = model.config
    vision = config.vision_config
    patch = vision.in_chans * vision.temporal_patch_size * vision.patch_size**2
    grid = torch.tensor([[1, 4, 4]])
    generator = torch.Generator().manual_seed(3)
    pixel_values = torch.randn(16, patch, generator=generator)
    text = torch.randint(3, 90, (1, 10), generator=generator)
    ids = torch.cat(
        (text[:, :4], torch.tensor([[config.vision_start_token_id] + [config.image_token_id] * 4]), text[:, 4:]), dim=1
    )
    kinds = (ids == config.image_token_id).long()  # the processor's mm_token_type_ids: 1 at image tokens
    return {"input_ids": ids, "pixel_values": pixel_values, "image_grid_thw": grid, "mm_token_type_ids": kinds}


@pytest.mark.parametrize("name", list(RELEASED))
def test_released_config_patched_matches_unpatched(name: str) -> None:
    # Text only and with an image; greedy tokens with and without a KV cache: logits within LOGIT_ATOL.
    reference = released_model(name)
    patched = patch_hf_rope(released_model(name))
    assert len(rotary_modules(patched)) == 1
    text_ids = torch.randint(3, 90, (2, 9), generator=torch.Generator().manual_seed(1))
    image = _image_inputs(reference)
    with torch.no_grad():
        assert_logits_close(reference(text_ids).logits, patched(text_ids).logits)
        want, got = reference(**image).logits, patched(**image).logits
        assert_logits_close(want, got)
        image_ids_only = reference(image["input_ids"]).logits  # the same tokens without the picture
        assert (want - image_ids_only).abs().max().item() > 100 * LOGIT_ATOL  # the image (and its positions) count
        for inputs in ({"input_ids": text_ids}, image):
            for use_cache in (True, False):
                options: dict[str, Any] = dict(
                    max_new_tokens=4, do_sample=False, use_cache=use_cache, output_logits=True,
                    return_dict_in_generate=True,
                )  # fmt: skip
                expected, have = reference.generate(**inputs, **options), patched.generate(**inputs, **options)
                assert torch.equal(expected.sequences, have.sequences), (use_cache, list(inputs))
                for w, g in zip(expected.logits, have.logits):
                    assert_logits_close(w, g)


# ----------------------------------------------------------------------------- rope_config on each legacy form

BASE = {"hidden_size": 64, "num_attention_heads": 4, "max_position_embeddings": 256}
# name -> (config.json dict, the transformers config class that reads it)
LEGACY = {
    "type for rope_type": ({**BASE, "rope_scaling": {"type": "linear", "factor": 2.0}}, transformers.LlamaConfig),
    "rope_scaling, top-level theta": (
        {**BASE, "rope_theta": 5e5, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
        transformers.LlamaConfig,
    ),
    "yarn by type, original length": (
        {**BASE, "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}},
        transformers.LlamaConfig,
    ),
    "mrope (Qwen2-VL text)": (
        {**BASE, "rope_theta": 1e6, "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}},
        transformers.Qwen2VLTextConfig,
    ),
    "su (Phi-3)": (
        {
            **BASE, "model_type": "phi3", "original_max_position_embeddings": 64,
            "rope_scaling": {
                "type": "su", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
                "original_max_position_embeddings": 64,
            },
        },
        transformers.Phi3Config,
    ),
    "rotary_pct, rotary_emb_base (GPT-NeoX)": (
        {**BASE, "model_type": "gpt_neox", "rotary_pct": 0.5, "rotary_emb_base": 500.0},
        transformers.GPTNeoXConfig,
    ),
    "GPT-NeoX default quarter": ({**BASE, "model_type": "gpt_neox"}, transformers.GPTNeoXConfig),
    "partial at top level": ({**BASE, "partial_rotary_factor": 0.5}, transformers.PhiConfig),
}  # fmt: skip


def _peer(config: dict[str, Any], config_cls: type) -> Any:
    logging.disable(logging.WARNING)  # transformers' notes on these dicts (checked against ropelib's elsewhere)
    try:
        return config_cls(**{k: v for k, v in copy.deepcopy(config).items() if k != "model_type"})
    finally:
        logging.disable(logging.NOTSET)


@pytest.mark.parametrize("name", list(LEGACY))
def test_rope_config_reads_each_legacy_form_as_transformers(name: str) -> None:
    config, config_cls = LEGACY[name]
    peer = _peer(config, config_cls)
    params = peer.rope_parameters
    head_dim = peer.hidden_size // peer.num_attention_heads
    want_rotary = int(head_dim * params.get("partial_rotary_factor", 1.0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # LongRoPE without factor warns in both (tests/test_scaling.py)
        for source in (config, config_dict(peer)):  # the dict as released, and transformers' standardised one
            options = rope_config(source)
            assert options["theta"] == params["rope_theta"], source
            assert options["rotary_dim"] == want_rotary, source
            rope_type = "default" if options["scaling"] is None else options["scaling"]["rope_type"]
            assert rope_type == params["rope_type"], source
            for key in ("factor", "original_max_position_embeddings", "short_factor", "long_factor"):
                if options["scaling"] is not None and key in params:
                    assert options["scaling"][key] == params[key], (source, key)


def test_type_naming_another_scaling_is_read_as_rope_type_with_a_warning() -> None:
    # transformers reads rope_type and ignores a type beside it; ropelib does the same and says so.
    config = {**BASE, "rope_scaling": {"rope_type": "linear", "type": "dynamic", "factor": 2.0}}
    peer = _peer(config, transformers.LlamaConfig)
    with pytest.warns(UserWarning, match="rope_type is used"):
        options = rope_config(config)
    assert (
        options["scaling"] == {"rope_type": "linear", "factor": 2.0} and peer.rope_parameters["rope_type"] == "linear"
    )


def test_rope_scaling_beside_the_rope_parameters_written_from_it() -> None:
    # transformers' dict of an old config: rope_parameters (with rope_type, type and rope_theta) beside rope_scaling.
    legacy = {"type": "linear", "factor": 2.0}
    peer = _peer({**BASE, "rope_scaling": dict(legacy)}, transformers.LlamaConfig)
    both = {**BASE, "rope_scaling": legacy, "rope_parameters": dict(peer.rope_parameters)}
    assert rope_config(both)["scaling"] == {"rope_type": "linear", "factor": 2.0}
    with pytest.raises(ValueError, match="differ"):  # two different scalings are refused, as before
        rope_config({**both, "rope_scaling": {"type": "linear", "factor": 4.0}})


def test_hf_rotary_embedding_and_patch_read_the_config_object_attribute_map() -> None:
    # DBRX names its width d_model and its heads n_heads: transformers reads them through attribute_map.
    config = transformers.DbrxConfig(d_model=64, n_heads=4, n_layers=1, max_seq_len=64, vocab_size=100)
    rotary = HFRotaryEmbedding(config)
    assert rotary.rope.head_dim == 16 and rotary.rope.theta == config.rope_parameters["rope_theta"]


def test_ministral3_ignore_keys_of_its_config_class_are_honoured() -> None:
    # Ministral 3 keeps llama_4_scaling_beta in its rope parameters and lists it in ignore_keys_at_rope_validation.
    config = transformers.AutoConfig.for_model("ministral3").get_text_config()
    assert "llama_4_scaling_beta" in config.rope_parameters
    from transformers.models.ministral3.modeling_ministral3 import Ministral3RotaryEmbedding

    holder = torch.nn.Module()
    holder.rotary_emb = Ministral3RotaryEmbedding(config=config)
    patch_hf_rope(holder)
    assert isinstance(holder.rotary_emb, HFRotaryEmbedding)
    assert holder.rotary_emb.rope_type == config.rope_parameters["rope_type"]
