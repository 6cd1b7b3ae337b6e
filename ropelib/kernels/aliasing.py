"""Whether an in-place rotation may overwrite q and k: no shared elements, within or between them.

q and k split from one fused projection (views of different heads of one buffer) are told apart
exactly; any other pair in one storage is compared by byte range. Storages are compared, never
read. Where storages cannot be seen (fake tensors under :func:`torch.compile` or ``make_fx``,
tensors under :func:`torch.func.vmap`), q and k are not compared.
"""

from __future__ import annotations

import torch


def storage_visible(x: torch.Tensor) -> bool:
    """True when ``x`` has a real storage to compare: eager, not a functorch or fake tensor."""
    if torch.compiler.is_compiling() or torch._C._functorch.is_functorch_wrapped_tensor(x):
        return False
    return x.device.type != "meta" and type(x) in (torch.Tensor, torch.nn.Parameter)


def overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when ``a`` and ``b`` (``[B, S, H, D]``) may share memory."""
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr() or a.numel() == 0 or b.numel() == 0:
        return False
    if a.stride() == b.stride() and a.shape[:2] == b.shape[:2] and a.shape[3] == b.shape[3]:
        head_stride = int(a.stride(2))
        shift = int(b.storage_offset()) - int(a.storage_offset())
        if head_stride > 0 and shift % head_stride == 0 and head_stride >= a.shape[3] * int(a.stride(3)):
            first = shift // head_stride  # b's head 0 is a's head `first`
            low, high = min(0, first), max(a.shape[2], first + b.shape[2])
            outer = [int(st) for sz, st in zip(a.shape[:2], a.stride()[:2]) if sz > 1]
            if all((high - low) * head_stride <= st for st in outer):
                return not (first >= a.shape[2] or first + b.shape[2] <= 0)

    def span(t: torch.Tensor) -> tuple[int, int]:
        start = int(t.storage_offset()) * t.element_size()
        extent = sum(int(size - 1) * int(stride) for size, stride in zip(t.shape, t.stride()) if size > 0)
        return start, start + (extent + 1) * t.element_size()

    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def writes_in_place(q: torch.Tensor, k: torch.Tensor, q_out: torch.Tensor, k_out: torch.Tensor) -> bool:
    """True when a kernel's outputs are its inputs (an in-place call), judged by a tensor that has elements.

    An empty tensor and its fresh output both have address 0, so ``q`` with no heads says nothing:
    ``k`` decides then. (Inside an operator's kernel, where the addresses are real.)
    """
    x, out = (q, q_out) if q.numel() else (k, k_out)
    return out.data_ptr() == x.data_ptr()


def self_overlaps(t: torch.Tensor) -> bool:
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


def check_inplace(q: torch.Tensor, k: torch.Tensor) -> None:
    """Refuse an in-place rotation that autograd forbids or that would write an element twice."""
    for name, x in (("q", q), ("k", k)):
        if torch.is_grad_enabled() and x.requires_grad:
            base = x._base if storage_visible(x) else None
            if x.is_leaf or (base is not None and base.is_leaf):
                raise ValueError(
                    f"inplace=True does not support autograd on {name}: it is a leaf tensor that requires grad (or a "
                    "view of one), which no in-place op may overwrite; rotate a non-leaf (e.g. the output of a "
                    "projection), use inplace=False, or run under torch.no_grad()"
                )
        if self_overlaps(x):
            raise ValueError(
                f"inplace=True needs {name} whose elements do not share memory (it is expanded or overlapping, "
                f"strides {x.stride()}); pass {name}.contiguous() or use inplace=False"
            )
    if storage_visible(q) and storage_visible(k) and overlap(q, k):
        raise ValueError("inplace=True needs q and k in separate memory (they overlap, so it would be rotated twice)")
