r"""Rotary position embedding (RoPE; Su et al., RoFormer, 2024): :class:`RotaryEmbedding`, a spec, a cache, one operator.

Each pair of features ``(x_a, x_b)`` of a query or key at position ``m`` is rotated by ``m theta_i``:

.. math::

    \begin{pmatrix} x_a' \\ x_b' \end{pmatrix} =
    \begin{pmatrix} \cos m\theta_i & -\sin m\theta_i \\ \sin m\theta_i & \cos m\theta_i \end{pmatrix}
    \begin{pmatrix} x_a \\ x_b \end{pmatrix},

so that ``<R_m q, R_n k>`` depends on ``m - n`` only. Which features pair up is the *layout*
(:mod:`ropelib.layouts`); tensors are ``[batch, seq, heads, head_dim]``, and with ``rotary_dim <
head_dim`` only the first ``rotary_dim`` features turn.

A call checks its arguments once, makes a :class:`Rotation` (the tables of
:class:`~ropelib.rotary.cache.TableCache` and the checked positions) and applies it: one call of
the operator ``ropelib::rotary``. A model makes one :class:`Rotation` per forward pass and hands it
to every layer (:class:`ropelib.MultiHeadAttention` takes ``rotation=``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from .._validation import (
    check_bool,
    check_choice,
    check_even,
    check_float_dtype,
    check_float_tensor,
    check_int,
    check_integer_tensor,
    check_position_range,
    check_positions,
    check_qk,
    check_real_positions,
    values_readable,
)
from ..config import rope_config
from ..frequencies import angle_tables
from ..kernels.door import check_kernel, check_packed, check_packed_row, no_offsets, offset_positions
from ..layouts import LAYOUTS
from ..packing import positions_in_documents
from .cache import TableCache, table_dtype
from .rotation import Rotation
from .spec import RopeSpec


class RotaryEmbedding(nn.Module):
    r"""Rotates queries and keys by their positions (RoPE).

    Args:
        head_dim: per-head width ``d``.
        theta: the frequency base (``theta_i = base^{-2i/d_rot}``).
        layout: ``"half"`` (GPT-NeoX / Hugging Face) or ``"interleaved"`` (GPT-J / Meta / the seed).
        rotary_dim: features rotated per head (``head_dim`` by default; even, <= ``head_dim``;
            ``head_dim`` may then be odd).
        scaling: a Hugging Face ``rope_scaling`` dict (:mod:`ropelib.scaling`). With
            ``"proportional"`` and ``rotary_dim < head_dim``, ``rotary_dim / 2`` pairs of the whole
            head turn at the full head's frequencies, as transformers computes it.
        max_position_embeddings: the context length the frequencies are built for (read by scalings).
        kernel: ``"auto"``, ``"torch"``, ``"native"`` or ``"triton"`` (:func:`~ropelib.choose_kernel`).
        theta_rescale_factor: static NTK-aware scaling (rotary-embedding-torch's): the base becomes
            ``theta * factor^(d_rot / (d_rot - 2))``.
        freqs_for: ``"lang"`` (``base^{-2i/d_rot}``) or ``"pixel"`` (``linspace(1, max_freq / 2, d_rot/2) * pi``,
            for coordinates in ``[-1, 1]``); ``max_freq`` is read by ``"pixel"``.
        continuous_positions: positions may be any finite reals (floating tensors), not only token indices.
        learned_freq: the inverse frequencies become the parameter :attr:`learned_inv_freq`
            (rotary-embedding-torch's ``learned_freq``): rows are computed from it at each call,
            and gradients reach it.
        cache: a :class:`~ropelib.rotary.cache.TableCache` to share (its spec must be this one's).

    Shapes:
        ``forward(q, k, positions=None, *, cu_seqlens=None, seqlen_offsets=0)``: ``q``
        ``[batch, seq, q_heads, head_dim]``, ``k`` ``[batch, seq, kv_heads, head_dim]``;
        ``positions`` integers ``[seq]``, ``[1, seq]`` or ``[batch, seq]``, >= 0 (default
        ``0 .. seq-1``); ``cu_seqlens``: a packed row's document lengths (positions restart in each);
        ``seqlen_offsets`` (flash-attn's): an int or integer tensor ``[batch]`` added to the default
        positions. Returns the rotated ``(q, k)`` in their dtypes.

    Example:
        >>> rope = RotaryEmbedding(head_dim=8)
        >>> q = k = torch.ones(1, 3, 2, 8)
        >>> q2, k2 = rope(q, k)
        >>> torch.allclose(q2[:, 0], q[:, 0])  # position 0 is not rotated
        True
    """

    #: The learned inverse frequencies ``[rotary_dim // 2]`` (only with ``learned_freq=True``).
    learned_inv_freq: nn.Parameter

    def __init__(
        self,
        head_dim: int,
        theta: float = 10000.0,
        layout: str = "half",
        rotary_dim: int | None = None,
        *,
        scaling: Mapping[str, Any] | None = None,
        max_position_embeddings: int | None = None,
        kernel: str = "auto",
        theta_rescale_factor: float = 1.0,
        freqs_for: str = "lang",
        max_freq: float = 10.0,
        continuous_positions: bool = False,
        learned_freq: bool = False,
        cache: TableCache | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = check_int(head_dim, "head_dim", minimum=2)
        rotary_dim = self._rotary_dim(rotary_dim)
        if scaling is not None and not isinstance(scaling, Mapping):
            raise TypeError(f"scaling must be a dict (a rope_scaling config) or None, got {type(scaling).__name__}")
        scaling, rotary_dim = self._proportional(scaling, rotary_dim)
        self.layout = check_choice(layout, "layout", LAYOUTS)
        self.kernel = check_choice(kernel, "kernel", ("auto", "torch", "native", "triton"))
        self.continuous_positions = check_bool(continuous_positions, "continuous_positions")
        self.learned_freq = check_bool(learned_freq, "learned_freq")
        self.spec = RopeSpec.create(
            rotary_dim,
            theta,
            scaling,
            max_position_embeddings=max_position_embeddings,
            freqs_for=freqs_for,
            max_freq=max_freq,
            theta_rescale_factor=theta_rescale_factor,
        )
        if self.spec.follows_length and (self.learned_freq or self.continuous_positions):
            raise ValueError(
                "a length-following scaling (dynamic, longrope) needs fixed frequencies and integer positions: "
                "it does not combine with learned_freq=True or continuous_positions=True"
            )
        if cache is not None and (not isinstance(cache, TableCache) or cache.spec != self.spec):
            raise ValueError("cache must be a TableCache of this module's spec (RopeSpec), to share its tables")
        self.cache = cache if cache is not None else TableCache(self.spec)
        self.reset_parameters()

    def _rotary_dim(self, rotary_dim: int | None) -> int:
        if rotary_dim is None:
            if self.head_dim % 2:
                raise ValueError(
                    f"head_dim must be even (features are rotated in pairs) unless an even rotary_dim < head_dim "
                    f"is given, got {self.head_dim}"
                )
            return self.head_dim
        rotary_dim = check_even(rotary_dim, "rotary_dim")
        if rotary_dim > self.head_dim:
            raise ValueError(f"rotary_dim must be <= head_dim={self.head_dim}, got {rotary_dim}")
        return rotary_dim

    def _proportional(self, scaling: Mapping[str, Any] | None, rotary_dim: int) -> tuple[Any, int]:
        """``rope_type="proportional"`` with ``rotary_dim < head_dim``: the fraction goes into the dict and the
        frequencies span the whole head (:func:`~ropelib.scaling.proportional.proportional_scaling`)."""
        if scaling is None or rotary_dim == self.head_dim:
            return scaling, rotary_dim
        if scaling.get("rope_type", scaling.get("type")) != "proportional":
            return scaling, rotary_dim
        if scaling.get("partial_rotary_factor") is not None:
            raise ValueError(
                "rope_type='proportional' got both rotary_dim < head_dim and scaling['partial_rotary_factor']; "
                "give the fraction once"
            )
        fraction = rotary_dim / check_even(self.head_dim, "head_dim")
        return {**scaling, "partial_rotary_factor": fraction}, self.head_dim

    # the spec's values, as attributes
    rotary_dim = property(lambda self: self.spec.rotary_dim, doc="Features rotated per head.")
    theta = property(lambda self: self.spec.theta, doc="The frequency base.")
    scaling = property(lambda self: self.spec.scaling, doc="The ``rope_scaling`` dict, or None.")
    max_position_embeddings = property(lambda self: self.spec.max_position_embeddings, doc="The context length.")
    theta_rescale_factor = property(lambda self: self.spec.theta_rescale_factor, doc="Static NTK factor.")
    freqs_for = property(lambda self: self.spec.freqs_for, doc="The frequency family.")
    max_freq = property(lambda self: self.spec.max_freq, doc="The highest ``pixel`` frequency.")

    def reset_parameters(self) -> None:
        """Reset :attr:`learned_inv_freq` to the spec's frequencies (after building under ``meta``, say)."""
        if self.learned_freq:
            initial = self.spec.frequencies()[0].to(torch.float32)
            if isinstance(getattr(self, "learned_inv_freq", None), nn.Parameter):
                with torch.no_grad():
                    self.learned_inv_freq.copy_(initial)
            else:
                self.learned_inv_freq = nn.Parameter(initial)

    @property
    def inv_freq(self) -> torch.Tensor:
        """The float32 inverse frequencies, ``[rotary_dim // 2]`` (the learned ones' current value, detached)."""
        if self.learned_freq:
            return self.learned_inv_freq.detach().to(torch.float32)
        return self.cache.inv_freq.to(torch.float32)

    @property
    def attention_scaling(self) -> float:
        """The factor on cos and sin (YaRN's temperature; 1 for most scalings)."""
        return self.cache.attention_scaling

    @classmethod
    def from_config(cls, config: Mapping[str, Any], *, layout: str = "half", kernel: str = "auto") -> RotaryEmbedding:
        """The rotary embedding of a model's ``config.json`` dict (parsed by :func:`ropelib.rope_config`).

        Example:
            >>> config = {
            ...     "hidden_size": 64, "num_attention_heads": 4,
            ...     "rope_theta": 500000.0, "max_position_embeddings": 4096,
            ...     "rope_scaling": {"rope_type": "linear", "factor": 2.0},
            ... }
            >>> rope = RotaryEmbedding.from_config(config)
            >>> rope.head_dim, rope.theta, rope.scaling
            (16, 500000.0, {'rope_type': 'linear', 'factor': 2.0})
        """
        return cls(layout=layout, kernel=kernel, **rope_config(config))

    # ----------------------------------------------------------------------------- rows

    def _rows(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows computed for ``positions`` (any shape, integer or real): ``positions.shape + (d_rot/2,)``."""
        if self.learned_freq:
            inv_freq = self.learned_inv_freq.to(device=positions.device, dtype=torch.float64)
        else:
            inv_freq = self.cache.inv_freq.to(positions.device)
        return angle_tables(inv_freq, positions, self.attention_scaling, dtype)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` at ``positions`` (any shape), each ``positions.shape + (rotary_dim/2,)``, in ``dtype``.

        Float64 angles rounded once to ``dtype``: the rows of the cache (gathered from it when the
        positions can be read for free), or computed. Integer positions >= 0; with
        ``continuous_positions``, any finite reals. A length-following scaling first follows
        ``positions.max() + 1``.
        """
        dtype = check_float_dtype(dtype)
        if self.continuous_positions and isinstance(positions, torch.Tensor) and positions.is_floating_point():
            return self._rows(check_real_positions(positions, "positions"), dtype)
        positions = check_integer_tensor(positions, "positions").long()
        check_position_range(positions, "positions", minimum=None if self.continuous_positions else 0)
        return self.rows_at(positions, dtype)

    def rows_at(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`cos_sin` for checked int64 ``positions`` of any sign, unchecked: the cache's rows when the
        positions can be read for free and lie in it, else rows computed for them (the same values)."""
        if self.spec.follows_length and positions.numel():  # transformers reads the length on the host too
            self.cache.follow(int(positions.max()) + 1)
        if values_readable(positions) and positions.numel() and not self.learned_freq:
            low, high = (int(v) for v in torch.aminmax(positions))
            if low >= 0 and high < self.cache.limit:
                tables = self.cache.tables(positions.device, table_dtype(dtype), high + 1)
                index = positions.reshape(-1)
                cos, sin = (t.index_select(0, index).view(*positions.shape, -1) for t in (tables.cos, tables.sin))
                return cos.to(dtype), sin.to(dtype)
        return self._rows(positions, dtype)

    def cos_sin_cache(self, length: int, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The float32 ``(cos, sin)`` tables of positions ``0 .. L-1`` for some ``L >= length``, ``[L, rotary_dim/2]``.

        The cache's own tables (shared, not to be modified). With learned frequencies they are
        computed from the parameter at each call.
        """
        length = check_int(length, "length", minimum=0)
        device = torch.device("cpu") if device is None else torch.device(device)
        if self.learned_freq:
            return self._rows(torch.arange(max(length, 1), device=device), torch.float32)
        if length > self.cache.limit:
            return self._rows(torch.arange(length, device=device), torch.float32)
        tables = self.cache.tables(device, torch.float32, max(length, 1))
        return tables.cos, tables.sin

    # ----------------------------------------------------------------------------- the call

    def rotation(
        self,
        q: torch.Tensor,
        positions: torch.Tensor | None = None,
        *,
        cu_seqlens: torch.Tensor | None = None,
        seqlen_offsets: int | torch.Tensor = 0,
    ) -> Rotation:
        """The checked :class:`Rotation` for queries like ``q`` (``[batch, seq, heads, head_dim]``: its batch,
        length, dtype and device) at ``positions``; arguments as those of ``forward``."""
        check_float_tensor(q, "q")
        if q.ndim < 2:
            raise ValueError(f"q must be [batch, seq, ...] (queries, or the layer's input), got shape {tuple(q.shape)}")
        return self._rotation(q, positions, cu_seqlens, seqlen_offsets)

    def _rotation(
        self,
        q: torch.Tensor,
        positions: torch.Tensor | None,
        cu_seqlens: torch.Tensor | None,
        seqlen_offsets: int | torch.Tensor,
    ) -> Rotation:
        """:meth:`rotation` for a checked ``q``."""
        batch, seq = q.shape[:2]
        compute = table_dtype(q.dtype)
        length: int | None = None
        if cu_seqlens is not None:
            check_packed(positions, seqlen_offsets)
            cu_seqlens = check_packed_row(q, cu_seqlens)
            if self.learned_freq or self.spec.follows_length:  # rows of their own: the positions spelled out
                positions, cu_seqlens = positions_in_documents(cu_seqlens, seq), None
            else:
                positions, length = torch.zeros(1, dtype=torch.long, device=q.device).expand(seq), seq
        elif positions is None:
            offsets = None if no_offsets(seqlen_offsets) else offset_positions(seqlen_offsets, batch, seq, q.device)
            if offsets is None:
                positions, length = torch.arange(seq, device=q.device), seq
            else:
                positions = offsets
                length = int(seqlen_offsets) + seq if not isinstance(seqlen_offsets, torch.Tensor) else None
        elif not no_offsets(seqlen_offsets):
            raise ValueError("give positions or seqlen_offsets, not both: the offsets shift the default positions")
        elif self.continuous_positions and not isinstance(positions, torch.Tensor):
            raise TypeError(f"positions must be a torch.Tensor (integer or floating), got {type(positions).__name__}")
        elif self.continuous_positions and positions.is_floating_point():
            positions = check_real_positions(positions, "positions", batch=batch, seq_len=seq).to(q.device)
            return self._token_rotation(q, positions, compute)
        else:
            positions = check_positions(positions, "positions", batch=batch, seq_len=seq, minimum=None, expand=False)
            bounds = check_position_range(positions, "positions", minimum=None if self.continuous_positions else 0)
            if positions.device != q.device:
                positions = positions.to(q.device)
            if bounds is not None:
                length = bounds[1] + 1 if bounds[0] >= 0 else None
        if self.learned_freq or (self.continuous_positions and length is None):
            return self._token_rotation(q, positions, compute)
        if self.spec.follows_length and length is None:  # transformers reads the length on the host too
            length = int(positions.max()) + 1 if positions.numel() else seq
        tables = self.cache.tables_for(q.device, compute, length)
        beyond = length is None or length > tables.length
        return Rotation(
            tables.cos,
            tables.sin,
            positions,
            self.layout == "interleaved",
            check_kernel(self.kernel, q.device, q.dtype),
            self.head_dim,
            seq,
            frequencies=tables.frequencies if beyond else None,
            cu_seqlens=cu_seqlens,
        )

    def _token_rotation(self, q: torch.Tensor, positions: torch.Tensor, compute: torch.dtype) -> Rotation:
        """A rotation with a row per token (learned frequencies, real-valued positions)."""
        cos, sin = self._rows(positions, compute)  # [S or B, S, r/2]
        rows = torch.arange(positions.numel(), device=q.device).view(positions.shape)
        differentiable = self.learned_freq and torch.is_grad_enabled() and self.learned_inv_freq.requires_grad
        return Rotation(
            cos.reshape(-1, cos.shape[-1]),
            sin.reshape(-1, sin.shape[-1]),
            rows,
            self.layout == "interleaved",
            check_kernel(self.kernel, q.device, q.dtype),
            self.head_dim,
            q.shape[1],
            differentiable=differentiable,
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        positions: torch.Tensor | None = None,
        *,
        cu_seqlens: torch.Tensor | None = None,
        seqlen_offsets: int | torch.Tensor = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        flat = cu_seqlens is not None and isinstance(q, torch.Tensor) and q.ndim == 3 and isinstance(k, torch.Tensor)
        if flat:  # flash-attn's varlen layout [tokens, heads, d]
            q, k = q.unsqueeze(0), k.unsqueeze(0)
        check_qk(q, k, head_dim=self.head_dim)
        q, k = self._rotation(q, positions, cu_seqlens, seqlen_offsets).apply(q, k)
        return (q[0], k[0]) if flat else (q, k)

    def extra_repr(self) -> str:
        extra = "".join(
            f", {name}={value!r}"
            for name, value, default in (
                ("theta_rescale_factor", self.theta_rescale_factor, 1.0),
                ("freqs_for", self.freqs_for, "lang"),
                ("continuous_positions", self.continuous_positions, False),
                ("learned_freq", self.learned_freq, False),
            )
            if value != default
        )
        return (
            f"head_dim={self.head_dim}, rotary_dim={self.rotary_dim}, theta={self.theta}, "
            f"layout={self.layout!r}, scaling={self.scaling}, kernel={self.kernel!r}{extra}"
        )
