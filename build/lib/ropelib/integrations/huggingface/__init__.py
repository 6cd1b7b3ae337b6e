"""Hugging Face ``transformers`` models with ropelib's RoPE.

* :mod:`~ropelib.integrations.huggingface.module`: :class:`HFRotaryEmbedding`, the drop-in rotary module;
* :mod:`~ropelib.integrations.huggingface.apply`: the stand-in for the modeling module's apply function,
  with an adapter per signature;
* :mod:`~ropelib.integrations.huggingface.families`: one row per model family (:data:`FAMILIES`): the Llama
  template, GLM, Cohere, GPT-J, Llama 4, Gemma 3, Qwen2-VL / Qwen2.5-VL and Qwen3-VL (M-RoPE);
* :mod:`~ropelib.integrations.huggingface.probes`: the patch-time checks;
* :mod:`~ropelib.integrations.huggingface.patch`: :func:`patch_hf_rope`, :func:`unpatch_hf_rope`,
  :func:`use_ropelib_rope`.
"""

from .families import FAMILIES, Family
from .module import HFRotaryEmbedding
from .patch import patch_hf_rope, unpatch_hf_rope, use_ropelib_rope

__all__ = ["FAMILIES", "Family", "HFRotaryEmbedding", "patch_hf_rope", "unpatch_hf_rope", "use_ropelib_rope"]
