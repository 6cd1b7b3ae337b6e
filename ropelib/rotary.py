r"""Rotary position embedding (RoPE; Su et al., RoFormer, 2021): the module that validates, builds tables, and calls the kernels.

Each pair of features ``(x_a, x_b)`` of a query or key at position ``m`` is rotated by the
angle ``m * inv_freq[i]``:

.. math::

    \begin{pmatrix} x_a' \\ x_b' \end{pmatrix} =
    \begin{pmatrix} \cos m\theta_i & -\sin m\theta_i \\ \sin m\theta_i & \cos m\theta_i \end{pmatrix}
    \begin{pmatrix} x_a \\ x_b \end{pmatrix},

so that ``<R_m q, R_n k>`` depends on ``m - n`` only. Which features form a pair is the
*layout* (:mod:`ropelib.layouts`). Tensors are ``[batch, seq, heads, head_dim]``. With
``rotary_dim = r < head_dim`` only the first ``r`` features are rotated; the rest pass through.

A call validates its arguments once, gets cos/sin rows for its positions, and hands everything to
:func:`ropelib.kernels.ops.rotate_qk` unchecked. The rows come from a float32 cache of positions
``0 .. L-1`` when that is free (no positions given, or positions that can be read on the host:
eager on the CPU); otherwise (on a GPU, or under :func:`torch.compile`) they are computed for the
positions given, with the same float64 angles, so that no call waits for the device or breaks a graph.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ._validation import (
    check_choice,
    check_even,
    check_float_dtype,
    check_int,
    check_integer_tensor,
    check_position_range,
    check_positions,
    check_positive_float,
    check_qk,
    values_readable,
)
from .config import rope_config
from .frequencies import angle_tables
from .kernels.ops import BACKENDS, choose_kernel, rotate_qk
from .layouts import LAYOUTS
from .packing import check_cu_seqlens, positions_in_documents
from .reference import rotate
from .scaling import ROPE_SCALINGS, frequency_seq_len, inverse_frequencies64, rope_type_of

#: The float32 cache holds at most this many positions (or ``max_position_embeddings``, if larger);
#: beyond it, rows are computed for the positions asked for, so one far position costs one row.
CACHE_POSITIONS = 1 << 16


class RotaryEmbedding(nn.Module):
    r"""Rotates queries and keys by their positions.

    Args:
        head_dim: per-head width ``d``.
        theta: the frequency base (``inv_freq[i] = theta^{-2i/r}``).
        layout: ``"half"`` (GPT-NeoX / Hugging Face) or ``"interleaved"`` (GPT-J / Meta / the seed).
        rotary_dim: features rotated per head (``head_dim`` by default; even, <= ``head_dim``).
        scaling: a Hugging Face-style ``rope_scaling`` dict (see :mod:`ropelib.scaling`).
        max_position_embeddings: the context length the frequencies are built for (read by scalings).
        backend: ``"auto"``, ``"torch"`` or ``"triton"`` (:data:`~ropelib.kernels.ops.BACKENDS`).

    Shapes:
        ``forward(q, k, positions=None)``: ``q`` is ``[batch, seq, q_heads, head_dim]``, ``k`` is
        ``[batch, seq, kv_heads, head_dim]`` (the head counts may differ, as in GQA/MQA);
        ``positions`` are integers of shape ``[seq]``, ``[1, seq]`` or ``[batch, seq]`` (default
        ``0 .. seq-1``), all >= 0 (checked as :mod:`ropelib._validation` says). Returns the
        rotated ``(q, k)`` in their dtypes; the angles are float64 rounded to float32.

    The frequencies are plain attributes, not buffers (``module.half()`` must not round them), and
    are built on the CPU even under ``torch.device("meta")``; :meth:`reset_parameters` rebuilds them.

    Example:
        >>> rope = RotaryEmbedding(head_dim=8)
        >>> q = k = torch.ones(1, 3, 2, 8)
        >>> q2, k2 = rope(q, k)
        >>> torch.allclose(q2[:, 0], q[:, 0])  # position 0 is not rotated
        True
    """

    def __init__(
        self,
        head_dim: int,
        theta: float = 10000.0,
        layout: str = "half",
        rotary_dim: int | None = None,
        *,
        scaling: Mapping[str, Any] | None = None,
        max_position_embeddings: int | None = None,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        self.head_dim = check_even(head_dim, "head_dim")
        self.rotary_dim = self.head_dim if rotary_dim is None else check_even(rotary_dim, "rotary_dim")
        if self.rotary_dim > self.head_dim:
            raise ValueError(f"rotary_dim must be <= head_dim={self.head_dim}, got {self.rotary_dim}")
        self.theta = check_positive_float(theta, "theta")
        self.layout = check_choice(layout, "layout", LAYOUTS)
        self.backend = check_choice(backend, "backend", BACKENDS)
        if scaling is not None and not isinstance(scaling, Mapping):
            raise TypeError(f"scaling must be a dict (a rope_scaling config) or None, got {type(scaling).__name__}")
        self.scaling = dict(scaling) if scaling is not None else None
        self.max_position_embeddings = max_position_embeddings
        rope_type = rope_type_of(self.scaling)
        self._follows_length = ROPE_SCALINGS[rope_type].follows_length
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """(Re)build the frequencies on the CPU and empty the caches (e.g. after building under ``meta``)."""
        self._inv_freq64, self.attention_scaling = inverse_frequencies64(
            self.rotary_dim, self.theta, self.scaling, max_position_embeddings=self.max_position_embeddings
        )
        self._freq_seq_len: int | None = None  # the seq_len of dynamic / longrope frequencies (None: original)
        self._forget_tables()

    def _forget_tables(self) -> None:
        self._inv_on: dict[torch.device, torch.Tensor] = {}
        self._cos = torch.empty(0, self.rotary_dim // 2, device="cpu")
        self._sin = torch.empty(0, self.rotary_dim // 2, device="cpu")

    @property
    def inv_freq(self) -> torch.Tensor:
        """The float32 inverse frequencies, ``[rotary_dim // 2]``."""
        return self._inv_freq64.to(torch.float32)

    @property
    def cache_limit(self) -> int:
        """The most positions the float32 cache holds (see :data:`~ropelib.rotary.CACHE_POSITIONS`)."""
        return max(CACHE_POSITIONS, self.max_position_embeddings or 0)

    def _inv_freq_on(self, device: torch.device) -> torch.Tensor:
        """The float64 inverse frequencies on ``device``, copied there once."""
        inv = self._inv_on.get(device)
        if inv is None:
            inv = self._inv_on[device] = self._inv_freq64.to(device)
        return inv

    def rows(self, positions: torch.Tensor, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` computed for ``positions`` (any shape and integer values), no cache: ``positions.shape + (r/2,)``."""
        return angle_tables(self._inv_freq_on(positions.device), positions, self.attention_scaling, dtype)

    def cos_sin_cache(self, length: int, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The float32 ``(cos, sin)`` tables for positions ``0 .. length-1`` or more, ``[L, rotary_dim/2]``.

        The cache doubles when it grows, so a decoding loop rebuilds it ``log2(L)`` times.
        """
        length = check_int(length, "length", minimum=0)
        device = torch.device(device) if device is not None else self._cos.device
        if self._cos.shape[0] < length or self._cos.device != device:
            grown = 2 * self._cos.shape[0] if self._cos.device == device else 0
            size = max(length, min(grown, self.cache_limit), 16)
            self._cos, self._sin = self.rows(torch.arange(size, device=device))
        return self._cos, self._sin

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` at integer ``positions`` (any shape), each ``positions.shape + (rotary_dim/2,)``, in ``dtype``.

        The angles are formed in float64 and rounded once to ``dtype``. With a length-dependent
        scaling (``dynamic``, ``longrope``) the frequencies are first brought to the length
        ``positions.max() + 1`` (see :func:`ropelib.scaling.frequency_seq_len`).
        """
        positions = check_integer_tensor(positions, "positions").long()
        check_position_range(positions, "positions")
        dtype = check_float_dtype(dtype)
        if self._follows_length and positions.numel():
            self._follow_length(int(positions.max()) + 1)
        return self.rows(positions, dtype)

    def _follow_length(self, needed: int) -> None:
        """Recompute dynamic NTK / LongRoPE frequencies for a sequence of ``needed`` positions (as Hugging Face does)."""
        seq_len = frequency_seq_len(
            self.scaling, needed, self._freq_seq_len, max_position_embeddings=self.max_position_embeddings
        )
        if seq_len != self._freq_seq_len:
            self._inv_freq64, self.attention_scaling = inverse_frequencies64(
                self.rotary_dim,
                self.theta,
                self.scaling,
                max_position_embeddings=self.max_position_embeddings,
                seq_len=seq_len,
            )
            self._freq_seq_len = seq_len
            self._forget_tables()

    @classmethod
    def from_config(cls, config: Mapping[str, Any], *, layout: str = "half", backend: str = "auto") -> RotaryEmbedding:
        """The rotary embedding of a model's ``config.json`` dict (parsed by :func:`ropelib.rope_config`).

        Example:
            >>> rope = RotaryEmbedding.from_config({"hidden_size": 64, "num_attention_heads": 4, "rope_theta": 500000.0,
            ...     "max_position_embeddings": 4096, "rope_scaling": {"rope_type": "linear", "factor": 2.0}})
            >>> rope.head_dim, rope.theta, rope.scaling
            (16, 500000.0, {'rope_type': 'linear', 'factor': 2.0})
        """
        options = rope_config(config)
        return cls(layout=layout, backend=backend, **options)

    def check_qk(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor | None:
        """Validate ``q``, ``k`` and ``positions``; return the positions as int64 on ``q``'s device (or None)."""
        check_qk(q, k, head_dim=self.head_dim)
        if positions is None:
            return None
        positions = check_positions(positions, "positions", batch=q.shape[0], seq_len=q.shape[1])
        return positions.to(q.device)

    def tables_for(
        self, positions: torch.Tensor | None, seq_len: int, device: torch.device, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(cos, sin, rows)`` for the kernels: a ``[L, r/2]`` table and the row of each token (None: ``0 .. seq-1``).

        Validated ``positions`` (int64 on ``device``) or None. Reads position values only where
        that is free (see the module docstring).
        """
        if self._follows_length:  # dynamic / longrope: the length is read on the host, as transformers does
            needed = seq_len if positions is None or positions.numel() == 0 else int(positions.max()) + 1
            self._follow_length(needed)
        if dtype == torch.float64:
            if positions is None:
                positions = torch.arange(seq_len, device=device)
            cos, sin = self.rows(positions, torch.float64)
            return cos.reshape(-1, cos.shape[-1]), sin.reshape(-1, sin.shape[-1]), self._row_index(positions)
        if torch.compiler.is_compiling():
            positions = torch.arange(seq_len, device=device) if positions is None else positions
        elif positions is None:
            cos, sin = self.cos_sin_cache(max(seq_len, 1), device)
            return cos, sin, None
        elif values_readable(positions) and positions.numel():
            low, high = (int(v) for v in torch.aminmax(positions))
            if low >= 0 and high < self.cache_limit:
                cos, sin = self.cos_sin_cache(high + 1, device)
                return cos, sin, positions
        cos, sin = self.rows(positions)
        return cos.reshape(-1, cos.shape[-1]), sin.reshape(-1, sin.shape[-1]), self._row_index(positions)

    @staticmethod
    def _row_index(positions: torch.Tensor) -> torch.Tensor:
        """Rows ``0 .. n-1`` of a table computed for ``positions`` itself, shaped like ``positions``."""
        return torch.arange(positions.numel(), device=positions.device).view(positions.shape)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        positions: torch.Tensor | None = None,
        *,
        cu_seqlens: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if cu_seqlens is not None:
            return self.rotate_packed(q, k, positions, cu_seqlens)
        return self.rotate(q, k, self.check_qk(q, k, positions))

    def rotate_packed(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor | None, cu_seqlens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward(q, k, cu_seqlens=...)``: a packed row of documents, positions restarting at 0 in each.

        ``q``/``k`` are ``[1, tokens, heads, head_dim]`` or ``[tokens, heads, head_dim]`` (flash-attn's
        varlen layout); ``cu_seqlens`` the ``[num_docs + 1]`` cumulative lengths. No position exceeds
        ``tokens - 1``, so the table of the first ``tokens`` positions (a shape, not a value) covers
        them all, and the kernels find each token's document from ``cu_seqlens`` themselves.
        """
        if positions is not None:
            raise ValueError("give positions or cu_seqlens, not both: cu_seqlens defines the positions")
        flat = isinstance(q, torch.Tensor) and q.ndim == 3
        if flat and isinstance(k, torch.Tensor):
            q, k = q.unsqueeze(0), k.unsqueeze(0)
        check_qk(q, k, head_dim=self.head_dim)
        if q.shape[0] != 1:
            raise ValueError(
                f"with cu_seqlens, q and k must be one packed row [1, tokens, heads, d], got {tuple(q.shape)}"
            )
        tokens = q.shape[1]
        cu_seqlens = check_cu_seqlens(cu_seqlens, tokens)
        if cu_seqlens.device != q.device:
            raise ValueError(f"cu_seqlens must be on q's device {q.device}, got {cu_seqlens.device}")
        if q.dtype == torch.float64 or self._follows_length:  # the general path, with explicit positions
            q, k = self.rotate(q, k, positions_in_documents(cu_seqlens, tokens)[None])
        else:
            if torch.compiler.is_compiling():
                cos, sin = self.rows(torch.arange(max(tokens, 1), device=q.device))
            else:
                cos, sin = self.cos_sin_cache(max(tokens, 1), q.device)
            q = q if q.stride(-1) == 1 else q.contiguous()
            k = k if k.stride(-1) == 1 else k.contiguous()
            unused = torch.zeros(1, tokens, dtype=torch.long, device=q.device)
            kernel = choose_kernel(self.backend, q.device)
            interleaved = self.layout == "interleaved"
            q, k = rotate_qk(q, k, cos, sin, unused, interleaved=interleaved, kernel=kernel, cu_seqlens=cu_seqlens)
        return (q[0], k[0]) if flat else (q, k)

    def rotate(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The module's call without argument checks, for callers that ran :meth:`check_qk` (attention layers, xPos)."""
        batch, seq = q.shape[:2]
        compute = torch.float64 if q.dtype == torch.float64 else torch.float32
        cos, sin, rows = self.tables_for(positions, seq, q.device, compute)
        if q.dtype == torch.float64:  # the reference path keeps float64 end to end
            cos, sin = cos[rows], sin[rows]
            return rotate(q, cos, sin, self.layout), rotate(k, cos, sin, self.layout)
        rows = torch.arange(seq, device=q.device) if rows is None else rows
        q = q if q.stride(-1) == 1 else q.contiguous()
        k = k if k.stride(-1) == 1 else k.contiguous()
        kernel = choose_kernel(self.backend, q.device)
        return rotate_qk(
            q, k, cos, sin, rows.expand(batch, seq), interleaved=self.layout == "interleaved", kernel=kernel
        )

    def extra_repr(self) -> str:
        return (
            f"head_dim={self.head_dim}, rotary_dim={self.rotary_dim}, theta={self.theta}, "
            f"layout={self.layout!r}, scaling={self.scaling}, backend={self.backend!r}"
        )
