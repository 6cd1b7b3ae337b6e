r"""Make a Hugging Face ``transformers`` model compute its RoPE with ropelib: the public API.

Models of a known family (:mod:`~ropelib.integrations.huggingface.families`) do RoPE in two places:

1. one rotary module per model, called once per forward pass, turns ``position_ids``
   (``[batch, seq]``; ``[3, batch, seq]`` for M-RoPE) into tables such as ``cos, sin`` of shape
   ``[batch, seq, d_rot]`` (once per layer type for Gemma 3);
2. a function of the modeling module (``apply_rotary_pos_emb(q, k, cos, sin)`` and kin, see
   :data:`~ropelib.integrations.huggingface.apply.SIGNATURES`), called by every attention layer
   that uses RoPE on ``q, k`` of shape ``[batch, heads, seq, head_dim]``.

:func:`~ropelib.patch_hf_rope` swaps each (1) for an :class:`~ropelib.HFRotaryEmbedding`, which builds the
tables with ropelib from the model's config, and wraps each (2) so that tables made by ropelib
are applied by ropelib's kernels (:class:`~ropelib.integrations.huggingface.apply.RopelibApply`).
The wrapper recognises ropelib's tables by identity and version and hands every other call to the
original function untouched, so an unpatched model in the same process computes exactly what it
did before. The wrapper keeps the patched modules that use it; unpatching the last one puts the
original function back.

This package never imports ``transformers``: it reads the model's modules and config only.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from types import ModuleType
from typing import TypeVar

from torch import nn

from ..._validation import check_choice
from ...kernels.registry import KERNEL_CHOICES
from .apply import RopelibApply
from .families import FAMILIES, REFUSED, Family, family_of
from .module import HFRotaryEmbedding, config_dict
from .probes import probe_apply, probe_tables

ModelT = TypeVar("ModelT", bound=nn.Module)


def _modeling_modules(model: nn.Module, family: Family) -> list[ModuleType]:
    """The Python modules of ``model``'s classes that define the family's apply function."""
    found: dict[str, ModuleType] = {}
    for module in model.modules():
        name = type(module).__module__
        py_module = sys.modules.get(name)
        if py_module is not None and callable(getattr(py_module, family.apply_name, None)):
            found[name] = py_module
    return list(found.values())


def _targets(model: nn.Module) -> list[tuple[str, nn.Module, Family]]:
    """The rotary modules of ``model`` that a known family takes, by name, with their family."""
    found = []
    for name, module in model.named_modules():
        if isinstance(module, HFRotaryEmbedding):
            continue
        family = family_of(module)
        if family is not None:
            found.append((name, module, family))
    return found


def _config_of(model: nn.Module, name: str, module: nn.Module) -> object:
    """The rotary module's own ``config``, else that of its nearest parent (GPT-J's module has none)."""
    config = getattr(module, "config", None)
    parts = name.split(".")
    while config is None and parts:
        parts.pop()
        config = getattr(model.get_submodule(".".join(parts)), "config", None)
    if config is None:
        raise ValueError(f"model's {name} has no config (nor has any module above it) to read its RoPE from")
    return config


def _ignored_keys(config: object) -> frozenset[str]:
    """The config class's ``ignore_keys_at_rope_validation`` (model-specific keys of its rope parameters), as transformers reads them."""
    keys = getattr(config, "ignore_keys_at_rope_validation", None)
    return (
        frozenset(k for k in keys if isinstance(k, str))
        if isinstance(keys, (set, frozenset, list, tuple))
        else frozenset()
    )


def _replacement(model: nn.Module, name: str, original: nn.Module, family: Family, kernel: str) -> HFRotaryEmbedding:
    """The :class:`HFRotaryEmbedding` for ``original``, built from the config as the family's row says."""
    config = _config_of(model, name, original)
    mrope_section = None
    if family.mrope is not None:
        mrope_section = getattr(original, "mrope_section", None)
        if mrope_section is None:
            raise ValueError(f"model's {name} has no mrope_section attribute to split the frequency pairs by")
    return HFRotaryEmbedding(
        config,
        kernel=kernel,
        original=original,
        output=family.output,
        rope_options=family.options(config_dict(config), _ignored_keys(config)),
        mrope_section=mrope_section,
        mrope_interleaved=family.mrope == "interleaved",
    )


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, attr, module)


