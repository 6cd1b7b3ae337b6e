r"""Context-extension scalings of RoPE's frequencies, read from Hugging Face-style ``rope_scaling`` dicts.

A model trained with RoPE at context length ``L`` sees, in pair ``i``, angles ``m * inv_freq[i]``
for ``m < L``. Running it at ``s * L`` shows its slow pairs (wavelength ``2 pi / inv_freq[i] > L``)
angles they never saw. Every scaling here changes the
inverse frequencies (and possibly multiplies cos and sin by an *attention factor*) so that the
longer context maps back into familiar angles. One public registry, :data:`~ropelib.scaling.registry.ROPE_SCALINGS`, holds
one entry per ``rope_type`` (one module each: :mod:`~ropelib.scaling.default`,
:mod:`~ropelib.scaling.linear`, :mod:`~ropelib.scaling.dynamic`, :mod:`~ropelib.scaling.yarn`,
:mod:`~ropelib.scaling.longrope`, :mod:`~ropelib.scaling.llama3`, ``ropelib.scaling.proportional``);
:func:`~ropelib.register_scaling` adds yours.

The dict is read with the keys and defaults of model ``config.json`` files (Hugging Face's
``rope_scaling`` / ``rope_parameters``): ``"rope_type"`` (``"type"`` is an alias), ``"factor"``,
``"original_max_position_embeddings"``, and the keys of each type. As in Hugging Face, missing
required keys raise; unlike Hugging Face, which logs a warning for them, unknown keys and
impossible values raise too (model-specific extra keys can be let through with ``ignore_keys``).
Where Hugging Face warns about a consistent but suspicious dict (a YaRN ``factor`` that is not
``max_position_embeddings / original_max_position_embeddings`` or a YaRN ``attention_factor``
that is not a float, a Llama 3 original length that is not below ``max_position_embeddings``, a
LongRoPE dict without ``factor``, a ``proportional`` dict without ``partial_rotary_factor`` or
with ``factor``), ropelib warns too (:class:`UserWarning`).

Notation: ``d_rot`` is the rotary dimension, ``base`` the base (the argument ``theta``), ``theta_i = base^(-2i/d_rot)``,
``lambda_i = 2 pi / theta_i`` the wavelength of pair ``i`` in tokens, ``s`` the ``factor`` and
``L`` the original (pre-extension) context length.
"""

from __future__ import annotations

import numbers
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from .._validation import check_choice, check_int, check_integer_tensor, check_positive_float
from ..frequencies import default_inverse_frequencies, rotary_dim_for
from . import default, dynamic, linear, llama3, longrope, proportional, yarn  # noqa: F401  (each registers its rope_type)
from .default import default_scaling
from .dynamic import dynamic_ntk_scaling
from .linear import linear_scaling
from .llama3 import llama3_scaling
from .longrope import longrope_scaling
from .proportional import proportional_scaling
from .registry import COMMON_KEYS, ROPE_SCALINGS, RopeScaling, check_computed, key_names, register_scaling
from .yarn import yarn_correction_dim, yarn_get_mscale, yarn_ramp, yarn_scaling

__all__ = [
    "ROPE_SCALINGS",
    "RopeScaling",
    "default_scaling",
    "dynamic_ntk_scaling",
    "frequency_seq_len",
    "inverse_frequencies64",
    "linear_scaling",
    "llama3_scaling",
    "longrope_scaling",
    "proportional_scaling",
    "register_scaling",
    "rope_frequencies",
    "rope_type_of",
    "scaled_inverse_frequencies",
    "validate_scaling",
    "yarn_correction_dim",
    "yarn_get_mscale",
    "yarn_ramp",
    "yarn_scaling",
]


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


def _warn(message: str) -> None:
    warnings.warn(message, UserWarning, stacklevel=4)  # at the function that called validate_scaling


