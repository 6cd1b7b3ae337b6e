"""Fast RoPE: ropelib's operators and the kernels behind them.

* :mod:`~ropelib.kernels.door`: :func:`~ropelib.rotary_qk`, the public door (checks once), and the
  unchecked entries the modules use;
* :mod:`~ropelib.kernels.aliasing`: whether an in-place rotation may overwrite q and k;
* :mod:`~ropelib.kernels.operators`: ``ropelib::rotary`` and ``ropelib::rotary_``, with their
  autograd, fake, version-counter and vmap rules;
* :mod:`~ropelib.kernels.registry`: the kernels (:data:`~ropelib.KERNELS`) and :func:`~ropelib.choose_kernel`;
* the kernels: :mod:`~ropelib.kernels.torch_kernel` (PyTorch operations),
  :mod:`~ropelib.kernels.native_kernel` (a C loop on the CPU, built by
  :mod:`~ropelib.kernels.native_build`) and :mod:`~ropelib.kernels.triton_kernel`.
"""

from .door import rotary_qk
from .native_kernel import build as build_native_kernel
from .registry import KERNEL_CHOICES, KERNELS, choose_kernel

__all__ = ["KERNELS", "KERNEL_CHOICES", "build_native_kernel", "choose_kernel", "rotary_qk"]
