"""The stand-in for a modeling module's ``apply_rotary_pos_emb``, and the record of what the patch installed."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch

from ...kernels.ops import choose_kernel, rotate_qk
from .module import HFRotaryEmbedding

#: every HFRotaryEmbedding that patch_hf_rope put into a model and unpatch_hf_rope has not taken out
INSTALLED: weakref.WeakSet[HFRotaryEmbedding] = weakref.WeakSet()


def installed_tables(cos: object) -> tuple[HFRotaryEmbedding, torch.Tensor, torch.Tensor] | None:
    """The installed module that returned ``cos`` last, with its half-width tables; None for any other tensor."""
    for module in INSTALLED:
        tables = module.tables_of(cos)
        if tables is not None:
            return module, tables[0], tables[1]
    return None


def rotate_with_tables(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q, k`` (``[batch, seq, heads, d]``) by per-token tables ``[1 or batch, seq, r/2]``.

    The tables are handed to the kernels as a ``[rows, r/2]`` table with one row per token, so
    the kernels need no positions and no range checks (no device synchronisation).
    """
    batch, seq = q.shape[:2]
    kernel = choose_kernel(backend, q.device)
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    if cos.shape[0] == 1:  # one row of positions shared by the whole batch
        rows = torch.arange(seq, device=q.device).expand(batch, seq)
        return rotate_qk(q, k, cos[0], sin[0], rows, interleaved=False, kernel=kernel)
    rows = torch.arange(batch * seq, device=q.device).view(batch, seq)
    flat_cos, flat_sin = cos.reshape(batch * seq, -1), sin.reshape(batch * seq, -1)
    return rotate_qk(q, k, flat_cos, flat_sin, rows, interleaved=False, kernel=kernel)


class RopelibApply:
    """Stands in for a modeling module's ``apply_rotary_pos_emb``.

    Eager calls whose ``cos`` comes from an installed :class:`~ropelib.HFRotaryEmbedding` are rotated by
    ropelib's kernels with ropelib's float tables; any other call, and every call under
    :func:`torch.compile` (where Inductor fuses the original's arithmetic into one kernel), goes to
    the original function with its arguments unchanged.
    """

    def __init__(self, original: Callable[..., Any]) -> None:
        self.original = original
        functools.update_wrapper(self, original)

    def __call__(self, q: Any, k: Any, cos: Any, sin: Any, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling() or args or set(kwargs) - {"unsqueeze_dim"}:
            return self.original(q, k, cos, sin, *args, **kwargs)
        found = installed_tables(cos)
        unsqueeze_dim = kwargs.get("unsqueeze_dim", 1)
        if (
            found is None
            or unsqueeze_dim not in (1, 2)
            or not isinstance(q, torch.Tensor)
            or not isinstance(k, torch.Tensor)
            or q.ndim != 4
            or k.ndim != 4
            or q.dtype != k.dtype
            or found[1].shape[0] not in (1, q.shape[0])
            or found[1].shape[1] != q.shape[3 - unsqueeze_dim]  # the seq dimension
        ):
            return self.original(q, k, cos, sin, *args, **kwargs)
        module, cos_half, sin_half = found
        if unsqueeze_dim == 1:  # [batch, heads, seq, d] -> ropelib's [batch, seq, heads, d]
            q, k = q.transpose(1, 2), k.transpose(1, 2)
        q, k = rotate_with_tables(q, k, cos_half, sin_half, module.backend)
        if unsqueeze_dim == 1:
            q, k = q.transpose(1, 2), k.transpose(1, 2)
        return q, k
