r"""The fused rotation as a PyTorch operator: validation, backend choice, autograd, torch.compile.

:func:`rotary_qk` rotates ``q`` and ``k`` by the angles of their positions in one call. The
work is done by one of two kernels behind the custom operators ``ropelib::rotary_qk`` (out of
place, differentiable) and ``ropelib::rotary_qk_`` (in place):

* ``"triton"``: :mod:`ropelib.kernels.triton_rope` (one launch for q and k; on a machine without
  CUDA it runs in Triton's interpreter: correct but slow, for tests);
* ``"torch"``: :mod:`ropelib.kernels.cpu_rope` (a complex multiply or three ``out=`` operations
  per block of tokens; any device).

Both are registered with :func:`torch.library.custom_op`, with a fake (shape-only) function so
that :func:`torch.compile` traces through them without a graph break, and with a backward
that is the same operator with the angle negated: ``dL/dx = R(-theta) dL/dy`` because a rotation's
transpose is its inverse.
"""

from __future__ import annotations

from typing import Any

import torch

from .._validation import check_choice, check_float_tensor, check_positions
from .cpu_rope import rotate_qk_torch

KERNELS = ("auto", "torch", "triton")
LAYOUTS = ("half", "interleaved")


def choose_kernel(kernel: str, device: torch.device) -> str:
    """The kernel ``"auto"`` stands for on ``device``: Triton on CUDA, the PyTorch path elsewhere.

    On CPU the Triton kernel only runs in the interpreter, thousands of times slower than the
    PyTorch path, so ``"auto"`` never picks it there.

    Example:
        >>> choose_kernel("auto", torch.device("cpu"))
        'torch'
    """
    kernel = check_choice(kernel, "kernel", KERNELS)
    if kernel != "auto":
        return kernel
    return "triton" if device.type == "cuda" else "torch"


def _launch(
    q: torch.Tensor,
    k: torch.Tensor,
    q_out: torch.Tensor,
    k_out: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    interleaved: bool,
    conjugate: bool,
    use_triton: bool,
) -> None:
    if use_triton:
        from .triton_rope import launch_rotary_qk

        launch_rotary_qk(q, k, q_out, k_out, cos, sin, positions, interleaved=interleaved, conjugate=conjugate)
    else:
        rotate_qk_torch(q, k, q_out, k_out, cos, sin, positions, interleaved=interleaved, conjugate=conjugate)


