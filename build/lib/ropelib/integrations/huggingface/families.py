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

from collections.abc import Callable
from dataclasses import dataclass
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


def single_options(config: dict[str, Any]) -> Options:
    """One RoPE setting for all layers: :func:`ropelib.rope_config` of the config."""
    return {None: rope_config(config)}


def per_layer_type_options(config: dict[str, Any]) -> Options:
    """One setting per layer type (Gemma 3): ``rope_config`` of the config with each layer type's ``rope_parameters``."""
    params = config.get("rope_parameters") or {}
    types = sorted(set(config.get("layer_types") or ()))
    if not types or not all(isinstance(params.get(t), dict) for t in types):
        raise ValueError(f"config needs a rope_parameters dict for each of its layer_types {types}")
    return {t: rope_config({**config, "rope_parameters": params[t]}) for t in types}


def mrope_options(config: dict[str, Any]) -> Options:
    """Qwen2-VL's text config: ``rope_config`` without the ``mrope_section`` (read from the rotary module)."""
    return {None: rope_config(config, ignore_keys=("mrope_section", "mrope_interleaved"))}


def gptj_options(config: dict[str, Any]) -> Options:
    """GPT-J: ``n_embd / n_head`` features per head, the first ``rotary_dim`` rotated, base 10 000, no scaling."""
    heads = config.get("n_head", config.get("num_attention_heads"))
    hidden = config.get("n_embd", config.get("hidden_size"))
    options = rope_config(
        {"hidden_size": hidden, "num_attention_heads": heads, "max_position_embeddings": config.get("n_positions")}
    )
    if config.get("rotary_dim") is not None:
        options["rotary_dim"] = config["rotary_dim"]  # checked by RotaryEmbedding (even, <= head_dim)
    return {None: options}


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
        options: the config dict -> :class:`ropelib.RotaryEmbedding` arguments by layer type (``None``: one setting).
        mrope: None, or ``"sections"`` (Qwen2-VL) / ``"interleaved"`` (Qwen3-VL) M-RoPE, with the
            module's ``mrope_section``.
    """

    name: str
    is_rotary_module: Callable[[nn.Module], bool]
    apply_name: str
    layout: str
    signature: str = "qk_cos_sin"
    output: str = "cat"
    options: Callable[[dict[str, Any]], Options] = single_options
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


#: Gemma 3: one rotary module with an ``inv_freq`` per layer type, called as ``rotary_emb(x, positions, layer_type)``.
GEMMA3 = Family(
    "per layer type (Gemma 3)", _is_per_layer_type, "apply_rotary_pos_emb", "half", options=per_layer_type_options
)
#: GLM / GLM-4: Llama's tables, rotated in the interleaved layout (first half of the table, each angle repeated).
GLM = Family("GLM", text_rotary_in("modeling_glm", "modeling_glm4"), "apply_rotary_pos_emb", "interleaved")
#: Cohere: tables with each angle repeated side by side, rotated in the interleaved layout.
COHERE = Family("Cohere", text_rotary_in("modeling_cohere"), "apply_rotary_pos_emb", "interleaved", output="repeat")
#: GPT-J: a table of ``(sin, cos)`` halves, one tensor rotated at a time, interleaved, ``rotary_dim`` of the head.
GPTJ = Family(
    "GPT-J",
    lambda m: _modeling(m) == "modeling_gptj" and type(m).__name__ == "GPTJRotaryEmbedding",
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
#: GPT-NeoX and Phi (partial rotary), Phi-3, DeepSeek-V3, Falcon and the others generated from it.
LLAMA_TEMPLATE = Family(
    name="Llama template (rotate_half)",
    is_rotary_module=lambda m: (
        type(m).__name__.endswith("RotaryEmbedding") and "Vision" not in type(m).__name__ and has_rotary_buffers(m)
    ),
    apply_name="apply_rotary_pos_emb",
    layout="half",
)

#: Every family, tried in order for each module (the Llama template last).
FAMILIES: tuple[Family, ...] = (GEMMA3, GLM, COHERE, GPTJ, LLAMA4, QWEN2_VL, QWEN3_VL, LLAMA_TEMPLATE)


def family_of(module: nn.Module) -> Family | None:
    """The first family whose rotary modules include ``module``, or None."""
    return next((family for family in FAMILIES if family.is_rotary_module(module)), None)