def _warn_like_transformers(rope_type: str, scaling: Mapping[str, Any], max_position_embeddings: int | None) -> None:
    """The warnings ``transformers`` gives for these dicts, as :class:`UserWarning`, where ropelib accepts the dict.

    They mirror ``RotaryEmbeddingConfigMixin._validate_<rope_type>_rope_parameters`` of
    ``transformers.modeling_rope_utils``, run after its ``standardize_rope_params``, which fills a
    missing ``original_max_position_embeddings`` of ``yarn``, ``llama3`` and ``longrope`` with
    ``max_position_embeddings`` (as ropelib reads it too). The checks transformers only warns about
    but ropelib refuses (a factor below 1, unknown keys, ...) raise instead, in the scalings.
    """
    given = scaling.get("original_max_position_embeddings")
    original = max_position_embeddings if given is None else given
    # Both lengths as positive ints (else the scaling raises about them, and there is nothing to compare).
    lengths: tuple[int, int] | None = None
    if isinstance(original, numbers.Integral) and not isinstance(original, bool) and int(original) > 0:
        if max_position_embeddings is not None:
            lengths = int(original), max_position_embeddings
    if rope_type == "yarn":
        if lengths is not None:
            implicit = lengths[1] / lengths[0]
            if implicit != 1 and implicit != scaling.get("factor"):
                _warn(
                    f"scaling['factor']={scaling.get('factor')} does not match max_position_embeddings / "
                    f"original_max_position_embeddings = {max_position_embeddings} / {original} = {implicit}; "
                    "the explicit factor is used (as transformers warns)"
                )
        attention_factor = scaling.get("attention_factor")
        if attention_factor is not None and not isinstance(attention_factor, float):
            _warn(
                f"scaling['attention_factor']={attention_factor!r} is a {type(attention_factor).__name__}, not a "
                "float (transformers warns that it must be a float greater than 0); its value is used"
            )
    if rope_type == "llama3" and lengths is not None and lengths[0] >= lengths[1]:
        default = "" if given is not None else " (by default)"
        _warn(
            f"scaling['original_max_position_embeddings']={original}{default} should be less than "
            f"max_position_embeddings={max_position_embeddings} (as transformers warns)"
        )
    if rope_type == "longrope" and scaling.get("factor") is None and max_position_embeddings is not None:
        _warn(
            "scaling has no 'factor': it is taken as max_position_embeddings / original_max_position_embeddings "
            f"= {max_position_embeddings} / {original}; give scaling['factor'] (transformers warns and recommends it)"
        )
    if rope_type == "proportional":
        if scaling.get("partial_rotary_factor") is None:
            _warn(
                "rope_type='proportional' without scaling['partial_rotary_factor'] rotates every pair (the fraction "
                "defaults to 1.0, plain RoPE divided by the factor); give a fraction in [0, 1) (as transformers warns)"
            )
        if "factor" in scaling:
            _warn(
                "scaling['factor'] is not a key of rope_type='proportional' to transformers' validation (it warns "
                "'Unrecognized keys'), though its frequencies are divided by it there as here"
            )


def validate_scaling(
    scaling: Mapping[str, Any],
    theta: float | None = None,
    *,
    max_position_embeddings: int | None = None,
    ignore_keys: Iterable[str] = (),
) -> str:
    """Check a scaling dict's keys (unknown or missing keys raise); return its ``rope_type``.

    ``rope_theta`` may appear in the dict (as in ``rope_parameters``) and must then equal ``theta``.
    Keys in ``ignore_keys`` (model-specific ones such as Qwen2-VL's ``mrope_section``) are let
    through unread, as ``transformers``' ``ignore_keys``.
    """
    rope_type = rope_type_of(scaling)
    ignore_keys = key_names(ignore_keys, "ignore_keys")
    entry = ROPE_SCALINGS[rope_type]
    keys = set(scaling) - set(ignore_keys)
    if "partial_rotary_factor" in keys - entry.optional:
        raise ValueError(
            "scaling['partial_rotary_factor'] is not read here: pass partial_rotary_factor= to rope_frequencies "
            "(RotaryEmbedding.from_config does this for a config dict)"
        )
    unknown = keys - COMMON_KEYS - entry.required - entry.optional
    if unknown:
        raise ValueError(
            f"unknown keys {sorted(unknown)} for rope_type={rope_type!r}; it takes "
            f"{sorted(entry.required)} (required) and {sorted(entry.optional)} (optional); "
            "remove model-specific keys from the dict, or let them through with ignore_keys= (of rope_config, "
            "HFRotaryEmbedding, validate_scaling and scaled_inverse_frequencies)"
        )
    missing = {key for key in entry.required if scaling.get(key) is None}
    if missing:
        raise ValueError(f"rope_type={rope_type!r} needs keys {sorted(missing)} in scaling, got {sorted(keys)}")
    if theta is not None and scaling.get("rope_theta") is not None:
        if check_positive_float(scaling["rope_theta"], "scaling['rope_theta']") != theta:
            raise ValueError(
                f"scaling['rope_theta']={scaling['rope_theta']} disagrees with theta={theta}; pass theta={scaling['rope_theta']}"
            )
    _warn_like_transformers(rope_type, scaling, max_position_embeddings)
    return rope_type


