r"""Rotary position embedding (RoPE; Su et al., RoFormer, 2021).

Each pair of features ``(x_a, x_b)`` of a query or key at position ``m`` is rotated by the
angle ``m * inv_freq[i]``:

.. math::

    \begin{pmatrix} x_a' \\ x_b' \end{pmatrix} =
    \begin{pmatrix} \cos m\theta_i & -\sin m\theta_i \\ \sin m\theta_i & \cos m\theta_i \end{pmatrix}
    \begin{pmatrix} x_a \\ x_b \end{pmatrix},

so that ``<R_m q, R_n k>`` depends on ``m - n`` only. Which features form a pair is the
*layout*:

* ``"half"`` (GPT-NeoX, Hugging Face ``rotate_half``): pair ``i`` is ``(x[i], x[i + r/2])``;
* ``"interleaved"`` (GPT-J, Meta's complex-number code, the seed): pair ``i`` is ``(x[2i], x[2i+1])``.

Tensors are ``[batch, seq, heads, head_dim]``. With ``rotary_dim = r < head_dim`` only the first
``r`` features are rotated; the rest pass through unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ._validation import check_choice, check_even, check_float_tensor, check_int, check_positions, check_positive_float
from .frequencies import cos_sin_table, inverse_frequencies64
from .kernels import rotary_qk
from .scaling import frequency_seq_len, rope_config

#: Which features form a rotated pair. ``"half"`` pairs ``(i, i + r/2)`` (GPT-NeoX, Hugging Face),
#: ``"interleaved"`` pairs ``(2i, 2i + 1)`` (GPT-J, Meta's LLaMA code, the seed post).
LAYOUTS = ("half", "interleaved")
#: How :class:`RotaryEmbedding` computes the rotation. ``"auto"`` is the fused kernel on CUDA and
#: the PyTorch path elsewhere; ``"torch"`` and ``"triton"`` force one.
BACKENDS = ("auto", "torch", "triton")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``(x1, x2) -> (-x2, x1)`` on the two halves of the last dimension (the ``"half"`` layout's 90° turn)."""
    x = check_float_tensor(x, "x")
    if x.ndim == 0 or x.shape[-1] % 2:
        raise ValueError(f"x must have an even last dimension (two halves), got shape {tuple(x.shape)}")
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _check_cos_sin(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """``cos``/``sin`` of shape ``[seq, r/2]`` or ``[batch, seq, r/2]`` matching ``x`` = ``[batch, seq, heads, d]``."""
    check_float_tensor(cos, "cos")
    check_float_tensor(sin, "sin")
    if cos.shape != sin.shape:
        raise ValueError(f"cos and sin must have the same shape, got {tuple(cos.shape)} and {tuple(sin.shape)}")
    batch, seq = x.shape[0], x.shape[1]
    if cos.ndim not in (2, 3) or cos.shape[-2] != seq or (cos.ndim == 3 and cos.shape[0] != batch):
        raise ValueError(
            f"cos and sin must have shape [{seq}, r/2] or [{batch}, {seq}, r/2] for x of shape "
            f"{tuple(x.shape)}, got {tuple(cos.shape)}"
        )
    if 2 * cos.shape[-1] > x.shape[-1]:
        raise ValueError(f"cos has {cos.shape[-1]} pairs but x has only {x.shape[-1]} features (head_dim)")


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, layout: str = "half") -> torch.Tensor:
    r"""Rotate the first ``r = 2 * cos.shape[-1]`` features of ``x`` (the reference implementation).

    The math runs in float32 (float64 for float64 input); the result has ``x``'s dtype.

    Args:
        x: ``[batch, seq, heads, head_dim]`` floating tensor.
        cos, sin: ``[seq, r/2]`` or ``[batch, seq, r/2]`` (from :func:`ropelib.cos_sin_table`).
        layout: ``"half"`` or ``"interleaved"``.

    Returns:
        Tensor like ``x``.
    """
    x = check_float_tensor(x, "x", ndim=4)
    _check_cos_sin(x, cos, sin)
    layout = check_choice(layout, "layout", LAYOUTS)
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    r = 2 * cos.shape[-1]
    cos = cos.to(compute).unsqueeze(-2)  # [.., seq, 1, r/2]: broadcast over heads
    sin = sin.to(compute).unsqueeze(-2)
    rot, rest = x[..., :r].to(compute), x[..., r:]
    if layout == "half":
        a, b = rot[..., : r // 2], rot[..., r // 2 :]
        out = torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)
    else:
        a, b = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1).flatten(-2)
    return torch.cat((out.to(x.dtype), rest), dim=-1)


