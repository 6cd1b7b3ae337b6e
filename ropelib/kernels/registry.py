r"""The kernels behind ropelib's operators, and which one a call gets.

:data:`~ropelib.KERNELS` maps each kernel's name to a :class:`Kernel`:

* ``"torch"``: :mod:`~ropelib.kernels.torch_kernel`, PyTorch operations only, any device;
* ``"native"``: :mod:`~ropelib.kernels.native_kernel`, one compiled C loop on the CPU (float16,
  bfloat16, float32, float64), built and cached by :mod:`~ropelib.kernels.native_build`;
* ``"triton"``: :mod:`~ropelib.kernels.triton_kernel`, one fused launch for q and k (imported on
  first use; on a machine without CUDA it runs in Triton's interpreter, for tests).

``kernel="auto"`` (:func:`~ropelib.choose_kernel`) is Triton on CUDA, the native kernel on the CPU when it
builds, and the PyTorch kernel otherwise; a name forces that kernel. :func:`run` is the body of
the operators' kernel: it resolves the choice, turns packed-row lengths and positions beyond the
table into what the chosen kernel reads, and launches it.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch

from .._validation import check_choice
from ..frequencies import angle_tables
from ..packing import positions_in_documents
from . import native_kernel, torch_kernel
from .native_build import BuildFailed
from .native_kernel import BUILD

#: ``launch(q, k, q_out, k_out, cos, sin, positions, *, interleaved, conjugate)``: the rotation of
#: ``q``/``k`` written into ``q_out``/``k_out`` (which may be ``q``/``k``), ``positions`` int64
#: ``[S]``, ``[1, S]`` or ``[B, S]`` rows of the ``[L, d_rot/2]`` tables.
Launch = Callable[..., None]
#: ``write_kv(q, k, v, q_out, k_cache, v_cache, slot_mapping, cos, sin, positions, *, interleaved)``:
#: the rotation of ``q`` into ``q_out``, of ``k`` into the caches' slots with ``v`` beside it (see
#: :func:`run_kv_write`).
WriteKV = Callable[..., None]


def _launch_triton(*args: Any, **kwargs: Any) -> None:
    from .triton_kernel import launch

    launch(*args, **kwargs)


def _write_kv_triton(*args: Any, **kwargs: Any) -> None:
    from .triton_kv_write import write_kv

    write_kv(*args, **kwargs)


def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


@dataclass(frozen=True)
class Kernel:
    """One kernel: how to launch it, and where it runs.

    ``reads_rows``: the kernel itself finds packed rows' positions (``cu_seqlens``) and computes the
    rows of positions beyond the table from the frequencies (Triton); for the others :func:`run`
    prepares them. ``write_kv``: the rotation fused with the write of a key/value cache.
    """

    name: str
    launch: Launch
    reads_rows: bool
    runs_on: Callable[[torch.device, torch.dtype], bool]
    write_kv: WriteKV

    def why_not(self, device: torch.device, dtype: torch.dtype) -> str | None:
        """None when this kernel can rotate ``dtype`` tensors on ``device`` here, else the reason."""
        if not self.runs_on(device, dtype):
            return f"kernel={self.name!r} does not run {dtype} tensors on {device.type}"
        if self.name == "native":
            try:
                BUILD.library()
            except BuildFailed as error:
                return f"kernel='native' is not available here: {error}"
        if self.name == "triton" and not _triton_installed():
            return "kernel='triton' needs the triton package, which is not installed"
        return None


#: The kernels, by name.
KERNELS: MappingProxyType[str, Kernel] = MappingProxyType(
    {
        "torch": Kernel("torch", torch_kernel.launch, False, lambda device, dtype: True, torch_kernel.write_kv),
        "native": Kernel(
            "native",
            native_kernel.launch,
            False,
            lambda d, t: d.type == "cpu" and t in native_kernel.DTYPES,
            native_kernel.write_kv,
        ),
        "triton": Kernel(
            "triton", _launch_triton, True, lambda device, dtype: device.type in ("cuda", "cpu"), _write_kv_triton
        ),
    }
)
#: The names ``kernel=`` accepts, ``"auto"`` and the keys of :data:`~ropelib.KERNELS`.
KERNEL_CHOICES = ("auto", *KERNELS)


def resolve(kernel: str, device: torch.device, dtype: torch.dtype) -> str:
    """:func:`~ropelib.choose_kernel` for a validated choice, unchecked; raises :class:`RuntimeError` for an unusable forced kernel."""
    if kernel == "auto":
        if device.type == "cpu":
            return "native" if dtype in native_kernel.DTYPES and BUILD.available() else "torch"
        return "triton" if device.type == "cuda" and _triton_installed() else "torch"
    why = KERNELS[kernel].why_not(device, dtype)
    if why is not None:
        raise RuntimeError(why)
    return kernel


def choose_kernel(kernel: str, device: torch.device | str, dtype: torch.dtype = torch.float32) -> str:
    """The kernel that ``kernel`` stands for on ``device`` for ``dtype`` tensors.

    ``"auto"`` is Triton on CUDA, the native kernel on the CPU (when a C compiler builds it) and
    the PyTorch kernel elsewhere; on the CPU Triton only runs in its interpreter, written in
    Python and far slower, so ``"auto"`` never picks it there. A kernel's name stands for itself, and
    raises :class:`RuntimeError` where that kernel cannot run.

    Example:
        >>> choose_kernel("torch", "cpu")
        'torch'
        >>> choose_kernel("auto", "cpu") in ("native", "torch")
        True
    """
    kernel = check_choice(kernel, "kernel", KERNEL_CHOICES)
    if isinstance(device, str):
        try:
            device = torch.device(device)
        except RuntimeError as error:
            raise ValueError(f"device must name a torch device, got {device!r}") from error
    if not isinstance(device, torch.device):
        raise TypeError(f"device must be a torch.device or str, got {type(device).__name__}")
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__}")
    return resolve(kernel, device, dtype)


def _rows_beyond_table(
    cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, frequencies: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(cos, sin, positions)`` that cover every position: the table's when they all fall in it, else
    rows computed for the tokens (float64 angles, as the table's) and each token's own row."""
    length = cos.shape[0]
    if positions.device.type == "cpu":  # inside the kernel the values are host memory: read them
        low, high = (int(v) for v in torch.aminmax(positions)) if positions.numel() else (0, -1)
        if low >= 0 and high < length:
            return cos, sin, positions
    cos_t, sin_t = angle_tables(frequencies[:-1], positions, frequencies[-1], cos.dtype)
    rows = torch.arange(positions.numel(), device=positions.device).view(positions.shape)
    return cos_t.flatten(0, -2), sin_t.flatten(0, -2), rows


