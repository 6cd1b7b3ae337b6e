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
    check_bool,
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
from .frequencies import angle_tables, ntk_rescaled_theta, pixel_inverse_frequencies
from .kernels import native_kernel
from .kernels.ops import BACKENDS, choose_kernel, kernel_for, no_offsets, offset_positions, rotate_qk
from .kernels.torch_kernel import few_elements, split_wide, wide_table
from .layouts import LAYOUTS
from .packing import check_cu_seqlens, positions_in_documents
from .reference import rotate
from .scaling import ROPE_SCALINGS, frequency_seq_len, inverse_frequencies64, rope_type_of

#: The float32 cache holds at most this many positions (or ``max_position_embeddings``, if larger);
#: beyond it, rows are computed for the positions asked for, so one far position costs one row.
CACHE_POSITIONS = 1 << 16

#: The frequency families, rotary-embedding-torch's ``freqs_for``: ``"lang"`` (``theta^{-2i/r}``) and ``"pixel"``.
FREQS_FOR = ("lang", "pixel")
#: Which positions a module accepts, ``"integer"`` token indices (>= 0) or ``"continuous"`` finite reals.
POSITION_KINDS = ("integer", "continuous")


def check_continuous_positions(positions: object, name: str, *, batch: int | None, seq_len: int | None) -> torch.Tensor:
    """Real-valued positions (integer or floating tensor), finite, of shape ``[seq]``/``[1, seq]``/``[batch, seq]``.

    ``seq_len=None`` accepts any shape. Integer positions are returned as int64 (any sign), floating
    ones unchanged; finiteness is checked by the rule of :mod:`ropelib._validation` (read on the CPU,
    a queued :func:`torch._assert_async` on a GPU or under :func:`torch.compile`).
    """
    if not isinstance(positions, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor (integer or floating), got {type(positions).__name__}")
    if not positions.dtype.is_floating_point:
        if seq_len is None:
            return check_integer_tensor(positions, name).long()
        return check_positions(positions, name, batch=batch, seq_len=seq_len, minimum=None)
    if seq_len is not None:
        shapes = [(seq_len,)] + ([(batch, seq_len), (1, seq_len)] if batch is not None else [])
        if tuple(positions.shape) not in shapes:
            expected = " or ".join(str(list(s)) for s in dict.fromkeys(shapes))
            raise ValueError(f"{name} must have shape {expected}, got {list(positions.shape)}")
        if positions.ndim == 2 and positions.shape[0] == 1 and batch is not None and batch != 1:
            positions = positions.expand(batch, seq_len)
    if positions.numel() and positions.device.type != "meta":
        finite = torch.isfinite(positions).all()
        if values_readable(positions):
            if not bool(finite):
                bad = positions[~torch.isfinite(positions)].flatten()[0].item()
                raise ValueError(f"{name} must be finite, got {bad}")
        else:
            torch._assert_async(finite, f"{name} must be finite")
    return positions


class RotaryEmbedding(nn.Module):
    r"""Rotates queries and keys by their positions.

    Args:
        head_dim: per-head width ``d``.
        theta: the frequency base (``inv_freq[i] = theta^{-2i/r}``).
        layout: ``"half"`` (GPT-NeoX / Hugging Face) or ``"interleaved"`` (GPT-J / Meta / the seed).
        rotary_dim: features rotated per head (``head_dim`` by default; even, <= ``head_dim``).
            ``head_dim`` may be odd when an even ``rotary_dim < head_dim`` is given.
        scaling: a Hugging Face-style ``rope_scaling`` dict (see :mod:`ropelib.scaling`). With
            ``"proportional"`` and ``rotary_dim < head_dim``, ``rotary_dim / 2`` pairs of the whole
            head rotate at the full head's frequencies (``partial_rotary_factor = rotary_dim / head_dim``
            in the dict), as transformers computes it.
        max_position_embeddings: the context length the frequencies are built for (read by scalings).
        backend: ``"auto"``, ``"torch"`` or ``"triton"`` (:data:`~ropelib.kernels.ops.BACKENDS`).
        theta_rescale_factor: static NTK-aware scaling, rotary-embedding-torch's argument of that
            name: the base becomes ``theta * factor^(r / (r - 2))`` (:func:`~ropelib.frequencies.ntk_rescaled_theta`).
        freqs_for: ``"lang"`` (RoPE's ``theta^{-2i/r}``) or ``"pixel"`` (rotary-embedding-torch's
            ``linspace(1, max_freq / 2, r / 2) * pi``, for coordinates in ``[-1, 1]``:
            :func:`~ropelib.frequencies.pixel_inverse_frequencies`); ``max_freq`` is read by ``"pixel"``.
        positions: ``"integer"`` (token indices, the default) or ``"continuous"``: positions may then
            be floating (fractional, negative) as well as integer, in ``forward`` and :meth:`cos_sin`;
            the angles are formed in float64 from them.
        learned_freq: make the inverse frequencies an :class:`torch.nn.Parameter`,
            :attr:`learned_inv_freq` (``[r/2]``, float32 until the module is cast), as
            rotary-embedding-torch's ``learned_freq``: every call computes its rows from it (no
            cache) and rotates with differentiable operations, so gradients reach it.

    Shapes:
        ``forward(q, k, positions=None)``: ``q`` is ``[batch, seq, q_heads, head_dim]``, ``k`` is
        ``[batch, seq, kv_heads, head_dim]`` (the head counts may differ, as in GQA/MQA);
        ``positions`` are integers of shape ``[seq]``, ``[1, seq]`` or ``[batch, seq]`` (default
        ``0 .. seq-1``), all >= 0 (checked as :mod:`ropelib._validation` says); with
        ``positions="continuous"``, any finite reals, floating or integer. ``seqlen_offsets``
        (flash-attn's): an int or integer tensor ``[batch]`` added to the default positions, token
        ``s`` of row ``b`` at ``offsets[b] + s`` (built on the device, no host read). Returns the
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
        backend: str = "auto",
        theta_rescale_factor: float = 1.0,
        freqs_for: str = "lang",
        max_freq: float = 10.0,
        positions: str = "integer",
        learned_freq: bool = False,
    ) -> None:
        super().__init__()
        self.head_dim = check_int(head_dim, "head_dim", minimum=2)
        if rotary_dim is None:
            if self.head_dim % 2:
                raise ValueError(
                    f"head_dim must be even (features are rotated in pairs) unless an even rotary_dim < head_dim "
                    f"is given, got {self.head_dim}"
                )
            self.rotary_dim = self.head_dim
        else:
            self.rotary_dim = check_even(rotary_dim, "rotary_dim")
        if self.rotary_dim > self.head_dim:
            raise ValueError(f"rotary_dim must be <= head_dim={self.head_dim}, got {self.rotary_dim}")
        self.theta = check_positive_float(theta, "theta")
        self.theta_rescale_factor = check_positive_float(theta_rescale_factor, "theta_rescale_factor")
        self.freqs_for = check_choice(freqs_for, "freqs_for", FREQS_FOR)
        self.max_freq = check_positive_float(max_freq, "max_freq")
        self.position_kind = check_choice(positions, "positions", POSITION_KINDS)
        self.learned_freq = check_bool(learned_freq, "learned_freq")
        self.layout = check_choice(layout, "layout", LAYOUTS)
        self.backend = check_choice(backend, "backend", BACKENDS)
        if scaling is not None and not isinstance(scaling, Mapping):
            raise TypeError(f"scaling must be a dict (a rope_scaling config) or None, got {type(scaling).__name__}")
        self.scaling = dict(scaling) if scaling is not None else None
        self.max_position_embeddings = max_position_embeddings
        rope_type = rope_type_of(self.scaling)
        if rope_type == "proportional" and self.rotary_dim != self.head_dim:
            self._proportional_fraction()
        self._follows_length = ROPE_SCALINGS[rope_type].follows_length
        self._check_combinations()
        # the options under which the few-token path applies (see _few_path)
        self._few_options = (
            self.layout == "half" and self.rotary_dim == self.head_dim and not self.learned_freq
        ) and not self._follows_length
        self.reset_parameters()

    def _proportional_fraction(self) -> None:
        """``rope_type="proportional"`` with ``rotary_dim < head_dim`` (as :func:`~ropelib.rope_config` gives it):
        the fraction ``rotary_dim / head_dim`` goes into the dict and the frequencies span the whole head,
        as transformers computes them (:func:`~ropelib.scaling.proportional.proportional_scaling`)."""
        assert self.scaling is not None
        if self.scaling.get("partial_rotary_factor") is not None:
            raise ValueError(
                "rope_type='proportional' got both rotary_dim < head_dim and scaling['partial_rotary_factor']; "
                "give the fraction once"
            )
        self.scaling["partial_rotary_factor"] = self.rotary_dim / check_even(self.head_dim, "head_dim")
        self.rotary_dim = self.head_dim

    def _check_combinations(self) -> None:
        """Refuse the options that do not combine (each would silently mean something else)."""
        if self.theta_rescale_factor != 1.0 and (self.scaling is not None or self.freqs_for == "pixel"):
            raise ValueError("theta_rescale_factor (static NTK scaling) needs freqs_for='lang' and scaling=None")
        ntk_rescaled_theta(self.theta, self.rotary_dim, self.theta_rescale_factor)  # rotary_dim = 2 cannot rescale
        if self.freqs_for == "pixel" and self.scaling is not None:
            raise ValueError("freqs_for='pixel' takes no scaling (the rope_scaling types rescale theta^(-2i/r))")
        if self._follows_length and (self.learned_freq or self.position_kind == "continuous"):
            raise ValueError(
                "a length-following scaling (dynamic, longrope) needs fixed frequencies and integer positions: "
                "it does not combine with learned_freq=True or positions='continuous'"
            )

    def _initial_frequencies(self) -> tuple[torch.Tensor, float]:
        """The float64 inverse frequencies ``[r/2]`` and attention factor of the options, built on the CPU."""
        if self.freqs_for == "pixel":
            return pixel_inverse_frequencies(self.rotary_dim, self.max_freq), 1.0
        theta = ntk_rescaled_theta(self.theta, self.rotary_dim, self.theta_rescale_factor)
        return inverse_frequencies64(
            self.rotary_dim, theta, self.scaling, max_position_embeddings=self.max_position_embeddings
        )

    def reset_parameters(self) -> None:
        """(Re)build the frequencies on the CPU and empty the caches (e.g. after building under ``meta``).

        With ``learned_freq=True`` the parameter :attr:`learned_inv_freq` is reset to them too.
        """
        self._inv_freq64, self.attention_scaling = self._initial_frequencies()
        if self.learned_freq:
            if isinstance(getattr(self, "learned_inv_freq", None), nn.Parameter):
                with torch.no_grad():
                    self.learned_inv_freq.copy_(self._inv_freq64)
            else:
                self.learned_inv_freq = nn.Parameter(self._inv_freq64.to(torch.float32))
        self._freq_seq_len: int | None = None  # the seq_len of dynamic / longrope frequencies (None: original)
        self._forget_tables()

    def _forget_tables(self) -> None:
        self._inv_on: dict[torch.device, torch.Tensor] = {}
        self._cos = torch.empty(0, self.rotary_dim // 2, device="cpu")
        self._sin = torch.empty(0, self.rotary_dim // 2, device="cpu")
        self._wide: torch.Tensor | None = None  # the cache in the form of the few-token path, [L, 2, r] (_wide_rows)

    @property
    def inv_freq(self) -> torch.Tensor:
        """The float32 inverse frequencies, ``[rotary_dim // 2]`` (the learned ones' current value, detached)."""
        if self.learned_freq:
            return self.learned_inv_freq.detach().to(torch.float32)
        return self._inv_freq64.to(torch.float32)

    @property
    def cache_limit(self) -> int:
        """The most positions the float32 cache holds (see :data:`~ropelib.rotary.CACHE_POSITIONS`)."""
        return max(CACHE_POSITIONS, self.max_position_embeddings or 0)

    def _inv_freq_on(self, device: torch.device) -> torch.Tensor:
        """The float64 inverse frequencies on ``device``, copied there once (learned ones: every call, differentiably)."""
        if self.learned_freq:
            return self.learned_inv_freq.to(device=device, dtype=torch.float64)
        inv = self._inv_on.get(device)
        if inv is None:
            inv = self._inv_on[device] = self._inv_freq64.to(device)
        return inv

    def rows(self, positions: torch.Tensor, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` computed for ``positions`` (any shape, integer or real values), no cache: ``positions.shape + (r/2,)``."""
        return angle_tables(self._inv_freq_on(positions.device), positions, self.attention_scaling, dtype)

    def cos_sin_cache(self, length: int, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The float32 ``(cos, sin)`` tables for positions ``0 .. length-1`` or more, ``[L, rotary_dim/2]``.

        The cache doubles when it grows, so a decoding loop rebuilds it ``log2(L)`` times. With
        learned frequencies the tables are computed from the parameter at each call (never stale).
        """
        length = check_int(length, "length", minimum=0)
        device = torch.device(device) if device is not None else self._cos.device
        if self.learned_freq:
            return self.rows(torch.arange(max(length, 1), device=device))
        if self._cos.shape[0] < length or self._cos.device != device:
            grown = 2 * self._cos.shape[0] if self._cos.device == device else 0
            size = max(length, min(grown, self.cache_limit), 16)
            self._cos, self._sin = self.rows(torch.arange(size, device=device))
        return self._cos, self._sin

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` at integer ``positions`` (any shape), each ``positions.shape + (rotary_dim/2,)``, in ``dtype``.

        The angles are formed in float64 and rounded once to ``dtype``. With a length-dependent
        scaling (``dynamic``, ``longrope``) the frequencies are first brought to the length
        ``positions.max() + 1`` (see :func:`ropelib.scaling.frequency_seq_len`). With
        ``positions="continuous"``, any finite real positions (floating tensors too).
        """
        if self.position_kind == "continuous":
            positions = check_continuous_positions(positions, "positions", batch=None, seq_len=None)
            return self.rows(positions, check_float_dtype(dtype))
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
            >>> config = {
            ...     "hidden_size": 64, "num_attention_heads": 4,
            ...     "rope_theta": 500000.0, "max_position_embeddings": 4096,
            ...     "rope_scaling": {"rope_type": "linear", "factor": 2.0},
            ... }
            >>> rope = RotaryEmbedding.from_config(config)
            >>> rope.head_dim, rope.theta, rope.scaling
            (16, 500000.0, {'rope_type': 'linear', 'factor': 2.0})
        """
        options = rope_config(config)
        return cls(layout=layout, backend=backend, **options)

    def check_qk(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor | None:
        """Validate ``q``, ``k`` and ``positions``; return the positions as int64 on ``q``'s device (or None)."""
        return self._check_qk(q, k, positions)[0]

    def _check_qk(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, tuple[int, int] | None]:
        """:meth:`check_qk`, with the smallest and largest position when they were read (see :mod:`ropelib._validation`)."""
        check_qk(q, k, head_dim=self.head_dim)
        if positions is None:
            return None, None
        if self.position_kind == "continuous":
            positions = check_continuous_positions(positions, "positions", batch=q.shape[0], seq_len=q.shape[1])
            bounds = None
        else:
            positions = check_positions(positions, "positions", batch=q.shape[0], seq_len=q.shape[1], minimum=None)
            bounds = check_position_range(positions, "positions", minimum=0)
        return (positions if positions.device == q.device else positions.to(q.device)), bounds

    def tables_for(
        self,
        positions: torch.Tensor | None,
        seq_len: int,
        device: torch.device,
        dtype: torch.dtype,
        bounds: tuple[int, int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(cos, sin, rows)`` for the kernels: a ``[L, r/2]`` table and the row of each token (None: ``0 .. seq-1``).

        Validated ``positions`` (int64, or floating for ``positions="continuous"``, on ``device``) or
        None; ``bounds``, their smallest and largest value if the caller has read them. Reads position
        values only where that is free (see the module docstring). Floating positions and learned
        frequencies always get rows computed for them.
        """
        if self._follows_length:  # dynamic / longrope: the length is read on the host, as transformers does
            needed = seq_len if positions is None or positions.numel() == 0 else int(positions.max()) + 1
            self._follow_length(needed)
        if dtype == torch.float64 or self.learned_freq or (positions is not None and positions.is_floating_point()):
            if positions is None:
                positions = torch.arange(seq_len, device=device)
            cos, sin = self.rows(positions, dtype)
            return cos.reshape(-1, cos.shape[-1]), sin.reshape(-1, sin.shape[-1]), self._row_index(positions)
        if torch.compiler.is_compiling():
            positions = torch.arange(seq_len, device=device) if positions is None else positions
        elif positions is None:
            cos, sin = self.cos_sin_cache(max(seq_len, 1), device)
            return cos, sin, None
        else:
            bounds = bounds or self._readable_bounds(positions)
            if bounds is not None and bounds[0] >= 0 and bounds[1] < self.cache_limit:
                cos, sin = self.cos_sin_cache(bounds[1] + 1, device)
                return cos, sin, positions
        cos, sin = self.rows(positions)
        return cos.reshape(-1, cos.shape[-1]), sin.reshape(-1, sin.shape[-1]), self._row_index(positions)

    @staticmethod
    def _readable_bounds(positions: torch.Tensor) -> tuple[int, int] | None:
        """``(min, max)`` of ``positions`` when they can be read for free (eager, CPU, not empty), else None."""
        return check_position_range(positions, "positions", minimum=None) if values_readable(positions) else None

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
        seqlen_offsets: int | torch.Tensor = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if cu_seqlens is not None:
            if not no_offsets(seqlen_offsets):
                raise ValueError("give seqlen_offsets or cu_seqlens, not both: cu_seqlens defines the positions")
            return self.rotate_packed(q, k, positions, cu_seqlens)
        checked, bounds = self._check_qk(q, k, positions)
        if seqlen_offsets is not None and not (type(seqlen_offsets) is int and seqlen_offsets == 0):
            if checked is not None:
                raise ValueError("give positions or seqlen_offsets, not both: the offsets shift the default positions")
            checked = offset_positions(seqlen_offsets, q.shape[0], q.shape[1], q.device)
        return self.rotate(q, k, checked, bounds=bounds)

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
        if q.dtype == torch.float64 or self._follows_length or self._differentiable_tables():  # explicit positions
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
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor | None, *, bounds: tuple[int, int] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The module's call without argument checks, for callers that ran :meth:`check_qk` (attention layers, xPos).

        ``bounds``: the smallest and largest position, if the caller has read them (else they are
        read here when that is free).
        """
        batch, seq = q.shape[:2]
        kernel = kernel_for(self.backend, q.device)
        if self._few_path(q, k, kernel):
            wide = self._wide_rows(positions, seq, q.device, bounds)
            if wide is not None:
                return native_kernel.rotate_few(q, k, *wide)
        compute = torch.float64 if q.dtype == torch.float64 else torch.float32
        cos, sin, rows = self.tables_for(positions, seq, q.device, compute, bounds)
        if q.dtype == torch.float64 or self._differentiable_tables():  # plain differentiable operations
            rows = torch.arange(seq, device=q.device) if rows is None else rows
            cos, sin = cos[rows], sin[rows]
            return rotate(q, cos, sin, self.layout), rotate(k, cos, sin, self.layout)
        rows = torch.arange(seq, device=q.device) if rows is None else rows
        q = q if q.stride(-1) == 1 else q.contiguous()
        k = k if k.stride(-1) == 1 else k.contiguous()
        return rotate_qk(
            q, k, cos, sin, rows.expand(batch, seq), interleaved=self.layout == "interleaved", kernel=kernel
        )

    def _few_path(self, q: torch.Tensor, k: torch.Tensor, kernel: str) -> bool:
        """True for a call that :func:`~ropelib.kernels.native_kernel.rotate_few` serves: a few float32 tokens
        in eager inference, the PyTorch kernel, the "half" layout, every feature rotated, fixed frequencies."""
        return (
            kernel == "torch"
            and self._few_options
            and few_elements(q, k, self.rotary_dim, torch.float32, False)
            and not torch.compiler.is_compiling()
            and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad))
        )

    def _wide_rows(
        self, positions: torch.Tensor | None, seq: int, device: torch.device, bounds: tuple[int, int] | None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Rows of the cached :func:`~ropelib.kernels.torch_kernel.wide_table` for ``positions``, or None where the
        cache cannot serve them without reading a device (the general path then computes them)."""
        wide = self._wide
        if positions is not None and bounds is not None and bounds[0] == bounds[1]:  # one position: decoding
            if wide is not None and 0 <= bounds[0] < wide.shape[0] and wide.device == device:
                return split_wide(wide[bounds[0]])
        if positions is None:
            bounds = (0, seq - 1)
        elif positions.is_floating_point():
            return None
        else:
            bounds = bounds or self._readable_bounds(positions)
        if bounds is None or bounds[0] < 0 or bounds[1] >= self.cache_limit:
            return None
        if wide is None or bounds[1] >= wide.shape[0] or wide.device != device:
            cos, sin = self.cos_sin_cache(bounds[1] + 1, device)
            wide = self._wide = wide_table(cos, sin)  # forgotten with the cache (_forget_tables)
        if positions is None:
            return split_wide(wide[:seq].unsqueeze(-3))  # [seq, 1, r]: over batch and heads
        if bounds[0] == bounds[1]:
            return split_wide(wide[bounds[0]])
        rows = wide.index_select(0, positions.reshape(-1))
        return split_wide(rows.view(*positions.shape, 1, *rows.shape[1:]))

    def _differentiable_tables(self) -> bool:
        """True when the tables carry a gradient (learned frequencies, recording): the kernels would drop it."""
        return self.learned_freq and torch.is_grad_enabled() and self.learned_inv_freq.requires_grad

    def extra_repr(self) -> str:
        extra = "".join(
            f", {name}={value!r}"
            for name, value, default in (
                ("theta_rescale_factor", self.theta_rescale_factor, 1.0),
                ("freqs_for", self.freqs_for, "lang"),
                ("positions", self.position_kind, "integer"),
                ("learned_freq", self.learned_freq, False),
            )
            if value != default
        )
        return (
            f"head_dim={self.head_dim}, rotary_dim={self.rotary_dim}, theta={self.theta}, "
            f"layout={self.layout!r}, scaling={self.scaling}, backend={self.backend!r}{extra}"
        )
