r"""Context-extension scalings of RoPE's frequencies, read from Hugging Face-style ``rope_scaling`` dicts.

A model trained with RoPE at context length ``L`` sees, in pair ``i``, angles ``m * inv_freq[i]``
for ``m < L``. Running it at ``s * L`` shows it angles it never saw. Every scaling here changes the
inverse frequencies (and possibly multiplies cos and sin by an *attention factor*) so that the
longer context maps back into familiar angles. One registry, :data:`ROPE_SCALINGS`, holds one
entry per ``rope_type``; each entry documents its paper, formula and config keys.

The dict is read with the keys and defaults of model ``config.json`` files (Hugging Face's
``rope_scaling`` / ``rope_parameters``): ``"rope_type"`` (``"type"`` is an alias), ``"factor"``,
``"original_max_position_embeddings"``, and the keys of each type below. Unlike Hugging Face,
which only logs a warning, unknown keys, missing required keys and impossible values raise.

Notation: ``d`` is the rotary dimension, ``b`` the base ``theta``, ``inv_i = b^(-2i/d)``,
``lambda_i = 2 pi / inv_i`` the wavelength of pair ``i`` in tokens, ``s`` the ``factor`` and
``L`` the original (pre-extension) context length.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ._validation import check_choice, check_int, check_positive_float
from .frequencies import default_inverse_frequencies

ScalingFunction = Callable[..., "tuple[torch.Tensor, float]"]


@dataclass(frozen=True)
class RopeScaling:
    """One ``rope_type``: the function computing ``(inv_freq64, attention_scaling)`` and its config keys."""

    compute: ScalingFunction
    required: frozenset[str]
    optional: frozenset[str]


ROPE_SCALINGS: dict[str, RopeScaling] = {}
"""The registry, ``rope_type`` -> :class:`RopeScaling`."""

# Keys every dict may carry: the type itself and the base (checked against the ``theta`` argument).
_COMMON_KEYS = frozenset({"rope_type", "type", "rope_theta"})


def _register(
    name: str, required: Iterable[str] = (), optional: Iterable[str] = ()
) -> Callable[[ScalingFunction], ScalingFunction]:
    def add(fn: ScalingFunction) -> ScalingFunction:
        ROPE_SCALINGS[name] = RopeScaling(fn, frozenset(required), frozenset(optional))
        return fn

    return add


# ----------------------------------------------------------------------------- reading values


def _number(params: Mapping[str, Any], key: str, *, minimum: float | None = None, strict: bool = False) -> float:
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


def _factor(params: Mapping[str, Any]) -> float:
    """The context-extension factor ``s >= 1`` (``s < 1`` would shrink the context)."""
    return _number(params, "factor", minimum=1.0)


def _original_length(params: Mapping[str, Any], max_position_embeddings: int | None, rope_type: str) -> int:
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


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    r"""YaRN's temperature factor ``0.1 * mscale * ln(s) + 1`` for ``s > 1``, else 1 (Peng et al., 2024, eq. 22)."""
    if scale <= 1.0:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def yarn_correction_dim(num_rotations: float, rotary_dim: int, theta: float, original_length: int) -> float:
    r"""The (fractional) pair index whose wavelength fits ``num_rotations`` times in ``L`` tokens.

    Solving ``L / lambda_i = r`` for ``i``, with ``lambda_i = 2 pi b^{2i/d}``, gives

    .. math:: i(r) = \frac{d \, \ln\!\big(L / (2 \pi r)\big)}{2 \ln b}.

    Returned as in Hugging Face's ``find_correction_dim``: a number on the scale of ``d`` of which
    pair indices ``0 .. d/2 - 1`` are compared directly.
    """
    return rotary_dim * math.log(original_length / (num_rotations * 2 * math.pi)) / (2 * math.log(theta))


