r"""p-RoPE (Barbero et al., 2025, "Round and Round We Go! What makes Rotary Positional Encodings useful?").

RoPE with only the fraction ``p`` of its *highest* frequencies kept: pair ``i`` of ``d/2`` turns by

.. math:: \theta_i = \begin{cases} \mathrm{base}^{-2i/d} & i < \lfloor p d / 2 \rfloor \\ 0 & \text{otherwise,} \end{cases}

so the lowest ``1 - p`` of the pairs are not rotated at all: position-free ("semantic") channels,
while the rotated pairs keep RoPE's frequencies and its relative property. ``p = 1`` is RoPE,
``p = 0`` is NoPE. This is exactly transformers' ``rope_type="proportional"`` (Gemma-family
configs; :func:`~ropelib.scaling.proportional.proportional_scaling`) with ``factor = 1``: the same
count ``int(p d // 2)``, the same end truncated (the low frequencies), the truncated pairs kept
unrotated rather than dropped. So :class:`PRotaryEmbedding` is a :class:`~ropelib.RotaryEmbedding`
with that scaling: the same spec, table cache, operator and kernels.
"""

from __future__ import annotations

import math
import numbers

from .standard import RotaryEmbedding


def check_fraction(value: object, name: str) -> float:
    """A real number in ``[0, 1]`` (a fraction of the pairs)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number in [0, 1], got {type(value).__name__}")
    if not (math.isfinite(float(value)) and 0.0 <= float(value) <= 1.0):
        raise ValueError(f"{name} must be in [0, 1], got {float(value)}")
    return float(value)


def p_rope_scaling(p: float) -> dict[str, object]:
    """The ``rope_scaling`` dict of p-RoPE: ``{"rope_type": "proportional", "partial_rotary_factor": p}``.

    Example:
        >>> p_rope_scaling(0.25)
        {'rope_type': 'proportional', 'partial_rotary_factor': 0.25}
    """
    return {"rope_type": "proportional", "partial_rotary_factor": check_fraction(p, "p")}


class PRotaryEmbedding(RotaryEmbedding):
    r"""p-RoPE (Barbero et al., 2025): RoPE whose lowest ``1 - p`` of the frequencies are set to zero.

    Args:
        head_dim: per-head width ``d`` (even); every pair is either rotated or kept as it is.
        p: the fraction of the pairs that rotate, in ``[0, 1]`` (``int(p d // 2)`` pairs, the fastest).
        theta: RoPE's base.
        layout: ``"half"`` or ``"interleaved"``.
        max_position_embeddings, kernel: as :class:`~ropelib.RotaryEmbedding`.

    Shapes:
        as :class:`~ropelib.RotaryEmbedding`.

    Example:
        >>> rope = PRotaryEmbedding(8, p=0.5)
        >>> [round(f, 4) for f in rope.inv_freq.tolist()]
        [1.0, 0.1, 0.0, 0.0]
    """

    def __init__(
        self,
        head_dim: int,
        p: float = 0.75,
        theta: float = 10000.0,
        layout: str = "half",
        *,
        max_position_embeddings: int | None = None,
        kernel: str = "auto",
    ) -> None:
        super().__init__(
            head_dim,
            theta,
            layout,
            scaling=p_rope_scaling(p),
            max_position_embeddings=max_position_embeddings,
            kernel=kernel,
        )
        self.p = float(p)

    @property
    def rotated_pairs(self) -> int:
        """The number of pairs that turn, ``int(p d // 2)``; they are the first pairs, of the highest frequencies."""
        return int(self.p * self.head_dim // 2)

    def extra_repr(self) -> str:
        return (
            f"head_dim={self.head_dim}, p={self.p}, theta={self.theta}, layout={self.layout!r}, kernel={self.kernel!r}"
        )
