r"""The frequencies of a RoPE as one immutable value: :class:`RopeSpec`.

Pair ``i`` of a query or key at position ``m`` turns by ``m\theta_i``. The frequencies ``theta_i`` are fixed
by the base ``theta``, the number of rotated features ``d_rot``, a context-extension ``scaling`` (a
Hugging Face ``rope_scaling`` dict, :mod:`ropelib.scaling`), the model's context length, and the
frequency family (RoPE's ``base^{-2i/d_rot}``, or rotary-embedding-torch's ``"pixel"``). A spec is
frozen and hashable: modules, caches and layers that share one share one set of tables.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .._validation import check_choice, check_even, check_int, check_positive_float
from ..frequencies import ntk_rescaled_theta, pixel_inverse_frequencies
from ..scaling import ROPE_SCALINGS, frequency_seq_len, inverse_frequencies64, rope_type_of

#: The frequency families of rotary-embedding-torch's ``freqs_for``, ``"lang"`` (``base^{-2i/d_rot}``) and ``"pixel"``.
FREQS_FOR = ("lang", "pixel")


def _frozen(value: Any) -> Any:
    """A hashable copy of a config value: a dict becomes its ``(key, value)`` pairs in order, a list a tuple."""
    if isinstance(value, Mapping):
        return tuple((str(k), _frozen(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    return value


def _thawed(value: Any) -> Any:
    """A value of a scaling dict as :func:`_frozen` found it (its tuples as lists, as JSON has them)."""
    if isinstance(value, tuple):
        return [_thawed(v) for v in value]
    return value


@dataclass(frozen=True)
class RopeSpec:
    """What fixes a RoPE's frequencies (see the module docstring). Build it with :meth:`create`.

    Example:
        >>> spec = RopeSpec.create(8, theta=100.0)
        >>> spec.frequencies()[0].tolist()
        [1.0, 0.31622776601683794, 0.1, 0.03162277660168379]
        >>> spec == RopeSpec.create(8, theta=100.0)  # a value: equal, hashable
        True
    """

    rotary_dim: int
    theta: float = 10000.0
    scaling_items: tuple[tuple[str, Any], ...] | None = None
    max_position_embeddings: int | None = None
    freqs_for: str = "lang"
    max_freq: float = 10.0
    theta_rescale_factor: float = 1.0

    @classmethod
    def create(
        cls,
        rotary_dim: int,
        theta: float = 10000.0,
        scaling: Mapping[str, Any] | None = None,
        *,
        max_position_embeddings: int | None = None,
        freqs_for: str = "lang",
        max_freq: float = 10.0,
        theta_rescale_factor: float = 1.0,
    ) -> RopeSpec:
        """A checked spec; the scaling dict is validated (and its frequencies computed once) here."""
        if scaling is not None and not isinstance(scaling, Mapping):
            raise TypeError(f"scaling must be a dict (a rope_scaling config) or None, got {type(scaling).__name__}")
        spec = cls(
            rotary_dim=check_even(rotary_dim, "rotary_dim"),
            theta=check_positive_float(theta, "theta"),
            scaling_items=None if scaling is None else _frozen(scaling),
            max_position_embeddings=None
            if max_position_embeddings is None
            else check_int(max_position_embeddings, "max_position_embeddings", minimum=1),
            freqs_for=check_choice(freqs_for, "freqs_for", FREQS_FOR),
            max_freq=check_positive_float(max_freq, "max_freq"),
            theta_rescale_factor=check_positive_float(theta_rescale_factor, "theta_rescale_factor"),
        )
        if spec.theta_rescale_factor != 1.0 and (scaling is not None or spec.freqs_for == "pixel"):
            raise ValueError("theta_rescale_factor (static NTK scaling) needs freqs_for='lang' and scaling=None")
        if spec.freqs_for == "pixel" and scaling is not None:
            raise ValueError("freqs_for='pixel' takes no scaling (the rope_scaling types rescale theta^(-2i/r))")
        spec.frequencies()  # every value checked now, not at the first call
        return spec

    @property
    def scaling(self) -> dict[str, Any] | None:
        """The scaling as a ``rope_scaling`` dict (a fresh copy), or None."""
        if self.scaling_items is None:
            return None
        return {key: _thawed(value) for key, value in self.scaling_items}

    @functools.cached_property
    def rope_type(self) -> str:
        """The scaling's ``rope_type`` (``"default"`` without one)."""
        return rope_type_of(self.scaling)

    @functools.cached_property
    def follows_length(self) -> bool:
        """True for the scalings whose frequencies follow the current length (``dynamic``, ``longrope``)."""
        return ROPE_SCALINGS[self.rope_type].follows_length

    def frequency_seq_len(self, needed: int, current: int | None) -> int | None:
        """The ``seq_len`` to compute the frequencies at for ``needed`` positions (None: the original ones)."""
        return frequency_seq_len(self.scaling, needed, current, max_position_embeddings=self.max_position_embeddings)

    def frequencies(self, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
        """``(inv_freq, attention_scaling)``: float64 ``[d_rot/2]`` on the CPU and the factor on cos and sin."""
        if self.freqs_for == "pixel":
            return pixel_inverse_frequencies(self.rotary_dim, self.max_freq), 1.0
        theta = ntk_rescaled_theta(self.theta, self.rotary_dim, self.theta_rescale_factor)
        return inverse_frequencies64(
            self.rotary_dim,
            theta,
            self.scaling,
            max_position_embeddings=self.max_position_embeddings,
            seq_len=seq_len,
        )
