"""The model families the Hugging Face patch knows: one row each, so adding a family is one row.

A row says how to find the family's rotary module in a model, which function of its modeling
module its attention layers call to rotate, with which signature
(:data:`~ropelib.integrations.huggingface.apply.SIGNATURES`) and in which layout, what form of
tables the rotary module returns (:data:`~ropelib.integrations.huggingface.module.OUTPUTS`), and
how its config reads into :class:`ropelib.RotaryEmbedding` arguments. The patch-time probes
(:mod:`~ropelib.integrations.huggingface.probes`) then check that ropelib reproduces the row's
module and function on the model at hand, and refuse it otherwise.

Rows are tried in order for each module of a model; the Llama template, last, takes any
``*RotaryEmbedding`` module with a ``config`` and an ``inv_freq`` buffer that no row before it took.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from torch import nn

from ...config import rope_config
from ...layouts import LAYOUTS
from .apply import SIGNATURES
from .module import OUTPUTS

Options = dict[str | None, dict[str, Any]]


def has_rotary_buffers(module: nn.Module) -> bool:
    """A ``transformers`` rotary module: a ``config`` attribute and an ``inv_freq`` buffer of its own."""
    return hasattr(module, "config") and "inv_freq" in dict(module.named_buffers(recurse=False))


def _modeling(module: nn.Module) -> str:
    """The modeling module's short name: ``"modeling_llama"`` for ``transformers.models.llama.modeling_llama``."""
    return type(module).__module__.rpartition(".")[2]


def text_rotary_in(*modeling: str) -> Callable[[nn.Module], bool]:
    """A predicate: a text rotary module (``*RotaryEmbedding``, not ``*Vision*``, with rotary buffers) of these modeling modules."""

    def test(module: nn.Module) -> bool:
        name = type(module).__name__
        return (
            _modeling(module) in modeling
            and name.endswith("RotaryEmbedding")
            and "Vision" not in name
            and has_rotary_buffers(module)
        )

    return test


def single_options(config: dict[str, Any], ignore_keys: Iterable[str] = ()) -> Options:
    """One RoPE setting for all layers: :func:`ropelib.rope_config` of the config.

    ``ignore_keys``: the config class's ``ignore_keys_at_rope_validation`` (model-specific keys of its rope parameters)."""
    return {None: rope_config(config, ignore_keys=ignore_keys)}


def _layer_overrides(config: dict[str, Any], layer_type: str) -> dict[str, Any]:
    """The ``per_layer_config`` entry (keyed by layer index: ``5``, ``"5"`` or ``"05"``) of the first layer of
    ``layer_type`` (Gemma 4's ``head_dim`` of its global layers), or ``{}``."""
    per_layer = config.get("per_layer_config")
    index = list(config.get("layer_types") or ()).index(layer_type)
    if not isinstance(per_layer, dict):
        return {}
    for key, overrides in per_layer.items():
        if str(key).isdigit() and int(key) == index and isinstance(overrides, dict):
            return dict(overrides)
    return {}


def per_layer_type_options(config: dict[str, Any], ignore_keys: Iterable[str] = ()) -> Options:
    """One setting per layer type (Gemma 3, Gemma 4): ``rope_config`` of the config with each layer type's
    ``rope_parameters`` (and the ``per_layer_config`` overrides of a layer of that type)."""
    params = config.get("rope_parameters") or {}
    # layer types with rope_parameters None have no RoPE (convolution or MLP-only layers, as transformers skips them)
    types = sorted({t for t in config.get("layer_types") or () if params.get(t) is not None})
    if not types or not all(isinstance(params.get(t), dict) for t in types):
        raise ValueError(f"config needs a rope_parameters dict for each of its layer_types {types}")
    return {
        t: rope_config({**config, **_layer_overrides(config, t), "rope_parameters": params[t]}, ignore_keys=ignore_keys)
        for t in types
    }


def mrope_options(config: dict[str, Any], ignore_keys: Iterable[str] = ()) -> Options:
    """Qwen2-VL's text config: ``rope_config`` without the ``mrope_section`` (read from the rotary module)."""
    return {None: rope_config(config, ignore_keys={"mrope_section", "mrope_interleaved", *ignore_keys})}


def gptj_options(config: dict[str, Any], ignore_keys: Iterable[str] = ()) -> Options:
    """GPT-J: ``n_embd / n_head`` features per head, the first ``rotary_dim`` rotated, base 10 000, no scaling."""
    heads = config.get("n_head", config.get("num_attention_heads"))
    hidden = config.get("n_embd", config.get("hidden_size"))
    options = rope_config(
        {"hidden_size": hidden, "num_attention_heads": heads, "max_position_embeddings": config.get("n_positions")}
    )
    if config.get("rotary_dim") is not None:
        options["rotary_dim"] = config["rotary_dim"]  # checked by RotaryEmbedding (even, <= head_dim)
    return {None: options}


