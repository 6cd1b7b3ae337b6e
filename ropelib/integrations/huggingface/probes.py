"""Checks at patch time: ropelib must reproduce a model's own tables and rotation before the patch touches it."""

from __future__ import annotations

from types import ModuleType

import torch
from torch import nn

from ...reference import rotate
from .apply import RopelibApply
from .families import Family
from .module import HFRotaryEmbedding

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


def probe_tables(original: nn.Module, replacement: HFRotaryEmbedding, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Compare both modules' tables at positions below ``max_position_embeddings`` (no dynamic growth)."""
    # After model.to(torch.bfloat16) the original's inv_freq buffer is rounded to 16 bits (eps 2^-7), and its
    # angles p * inv_freq are off by up to p * eps: then only the first few positions are compared, with a
    # tolerance of that size, which still tells a layout or scaling apart (differences of 0.1 and more).
    eps = torch.finfo(original.get_buffer("inv_freq").dtype).eps
    n = _PROBE_POSITIONS if eps <= torch.finfo(torch.float32).eps else 4
    max_positions = replacement.rope.max_position_embeddings
    if max_positions is not None:
        # Length-following scalings (dynamic NTK) keep grown frequencies for a sequence of exactly
        # max_position_embeddings and reset below it, in transformers as here: probe below it, so that a
        # model that has already generated past its context compares with its original frequencies.
        n = min(n, max_positions - 1 if replacement.rope._follows_length and max_positions > 1 else max_positions)
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


def probe_apply(
    py_module: ModuleType, family: Family, replacement: HFRotaryEmbedding, cos: torch.Tensor, sin: torch.Tensor
) -> None:
    """Check that the family's apply function in ``py_module`` is the rotation ropelib applies with these tables."""
    original = unwrapped(py_module, family.apply_name)
    assert callable(original)
    generator = torch.Generator().manual_seed(0)
    head_dim = cos.shape[-1]
    # Heads 2 and 1 (as in GQA); a head_dim larger than the tables for partial rotary factors.
    q = torch.randn(1, 2, cos.shape[1], head_dim, generator=generator).to(cos.device)
    k = torch.randn(1, 1, cos.shape[1], head_dim, generator=generator).to(cos.device)
    tables = replacement.tables_of(cos)
    assert tables is not None  # made by the replacement just before
    cos_half, sin_half = tables
    name = f"{py_module.__name__}.{family.apply_name}"
    try:
        with torch.no_grad():
            want_q, want_k = original(q, k, cos, sin)
    except Exception as error:  # any failure means the function is not the one we replace
        raise ValueError(f"{name} does not take (q, k, cos, sin): {error}") from error
    # ropelib's reference rotation (the kernels are checked against it in ropelib's own tests)
    got_q = rotate(q.transpose(1, 2), cos_half, sin_half, family.layout).transpose(1, 2)
    got_k = rotate(k.transpose(1, 2), cos_half, sin_half, family.layout).transpose(1, 2)
    # Same float32 products and sums in both, so they agree to a few ulps of |x| ~ 4.
    if not (torch.allclose(want_q, got_q, atol=1e-5) and torch.allclose(want_k, got_k, atol=1e-5)):
        raise ValueError(
            f"{name} is not the {family.layout!r}-layout rotation ropelib applies; the model was left unpatched"
        )
