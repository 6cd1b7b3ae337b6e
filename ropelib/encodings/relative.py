r"""Relative position encodings: a bias added to the attention scores.

All of them change the score of query ``i`` and key ``j`` to

.. math:: A_{ij} = q_i \cdot k_j + b_{ij}

where ``b_ij`` depends on the relative position ``j - i`` only (Raffel et al., 2020; Press et
al., 2022) or on the query and ``j - i`` (Shaw et al., 2018). Throughout, ``relative_position[i, j] = j - i``: negative for
keys in the past, positive for keys in the future.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .._validation import (
    check_bool,
    check_float_dtype,
    check_float_tensor,
    check_int,
    check_integer_tensor,
    check_positive_float,
)

# ----------------------------------------------------------------------------- distances


def relative_positions(
    query_len: int, key_len: int | None = None, *, offset: int = 0, device: torch.device | str | None = None
) -> torch.Tensor:
    """The relative-distance matrix, entry ``[i, j] = j - (i + offset)``, int64, shape ``[query_len, key_len]``.

    ``offset`` is the position of the first query among the keys (``key_len - query_len`` when
    decoding with a cache whose queries are the last tokens).

    Example:
        >>> relative_positions(3).tolist()
        [[0, 1, 2], [-1, 0, 1], [-2, -1, 0]]
    """
    query_len = check_int(query_len, "query_len", minimum=0)
    key_len = query_len if key_len is None else check_int(key_len, "key_len", minimum=0)
    offset = check_int(offset, "offset", minimum=0)
    queries = torch.arange(query_len, device=device) + offset
    keys = torch.arange(key_len, device=device)
    return keys[None, :] - queries[:, None]


def _check_relative(relative_position: object, ndim_at_least: int = 0) -> torch.Tensor:
    """An integer tensor of relative positions ``j - i`` (int64), of rank >= ``ndim_at_least``."""
    relative_position = check_integer_tensor(relative_position, "relative_position")
    if relative_position.ndim < ndim_at_least:
        raise ValueError(
            f"relative_position must have at least {ndim_at_least} dimensions ([..., query_len, key_len]), "
            f"got shape {tuple(relative_position.shape)}"
        )
    return relative_position.long()


# ----------------------------------------------------------------------------- T5


def t5_relative_bucket(
    relative_position: torch.Tensor,
    bidirectional: bool = True,
    num_buckets: int = 32,
    max_distance: int = 128,
) -> torch.Tensor:
    r"""T5's bucket index of each relative position ``j - i`` (Raffel et al., 2020, section 2.1).

    Half of the buckets (of each direction, when ``bidirectional``) hold one distance each,
    ``0 .. max_exact - 1`` with ``max_exact = buckets / 2``; the rest cover distances up to
    ``max_distance`` on a log scale,

    .. math::

        \text{bucket}(n) = \text{max\_exact} + \Bigg\lfloor
            &\frac{\ln(n / \text{max\_exact})}
                  {\ln(\text{max\_distance} / \text{max\_exact})} \\
            &\times (\text{buckets} - \text{max\_exact}) \Bigg\rfloor,

    clipped to the last bucket, so every distance beyond ``max_distance`` shares it. With
    ``bidirectional`` the buckets are split in two halves: keys in the future (``j > i``) use
    the upper half. Without it, future keys all fall in bucket 0 (a causal model never sees them).

    Args:
        relative_position: integer tensor of ``j - i`` (any shape).
        bidirectional: encoder-style (both directions) or decoder-style.
        num_buckets: total number of buckets (even when ``bidirectional``).
        max_distance: the distance from which all positions share the last bucket.

    Returns:
        int64 tensor of bucket indices in ``[0, num_buckets)``, same shape as the input.
    """
    relative_position = _check_relative(relative_position)
    if not isinstance(bidirectional, bool):
        raise TypeError(f"bidirectional must be a bool, got {type(bidirectional).__name__}")
    num_buckets = check_int(num_buckets, "num_buckets", minimum=2)
    max_distance = check_int(max_distance, "max_distance", minimum=1)
    if bidirectional and num_buckets % 2:
        raise ValueError(f"num_buckets must be even when bidirectional, got {num_buckets}")
    buckets = num_buckets // 2 if bidirectional else num_buckets
    max_exact = buckets // 2
    if max_exact < 1:
        raise ValueError(f"num_buckets={num_buckets} leaves no exact bucket; use at least {4 if bidirectional else 2}")
    if max_distance <= max_exact:
        raise ValueError(f"max_distance must be > {max_exact} (the exact range), got {max_distance}")

    return bucket_of(relative_position, bidirectional, num_buckets, max_distance)


def bucket_of(
    relative_position: torch.Tensor, bidirectional: bool, num_buckets: int, max_distance: int
) -> torch.Tensor:
    """:func:`~ropelib.t5_relative_bucket` without argument checks (int64 ``relative_position``, valid settings).

    The arithmetic is T5's own (``transformers``' ``_relative_position_bucket``): the log ratio in
    float32 and truncated, so that buckets agree with T5 at their exact boundaries too, where a
    float64 logarithm can land on the other side of an integer. Distances are first clipped to
    ``max_distance`` (they share the last bucket either way), so no absolute value overflows.
    """
    relative_position = relative_position.clamp(-max_distance, max_distance)
    buckets = num_buckets
    offset = torch.zeros_like(relative_position)
    if bidirectional:
        buckets //= 2
        offset = (relative_position > 0).long() * buckets
        distance = relative_position.abs()
    else:
        distance = -torch.clamp(relative_position, max=0)
    max_exact = buckets // 2
    large = max_exact + (
        torch.log(distance.float() / max_exact) / math.log(max_distance / max_exact) * (buckets - max_exact)
    ).to(torch.long)
    large = large.clamp(max=buckets - 1)
    return offset + torch.where(distance < max_exact, distance, large)


class T5RelativeBias(nn.Module):
    """A learned scalar per (bucket, head), added to the scores: ``b_ij = w[bucket(j - i), head]``.

    ``bidirectional``, ``num_buckets`` and ``max_distance`` are as for
    :func:`~ropelib.t5_relative_bucket`.

    Args:
        num_heads: attention heads (each learns its own bias per bucket).

    Shapes:
        ``forward(relative_position)`` takes integer ``j - i`` of shape ``[..., query_len, key_len]``
        (see :func:`relative_positions`) and returns ``[..., num_heads, query_len, key_len]``.
    """

    def __init__(
        self, num_heads: int, bidirectional: bool = True, num_buckets: int = 32, max_distance: int = 128
    ) -> None:
        super().__init__()
        self.num_heads = check_int(num_heads, "num_heads", minimum=1)
        self.bidirectional = check_bool(bidirectional, "bidirectional")
        self.num_buckets = num_buckets
        self.max_distance = max_distance
        t5_relative_bucket(torch.zeros(1, dtype=torch.long), bidirectional, num_buckets, max_distance)  # validates
        self.weight = nn.Parameter(torch.zeros(num_buckets, self.num_heads))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, relative_position: torch.Tensor) -> torch.Tensor:
        return self.bias(_check_relative(relative_position, ndim_at_least=2))

    def bias(self, relative_position: torch.Tensor) -> torch.Tensor:
        """The module's call without argument checks (int64 ``relative_position``)."""
        buckets = bucket_of(
            relative_position.to(self.weight.device), self.bidirectional, self.num_buckets, self.max_distance
        )
        return self.weight[buckets].movedim(-1, -3)

    def extra_repr(self) -> str:
        return (
            f"num_heads={self.num_heads}, bidirectional={self.bidirectional}, "
            f"num_buckets={self.num_buckets}, max_distance={self.max_distance}"
        )


