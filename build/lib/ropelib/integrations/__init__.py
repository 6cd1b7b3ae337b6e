"""Adapters that put ropelib's RoPE inside other libraries' models.

:mod:`ropelib.integrations.huggingface` patches Hugging Face ``transformers`` models. It does not
import ``transformers`` itself: it only reads the model's modules and config, so importing
ropelib stays cheap when the optional ``hf`` extra is not installed.
"""

from __future__ import annotations

from .huggingface import HFRotaryEmbedding, patch_hf_rope, unpatch_hf_rope, use_ropelib_rope

__all__ = ["HFRotaryEmbedding", "patch_hf_rope", "unpatch_hf_rope", "use_ropelib_rope"]
