"""Reading a model's ``config.json`` (Hugging Face keys) into :class:`~ropelib.RotaryEmbedding` arguments."""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Any

from ._validation import check_int, check_positive_float
from .frequencies import rotary_dim_for
from .scaling import ROPE_SCALINGS, rope_type_of, scaled_inverse_frequencies, validate_scaling
from .scaling.registry import key_names

_CONFIG_ONLY_KEYS = ("rope_theta", "partial_rotary_factor")

#: Names of ``type`` that ``transformers`` configs rename, beside the ``rope_type`` they become:
#: Qwen2-VL / Qwen2.5-VL's ``"mrope"`` (default frequencies, pairs split by ``mrope_section``) and
#: Phi-3's ``"su"`` and ``"yarn"`` (LongRoPE, by its earlier names; ``"yarn"`` so only in Phi-3).
LEGACY_TYPES: Mapping[tuple[str | None, str], str] = MappingProxyType(
    {
        (None, "mrope"): "default",
        (None, "su"): "longrope",
        ("phi3", "yarn"): "longrope",
    }
)
#: The keys of M-RoPE's parameters, read by :class:`~ropelib.MRotaryEmbedding` rather than the scaling.
MROPE_KEYS = ("mrope_section", "mrope_interleaved")
#: Top-level keys of older ``config.json`` files that ``transformers`` reads as RoPE keys (GPT-NeoX).
LEGACY_KEYS: Mapping[str, str] = MappingProxyType(
    {"rotary_emb_base": "rope_theta", "rotary_pct": "partial_rotary_factor"}
)
#: Defaults ``transformers`` gives a model type where its config has none (GPT-NeoX rotates a quarter).
MODEL_DEFAULTS: Mapping[str, Mapping[str, Any]] = MappingProxyType(
    {"gpt_neox": MappingProxyType({"partial_rotary_factor": 0.25})}
)


def _warn(message: str) -> None:
    warnings.warn(message, UserWarning, stacklevel=3)  # at the caller of rope_config


def _legacy_name(name: object, model_type: object) -> object:
    """A ``rope_type`` / ``type`` value as ``transformers`` renames it (``LEGACY_TYPES``)."""
    if not isinstance(name, str):
        return name
    return LEGACY_TYPES.get(
        (None, name), LEGACY_TYPES.get((model_type if isinstance(model_type, str) else None, name), name)
    )


def standard_rope_parameters(params: Mapping[str, Any], model_type: object = None) -> tuple[dict[str, Any], bool]:
    """A flat rope parameters dict as ``transformers`` standardises it: one ``rope_type``; whether it is M-RoPE.

    ``rope_type`` comes first, then ``type`` (its former name); ``LEGACY_TYPES`` are renamed.
    ``type`` beside ``rope_type`` is dropped: where it names another scaling, ``rope_type`` is used
    (as in transformers) and a :class:`UserWarning` says so.
    """
    params = dict(params)
    given = params.pop("type", None)
    mrope = "mrope" in (given, params.get("rope_type"))
    rope_type = _legacy_name(params.get("rope_type", given), model_type)
    if rope_type is not None:
        params["rope_type"] = rope_type
    elif params:
        params["rope_type"] = "default"
    if given is not None and "rope_type" in params and _legacy_name(given, model_type) != params["rope_type"]:
        _warn(
            f"rope parameters have rope_type={params['rope_type']!r} and type={given!r}; rope_type is used "
            "(transformers reads type only where rope_type is missing)"
        )
    return params, mrope


def _config_value(config: Mapping[str, Any], params: Mapping[str, Any], key: str) -> Any:
    """``key`` from the config's top level or from ``rope_parameters``; the two must agree when both are set."""
    top, inner = config.get(key), params.get(key)
    if top is not None and inner is not None and top != inner:
        raise ValueError(f"config[{key!r}]={top} disagrees with the rope parameters' {key}={inner}")
    return top if top is not None else inner