def layout_permutation(rotary_dim: int, src: str, dst: str) -> torch.Tensor:
    """Index ``perm`` such that ``features_dst = features_src[perm]`` within one head's rotated part.

    interleaved -> half: ``[0, 2, 4, ..., r-2, 1, 3, ..., r-1]``; half -> interleaved: its inverse.
    """
    rotary_dim = check_even(rotary_dim, "rotary_dim")
    src = check_choice(src, "src", LAYOUTS)
    dst = check_choice(dst, "dst", LAYOUTS)
    to_half = torch.cat((torch.arange(0, rotary_dim, 2), torch.arange(1, rotary_dim, 2)))
    if src == dst:
        return torch.arange(rotary_dim)
    return to_half if src == "interleaved" else torch.argsort(to_half)


def convert_rotary_layout(
    weight: torch.Tensor,
    num_heads: int,
    head_dim: int,
    *,
    src: str,
    dst: str,
    rotary_dim: int | None = None,
) -> torch.Tensor:
    """Permute a q or k projection so that a checkpoint for one RoPE layout works with the other.

    A linear layer ``y = W x`` whose output rows are ``num_heads`` blocks of ``head_dim``: within
    each block the first ``rotary_dim`` rows are reordered so that the pairs of ``src`` land where
    ``dst`` pairs them. Attention scores are then identical (the rotation commutes with the
    permutation, and ``q . k`` is invariant when both are permuted alike). This is the
    permutation Hugging Face applies when converting Meta's Llama weights.

    Args:
        weight: ``[num_heads * head_dim, in_features]`` (a weight) or ``[num_heads * head_dim]`` (a bias).
        num_heads, head_dim: the layer's head split.
        src, dst: ``"half"`` or ``"interleaved"``.
        rotary_dim: rotated features per head (``head_dim`` by default).

    Returns:
        A new tensor of the same shape and dtype.
    """
    weight = check_float_tensor(weight, "weight")
    num_heads = check_int(num_heads, "num_heads", minimum=1)
    head_dim = check_int(head_dim, "head_dim", minimum=2)
    rotary_dim = head_dim if rotary_dim is None else check_even(rotary_dim, "rotary_dim")
    if rotary_dim > head_dim:
        raise ValueError(f"rotary_dim must be <= head_dim={head_dim}, got {rotary_dim}")
    if weight.ndim not in (1, 2) or weight.shape[0] != num_heads * head_dim:
        raise ValueError(
            f"weight must have shape [{num_heads * head_dim}, in_features] or [{num_heads * head_dim}] "
            f"(num_heads * head_dim rows), got {tuple(weight.shape)}"
        )
    perm = torch.cat((layout_permutation(rotary_dim, src, dst), torch.arange(rotary_dim, head_dim)))
    blocks = weight.reshape(num_heads, head_dim, *weight.shape[1:])
    return blocks[:, perm.to(weight.device)].reshape(weight.shape).clone()