def run(
    kernel: str,
    q: torch.Tensor,
    k: torch.Tensor,
    q_out: torch.Tensor,
    k_out: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    frequencies: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    *,
    interleaved: bool,
    conjugate: bool,
) -> None:
    """Rotate ``q``/``k`` into ``q_out``/``k_out`` with the kernel ``kernel`` stands for (see the operators).

    ``positions``: int64 ``[S]`` or ``[B, S]`` rows of ``cos``/``sin`` (ignored with ``cu_seqlens``,
    whose documents' positions are used); ``frequencies``: float64 ``[d_rot/2 + 1]`` (the inverse
    frequencies, then the factor on cos and sin), or None when every position is in the table.
    """
    chosen = KERNELS[resolve(kernel, q.device, q.dtype)]
    if not chosen.reads_rows:
        if cu_seqlens is not None:
            positions, cu_seqlens = positions_in_documents(cu_seqlens, q.shape[1])[None], None
        if frequencies is not None:
            cos, sin, positions = _rows_beyond_table(cos, sin, positions, frequencies)
        chosen.launch(q, k, q_out, k_out, cos, sin, positions, interleaved=interleaved, conjugate=conjugate)
        return
    chosen.launch(
        q,
        k,
        q_out,
        k_out,
        cos,
        sin,
        positions,
        frequencies=frequencies,
        cu_seqlens=cu_seqlens,
        interleaved=interleaved,
        conjugate=conjugate,
    )


def run_kv_write(
    kernel: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_out: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    *,
    interleaved: bool,
) -> None:
    """Rotate ``q`` into ``q_out`` and ``k`` into the caches, ``v`` beside it, with the kernel ``kernel`` stands for.

    ``q`` ``[B, S, Hq, D]``, ``k`` ``[B, S, Hk, D]``, ``v`` ``[B, S, Hk, Dv]`` with unit stride on
    the features; ``k_cache`` ``[num_blocks, block_size, Hk, D]``, ``v_cache`` ``[..., Hk, Dv]`` (unit
    feature stride, any other strides); ``slot_mapping`` int64 ``[B, S]``: token ``(b, s)`` goes to
    block ``slot // block_size``, row ``slot % block_size``, and a negative slot is not written;
    ``positions`` int64 ``[S]``, ``[1, S]`` or ``[B, S]`` in ``[0, L)``. The valid slots are distinct.
    """
    chosen = KERNELS[resolve(kernel, q.device, q.dtype)]
    chosen.write_kv(q, k, v, q_out, k_cache, v_cache, slot_mapping, cos, sin, positions, interleaved=interleaved)