# ----------------------------------------------------------------------------- ALiBi


def alibi_slopes(num_heads: int, *, alibi_bias_max: float = 8.0) -> torch.Tensor:
    r"""ALiBi's per-head slopes (Press et al., 2022, section 3), with MPT's ``alibi_bias_max``.

    For ``H`` heads, ``H`` a power of two, the slopes are the geometric sequence
    ``2^(-B/H), 2^(-2B/H), ..., 2^(-B)`` with ``B = alibi_bias_max`` (8 in the paper). Otherwise,
    with ``H'`` the largest power of two below ``H``, the first ``H'`` slopes are those of ``H'``
    heads and the remaining ``H - H'`` are every other slope of ``2H'`` heads
    (``2^(-B/2H'), 2^(-3B/2H'), ...``), the rule in the paper's code. This is MPT's ``gen_slopes``
    (``1 / 2^(B i / 2^ceil(log2 H))`` for ``i = 1 .. 2^ceil(log2 H)``, the even-``i`` slopes first,
    then the odd ones, cut to ``H``) written in float64.

    Args:
        num_heads: ``H >= 1``.
        alibi_bias_max: ``B``, finite and > 0 (MPT's config key; 8 gives the paper's slopes).

    Returns:
        float64 tensor of shape ``[num_heads]``.

    Example:
        >>> alibi_slopes(8).tolist()
        [0.5, 0.25, 0.125, 0.0625, 0.03125, 0.015625, 0.0078125, 0.00390625]
    """
    num_heads = check_int(num_heads, "num_heads", minimum=1)
    bias_max = check_positive_float(alibi_bias_max, "alibi_bias_max")

    def power_of_two(n: int) -> torch.Tensor:
        return 2.0 ** (-bias_max * torch.arange(1, n + 1, dtype=torch.float64) / n)

    closest = 2 ** int(math.floor(math.log2(num_heads)))
    slopes = power_of_two(closest)
    if closest < num_heads:
        slopes = torch.cat((slopes, power_of_two(2 * closest)[0::2][: num_heads - closest]))
    return slopes


