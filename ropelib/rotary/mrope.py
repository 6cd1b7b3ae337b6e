r"""Multimodal RoPE (M-RoPE; Qwen2-VL, Wang et al., 2024, section 2.1): three position axes, one rotation.

Every token has three positions ``(t, h, w)`` (time, height, width). Text tokens have the same
index on all three axes, so for text M-RoPE is plain 1-D RoPE; an image of ``T x H x W`` patches
placed after ``n`` positions gets ``(n + i, n + j, n + k)`` for patch ``(i, j, k)``, and the next
text token continues at one more than the largest index used so far (:func:`~ropelib.mrope_positions`).

The ``d_rot/2`` frequency pairs are shared out among the axes by ``mrope_section = (s_t, s_h, s_w)``
(``s_t + s_h + s_w = d_rot/2``); pair ``i`` of a token is rotated by the token's position
``p_{a(i)}`` on the axis ``a(i)`` of that pair:

.. math:: \text{angle}_i = p_{a(i)} \cdot \theta_i, \qquad \theta_i = \mathrm{base}^{-2i/d_{\mathrm{rot}}}\ (\text{or a scaling's}),

* Qwen2-VL / Qwen2.5-VL (``interleaved=False``): contiguous sections, pairs ``0 .. s_t-1`` to
  time, the next ``s_h`` to height, the last ``s_w`` to width;
* Qwen3-VL (``interleaved=True``): pair ``i`` goes to height if ``i % 3 == 1`` and ``i < 3 s_h``,
  to width if ``i % 3 == 2`` and ``i < 3 s_w``, to time otherwise.

The angles are formed in float64 and rounded once to float32 per token (:func:`mrope_tables`);
the rotation (:class:`MRotaryEmbedding`) hands ropelib's kernels a ``[tokens, d_rot/2]`` table with
one row per token, so M-RoPE runs on the same fused kernels as 1-D RoPE.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from .._validation import check_bool, check_choice, check_int, check_integer_tensor, check_position_range, check_qk
from ..kernels.door import rotate_token_tables
from ..layouts import LAYOUTS
from .standard import RotaryEmbedding

#: The number of position axes: time, height, width.
AXES = 3


def _check_section(mrope_section: object, pairs: int | None = None) -> tuple[int, int, int]:
    """``mrope_section`` as three non-negative ints, summing to ``pairs`` when given."""
    if isinstance(mrope_section, (str, bytes)) or not isinstance(mrope_section, Sequence):
        raise TypeError(f"mrope_section must be a sequence of 3 ints, got {type(mrope_section).__name__}")
    if len(mrope_section) != AXES:
        raise ValueError(f"mrope_section must have 3 entries (time, height, width), got {list(mrope_section)}")
    section = tuple(check_int(s, f"mrope_section[{i}]", minimum=0) for i, s in enumerate(mrope_section))
    if pairs is not None and sum(section) != pairs:
        raise ValueError(
            f"mrope_section must sum to rotary_dim / 2 = {pairs}, got {list(section)} (sum {sum(section)})"
        )
    return section[0], section[1], section[2]


def mrope_axes(mrope_section: Sequence[int], *, interleaved: bool = False) -> torch.Tensor:
    """The axis (0 time, 1 height, 2 width) of each of the ``d_rot/2 = sum(mrope_section)`` frequency pairs, int64 ``[d_rot/2]``.

    Example:
        >>> mrope_axes([2, 1, 1]).tolist()
        [0, 0, 1, 2]
        >>> mrope_axes([2, 1, 1], interleaved=True).tolist()
        [0, 1, 2, 0]
    """
    section = _check_section(mrope_section)
    check_bool(interleaved, "interleaved")
    pairs = sum(section)
    if not interleaved:
        return torch.repeat_interleave(torch.arange(AXES), torch.tensor(section))
    index = torch.arange(pairs)
    axes = torch.zeros(pairs, dtype=torch.long)
    for axis in (1, 2):
        axes[(index % 3 == axis) & (index < 3 * section[axis])] = axis
    return axes


def mrope_positions(segments: Sequence[int | Sequence[int]], *, spatial_merge_size: int = 1) -> torch.Tensor:
    """The ``[3, N]`` (time, height, width) positions of a sequence of text runs and image grids (Qwen2-VL's ``get_rope_index``).

    Args:
        segments: in order, an ``int`` ``n`` for a run of ``n`` text tokens, or a ``(t, h, w)``
            grid of vision patches (as in ``image_grid_thw``).
        spatial_merge_size: the vision tower merges ``m x m`` patches into one token
            (Qwen2-VL: 2), so a grid stands for ``t x (h/m) x (w/m)`` tokens; ``h`` and ``w`` must
            be divisible by ``m``.

    A text token at offset ``j`` of a run starting at ``n`` has position ``n + j`` on all three
    axes; the token for patch ``(i, j, k)`` of a grid starting at ``n`` has ``(n + i, n + j, n + k)``,
    in row-major order ``(t, h, w)``. Each segment starts at one more than the largest position before it
    (Qwen2-VL's release; ``transformers`` 5 advances by ``max(h, w)`` after a grid, the same for
    images, ``t = 1``, and for videos of at most ``max(h, w)`` frames). Qwen2.5-VL's scaled time
    steps of videos are not modelled.

    Returns:
        int64 tensor ``[3, N]``, ``N`` the number of tokens.

    Example:
        >>> mrope_positions([2, (1, 2, 2), 1]).tolist()
        [[0, 1, 2, 2, 2, 2, 4], [0, 1, 2, 2, 3, 3, 4], [0, 1, 2, 3, 2, 3, 4]]
    """
    if isinstance(segments, (str, bytes)) or not isinstance(segments, Sequence):
        raise TypeError(f"segments must be a sequence of ints and (t, h, w) grids, got {type(segments).__name__}")
    merge = check_int(spatial_merge_size, "spatial_merge_size", minimum=1)
    parts, start = [], 0
    for i, segment in enumerate(segments):
        if isinstance(segment, Sequence) and not isinstance(segment, (str, bytes)):
            if len(segment) != AXES:
                raise ValueError(f"segments[{i}] must be a (t, h, w) grid, got {list(segment)}")
            t, h, w = (check_int(v, f"segments[{i}][{a}]", minimum=1) for a, v in enumerate(segment))
            if h % merge or w % merge:
                raise ValueError(f"segments[{i}]'s h={h} and w={w} must be divisible by spatial_merge_size={merge}")
            h, w = h // merge, w // merge
            grid = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij"))
            parts.append(grid.reshape(AXES, -1) + start)
            start += max(t, h, w)
        else:
            n = check_int(segment, f"segments[{i}]", minimum=0)
            parts.append((torch.arange(n) + start).expand(AXES, n))
            start += n
    if not parts:
        return torch.zeros(AXES, 0, dtype=torch.long)
    return torch.cat(parts, dim=1)


def mrope_tables(
    inv_freq64: torch.Tensor,
    positions: torch.Tensor,
    axes: torch.Tensor,
    attention_scaling: float = 1.0,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""``cos`` and ``sin`` of ``positions[axes[i]] * inv_freq[i]`` (float64, then ``dtype``), unchecked.

    Args:
        inv_freq64: float64 ``[d_rot/2]`` on ``positions``' device.
        positions: integers ``[3, *shape]``.
        axes: the axis of each pair (:func:`~ropelib.mrope_axes`), ``[d_rot/2]``.
        attention_scaling: multiplies cos and sin.

    Returns:
        ``(cos, sin)``, each ``shape + (d_rot/2,)``.
    """
    angles = positions.to(torch.float64)[..., None] * inv_freq64  # [3, *shape, r/2]
    index = axes.to(positions.device).expand(*angles.shape[1:])[None]
    angles = angles.gather(0, index)[0]
    cos, sin = angles.cos(), angles.sin()
    if attention_scaling != 1.0:
        cos, sin = cos * attention_scaling, sin * attention_scaling
    return cos.to(dtype), sin.to(dtype)


class MRotaryEmbedding(nn.Module):
    r"""M-RoPE: rotates queries and keys by three-axis positions (see the module docstring).

    ``head_dim``, ``theta``, ``rotary_dim``, ``scaling`` and ``max_position_embeddings`` are as
    for :class:`ropelib.RotaryEmbedding` (its frequencies and scalings are used; the
    length-following ``dynamic`` and ``longrope`` are not supported).

    Args:
        mrope_section: ``(s_t, s_h, s_w)``, summing to ``rotary_dim / 2``.
        interleaved: Qwen3-VL's interleaved assignment of pairs to axes (else Qwen2-VL's contiguous sections).
        layout: ``"half"`` (Qwen2-VL in ``transformers``) or ``"interleaved"``.
        kernel: ``"auto"``, ``"torch"``, ``"native"`` or ``"triton"`` (:func:`~ropelib.choose_kernel`).

    Shapes:
        ``forward(q, k, positions)``: ``q`` ``[batch, seq, q_heads, head_dim]``, ``k``
        ``[batch, seq, kv_heads, head_dim]``, ``positions`` integers ``[3, seq]`` or
        ``[3, batch, seq]`` (>= 0). Returns the rotated ``(q, k)``.

    Example:
        >>> rope = MRotaryEmbedding(head_dim=8, mrope_section=[2, 1, 1])
        >>> q = k = torch.ones(1, 3, 2, 8)
        >>> # text: the same position on all three axes
        >>> positions = torch.tensor([[0, 1, 2]]).expand(3, 3)
        >>> plain = RotaryEmbedding(head_dim=8)(q, k)[0]
        >>> torch.allclose(rope(q, k, positions)[0], plain, atol=1e-6)
        True
    """

    def __init__(
        self,
        head_dim: int,
        theta: float = 10000.0,
        mrope_section: Sequence[int] = (16, 24, 24),
        *,
        interleaved: bool = False,
        layout: str = "half",
        rotary_dim: int | None = None,
        scaling: Mapping[str, Any] | None = None,
        max_position_embeddings: int | None = None,
        kernel: str = "auto",
    ) -> None:
        super().__init__()
        self.rope = RotaryEmbedding(
            head_dim,
            theta,
            check_choice(layout, "layout", LAYOUTS),
            rotary_dim,
            scaling=scaling,
            max_position_embeddings=max_position_embeddings,
            kernel=kernel,
        )
        if self.rope.spec.follows_length:
            raise ValueError("scaling must not be 'dynamic' or 'longrope' (length-following) for M-RoPE")
        self.mrope_section = _check_section(mrope_section, self.rope.rotary_dim // 2)
        self.interleaved = check_bool(interleaved, "interleaved")
        self.axes = mrope_axes(self.mrope_section, interleaved=interleaved)

    @property
    def layout(self) -> str:
        return self.rope.layout

    @property
    def kernel(self) -> str:
        return self.rope.kernel

    def check_positions(self, positions: object, batch: int | None = None, seq_len: int | None = None) -> torch.Tensor:
        """Validate three-axis ``positions`` (``[3, seq]`` or ``[3, batch, seq]``); int64, always ``[3, batch or 1, seq]``."""
        positions = check_integer_tensor(positions, "positions")
        if positions.ndim not in (2, 3) or positions.shape[0] != AXES:
            raise ValueError(f"positions must have shape [3, seq] or [3, batch, seq], got {list(positions.shape)}")
        positions = positions.long() if positions.ndim == 3 else positions.long()[:, None]
        if seq_len is not None and positions.shape[-1] != seq_len:
            raise ValueError(f"positions must have {seq_len} positions per axis (seq_len), got {positions.shape[-1]}")
        if batch is not None and positions.shape[1] not in (1, batch):
            raise ValueError(f"positions must have batch 1 or {batch}, got {positions.shape[1]}")
        check_position_range(positions, "positions")
        return positions

    def tables(self, positions: torch.Tensor, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` ``[*positions.shape[1:], d_rot/2]`` for validated ``[3, ...]`` positions, in ``dtype``."""
        inv = self.rope.cache.inv_freq.to(positions.device)
        return mrope_tables(inv, positions, self.axes, self.rope.attention_scaling, dtype)

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        check_qk(q, k, head_dim=self.rope.head_dim)
        batch, seq = q.shape[:2]
        positions = self.check_positions(positions, batch, seq).to(q.device)
        compute = torch.float64 if q.dtype == torch.float64 else torch.float32
        cos, sin = self.tables(positions, compute)  # [1 or batch, seq, r/2]
        return rotate_token_tables(q, k, cos, sin, interleaved=self.layout == "interleaved", kernel=self.kernel)

    def extra_repr(self) -> str:
        return f"mrope_section={list(self.mrope_section)}, interleaved={self.interleaved}, {self.rope.extra_repr()}"
