"""Fast RoPE: a fused Triton kernel for q and k, a memory-frugal PyTorch path, and the operator over both.

:func:`rotary_qk` is the entry point; :class:`ropelib.RotaryEmbedding` calls it for its
``backend`` (``"auto"``, ``"torch"`` or ``"triton"``). The Triton module is imported only when
the Triton kernel is used, so the PyTorch path works without Triton installed.
"""

from .ops import KERNELS, choose_kernel, rotary_qk

__all__ = ["KERNELS", "choose_kernel", "rotary_qk"]
