"""The stand-in for a modeling module's apply function, its per-signature adapters, and the record of what the patch installed.

``transformers`` families call their rotation with one of three signatures (:data:`SIGNATURES`):

* ``"qk_cos_sin"``: ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)``, ``q, k`` of shape
  ``[batch, heads, seq, d]`` (Llama, GLM, Cohere, Gemma 3, Qwen2-VL; the ``cos`` table identifies ropelib's call);
* ``"tensor_sin_cos"``: ``apply_rotary_pos_emb(x, sin, cos)``, one ``[batch, seq, heads, r]``
  tensor, tables ``[batch, seq, r/2]`` (GPT-J; identified by ``sin``);
* ``"qk_freqs"``: ``apply_rotary_emb(xq, xk, freqs_cis)``, ``[batch, seq, heads, d]`` and complex
  ``[batch, seq, r/2]`` (Llama 4, Meta's form; identified by ``freqs_cis``).

Each adapter has two halves: ``run`` turns a live call into ropelib's kernel call (or returns None,
and the original runs), ``probe`` calls the original on ropelib-layout ``q, k`` at patch time.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ...kernels import native_kernel
from ...kernels.ops import kernel_for, rotate_by_token_tables
from ...kernels.torch_kernel import LastCall, few_elements
from .module import HFRotaryEmbedding

#: every HFRotaryEmbedding that patch_hf_rope put into a model and unpatch_hf_rope has not taken out
INSTALLED: weakref.WeakSet[HFRotaryEmbedding] = weakref.WeakSet()

Tables = tuple[HFRotaryEmbedding, torch.Tensor, torch.Tensor]


def installed_tables(key: object) -> Tables | None:
    """The installed module that returned ``key`` last, with its half-width tables; None for any other object."""
    for module in INSTALLED:
        tables = module.tables_of(key)
        if tables is not None:
            return module, tables[0], tables[1]
    return None


def _fits(found: Tables | None, *tensors: object, seq_dim: int = 1) -> Tables | None:
    """``found`` if every tensor is a 4-D tensor of one dtype whose batch and seq match the tables."""
    if found is None or not isinstance(tensors[0], torch.Tensor):
        return None
    cos, dtype = found[1], tensors[0].dtype
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.ndim != 4 or t.dtype != dtype:
            return None
        if cos.shape[0] not in (1, t.shape[0]) or cos.shape[1] != t.shape[seq_dim] or 2 * cos.shape[2] > t.shape[3]:
            return None
    return found


# ----------------------------------------------------------------------------- qk_cos_sin (Llama and most)


def _run_qk_cos_sin(args: tuple[Any, ...], kwargs: dict[str, Any], interleaved: bool) -> Any:
    if len(args) != 4 or set(kwargs) - {"unsqueeze_dim"}:
        return None
    q, k, cos, _ = args
    unsqueeze_dim = kwargs.get("unsqueeze_dim", 1)
    if unsqueeze_dim not in (1, 2):
        return None
    few = _few_tables(cos, unsqueeze_dim)  # the layers of a decoding step after the first
    if (
        few is not None
        and _fits(few[0], q, k, seq_dim=3 - unsqueeze_dim) is not None
        and _few(q, k, few[0], interleaved)
    ):
        return native_kernel.rotate_few(q, k, few[1], few[2])
    found = _fits(installed_tables(cos), q, k, seq_dim=3 - unsqueeze_dim)
    if found is None:
        return None
    module, cos_half, sin_half = found
    if _few(q, k, found, interleaved):  # HF's own cos is cat(c, c) in float32; the sine gets its signs
        signed_sin = torch.cat((-sin_half, sin_half), -1).unsqueeze(unsqueeze_dim)
        few = (found, cos.unsqueeze(unsqueeze_dim), signed_sin)
        _LAST_FEW.put((cos,), unsqueeze_dim, few)
        return native_kernel.rotate_few(q, k, few[1], few[2])
    if unsqueeze_dim == 1:  # [batch, heads, seq, d] -> ropelib's [batch, seq, heads, d]
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    q, k = rotate_by_token_tables(q, k, cos_half, sin_half, interleaved=interleaved, backend=module.backend)
    if unsqueeze_dim == 1:
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    return q, k


#: The few-token tables ``(found, cos, signed_sin)`` of the last call, keyed by the ``cos`` tensor the
#: installed module returned and ``unsqueeze_dim``. Every layer of a decoding step passes the same
#: ``cos``: the first builds them, the others reuse them.
_LAST_FEW = LastCall()


def _few_tables(cos: object, unsqueeze_dim: int) -> tuple[Tables, torch.Tensor, torch.Tensor] | None:
    return _LAST_FEW.get((cos,), unsqueeze_dim) if isinstance(cos, torch.Tensor) else None


def _few(q: torch.Tensor, k: torch.Tensor, found: Tables, interleaved: bool) -> bool:
    """True when :func:`~ropelib.kernels.native_kernel.rotate_few` serves the call (see its conditions)."""
    module, cos_half, _ = found
    return (
        kernel_for(module.backend, q.device) == "torch"
        and few_elements(q, k, 2 * cos_half.shape[-1], cos_half.dtype, interleaved)
        and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad))
    )


def _probe_qk_cos_sin(original: Callable[..., Any], q: torch.Tensor, k: torch.Tensor, tables: Any) -> Any:
    cos, sin = tables
    q2, k2 = original(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    return q2.transpose(1, 2), k2.transpose(1, 2)


# ----------------------------------------------------------------------------- tensor_sin_cos (GPT-J)


def _run_tensor_sin_cos(args: tuple[Any, ...], kwargs: dict[str, Any], interleaved: bool) -> Any:
    if len(args) != 3 or kwargs:
        return None
    x, sin, _ = args
    found = _fits(installed_tables(sin), x)
    if found is None or x.shape[3] != 2 * found[1].shape[2]:  # GPT-J's function rotates the whole x
        return None
    module, cos_half, sin_half = found
    # The kernels rotate a query and a key together; one head of x stands in for the key.
    out, _ = rotate_by_token_tables(x, x[:, :, :1], cos_half, sin_half, interleaved=interleaved, backend=module.backend)
    return out


def _probe_tensor_sin_cos(original: Callable[..., Any], q: torch.Tensor, k: torch.Tensor, tables: Any) -> Any:
    sin, cos = tables
    r = 2 * sin.shape[-1]  # GPT-J's attention rotates x[..., :rotary_dim] and passes the rest
    return tuple(torch.cat((original(t[..., :r], sin, cos), t[..., r:]), dim=-1) for t in (q, k))


# ----------------------------------------------------------------------------- qk_freqs (Llama 4)


def _run_qk_freqs(args: tuple[Any, ...], kwargs: dict[str, Any], interleaved: bool) -> Any:
    if len(args) != 3 or kwargs:
        return None
    q, k, freqs = args
    found = _fits(installed_tables(freqs), q, k)
    if found is None:
        return None
    module, cos_half, sin_half = found
    return rotate_by_token_tables(q, k, cos_half, sin_half, interleaved=interleaved, backend=module.backend)


def _probe_qk_freqs(original: Callable[..., Any], q: torch.Tensor, k: torch.Tensor, tables: Any) -> Any:
    return original(q, k, tables)


@dataclass(frozen=True)
class Signature:
    """How a family's apply function is called: ``run`` (live calls) and ``probe`` (patch time), see the module docstring."""

    name: str
    run: Callable[[tuple[Any, ...], dict[str, Any], bool], Any]
    probe: Callable[[Callable[..., Any], torch.Tensor, torch.Tensor, Any], Any]