def alibi_bias(
    num_heads: int,
    query_len: int,
    key_len: int | None = None,
    *,
    offset: int = 0,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
    alibi_bias_max: float = 8.0,
) -> torch.Tensor:
    r"""ALiBi's bias ``b_ij = -mu_h |j - i|`` (``-mu_h (i - j)`` under a causal mask), shape ``[num_heads, query_len, key_len]``.

    In a causal model only ``j <= i`` survives the mask, where this is the paper's
    ``m (j - i)`` (``mu_h`` here); the absolute value makes the same bias usable without a causal mask. The
    slopes ``mu_h`` are :func:`~ropelib.alibi_slopes` ``(num_heads, alibi_bias_max=...)`` (MPT's key).
    """
    dtype = check_float_dtype(dtype)
    rel = relative_positions(query_len, key_len, offset=offset, device=device)
    return alibi_bias_from_relative(alibi_slopes(num_heads, alibi_bias_max=alibi_bias_max), rel, dtype=dtype)


def alibi_bias_from_relative(
    slopes: torch.Tensor, relative_position: torch.Tensor, *, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``-slopes[h] * |relative_position|`` for ``relative_position`` of shape ``[..., q, k]``.

    Returns ``[..., num_heads, q, k]`` in ``dtype`` (formed in float64).
    """
    dtype = check_float_dtype(dtype)
    relative_position = _check_relative(relative_position, ndim_at_least=2)
    slopes = check_float_tensor(slopes, "slopes", ndim=1).to(device=relative_position.device, dtype=torch.float64)
    distance = relative_position.abs().double().unsqueeze(-3)  # [..., 1, q, k]
    return (-slopes[:, None, None] * distance).to(dtype)


# ----------------------------------------------------------------------------- Shaw et al.


class ShawRelativePosition(nn.Module):
    r"""Shaw et al. (2018)'s clipped relative position embeddings.

    Two learned tables of ``2 k_max + 1`` vectors (``k_max = max_relative_position``), indexed
    by ``clip(j - i, -k_max, k_max)``. Attention then becomes

    .. math::

        e_{ij} = \frac{q_i \cdot (k_j + a^K_{ij})}{\sqrt{d}}, \qquad
        z_i = \sum_j a_{ij} (v_j + a^V_{ij}),

    so the bias ``b_ij = q_i \cdot a^K_{ij} / \sqrt{d}`` depends on the query as well as on ``j - i``.
    The tables are shared by all heads, as in the paper.

    Args:
        head_dim: per-head width ``d``.
        max_relative_position: the clipping distance ``k_max``.
        values: also learn ``a^V`` (the paper's second table).
    """

    def __init__(self, head_dim: int, max_relative_position: int = 16, values: bool = True) -> None:
        super().__init__()
        self.head_dim = check_int(head_dim, "head_dim", minimum=1)
        self.max_relative_position = check_int(max_relative_position, "max_relative_position", minimum=1)
        size = 2 * self.max_relative_position + 1
        self.key_table = nn.Parameter(torch.randn(size, self.head_dim) * 0.02)
        check_bool(values, "values")
        self.value_table = nn.Parameter(torch.randn(size, self.head_dim) * 0.02) if values else None

    def index(self, relative_position: torch.Tensor) -> torch.Tensor:
        """``clip(j - i, -k, k) + k``: rows of the tables, same shape as ``relative_position``."""
        relative_position = _check_relative(relative_position, ndim_at_least=2)
        k = self.max_relative_position
        return relative_position.to(self.key_table.device).clamp(-k, k) + k

    def score_bias(self, q: torch.Tensor, relative_position: torch.Tensor) -> torch.Tensor:
        r"""``q_i \cdot a^K_{ij} / \sqrt{d}``.

        Args:
            q: ``[batch, heads, query_len, d]``.
            relative_position: ``[query_len, key_len]`` or ``[batch, query_len, key_len]``.

        Returns:
            ``[batch, heads, query_len, key_len]`` in ``q``'s dtype.
        """
        q = check_float_tensor(q, "q", ndim=4)
        if q.shape[-1] != self.head_dim:
            raise ValueError(f"q must have last dimension {self.head_dim}, got shape {tuple(q.shape)}")
        table = self.key_table[self._batched_index(relative_position, q.shape[0], q.shape[2])].to(q.dtype)
        return torch.einsum("bhid,bijd->bhij", q, table) / math.sqrt(self.head_dim)

    def value_term(self, weights: torch.Tensor, relative_position: torch.Tensor) -> torch.Tensor:
        r"""``\sum_j a_{ij} a^V_{ij}`` for attention weights ``[batch, heads, query_len, key_len]``.

        Returns ``[batch, heads, query_len, d]``.
        """
        if self.value_table is None:
            raise ValueError("this ShawRelativePosition was built with values=False")
        weights = check_float_tensor(weights, "weights", ndim=4)
        table = self.value_table[self._batched_index(relative_position, weights.shape[0], weights.shape[2])].to(
            weights.dtype
        )
        return torch.einsum("bhij,bijd->bhid", weights, table)

    def _batched_index(self, relative_position: torch.Tensor, batch: int, query_len: int) -> torch.Tensor:
        index = self.index(relative_position)
        if index.ndim == 2:
            index = index.unsqueeze(0)
        if index.ndim != 3 or index.shape[0] not in (1, batch) or index.shape[1] != query_len:
            raise ValueError(
                f"relative_position must have shape [{query_len}, key_len] or [{batch}, {query_len}, key_len], "
                f"got {tuple(relative_position.shape)}"
            )
        return index.expand(batch, *index.shape[1:])

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, max_relative_position={self.max_relative_position}, values={self.value_table is not None}"
