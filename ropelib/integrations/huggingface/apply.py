"""The stand-in for a modeling module's apply function, and its per-signature adapters.

``transformers`` families call their rotation with one of these signatures (:data:`SIGNATURES`):

* ``"qk_cos_sin"``: ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)``, ``q, k`` of shape
  ``[batch, heads, seq, d]`` (Llama, GLM, Cohere, Gemma 3, Qwen2-VL, GPT-OSS, Ernie 4.5);
* ``"qk_cos_sin_to_halves"``: the same call, whose function reads interleaved pairs and writes
  the rotated ones out as halves, ``(x_0', x_2', .., x_1', x_3', ..)`` (DeepSeek V3's
  ``apply_rotary_pos_emb_interleave``);
* ``"x_cos_sin"``: ``apply_rotary_pos_emb(x, cos, sin, unsqueeze_dim=2)``, one tensor
  ``[batch, seq, heads, d]`` at a time (Gemma 4);
* ``"tensor_sin_cos"``: ``apply_rotary_pos_emb(x, sin, cos)``, one ``[batch, seq, heads, d_rot]``
  tensor, tables ``[batch, seq, d_rot/2]`` (GPT-J);
* ``"qk_freqs"``: ``apply_rotary_emb(xq, xk, freqs_cis)``, ``[batch, seq, heads, d]`` and complex
  ``[batch, seq, d_rot/2]`` (Llama 4, Meta's form);
* ``"qk_freqs_heads_first"``: the same with ``[batch, heads, seq, d]`` (DeepSeek V2's MLA).

A call is rotated by ropelib only when its tables are the very tensors an installed
:class:`~ropelib.HFRotaryEmbedding` returned, unchanged since (their version counters; see
:class:`~ropelib.integrations.huggingface.module.ReturnedTables`): then ropelib's float tables
behind them are used. Any other call, a ``sin`` that is not the one returned beside ``cos`` (the
inverse rotation with ``-sin``, say), tables changed in place, and every call under
:func:`torch.compile`, goes to the original function with its arguments unchanged.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch

from ...kernels.door import rotate_token_tables
from .module import HFRotaryEmbedding, ReturnedTables, returned_tables


def _fits(found: ReturnedTables | None, *tensors: object, seq_dim: int = 1) -> ReturnedTables | None:
    """``found`` if every tensor is a 4-D tensor of one dtype whose batch and seq match the tables."""
    if found is None or not isinstance(tensors[0], torch.Tensor):
        return None
    cos, dtype = found.cos, tensors[0].dtype
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.ndim != 4 or t.dtype != dtype or t.device != cos.device:
            return None
        if cos.shape[0] not in (1, t.shape[0]) or cos.shape[1] != t.shape[seq_dim] or 2 * cos.shape[2] > t.shape[3]:
            return None
    return found


def _rotate(
    q: torch.Tensor, k: torch.Tensor, found: ReturnedTables, interleaved: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    return rotate_token_tables(q, k, found.cos, found.sin, interleaved=interleaved, kernel=found.kernel)


# ----------------------------------------------------------------------------- qk_cos_sin (Llama and most)


def _heads_first(q: torch.Tensor, k: torch.Tensor, found: ReturnedTables, interleaved: bool) -> Any:
    """Rotate ``[batch, heads, seq, d]`` tensors (transposed views to ropelib's ``[batch, seq, heads, d]`` and back)."""
    q_out, k_out = _rotate(q.transpose(1, 2), k.transpose(1, 2), found, interleaved)
    return q_out.transpose(1, 2), k_out.transpose(1, 2)


def _run_qk_cos_sin(args: tuple[Any, ...], kwargs: dict[str, Any], interleaved: bool) -> Any:
    if len(args) != 4 or set(kwargs) - {"unsqueeze_dim"}:
        return None
    q, k, cos, sin = args
    unsqueeze_dim = kwargs.get("unsqueeze_dim", 1)
    if unsqueeze_dim not in (1, 2):
        return None
    found = _fits(returned_tables(cos, sin), q, k, seq_dim=3 - unsqueeze_dim)
    if found is None:
        return None
    if unsqueeze_dim == 1:
        return _heads_first(q, k, found, interleaved)
    return _rotate(q, k, found, interleaved)


def _probe_qk_cos_sin(original: Callable[..., Any], q: torch.Tensor, k: torch.Tensor, tables: Any) -> Any:
    cos, sin = tables
    q2, k2 = original(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    return q2.transpose(1, 2), k2.transpose(1, 2)


def to_halves(x: torch.Tensor, rotated: int) -> torch.Tensor:
    """The first ``rotated`` features of ``x`` reordered from pairs ``(x_0, x_1), (x_2, x_3), ..`` to halves
    ``(x_0, x_2, .., x_1, x_3, ..)``, the rest as they are."""
    head, rest = x[..., :rotated], x[..., rotated:]
    return torch.cat((head[..., 0::2], head[..., 1::2], rest), dim=-1)


def _run_qk_cos_sin_to_halves(args: tuple[Any, ...], kwargs: dict[str, Any], interleaved: bool) -> Any:
    out = _run_qk_cos_sin(args, kwargs, interleaved)
    if out is None:
        return None
    return tuple(to_halves(t, args[2].shape[-1]) for t in out)  # cat(c, c) tables: as wide as the rotated part


# ----------------------------------------------------------------------------- x_cos_sin (Gemma 4)


def _run_x_cos_sin(args: tuple[Any, ...], kwargs: dict[str, Any], interleaved: bool) -> Any:
    if len(args) != 3 or set(kwargs) - {"unsqueeze_dim"}:
        return None
    x, cos, sin = args
    unsqueeze_dim = kwargs.get("unsqueeze_dim", 1)
    if unsqueeze_dim not in (1, 2):
        return None
    found = _fits(returned_tables(cos, sin), x, seq_dim=3 - unsqueeze_dim)
    if found is None:
        return None
    if unsqueeze_dim == 1:
        return _heads_first(x, x[:, :0], found, interleaved)[0]
    return _rotate(x, x[:, :, :0], found, interleaved)[0]  # one tensor: no key heads beside it


def _probe_x_cos_sin(original: Callable[..., Any], q: torch.Tensor, k: torch.Tensor, tables: Any) -> Any:
    cos, sin = tables
    return tuple(original(t, cos, sin, unsqueeze_dim=2) for t in (q, k))


# ----------------------------------------------------------------------------- tensor_sin_cos (GPT-J)


def _run_tensor_sin_cos(args: tuple[Any, ...], kwargs: dict[str, Any], interleaved: bool) -> Any:
    if len(args) != 3 or kwargs:
        return None
    x, sin, cos = args
    found = _fits(returned_tables(sin, cos), x)
    if found is None or x.shape[3] != 2 * found.cos.shape[2]:  # GPT-J's function rotates the whole x
        return None
    out, _ = _rotate(x, x[:, :, :0], found, interleaved)  # one tensor: no key heads beside it
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
    found = _fits(returned_tables(freqs), q, k)
    return None if found is None else _rotate(q, k, found, interleaved)


def _probe_qk_freqs(original: Callable[..., Any], q: torch.Tensor, k: torch.Tensor, tables: Any) -> Any:
    return original(q, k, tables)


def _run_qk_freqs_heads_first(args: tuple[Any, ...], kwargs: dict[str, Any], interleaved: bool) -> Any:
    if len(args) != 3 or kwargs:
        return None
    q, k, freqs = args
    found = _fits(returned_tables(freqs), q, k, seq_dim=2)
    return None if found is None else _heads_first(q, k, found, interleaved)


def _probe_qk_freqs_heads_first(original: Callable[..., Any], q: torch.Tensor, k: torch.Tensor, tables: Any) -> Any:
    q2, k2 = original(q.transpose(1, 2), k.transpose(1, 2), tables)
    return q2.transpose(1, 2), k2.transpose(1, 2)


@dataclass(frozen=True)
class Signature:
    """How a family's apply function is called: ``run`` (live calls) and ``probe`` (patch time), see the module docstring."""

    name: str
    run: Callable[[tuple[Any, ...], dict[str, Any], bool], Any]
    probe: Callable[[Callable[..., Any], torch.Tensor, torch.Tensor, Any], Any]
    #: the function writes the rotated pairs out as halves (:func:`to_halves`)
    to_halves: bool = False


#: The signatures of apply functions, by name.
SIGNATURES: MappingProxyType[str, Signature] = MappingProxyType(
    {
        s.name: s
        for s in (
            Signature("qk_cos_sin", _run_qk_cos_sin, _probe_qk_cos_sin),
            Signature("qk_cos_sin_to_halves", _run_qk_cos_sin_to_halves, _probe_qk_cos_sin, to_halves=True),
            Signature("x_cos_sin", _run_x_cos_sin, _probe_x_cos_sin),
            Signature("tensor_sin_cos", _run_tensor_sin_cos, _probe_tensor_sin_cos),
            Signature("qk_freqs", _run_qk_freqs, _probe_qk_freqs),
            Signature("qk_freqs_heads_first", _run_qk_freqs_heads_first, _probe_qk_freqs_heads_first),
        )
    }
)


class RopelibApply:
    """Stands in for a modeling module's apply function (``apply_rotary_pos_emb`` and kin).

    Calls whose tables an installed :class:`~ropelib.HFRotaryEmbedding` returned, unchanged, are
    rotated by ropelib's operator with ropelib's float tables; every other call goes to the
    original function with its arguments unchanged (see the module docstring).

    Args:
        original: the function replaced.
        signature: a key of :data:`SIGNATURES`.
        layout: ``"half"`` or ``"interleaved"``, the pairs the original rotates.
    """

    def __init__(self, original: Callable[..., Any], signature: str = "qk_cos_sin", layout: str = "half") -> None:
        self.original = original
        self.signature = SIGNATURES[signature]
        self.interleaved = layout == "interleaved"
        # the patched modules that rely on this stand-in; unpatching the last one restores the original
        self.users: weakref.WeakSet[HFRotaryEmbedding] = weakref.WeakSet()
        functools.update_wrapper(self, original)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.compiler.is_compiling():
            result = self.signature.run(args, kwargs, self.interleaved)
            if result is not None:
                return result
        return self.original(*args, **kwargs)
