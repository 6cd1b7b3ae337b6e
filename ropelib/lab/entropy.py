r"""Attention entropy of a trained lab model, and the log-n query scaling that aims to hold it fixed.

The entropy of query ``i``'s attention ``p_i`` is ``H_i = -sum_j p_ij ln p_ij`` (nats). Uniform
attention over the ``i + 1`` keys a causal query sees has ``H_i = ln(i + 1)``, so for attention that
stays spread out, entropy grows like ``ln n`` with the context: the dilution that motivates scaling
the logits with length. Log-n scaling (Chiang and Cholak, 2022; Su, 2021) multiplies query ``i`` by
``max(1, ln(i + 1) / ln L)`` (:func:`log_n_scale`); YaRN's temperature (Peng et al., 2024) multiplies
all logits by ``(0.1 ln s + 1)^2`` at extension factor ``s``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import cast

import torch

from .._validation import check_int
from .experiment import Block, TinyTransformer


def entropy(weights: torch.Tensor) -> torch.Tensor:
    r"""``-sum_j p_j ln p_j`` over the last dimension (``0 ln 0 = 0``), in nats.

    Example:
        >>> round(float(entropy(torch.full((4,), 0.25))), 6) == round(math.log(4), 6)
        True
    """
    logs = torch.where(weights > 0, weights.log(), torch.zeros_like(weights))
    return -(weights * logs).sum(-1)


def uniform_causal_entropy(length: int) -> float:
    """Mean over the queries of a causal sequence of ``length`` of ``ln(i + 1)``: uniform attention's entropy.

    Example:
        >>> uniform_causal_entropy(1), round(uniform_causal_entropy(2), 6) == round(math.log(2) / 2, 6)
        (0.0, True)
    """
    length = check_int(length, "length", minimum=1)
    return math.lgamma(length + 1) / length


def log_n_scale(length: int, train_length: int) -> torch.Tensor:
    """The per-query multiplier ``max(1, ln(i + 1) / ln L)``, float32 ``[length]`` (1 within the training length)."""
    length = check_int(length, "length", minimum=1)
    train_length = check_int(train_length, "train_length", minimum=2)
    ratio = torch.log(torch.arange(1, length + 1, dtype=torch.float64)) / math.log(train_length)
    return ratio.clamp(min=1.0).float()


@contextlib.contextmanager
def query_scale(model: TinyTransformer, scale: torch.Tensor | None) -> Iterator[None]:
    """Within the block, every layer's queries are multiplied by ``scale`` (``[seq]``, per position).

    A forward hook on each ``q_proj`` (before RoPE's rotation, which is linear, so the logits
    ``q_i . k_j`` are multiplied by ``scale[i]``; additive biases are not). ``None``: no change.
    """
    if scale is None:
        yield
        return
    if scale.ndim != 1:
        raise ValueError(f"scale must be 1-D [seq], got shape {tuple(scale.shape)}")

    def hook(module: torch.nn.Module, inputs: object, output: torch.Tensor) -> torch.Tensor:
        if output.shape[-2] != scale.shape[0]:
            raise ValueError(f"scale has {scale.shape[0]} positions, the input {output.shape[-2]}")
        return output * scale.to(output)[:, None]

    handles = [cast(Block, block).attn.q_proj.register_forward_hook(hook) for block in model.blocks]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@torch.no_grad()
def attention_entropy(model: TinyTransformer, tokens: torch.Tensor) -> list[float]:
    """Per layer, the mean over batch, heads and queries of the attention entropy on ``tokens`` ``[b, n]``.

    Each layer's input is captured in the model's own forward pass; its weights are the softmax of
    :meth:`~ropelib.MultiHeadAttention.scores` on that input (masked keys have weight 0).
    """
    inputs: list[torch.Tensor] = []
    layers = [cast(Block, block).attn for block in model.blocks]
    handles = [attn.register_forward_pre_hook(lambda module, args: inputs.append(args[0])) for attn in layers]
    try:
        model(tokens)
    finally:
        for handle in handles:
            handle.remove()
    return [float(entropy(attn.scores(x).softmax(-1)).mean()) for attn, x in zip(layers, inputs)]
