"""Hugging Face ``transformers`` models with ropelib's RoPE.

* :mod:`~ropelib.integrations.huggingface.module`: :class:`HFRotaryEmbedding`, the drop-in rotary module;
* :mod:`~ropelib.integrations.huggingface.apply`: the stand-in for the modeling module's apply function;
* :mod:`~ropelib.integrations.huggingface.families`: one row per model family;
* :mod:`~ropelib.integrations.huggingface.probes`: the patch-time checks;
* :mod:`~ropelib.integrations.huggingface.patch`: :func:`patch_hf_rope`, :func:`unpatch_hf_rope`,
  :func:`use_ropelib_rope`.
"""

from .module import HFRotaryEmbedding
from .patch import patch_hf_rope, unpatch_hf_rope, use_ropelib_rope

__all__ = ["HFRotaryEmbedding", "patch_hf_rope", "unpatch_hf_rope", "use_ropelib_rope"]
