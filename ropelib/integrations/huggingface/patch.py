r"""Make a Hugging Face ``transformers`` model compute its RoPE with ropelib.

Llama-family models in ``transformers`` (Llama, Qwen2, Mistral, Qwen3, Gemma, OLMo and others
generated from the same template) do RoPE in two places:

1. one ``*RotaryEmbedding`` module per model, called once per forward pass, turns
   ``position_ids`` (``[batch, seq]``) into ``cos, sin`` tables of shape ``[batch, seq, r]``:
   the ``r/2`` angles ``p * inv_freq[i]`` written twice (the ``"half"`` layout), times the
   attention scaling;
2. a function ``apply_rotary_pos_emb(q, k, cos, sin)`` of the modeling module, called by every
   attention layer on ``q, k`` of shape ``[batch, heads, seq, head_dim]``:
   ``x * cos + rotate_half(x) * sin``.

:func:`~ropelib.patch_hf_rope` swaps each (1) for :class:`HFRotaryEmbedding`, which builds the tables with
ropelib from the model's config (angles in float64, the scalings of :mod:`ropelib.scaling`),
and wraps each (2) so that tables made by ropelib are applied by ropelib
(:func:`ropelib.apply_rotary`, or the fused kernel where the backend has one). The wrapper
recognises ropelib's tables by identity and hands every other call to the original function
untouched, so an unpatched model in the same process computes exactly what it did before.

This module never imports ``transformers``: it reads the model's modules and config only.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any, TypeVar

import torch
from torch import nn

from .._validation import check_choice
from ..kernels import rotary_qk
from ..rotary import BACKENDS, RotaryEmbedding, apply_rotary
from ..scaling import rope_type_of

#: The ``rope_type`` values whose Hugging Face behaviour :class:`HFRotaryEmbedding` reproduces
#: (each is checked against ``transformers`` in the tests).
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")

# Largest difference between Hugging Face's tables and ropelib's that the patch-time probe
# accepts. Hugging Face forms the angle p * inv_freq in float32: inv_freq and the product are
# each rounded (relative error <= 2^-24 each), so at the probe's largest position p = 63 and
# inv_freq <= 1 the angle is off by <= 63 * 2 * 2^-24 = 7.5e-6 rad, and cos/sin by as much
# (times an attention scaling below 1.5). A different layout or frequency is off by >= 1e-2.
_PROBE_ATOL = 3e-5
_PROBE_POSITIONS = 64

# The name of the function each modeling module defines and its attention layers call.
_APPLY = "apply_rotary_pos_emb"

ModelT = TypeVar("ModelT", bound=nn.Module)


# ----------------------------------------------------------------------------- tables


@dataclass
class _Tables:
    """ropelib's half-width tables behind one pair of Hugging Face-format ``cos, sin`` tensors."""

    cos: weakref.ref[torch.Tensor]
    sin: weakref.ref[torch.Tensor]
    cos_half: torch.Tensor
    sin_half: torch.Tensor
    backend: str


# id(cos) -> its tables, for as long as the cos tensor that HFRotaryEmbedding returned is alive.
_TABLES: dict[int, _Tables] = {}


def _remember(
    cos: torch.Tensor, sin: torch.Tensor, cos_half: torch.Tensor, sin_half: torch.Tensor, backend: str
) -> None:
    key = id(cos)

    def forget(ref: weakref.ref[torch.Tensor]) -> None:
        entry = _TABLES.get(key)
        if entry is not None and entry.cos is ref:
            del _TABLES[key]

    _TABLES[key] = _Tables(weakref.ref(cos, forget), weakref.ref(sin), cos_half, sin_half, backend)


def _lookup(cos: object, sin: object) -> _Tables | None:
    entry = _TABLES.get(id(cos))
    if entry is None or entry.cos() is not cos or entry.sin() is not sin:
        return None
    return entry


def _config_dict(config: Any) -> dict[str, Any]:
    """A ``transformers`` config (anything with ``to_dict()``) or a ``config.json`` dict, as a dict."""
    if isinstance(config, Mapping):
        return dict(config)
    to_dict = getattr(config, "to_dict", None)
    if not callable(to_dict):
        raise TypeError(f"config must be a transformers config (with to_dict()) or a dict, got {type(config).__name__}")
    return dict(to_dict())


