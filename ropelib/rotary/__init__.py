"""Rotary position embeddings: RoPE and its variants, one module each, over one spec, one cache and one operator.

* :mod:`~ropelib.rotary.spec`: :class:`~ropelib.RopeSpec`, the frequencies as one immutable value;
* :mod:`~ropelib.rotary.cache`: :class:`~ropelib.TableCache`, the cos/sin rows of a spec per device and dtype;
* :mod:`~ropelib.rotary.standard`: :class:`~ropelib.RotaryEmbedding` (RoPE);
* :mod:`~ropelib.rotary.rotation`: :class:`~ropelib.Rotation`, one forward pass's tables for every layer;
* the variants, each stating only what differs: :mod:`~ropelib.rotary.mrope` (M-RoPE, three
  position axes), :mod:`~ropelib.rotary.xpos` (xPos, a decay) and :mod:`~ropelib.rotary.axial`
  (2-D axial RoPE for image patches).
"""

from .axial import AxialRotaryEmbedding, axial_positions
from .cache import CACHE_POSITIONS, TableCache, Tables
from .mrope import MRotaryEmbedding, mrope_axes, mrope_positions
from .rotation import Rotation
from .spec import FREQS_FOR, RopeSpec
from .standard import RotaryEmbedding
from .xpos import XPos, xpos_decay_rates

__all__ = [
    "CACHE_POSITIONS",
    "FREQS_FOR",
    "AxialRotaryEmbedding",
    "MRotaryEmbedding",
    "RopeSpec",
    "RotaryEmbedding",
    "Rotation",
    "TableCache",
    "Tables",
    "XPos",
    "axial_positions",
    "mrope_axes",
    "mrope_positions",
    "xpos_decay_rates",
]
