r"""The public registry of RoPE scalings, keyed by ``rope_type``, and the readers every entry shares.

Each entry is a :class:`~ropelib.scaling.registry.RopeScaling`: the function that computes ``(inv_freq64, attention_scaling)``,
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
from types import MappingProxyType
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
            ``(inv_freq, attention_scaling)``, float64 ``[rotary_dim / 2]`` on the CPU and a float
            (checked at registration and at every call: :func:`~ropelib.scaling.registry.check_computed`).
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
"""The registry, ``rope_type`` -> :class:`~ropelib.scaling.registry.RopeScaling`. Add entries with :func:`~ropelib.register_scaling`."""

#: Keys every dict may carry: the type itself and the base (checked against the ``theta`` argument).
COMMON_KEYS = frozenset({"rope_type", "type", "rope_theta"})


#: The probe of :func:`register_scaling`: a rotary dimension of 8 (so 4 frequencies), base 10000, and a
#: model of 128 positions extended from 64.
PROBE_ROTARY_DIM, PROBE_THETA, PROBE_MAX_POSITIONS, PROBE_ORIGINAL = 8, 10000.0, 128, 64

#: What the probe dict holds for the keys of Hugging Face's ``rope_scaling`` dicts (others get 1.0).
PROBE_VALUES: Mapping[str, Any] = MappingProxyType(
    {
        "factor": 2.0,
        "original_max_position_embeddings": PROBE_ORIGINAL,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "attention_factor": 1.0,
        "truncate": True,
        "partial_rotary_factor": 1.0,
        "short_factor": (1.0,) * (PROBE_ROTARY_DIM // 2),
        "long_factor": (2.0,) * (PROBE_ROTARY_DIM // 2),
    }
)


def key_names(keys: object, argument: str) -> frozenset[str]:
    """A collection of key names (``required``, ``optional``, ``ignore_keys``) as a frozenset, read once.

    A bare string is refused (:class:`TypeError`): iterating it would give its letters. A
    generator is read once, so that checking it does not consume it.
    """
    if isinstance(keys, (str, bytes)):
        raise TypeError(
            f"{argument} must be a collection of key names (a set or list of str), not a bare "
            f"{type(keys).__name__} {keys!r} (which would be read as its letters); write [{keys!r}]"
        )
    if not isinstance(keys, Iterable):
        raise TypeError(f"{argument} must be a collection of key names (a set or list of str), got {keys!r}")
    names = tuple(keys)
    for key in names:
        if not isinstance(key, str):
            raise TypeError(f"{argument} must hold str key names, got {key!r} ({type(key).__name__})")
    return frozenset(names)


def check_computed(
    rope_type: str, inv_freq: object, attention_scaling: object, rotary_dim: int
) -> tuple[torch.Tensor, float]:
    """What a scaling function returned, checked against its contract (see :class:`~ropelib.scaling.registry.RopeScaling`).

    ``inv_freq`` must be a float64 CPU tensor of ``rotary_dim // 2`` finite frequencies ``>= 0`` and
    ``attention_scaling`` a finite float ``> 0``: anything else would rotate mismatched pairs, or
    in the wrong precision, later. Raises :class:`TypeError` (wrong kind) or :class:`ValueError`.
    """
    pairs = rotary_dim // 2
    where = f"the scaling function of rope_type={rope_type!r}"
    wanted = f"a float64 tensor [rotary_dim // 2] = [{pairs}] for rotary_dim={rotary_dim}"
    if not isinstance(inv_freq, torch.Tensor):
        raise TypeError(f"{where} must return (inv_freq, attention_scaling) with inv_freq {wanted}, got {inv_freq!r}")
    if inv_freq.dtype != torch.float64:
        raise TypeError(f"{where} returned inv_freq of dtype {inv_freq.dtype}; expected {wanted}")
    if inv_freq.device.type != "cpu":  # the tables are built from it on the host; and no device is waited for
        raise ValueError(f"{where} returned inv_freq on {inv_freq.device}; expected {wanted} on the CPU")
    if tuple(inv_freq.shape) != (pairs,):
        raise ValueError(
            f"{where} returned inv_freq of shape {list(inv_freq.shape)}; expected {wanted} (one frequency per pair)"
        )
    if isinstance(attention_scaling, bool) or not isinstance(attention_scaling, float):
        raise TypeError(
            f"{where} returned attention_scaling={attention_scaling!r} ({type(attention_scaling).__name__}); "
            "expected a Python float (the factor on cos and sin)"
        )
    if not (torch.isfinite(inv_freq).all() and inv_freq.ge(0).all()) or not 0 < attention_scaling < math.inf:
        raise ValueError(
            f"rope_type={rope_type!r} gave non-finite or negative frequencies or attention scaling "
            f"({attention_scaling}) for rotary_dim={rotary_dim}; check the scaling's values"
        )
    return inv_freq, attention_scaling


def _probe(
    name: str,
    fn: ScalingFunction,
    required: frozenset[str],
    follow_length: LengthRule | None,
    for_factor: Example | None,
    probe: Mapping[str, Any] | None,
) -> None:
    """Call ``fn`` once (twice for a length-following one) as the library will, and check what it returns.

    A probe dict made here is a guess at valid values: when ``fn`` raises on it, nothing is
    concluded (every later call is checked by :func:`~ropelib.scaling.registry.check_computed` all the same). A ``probe``
    given by the caller must be accepted.
    """
    given = probe is not None
    if probe is None and for_factor is not None:
        probe = for_factor(PROBE_VALUES["factor"], PROBE_ORIGINAL)
        if not isinstance(probe, Mapping):
            raise TypeError(
                f"for_factor must return a scaling dict, got {type(probe).__name__} from "
                f"for_factor({PROBE_VALUES['factor']}, {PROBE_ORIGINAL})"
            )
    if probe is None:
        probe = {key: PROBE_VALUES.get(key, 1.0) for key in sorted(required)}
    params = {"rope_type": name, **{key: list(v) if isinstance(v, tuple) else v for key, v in probe.items()}}
    lengths: tuple[int | None, ...] = (None,) if follow_length is None else (None, 2 * PROBE_MAX_POSITIONS)
    for seq_len in lengths:
        call = (
            f"{getattr(fn, '__name__', 'the function')}({PROBE_ROTARY_DIM}, {PROBE_THETA}, {params}, "
            f"max_position_embeddings={PROBE_MAX_POSITIONS}, seq_len={seq_len})"
        )
        try:
            result = fn(
                PROBE_ROTARY_DIM, PROBE_THETA, params, max_position_embeddings=PROBE_MAX_POSITIONS, seq_len=seq_len
            )
        except Exception as error:
            if not given:
                return  # the guessed values do not suit it (or its module is still being imported)
            raise ValueError(
                f"register_scaling({name!r}, probe=...): {call} raised {type(error).__name__}: {error}"
            ) from error
        if not isinstance(result, tuple) or len(result) != 2:
            raise TypeError(
                f"register_scaling({name!r}) refuses the scaling: {call} must return (inv_freq, attention_scaling), "
                f"got {result!r}"
            )
        try:
            check_computed(name, *result, PROBE_ROTARY_DIM)
        except (TypeError, ValueError) as error:
            raise type(error)(f"register_scaling({name!r}) refuses the scaling: probed with {call}, {error}") from None


def register_scaling(
    name: str,
    *,
    required: Iterable[str] = (),
    optional: Iterable[str] = (),
    paper: str = "",
    follow_length: LengthRule | None = None,
    for_factor: Example | None = None,
    replace: bool = False,
    probe: Mapping[str, Any] | None = None,
) -> Callable[[ScalingFunction], ScalingFunction]:
    """Decorator adding ``compute`` to :data:`~ropelib.scaling.registry.ROPE_SCALINGS` under ``name``.

    The function is tried at registration (a *probe*): ``compute(8, 10000.0, params,
    max_position_embeddings=128, seq_len=None)`` (and ``seq_len=256`` with ``follow_length``) must
    return a float64 CPU tensor of ``8 // 2 = 4`` finite frequencies ``>= 0`` and a finite float
    attention factor ``> 0``, or the registration is refused (:class:`TypeError` /
    :class:`ValueError`); every later call is checked the same way (:func:`~ropelib.scaling.registry.check_computed`).
    ``params`` is ``probe`` when given (which must then be accepted), else ``for_factor(2.0, 64)``
    when given, else a value for each required key (:data:`~ropelib.scaling.registry.PROBE_VALUES`: Hugging Face's
    meanings, e.g. ``factor=2.0``; 1.0 for other keys). When the function raises on a dict made
    here the probe proves nothing and is skipped (the values may not suit it, or its module is
    still being imported): pass ``probe=`` to have it run.

    Args:
        name: the ``rope_type``.
        required, optional: collections of key names (a set or list, not a bare string).
        paper, follow_length, for_factor: see :class:`~ropelib.scaling.registry.RopeScaling`.
        replace: allow replacing an entry of the same name.
        probe: the scaling dict to probe with (for required keys :data:`~ropelib.scaling.registry.PROBE_VALUES` cannot fill).

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
    required_keys, optional_keys = key_names(required, "required"), key_names(optional, "optional")
    for key, value in (("follow_length", follow_length), ("for_factor", for_factor)):
        if value is not None and not callable(value):
            raise TypeError(f"{key} must be callable or None, got {type(value).__name__}")
    if probe is not None and not isinstance(probe, Mapping):
        raise TypeError(f"probe must be a scaling dict or None, got {type(probe).__name__}")

    def add(fn: ScalingFunction) -> ScalingFunction:
        if not callable(fn):
            raise TypeError(f"a scaling must be callable, got {type(fn).__name__}")
        _probe(name, fn, required_keys, follow_length, for_factor, probe)
        ROPE_SCALINGS[name] = RopeScaling(name, fn, required_keys, optional_keys, paper, follow_length, for_factor)
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
