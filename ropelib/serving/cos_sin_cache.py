r"""RoPE as inference engines call it: flattened tokens and one ``cos_sin_cache`` (vLLM's, SGLang's, FlashInfer's).

An engine batches the tokens of all its requests into one dimension and keeps one float32 table
``cos_sin_cache`` ``[max_positions, rotary_dim]``, row ``p`` holding ``cat(cos(p f), sin(p f))``.
:func:`~ropelib.apply_rope_with_cos_sin_cache` takes FlashInfer's arguments in FlashInfer's order
(``flashinfer.rope.apply_rope_with_cos_sin_cache``), so that code written for FlashInfer runs where
FlashInfer is not installed, and follows vLLM's contract (``RotaryEmbedding.forward_native``): ``key``
may be None, ``query``/``key`` flattened ``[tokens, heads * head_size]`` or ``[tokens, heads,
head_size]``, the first ``rotary_dim`` features of each head rotated and the rest kept.

Both functions check their arguments once and make one call of ``ropelib::rotary`` (``rotary_``
in place) on views of ``query`` and ``key``: no copy of either. The cache's rows of the given
positions are gathered once (one operation), as the engines' kernels read them.
"""

from __future__ import annotations

import torch

from .._validation import (
    check_bool,
    check_float_tensor,
    check_int,
    check_integer_tensor,
    check_position_range,
)
from ..kernels.aliasing import check_inplace
from ..kernels.door import check_kernel, rotate
from ..rotary import RotaryEmbedding
from ..rotary.cache import table_dtype


def _heads(x: object, name: str, tokens: tuple[int, ...], head_size: int) -> torch.Tensor:
    """``x`` ``[*tokens, heads * head_size]`` or ``[*tokens, heads, head_size]`` as a view ``[*tokens, heads, head_size]``."""
    x = check_float_tensor(x, name)
    lead = len(tokens)
    flat = x.ndim == lead + 1
    if tuple(x.shape[:lead]) != tokens or x.ndim not in (lead + 1, lead + 2):
        raise ValueError(
            f"{name} must be [{', '.join(map(str, tokens))}, heads * head_size] or [..., heads, head_size] "
            f"(positions' shape first), got {tuple(x.shape)}"
        )
    width = x.shape[-1]
    if (flat and width % head_size) or (not flat and width != head_size) or width == 0:
        wanted = f"a multiple of head_size={head_size}" if flat else f"head_size={head_size}"
        raise ValueError(f"{name}'s last dimension must be {wanted}, got shape {tuple(x.shape)}")
    return x.unflatten(-1, (-1, head_size)) if flat else x


def _check_cache(cos_sin_cache: object, q: torch.Tensor, head_size: int) -> torch.Tensor:
    """``[max_positions, rotary_dim]`` in the compute dtype of ``q`` (float32; float64 for float64), on its device."""
    cache = check_float_tensor(cos_sin_cache, "cos_sin_cache", ndim=2)
    width = cache.shape[1]
    if width % 2 or width == 0 or width > head_size or cache.shape[0] == 0:
        raise ValueError(
            "cos_sin_cache must be [max_positions, rotary_dim] = cat(cos, sin), non-empty, with an even rotary_dim "
            f"<= head_size={head_size}, got shape {tuple(cache.shape)}"
        )
    wanted = table_dtype(q.dtype)
    if cache.dtype != wanted:
        raise TypeError(
            f"cos_sin_cache must be {wanted} for {q.dtype} inputs (the rotation is computed in it), got "
            f"{cache.dtype}; widen it with .to({wanted})"
        )
    if cache.device != q.device:
        raise ValueError(f"cos_sin_cache must be on query's device {q.device}, got {cache.device}")
    if cache.requires_grad:
        raise ValueError("cos_sin_cache must not require grad: gradients flow to query and key only")
    return cache


def _prepare(
    positions: object,
    query: object,
    key: object,
    head_size: object,
    cos_sin_cache: object,
    is_neox: object,
    kernel: object,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, bool, str]:
    """The checked arguments as the operator takes them: ``(q, k, cos, sin, rows, interleaved, kernel)``.

    ``q``/``k`` are ``[batch or 1, seq, heads, head_size]`` views (``k`` of no heads when ``key`` is
    None); ``cos``/``sin`` ``[tokens, d_rot/2]`` the gathered rows and ``rows`` their indices.
    """
    positions = check_integer_tensor(positions, "positions")
    if positions.ndim not in (1, 2):
        raise ValueError(f"positions must be [tokens] (or [batch, seq]), got shape {tuple(positions.shape)}")
    head_size = check_int(head_size, "head_size", minimum=2)
    tokens = tuple(positions.shape)
    q = _heads(query, "query", tokens, head_size)
    k = q.new_empty((*tokens, 0, head_size)) if key is None else _heads(key, "key", tokens, head_size)
    if q.dtype != k.dtype or q.device != k.device:
        raise ValueError(
            f"query and key must share dtype and device, got {q.dtype}/{q.device} and {k.dtype}/{k.device}"
        )
    cache = _check_cache(cos_sin_cache, q, head_size)
    if positions.device != q.device:
        raise ValueError(f"positions must be on query's device {q.device}, got {positions.device}")
    interleaved = not check_bool(is_neox, "is_neox")
    if positions.ndim == 1:  # [tokens]: one row of tokens
        q, k = q[None], k[None]
    halves = cache.view(cache.shape[0], 2, -1).transpose(0, 1)  # cos and sin, views [2, L, r/2]
    check_position_range(positions, "positions", limit=cache.shape[0])
    index = positions.reshape(-1).long()
    gathered = halves.index_select(1, index)  # [2, tokens, r/2]: the rows of these tokens, contiguous
    rows = torch.arange(index.numel(), device=q.device).view(positions.shape)
    return q, k, gathered[0], gathered[1], rows, interleaved, check_kernel(kernel, q.device, q.dtype)


