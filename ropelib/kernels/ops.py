r"""The fused rotation as a PyTorch operator: the kernel registry, autograd, torch.compile, and the lean eager path.

:func:`~ropelib.rotary_qk` rotates ``q`` and ``k`` by the angles of their positions in one call. The
work is done by one of the kernels of :data:`KERNELS` (``name -> launcher``):

* ``"torch"``: :mod:`ropelib.kernels.torch_kernel` (a complex multiply or three ``out=`` operations
  per block of tokens; any device);
* ``"triton"``: :mod:`ropelib.kernels.triton_kernel` (one launch for q and k; imported on first use,
  so the PyTorch path works without Triton installed; on a machine without CUDA it runs in
  Triton's interpreter: correct but slow, for tests).

A backend is what a caller asks for: ``"auto"`` or one of the kernel names (:data:`BACKENDS`);
:func:`~ropelib.choose_kernel` resolves ``"auto"`` for a device.

Where the call needs them, the kernels run behind the custom operators ``ropelib::rotary_qk``
(out of place, differentiable) and ``ropelib::rotary_qk_`` (in place), registered with
:func:`torch.library.custom_op` and a fake (shape-only) function so that :func:`torch.compile`
traces through them without a graph break, and with a backward that is the same operator with the
angle negated: ``dL/dx = R(-theta) dL/dy`` because a rotation's transpose is its inverse. The in-place
operator, which autograd cannot differentiate itself (a mutating custom op takes no autograd formula),
is recorded by an :class:`torch.autograd.Function` that marks ``q`` and ``k`` dirty and has the same
backward, so ``inplace=True`` trains too (as flash-attn's does).

In eager mode with no gradient to record (inference) the operators are skipped, since their
dispatch costs more than the rotation itself at decoding shapes: a few tokens take
:func:`~ropelib.kernels.native_kernel.rotate_few` (one C call, or four list operations), everything
else the launcher directly. On the CPU the ``"torch"`` launcher runs the compiled loop of
:mod:`~ropelib.kernels.native_kernel` once it is built (one pass, in place or not, either layout),
behind the operators too, so training and compiled graphs use it as well.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any

import torch

from .._validation import (
    check_bool,
    check_choice,
    check_float_tensor,
    check_int,
    check_integer_tensor,
    check_position_range,
    check_positions,
    check_qk,
)
from ..layouts import LAYOUTS
from ..packing import check_cu_seqlens, positions_in_documents
from . import native_kernel
from .torch_kernel import few_elements, rotate_qk_torch, wide_rows

#: ``launch(q, k, q_out, k_out, cos, sin, positions, *, interleaved, conjugate)``: writes the rotation
#: of ``q``/``k`` into ``q_out``/``k_out`` (which may be ``q``/``k``). ``cos``/``sin`` are contiguous
#: ``[L, r/2]`` tables, ``positions`` int64 ``[B, S]`` rows of them; no validation inside.
Launcher = Callable[..., None]


def _complex_viewable(x: torch.Tensor) -> bool:
    """True when the pairs of ``x``'s features can be viewed as complex numbers (even strides and offset)."""
    return x.storage_offset() % 2 == 0 and all(st % 2 == 0 for sz, st in zip(x.shape[:-1], x.stride()[:-1]) if sz > 1)


