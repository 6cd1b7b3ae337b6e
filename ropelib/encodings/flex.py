r"""Relative-bias attention two ways: a materialized ``n x n`` bias, or a ``score_mod`` with no ``n x n`` tensor.

ALiBi (Press et al., 2022) and T5 (Raffel et al., 2020) add a bias ``b_ij`` that depends on
``j - i`` (and the head) to the attention scores,

.. math:: \operatorname{softmax}\!\big(q_i \cdot k_j / \sqrt{d} + b_{h,ij}\big).

* :func:`materialized_bias_attention` builds ``b`` as an ``[heads, n, n]`` tensor and passes it as
  ``attn_mask`` to :func:`torch.nn.functional.scaled_dot_product_attention`: ``O(h n^2)`` memory
  written and read once more.
* :func:`flex_bias_attention` hands :func:`torch.nn.attention.flex_attention.flex_attention` a
  ``score_mod`` that adds the bias to each score as it is computed. ALiBi needs one slope per
  head; T5 one value per (offset, head), looked up from a ``[2n - 1, heads]`` table.

On a CPU, ``flex_attention`` runs fused only under :func:`torch.compile` (``compiled=True``);
without it PyTorch falls back to an unfused reference that materializes the scores (useful for
checking, not for speed). Tensors here are ``[batch, heads, seq, head_dim]``, as in SDPA.
"""

from __future__ import annotations

import statistics
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from ._validation import check_choice, check_float_tensor
from .relative import T5RelativeBias, alibi_bias, alibi_slopes, relative_positions, t5_relative_bucket

BIASES = ("alibi", "t5")
ScoreMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_float_tensor(t, name, ndim=4)
    if q.shape != k.shape or q.shape[:3] != v.shape[:3]:
        raise ValueError(
            f"q, k must be [batch, heads, seq, d] of equal shape and v [batch, heads, seq, d_v]; got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )


def alibi_score_mod(slopes: torch.Tensor) -> ScoreMod:
    r"""A ``score_mod`` adding ALiBi's ``-m_h |j - i|`` (the bias of :func:`ropelib.alibi_bias`).

    Args:
        slopes: ``[heads]`` (from :func:`ropelib.alibi_slopes`); kept in float32 for the kernel.
    """
    slopes = check_float_tensor(slopes, "slopes", ndim=1).to(torch.float32)

    def alibi(score, batch, head, q_idx, kv_idx):
        return score - slopes[head] * (kv_idx - q_idx).abs()

    return alibi


def t5_offset_table(bias: T5RelativeBias, seq_len: int) -> torch.Tensor:
    """T5's bias for every offset ``j - i`` in ``-(n-1) .. n-1``: ``[2n - 1, heads]``, row ``j - i + n - 1``."""
    offsets = torch.arange(-(seq_len - 1), seq_len, device=bias.weight.device)
    buckets = t5_relative_bucket(offsets, bias.bidirectional, bias.num_buckets, bias.max_distance)
    return bias.weight[buckets]


def t5_score_mod(bias: T5RelativeBias, seq_len: int) -> ScoreMod:
    """A ``score_mod`` adding T5's learned bucket bias (the bias of :class:`ropelib.T5RelativeBias`)."""
    table = t5_offset_table(bias, seq_len).detach().to(torch.float32)
    shift = seq_len - 1

    def t5(score, batch, head, q_idx, kv_idx):
        return score + table[kv_idx - q_idx + shift, head]

    return t5


def materialized_bias_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """SDPA with the bias as an ``attn_mask``: ``bias`` is ``[heads, n, n]`` (or broadcastable to the scores)."""
    _check_qkv(q, k, v)
    check_float_tensor(bias, "bias")
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(q.dtype))


_COMPILED_FLEX: list[Any] = []


def flex_bias_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, score_mod: ScoreMod, *, compiled: bool = True
) -> torch.Tensor:
    """``flex_attention`` with ``score_mod`` (no ``n x n`` tensor when ``compiled``).

    Args:
        q, k, v: ``[batch, heads, seq, d]``.
        score_mod: from :func:`alibi_score_mod` or :func:`t5_score_mod`.
        compiled: go through one shared ``torch.compile(flex_attention)`` (the fused kernel; the
            first call per ``score_mod`` compiles, seconds on a CPU). ``False`` runs PyTorch's
            unfused reference, with its warning about that silenced.
    """
    from torch.nn.attention.flex_attention import flex_attention

    _check_qkv(q, k, v)
    if compiled:
        if not _COMPILED_FLEX:
            _COMPILED_FLEX.append(torch.compile(flex_attention))
        return _COMPILED_FLEX[0](q, k, v, score_mod=score_mod)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return flex_attention(q, k, v, score_mod=score_mod)


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
    from .bench import time_interleaved

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