def rope_interleave_in_config(module: nn.Module) -> bool:
    """A text rotary module of a modeling module with ``apply_rotary_pos_emb_interleave`` (DeepSeek V3's MLA and the
    models generated from it), in a model whose ``config.rope_interleave`` is set or a module with no other rotation."""
    py_module = sys.modules.get(type(module).__module__)
    return (
        text_rotary_in(_modeling(module))(module)
        and callable(getattr(py_module, "apply_rotary_pos_emb_interleave", None))
        and (
            bool(getattr(module.config, "rope_interleave", False))
            or not callable(getattr(py_module, "apply_rotary_pos_emb", None))  # the only rotation there is
        )
    )


def _is_per_layer_type(module: nn.Module) -> bool:
    buffers = [name for name, _ in module.named_buffers(recurse=False)]
    return (
        type(module).__name__.endswith("RotaryEmbedding")
        and hasattr(module, "config")
        and isinstance(getattr(module, "layer_types", None), (list, tuple))
        and any(name.endswith("_inv_freq") for name in buffers)
    )


@dataclass(frozen=True)
class Family:
    """One family of ``transformers`` models whose RoPE the patch can take over.

    Attributes:
        name: what the family is called in messages.
        is_rotary_module: true for the family's ``*RotaryEmbedding`` modules.
        apply_name: the function of the modeling module that the attention layers call.
        layout: the pairs that function rotates (:data:`ropelib.layouts.LAYOUTS`).
        signature: how that function is called (:data:`~ropelib.integrations.huggingface.apply.SIGNATURES`).
        output: the form of tables the rotary module returns (:data:`~ropelib.integrations.huggingface.module.OUTPUTS`).
        options: ``(config dict, ignore_keys)`` -> :class:`ropelib.RotaryEmbedding` arguments by layer type
            (``None``: one setting); ``ignore_keys`` is the config's ``ignore_keys_at_rope_validation``.
        mrope: None, or ``"sections"`` (Qwen2-VL) / ``"interleaved"`` (Qwen3-VL) M-RoPE, with the
            module's ``mrope_section``.
    """

    name: str
    is_rotary_module: Callable[[nn.Module], bool]
    apply_name: str
    layout: str
    signature: str = "qk_cos_sin"
    output: str = "cat"
    options: Callable[[dict[str, Any], Iterable[str]], Options] = single_options
    mrope: str | None = None

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {list(LAYOUTS)}, got {self.layout!r}")
        if self.signature not in SIGNATURES:
            raise ValueError(f"signature must be one of {list(SIGNATURES)}, got {self.signature!r}")
        if self.output not in OUTPUTS:
            raise ValueError(f"output must be one of {list(OUTPUTS)}, got {self.output!r}")
        if self.mrope not in (None, "sections", "interleaved"):
            raise ValueError(f"mrope must be None, 'sections' or 'interleaved', got {self.mrope!r}")


