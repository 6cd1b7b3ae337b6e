r"""RoPE fused with the write of the key/value cache, as serving engines call it.

A serving engine rotates the new tokens' keys once and writes them into a (paged) KV cache, where
attention reads them at every later step; vLLM's ``reshape_and_cache_flash`` writes the slots,
SGLang and FlashInfer fuse the rotation into that write. :func:`~ropelib.rotary_kv_cache_write` does both
in one pass over ``k`` and ``v``: one call of the operator ``ropelib::rotary_kv_write_``, whose
schema says it writes the caches (their version counters move; ``torch.compile``, ``make_fx``
and dispatch modes see it). The two-step path (``rotary_qk``, then ``index_copy_`` of the rotated
``k``) reads ``k`` twice and writes it twice; this reads it once and writes it once, with the
same bits.
"""

from __future__ import annotations

import torch

from .._validation import (
    check_bool,
    check_choice,
    check_float_tensor,
    check_integer_tensor,
    check_position_range,
    check_positions,
    check_qk,
)
from ..kernels.aliasing import check_inplace, overlap, self_overlaps, storage_visible
from ..kernels.door import check_kernel, check_tables
from ..kernels.operators import rotary_kv_write_, rotary_kv_write_inplace_
from ..layouts import LAYOUTS


def _check_v(v: object, k: torch.Tensor) -> torch.Tensor:
    """Values ``[..., Hk, Dv]`` beside the keys: the same tokens and heads, dtype and device."""
    v = check_float_tensor(v, "v", ndim=k.ndim)
    if v.shape[:-1] != k.shape[:-1] or v.dtype != k.dtype or v.device != k.device:
        raise ValueError(
            f"v must have k's tokens and heads {tuple(k.shape[:-1])} (any head_dim), dtype and device, got "
            f"{tuple(v.shape)} {v.dtype}/{v.device} for k {tuple(k.shape)} {k.dtype}/{k.device}"
        )
    return v