@torch.library.custom_op("ropelib::rotary_qk", mutates_args=())
def _rotary_qk_op(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    interleaved: bool,
    conjugate: bool,
    use_triton: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    _launch(q, k, q_out, k_out, cos, sin, positions, interleaved, conjugate, use_triton)
    return q_out, k_out


@_rotary_qk_op.register_fake
def _(q, k, cos, sin, positions, interleaved, conjugate, use_triton):
    return q.new_empty(q.shape), k.new_empty(k.shape)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    _, _, cos, sin, positions, interleaved, conjugate, use_triton = inputs
    ctx.save_for_backward(cos, sin, positions)
    ctx.flags = (interleaved, conjugate, use_triton)


def _unit_stride(g: torch.Tensor) -> torch.Tensor:
    return g if g.stride(-1) == 1 else g.contiguous()


def _backward(ctx: Any, grad_q: torch.Tensor, grad_k: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    cos, sin, positions = ctx.saved_tensors
    interleaved, conjugate, use_triton = ctx.flags
    grad_q, grad_k = _unit_stride(grad_q), _unit_stride(grad_k)
    dq, dk = _rotary_qk_op(grad_q, grad_k, cos, sin, positions, interleaved, not conjugate, use_triton)
    return dq, dk, None, None, None, None, None, None


_rotary_qk_op.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("ropelib::rotary_qk_", mutates_args=("q", "k"))
def _rotary_qk_inplace_op(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    interleaved: bool,
    conjugate: bool,
    use_triton: bool,
) -> None:
    _launch(q, k, q, k, cos, sin, positions, interleaved, conjugate, use_triton)


@_rotary_qk_inplace_op.register_fake
def _(q, k, cos, sin, positions, interleaved, conjugate, use_triton):
    return None


def _check_tables(cos: torch.Tensor, sin: torch.Tensor, q: torch.Tensor) -> None:
    check_float_tensor(cos, "cos", ndim=2)
    check_float_tensor(sin, "sin", ndim=2)
    if cos.shape != sin.shape:
        raise ValueError(
            f"cos and sin must have the same shape [table_len, r/2], got {tuple(cos.shape)} and {tuple(sin.shape)}"
        )
    wanted = torch.float64 if q.dtype == torch.float64 else torch.float32
    if cos.dtype != wanted or sin.dtype != wanted:
        raise TypeError(
            f"cos and sin must be {wanted} for {q.dtype} inputs (the math runs in their dtype), got {cos.dtype}"
        )
    if cos.shape[0] == 0 or cos.shape[1] == 0:
        raise ValueError(f"cos and sin must be non-empty [table_len, r/2] tables, got {tuple(cos.shape)}")
    if 2 * cos.shape[1] > q.shape[-1]:
        raise ValueError(f"cos has {cos.shape[1]} pairs but head_dim is {q.shape[-1]}: need 2 * r/2 <= head_dim")
    if cos.device != q.device or sin.device != q.device:
        raise ValueError(f"cos and sin must be on q's device {q.device}, got {cos.device} and {sin.device}")
    if cos.requires_grad or sin.requires_grad:
        raise ValueError("cos and sin must not require grad: gradients flow to q and k only")


def _check_qk(q: torch.Tensor, k: torch.Tensor) -> None:
    check_float_tensor(q, "q", ndim=4)
    check_float_tensor(k, "k", ndim=4)
    if q.shape[:2] != k.shape[:2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must share batch, seq and head_dim, got {tuple(q.shape)} and {tuple(k.shape)}")
    if q.dtype != k.dtype or q.device != k.device:
        raise ValueError(f"q and k must share dtype and device, got {q.dtype}/{q.device} and {k.dtype}/{k.device}")


def _check_position_arg(positions: torch.Tensor | None, q: torch.Tensor, table_len: int) -> torch.Tensor:
    """int64 ``[batch, seq]`` positions (a broadcast view when given as ``[seq]`` or left out)."""
    batch, seq = q.shape[:2]
    if positions is None:
        if seq > table_len:
            raise ValueError(f"the table has {table_len} rows but seq_len is {seq}; pass a longer cos/sin table")
        positions = torch.arange(seq, device=q.device)
    elif torch.compiler.is_compiling():  # data-dependent range checks would break the graph; the kernels clamp
        if positions.dtype.is_floating_point or positions.dtype == torch.bool or positions.ndim not in (1, 2):
            raise TypeError(
                f"positions must be an integer tensor [seq] or [batch, seq], got {positions.dtype} {tuple(positions.shape)}"
            )
        positions = positions.long().to(q.device)
    else:
        positions = check_positions(positions, "positions", batch=batch, seq_len=seq, limit=table_len).to(q.device)
    return positions.expand(batch, seq)


def rotary_qk(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor | None = None,
    *,
    layout: str = "half",
    inplace: bool = False,
    conjugate: bool = False,
    kernel: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Rotate ``q`` and ``k`` by RoPE (Su et al., 2021) in one fused call, gathering cos/sin by position.

    For pair ``i`` of a head at position ``m``, ``(x_a, x_b) -> (x_a c - x_b s, x_b c + x_a s)``
    with ``c = cos[m, i]``, ``s = sin[m, i]`` (``-sin`` when ``conjugate``: the inverse rotation).
    Only the first ``r = 2 * cos.shape[1]`` features of each head are rotated; the rest are kept.

    Args:
        q: ``[batch, seq, q_heads, head_dim]``, float16, bfloat16, float32 or float64.
        k: ``[batch, seq, kv_heads, head_dim]`` (``kv_heads`` may differ from ``q_heads``: GQA/MQA).
        cos, sin: the ``[table_len, r/2]`` tables of :meth:`ropelib.RotaryEmbedding.cos_sin_cache`
            (float32; float64 for float64 inputs). The math runs in this dtype.
        positions: integers in ``[0, table_len)``, shape ``[seq]`` or ``[batch, seq]``
            (default ``0 .. seq-1``). Under :func:`torch.compile` their range is not checked (the
            kernels clamp them into the table instead of reading out of bounds).
        layout: ``"half"`` (pairs ``(i, i + r/2)``) or ``"interleaved"`` (pairs ``(2i, 2i + 1)``).
        inplace: overwrite ``q`` and ``k`` (no autograd) and return them.
        conjugate: rotate by ``-theta`` instead (what the backward pass does).
        kernel: ``"auto"`` (see :func:`choose_kernel`), ``"torch"`` or ``"triton"``.

    Returns:
        ``(q_rotated, k_rotated)`` in the input dtypes. Differentiable with respect to ``q`` and
        ``k`` unless ``inplace``.

    Example:
        >>> from ropelib import RotaryEmbedding
        >>> rope = RotaryEmbedding(head_dim=8)
        >>> cos, sin = rope.cos_sin_cache(4)
        >>> q, k = torch.randn(1, 4, 2, 8), torch.randn(1, 4, 1, 8)
        >>> q2, k2 = rotary_qk(q, k, cos, sin)
        >>> torch.allclose(q2, rope(q, q)[0], atol=1e-6), k2.shape
        (True, torch.Size([1, 4, 1, 8]))
    """
    _check_qk(q, k)
    _check_tables(cos, sin, q)
    layout = check_choice(layout, "layout", LAYOUTS)
    use_triton = choose_kernel(kernel, q.device) == "triton"
    for name, flag in (("inplace", inplace), ("conjugate", conjugate)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    positions = _check_position_arg(positions, q, cos.shape[0])
    interleaved = layout == "interleaved"
    if inplace:
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
            raise ValueError("inplace=True does not support autograd; use inplace=False for tensors that require grad")
        if q.stride(-1) != 1 or k.stride(-1) != 1:
            raise ValueError("inplace=True needs q and k with unit stride on head_dim")
        _rotary_qk_inplace_op(q, k, cos, sin, positions, interleaved, conjugate, use_triton)
        return q, k
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    return _rotary_qk_op(q, k, cos, sin, positions, interleaved, conjugate, use_triton)
