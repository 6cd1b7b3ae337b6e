"""One forward pass's rotation: :class:`Rotation`, the tables and checked positions every layer applies.

A model makes one with :meth:`ropelib.RotaryEmbedding.rotation` and hands it to each layer, which
calls ``rotation(q, k)``: one ``ropelib::rotary`` call per layer, no argument checked twice.
"""

from __future__ import annotations

import torch

from .._validation import check_bool, check_qk
from ..kernels.operators import rotary, rotary_
from ..reference import rotate as reference_rotate
from .cache import table_dtype


class Rotation:
    """The rotation of one forward pass: tables and checked positions, applied to the q and k of every layer.

    Made by :meth:`RotaryEmbedding.rotation`; ``rotation(q, k)`` returns the rotated pair (one
    ``ropelib::rotary`` call), for ``q``/``k`` of the batch and length it was made for. A value:
    its attributes are not to be changed.

    Attributes:
        cos: an ``[L, d_rot/2]`` table (the cache's, or a row per token).
        sin: the sine table, of ``cos``'s shape.
        positions: int64 ``[S]``, ``[1, S]`` or ``[B, S]`` rows of the tables.
        frequencies: float64 ``[d_rot/2 + 1]`` when a position may lie past the table, else None.
        cu_seqlens: a packed row's document lengths (positions restart in each), or None.
        differentiable: the rows carry a gradient (learned frequencies): plain operations rotate.
    """

    __slots__ = (
        "cos",
        "sin",
        "positions",
        "interleaved",
        "kernel",
        "head_dim",
        "seq",
        "frequencies",
        "cu_seqlens",
        "differentiable",
    )

    def __init__(
        self,
        cos: torch.Tensor,
        sin: torch.Tensor,
        positions: torch.Tensor,
        interleaved: bool,
        kernel: str,
        head_dim: int,
        seq: int,
        frequencies: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        differentiable: bool = False,
    ) -> None:
        self.cos, self.sin, self.positions = cos, sin, positions
        self.interleaved, self.kernel, self.head_dim, self.seq = interleaved, kernel, head_dim, seq
        self.frequencies, self.cu_seqlens, self.differentiable = frequencies, cu_seqlens, differentiable

    def __repr__(self) -> str:
        return (
            f"Rotation(positions={tuple(self.positions.shape)}, table_rows={self.cos.shape[0]}, "
            f"layout={'interleaved' if self.interleaved else 'half'!r}, kernel={self.kernel!r})"
        )

    def __call__(self, q: torch.Tensor, k: torch.Tensor, *, inplace: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        check_qk(q, k, head_dim=self.head_dim)
        rows = self.positions.shape[0] if self.positions.ndim == 2 else 1
        if q.shape[1] != self.seq or rows not in (1, q.shape[0]):
            raise ValueError(
                f"q and k must have the seq_len {self.seq} and batch the rotation was made for, got {tuple(q.shape)}"
            )
        if table_dtype(q.dtype) != self.cos.dtype:
            raise ValueError(f"the rotation was made for {self.cos.dtype} tables; make one for {q.dtype} inputs")
        return self.apply(q, k, inplace=check_bool(inplace, "inplace"))

    def apply(self, q: torch.Tensor, k: torch.Tensor, *, inplace: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """``rotation(q, k)`` for q and k already checked against it (unchecked)."""
        if self.differentiable:
            rows = self.positions.expand(q.shape[0], self.seq)
            layout = "interleaved" if self.interleaved else "half"
            cos, sin = self.cos[rows].to(q.dtype), self.sin[rows].to(q.dtype)
            return reference_rotate(q, cos, sin, layout), reference_rotate(k, cos, sin, layout)
        args = (
            self.cos,
            self.sin,
            self.positions,
            self.frequencies,
            self.cu_seqlens,
            self.interleaved,
            False,
            self.kernel,
        )
        if inplace:
            rotary_(q, k, *args)
            return q, k
        return rotary(q, k, *args)