#: The signatures of apply functions, by name.
SIGNATURES: dict[str, Signature] = {
    s.name: s
    for s in (
        Signature("qk_cos_sin", _run_qk_cos_sin, _probe_qk_cos_sin),
        Signature("tensor_sin_cos", _run_tensor_sin_cos, _probe_tensor_sin_cos),
        Signature("qk_freqs", _run_qk_freqs, _probe_qk_freqs),
    )
}


class RopelibApply:
    """Stands in for a modeling module's apply function (``apply_rotary_pos_emb`` and kin).

    Eager calls whose tables come from an installed :class:`~ropelib.HFRotaryEmbedding` are rotated by
    ropelib's kernels with ropelib's float tables; any other call, and every call under
    :func:`torch.compile` (where Inductor fuses the original's arithmetic into one kernel), goes to
    the original function with its arguments unchanged.

    Args:
        original: the function replaced.
        signature: a key of :data:`SIGNATURES`.
        layout: ``"half"`` or ``"interleaved"``, the pairs the original rotates.
    """

    def __init__(self, original: Callable[..., Any], signature: str = "qk_cos_sin", layout: str = "half") -> None:
        self.original = original
        self.signature = SIGNATURES[signature]
        self.interleaved = layout == "interleaved"
        functools.update_wrapper(self, original)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.compiler.is_compiling():
            result = self.signature.run(args, kwargs, self.interleaved)
            if result is not None:
                return result
        return self.original(*args, **kwargs)
