r"""Move cached keys to other positions without the unrotated keys: :func:`~ropelib.rerotate_keys`.

RoPE's rotations form a group, :math:`R(p + \delta) = R(\delta) R(p)` (each pair turns by
:math:`(p + \delta) f_i = \delta f_i + p f_i`), so a key stored already rotated to position ``p``
moves to ``p + δ`` by one more rotation, by ``δ``, and equals the key encoded at ``p + δ`` up to
rounding. A sink cache (StreamingLLM, Xiao et al., 2024; transformers' ``SinkCache``) does this
when it evicts tokens: the window it keeps slides down to contiguous positions.

The frequencies are the module's own (any scaling); the factor on cos and sin that some scalings
apply (YaRN's attention factor ``a``) is left out of the shift: ``a R(p + δ) = R(δ) (a R(p))``.
The identity needs the same frequencies at ``p`` and at ``p + δ``: with a scaling whose
frequencies follow the length (dynamic NTK, LongRoPE), keys encoded before the frequencies last
changed are rotated by other ones, and no shift makes them equal to keys encoded now.
"""

from __future__ import annotations

import numbers

import torch

from .._validation import check_bool, check_choice, check_float_tensor, check_positions
from ..frequencies import angle_tables
from ..kernels.aliasing import check_inplace
from ..kernels.door import TENSOR_FORMATS, check_kernel, rotate
from ..rotary import RotaryEmbedding
from ..rotary.cache import table_dtype


def _shift_rows(
    shift: object, rope: RotaryEmbedding, keys: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(cos, sin, rows)``: the tables of the rotations by ``shift`` (factor 1) and the row of each token."""
    batch, seq = keys.shape[:2]
    if rope.learned_freq:
        inv_freq = rope.learned_inv_freq.detach().to(device=keys.device, dtype=torch.float64)
    else:
        inv_freq = rope.cache.inv_freq.to(keys.device)
    if isinstance(shift, numbers.Integral) and not isinstance(shift, bool):
        shifts = torch.full((1,), int(shift), dtype=torch.long, device=keys.device)
        rows = torch.zeros(1, dtype=torch.long, device=keys.device).expand(seq)  # one rotation for every token
    elif isinstance(shift, torch.Tensor):
        shifts = check_positions(shift, "shift", batch=batch, seq_len=seq, minimum=None, expand=False)
        shifts = shifts.to(keys.device)
        rows = torch.arange(shifts.numel(), device=keys.device).view(shifts.shape)
    else:
        raise TypeError(f"shift must be an int or an integer tensor [seq] or [batch, seq], got {type(shift).__name__}")
    cos, sin = angle_tables(inv_freq, shifts.reshape(-1), 1.0, table_dtype(keys.dtype))
    return cos, sin, rows


def rerotate_keys(
    keys: torch.Tensor,
    shift: int | torch.Tensor,
    *,
    rope: RotaryEmbedding,
    inplace: bool = False,
    tensor_format: str = "bshd",
) -> torch.Tensor:
    r"""Keys rotated by ``rope`` at positions ``p``, moved to ``p + shift``: ``R(shift) k`` (see the module docstring).

    Args:
        keys: ``[batch, seq, heads, head_dim]`` (``[seq, batch, ...]`` with ``tensor_format="sbhd"``),
            rotated by ``rope`` (its layout and ``rotary_dim``; the rest of each head is kept).
        shift: an int (any sign) for every token, or an integer tensor ``[seq]``, ``[1, seq]`` or
            ``[batch, seq]`` of per-token shifts. The angles ``shift * f`` are formed in float64.
        rope: the :class:`~ropelib.RotaryEmbedding` that rotated the keys; its frequencies in use
            now (a length-following scaling's may have changed since: see the module docstring).
        inplace: overwrite ``keys`` (a view of a cache, say) and return it.
        tensor_format: ``"bshd"`` or ``"sbhd"``, as for :func:`~ropelib.rotary_qk`.

    Returns:
        The moved keys, in ``keys``' shape and dtype (``keys`` itself in place).

    Example:
        >>> from ropelib import RotaryEmbedding
        >>> rope = RotaryEmbedding(8)
        >>> k = torch.randn(1, 3, 2, 8, dtype=torch.float64)
        >>> _, at_5 = rope(k, k, torch.arange(5, 8))
        >>> _, at_2 = rope(k, k, torch.arange(2, 5))
        >>> torch.allclose(rerotate_keys(at_5, -3, rope=rope), at_2)
        True
    """
    if not isinstance(rope, RotaryEmbedding):
        raise TypeError(f"rope must be a ropelib.RotaryEmbedding, got {type(rope).__name__}")
    keys = check_float_tensor(keys, "keys", ndim=4)
    if keys.shape[-1] != rope.head_dim:
        raise ValueError(f"keys must have head_dim={rope.head_dim} (the rope's) last, got shape {tuple(keys.shape)}")
    seq_first = check_choice(tensor_format, "tensor_format", TENSOR_FORMATS) == "sbhd"
    check_bool(inplace, "inplace")
    view = keys.transpose(0, 1) if seq_first else keys
    cos, sin, rows = _shift_rows(shift, rope, view)
    # the keys go in q's place: the kernels tell an in-place call by q's storage, which an empty q lacks
    no_keys = view.new_empty((*view.shape[:2], 0, view.shape[3]))
    kernel = check_kernel(rope.kernel, keys.device, keys.dtype)
    if inplace:
        try:
            check_inplace(view, no_keys)
        except ValueError as error:  # its messages call the tensor q
            raise ValueError(f"keys (q below): {error}") from None
    moved, _ = rotate(
        view, no_keys, cos, sin, rows, interleaved=rope.layout == "interleaved", kernel=kernel, inplace=inplace
    )
    if inplace:
        return keys
    return moved.transpose(0, 1) if seq_first else moved
