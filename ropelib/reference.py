r"""The reference rotation: RoPE written plainly, the yardstick for every fast path.

For pair ``i`` of a head at position ``m`` with ``c = cos(m theta_i)``, ``s = sin(m theta_i)``:

.. math:: (x_a, x_b) \mapsto (x_a c - x_b s,\; x_b c + x_a s),

with the pairs of the layout (:mod:`ropelib.layouts`). The math runs in float32 (float64 for
float64 input), the result is rounded once to the input's dtype.
"""

from __future__ import annotations

import torch

from ._validation import check_choice, check_float_tensor, check_same_device
from .layouts import LAYOUTS


def _check_cos_sin(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """``cos``/``sin`` of shape ``[seq, d_rot/2]`` or ``[batch, seq, d_rot/2]`` matching ``x`` = ``[batch, seq, heads, d]``."""
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
    check_same_device("cos", cos, "x", x)
    check_same_device("sin", sin, "x", x)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, layout: str = "half") -> torch.Tensor:
    r"""Rotate the first ``2 * cos.shape[-1]`` features of ``x`` (the reference implementation).

    The math runs in float32 (float64 for float64 input); the result has ``x``'s dtype.

    Args:
        x: ``[batch, seq, heads, head_dim]`` floating tensor.
        cos: ``[seq, d_rot/2]`` or ``[batch, seq, d_rot/2]`` (from :func:`ropelib.cos_sin_table`).
        sin: the sine table, of ``cos``'s shape.
        layout: ``"half"`` or ``"interleaved"``.

    Returns:
        Tensor like ``x``.
    """
    x = check_float_tensor(x, "x", ndim=4)
    _check_cos_sin(x, cos, sin)
    return rotate(x, cos, sin, check_choice(layout, "layout", LAYOUTS))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: str) -> torch.Tensor:
    """:func:`~ropelib.apply_rotary` without argument checks, for callers that validated them."""
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