def _launch_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    q_out: torch.Tensor,
    k_out: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    *,
    interleaved: bool,
    conjugate: bool,
    cu_seqlens: torch.Tensor | None = None,
) -> None:
    """The CPU's compiled loop (:mod:`~ropelib.kernels.native_kernel`) when it is built and fits, else
    :func:`~ropelib.kernels.torch_kernel.rotate_qk_torch`, with odd strides (an odd ``head_dim``) handled.

    The interleaved layout views pairs as complex numbers, which needs even strides; otherwise the
    rotated features are copied to a contiguous buffer, rotated there and copied back.
    """
    if cu_seqlens is not None:  # a packed row: the positions within its documents, found once for either path
        positions, cu_seqlens = positions_in_documents(cu_seqlens, q.shape[1])[None], None
    if q.device.type == "cpu" and native_kernel.rotate_qk(
        q, k, q_out, k_out, cos, sin, positions, interleaved=interleaved, conjugate=conjugate
    ):
        return
    if not interleaved or all(_complex_viewable(t) for t in (q, k, q_out, k_out)):
        rotate_qk_torch(
            q, k, q_out, k_out, cos, sin, positions, interleaved=interleaved, conjugate=conjugate, cu_seqlens=cu_seqlens
        )
        return
    r = 2 * cos.shape[-1]
    q_rot, k_rot = q[..., :r].contiguous(), k[..., :r].contiguous()
    rotate_qk_torch(
        q_rot, k_rot, q_rot, k_rot, cos, sin, positions, interleaved=True, conjugate=conjugate, cu_seqlens=cu_seqlens
    )
    for x, out, rot in ((q, q_out, q_rot), (k, k_out, k_rot)):
        out[..., :r].copy_(rot)
        if out.data_ptr() != x.data_ptr() and r < x.shape[-1]:
            out[..., r:].copy_(x[..., r:])


def _launch_triton(*args: Any, **kwargs: Any) -> None:
    from .triton_kernel import launch_rotary_qk

    launch_rotary_qk(*args, **kwargs)


#: The kernels, ``name -> launcher``. Adding a kernel is one entry here.
KERNELS: dict[str, Launcher] = {"torch": _launch_torch, "triton": _launch_triton}
#: The backends callers may ask for, ``"auto"`` (see :func:`~ropelib.choose_kernel`) or a kernel name.
BACKENDS = ("auto", *KERNELS)


def choose_kernel(kernel: str, device: torch.device | str) -> str:
    """The kernel ``kernel`` stands for on ``device``: ``"auto"`` is Triton on CUDA, the PyTorch path elsewhere.

    On CPU the Triton kernel only runs in the interpreter, thousands of times slower than the
    PyTorch path, so ``"auto"`` never picks it there.

    Example:
        >>> choose_kernel("auto", "cpu")
        'torch'
    """
    kernel = check_choice(kernel, "kernel", BACKENDS)
    if isinstance(device, str):
        try:
            device = torch.device(device)
        except RuntimeError as error:
            raise ValueError(f"device must name a torch device, got {device!r}") from error
    if not isinstance(device, torch.device):
        raise TypeError(f"device must be a torch.device or str, got {type(device).__name__}")
    return kernel_for(kernel, device)


def kernel_for(backend: str, device: torch.device) -> str:
    """:func:`~ropelib.choose_kernel` for a validated backend and device, unchecked (the per-call path)."""
    if backend != "auto":
        return backend
    return "triton" if device.type == "cuda" else "torch"


# ----------------------------------------------------------------------------- custom operators