def apply_rope_with_cos_sin_cache(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
    *,
    kernel: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    r"""RoPE with a precomputed ``cos_sin_cache``, as FlashInfer and vLLM call it; new outputs.

    For token ``t`` at position ``p = positions[t]``, with ``c, s`` the halves of
    ``cos_sin_cache[p]``, pair ``i`` of every head turns: ``(x_a, x_b) -> (x_a c_i - x_b s_i,
    x_b c_i + x_a s_i)``; features from ``rotary_dim`` on are kept.

    Args:
        positions: integers in ``[0, max_positions)``, ``[tokens]`` (or ``[batch, seq]``, with
            ``query`` ``[batch, seq, ...]``), on ``query``'s device.
        query: ``[tokens, q_heads * head_size]`` or ``[tokens, q_heads, head_size]``; float16,
            bfloat16 or float32 (float64 with a float64 cache); any strides (a slice of a packed
            QKV projection is rotated where it lies).
        key: like ``query`` with its own number of heads, or None (queries only).
        head_size: the width of a head.
        cos_sin_cache: ``[max_positions, rotary_dim]``, float32 (float64 for float64 inputs):
            ``cat(cos, sin, -1)`` of each position, ``rotary_dim`` even and ``<= head_size``.
        is_neox: True for the half layout (pairs ``(i, i + d_rot/2)``, GPT-NeoX), False for the
            interleaved one (pairs ``(2i, 2i + 1)``, GPT-J).
        kernel: ropelib's own choice, ``"auto"``, ``"torch"``, ``"native"`` or ``"triton"``
            (:func:`~ropelib.choose_kernel`); not one of FlashInfer's arguments.

    Returns:
        ``(query_out, key_out)`` in the shapes and dtypes of ``query`` and ``key`` (``key_out`` is
        None when ``key`` is).

    Example:
        >>> from ropelib import RotaryEmbedding
        >>> cache = make_cos_sin_cache(RotaryEmbedding(8), 16)
        >>> query, key = torch.randn(3, 2 * 8), torch.randn(3, 8)
        >>> positions = torch.tensor([0, 5, 9])
        >>> q, k = apply_rope_with_cos_sin_cache(positions, query, key, 8, cache)
        >>> q.shape, torch.equal(q[0], query[0])  # position 0 is not rotated
        (torch.Size([3, 16]), True)
    """
    q, k, cos, sin, rows, interleaved, kernel = _prepare(
        positions, query, key, head_size, cos_sin_cache, is_neox, kernel
    )
    q_out, k_out = rotate(q, k, cos, sin, rows, interleaved=interleaved, kernel=kernel)
    return q_out.reshape(query.shape), None if key is None else k_out.reshape(key.shape)


def apply_rope_with_cos_sin_cache_inplace(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
    *,
    kernel: str = "auto",
) -> None:
    """:func:`~ropelib.apply_rope_with_cos_sin_cache` writing into ``query`` and ``key`` (FlashInfer's ``_inplace``).

    The same arguments; ``query`` and ``key`` must not overlap (views of different heads of one
    buffer are fine). Their version counters move, and autograd records the rotation as for any
    in-place operation of PyTorch (not on leaf tensors that require grad).

    Example:
        >>> from ropelib import RotaryEmbedding
        >>> cache = make_cos_sin_cache(RotaryEmbedding(8), 16)
        >>> qkv = torch.randn(3, 3 * 8)  # one token's q, k, v heads side by side
        >>> v = qkv[:, 16:].clone()
        >>> apply_rope_with_cos_sin_cache_inplace(
        ...     torch.tensor([1, 2, 3]), qkv[:, :8], qkv[:, 8:16], 8, cache
        ... )
        >>> torch.equal(qkv[:, 16:], v)  # the values are not touched
        True
    """
    q, k, cos, sin, rows, interleaved, kernel = _prepare(
        positions, query, key, head_size, cos_sin_cache, is_neox, kernel
    )
    check_inplace(q, k)
    rotate(q, k, cos, sin, rows, interleaved=interleaved, kernel=kernel, inplace=True)


def make_cos_sin_cache(
    rope: RotaryEmbedding, max_positions: int, device: torch.device | str | None = None
) -> torch.Tensor:
    r"""The engines' float32 ``cos_sin_cache`` ``[max_positions, rotary_dim]`` of a :class:`~ropelib.RotaryEmbedding`.

    Row ``p`` is ``cat(a cos(p f), a sin(p f))`` with the module's frequencies ``f`` (any scaling)
    and attention factor ``a``, the angles formed in float64 and rounded once. For the scalings
    whose frequencies follow the length (dynamic NTK, LongRoPE), those of ``max_positions``
    positions (transformers' rule). A snapshot: no gradient, and learned frequencies as they are now.

    Example:
        >>> from ropelib import RotaryEmbedding
        >>> make_cos_sin_cache(RotaryEmbedding(16, rotary_dim=8), 32).shape
        torch.Size([32, 8])
    """
    if not isinstance(rope, RotaryEmbedding):
        raise TypeError(f"rope must be a ropelib.RotaryEmbedding, got {type(rope).__name__}")
    max_positions = check_int(max_positions, "max_positions", minimum=1)
    device = torch.device("cpu") if device is None else torch.device(device)
    with torch.no_grad():
        cos, sin = rope.cos_sin(torch.arange(max_positions, device=device), torch.float32)
    return torch.cat((cos, sin), -1)
