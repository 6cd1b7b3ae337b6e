r"""The public registry of RoPE scalings, keyed by ``rope_type``, and the readers every entry shares.

Each entry is a :class:`RopeScaling`: the function that computes ``(inv_freq64, attention_scaling)``,
the config keys it reads (required and optional), the paper it implements, and whether its
frequencies follow the current sequence length (``dynamic``, ``longrope``). One module per
``rope_type`` in :mod:`ropelib.scaling` registers its entry with :func:`~ropelib.register_scaling`; users
register their own the same way, and everything else (the module, the Hugging Face patch, the
lab) reads :data:`~ropelib.scaling.registry.ROPE_SCALINGS` instead of keeping its own list.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .._validation import check_int

ScalingFunction = Callable[..., "tuple[torch.Tensor, float]"]
#: ``(scaling, needed, current, max_position_embeddings) -> seq_len or None``: the length at which a
#: length-following scaling is evaluated for a sequence of ``needed`` positions (see each entry).
LengthRule = Callable[[Mapping[str, Any], int, "int | None", "int | None"], "int | None"]
#: ``(factor, original_length) -> scaling dict``: a config that extends a context of ``original_length``
#: tokens ``factor`` times, for the types that need nothing else (not LongRoPE's searched factors).
Example = Callable[[float, int], "dict[str, Any]"]


@dataclass(frozen=True)
class RopeScaling:
    """One ``rope_type``: how to compute its frequencies, which keys it reads, and where it comes from.

    Attributes:
        name: the ``rope_type`` string of model configs.
        compute: ``compute(rotary_dim, theta, params, *, max_position_embeddings, seq_len)`` returning
            ``(inv_freq, attention_scaling)``, float64 ``[rotary_dim / 2]`` and a float.
        required, optional: the keys of the ``rope_scaling`` dict it reads.
        paper: the reference that defines it.
        follow_length: for scalings whose frequencies depend on the current length, the rule that
            picks the length to evaluate at; ``None`` for the others.
        for_factor: builds this type's dict for a factor and an original length (used by the lab
            to stretch a model at test time); ``None`` when the type needs more than that.
    """

    name: str
    compute: ScalingFunction
    required: frozenset[str]
    optional: frozenset[str]
    paper: str
    follow_length: LengthRule | None = None
    for_factor: Example | None = None

    @property
    def follows_length(self) -> bool:
        """True when the frequencies change with the sequence length (they must be recomputed per call)."""
        return self.follow_length is not None


ROPE_SCALINGS: dict[str, RopeScaling] = {}
"""The registry, ``rope_type`` -> :class:`RopeScaling`. Add entries with :func:`~ropelib.register_scaling`."""

#: Keys every dict may carry: the type itself and the base (checked against the ``theta`` argument).
COMMON_KEYS = frozenset({"rope_type", "type", "rope_theta"})


def register_scaling(
    name: str,
    *,
    required: Iterable[str] = (),
    optional: Iterable[str] = (),
    paper: str = "",
    follow_length: LengthRule | None = None,
    for_factor: Example | None = None,
    replace: bool = False,
) -> Callable[[ScalingFunction], ScalingFunction]:
    """Decorator adding ``compute`` to :data:`~ropelib.scaling.registry.ROPE_SCALINGS` under ``name``.

    Example:
        >>> @register_scaling(
        ...     "flat", required={"factor"}, paper="an example", replace=True
        ... )
        ... def flat(rotary_dim, theta, params, **_):
        ...     half = (rotary_dim // 2,)
        ...     return torch.full(half, 1.0 / theta, dtype=torch.float64), 1.0
        >>> ROPE_SCALINGS["flat"].required
        frozenset({'factor'})
        >>> del ROPE_SCALINGS["flat"]
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str, got {name!r}")
    if not replace and name in ROPE_SCALINGS:
        raise ValueError(f"rope_type {name!r} is registered already; pass replace=True to override it")
    for key, value in (("follow_length", follow_length), ("for_factor", for_factor)):
        if value is not None and not callable(value):
            raise TypeError(f"{key} must be callable or None, got {type(value).__name__}")

    def add(fn: ScalingFunction) -> ScalingFunction:
        if not callable(fn):
            raise TypeError(f"a scaling must be callable, got {type(fn).__name__}")
        ROPE_SCALINGS[name] = RopeScaling(
            name, fn, frozenset(required), frozenset(optional), paper, follow_length, for_factor
        )
        return fn

    return add


# ----------------------------------------------------------------------------- reading values


def number(params: Mapping[str, Any], key: str, *, minimum: float | None = None, strict: bool = False) -> float:
    """``params[key]`` as a finite real number, ``> minimum`` when ``strict`` else ``>= minimum``."""
    value = params[key]
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"scaling[{key!r}] must be a real number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"scaling[{key!r}] must be finite, got {value}")
    if minimum is not None and (value <= minimum if strict else value < minimum):
        raise ValueError(f"scaling[{key!r}] must be {'>' if strict else '>='} {minimum}, got {value}")
    return value


def optional_number(
    params: Mapping[str, Any], key: str, default: float | None, *, minimum: float | None = None, strict: bool = False
) -> float | None:
    """``params[key]`` read by :func:`number`, or ``default`` when the key is absent or null."""
    return default if params.get(key) is None else number(params, key, minimum=minimum, strict=strict)


def factor(params: Mapping[str, Any]) -> float:
    """The context-extension factor ``s >= 1`` (``s < 1`` would shrink the context)."""
    return number(params, "factor", minimum=1.0)


def original_length(params: Mapping[str, Any], max_position_embeddings: int | None, rope_type: str) -> int:
    """``L``: ``original_max_position_embeddings`` from the dict, else ``max_position_embeddings``.

    Hugging Face fills the missing key from the model's ``max_position_embeddings`` the same way.
    """
    if params.get("original_max_position_embeddings") is not None:
        return check_int(
            params["original_max_position_embeddings"], "scaling['original_max_position_embeddings']", minimum=1
        )
    if max_position_embeddings is None:
        raise ValueError(
            f"rope_type={rope_type!r} needs the original context length: give "
            "scaling['original_max_position_embeddings'] or max_position_embeddings"
        )
    return max_position_embeddings
