r"""Positions for packed sequences (several documents in one row, no padding).

Training and serving often pack documents of different lengths end to end into one row of
``T`` tokens and describe the boundaries by the cumulative lengths ``cu_seqlens``, a 1-D
integer tensor of ``D + 1`` entries for ``D`` documents:

.. math::

    \mathrm{cu}_0 = 0, \qquad \mathrm{cu}_{j+1} = \mathrm{cu}_j + \mathrm{len}_j, \qquad \mathrm{cu}_D = T,

so document ``j`` holds the tokens ``cu[j] <= t < cu[j+1]`` (an empty document has
``cu[j] == cu[j+1]``). This is the format of flash-attn's varlen API
(``flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, ...)``
with ``q`` of shape ``[total_tokens, heads, head_dim]`` and int32 ``cu_seqlens`` of shape
``[batch + 1]``) and of TransformerEngine's ``qkv_format="thd"`` (``t`` total tokens, ``h`` heads,
``d`` head dim; its ``apply_rotary_pos_emb(..., tensor_format="thd", cu_seqlens=...)`` restarts
the rotation in each document).

RoPE must then count positions from 0 in every document, otherwise a document's rotation would
depend on what happens to be packed before it:

.. math::

    \mathrm{pos}_t = t - \mathrm{cu}_{j(t)}, \qquad j(t) = \max\{\, j : \mathrm{cu}_j \le t \,\}.

In ropelib's ``[batch, seq, heads, head_dim]`` layout a packed row is ``batch = 1`` and
``seq = T``; rotate it with ``rope(q, k, positions=packed_positions(cu_seqlens))``. The attention
that follows must also be block-diagonal (a token sees only its own document), which is what the
varlen kernels do with the same ``cu_seqlens``.
"""

from __future__ import annotations

import torch

from ._validation import check_int, values_readable

#: The largest number of tokens in a packed row. Its int64 positions, ``8 T`` bytes, must be a tensor
#: PyTorch can size (``2^63 - 1`` bytes at most), so ``T <= 2^60 - 1``.
MAX_TOKENS = (2**63 - 1) // 8


def check_cu_seqlens(cu_seqlens: object, total_tokens: object = None, name: str = "cu_seqlens") -> torch.Tensor:
    """Validate cumulative sequence lengths; return them unchanged.

    Checks that ``cu_seqlens`` is a 1-D integer tensor (not bool) with at least one entry
    (:class:`TypeError` for the wrong kind, :class:`ValueError` for the wrong shape), and that its
    values start at 0, never decrease, and end at ``total_tokens`` when that is given
    (:class:`ValueError`).

    The value checks follow the rule of :mod:`ropelib._validation`: eager on the CPU the values are
    read (they are host memory) and a bad one raises :class:`ValueError`; on a GPU or under
    :func:`torch.compile` they are queued as a device-side assertion (no synchronisation, no graph
    break). The kind and shape checks always run.

    Args:
        cu_seqlens: ``[num_docs + 1]`` integer tensor, e.g. ``[0, 3, 3, 8, 10]``.
        total_tokens: the number of tokens of the packed row (an int), or ``None``.
        name: the argument's name in error messages.

    Returns:
        ``cu_seqlens``.
    """
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"{name} must be an integer torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype.is_complex or cu_seqlens.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor (int32 or int64), got {cu_seqlens.dtype}")
    if cu_seqlens.ndim != 1:
        raise ValueError(f"{name} must be 1-D [num_docs + 1], got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.numel() == 0:
        raise ValueError(f"{name} must have at least one entry (cu_seqlens[0] = 0), got an empty tensor")
    if total_tokens is not None and not isinstance(total_tokens, torch.SymInt):  # a SymInt under torch.compile
        total_tokens = check_int(total_tokens, "total_tokens", minimum=0, maximum=MAX_TOKENS)
    if cu_seqlens.device.type == "meta":
        return cu_seqlens
    if not values_readable(cu_seqlens):
        cu = cu_seqlens.long()
        ok = (cu[0] == 0) & (cu[1:] >= cu[:-1]).all()
        if total_tokens is not None:
            ok = ok & (cu[-1] == total_tokens)
        torch._assert_async(ok, f"{name} must start at 0, never decrease and end at the number of tokens")
        return cu_seqlens
    values = cu_seqlens.detach().to(torch.int64).tolist()  # host memory already: no device is waited for
    if values[0] != 0:
        raise ValueError(f"{name}[0] must be 0, got {values[0]}")
    for i in range(len(values) - 1):
        if values[i + 1] < values[i]:
            raise ValueError(
                f"{name} must be non-decreasing, got {name}[{i}] = {values[i]} > {name}[{i + 1}] = {values[i + 1]}"
            )
    if total_tokens is not None and values[-1] != total_tokens:
        raise ValueError(f"{name}[-1] must equal the number of tokens {total_tokens}, got {values[-1]}")
    return cu_seqlens


def packed_positions(cu_seqlens: torch.Tensor, total_tokens: int | None = None) -> torch.Tensor:
    r"""Token positions of a packed row, restarting at 0 in each document.

    ``pos[t] = t - cu_seqlens[j]`` for the document ``j`` with ``cu_seqlens[j] <= t < cu_seqlens[j + 1]``.

    With ``total_tokens`` given the result is computed without reading ``cu_seqlens`` on the host
    (``torch.searchsorted`` on ``arange(total_tokens)``; the output size is known), so it runs
    asynchronously on an accelerator and :func:`torch.compile` traces it in one graph. Without it
    the length ``cu_seqlens[-1]`` is read from the device.

    Args:
        cu_seqlens: ``[num_docs + 1]`` int32/int64 tensor of cumulative lengths, starting at 0 and
            non-decreasing (flash-attn's ``cu_seqlens``, TransformerEngine's ``thd`` format). Empty
            documents (repeated entries) are allowed.
        total_tokens: ``cu_seqlens[-1]``, the number of tokens ``T``, if known (at most
            :data:`~ropelib.packing.MAX_TOKENS`, as ``cu_seqlens[-1]`` must be).

    Returns:
        int64 tensor ``[T]`` on ``cu_seqlens``'s device.

    Example:
        >>> from ropelib.packing import packed_positions
        >>> packed_positions(torch.tensor([0, 3, 3, 8, 10])).tolist()
        [0, 1, 2, 0, 1, 2, 3, 4, 0, 1]
    """
    cu_seqlens = check_cu_seqlens(cu_seqlens, total_tokens)
    if total_tokens is not None:
        return positions_in_documents(cu_seqlens, total_tokens)
    total = int(cu_seqlens[-1])  # a host read (the output's size)
    if total > MAX_TOKENS:  # an int64 end near 2^63: arange(total) would overflow its size
        raise ValueError(
            f"cu_seqlens[-1] = {total} tokens is more than a packed row's int64 positions can hold "
            f"(at most {MAX_TOKENS} tokens, 2^63 - 1 bytes)"
        )
    return positions_in_documents(cu_seqlens, total)


def positions_in_documents(cu_seqlens: torch.Tensor, total_tokens: int) -> torch.Tensor:
    """:func:`~ropelib.packed_positions` without argument checks (validated ``cu_seqlens``, known ``total_tokens``)."""
    cu = cu_seqlens.long()
    tokens = torch.arange(total_tokens, device=cu.device)
    # j(t) = (number of boundaries <= t) - 1; right=True skips the empty documents ending at t.
    doc = torch.searchsorted(cu, tokens, right=True) - 1
    return tokens - cu[doc]
