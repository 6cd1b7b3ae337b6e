"""Relative-bias attention timed two ways: a materialized ``n x n`` bias against ``flex_attention``'s ``score_mod``."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .._validation import check_choice
from ..encodings.flex import ScoreMod, alibi_score_mod, flex_bias_attention, materialized_bias_attention, t5_score_mod
from ..encodings.relative import T5RelativeBias, alibi_bias, alibi_slopes, relative_positions
from .harness import time_interleaved

BIASES = ("alibi", "t5")


def bias_setups(
    kind: str, heads: int, seq_len: int, device: torch.device
) -> tuple[Callable[[], torch.Tensor], ScoreMod]:
    """A function building the materialized ``[heads, n, n]`` bias, and the equivalent ``score_mod``.

    ``kind`` is ``"alibi"`` or ``"t5"``; T5's weights are drawn with a fixed seed (in a model they
    are learned), without disturbing the global random state.
    """
    kind = check_choice(kind, "kind", BIASES)
    if kind == "alibi":
        return (lambda: alibi_bias(heads, seq_len, device=device)), alibi_score_mod(alibi_slopes(heads).to(device))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        module = T5RelativeBias(heads).to(device).requires_grad_(False)
    return (lambda: module(relative_positions(seq_len, device=device))), t5_score_mod(module, seq_len)


def benchmark_bias(
    device: torch.device,
    *,
    shape: Sequence[int] | None = None,
    kinds: Sequence[str] = BIASES,
    reps: int = 5,
    warmup: int = 2,
    compiled: bool = True,
) -> list[dict[str, Any]]:
    """Time materialized-bias SDPA against ``flex_attention`` with the harness of :mod:`ropelib.bench`.

    Args:
        device: where to run.
        shape: ``(batch, heads, seq, head_dim)``; default ``(1, 8, 1024, 64)`` on CPU, ``(4, 16, 4096, 64)`` on CUDA.
        kinds: which biases.
        reps, warmup: timed and untimed rounds (compilation happens in warm-up).
        compiled: use the compiled ``flex_attention`` (see :func:`flex_bias_attention`).

    Returns:
        One dict per (bias, method): ``bias``, ``method``, ``shape``, ``median_ms``, ``times_ms``,
        ``bias_bytes`` (the ``n x n`` tensor's size, 0 for flex) and ``max_abs_diff`` (flex vs materialized).
        Materialized times include building the bias, which is what a model without a cache does.
    """
    batch, heads, seq, dim = shape or ((4, 16, 4096, 64) if device.type == "cuda" else (1, 8, 1024, 64))
    gen = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(batch, heads, seq, dim, generator=gen).to(device) for _ in range(3))
    rows = []
    for kind in kinds:
        build_bias, score_mod = bias_setups(kind, heads, seq, device)

        def materialized(build_bias=build_bias):
            return materialized_bias_attention(q, k, v, build_bias())

        def flex(score_mod=score_mod):
            return flex_bias_attention(q, k, v, score_mod, compiled=compiled)

        with torch.no_grad():
            diff = (materialized() - flex()).abs().max().item()
            times = time_interleaved(
                {"materialized": materialized, "flex_attention": flex}, device, reps=reps, warmup=warmup
            )
        for method, values in times.items():
            rows.append(
                {
                    "bias": kind,
                    "method": method,
                    "shape": [batch, heads, seq, dim],
                    "median_ms": 1e3 * statistics.median(values),
                    "times_ms": [1e3 * t for t in values],
                    "bias_bytes": heads * seq * seq * 4 if method == "materialized" else 0,
                    "max_abs_diff": diff,
                }
            )
    return rows