class RotaryEmbedding(nn.Module):
    r"""Rotates queries and keys by their positions; the cos/sin cache grows on demand.

    Args:
        head_dim: per-head width ``d``.
        theta: the frequency base (``inv_freq[i] = theta^{-2i/r}``).
        layout: ``"half"`` (GPT-NeoX / Hugging Face) or ``"interleaved"`` (GPT-J / Meta / the seed).
        rotary_dim: features rotated per head (``head_dim`` by default; even, <= ``head_dim``).
        scaling: a Hugging Face-style ``rope_scaling`` dict (see :mod:`ropelib.scaling`).
        max_position_embeddings: the context length the frequencies are built for (read by scalings).
        backend: ``"auto"``, ``"torch"`` or ``"triton"``.

    Shapes:
        ``forward(q, k, positions=None)``: ``q`` is ``[batch, seq, q_heads, head_dim]``, ``k`` is
        ``[batch, seq, kv_heads, head_dim]`` (the head counts may differ, as in GQA/MQA);
        ``positions`` are integers of shape ``[seq]`` or ``[batch, seq]`` (default ``0 .. seq-1``).
        Returns the rotated ``(q, k)`` in their dtypes; the angles are float64 rounded to float32.

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
        self.scaling = dict(scaling) if scaling is not None else None
        self.max_position_embeddings = max_position_embeddings
        self._inv_freq64, self.attention_scaling = inverse_frequencies64(
            self.rotary_dim, self.theta, self.scaling, max_position_embeddings=max_position_embeddings
        )
        # Plain attributes, not buffers: ``module.half()`` must not round the frequencies.
        self._cos = torch.empty(0, self.rotary_dim // 2)
        self._sin = torch.empty(0, self.rotary_dim // 2)
        self._freq_seq_len: int | None = None  # the seq_len of dynamic / longrope frequencies (None: original)

    @property
    def inv_freq(self) -> torch.Tensor:
        """The float32 inverse frequencies, ``[rotary_dim // 2]``."""
        return self._inv_freq64.to(torch.float32)

    def cos_sin_cache(self, length: int, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The float32 ``(cos, sin)`` tables for positions ``0 .. length-1`` or more, ``[L, rotary_dim/2]``.

        The cache doubles when it grows, so a decoding loop rebuilds it ``log2(L)`` times.
        """
        length = check_int(length, "length", minimum=0)
        device = torch.device(device) if device is not None else self._cos.device
        if self._cos.shape[0] < length or self._cos.device != device:
            size = max(length, 2 * self._cos.shape[0] if self._cos.device == device else 0, 16)
            positions = torch.arange(size, device=device)
            self._cos, self._sin = cos_sin_table(self._inv_freq64, positions, self.attention_scaling)
        return self._cos, self._sin

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` at ``positions`` (any shape), each ``positions.shape + (rotary_dim/2,)``.

        float32 tables come from the cache; float64 ones are computed afresh. With a length-dependent
        scaling (``dynamic``, ``longrope``) the frequencies are first brought to the length
        ``positions.max() + 1`` (see :func:`ropelib.scaling.frequency_seq_len`).
        """
        high = int(positions.max()) + 1 if positions.numel() else 0
        self._follow_length(high)
        if dtype == torch.float64:
            return cos_sin_table(self._inv_freq64, positions, self.attention_scaling, torch.float64)
        cos, sin = self.cos_sin_cache(high, positions.device)
        return cos[positions], sin[positions]

    def _follow_length(self, needed: int) -> None:
        """Recompute dynamic NTK / LongRoPE frequencies for a sequence of ``needed`` positions (as Hugging Face does)."""
        if self.scaling is None or needed == 0:
            return
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
            self._cos, self._sin = self._cos[:0], self._sin[:0]

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

    def check_qk(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        """Validate ``q``, ``k`` and ``positions``; return the positions as int64 ``[seq]`` or ``[batch, seq]``."""
        q = check_float_tensor(q, "q", ndim=4)
        k = check_float_tensor(k, "k", ndim=4)
        if q.shape[-1] != self.head_dim or k.shape[-1] != self.head_dim:
            raise ValueError(
                f"q and k must have head_dim={self.head_dim} as last dimension, got {tuple(q.shape)} and {tuple(k.shape)}"
            )
        if q.shape[:2] != k.shape[:2]:
            raise ValueError(f"q and k must share [batch, seq], got {tuple(q.shape)} and {tuple(k.shape)}")
        if q.dtype != k.dtype or q.device != k.device:
            raise ValueError(f"q and k must share dtype and device, got {q.dtype}/{q.device} and {k.dtype}/{k.device}")
        if positions is None:
            return torch.arange(q.shape[1], device=q.device)
        positions = check_positions(positions, "positions", batch=q.shape[0], seq_len=q.shape[1])
        return positions.to(q.device)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        given = positions is not None
        positions = self.check_qk(q, k, positions)
        if q.dtype != torch.float64:  # fused kernels (ropelib.kernels) for self.backend; float64 stays on the reference
            length = int(positions.max()) + 1 if given and positions.numel() else q.shape[1]
            self._follow_length(length)
            cos, sin = self.cos_sin_cache(max(length, 1), q.device)
            return rotary_qk(q, k, cos, sin, positions if given else None, layout=self.layout, kernel=self.backend)
        cos, sin = self.cos_sin(positions, torch.float64)
        return apply_rotary(q, cos, sin, layout=self.layout), apply_rotary(k, cos, sin, layout=self.layout)

    def extra_repr(self) -> str:
        return (
            f"head_dim={self.head_dim}, rotary_dim={self.rotary_dim}, theta={self.theta}, "
            f"layout={self.layout!r}, scaling={self.scaling}, backend={self.backend!r}"
        )
