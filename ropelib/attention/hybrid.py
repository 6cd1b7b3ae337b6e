r"""Hybrid attention stacks: local RoPE layers interleaved with global NoPE layers.

* **iRoPE** (Llama 4, Meta 2025): every ``interval``-th layer (``4``) is global attention with no
  position encoding whose queries are scaled by the temperature of :func:`attention_temperature`;
  the others are RoPE layers with *chunked* attention (a query sees the keys of its own chunk of
  ``chunk_size`` positions).
* **RNoPE-SWA** (Yang et al., 2025, "Rope to Nope and Back Again"): every ``interval``-th layer is
  global NoPE attention; the others are RoPE layers with *sliding-window* attention (a query sees
  the last ``window`` positions).

This module holds the pieces that are not plugs: the temperature, the local masks, the modules the
plugs build (:class:`AttentionTemperature`, :class:`LocalRotary`) and the layer patterns
(:func:`hybrid_layers`). The plugs are in :mod:`ropelib.attention.plugs.hybrid`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

import torch
from torch import nn

from .._validation import check_choice, check_int, check_integer_tensor, check_positive_float
from ..rotary import RotaryEmbedding

#: The kinds of local attention of a hybrid's RoPE layers (Llama 4's chunks, RNoPE-SWA's window).
LOCAL_KINDS = ("chunk", "window")


def _check_position_tensor(positions: object, name: str = "positions") -> torch.Tensor:
    positions = check_integer_tensor(positions, name)
    if positions.ndim not in (1, 2):
        raise ValueError(f"{name} must have shape [seq] or [batch, seq], got {list(positions.shape)}")
    return positions.long()


def temperature_of(positions: torch.Tensor, floor_scale: int, attn_scale: float) -> torch.Tensor:
    """:func:`attention_temperature` without checks (``positions`` int64)."""
    steps = torch.div(positions + 1, floor_scale, rounding_mode="floor")  # exact integer floor
    return 1.0 + attn_scale * torch.log1p(steps.to(torch.float64))


def attention_temperature(positions: torch.Tensor, *, floor_scale: int = 8192, attn_scale: float = 0.1) -> torch.Tensor:
    r"""Llama 4's query temperature on its NoPE layers (``attn_temperature_tuning``).

    .. math::

        \tau(p) = 1 + \mathtt{attn\_scale} \, \log\Bigl(\Bigl\lfloor
        \frac{p + 1}{\mathtt{floor\_scale}} \Bigr\rfloor + 1\Bigr),

    with transformers' defaults ``floor_scale = 8192`` and ``attn_scale = 0.1``, ``p``
    the 0-based position (``p + 1`` tokens seen). The query at ``p`` is multiplied by ``tau(p)``:
    ``tau = 1`` for the first ``floor_scale - 1`` positions, then it grows by steps of
    ``floor_scale``. The floor is
    taken on integers, exactly; the result is float64 (the layer rounds it once to ``q``'s dtype).

    Args:
        positions: integer tensor of any shape (0-based).
        floor_scale: an integer >= 1.
        attn_scale: > 0.

    Example:
        >>> positions = torch.tensor([0, 2, 3, 7])
        >>> attention_temperature(positions, floor_scale=4).tolist()[1:3]
        [1.0, 1.0693147180559945]
    """
    positions = check_integer_tensor(positions, "positions").long()
    return temperature_of(
        positions, check_int(floor_scale, "floor_scale", minimum=1), check_positive_float(attn_scale, "attn_scale")
    )


def local_mask(positions: torch.Tensor, kind: str, size: int) -> torch.Tensor:
    """:func:`local_attention_mask` without checks (``positions`` int64 ``[seq]`` or ``[batch, seq]``)."""
    query, key = positions.unsqueeze(-1), positions.unsqueeze(-2)
    if kind == "chunk":
        return torch.div(query, size, rounding_mode="floor") != torch.div(key, size, rounding_mode="floor")
    return (query - key).abs() >= size


def local_attention_mask(positions: torch.Tensor, kind: str, size: int) -> torch.Tensor:
    r"""Where local attention masks a key: boolean ``[..., seq, seq]``, True = masked (as the causal mask).

    * ``"chunk"`` (Llama 4): query ``i`` sees key ``j`` iff ``floor(p_i / C) = floor(p_j / C)``;
    * ``"window"`` (sliding window): query ``i`` sees key ``j`` iff ``|p_i - p_j| < W``.

    Combined with the causal mask (``p_j <= p_i``) of a decoder layer; a query always sees itself.

    Args:
        positions: integers ``[seq]`` or ``[batch, seq]``.
        kind: ``"chunk"`` or ``"window"``.
        size: ``C`` or ``W``, >= 1.

    Example:
        >>> local_attention_mask(torch.arange(4), "chunk", 2).int().tolist()
        [[0, 0, 1, 1], [0, 0, 1, 1], [1, 1, 0, 0], [1, 1, 0, 0]]
    """
    positions = _check_position_tensor(positions)
    return local_mask(positions, check_choice(kind, "kind", LOCAL_KINDS), check_int(size, "size", minimum=1))


class AttentionTemperature(nn.Module):
    """The temperature of a NoPE layer of iRoPE (:func:`attention_temperature`), as a module with its settings.

    ``forward(positions)``: integer ``[seq]`` or ``[batch, seq]`` -> float64 ``tau`` of the same shape.
    """

    def __init__(self, floor_scale: int = 8192, attn_scale: float = 0.1) -> None:
        super().__init__()
        self.floor_scale = check_int(floor_scale, "floor_scale", minimum=1)
        self.attn_scale = check_positive_float(attn_scale, "attn_scale")

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return temperature_of(_check_position_tensor(positions), self.floor_scale, self.attn_scale)

    def extra_repr(self) -> str:
        return f"floor_scale={self.floor_scale}, attn_scale={self.attn_scale}"


class LocalRotary(nn.Module):
    """RoPE with local attention: a :class:`~ropelib.RotaryEmbedding` (``rotary``) and a chunk or window.

    ``mask(positions)``: :func:`local_attention_mask` of ``kind`` and ``size``.
    """

    def __init__(self, rotary: RotaryEmbedding, kind: str, size: int) -> None:
        super().__init__()
        if not isinstance(rotary, RotaryEmbedding):
            raise TypeError(f"rotary must be a RotaryEmbedding, got {type(rotary).__name__}")
        self.rotary = rotary
        self.kind = check_choice(kind, "kind", LOCAL_KINDS)
        self.size = check_int(size, "size", minimum=1)

    def mask(self, positions: torch.Tensor) -> torch.Tensor:
        return local_mask(_check_position_tensor(positions), self.kind, self.size)

    def extra_repr(self) -> str:
        return f"kind={self.kind!r}, size={self.size}"


def _interleaved(local: str, global_: str) -> Callable[[int, int], tuple[str, ...]]:
    def pattern(num_layers: int, interval: int) -> tuple[str, ...]:
        return tuple(global_ if (i + 1) % interval == 0 else local for i in range(num_layers))

    return pattern


#: Hybrid name -> ``pattern(num_layers, interval)``, which returns the ``position`` (plug name) of each layer.
HYBRIDS: Mapping[str, Callable[[int, int], tuple[str, ...]]] = MappingProxyType(
    {
        "irope": _interleaved("rope_chunked", "nope_temperature"),
        "rnope_swa": _interleaved("rope_swa", "none"),
    }
)


def hybrid_layers(name: str, num_layers: int, *, interval: int = 4) -> tuple[str, ...]:
    """Each layer's ``position`` (a key of :data:`~ropelib.attention.plugs.PLUGS`) in hybrid ``name``.

    Layer ``i`` (0-based) is the global NoPE layer when ``(i + 1) % interval == 0`` (Llama 4's
    ``no_rope_layer_interval = 4``: layers 3, 7, ...; RNoPE-SWA's one global layer in four), else
    the local RoPE layer.

    Example:
        >>> hybrid_layers("irope", 4)
        ('rope_chunked', 'rope_chunked', 'rope_chunked', 'nope_temperature')
    """
    name = check_choice(name, "name", tuple(HYBRIDS))
    return HYBRIDS[name](check_int(num_layers, "num_layers", minimum=1), check_int(interval, "interval", minimum=1))