def _check_position_ids(position_ids: object) -> torch.Tensor:
    if not isinstance(position_ids, torch.Tensor):
        raise TypeError(f"position_ids must be an integer torch.Tensor, got {type(position_ids).__name__}")
    if position_ids.dtype.is_floating_point or position_ids.dtype.is_complex or position_ids.dtype == torch.bool:
        raise TypeError(f"position_ids must be an integer tensor, got {position_ids.dtype}")
    if position_ids.ndim not in (1, 2):
        raise ValueError(f"position_ids must have shape [seq] or [batch, seq], got {list(position_ids.shape)}")
    return position_ids.long()


class HFRotaryEmbedding(nn.Module):
    r"""A drop-in for a ``transformers`` ``*RotaryEmbedding`` module, computed by ropelib.

    ``forward(x, position_ids)`` returns what the Hugging Face module returns: tables with
    ``cos[b, s, i] = cos[b, s, i + r/2] = a * cos(p * f_i)`` and ``sin`` likewise, where
    ``p = position_ids[b, s]``, ``f_i`` are the (scaled) inverse frequencies of the config's
    ``rope_type`` and ``a`` its attention scaling (YaRN's ``0.1 ln(factor) + 1``, LongRoPE's
    ``sqrt(1 + ln s / ln L)``; 1 otherwise). Each of the ``r/2`` angles is written twice because
    ``transformers`` rotates in the ``"half"`` layout (GPT-NeoX's form of RoFormer, Su et al., 2021,
    section 3.4.2).

    The tables come from a :class:`ropelib.RotaryEmbedding` built by
    :meth:`~ropelib.RotaryEmbedding.from_config`: angles formed in float64 and rounded once (where
    ``transformers`` forms them in float32), the scalings of :mod:`ropelib.scaling`, and for
    ``"dynamic"`` and ``"longrope"`` the same length-following rule as ``transformers``'
    ``dynamic_rope_update``.

    Args:
        config: the model's ``transformers`` config, or its ``config.json`` dict (read by
            :func:`ropelib.rope_config`).
        backend: how the patched ``apply_rotary_pos_emb`` rotates with these tables:
            ``"auto"``, ``"torch"`` or ``"triton"`` (see :class:`ropelib.RotaryEmbedding`).
        original: the module this one replaces; :func:`unpatch_hf_rope` puts it back.

    Shapes:
        ``x``: any tensor (only its dtype and device are read); ``position_ids``: integers of
        shape ``[batch, seq]`` or ``[seq]``. Returns ``(cos, sin)``, each ``[batch, seq, r]``
        (``[1, seq, r]`` for 1-D positions) in ``x``'s dtype; ``r`` is the rotary dimension.

    Example:
        >>> config = {"hidden_size": 32, "num_attention_heads": 4, "max_position_embeddings": 64}
        >>> cos, sin = HFRotaryEmbedding(config)(torch.zeros(1), torch.tensor([[0, 1, 2]]))
        >>> cos.shape, cos[0, 0].tolist() == [1.0] * 8, sin[0, 0].tolist() == [0.0] * 8
        (torch.Size([1, 3, 8]), True, True)
    """

    def __init__(self, config: Any, *, backend: str = "auto", original: nn.Module | None = None) -> None:
        super().__init__()
        self.backend = check_choice(backend, "backend", BACKENDS)
        self.config = config
        self.rope = RotaryEmbedding.from_config(_config_dict(config), layout="half", backend=backend)
        self.rope_type = "default" if self.rope.scaling is None else rope_type_of(self.rope.scaling)
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope_type must be one of {list(SUPPORTED_ROPE_TYPES)}, got {self.rope_type!r}")
        self._original = (original,)  # a tuple, so that the replaced module is not a submodule

    @property
    def original(self) -> nn.Module | None:
        """The ``transformers`` module this one replaced (None when built directly)."""
        return self._original[0]

    @property
    def inv_freq(self) -> torch.Tensor:
        """The float32 inverse frequencies in use, ``[r/2]`` (the Hugging Face attribute)."""
        return self.rope.inv_freq

    @property
    def attention_scaling(self) -> float:
        """The factor that multiplies cos and sin (the Hugging Face attribute)."""
        return self.rope.attention_scaling

    def forward(
        self, x: torch.Tensor, position_ids: torch.Tensor, layer_type: str | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if layer_type is not None:
            raise ValueError(f"layer_type must be None (one RoPE setting for all layers), got {layer_type!r}")
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        positions = _check_position_ids(position_ids)
        compute = torch.float64 if x.dtype == torch.float64 else torch.float32
        if positions.numel() and int(positions.min()) < 0:
            # transformers accepts negative positions (at padded slots); the float32 cache has rows
            # for positions >= 0 only, so these tables are computed afresh (in float64).
            cos_half, sin_half = (t.to(compute) for t in self.rope.cos_sin(positions, torch.float64))
        else:
            cos_half, sin_half = self.rope.cos_sin(positions, compute)
        if positions.ndim == 1:
            cos_half, sin_half = cos_half[None], sin_half[None]
        cos = torch.cat((cos_half, cos_half), dim=-1).to(x.dtype)
        sin = torch.cat((sin_half, sin_half), dim=-1).to(x.dtype)
        _remember(cos, sin, cos_half, sin_half, self.backend)
        return cos, sin

    def extra_repr(self) -> str:
        return f"rope_type={self.rope_type!r}, backend={self.backend!r}"


# ----------------------------------------------------------------------------- apply_rotary_pos_emb


def _rotate_qk(q: torch.Tensor, k: torch.Tensor, tables: _Tables) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q, k`` (``[batch, seq, heads, d]``) by ropelib's tables with :func:`ropelib.kernels.rotary_qk`.

    The per-token tables are handed to the fused operator as its ``[rows, r/2]`` table with the
    default positions ``0 .. rows-1``: one row per token, so the operator needs no position
    checks (no device synchronisation) and dynamic or negative positions need no special case.
    """
    cos, sin = tables.cos_half, tables.sin_half  # [1 or batch, seq, r/2]
    if cos.shape[0] == 1:  # one row of positions shared by the whole batch
        return rotary_qk(q, k, cos[0], sin[0], layout="half", kernel=tables.backend)
    batch, seq = q.shape[:2]
    flat_q, flat_k = q.reshape(1, batch * seq, *q.shape[2:]), k.reshape(1, batch * seq, *k.shape[2:])
    rows = batch * seq
    out_q, out_k = rotary_qk(
        flat_q, flat_k, cos.reshape(rows, -1), sin.reshape(rows, -1), layout="half", kernel=tables.backend
    )
    return out_q.view(q.shape), out_k.view(k.shape)


class _RopelibApply:
    """Stands in for a modeling module's ``apply_rotary_pos_emb``.

    Calls whose ``cos``/``sin`` come from :class:`HFRotaryEmbedding` are rotated by ropelib; any
    other call goes to the original function with its arguments unchanged.
    """

    def __init__(self, original: Callable[..., Any]) -> None:
        self.original = original
        functools.update_wrapper(self, original)

    def __call__(self, q: Any, k: Any, cos: Any, sin: Any, *args: Any, **kwargs: Any) -> Any:
        tables = _lookup(cos, sin)
        unsqueeze_dim = kwargs.get("unsqueeze_dim", 1)
        if (
            tables is None
            or args
            or set(kwargs) - {"unsqueeze_dim"}
            or unsqueeze_dim not in (1, 2)
            or not isinstance(q, torch.Tensor)
            or not isinstance(k, torch.Tensor)
            or q.ndim != 4
            or k.ndim != 4
            or tables.cos_half.shape[0] not in (1, q.shape[0])
            or tables.cos_half.shape[1] != q.shape[3 - unsqueeze_dim]  # the seq dimension
        ):
            return self.original(q, k, cos, sin, *args, **kwargs)
        if unsqueeze_dim == 1:  # [batch, heads, seq, d] -> ropelib's [batch, seq, heads, d]
            q, k = q.transpose(1, 2), k.transpose(1, 2)
        q, k = _rotate_qk(q, k, tables)
        if unsqueeze_dim == 1:
            q, k = q.transpose(1, 2), k.transpose(1, 2)
        return q, k


# modeling module name -> the wrapper installed there
_WRAPPED: dict[str, _RopelibApply] = {}
# every HFRotaryEmbedding that patch_hf_rope put into a model and unpatch_hf_rope has not taken out
_INSTALLED: weakref.WeakSet[HFRotaryEmbedding] = weakref.WeakSet()


def _modeling_modules(model: nn.Module) -> list[ModuleType]:
    """The Python modules of ``model``'s classes that define ``apply_rotary_pos_emb``."""
    found: dict[str, ModuleType] = {}
    for module in model.modules():
        name = type(module).__module__
        py_module = sys.modules.get(name)
        if py_module is not None and callable(getattr(py_module, _APPLY, None)):
            found[name] = py_module
    return list(found.values())


def _unwrapped_apply(py_module: ModuleType) -> Callable[..., Any]:
    fn = getattr(py_module, _APPLY)
    return fn.original if isinstance(fn, _RopelibApply) else fn


# ----------------------------------------------------------------------------- checks at patch time


def _probe_tables(
    original: nn.Module, replacement: HFRotaryEmbedding, device: torch.device
) -> tuple[torch.Tensor, ...]:
    """Compare both modules' tables at positions below ``max_position_embeddings`` (no dynamic growth)."""
    # After model.to(torch.bfloat16) the original's inv_freq buffer is rounded to 16 bits (eps 2^-7), and its
    # angles p * inv_freq are off by up to p * eps: then only the first few positions are compared, with a
    # tolerance of that size, which still tells a layout or scaling apart (differences of 0.1 and more).
    eps = torch.finfo(original.get_buffer("inv_freq").dtype).eps
    n = _PROBE_POSITIONS if eps <= torch.finfo(torch.float32).eps else 4
    max_positions = replacement.rope.max_position_embeddings
    n = n if max_positions is None else min(n, max_positions)
    atol = _PROBE_ATOL + 2 * (n - 1) * eps
    x = torch.zeros(1, device=device)
    positions = torch.arange(n, device=device)[None]
    with torch.no_grad():
        expected = original(x, positions)
        got = replacement(x, positions)
    for want, have, label in zip(expected, got, ("cos", "sin")):
        if want.shape != have.shape or not torch.allclose(want.float(), have.float(), rtol=0.0, atol=atol):
            raise ValueError(
                f"{type(original).__name__} computes {label} tables that ropelib does not reproduce "
                f"(a layout or scaling this integration does not know); the model was left unpatched"
            )
    return got


def _probe_apply(py_module: ModuleType, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Check that ``py_module.apply_rotary_pos_emb`` is the ``"half"`` rotation that ropelib applies."""
    original = _unwrapped_apply(py_module)
    generator = torch.Generator().manual_seed(0)
    head_dim = cos.shape[-1]
    # Heads 2 and 1 (as in GQA); a head_dim larger than the tables for partial rotary factors.
    q = torch.randn(1, 2, cos.shape[1], head_dim, generator=generator).to(cos.device)
    k = torch.randn(1, 1, cos.shape[1], head_dim, generator=generator).to(cos.device)
    tables = _lookup(cos, sin)
    assert tables is not None  # made by HFRotaryEmbedding just before
    try:
        with torch.no_grad():
            want_q, want_k = original(q, k, cos, sin)
    except Exception as error:  # any failure means the function is not the one we replace
        raise ValueError(
            f"{py_module.__name__}.apply_rotary_pos_emb does not take (q, k, cos, sin): {error}"
        ) from error
    # ropelib's reference rotation (the backends are checked against it in ropelib's own tests)
    got_q = apply_rotary(q.transpose(1, 2), tables.cos_half, tables.sin_half, layout="half").transpose(1, 2)
    got_k = apply_rotary(k.transpose(1, 2), tables.cos_half, tables.sin_half, layout="half").transpose(1, 2)
    # Same float32 products and sums in both, so they agree to a few ulps of |x| ~ 4.
    if not (torch.allclose(want_q, got_q, atol=1e-5) and torch.allclose(want_k, got_k, atol=1e-5)):
        raise ValueError(
            f"{py_module.__name__}.apply_rotary_pos_emb is not the rotate_half rotation ropelib applies; "
            "the model was left unpatched"
        )


# ----------------------------------------------------------------------------- public API


def _rotary_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [
        (name, module)
        for name, module in model.named_modules()
        if type(module).__name__.endswith("RotaryEmbedding")
        and not isinstance(module, HFRotaryEmbedding)
        and hasattr(module, "config")
        and "inv_freq" in dict(module.named_buffers(recurse=False))
    ]


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, attr, module)


def patch_hf_rope(model: ModelT, *, backend: str = "auto") -> ModelT:
    r"""Make a ``transformers`` Llama-family model compute RoPE with ropelib; returns ``model``.

    Replaces every ``*RotaryEmbedding`` module of ``model`` by an :class:`HFRotaryEmbedding`
    built from the same config, and wraps ``apply_rotary_pos_emb`` of the model's modeling
    module(s) so that ropelib applies ropelib's tables. The rotation is RoFormer's (Su et al.,
    2021, section 3.4.2), in the ``"half"`` layout of GPT-NeoX and ``transformers``:

    .. math::

        x' = x \odot \cos(p\,f) + \mathrm{rotate\_half}(x) \odot \sin(p\,f),

    with the frequencies ``f`` of the config's ``rope_type`` (any of
    :data:`~ropelib.integrations.huggingface.SUPPORTED_ROPE_TYPES`: ``"default"``, ``"linear"``, ``"dynamic"``, ``"yarn"``,
    ``"llama3"``, ``"longrope"``). Weights, buffers and the state dict are unchanged;
    logits equal the unpatched model's to float32 rounding (ropelib's angles are more accurate).
    A model cast with ``model.to(torch.bfloat16)`` has had its ``inv_freq`` buffer rounded to 16
    bits by the cast (angles off by up to ``p * 2^-8``); ropelib's tables are built from the config,
    so the patch also removes that error, which grows with the position.

    Before changing anything it checks, on positions ``0 .. 63``, that ropelib's tables match the
    model's own and that the model's ``apply_rotary_pos_emb`` is the rotation ropelib applies;
    otherwise it raises :class:`ValueError` and leaves the model as it was. Patching a patched
    model does nothing.

    Args:
        model: a ``transformers`` model (e.g. ``LlamaForCausalLM``, ``Qwen2ForCausalLM``,
            ``MistralForCausalLM``) or any module containing one.
        backend: ``"auto"`` (the fused kernel on CUDA where available), ``"torch"`` or ``"triton"``.

    Returns:
        The same ``model`` object, patched in place.

    Example:
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        ...                      num_attention_heads=2, vocab_size=50)
        >>> model = patch_hf_rope(LlamaForCausalLM(config))
        >>> type(model.model.rotary_emb).__name__
        'HFRotaryEmbedding'
        >>> type(unpatch_hf_rope(model).model.rotary_emb).__name__
        'LlamaRotaryEmbedding'
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    backend = check_choice(backend, "backend", BACKENDS)
    targets = _rotary_modules(model)
    if not targets:
        if any(isinstance(m, HFRotaryEmbedding) for m in model.modules()):
            return model
        raise ValueError(
            "model has no transformers *RotaryEmbedding module (one with a config and inv_freq) to replace"
        )
    py_modules = _modeling_modules(model)
    if not py_modules:
        raise ValueError("model's modeling module has no apply_rotary_pos_emb function to route through ropelib")

    replacements = []
    for name, original in targets:
        replacement = HFRotaryEmbedding(original.config, backend=backend, original=original)
        cos, sin = _probe_tables(original, replacement, original.get_buffer("inv_freq").device)
        for py_module in py_modules:
            _probe_apply(py_module, cos, sin)
        replacements.append((name, replacement))

    for name, replacement in replacements:
        _set_submodule(model, name, replacement)
        _INSTALLED.add(replacement)
    for py_module in py_modules:
        current = getattr(py_module, _APPLY)
        if not isinstance(current, _RopelibApply):
            wrapper = _RopelibApply(current)
            setattr(py_module, _APPLY, wrapper)
            _WRAPPED[py_module.__name__] = wrapper
    return model