def patch_hf_rope(model: ModelT, *, kernel: str = "auto") -> ModelT:
    r"""Make a ``transformers`` model of a known family compute RoPE with ropelib; returns ``model``.

    Replaces every rotary module of ``model`` by an :class:`HFRotaryEmbedding` built from the same
    config, and wraps the apply function of the model's modeling module(s) so that ropelib applies
    ropelib's tables. For the Llama template the rotation is RoFormer's (Su et al., 2024,
    section 3.4.2) in the ``"half"`` layout of GPT-NeoX and ``transformers``:

    .. math::

        x' = x \odot \cos(p\,\theta) + \mathrm{rotate\_half}(x) \odot \sin(p\,\theta),

    with ``theta`` the vector of frequencies ``theta_i`` (the model's ``inv_freq``, each written twice) of the
    config's ``rope_type`` (any entry of
    :data:`~ropelib.scaling.registry.ROPE_SCALINGS`). The other rows of
    :data:`~ropelib.integrations.huggingface.families.FAMILIES` rotate adjacent pairs,
    ``(x_{2i}, x_{2i+1}) -> (x_{2i} c_i - x_{2i+1} s_i, x_{2i+1} c_i + x_{2i} s_i)`` (GLM, Cohere,
    GPT-J; Llama 4 in Meta's complex form ``z_i e^{i p theta_i}``), take one RoPE setting per layer type
    (Gemma 3), or take pair ``i``'s position from its axis of three (M-RoPE: Qwen2-VL, Qwen2.5-VL,
    Qwen3-VL; :mod:`ropelib.rotary.mrope`). Weights, buffers and the state dict are unchanged;
    in float32, logits agree with the unpatched model's up to rounding, chiefly that of transformers'
    float32 angles (ropelib forms them in float64), an error that grows with the position; in
    bfloat16 the two rotate with different arithmetic and agree to bfloat16 rounding.
    A model cast with ``model.to(torch.bfloat16)`` has had its ``inv_freq`` buffer rounded to
    bfloat16 by the cast (8 significant bits: each frequency off by up to 2^-8 of itself, angles by up to
    ``p * theta_i * 2^-8``); ropelib's tables are built from the config,
    so the patch also removes that error, which grows with the position.

    Before changing anything it checks, on positions ``0 .. 63``, that ropelib's tables match the
    model's own and that the model's apply function is the rotation ropelib applies; otherwise it
    raises :class:`ValueError` and leaves the model as it was. Patching a patched model does nothing.

    Args:
        model: a ``transformers`` model (e.g. ``LlamaForCausalLM``, ``Qwen2ForCausalLM``,
            ``GlmForCausalLM``, ``GPTJForCausalLM``, ``Llama4ForCausalLM``, ``Gemma3ForCausalLM``,
            ``Qwen2VLForConditionalGeneration``) or any module containing one, with real (not meta)
            tensors. Vision rotary modules (2-D axial RoPE of a vision tower) are left alone.
        kernel: ``"auto"``, ``"torch"``, ``"native"`` or ``"triton"`` (:func:`~ropelib.choose_kernel`).

    Returns:
        The same ``model`` object, patched in place.

    Example:
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> config = LlamaConfig(hidden_size=32, intermediate_size=64,
        ...     num_hidden_layers=1, num_attention_heads=2, vocab_size=50)
        >>> model = patch_hf_rope(LlamaForCausalLM(config))
        >>> type(model.model.rotary_emb).__name__
        'HFRotaryEmbedding'
        >>> type(unpatch_hf_rope(model).model.rotary_emb).__name__
        'LlamaRotaryEmbedding'
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    kernel = check_choice(kernel, "kernel", KERNEL_CHOICES)
    targets = _targets(model)
    if not targets:
        if any(isinstance(m, HFRotaryEmbedding) for m in model.modules()):
            return model
        names = ", ".join(family.name for family in FAMILIES)
        raise ValueError(
            f"model has no rotary module of a known family ({names}; a *RotaryEmbedding module with a config "
            "and inv_freq) to replace"
        )
    for name, original, _ in targets:
        model_type = getattr(getattr(original, "config", None), "model_type", None)
        if isinstance(model_type, str) and model_type in REFUSED:
            raise ValueError(f"model's {name} is a {model_type!r} rotary module, not patched: {REFUSED[model_type]}")
        if any(buffer.is_meta for buffer in original.buffers()):
            raise ValueError(
                f"model's {name} is on the meta device (no values to compare with); materialise the model "
                "(e.g. model.to_empty(device=...) and load its weights) before patching"
            )
    py_modules: dict[Family, list[ModuleType]] = {}
    for _, _, family in targets:
        if family not in py_modules:
            py_modules[family] = _modeling_modules(model, family)
            if not py_modules[family]:
                raise ValueError(
                    f"model's modeling module has no {family.apply_name} function to route through ropelib"
                )

    replacements = []
    for name, original, family in targets:
        replacement = _replacement(model, name, original, family, kernel)
        device = next(original.buffers()).device  # every family's module has a frequency buffer
        for tables, _ in probe_tables(original, replacement, device).values():
            for py_module in py_modules[family]:
                probe_apply(py_module, family, replacement, tables)
        replacements.append((name, replacement, family))

    for name, replacement, family in replacements:
        _set_submodule(model, name, replacement)
        for py_module in py_modules[family]:
            current = getattr(py_module, family.apply_name)
            if not isinstance(current, RopelibApply):
                current = RopelibApply(current, family.signature, family.layout)
                setattr(py_module, family.apply_name, current)
            current.users.add(replacement)
    return model


def unpatch_hf_rope(model: ModelT) -> ModelT:
    """Undo :func:`~ropelib.patch_hf_rope`: put the original rotary modules back; returns ``model``.

    When no patched model is left in the process, the modeling modules' apply functions are
    restored too. Unpatching an unpatched model does nothing.

    Example:
        >>> layer = torch.nn.Linear(2, 2)  # nothing to undo
        >>> unpatch_hf_rope(layer) is layer
        True
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    removed = []
    for name, module in list(model.named_modules()):
        if isinstance(module, HFRotaryEmbedding) and module.original is not None:
            _set_submodule(model, name, module.original)
            removed.append(module)
    for py_module in {sys.modules.get(type(m).__module__) for m in model.modules()} - {None}:
        for attr, wrapper in list(vars(py_module).items()):
            if isinstance(wrapper, RopelibApply):
                for module in removed:
                    wrapper.users.discard(module)
                if not len(wrapper.users):  # no patched model uses it any more
                    setattr(py_module, attr, wrapper.original)
    return model


@contextlib.contextmanager
def use_ropelib_rope(model: ModelT, *, kernel: str = "auto") -> Iterator[ModelT]:
    """Context manager: ``model`` computes RoPE with ropelib inside the block, as before after it.

    Example:
        >>> from transformers import Qwen2Config, Qwen2ForCausalLM
        >>> config = Qwen2Config(hidden_size=32, intermediate_size=64,
        ...     num_hidden_layers=1, num_attention_heads=2,
        ...     num_key_value_heads=1, vocab_size=50)
        >>> model = Qwen2ForCausalLM(config)
        >>> with use_ropelib_rope(model):
        ...     type(model.model.rotary_emb).__name__
        'HFRotaryEmbedding'
        >>> type(model.model.rotary_emb).__name__
        'Qwen2RotaryEmbedding'
    """
    patch_hf_rope(model, kernel=kernel)
    try:
        yield model
    finally:
        unpatch_hf_rope(model)
