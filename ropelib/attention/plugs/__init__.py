r"""How each position encoding enters attention: one small protocol (``base``), one class per encoding.

:data:`PLUGS` maps the ``position`` argument of :class:`~ropelib.MultiHeadAttention` to its plug;
a new encoding is one class, in the module of its family, and one entry here.
"""

from __future__ import annotations

from types import MappingProxyType

from .base import AttentionLayer, PositionPlug, relative_from_positions
from .classic import AlibiPlug, LearnedPlug, RotaryPlug, ShawPlug, SinusoidalPlug, T5Plug
from .decay import XPosPlug
from .frequency import FoPEPlug, PRopePlug, ResonancePlug
from .hybrid import ChunkedRotaryPlug, SlidingRotaryPlug, TemperaturePlug
from .learned import CopePlug, FirePlug, KerpleLogPlug, KerplePowerPlug
from .lie import ComRoPEPlug, LieREPlug
from .mixed import RopeMixedPlug
from .remap import DualChunkPlug, LeakyReRoPEPlug, ReRoPEPlug, SelfExtendPlug

#: ``position`` name -> plug class, one entry per encoding of :class:`~ropelib.MultiHeadAttention`
#: (:data:`~ropelib.attention.mha.POSITION_ENCODINGS` lists the same names, in this order).
PLUGS: MappingProxyType[str, type[PositionPlug]] = MappingProxyType(
    {
        "none": PositionPlug,
        "sinusoidal": SinusoidalPlug,
        "learned": LearnedPlug,
        "t5": T5Plug,
        "alibi": AlibiPlug,
        "shaw": ShawPlug,
        "rope": RotaryPlug,
        "rope_chunked": ChunkedRotaryPlug,
        "rope_swa": SlidingRotaryPlug,
        "nope_temperature": TemperaturePlug,
        "comrope": ComRoPEPlug,
        "liere": LieREPlug,
        "rope_mixed": RopeMixedPlug,
        "kerple_log": KerpleLogPlug,
        "kerple_power": KerplePowerPlug,
        "fire": FirePlug,
        "cope": CopePlug,
        "p_rope": PRopePlug,
        "resonance_rope": ResonancePlug,
        "fope": FoPEPlug,
        "rerope": ReRoPEPlug,
        "leaky_rerope": LeakyReRoPEPlug,
        "self_extend": SelfExtendPlug,
        "dual_chunk": DualChunkPlug,
        "xpos": XPosPlug,
    }
)

__all__ = ["PLUGS", "AttentionLayer", "PositionPlug", "relative_from_positions"]