@torch.library.custom_op("ropelib::rotary_qk", mutates_args=())
def _rotary_qk_op(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    interleaved: bool,
    conjugate: bool,
    kernel: str,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    KERNELS[kernel](
        q, k, q_out, k_out, cos, sin, positions, interleaved=interleaved, conjugate=conjugate, cu_seqlens=cu_seqlens
    )
    return q_out, k_out


@_rotary_qk_op.register_fake
def _(q, k, cos, sin, positions, interleaved, conjugate, kernel, cu_seqlens=None):
    return q.new_empty(q.shape), k.new_empty(k.shape)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    _, _, cos, sin, positions, interleaved, conjugate, kernel, cu_seqlens = inputs
    ctx.save_for_backward(cos, sin, positions, cu_seqlens)
    ctx.flags = (interleaved, conjugate, kernel)


def _unit_stride(g: torch.Tensor) -> torch.Tensor:
    return g if g.stride(-1) == 1 else g.contiguous()


def _backward(ctx: Any, grad_q: torch.Tensor, grad_k: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    cos, sin, positions, cu_seqlens = ctx.saved_tensors
    interleaved, conjugate, kernel = ctx.flags
    grad_q, grad_k = _unit_stride(grad_q), _unit_stride(grad_k)
    dq, dk = _rotary_qk_op(grad_q, grad_k, cos, sin, positions, interleaved, not conjugate, kernel, cu_seqlens)
    return dq, dk, None, None, None, None, None, None, None


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
    kernel: str,
    cu_seqlens: torch.Tensor | None = None,
) -> None:
    KERNELS[kernel](
        q, k, q, k, cos, sin, positions, interleaved=interleaved, conjugate=conjugate, cu_seqlens=cu_seqlens
    )


@_rotary_qk_inplace_op.register_fake
def _(q, k, cos, sin, positions, interleaved, conjugate, kernel, cu_seqlens=None):
    return None


class _RotateInPlace(torch.autograd.Function):
    """The in-place rotation as autograd sees it: ``q``, ``k`` overwritten (marked dirty), backward ``R(-theta)``.

    flash-attn's ``apply_rotary_emb(..., inplace=True)`` is differentiable the same way. The forward
    runs ``ropelib::rotary_qk_`` (opaque to :func:`torch.compile`); the backward is the out-of-place
    operator with the angle negated, itself differentiable (double backward works).
    """

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, interleaved: bool, conjugate: bool, kernel: str, cu_seqlens: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        _rotary_qk_inplace_op(q, k, cos, sin, positions, interleaved, conjugate, kernel, cu_seqlens)
        ctx.mark_dirty(q, k)
        ctx.save_for_backward(cos, sin, positions, cu_seqlens)
        ctx.flags = (interleaved, conjugate, kernel)
        return q, k

    @staticmethod
    def backward(ctx: Any, grad_q: torch.Tensor, grad_k: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return _backward(ctx, grad_q, grad_k)


# ----------------------------------------------------------------------------- the unchecked entry


def rotate_qk(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    *,
    interleaved: bool,
    conjugate: bool = False,
    kernel: str,
    inplace: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    position: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotation behind :func:`~ropelib.rotary_qk`, for callers that have validated their arguments.

    ``q``/``k`` ``[B, S, H, D]`` with unit stride on ``D``; ``cos``/``sin`` contiguous ``[L, r/2]`` in the
    compute dtype; ``positions`` int64, ``[B, S]`` (a broadcast view is fine), all in ``[0, L)``;
    ``kernel`` a key of :data:`KERNELS`; ``cu_seqlens`` (validated, a packed row of batch 1) replaces
    ``positions`` by the positions within each document. Eager calls that record no gradient go straight to the
    launcher; the others (autograd, :func:`torch.compile`) through the custom operators. In place with
    autograd, the rotation is recorded as an in-place operation (``q`` and ``k`` must not be leaves
    that require grad, which :func:`~ropelib.rotary_qk` checks). ``position``: the value of a
    one-token ``positions`` when the caller has read it on the host (it lets the few-token path
    reuse the previous call's rows).
    """
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)
    if not needs_grad and not torch.compiler.is_compiling():
        if kernel == "torch" and cu_seqlens is None and few_elements(q, k, 2 * cos.shape[1], cos.dtype, interleaved):
            rows = wide_rows(cos, sin, positions, conjugate=conjugate, position=position)
            q_out, k_out = native_kernel.rotate_few(q, k, *rows)
            if inplace:
                torch._foreach_copy_([q, k], [q_out, k_out])
                return q, k
            return q_out, k_out
        if inplace:
            q_out, k_out = q, k
        else:
            q_out, k_out = torch.empty_like(q), torch.empty_like(k)
        KERNELS[kernel](
            q, k, q_out, k_out, cos, sin, positions, interleaved=interleaved, conjugate=conjugate, cu_seqlens=cu_seqlens
        )
        return q_out, k_out
    if inplace and needs_grad:
        q, k = _RotateInPlace.apply(q, k, cos, sin, positions, interleaved, conjugate, kernel, cu_seqlens)
        return q, k
    if inplace:
        _rotary_qk_inplace_op(q, k, cos, sin, positions, interleaved, conjugate, kernel, cu_seqlens)
        return q, k
    return _rotary_qk_op(q, k, cos, sin, positions, interleaved, conjugate, kernel, cu_seqlens)


def rotate_by_token_tables(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool, backend: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q, k`` ``[batch, seq, heads, d]`` by per-token tables ``[1 or batch, seq, r/2]``, unchecked.

    The tables are flattened to one ``[rows, r/2]`` table and each token is given its own row,
    so the kernels need no positions and no range checks (no device synchronisation). Used where
    the tables are made per token (the Hugging Face patch, M-RoPE).
    """
    batch, seq = q.shape[:2]
    kernel = choose_kernel(backend, q.device)
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    if cos.shape[0] == 1:  # one row of positions shared by the whole batch
        rows = torch.arange(seq, device=q.device).expand(batch, seq)
        return rotate_qk(q, k, cos[0].contiguous(), sin[0].contiguous(), rows, interleaved=interleaved, kernel=kernel)
    rows = torch.arange(batch * seq, device=q.device).view(batch, seq)
    flat_cos, flat_sin = cos.reshape(batch * seq, -1).contiguous(), sin.reshape(batch * seq, -1).contiguous()
    return rotate_qk(q, k, flat_cos, flat_sin, rows, interleaved=interleaved, kernel=kernel)


# ----------------------------------------------------------------------------- the public door


def _check_tables(cos: object, sin: object, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cos = check_float_tensor(cos, "cos", ndim=2)
    sin = check_float_tensor(sin, "sin", ndim=2)
    if cos.shape != sin.shape:
        raise ValueError(
            f"cos and sin must have the same shape [table_len, r/2], got {tuple(cos.shape)} and {tuple(sin.shape)}"
        )
    wanted = torch.float64 if q.dtype == torch.float64 else torch.float32
    if cos.dtype != wanted or sin.dtype != wanted:
        raise TypeError(
            f"cos and sin must be {wanted} for {q.dtype} inputs (the math runs in their dtype), got {cos.dtype} and {sin.dtype}"
        )
    if cos.shape[0] == 0 or cos.shape[1] == 0:
        raise ValueError(f"cos and sin must be non-empty [table_len, r/2] tables, got {tuple(cos.shape)}")
    if 2 * cos.shape[1] > q.shape[-1]:
        raise ValueError(f"cos has {cos.shape[1]} pairs but head_dim is {q.shape[-1]}: need 2 * r/2 <= head_dim")
    if cos.device != q.device or sin.device != q.device:
        raise ValueError(f"cos and sin must be on q's device {q.device}, got {cos.device} and {sin.device}")
    if cos.requires_grad or sin.requires_grad:
        raise ValueError("cos and sin must not require grad: gradients flow to q and k only")
    if not (cos.is_contiguous() and sin.is_contiguous()):  # the kernels read rows of unit stride
        cos, sin = cos.contiguous(), sin.contiguous()
    return cos, sin


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when ``a`` and ``b`` (``[B, S, H, D]``) may share memory.

    Two views of one buffer that differ only in which heads they hold (q and k split from a fused
    projection) are told apart exactly; any other pair in one storage is compared by byte range.
    """
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr() or a.numel() == 0 or b.numel() == 0:
        return False
    if a.stride() == b.stride() and a.shape[:2] == b.shape[:2] and a.shape[3] == b.shape[3]:
        head_stride = int(a.stride(2))
        shift = int(b.storage_offset()) - int(a.storage_offset())
        if head_stride > 0 and shift % head_stride == 0 and head_stride >= a.shape[3] * int(a.stride(3)):
            first = shift // head_stride  # b's head 0 is a's head `first`
            low, high = min(0, first), max(a.shape[2], first + b.shape[2])
            outer = [int(st) for sz, st in zip(a.shape[:2], a.stride()[:2]) if sz > 1]
            within_token = all((high - low) * head_stride <= st for st in outer)
            if within_token:
                return not (first >= a.shape[2] or first + b.shape[2] <= 0)

    def span(t: torch.Tensor) -> tuple[int, int]:
        start = int(t.storage_offset()) * t.element_size()
        extent = sum(int(size - 1) * int(stride) for size, stride in zip(t.shape, t.stride()) if size > 0)
        return start, start + (extent + 1) * t.element_size()

    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def _self_overlaps(t: torch.Tensor) -> bool:
    """True when two elements of ``t`` may share memory (a stride 0, or strides that interleave).

    Dimensions sorted by stride must each step over everything the smaller ones span; this is
    sufficient for distinct addresses (conservative for exotic layouts, which are then refused).
    """
    extent = 0
    for stride, size in sorted((int(st), int(sz)) for sz, st in zip(t.shape, t.stride()) if sz > 1):
        if stride <= extent:
            return True
        extent += (size - 1) * stride
    return False


def _check_inplace(q: torch.Tensor, k: torch.Tensor) -> None:
    for name, x in (("q", q), ("k", k)):
        if torch.is_grad_enabled() and x.requires_grad:
            base = None if torch.compiler.is_compiling() else x._base
            if x.is_leaf or (base is not None and base.is_leaf):
                raise ValueError(
                    f"inplace=True does not support autograd on {name}: it is a leaf tensor that requires grad (or a "
                    "view of one), which no in-place op may overwrite; rotate a non-leaf (e.g. the output of a "
                    "projection), use inplace=False, or run under torch.no_grad()"
                )
        if x.stride(-1) != 1:
            raise ValueError(f"inplace=True needs {name} with unit stride on head_dim, got strides {x.stride()}")
        if _self_overlaps(x):
            raise ValueError(
                f"inplace=True needs {name} whose elements do not share memory (it is expanded or overlapping, "
                f"strides {x.stride()}); pass {name}.contiguous() or use inplace=False"
            )
    if not torch.compiler.is_compiling() and _overlap(q, k):
        raise ValueError("inplace=True needs q and k in separate memory (they overlap, so it would be rotated twice)")


def no_offsets(seqlen_offsets: object) -> bool:
    """True for the default ``seqlen_offsets=0`` (an integer 0, or None)."""
    if seqlen_offsets is None:
        return True
    return isinstance(seqlen_offsets, numbers.Integral) and not isinstance(seqlen_offsets, bool) and seqlen_offsets == 0


def offset_positions(seqlen_offsets: object, batch: int, seq: int, device: torch.device) -> torch.Tensor | None:
    """flash-attn's ``seqlen_offsets``, checked, as positions ``offsets[b] + s`` on ``device``.

    Args:
        seqlen_offsets: an int >= 0 or an integer tensor ``[batch]`` of values >= 0 (checked as
            :mod:`ropelib._validation` says: read on the CPU, a queued device assertion elsewhere).
        batch, seq: the batch size and sequence length of ``q``.
        device: where to build the positions (no value is read on the host).

    Returns:
        int64 ``[seq]`` (an int offset) or ``[batch, seq]`` (a tensor), or None for the offset 0.

    Example:
        >>> cpu = torch.device("cpu")
        >>> offset_positions(torch.tensor([0, 5]), 2, 3, cpu).tolist()
        [[0, 1, 2], [5, 6, 7]]
    """
    if seqlen_offsets is None:
        return None
    if isinstance(seqlen_offsets, torch.Tensor):
        offsets = check_integer_tensor(seqlen_offsets, "seqlen_offsets")
        if tuple(offsets.shape) != (batch,):
            raise ValueError(
                f"seqlen_offsets must be an int or an integer tensor of shape [batch] = [{batch}], "
                f"got shape {list(offsets.shape)}"
            )
        offsets = offsets.to(device).long()
        check_position_range(offsets, "seqlen_offsets", minimum=0)
        return offsets[:, None] + torch.arange(seq, device=device)
    if isinstance(seqlen_offsets, bool) or not isinstance(seqlen_offsets, numbers.Integral):
        raise TypeError(
            f"seqlen_offsets must be an int or an integer tensor [batch], got {type(seqlen_offsets).__name__}"
        )
    offset = check_int(seqlen_offsets, "seqlen_offsets", minimum=0)
    return None if offset == 0 else torch.arange(offset, offset + seq, device=device)


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
    cu_seqlens: torch.Tensor | None = None,
    seqlen_offsets: int | torch.Tensor = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Rotate ``q`` and ``k`` by RoPE (Su et al., 2021) in one fused call, gathering cos/sin by position.

    For pair ``i`` of a head at position ``m``, ``(x_a, x_b) -> (x_a c - x_b s, x_b c + x_a s)``
    with ``c = cos[m, i]``, ``s = sin[m, i]`` (``-sin`` when ``conjugate``: the inverse rotation).
    Only the first ``r = 2 * cos.shape[1]`` features of each head are rotated; the rest are kept.

    Args:
        q: ``[batch, seq, q_heads, head_dim]``, float16, bfloat16, float32 or float64.
        k: ``[batch, seq, kv_heads, head_dim]`` (``kv_heads`` may differ from ``q_heads``: GQA/MQA).
        cos, sin: the ``[table_len, r/2]`` tables of :meth:`ropelib.RotaryEmbedding.cos_sin_cache`
            (float32; float64 for float64 inputs). The math runs in this dtype. Tables that are not
            contiguous are copied first.
        positions: integers in ``[0, table_len)``, shape ``[seq]``, ``[1, seq]`` or ``[batch, seq]``
            (default ``0 .. seq-1``). Out-of-range values raise (see :mod:`ropelib._validation`:
            a :class:`ValueError` on the CPU, a device-side assertion on a GPU or under compile).
        layout: ``"half"`` (pairs ``(i, i + r/2)``) or ``"interleaved"`` (pairs ``(2i, 2i + 1)``).
        inplace: overwrite ``q`` and ``k`` and return them. They must not overlap.
        conjugate: rotate by ``-theta`` instead (what the backward pass does).
        kernel: ``"auto"`` (see :func:`~ropelib.choose_kernel`), ``"torch"`` or ``"triton"``.
        cu_seqlens: for a packed row of several documents (flash-attn's varlen format): the
            ``[num_docs + 1]`` cumulative lengths (int32/int64, from 0 to the number of tokens);
            positions then restart at 0 in every document (:func:`~ropelib.packed_positions`) and
            ``positions`` must be None. ``q``/``k`` are ``[1, tokens, heads, head_dim]`` or
            ``[tokens, heads, head_dim]``. The Triton kernel finds each token's document itself.
        seqlen_offsets: flash-attn's ``seqlen_offsets`` (decoding with a KV cache): an int or an
            integer tensor ``[batch]``, >= 0, added to the default positions, so token ``s`` of row
            ``b`` is at ``offsets[b] + s`` (must be ``< table_len``). The positions are built on
            ``q``'s device (no host read); not with ``positions`` or ``cu_seqlens``.

    Returns:
        ``(q_rotated, k_rotated)`` in the input dtypes, differentiable with respect to ``q`` and
        ``k``. With ``inplace`` too (as flash-attn's ``inplace=True``): autograd records an in-place
        operation whose backward is the inverse rotation, so ``q``/``k`` must not be leaf tensors
        that require grad (a :class:`ValueError`, as PyTorch refuses in-place ops on leaves).

    Example:
        >>> from ropelib import RotaryEmbedding
        >>> rope = RotaryEmbedding(head_dim=8)
        >>> cos, sin = rope.cos_sin_cache(4)
        >>> q, k = torch.randn(1, 4, 2, 8), torch.randn(1, 4, 1, 8)
        >>> q2, k2 = rotary_qk(q, k, cos, sin)
        >>> torch.allclose(q2, rope(q, q)[0], atol=1e-6), k2.shape
        (True, torch.Size([1, 4, 1, 8]))
    """
    if cu_seqlens is not None:
        if not no_offsets(seqlen_offsets):
            raise ValueError("give seqlen_offsets or cu_seqlens, not both: cu_seqlens defines the positions")
        return _rotary_qk_packed(q, k, cos, sin, positions, layout, inplace, conjugate, kernel, cu_seqlens)
    check_qk(q, k)
    cos, sin = _check_tables(cos, sin, q)
    interleaved = check_choice(layout, "layout", LAYOUTS) == "interleaved"
    kernel = choose_kernel(kernel, q.device)
    check_bool(inplace, "inplace")
    check_bool(conjugate, "conjugate")
    batch, seq = q.shape[:2]
    bounds = None
    if positions is None:
        if seq > cos.shape[0]:
            raise ValueError(f"the table has {cos.shape[0]} rows but seq_len is {seq}; pass a longer cos/sin table")
        offset_rows = offset_positions(seqlen_offsets, batch, seq, q.device)
        if offset_rows is None:
            positions = torch.arange(seq, device=q.device)
        else:
            if isinstance(seqlen_offsets, torch.Tensor):
                check_position_range(offset_rows, "seqlen_offsets[b] + seq_len - 1", limit=cos.shape[0])
            elif int(seqlen_offsets) + seq > cos.shape[0]:  # an int: no tensor value is read
                raise ValueError(
                    f"seqlen_offsets + seq_len = {int(seqlen_offsets) + seq} exceeds the table's {cos.shape[0]} rows"
                )
            positions = offset_rows
    elif not no_offsets(seqlen_offsets):
        raise ValueError("give positions or seqlen_offsets, not both: the offsets shift the default positions")
    else:
        positions = check_positions(positions, "positions", batch=batch, seq_len=seq, minimum=None)
        bounds = check_position_range(positions, "positions", limit=cos.shape[0])
        if positions.device != q.device:
            positions = positions.to(q.device)
    if inplace:
        _check_inplace(q, k)
    else:
        q = q if q.stride(-1) == 1 else q.contiguous()
        k = k if k.stride(-1) == 1 else k.contiguous()
    position = bounds[0] if bounds is not None and bounds[0] == bounds[1] and positions.numel() == 1 else None
    return rotate_qk(
        q,
        k,
        cos,
        sin,
        positions.expand(batch, seq),
        interleaved=interleaved,
        conjugate=conjugate,
        kernel=kernel,
        inplace=inplace,
        position=position,
    )


def _rotary_qk_packed(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor | None,
    layout: str,
    inplace: bool,
    conjugate: bool,
    kernel: str,
    cu_seqlens: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rotary_qk` for a packed row described by ``cu_seqlens``."""
    if positions is not None:
        raise ValueError("give positions or cu_seqlens, not both: cu_seqlens defines the positions")
    flat = isinstance(q, torch.Tensor) and q.ndim == 3
    if flat and isinstance(k, torch.Tensor):
        q, k = q.unsqueeze(0), k.unsqueeze(0)
    check_qk(q, k)
    if q.shape[0] != 1:
        raise ValueError(f"with cu_seqlens, q and k must be one packed row [1, tokens, heads, d], got {tuple(q.shape)}")
    cos, sin = _check_tables(cos, sin, q)
    interleaved = check_choice(layout, "layout", LAYOUTS) == "interleaved"
    kernel = choose_kernel(kernel, q.device)
    check_bool(inplace, "inplace")
    check_bool(conjugate, "conjugate")
    tokens = q.shape[1]
    cu_seqlens = check_cu_seqlens(cu_seqlens, tokens)
    if cu_seqlens.device != q.device:
        raise ValueError(f"cu_seqlens must be on q's device {q.device}, got {cu_seqlens.device}")
    if cos.shape[0] < tokens:  # a document longer than the table would read past it
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]
        check_position_range(lengths, "cu_seqlens' document lengths", minimum=None, limit=cos.shape[0] + 1)
    if inplace:
        _check_inplace(q, k)
    else:
        q = q if q.stride(-1) == 1 else q.contiguous()
        k = k if k.stride(-1) == 1 else k.contiguous()
    unused = torch.zeros(1, tokens, dtype=torch.long, device=q.device)  # positions come from cu_seqlens
    q, k = rotate_qk(
        q,
        k,
        cos,
        sin,
        unused,
        interleaved=interleaved,
        conjugate=conjugate,
        kernel=kernel,
        inplace=inplace,
        cu_seqlens=cu_seqlens,
    )
    return (q[0], k[0]) if flat else (q, k)
