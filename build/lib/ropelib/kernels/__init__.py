"""Fast RoPE: the kernels (a fused Triton kernel for q and k; on the CPU a compiled C loop, and a memory-frugal PyTorch path) and the operator over them.

:func:`rotary_qk` is the public entry point; :func:`~ropelib.kernels.ops.rotate_qk` is the same
rotation without argument checks, for modules that validated their input already (as
:class:`ropelib.RotaryEmbedding` does). :data:`KERNELS` maps each kernel's name to its launcher.
"""

from .ops import BACKENDS, KERNELS, choose_kernel, rotary_qk, rotate_qk

__all__ = ["BACKENDS", "KERNELS", "choose_kernel", "rotary_qk", "rotate_qk"]