def _share_elements(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when two caches may share an element; two halves of one ``[blocks, 2, ...]`` buffer do not."""
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr() or a.numel() == 0 or b.numel() == 0:
        return False
    shift = abs(int(b.storage_offset()) - int(a.storage_offset()))
    if a.shape == b.shape and a.stride() == b.stride() and shift:
        both = torch.empty_strided((2, *a.shape), (shift, *a.stride()), device="meta")
        return self_overlaps(both)  # the pair as one tensor: distinct addresses?
    return overlap(a, b)


def _check_caches(k_cache: object, v_cache: object, k: torch.Tensor, v: torch.Tensor) -> list[torch.Tensor]:
    """Key and value caches for ``k``/``v`` ``[B, S, Hk, D]``, as ``[num_blocks, block_size, Hk, D]`` views."""
    caches, shapes = [], []
    for name, cache, x in (("k_cache", k_cache, k), ("v_cache", v_cache, v)):
        cache = check_float_tensor(cache, name)
        shapes.append(tuple(cache.shape))
        if cache.ndim not in (3, 4) or cache.shape[-2:] != x.shape[2:]:
            heads, dim = x.shape[2:]
            raise ValueError(
                f"{name} must have shape [num_slots, {heads}, {dim}] or [num_blocks, block_size, {heads}, {dim}] "
                f"(heads and head_dim of {name[0]}), got {tuple(cache.shape)}"
            )
        if cache.dtype != x.dtype or cache.device != x.device:
            raise ValueError(
                f"{name} must have {name[0]}'s dtype and device {x.dtype}/{x.device}, got {cache.dtype}/{cache.device}"
            )
        if cache.stride(-1) != 1 and cache.shape[-1] > 1:
            raise ValueError(f"{name} must have unit stride on head_dim (it is written in place), got {cache.stride()}")
        if cache.requires_grad:
            raise ValueError(f"{name} must not require grad: the write is inference-only")
        if not cache.is_contiguous() and storage_visible(cache) and self_overlaps(cache):
            raise ValueError(
                f"{name}'s elements must not share memory (it is written in place), strides {cache.stride()}"
            )
        caches.append(cache if cache.ndim == 4 else cache.unsqueeze(0))
    if caches[0].shape[:2] != caches[1].shape[:2]:
        raise ValueError(
            f"k_cache and v_cache must have the same slots (leading dimensions), got {shapes[0]} and {shapes[1]}"
        )
    return caches


def _check_no_aliasing(inputs: dict[str, torch.Tensor], caches: list[torch.Tensor]) -> None:
    """The caches must not share memory with each other, nor with q, k or v, which the same pass reads."""
    caches = [c for c in caches if storage_visible(c)]  # none under compile or vmap: nothing to compare
    if not caches:
        return
    if len(caches) == 2 and _share_elements(*caches):
        raise ValueError("k_cache and v_cache must not share memory: each would overwrite the other")
    written = {c.untyped_storage().data_ptr() for c in caches}
    for name, x in inputs.items():
        if storage_visible(x) and x.untyped_storage().data_ptr() in written and any(overlap(x, c) for c in caches):
            raise ValueError(f"{name} overlaps a cache it is written into; pass {name}.clone()")


def rotary_kv_cache_write(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    *,
    layout: str = "half",
    kernel: str = "auto",
    inplace: bool = False,
) -> torch.Tensor:
    r"""Rotate ``q`` and ``k`` by RoPE (Su et al., 2024) and write ``k`` and ``v`` into a KV cache, in one pass.

    Each pair ``i`` of a head at position ``m`` becomes ``(x_a c - x_b s, x_b c + x_a s)``,
    ``c = cos[m, i]``, ``s = sin[m, i]`` (:func:`~ropelib.rotary_qk`'s rotation, the same bits); the
    rotated key of token ``t`` and its value are written into slot ``slot_mapping[t]`` of the
    caches, vLLM's slot mapping: block ``slot // block_size``, row ``slot % block_size``. A
    negative slot (vLLM's -1) is padding: its q is rotated, nothing is written to a cache. The
    result equals ``rotary_qk`` followed by ``index_copy_`` of the rotated ``k`` and of ``v`` into
    the valid slots. Inference only: with autograd recording, an input that requires grad raises.

    Args:
        q: ``[tokens, q_heads, head_dim]`` (vLLM's flattened tokens) or ``[batch, seq, q_heads,
            head_dim]``; float16, bfloat16, float32 or float64.
        k: ``[..., kv_heads, head_dim]`` with q's tokens (``kv_heads`` may differ: GQA/MQA).
        v: ``[..., kv_heads, v_head_dim]`` with k's tokens, heads, dtype and device.
        k_cache, v_cache: ``[num_slots, kv_heads, d]`` (contiguous) or ``[num_blocks, block_size,
            kv_heads, d]`` (paged, vLLM's flash layout), written in place; k's dtype and device,
            unit stride on ``d``, any other strides (two halves of one buffer are fine).
        slot_mapping: integers, ``[tokens]`` (or ``[batch, seq]``), on q's device, each ``<
            num_slots`` (checked as :mod:`ropelib._validation` says: read on the CPU, a queued
            device assertion elsewhere); the valid slots must be distinct (a slot named twice
            holds one of its tokens, which is unspecified, as for ``index_copy_``).
        cos: a ``[table_len, d_rot/2]`` table (:meth:`ropelib.RotaryEmbedding.cos_sin_cache`).
        sin: the sine table, of ``cos``'s shape.
        positions: integers in ``[0, table_len)``, ``[tokens]`` (or ``[seq]``, ``[1, seq]``,
            ``[batch, seq]``), on q's device.
        layout: ``"half"`` or ``"interleaved"``.
        kernel: ``"auto"``, ``"torch"``, ``"native"`` or ``"triton"`` (:func:`~ropelib.choose_kernel`).
        inplace: rotate ``q`` where it lies (vLLM's order; no fresh output, whose pages a CPU
            pays for), with ``ropelib::rotary_kv_write_inplace_``; ``q`` must not overlap ``k`` or ``v``.

    Returns:
        The rotated ``q``: a new tensor of q's shape and dtype, or ``q`` itself in place; ``k_cache``
        and ``v_cache`` hold the tokens' rotated keys and values.

    Example:
        >>> from ropelib import RotaryEmbedding
        >>> cos, sin = RotaryEmbedding(8).cos_sin_cache(16)
        >>> q = torch.randn(3, 2, 8)
        >>> k, v = torch.randn(3, 1, 8), torch.randn(3, 1, 8)
        >>> k_cache, v_cache = torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 1, 8)
        >>> # block 1 row 1, padding, block 0 row 0
        >>> slots = torch.tensor([5, -1, 0])
        >>> positions = torch.tensor([7, 0, 2])
        >>> q_rot = rotary_kv_cache_write(
        ...     q, k, v, k_cache, v_cache, slots, cos, sin, positions)
        >>> torch.equal(v_cache[1, 1], v[0]), bool(v_cache[0, 1:].eq(0).all())
        (True, True)
    """
    q = given = check_float_tensor(q, "q")
    if q.ndim not in (3, 4):
        raise ValueError(f"q must be [tokens, heads, head_dim] or [batch, seq, heads, head_dim], got {tuple(q.shape)}")
    flat = q.ndim == 3
    k = check_float_tensor(k, "k", ndim=q.ndim)
    check_qk(*((q.unsqueeze(0), k.unsqueeze(0)) if flat else (q, k)))  # k against q, then v against k
    v = _check_v(v, k)
    if flat:
        q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
    cos, sin = check_tables(cos, sin, q)
    interleaved = check_choice(layout, "layout", LAYOUTS) == "interleaved"
    kernel = check_kernel(kernel, q.device, q.dtype)
    if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
        raise ValueError(
            "rotary_kv_cache_write is inference-only (no gradient reaches q, k or v through the cache): run it "
            "under torch.no_grad() or torch.inference_mode(), or use rotary_qk to train"
        )
    caches = _check_caches(k_cache, v_cache, k, v)
    _check_no_aliasing({"q": q, "k": k, "v": v}, caches)
    if check_bool(inplace, "inplace"):
        check_inplace(q, k)  # q written where k is read: no shared element, no expanded q
        if storage_visible(q) and storage_visible(v) and overlap(q, v):
            raise ValueError("q overlaps v, which the same pass reads: pass q.clone() or inplace=False")
    batch, seq = q.shape[:2]
    slots = check_integer_tensor(slot_mapping, "slot_mapping")
    if tuple(slots.shape) != ((seq,) if flat else (batch, seq)):
        wanted = f"[tokens] = [{seq}]" if flat else f"[batch, seq] = [{batch}, {seq}]"
        raise ValueError(f"slot_mapping must have shape {wanted}, got {list(slots.shape)}")
    if slots.device != q.device:
        raise ValueError(f"slot_mapping must be on q's device {q.device}, got {slots.device}")
    slots = slots.long().view(batch, seq)
    num_slots = caches[0].shape[0] * caches[0].shape[1]
    check_position_range(
        slots, f"slot_mapping (the caches' {num_slots} slots; negative: padding)", minimum=None, limit=num_slots
    )
    positions = check_positions(
        positions, "positions", batch=None if flat else batch, seq_len=seq, limit=cos.shape[0], expand=False
    )
    if positions.device != q.device:
        raise ValueError(f"positions must be on q's device {q.device}, got {positions.device}")
    if inplace:
        rotary_kv_write_inplace_(q, k, v, k_cache, v_cache, slots, cos, sin, positions, interleaved, kernel)
        return given
    q_out = rotary_kv_write_(q, k, v, k_cache, v_cache, slots, cos, sin, positions, interleaved, kernel)
    return q_out[0] if flat else q_out
