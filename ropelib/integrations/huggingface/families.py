"""The model families the Hugging Face patch knows: one row each, so adding a family is one row.

A row says how to find the family's rotary module in a model, which function of its modeling
module its attention layers call to rotate, and in which layout. The patch-time probes
(:mod:`~ropelib.integrations.huggingface.probes`) then check that ropelib reproduces the row's
module and function on the model at hand, and refuse it otherwise.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from ...layouts import LAYOUTS


def has_rotary_buffers(module: nn.Module) -> bool:
    """A ``transformers`` rotary module: a ``config`` attribute and an ``inv_freq`` buffer of its own."""
    return hasattr(module, "config") and "inv_freq" in dict(module.named_buffers(recurse=False))


@dataclass(frozen=True)
class Family:
    """One family of ``transformers`` models whose RoPE the patch can take over.

    Attributes:
        name: what the family is called in messages.
        is_rotary_module: true for the family's ``*RotaryEmbedding`` modules.
        apply_name: the function of the modeling module that the attention layers call
            (``apply_rotary_pos_emb(q, k, cos, sin)``).
        layout: the pairs that function rotates (:data:`ropelib.layouts.LAYOUTS`).
    """

    name: str
    is_rotary_module: Callable[[nn.Module], bool]
    apply_name: str
    layout: str

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {list(LAYOUTS)}, got {self.layout!r}")


#: The Llama template: Llama, Qwen2/3, Mistral, Mixtral, Gemma/Gemma 2, OLMo 2, Granite, StableLM,
#: GPT-NeoX and Phi (partial rotary), Phi-3, DeepSeek-V3, Falcon and the others generated from it.
LLAMA_TEMPLATE = Family(
    name="Llama template (rotate_half)",
    is_rotary_module=lambda m: type(m).__name__.endswith("RotaryEmbedding") and has_rotary_buffers(m),
    apply_name="apply_rotary_pos_emb",
    layout="half",
)

#: Every family, tried in order.
FAMILIES: tuple[Family, ...] = (LLAMA_TEMPLATE,)
