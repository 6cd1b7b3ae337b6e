"""Checks at patch time: ropelib must reproduce a model's own tables and rotation before the patch touches it."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch
from torch import nn

from ...reference import rotate
from .apply import SIGNATURES, RopelibApply, to_halves
from .families import Family
from .module import HFRotaryEmbedding, returned_tables

# Largest difference between Hugging Face's tables and ropelib's that the patch-time probe
# accepts. Hugging Face forms the angle p * inv_freq in float32: inv_freq and the product are
# each rounded (relative error <= 2^-24 each), so at the probe's largest position p = 63 and
# inv_freq <= 1 the angle is off by <= 63 * 2 * 2^-24 = 7.5e-6 rad, and cos/sin by as much
# (times an attention scaling below 1.5). A different layout or frequency is off by >= 1e-2.
_PROBE_ATOL = 3e-5
_PROBE_POSITIONS = 64


def unwrapped(py_module: ModuleType, name: str) -> object:
    """``py_module.<name>`` with ropelib's wrapper taken off."""
    fn = getattr(py_module, name)
    return fn.original if isinstance(fn, RopelibApply) else fn


def _tensors(out: Any) -> list[torch.Tensor]:
    """A rotary module's output as real tensors (a complex table as its real and imaginary parts)."""
    items = list(out) if isinstance(out, (tuple, list)) else [out]
    return [torch.view_as_real(t) if isinstance(t, torch.Tensor) and t.is_complex() else t for t in items]


def _float_buffer_dtype(module: nn.Module) -> torch.dtype:
    dtypes = [b.dtype for b in module.buffers(recurse=False) if b.is_floating_point()]
    return dtypes[0] if dtypes else torch.float32


def probe_positions(replacement: HFRotaryEmbedding, n: int, device: torch.device) -> torch.Tensor:
    """``[1, n]`` positions ``0 .. n-1``; for M-RoPE ``[3, 1, n]`` with a different position on each axis."""
    positions = torch.arange(n, device=device)
    if replacement.mrope is None:
        return positions[None]
    return torch.stack((positions, positions // 2, (positions * 5) % n))[:, None]


def probe_tables(
    original: nn.Module, replacement: HFRotaryEmbedding, device: torch.device
) -> dict[str | None, tuple[Any, int]]:
    """Compare both modules' tables at positions below ``max_position_embeddings`` (no dynamic growth), for each layer type.

    Returns the replacement's output for each layer type, with the number of positions probed.
    """
    # After model.to(torch.bfloat16) the original's frequency buffer is rounded to 16 bits (eps 2^-7), and its
    # angles p * inv_freq are off by up to p * eps: then only the first few positions are compared, with a
    # tolerance of that size, which still tells a layout or scaling apart (differences of 0.1 and more).
    eps = torch.finfo(_float_buffer_dtype(original)).eps
    n = _PROBE_POSITIONS if eps <= torch.finfo(torch.float32).eps else 4
    max_positions = replacement.rope.max_position_embeddings
    if max_positions is not None:
        # Length-following scalings (dynamic NTK) keep grown frequencies for a sequence of exactly
        # max_position_embeddings and reset below it, in transformers as here: probe below it, so that a
        # model that has already generated past its context compares with its original frequencies.
        n = min(n, max_positions - 1 if replacement.rope.spec.follows_length and max_positions > 1 else max_positions)
    atol = _PROBE_ATOL + 2 * (n - 1) * eps
    x = torch.zeros(1, device=device)
    positions = probe_positions(replacement, n, device)
    outputs = {}
    for layer_type in replacement.layer_types:
        extra = () if layer_type is None else (layer_type,)
        with torch.no_grad():
            try:
                expected = original(x, positions, *extra)
            except Exception as error:  # a module that cannot be called so is not one this integration knows
                raise ValueError(f"{type(original).__name__} cannot be probed: {error}") from error
            got = replacement(x, positions, *extra)
        want, have = _tensors(expected), _tensors(got)
        same = len(want) == len(have) and all(
            w.shape == h.shape and torch.allclose(w.float(), h.float(), rtol=0.0, atol=atol) for w, h in zip(want, have)
        )
        if not same:
            where = "" if layer_type is None else f" for layer type {layer_type!r}"
            raise ValueError(
                f"{type(original).__name__} computes tables{where} that ropelib does not reproduce "
                f"(a layout or scaling this integration does not know); the model was left unpatched"
            )
        outputs[layer_type] = (got, n)
    return outputs


def probe_apply(py_module: ModuleType, family: Family, replacement: HFRotaryEmbedding, tables: Any) -> None:
    """Check that the family's apply function in ``py_module`` is the rotation ropelib applies with these tables."""
    original = unwrapped(py_module, family.apply_name)
    assert callable(original)
    found = returned_tables(*tables) if isinstance(tables, tuple) else returned_tables(tables)
    assert found is not None  # made by the replacement just before
    cos_half, sin_half = found.cos, found.sin
    generator = torch.Generator().manual_seed(0)
    # ropelib's layout [batch, seq, heads, r]: heads 2 and 1 (as in GQA), the rotated width of the tables
    shape = (cos_half.shape[0], cos_half.shape[1], 2, 2 * cos_half.shape[-1])
    q = torch.randn(shape, generator=generator).to(cos_half.device)
    k = torch.randn(shape[:2] + (1, shape[3]), generator=generator).to(cos_half.device)
    name = f"{py_module.__name__}.{family.apply_name}"
    try:
        with torch.no_grad():
            want_q, want_k = SIGNATURES[family.signature].probe(original, q, k, tables)
    except Exception as error:  # any failure means the function is not the one we replace
        raise ValueError(f"{name} does not take the {family.signature!r} arguments: {error}") from error
    # ropelib's reference rotation (the kernels are checked against it in ropelib's own tests)
    got_q = rotate(q, cos_half, sin_half, family.layout)
    got_k = rotate(k, cos_half, sin_half, family.layout)
    if SIGNATURES[family.signature].to_halves:
        got_q, got_k = to_halves(got_q, shape[3]), to_halves(got_k, shape[3])
    # Same float32 products and sums in both, so they agree to a few ulps of |x| ~ 4.
    if not (torch.allclose(want_q, got_q, atol=1e-5) and torch.allclose(want_k, got_k, atol=1e-5)):
        raise ValueError(
            f"{name} is not the {family.layout!r}-layout rotation ropelib applies; the model was left unpatched"
        )