#: Gemma 3n, Gemma 4: Gemma 3's module (its global layers' ``head_dim`` from ``per_layer_config``), q and k rotated one at a time.
GEMMA4 = Family(
    "per layer type, one tensor a call (Gemma 4)",
    lambda m: (
        _modeling(m) in ("modeling_gemma3n", "modeling_gemma4", "modeling_gemma4_unified") and _is_per_layer_type(m)
    ),
    "apply_rotary_pos_emb",
    "half",
    signature="x_cos_sin",
    options=per_layer_type_options,
)
#: Gemma 3: one rotary module with an ``inv_freq`` per layer type, called as ``rotary_emb(x, positions, layer_type)``.
GEMMA3 = Family(
    "per layer type (Gemma 3)", _is_per_layer_type, "apply_rotary_pos_emb", "half", options=per_layer_type_options
)
#: GLM / GLM-4, Helium: Llama's tables, rotated in the interleaved layout (first half of the table, each angle repeated).
GLM = Family(
    "GLM", text_rotary_in("modeling_glm", "modeling_glm4", "modeling_helium"), "apply_rotary_pos_emb", "interleaved"
)
#: Cohere, Cohere 2: tables with each angle repeated side by side, rotated in the interleaved layout.
COHERE = Family(
    "Cohere",
    text_rotary_in("modeling_cohere", "modeling_cohere2", "modeling_cohere2_moe"),
    "apply_rotary_pos_emb",
    "interleaved",
    output="repeat",
)
#: Ernie 4.5: GLM's rotation over the whole head, with Llama's tables kept in float32.
ERNIE = Family(
    "Ernie 4.5",
    text_rotary_in("modeling_ernie4_5", "modeling_ernie4_5_moe"),
    "apply_rotary_pos_emb",
    "interleaved",
    output="cat_float32",
)
#: GPT-OSS: tables of one angle per pair (``[batch, seq, d_rot/2]``), rotated in halves.
GPT_OSS = Family("GPT-OSS", text_rotary_in("modeling_gpt_oss"), "apply_rotary_pos_emb", "half", output="half")
#: DeepSeek V2: MLA's decoupled RoPE key in Meta's complex form, heads first.
DEEPSEEK_V2 = Family(
    "DeepSeek V2 (MLA, complex)",
    text_rotary_in("modeling_deepseek_v2"),
    "apply_rotary_emb",
    "interleaved",
    signature="qk_freqs_heads_first",
    output="complex",
)
#: DeepSeek V3 with ``rope_interleave``: interleaved pairs in, halves out; without it the Llama template.
DEEPSEEK_V3_INTERLEAVED = Family(
    "DeepSeek V3 interleaved (MLA)",
    rope_interleave_in_config,
    "apply_rotary_pos_emb_interleave",
    "interleaved",
    signature="qk_cos_sin_to_halves",
)
#: GPT-J, CodeGen: a table of ``(sin, cos)`` halves, one tensor rotated at a time, interleaved, ``rotary_dim`` of the head.
GPTJ = Family(
    "GPT-J",
    lambda m: (
        type(m).__name__ in ("GPTJRotaryEmbedding", "CodeGenRotaryEmbedding")
        and _modeling(m) in ("modeling_gptj", "modeling_codegen")
    ),
    "apply_rotary_pos_emb",
    "interleaved",
    signature="tensor_sin_cos",
    output="sin_cos",
    options=gptj_options,
)
#: Llama 4: complex ``freqs_cis`` (Meta's form), interleaved; its NoPE layers never call the function.
LLAMA4 = Family(
    "Llama 4",
    text_rotary_in("modeling_llama4"),
    "apply_rotary_emb",
    "interleaved",
    signature="qk_freqs",
    output="complex",
)
#: Qwen2-VL / Qwen2.5-VL: M-RoPE, 3-axis positions, contiguous sections (:mod:`ropelib.mrope`).
QWEN2_VL = Family(
    "Qwen2-VL (M-RoPE)",
    text_rotary_in("modeling_qwen2_vl", "modeling_qwen2_5_vl"),
    "apply_rotary_pos_emb",
    "half",
    options=mrope_options,
    mrope="sections",
)
#: Qwen3-VL: M-RoPE with the interleaved assignment of pairs to axes.
QWEN3_VL = Family(
    "Qwen3-VL (M-RoPE)",
    text_rotary_in("modeling_qwen3_vl", "modeling_qwen3_vl_moe"),
    "apply_rotary_pos_emb",
    "half",
    options=mrope_options,
    mrope="interleaved",
)
#: The Llama template: Llama, Qwen2/3, Mistral, Mixtral, Gemma/Gemma 2, OLMo 2, Granite, StableLM,
#: GPT-NeoX and Phi (partial rotary), Phi-3, DeepSeek-V3 without rope_interleave, Falcon and the others generated from it.
LLAMA_TEMPLATE = Family(
    name="Llama template (rotate_half)",
    is_rotary_module=lambda m: (
        type(m).__name__.endswith("RotaryEmbedding") and "Vision" not in type(m).__name__ and has_rotary_buffers(m)
    ),
    apply_name="apply_rotary_pos_emb",
    layout="half",
)

#: Every family, tried in order for each module (the Llama template last).
FAMILIES: tuple[Family, ...] = (
    GEMMA4,
    GEMMA3,
    GLM,
    COHERE,
    ERNIE,
    GPT_OSS,
    GPTJ,
    LLAMA4,
    DEEPSEEK_V2,
    DEEPSEEK_V3_INTERLEAVED,
    QWEN2_VL,
    QWEN3_VL,
    LLAMA_TEMPLATE,
)


#: Model types whose RoPE the patch refuses, with the reason (checked before the probes, which refuse the rest).
REFUSED: MappingProxyType[str, str] = MappingProxyType(
    {
        "nanochat": "its rotate_half flips the signs: it rotates by the negative angle, which no family applies",
        "deepseek_v4": "its RoPE settings are per compressed-attention kind (_rope_type_labels), not per layer type",
    }
)


def family_of(module: nn.Module) -> Family | None:
    """The first family whose rotary modules include ``module``, or None."""
    return next((family for family in FAMILIES if family.is_rotary_module(module)), None)
