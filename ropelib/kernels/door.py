r"""The public door to the rotation, :func:`~ropelib.rotary_qk`, and the unchecked entries behind it.

:func:`~ropelib.rotary_qk` checks its arguments once and calls the operators of
:mod:`~ropelib.kernels.operators`; modules that have checked their own arguments call
:func:`rotate` (tables and positions) or :func:`rotate_token_tables` (a row per token) directly.
"""

from __future__ import annotations

import numbers
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
    values_readable,
)
from ..layouts import LAYOUTS
from ..packing import check_cu_seqlens
from .aliasing import check_inplace
from .operators import rotary, rotary_
from .registry import KERNEL_CHOICES, KERNELS

#: The ``tensor_format`` of :func:`~ropelib.rotary_qk`: ``"bshd"`` (``[batch, seq, heads, head_dim]``) or
#: ``"sbhd"`` (``[seq, batch, heads, head_dim]``, Transformer Engine's sequence-first format).
TENSOR_FORMATS = ("bshd", "sbhd")


def rotate(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    *,
    interleaved: bool,
    kernel: str = "auto",
    conjugate: bool = False,
    inplace: bool = False,
    frequencies: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotation behind :func:`~ropelib.rotary_qk`, unchecked: one call of ``ropelib::rotary`` (or ``rotary_``).

    ``q``/``k`` ``[B, S, H, D]``; ``cos``/``sin`` ``[L, d_rot/2]`` in the compute dtype (float32, float64
    for float64 inputs); ``positions`` int64 ``[S]`` or ``[B, S]``, in ``[0, L)`` unless
    ``frequencies`` (float64 ``[d_rot/2 + 1]``) is given; ``cu_seqlens`` a checked packed row's lengths.
    """
    if inplace:
        rotary_(q, k, cos, sin, positions, frequencies, cu_seqlens, interleaved, conjugate, kernel)
        return q, k
    return rotary(q, k, cos, sin, positions, frequencies, cu_seqlens, interleaved, conjugate, kernel)


def rotate_token_tables(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool, kernel: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q, k`` ``[batch, seq, heads, d]`` by a row per token, ``cos``/``sin`` ``[seq, d_rot/2]`` or
    ``[1 or batch, seq, d_rot/2]``; unchecked.

    The tables are one ``[rows, d_rot/2]`` table whose row ``b * seq + s`` (or ``s``, shared by the
    batch) belongs to token ``(b, s)``: positions need no range check. Used where the rows are
    made per token (M-RoPE, axial RoPE, the Hugging Face stand-in).
    """
    batch, seq = q.shape[:2]
    if cos.ndim == 2 or cos.shape[0] == 1:  # one row of positions shared by the whole batch
        rows = torch.arange(seq, device=q.device)
    else:
        rows = torch.arange(batch * seq, device=q.device).view(batch, seq)
    flat_cos, flat_sin = cos.reshape(-1, cos.shape[-1]), sin.reshape(-1, sin.shape[-1])
    return rotate(q, k, flat_cos, flat_sin, rows, interleaved=interleaved, kernel=kernel)


def check_kernel(kernel: object, device: torch.device, dtype: torch.dtype) -> str:
    """``kernel``, one of :data:`~ropelib.kernels.registry.KERNEL_CHOICES`, usable for this device and dtype."""
    kernel = check_choice(kernel, "kernel", KERNEL_CHOICES)
    if kernel != "auto":
        why = KERNELS[kernel].why_not(device, dtype)
        if why is not None:
            raise ValueError(why)
    return kernel


def no_offsets(seqlen_offsets: object) -> bool:
    """True for the default ``seqlen_offsets=0`` (an integer 0, or None)."""
    if seqlen_offsets is None or (type(seqlen_offsets) is int and seqlen_offsets == 0):
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


def check_tables(cos: object, sin: object, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[table_len, d_rot/2]`` tables for ``q``: same shape, float32 (float64 for float64 ``q``), on ``q``'s device."""
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
    return cos, sin


def check_packed(positions: object, seqlen_offsets: object) -> None:
    """With ``cu_seqlens``, neither ``positions`` nor ``seqlen_offsets``: the documents define the positions."""
    if positions is not None:
        raise ValueError("give positions or cu_seqlens, not both: cu_seqlens defines the positions")
    if not no_offsets(seqlen_offsets):
        raise ValueError("give seqlen_offsets or cu_seqlens, not both: cu_seqlens defines the positions")


def check_packed_row(q: torch.Tensor, cu_seqlens: object) -> torch.Tensor:
    """``cu_seqlens`` checked against ``q``, one packed row ``[1, tokens, heads, d]`` on its device."""
    if q.shape[0] != 1:
        raise ValueError(f"with cu_seqlens, q and k must be one packed row [1, tokens, heads, d], got {tuple(q.shape)}")
    checked = check_cu_seqlens(cu_seqlens, q.shape[1])
    if checked.device != q.device:
        raise ValueError(f"cu_seqlens must be on q's device {q.device}, got {checked.device}")
    return checked


def _packed(q: Any, k: Any, positions: object, seqlen_offsets: object) -> tuple[Any, Any, bool]:
    """A packed row's ``q``/``k`` as ``[1, tokens, heads, d]`` (flash-attn's ``[tokens, heads, d]`` too)."""
    check_packed(positions, seqlen_offsets)
    both = isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)
    if both and q.ndim != k.ndim and 3 in (q.ndim, k.ndim):
        raise ValueError(
            "with cu_seqlens, q and k must both be [tokens, heads, head_dim] or both [1, tokens, heads, head_dim], "
            f"got q of shape {tuple(q.shape)} and k of shape {tuple(k.shape)}"
        )
    flat = both and q.ndim == 3
    if flat:
        q, k = q.unsqueeze(0), k.unsqueeze(0)
    return q, k, flat


def batch_first(q: object, k: object) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence-first ``q``/``k`` ``[seq, batch, heads, head_dim]`` as ``[batch, seq, ...]`` views (no copy).

    Checks the rank and the shared ``[seq, batch]`` and ``head_dim`` in the sbhd terms the caller used.
    """
    q = check_float_tensor(q, "q", ndim=4)
    k = check_float_tensor(k, "k", ndim=4)
    if q.shape[:2] != k.shape[:2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(
            "with tensor_format='sbhd', q and k must share [seq, batch] and head_dim, "
            f"got {tuple(q.shape)} and {tuple(k.shape)}"
        )
    return q.transpose(0, 1), k.transpose(0, 1)


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
    tensor_format: str = "bshd",
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Rotate ``q`` and ``k`` by RoPE (Su et al., 2024) in one fused call, gathering cos/sin by position.

    For pair ``i`` of a head at position ``m``, ``(x_a, x_b) -> (x_a c - x_b s, x_b c + x_a s)``
    with ``c = cos[m, i]``, ``s = sin[m, i]`` (``-sin`` when ``conjugate``: the inverse rotation).
    Only the first ``d_rot = 2 * cos.shape[1]`` features of each head are rotated; the rest are kept.
    One call of the operator ``ropelib::rotary`` (``ropelib::rotary_`` in place), which autograd,
    :func:`torch.compile`, ``make_fx``, :func:`torch.func.vmap` and dispatch modes all see.

    Args:
        q: ``[batch, seq, q_heads, head_dim]``, float16, bfloat16, float32 or float64.
        k: ``[batch, seq, kv_heads, head_dim]`` (``kv_heads`` may differ from ``q_heads``: GQA/MQA).
        cos: a ``[table_len, d_rot/2]`` table, as :meth:`ropelib.RotaryEmbedding.cos_sin_cache`
            gives (float32; float64 for float64 inputs). The math runs in this dtype.
        sin: the sine table, of ``cos``'s shape and dtype.
        positions: integers in ``[0, table_len)``, shape ``[seq]``, ``[1, seq]`` or ``[batch, seq]``
            (default ``0 .. seq-1``). Out-of-range values raise (a :class:`ValueError` on the CPU,
            a device-side assertion on a GPU or under compile: see :mod:`ropelib._validation`).
        layout: ``"half"`` (pairs ``(i, i + d_rot/2)``) or ``"interleaved"`` (pairs ``(2i, 2i + 1)``).
        inplace: overwrite ``q`` and ``k`` and return them. They must not overlap.
        conjugate: rotate by the negated angles ``-m theta_i`` instead (what the backward pass does).
        kernel: ``"auto"``, ``"torch"``, ``"native"`` or ``"triton"`` (:func:`~ropelib.choose_kernel`).
        cu_seqlens: for a packed row of documents (flash-attn's varlen format): the
            ``[num_docs + 1]`` cumulative lengths; positions restart at 0 in every document and
            ``positions`` must be None. ``q``/``k`` are ``[1, tokens, heads, head_dim]`` or
            ``[tokens, heads, head_dim]``.
        seqlen_offsets: flash-attn's ``seqlen_offsets`` (decoding with a KV cache): an int or an
            integer tensor ``[batch]``, >= 0, so token ``s`` of row ``b`` is at ``offsets[b] + s``
            (``< table_len``); not with ``positions`` or ``cu_seqlens``.
        tensor_format: ``"bshd"`` (the default) or ``"sbhd"``: ``q``/``k`` are
            ``[seq, batch, heads, head_dim]`` (Transformer Engine's sequence-first format), rotated
            through transposed views, without a copy; ``positions`` keep their shapes above and the
            outputs have the inputs' format. Not with ``cu_seqlens`` (packed rows have their own).

    Returns:
        ``(q_rotated, k_rotated)`` in the input dtypes, differentiable with respect to ``q`` and
        ``k``, in place too (as flash-attn's ``inplace=True``): then ``q``/``k`` must not be leaf
        tensors that require grad (a :class:`ValueError`, as PyTorch refuses in-place ops on leaves).

    Example:
        >>> from ropelib import RotaryEmbedding
        >>> rope = RotaryEmbedding(head_dim=8)
        >>> cos, sin = rope.cos_sin_cache(4)
        >>> q, k = torch.randn(1, 4, 2, 8), torch.randn(1, 4, 1, 8)
        >>> q2, k2 = rotary_qk(q, k, cos, sin)
        >>> torch.allclose(q2, rope(q, q)[0], atol=1e-6), k2.shape
        (True, torch.Size([1, 4, 1, 8]))
    """
    flat = False
    seq_first = check_choice(tensor_format, "tensor_format", TENSOR_FORMATS) == "sbhd"
    given = q, k  # in place, what is returned
    if seq_first:
        if cu_seqlens is not None:
            raise ValueError("cu_seqlens takes packed rows [1 or tokens, ...]: give tensor_format='bshd' with it")
        q, k = batch_first(q, k)
    if cu_seqlens is not None:
        q, k, flat = _packed(q, k, positions, seqlen_offsets)
    check_qk(q, k)
    cos, sin = check_tables(cos, sin, q)
    interleaved = check_choice(layout, "layout", LAYOUTS) == "interleaved"
    kernel = check_kernel(kernel, q.device, q.dtype)
    check_bool(inplace, "inplace")
    check_bool(conjugate, "conjugate")
    batch, seq = q.shape[:2]
    length = cos.shape[0]
    if cu_seqlens is not None:
        cu_seqlens = check_packed_row(q, cu_seqlens)
        if length < seq:  # a document longer than the table would read past it
            lengths = cu_seqlens[1:] - cu_seqlens[:-1]
            rows = f"at most the table's {length} rows"
            if values_readable(lengths) and lengths.numel():
                longest = int(lengths.max())
                if longest > length:
                    raise ValueError(
                        f"cu_seqlens' document lengths must be < {length + 1} ({rows}), got a document of "
                        f"{longest} tokens; pass a longer cos/sin table"
                    )
            else:  # queued on the device, by the rule of ropelib._validation
                name = f"cu_seqlens' document lengths ({rows})"
                check_position_range(lengths, name, minimum=None, limit=length + 1)
        positions = torch.zeros(1, dtype=torch.long, device=q.device).expand(seq)  # unused: cu_seqlens rules
    elif positions is None:
        offset_rows = None if no_offsets(seqlen_offsets) else offset_positions(seqlen_offsets, batch, seq, q.device)
        if offset_rows is None:
            if seq > length:
                raise ValueError(f"the table has {length} rows but seq_len is {seq}; pass a longer cos/sin table")
            positions = torch.arange(seq, device=q.device)
        else:
            if isinstance(seqlen_offsets, torch.Tensor):
                check_position_range(offset_rows, "seqlen_offsets[b] + seq_len - 1", limit=length)
            elif int(seqlen_offsets) + seq > length:  # an int: no tensor value is read
                raise ValueError(
                    f"seqlen_offsets + seq_len = {int(seqlen_offsets) + seq} exceeds the table's {length} rows"
                )
            positions = offset_rows
    elif not no_offsets(seqlen_offsets):
        raise ValueError("give positions or seqlen_offsets, not both: the offsets shift the default positions")
    else:
        positions = check_positions(positions, "positions", batch=batch, seq_len=seq, minimum=None, expand=False)
        check_position_range(positions, "positions", limit=length)
        if positions.device != q.device:
            positions = positions.to(q.device)
    if inplace:
        check_inplace(q, k)
    q_out, k_out = rotate(
        q,
        k,
        cos,
        sin,
        positions,
        interleaved=interleaved,
        kernel=kernel,
        conjugate=conjugate,
        inplace=inplace,
        cu_seqlens=cu_seqlens,
    )
    if seq_first:
        return given if inplace else (q_out.transpose(0, 1), k_out.transpose(0, 1))
    return (q_out[0], k_out[0]) if flat else (q_out, k_out)