def scaled_inverse_frequencies(
    rotary_dim: int,
    theta: float,
    scaling: Mapping[str, Any],
    *,
    max_position_embeddings: int | None = None,
    seq_len: int | torch.Tensor | None = None,
    ignore_keys: Iterable[str] = (),
) -> tuple[torch.Tensor, float]:
    r"""``(inv_freq, attention_scaling)`` for a ``rope_scaling`` dict, the inverse frequencies in float64.

    Args:
        rotary_dim: number of rotated features ``d_rot`` (even).
        theta: the base of the frequencies, ``base`` (finite, > 0).
        scaling: a Hugging Face-style ``rope_scaling`` dict; see :data:`~ropelib.scaling.registry.ROPE_SCALINGS`.
        max_position_embeddings: the model's context length (read by ``dynamic``, and as the
            default of ``original_max_position_embeddings`` / ``factor`` by the others).
        seq_len: the current sequence length (read by ``dynamic`` and ``longrope``): an int or a
            0-d integer tensor (converted to an int here, off the hot path).
        ignore_keys: model-specific keys of ``scaling`` to let through unread.

    Returns:
        ``(inv_freq, attention_scaling)``: float64 ``[d_rot/2]`` and a Python float.

    Example:
        >>> linear = {"rope_type": "linear", "factor": 2.0}
        >>> inv, s = scaled_inverse_frequencies(4, 100.0, linear)
        >>> inv.tolist(), s
        ([0.5, 0.05], 1.0)
    """
    rotary_dim = check_int(rotary_dim, "rotary_dim", minimum=2)
    if rotary_dim % 2:
        raise ValueError(f"rotary_dim must be even (features are rotated in pairs), got {rotary_dim}")
    theta = check_positive_float(theta, "theta")
    if max_position_embeddings is not None:
        max_position_embeddings = check_int(max_position_embeddings, "max_position_embeddings", minimum=1)
    seq_len = _seq_len(seq_len)
    rope_type = validate_scaling(
        scaling, theta, max_position_embeddings=max_position_embeddings, ignore_keys=ignore_keys
    )
    result = ROPE_SCALINGS[rope_type].compute(
        rotary_dim, theta, scaling, max_position_embeddings=max_position_embeddings, seq_len=seq_len
    )
    if not isinstance(result, tuple) or len(result) != 2:
        raise TypeError(
            f"the scaling function of rope_type={rope_type!r} must return (inv_freq, attention_scaling), got {result!r}"
        )
    return check_computed(rope_type, *result, rotary_dim)


def _seq_len(seq_len: object) -> int | None:
    """``seq_len`` as an int >= 0 (or None); a 0-d integer tensor (a traced length) is read here, off the hot path."""
    if isinstance(seq_len, torch.Tensor):
        check_integer_tensor(seq_len, "seq_len")
        if seq_len.ndim != 0:
            raise ValueError(f"seq_len must be an int or a 0-d integer tensor, got shape {list(seq_len.shape)}")
        if seq_len.device.type == "meta":
            raise ValueError("seq_len must be an int or a 0-d integer tensor with a value, got a meta tensor")
        seq_len = int(seq_len.item())
    return None if seq_len is None else check_int(seq_len, "seq_len", minimum=0)