def rope_config(config: Mapping[str, Any], *, ignore_keys: Iterable[str] = ()) -> dict[str, Any]:
    """The :class:`~ropelib.RotaryEmbedding` arguments of a model's ``config.json`` dict.

    Reads the keys Hugging Face configs use: ``head_dim`` (else ``hidden_size //
    num_attention_heads``), ``rope_theta`` (default 10000), ``partial_rotary_factor`` (default 1),
    ``max_position_embeddings``, ``original_max_position_embeddings`` (top level, as in Phi-3), and
    the scaling from ``rope_parameters`` (newer configs, which may also hold ``rope_theta`` and
    ``partial_rotary_factor``) or ``rope_scaling`` (older ones). A per-layer-type
    ``rope_parameters`` (one dict per attention kind) is rejected: pass one layer type's dict.

    ``ignore_keys`` names model-specific keys of the rope parameters that are not RoPE scaling
    (Qwen2-VL's ``mrope_section``, say): they are dropped, as ``transformers``' ``ignore_keys`` lets them through.

    Configs as released are read as ``transformers`` reads them (:func:`~ropelib.config.standard_rope_parameters`):
    ``type`` for ``rope_type`` (beside it, ``rope_type`` wins), Qwen2-VL's ``"mrope"`` (default
    frequencies; ``mrope_section`` then let through, for :class:`~ropelib.MRotaryEmbedding`),
    Phi-3's ``"su"``, ``rope_scaling`` beside the ``rope_parameters`` transformers writes from it,
    and GPT-NeoX's ``rotary_emb_base`` / ``rotary_pct`` (a quarter of the head by default).

    ``rope_type="proportional"`` keeps ``partial_rotary_factor`` in its dict and ``rotary_dim`` is
    ``head_dim``, as in transformers (:func:`~ropelib.scaling.proportional.proportional_scaling`).

    Returns:
        A dict with ``head_dim``, ``theta``, ``rotary_dim``, ``scaling`` (None for plain RoPE) and
        ``max_position_embeddings``.

    Example:
        >>> llama31 = {
        ...     "hidden_size": 4096,
        ...     "num_attention_heads": 32,
        ...     "rope_theta": 500000.0,
        ...     "max_position_embeddings": 131072,
        ...     "rope_scaling": {
        ...         "rope_type": "llama3",
        ...         "factor": 8.0,
        ...         "low_freq_factor": 1.0,
        ...         "high_freq_factor": 4.0,
        ...         "original_max_position_embeddings": 8192,
        ...     },
        ... }
        >>> rope_config(llama31)["rotary_dim"]
        128
    """
    if not isinstance(config, Mapping):
        raise TypeError(f"config must be a dict (a parsed config.json), got {type(config).__name__}")
    model_type = config.get("model_type")
    config = dict(config)
    for old_key, key in LEGACY_KEYS.items():
        if config.get(old_key) is not None and config.get(key) is None:
            config[key] = config[old_key]
    params, legacy = config.get("rope_parameters"), config.get("rope_scaling")
    for name, value in (("rope_parameters", params), ("rope_scaling", legacy)):
        if value is not None and not isinstance(value, Mapping):
            raise TypeError(f"config[{name!r}] must be a dict or null, got {type(value).__name__}")
    nested = [key for key, value in (params or legacy or {}).items() if isinstance(value, Mapping)]
    if nested:
        raise ValueError(
            f"config['rope_parameters'] holds one dict per layer type {nested}; build one RotaryEmbedding per "
            "layer type from a config whose rope_parameters is that layer type's dict"
        )
    mrope = False
    if params or legacy:
        (params, mrope_params), (legacy, mrope_legacy) = (
            standard_rope_parameters(p or {}, model_type) for p in (params, legacy)
        )
        mrope = mrope_params or mrope_legacy
        # transformers writes rope_theta and partial_rotary_factor into rope_parameters: compare the rest
        if (
            params
            and legacy
            and {k: v for k, v in params.items() if k not in _CONFIG_ONLY_KEYS}
            != {k: v for k, v in legacy.items() if k not in _CONFIG_ONLY_KEYS}
        ):
            raise ValueError("config has both 'rope_parameters' and 'rope_scaling' and they differ; keep one")
        params = {**legacy, **params}
    params = dict(params or {})
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
    if partial is None and isinstance(model_type, str):
        partial = MODEL_DEFAULTS.get(model_type, {}).get("partial_rotary_factor")
    max_positions = config.get("max_position_embeddings")
    if max_positions is not None:
        max_positions = check_int(max_positions, "config['max_position_embeddings']", minimum=1)
    dropped = set(_CONFIG_ONLY_KEYS) | key_names(ignore_keys, "ignore_keys") | (set(MROPE_KEYS) if mrope else set())
    scaling = {k: v for k, v in params.items() if k not in dropped}
    rope_type = rope_type_of(scaling) if scaling else "default"
    if rope_type == "proportional":
        # transformers' proportional RoPE spans the whole head and reads the fraction from its dict
        # (where it puts a top-level partial_rotary_factor): int(p * head_dim // 2) pairs rotate,
        # a number that int(head_dim * p) need not be twice of (head_dim 12, p 0.25: 1 pair).
        rotary_dim = rotary_dim_for(head_dim, 1.0)
        if partial is not None:
            scaling["partial_rotary_factor"] = partial
    else:
        rotary_dim = rotary_dim_for(head_dim, 1.0 if partial is None else partial)
    entry = ROPE_SCALINGS[rope_type]
    reads_original = "original_max_position_embeddings" in entry.required | entry.optional
    if config.get("original_max_position_embeddings") is not None and reads_original:
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