def yarn_ramp(
    rotary_dim: int, theta: float, original_length: int, beta_fast: float, beta_slow: float, truncate: bool = True
) -> torch.Tensor:
    r"""YaRN's ramp ``gamma_i`` in float64, ``[d/2]``: 0 = keep (extrapolate), 1 = divide by ``s`` (interpolate).

    ``low = i(beta_fast)``, ``high = i(beta_slow)`` (floored / ceiled when ``truncate``), clipped to
    ``[0, d - 1]``; ``gamma_i = clamp((i - low) / (high - low), 0, 1)``; when ``low == high`` the
    denominator is 0.001, as in Hugging Face.
    """
    low = yarn_correction_dim(beta_fast, rotary_dim, theta, original_length)
    high = yarn_correction_dim(beta_slow, rotary_dim, theta, original_length)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high = high + 0.001
    index = torch.arange(rotary_dim // 2, dtype=torch.float64)
    return ((index - low) / (high - low)).clamp(0.0, 1.0)


# ----------------------------------------------------------------------------- the registry


@_register("default")
def default_scaling(rotary_dim: int, theta: float, params: Mapping[str, Any], **_: Any) -> tuple[torch.Tensor, float]:
    r"""No scaling: ``inv_i = b^{-2i/d}`` (Su et al., RoFormer, eq. 15); attention factor 1. Keys: none."""
    return default_inverse_frequencies(rotary_dim, theta), 1.0


@_register("linear", required={"factor"})
def linear_scaling(rotary_dim: int, theta: float, params: Mapping[str, Any], **_: Any) -> tuple[torch.Tensor, float]:
    r"""Position interpolation (Chen et al., 2023): positions ``m -> m / s``, i.e. ``inv_i -> inv_i / s``.

    Every pair is interpolated: a context of ``s L`` tokens is squeezed into the angles of ``L``.
    Keys: ``factor`` (``s >= 1``). Attention factor 1.
    """
    return default_inverse_frequencies(rotary_dim, theta) / _factor(params), 1.0


@_register("dynamic", required={"factor"})
def dynamic_ntk_scaling(
    rotary_dim: int,
    theta: float,
    params: Mapping[str, Any],
    *,
    max_position_embeddings: int | None = None,
    seq_len: int | None = None,
    **_: Any,
) -> tuple[torch.Tensor, float]:
    r"""Dynamic NTK (emozilla, 2023), built on NTK-aware scaling (bloc97, 2023): a larger base.

    NTK-aware scaling raises the base so that the lowest frequency is interpolated by ``alpha``
    while the highest is unchanged: ``b' = b * alpha^{d/(d-2)}``. Dynamic NTK chooses ``alpha``
    from the current length ``n = max(seq_len, L)`` with ``L = max_position_embeddings``:

    .. math:: b' = b \left(\frac{s\,n}{L} - (s - 1)\right)^{d/(d-2)}, \qquad inv_i = b'^{-2i/d},

    which is the original base for ``n <= L``. Keys: ``factor`` (``s >= 1``). Needs
    ``max_position_embeddings`` and ``d >= 4``; ``seq_len`` defaults to ``L``. Attention factor 1.
    """
    factor = _factor(params)
    if max_position_embeddings is None:
        raise ValueError("rope_type='dynamic' needs max_position_embeddings (the length it was trained at)")
    if rotary_dim < 4:
        raise ValueError(
            f"rope_type='dynamic' needs a rotary dimension >= 4 (the exponent is d/(d-2)), got {rotary_dim}"
        )
    length = max_position_embeddings if seq_len is None else max(seq_len, max_position_embeddings)
    base = theta * ((factor * length / max_position_embeddings) - (factor - 1)) ** (rotary_dim / (rotary_dim - 2))
    return default_inverse_frequencies(rotary_dim, base), 1.0


@_register(
    "yarn",
    required={"factor"},
    optional={
        "original_max_position_embeddings",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "attention_factor",
        "truncate",
    },
)
def yarn_scaling(
    rotary_dim: int,
    theta: float,
    params: Mapping[str, Any],
    *,
    max_position_embeddings: int | None = None,
    **_: Any,
) -> tuple[torch.Tensor, float]:
    r"""YaRN (Peng et al., 2024): "NTK-by-parts" interpolation plus an attention temperature.

    Pairs that turn many times within ``L`` (high frequency) keep their frequency; pairs whose
    wavelength exceeds ``L`` are interpolated as in PI; in between, a linear ramp ``gamma_i``
    (:func:`yarn_ramp`, bounded by the pairs that make ``beta_fast`` and ``beta_slow`` turns in
    ``L``) blends the two:

    .. math:: inv'_i = (1 - \gamma_i)\, inv_i + \gamma_i\, inv_i / s .

    cos and sin are multiplied by ``attention_factor`` (``sqrt(1/t)`` in the paper), by default
    ``0.1 ln s + 1`` or, when ``mscale`` and ``mscale_all_dim`` are both set (DeepSeek),
    ``mscale(s, mscale) / mscale(s, mscale_all_dim)`` (:func:`yarn_get_mscale`).

    Keys: ``factor`` (required), ``original_max_position_embeddings`` (``L``; defaults to
    ``max_position_embeddings``), ``beta_fast`` (32), ``beta_slow`` (1), ``mscale``,
    ``mscale_all_dim``, ``attention_factor``, ``truncate`` (True: floor/ceil the ramp's ends).
    """
    factor = _factor(params)
    original = _original_length(params, max_position_embeddings, "yarn")
    beta_fast = _number(params, "beta_fast", minimum=0.0, strict=True) if params.get("beta_fast") is not None else 32.0
    beta_slow = _number(params, "beta_slow", minimum=0.0, strict=True) if params.get("beta_slow") is not None else 1.0
    if beta_fast < beta_slow:
        raise ValueError(f"scaling['beta_fast'] must be >= scaling['beta_slow'], got {beta_fast} < {beta_slow}")
    truncate = params.get("truncate", True)
    if not isinstance(truncate, bool):
        raise TypeError(f"scaling['truncate'] must be a bool, got {type(truncate).__name__}")
    if params.get("attention_factor") is not None:
        attention_factor = _number(params, "attention_factor", minimum=0.0, strict=True)
    else:
        mscale = _number(params, "mscale", minimum=0.0) if params.get("mscale") is not None else None
        mscale_all_dim = (
            _number(params, "mscale_all_dim", minimum=0.0) if params.get("mscale_all_dim") is not None else None
        )
        if mscale and mscale_all_dim:
            attention_factor = yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_get_mscale(factor)
    inv_freq = default_inverse_frequencies(rotary_dim, theta)
    ramp = yarn_ramp(rotary_dim, theta, original, beta_fast, beta_slow, truncate)
    return inv_freq * (1 - ramp) + (inv_freq / factor) * ramp, float(attention_factor)


@_register(
    "longrope",
    required={"short_factor", "long_factor"},
    optional={"factor", "attention_factor", "original_max_position_embeddings"},
)
def longrope_scaling(
    rotary_dim: int,
    theta: float,
    params: Mapping[str, Any],
    *,
    max_position_embeddings: int | None = None,
    seq_len: int | None = None,
    **_: Any,
) -> tuple[torch.Tensor, float]:
    r"""LongRoPE (Ding et al., 2024): one searched rescale factor per frequency, ``inv'_i = inv_i / lambda_i``.

    Two lists of ``d/2`` factors are found by evolutionary search: ``short_factor`` for
    sequences within ``L`` and ``long_factor`` beyond it (used when ``seq_len > L``). cos and sin are
    multiplied by ``attention_factor``, by default ``sqrt(1 + ln s / ln L)`` (1 when ``s <= 1``).

    Keys: ``short_factor``, ``long_factor`` (required; ``d/2`` positive numbers each), ``factor``
    (``s``; defaults to ``max_position_embeddings / L``), ``attention_factor``,
    ``original_max_position_embeddings`` (``L``; defaults to ``max_position_embeddings``).
    """
    original = _original_length(params, max_position_embeddings, "longrope")
    if params.get("factor") is not None:
        factor = _number(params, "factor", minimum=1.0)
    elif max_position_embeddings is not None:
        factor = max_position_embeddings / original
    else:
        raise ValueError("rope_type='longrope' needs scaling['factor'] or max_position_embeddings to infer it")
    if params.get("attention_factor") is not None:
        attention_factor = _number(params, "attention_factor", minimum=0.0, strict=True)
    elif factor <= 1.0:
        attention_factor = 1.0
    else:
        attention_factor = math.sqrt(1 + math.log(factor) / math.log(original))
    short, long = (_factor_list(params, key, rotary_dim // 2) for key in ("short_factor", "long_factor"))
    factors = long if seq_len is not None and seq_len > original else short
    return default_inverse_frequencies(rotary_dim, theta) / factors, float(attention_factor)


def _factor_list(params: Mapping[str, Any], key: str, length: int) -> torch.Tensor:
    values = params[key]
    if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
        raise TypeError(f"scaling[{key!r}] must be a list of {length} numbers, got {type(values).__name__}")
    if len(values) != length:
        raise ValueError(f"scaling[{key!r}] must have rotary_dim // 2 = {length} entries, got {len(values)}")
    for value in values:
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (0 < float(value) < math.inf):
            raise ValueError(f"scaling[{key!r}] must hold finite numbers > 0, got {value!r}")
    return torch.tensor([float(v) for v in values], dtype=torch.float64)


@_register(
    "llama3", required={"factor", "low_freq_factor", "high_freq_factor"}, optional={"original_max_position_embeddings"}
)
def llama3_scaling(
    rotary_dim: int,
    theta: float,
    params: Mapping[str, Any],
    *,
    max_position_embeddings: int | None = None,
    **_: Any,
) -> tuple[torch.Tensor, float]:
    r"""Llama 3.1's frequency-dependent interpolation (Dubey et al., 2024).

    With ``lambda_low = L / low_freq_factor`` and ``lambda_high = L / high_freq_factor``:

    .. math::

        inv'_i = \begin{cases}
          inv_i & \lambda_i < \lambda_{high} \\
          inv_i / s & \lambda_i > \lambda_{low} \\
          (1 - \mu_i)\, inv_i / s + \mu_i\, inv_i,\ \ \mu_i = \frac{L/\lambda_i - low}{high - low} & \text{otherwise.}
        \end{cases}

    Keys: ``factor`` (8 in Llama 3.1), ``low_freq_factor`` (1), ``high_freq_factor`` (4), all
    required, ``original_max_position_embeddings`` (8192; defaults to ``max_position_embeddings``).
    Attention factor 1.
    """
    factor = _factor(params)
    low = _number(params, "low_freq_factor", minimum=0.0, strict=True)
    high = _number(params, "high_freq_factor", minimum=0.0, strict=True)
    if high <= low:
        raise ValueError(f"scaling['high_freq_factor'] must be > scaling['low_freq_factor'], got {high} <= {low}")
    original = _original_length(params, max_position_embeddings, "llama3")
    inv_freq = default_inverse_frequencies(rotary_dim, theta)
    wavelength = 2 * math.pi / inv_freq
    smooth = ((original / wavelength - low) / (high - low)).clamp(0.0, 1.0)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return torch.where(
        wavelength < original / high, inv_freq, torch.where(wavelength > original / low, inv_freq / factor, blended)
    ), 1.0


# ----------------------------------------------------------------------------- entry points


def rope_type_of(scaling: Mapping[str, Any] | None) -> str:
    """The ``rope_type`` of a scaling dict (``"type"`` is an alias; ``None`` means ``"default"``)."""
    if scaling is None:
        return "default"
    if not isinstance(scaling, Mapping):
        raise TypeError(f"scaling must be a dict (a rope_scaling config) or None, got {type(scaling).__name__}")
    names = {scaling[key] for key in ("rope_type", "type") if key in scaling}
    if len(names) > 1:
        raise ValueError(
            f"scaling has rope_type={scaling['rope_type']!r} and type={scaling['type']!r}; they must agree"
        )
    if not names:
        raise ValueError(f"scaling needs a 'rope_type' (one of {sorted(ROPE_SCALINGS)}), got keys {sorted(scaling)}")
    return check_choice(names.pop(), "scaling['rope_type']", sorted(ROPE_SCALINGS))


def validate_scaling(scaling: Mapping[str, Any], theta: float | None = None) -> str:
    """Check a scaling dict's keys (unknown or missing keys raise); return its ``rope_type``.

    ``rope_theta`` may appear in the dict (as in ``rope_parameters``) and must then equal ``theta``.
    """
    rope_type = rope_type_of(scaling)
    entry = ROPE_SCALINGS[rope_type]
    keys = set(scaling)
    if "partial_rotary_factor" in keys:
        raise ValueError(
            "scaling['partial_rotary_factor'] is not read here: pass partial_rotary_factor= to rope_frequencies "
            "(RotaryEmbedding.from_config does this for a config dict)"
        )
    unknown = keys - _COMMON_KEYS - entry.required - entry.optional
    if unknown:
        raise ValueError(
            f"unknown keys {sorted(unknown)} for rope_type={rope_type!r}; it takes "
            f"{sorted(entry.required)} (required) and {sorted(entry.optional)} (optional)"
        )
    missing = {key for key in entry.required if scaling.get(key) is None}
    if missing:
        raise ValueError(f"rope_type={rope_type!r} needs keys {sorted(missing)} in scaling, got {sorted(keys)}")
    if theta is not None and scaling.get("rope_theta") is not None:
        if check_positive_float(scaling["rope_theta"], "scaling['rope_theta']") != theta:
            raise ValueError(
                f"scaling['rope_theta']={scaling['rope_theta']} disagrees with theta={theta}; pass theta={scaling['rope_theta']}"
            )
    return rope_type


def scaled_inverse_frequencies(
    rotary_dim: int,
    theta: float,
    scaling: Mapping[str, Any],
    *,
    max_position_embeddings: int | None = None,
    seq_len: int | None = None,
) -> tuple[torch.Tensor, float]:
    r"""``(inv_freq, attention_scaling)`` for a ``rope_scaling`` dict, the inverse frequencies in float64.

    Args:
        rotary_dim: number of rotated features ``d`` (even).
        theta: the base ``b``.
        scaling: a Hugging Face-style ``rope_scaling`` dict; see :data:`~ropelib.scaling.ROPE_SCALINGS`.
        max_position_embeddings: the model's context length (read by ``dynamic``, and as the
            default of ``original_max_position_embeddings`` / ``factor`` by the others).
        seq_len: the current sequence length (read by ``dynamic`` and ``longrope``).

    Returns:
        ``(inv_freq, attention_scaling)``: float64 ``[d/2]`` and a Python float.

    Example:
        >>> inv, s = scaled_inverse_frequencies(4, 100.0, {"rope_type": "linear", "factor": 2.0})
        >>> inv.tolist(), s
        ([0.5, 0.05], 1.0)
    """
    rope_type = validate_scaling(scaling, theta)
    return ROPE_SCALINGS[rope_type].compute(
        rotary_dim, theta, scaling, max_position_embeddings=max_position_embeddings, seq_len=seq_len
    )


def frequency_seq_len(
    scaling: Mapping[str, Any] | None,
    needed: int,
    current: int | None,
    *,
    max_position_embeddings: int | None,
) -> int | None:
    """The ``seq_len`` at which to evaluate a length-dependent scaling, for the rule of Hugging Face's ``dynamic_rope_update``.

    * ``dynamic``: the frequencies follow the longest length seen (``needed`` when it exceeds
      ``current``) and return to the original ones (``None``) for a sequence within
      ``max_position_embeddings``.
    * ``longrope``: ``needed`` beyond the original length (long factors), ``None`` within it.
    * every other type: ``None`` (the frequencies do not depend on the length).

    Args:
        scaling: the scaling dict (or None).
        needed: the current sequence length (largest position + 1).
        current: the ``seq_len`` the present frequencies were computed for (``None``: the original ones).
        max_position_embeddings: the model's context length.
    """
    if scaling is None:
        return None
    rope_type = rope_type_of(scaling)
    if rope_type == "dynamic":
        if max_position_embeddings is None:
            raise ValueError("dynamic scaling needs max_position_embeddings (the length the model was trained for)")
        # As transformers: grow past the longest length seen; reset only strictly below the original
        # length (a sequence of exactly max_position_embeddings keeps grown frequencies).
        if needed > (max_position_embeddings if current is None else current):
            return needed
        return None if needed < max_position_embeddings else current
    if rope_type == "longrope":
        original = _original_length(scaling, max_position_embeddings, "longrope")
        return original + 1 if needed > original else None
    return None


# ----------------------------------------------------------------------------- model configs

_CONFIG_ONLY_KEYS = ("rope_theta", "partial_rotary_factor")


def _config_value(config: Mapping[str, Any], params: Mapping[str, Any], key: str) -> Any:
    """``key`` from the config's top level or from ``rope_parameters``; the two must agree when both are set."""
    top, inner = config.get(key), params.get(key)
    if top is not None and inner is not None and top != inner:
        raise ValueError(f"config[{key!r}]={top} disagrees with the rope parameters' {key}={inner}")
    return top if top is not None else inner


def rope_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The :class:`~ropelib.rotary.RotaryEmbedding` arguments of a model's ``config.json`` dict.

    Reads the keys Hugging Face configs use: ``head_dim`` (else ``hidden_size //
    num_attention_heads``), ``rope_theta`` (default 10000), ``partial_rotary_factor`` (default 1),
    ``max_position_embeddings``, ``original_max_position_embeddings`` (top level, as in Phi-3), and
    the scaling from ``rope_parameters`` (newer configs, which may also hold ``rope_theta`` and
    ``partial_rotary_factor``) or ``rope_scaling`` (older ones). A per-layer-type
    ``rope_parameters`` (one dict per attention kind) is rejected: pass one layer type's dict.

    Returns:
        A dict with ``head_dim``, ``theta``, ``rotary_dim``, ``scaling`` (None for plain RoPE) and
        ``max_position_embeddings``.

    Example:
        >>> rope_config({"hidden_size": 4096, "num_attention_heads": 32, "rope_theta": 500000.0,
        ...     "max_position_embeddings": 131072, "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
        ...     "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}})["rotary_dim"]
        128
    """
    if not isinstance(config, Mapping):
        raise TypeError(f"config must be a dict (a parsed config.json), got {type(config).__name__}")
    params, legacy = config.get("rope_parameters"), config.get("rope_scaling")
    for name, value in (("rope_parameters", params), ("rope_scaling", legacy)):
        if value is not None and not isinstance(value, Mapping):
            raise TypeError(f"config[{name!r}] must be a dict or null, got {type(value).__name__}")
    if params and legacy and {k: v for k, v in params.items() if k not in _CONFIG_ONLY_KEYS} != dict(legacy):
        raise ValueError("config has both 'rope_parameters' and 'rope_scaling' and they differ; keep one")
    params = dict(params or legacy or {})
    nested = [key for key, value in params.items() if isinstance(value, Mapping)]
    if nested:
        raise ValueError(
            f"config['rope_parameters'] holds one dict per layer type {nested}; build one RotaryEmbedding per "
            "layer type from a config whose rope_parameters is that layer type's dict"
        )
    if config.get("head_dim") is not None:
        head_dim = check_int(config["head_dim"], "config['head_dim']", minimum=2)
    else:
        for key in ("hidden_size", "num_attention_heads"):
            if config.get(key) is None:
                raise ValueError(
                    f"config needs 'head_dim' or both 'hidden_size' and 'num_attention_heads'; {key!r} is missing"
                )
        hidden = check_int(config["hidden_size"], "config['hidden_size']", minimum=1)
        heads = check_int(config["num_attention_heads"], "config['num_attention_heads']", minimum=1)
        if hidden % heads:
            raise ValueError(
                f"config['hidden_size']={hidden} is not divisible by config['num_attention_heads']={heads}"
            )
        head_dim = hidden // heads
    theta = _config_value(config, params, "rope_theta")
    theta = 10000.0 if theta is None else check_positive_float(theta, "config['rope_theta']")
    partial = _config_value(config, params, "partial_rotary_factor")
    from .frequencies import rotary_dim_for

    rotary_dim = rotary_dim_for(head_dim, 1.0 if partial is None else partial)
    max_positions = config.get("max_position_embeddings")
    if max_positions is not None:
        max_positions = check_int(max_positions, "config['max_position_embeddings']", minimum=1)
    scaling = {k: v for k, v in params.items() if k not in _CONFIG_ONLY_KEYS}
    if scaling and "rope_type" not in scaling and "type" not in scaling:
        scaling["rope_type"] = "default"
    if "type" in scaling and "rope_type" in scaling:
        rope_type_of(scaling)  # they must agree
        del scaling["type"]
    rope_type = rope_type_of(scaling) if scaling else "default"
    if config.get("original_max_position_embeddings") is not None and rope_type in ("yarn", "longrope", "llama3"):
        top = check_int(
            config["original_max_position_embeddings"], "config['original_max_position_embeddings']", minimum=1
        )
        if scaling.get("original_max_position_embeddings", top) != top:
            raise ValueError(
                f"config['original_max_position_embeddings']={top} disagrees with the scaling's "
                f"{scaling['original_max_position_embeddings']}"
            )
        scaling["original_max_position_embeddings"] = top
    if rope_type == "default":
        validate_scaling(scaling or {"rope_type": "default"})
    else:
        scaled_inverse_frequencies(rotary_dim, theta, scaling, max_position_embeddings=max_positions)  # validates now
    return {
        "head_dim": head_dim,
        "theta": theta,
        "rotary_dim": rotary_dim,
        "scaling": None if rope_type == "default" else scaling,
        "max_position_embeddings": max_positions,
    }
