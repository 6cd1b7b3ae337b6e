r"""Which features of a head form RoPE's rotated pairs, and how to move weights between the two conventions.

* ``"half"`` (GPT-NeoX, Hugging Face ``rotate_half``): pair ``i`` is ``(x[i], x[i + d_rot/2])``;
* ``"interleaved"`` (GPT-J, Meta's complex-number code, the seed): pair ``i`` is ``(x[2i], x[2i+1])``.

Both give the same scores once the projections are permuted to match
(:func:`~ropelib.convert_rotary_layout`).
"""

from __future__ import annotations

import torch

from ._validation import check_choice, check_even, check_float_tensor, check_int

#: Which features form a rotated pair. ``"half"`` pairs ``(i, i + d_rot/2)`` (GPT-NeoX, Hugging Face),
#: ``"interleaved"`` pairs ``(2i, 2i + 1)`` (GPT-J, Meta's LLaMA code, the seed post).
LAYOUTS = ("half", "interleaved")


def pair_features(per_pair: torch.Tensor, layout: str) -> torch.Tensor:
    """``[..., d_rot/2]`` per-pair values -> ``[..., d_rot]`` per-feature values (both features of a pair alike)."""
    if layout == "half":
        return torch.cat((per_pair, per_pair), dim=-1)
    return per_pair.repeat_interleave(2, dim=-1)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``(x1, x2) -> (-x2, x1)`` on the two halves of the last dimension (the ``"half"`` layout's 90° turn)."""
    x = check_float_tensor(x, "x")
    if x.ndim == 0 or x.shape[-1] % 2:
        raise ValueError(f"x must have an even last dimension (two halves), got shape {tuple(x.shape)}")
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


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