def unpatch_hf_rope(model: ModelT) -> ModelT:
    """Undo :func:`patch_hf_rope`: put the original rotary modules back; returns ``model``.

    When no patched model is left in the process, the modeling modules' ``apply_rotary_pos_emb``
    functions are restored too. Unpatching an unpatched model does nothing.

    Example:
        >>> layer = torch.nn.Linear(2, 2)  # nothing to undo
        >>> unpatch_hf_rope(layer) is layer
        True
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    for name, module in list(model.named_modules()):
        if isinstance(module, HFRotaryEmbedding) and module.original is not None:
            _set_submodule(model, name, module.original)
            _INSTALLED.discard(module)
    if not len(_INSTALLED):
        for module_name, wrapper in list(_WRAPPED.items()):
            py_module = sys.modules.get(module_name)
            if py_module is not None and getattr(py_module, _APPLY) is wrapper:
                setattr(py_module, _APPLY, wrapper.original)
            del _WRAPPED[module_name]
    return model


@contextlib.contextmanager
def use_ropelib_rope(model: ModelT, *, backend: str = "auto") -> Iterator[ModelT]:
    """Context manager: ``model`` computes RoPE with ropelib inside the block, as before after it.

    Example:
        >>> from transformers import Qwen2Config, Qwen2ForCausalLM
        >>> config = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        ...                      num_attention_heads=2, num_key_value_heads=1, vocab_size=50)
        >>> model = Qwen2ForCausalLM(config)
        >>> with use_ropelib_rope(model):
        ...     type(model.model.rotary_emb).__name__
        'HFRotaryEmbedding'
        >>> type(model.model.rotary_emb).__name__
        'Qwen2RotaryEmbedding'
    """
    patch_hf_rope(model, backend=backend)
    try:
        yield model
    finally:
        unpatch_hf_rope(model)
