r"""Resonance RoPE (Wang et al., 2024, "Resonance RoPE: Improving Context Length Generalization of Large Language Models").

Each wavelength ``lambda_i = 2 pi / theta_i`` of a RoPE (any scaling: Resonance YaRN is YaRN's
frequencies rounded) is rounded to the nearest integer,

.. math:: \tilde\theta_i = \frac{2\pi}{\operatorname{round}(2\pi / \theta_i)},

so that pair ``i`` turns a whole number of times every ``round(lambda_i)`` positions:
``R(m + round(lambda_i)) = R(m)`` on that pair. A pair whose wavelength fits in the training length
(a *pre-critical* pair) therefore shows, at positions past it, only angles it saw in training. As
the authors' code, every wavelength is rounded (a long one moves by a negligible relative
``<= 1 / (2 lambda)``); a zero frequency (infinite wavelength) stays zero.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .cache import TableCache
from .spec import RopeSpec
from .standard import RotaryEmbedding


def resonance_frequencies(inv_freq: torch.Tensor) -> torch.Tensor:
    r"""``2 pi / round(2 pi / theta_i)`` for each ``theta_i > 0`` (zeros kept), float64 ``[d_rot/2]`` on the CPU.

    Raises :class:`ValueError` when a wavelength rounds to 0 (``theta_i > 4 pi``: no integer period).

    Example:
        >>> freqs = torch.tensor([1.0, 0.0], dtype=torch.float64)
        >>> resonance_frequencies(freqs).tolist()  # wavelength 2 pi -> 6
        [1.0471975511965976, 0.0]
    """
    if not isinstance(inv_freq, torch.Tensor) or inv_freq.dtype != torch.float64 or inv_freq.ndim != 1:
        raise TypeError(f"inv_freq must be a float64 tensor [r/2], got {getattr(inv_freq, 'dtype', type(inv_freq))}")
    inv_freq = inv_freq.cpu()
    if not (torch.isfinite(inv_freq).all() and inv_freq.ge(0).all()):
        raise ValueError("inv_freq must hold finite frequencies >= 0")
    rotating = inv_freq > 0
    wavelengths = torch.where(rotating, 2 * math.pi / inv_freq.where(rotating, 1.0), 0.0).round()
    if (rotating & (wavelengths < 1)).any():
        raise ValueError("inv_freq has a frequency > 4 pi, whose wavelength rounds to 0 (no integer period)")
    return torch.where(rotating, 2 * math.pi / wavelengths.where(rotating, 1.0), 0.0)


@dataclass(frozen=True)
class ResonanceSpec(RopeSpec):
    """A :class:`~ropelib.RopeSpec` whose frequencies are rounded to integer wavelengths (:func:`resonance_frequencies`)."""

    def frequencies(self, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
        inv_freq, attention_scaling = super().frequencies(seq_len)
        return resonance_frequencies(inv_freq), attention_scaling

    @classmethod
    def of(cls, spec: RopeSpec) -> ResonanceSpec:
        """The resonance version of ``spec`` (its fields, its scaling)."""
        fields = {name: getattr(spec, name) for name in spec.__dataclass_fields__}
        resonance = cls(**fields)
        resonance.frequencies()  # checked now (a wavelength rounding to 0 raises here)
        _ = resonance.follows_length  # its cached properties filled now, not first under a trace (a lock)
        return resonance


class ResonanceRotaryEmbedding(RotaryEmbedding):
    r"""Resonance RoPE (Wang et al., 2024): a :class:`~ropelib.RotaryEmbedding` with integer wavelengths.

    The frequencies of ``RotaryEmbedding(head_dim, theta, layout, rotary_dim, scaling=scaling, ...)``
    (with ``scaling`` a YaRN dict: Resonance YaRN), each wavelength rounded to the nearest integer;
    the rotation is RoPE's (the same cache, operator and kernels).

    Args:
        head_dim, theta, layout, rotary_dim, scaling, max_position_embeddings, kernel:
            as :class:`~ropelib.RotaryEmbedding`.

    Example:
        >>> rope = ResonanceRotaryEmbedding(4, theta=100.0)
        >>> wavelengths = 2 * math.pi / rope.cache.inv_freq  # 2 pi, 20 pi
        >>> [round(w, 6) for w in wavelengths.tolist()]
        [6.0, 63.0]
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
        kernel: str = "auto",
    ) -> None:
        super().__init__(
            head_dim,
            theta,
            layout,
            rotary_dim,
            scaling=scaling,
            max_position_embeddings=max_position_embeddings,
            kernel=kernel,
        )
        self.spec = ResonanceSpec.of(self.spec)
        self.cache = TableCache(self.spec)

    @property
    def wavelengths(self) -> torch.Tensor:
        """The integer wavelengths ``round(2 pi / theta_i)``, float64 ``[rotary_dim // 2]`` (``inf`` for a zero frequency)."""
        return (2 * math.pi / self.cache.inv_freq).round()