def frequency_seq_len(
    scaling: Mapping[str, Any] | None,
    needed: int,
    current: int | None,
    *,
    max_position_embeddings: int | None,
) -> int | None:
    """The ``seq_len`` at which to evaluate a length-dependent scaling (the entry's ``follow_length`` rule).

    ``None`` means the original frequencies. Types whose frequencies do not depend on the length
    always give ``None``; ``dynamic`` and ``longrope`` follow Hugging Face's ``dynamic_rope_update``
    (see :func:`ropelib.scaling.dynamic.dynamic_length` and
    :func:`ropelib.scaling.longrope.longrope_length`).

    Args:
        scaling: the scaling dict (or None).
        needed: the current sequence length (largest position + 1).
        current: the ``seq_len`` the present frequencies were computed for (``None``: the original ones).
        max_position_embeddings: the model's context length.
    """
    if scaling is None:
        return None
    rule = ROPE_SCALINGS[rope_type_of(scaling)].follow_length
    return None if rule is None else rule(scaling, needed, current, max_position_embeddings)


def inverse_frequencies64(
    head_dim: int,
    theta: float = 10000.0,
    scaling: Mapping[str, Any] | None = None,
    *,
    max_position_embeddings: int | None = None,
    seq_len: int | torch.Tensor | None = None,
    partial_rotary_factor: float = 1.0,
) -> tuple[torch.Tensor, float]:
    """Like :func:`~ropelib.rope_frequencies` but in float64: the tables are built from these."""
    rotary_dim = rotary_dim_for(head_dim, partial_rotary_factor)
    theta = check_positive_float(theta, "theta")
    seq_len = _seq_len(seq_len)
    if scaling is None:
        if max_position_embeddings is not None:
            check_int(max_position_embeddings, "max_position_embeddings", minimum=1)
        return default_inverse_frequencies(rotary_dim, theta), 1.0
    if rotary_dim != head_dim and rope_type_of(scaling) == "proportional":
        raise ValueError(
            "rope_type='proportional' reads scaling['partial_rotary_factor'] and spans all of head_dim: "
            "pass partial_rotary_factor=1.0 here (and the fraction in the dict, as transformers does)"
        )
    return scaled_inverse_frequencies(
        rotary_dim, theta, scaling, max_position_embeddings=max_position_embeddings, seq_len=seq_len
    )


def rope_frequencies(
    head_dim: int,
    theta: float = 10000.0,
    scaling: Mapping[str, Any] | None = None,
    *,
    max_position_embeddings: int | None = None,
    seq_len: int | torch.Tensor | None = None,
    partial_rotary_factor: float = 1.0,
) -> tuple[torch.Tensor, float]:
    r"""RoPE's inverse frequencies and the factor that multiplies cos and sin.

    Without scaling, ``inv_freq[i] = base^{-2i/d_rot}`` with ``d_rot = int(head_dim * partial_rotary_factor)``
    the number of rotated features (RoFormer eq. 15), and the factor is 1.

    Args:
        head_dim: per-head width ``d`` (even).
        theta: the base (10000 in RoFormer, 500000 in Llama 3, 1e6 in the seed and Qwen2).
        scaling: a Hugging Face-style ``rope_scaling`` dict, or ``None``. See :mod:`ropelib.scaling`.
        max_position_embeddings: the model's context length (read by some scalings).
        seq_len: the current sequence length (read by dynamic NTK): an int, or a 0-d integer
            tensor (read on the host here: this is not a hot-path function).
        partial_rotary_factor: fraction of ``head_dim`` that is rotated.

    Returns:
        ``(inv_freq, attention_scaling)``: a float32 tensor of ``d_rot // 2`` inverse frequencies
        (computed in float64, then rounded once) and a Python float.

    Example:
        >>> inv_freq, scale = rope_frequencies(8, theta=10000.0)
        >>> inv_freq
        tensor([1.0000, 0.1000, 0.0100, 0.0010])
        >>> inv_freq.dtype, inv_freq[1].item(), scale  # float32's 0.1
        (torch.float32, 0.10000000149011612, 1.0)
    """
    inv_freq, attention_scaling = inverse_frequencies64(
        head_dim,
        theta,
        scaling,
        max_position_embeddings=max_position_embeddings,
        seq_len=seq_len,
        partial_rotary_factor=partial_rotary_factor,
    )
    return inv_freq.to(torch.float32), attention_scaling
