r"""RoPE at scale: context parallelism.

Context parallelism (CP) splits one long sequence over ``G`` ranks along ``seq``: each rank
holds ``N / G`` tokens of ``q``, ``k`` and ``v`` and computes the attention output of its own
queries against the keys of the whole sequence. Two things must be right for RoPE:

* **Global positions.** A rank's tokens must be rotated by their positions in the *full*
  sequence, not by ``0 .. N/G - 1``: the score ``<R_m q, R_n k>`` depends on ``m - n``, and
  ``m``, ``n`` are global. :func:`~ropelib.shard_positions` gives those positions (Megatron-core slices
  its rotary table the same way in ``get_pos_emb_on_this_cp_rank``).
* **The causal mask by global positions**: key ``n`` is visible to query ``m`` iff ``n <= m``.

**Why load balancing matters.** With a causal mask the query at position ``p`` attends to
``p + 1`` keys. Cut into contiguous shards of ``N_s = N / G`` tokens, rank ``g`` holds positions
``[g N_s, (g+1) N_s)`` and does ``sum_p (p + 1) = N_s (g N_s + (N_s+1)/2) ~ N_s^2 (g + 1/2)``
units of work: the last rank does about ``(G - 1/2) / (1/2) = 2G - 1`` times the work of the first, and a
kernel that skips masked blocks (flash attention, ring attention) leaves the first ranks idle.
The load-balanced ("head-tail", "zigzag") layout cuts the sequence into ``2G`` chunks of
``c = N / (2G)`` tokens and gives rank ``g`` the chunks ``g`` and ``2G - 1 - g``; its work is
``c (gc + (c+1)/2) + c ((2G-1-g)c + (c+1)/2) = c (2Gc + 1)`` on every rank, exactly. This is
the layout of Megatron-core (``get_batch_on_this_cp_rank``, ``get_pos_emb_on_this_cp_rank``),
TransformerEngine's context parallelism, Llama 3's all-gather CP (Llama Team, AI @ Meta, 2024, §3.3.2)
and PyTorch's ``torch.distributed.tensor.experimental.context_parallel``, whose default load
balancer (``_HeadTailLoadBalancer``, the "round-robin" one of ``context_parallel_unshard``)
builds the same index: for ``N = 16, G = 4`` rank 0 holds ``[0, 1, 14, 15]`` and rank 3 holds
``[6, 7, 8, 9]``, as :func:`~ropelib.shard_positions` does. So a buffer sharded by PyTorch's
``context_parallel(mesh, buffers=[...], buffer_seq_dims=[...])`` lines up token for token with
:func:`~ropelib.shard_sequence` and :func:`~ropelib.shard_positions`.

**PyTorch's context_parallel on a CPU (torch 2.13, gloo).** Tried with 2 and 4 processes on
``init_device_mesh("cpu", (G,))``: the buffer sharding and ``context_parallel_unshard`` work and
give the layout above, but ``scaled_dot_product_attention`` inside the context fails. The CPU
dispatches to ``aten._scaled_dot_product_flash_attention_for_cpu``, which has no DTensor
sharding strategy ("does not have a sharding strategy registered"); the ring-attention handlers
cover only the CUDA flash, memory-efficient and cuDNN kernels, and the math backend
(``sdpa_kernel(SDPBackend.MATH)``) fails on mixed Tensor/DTensor arguments. Its attention is
therefore CUDA-only; :func:`~ropelib.context_parallel_attention` below runs anywhere ``torch.distributed``
does.

:func:`~ropelib.context_parallel_attention` is the simplest correct CP attention (all-gather KV, as in
Llama 3 and Megatron's ``cp_comm_type="all_gather"``): every rank gathers the rotated keys,
values and their positions from all ranks and masks by global positions. Ring attention
(Liu et al., 2024, arXiv:2310.01889) instead passes KV blocks around a ring and overlaps the
transfers with compute, so no rank holds the whole KV.

Tensors are ``[batch, seq, heads, head_dim]``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ._validation import check_float_tensor, check_int, check_positions
from .rotary import RotaryEmbedding


def _check_bool(value: object, name: str) -> bool:
    """A real ``bool`` (not a truthy int or string)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def _check_dim(dim: object, ndim: int, name: str = "dim") -> int:
    """An ``int`` in ``[-ndim, ndim)``, returned as non-negative."""
    dim = check_int(dim, name)
    if not -ndim <= dim < ndim:
        raise ValueError(f"{name} must be in [{-ndim}, {ndim}) for a tensor of {ndim} dimensions, got {dim}")
    return dim % ndim


def _chunks(
    seq_len: object, world_size: object, rank: object, load_balance: object, name: str
) -> list[tuple[int, int]]:
    """The ``(start, stop)`` ranges of the sequence that ``rank`` holds, in order."""
    seq_len = check_int(seq_len, name, minimum=0)
    world_size = check_int(world_size, "world_size", minimum=1)
    rank = check_int(rank, "rank", minimum=0)
    if rank >= world_size:
        raise ValueError(f"rank must be in [0, {world_size}) (world_size = {world_size}), got {rank}")
    parts = 2 * world_size if _check_bool(load_balance, "load_balance") else world_size
    if seq_len % parts:
        what = f"2 * world_size = {parts} (load_balance=True)" if load_balance else f"world_size = {parts}"
        raise ValueError(f"{name} must be divisible by {what}, got {seq_len}")
    c = seq_len // parts
    owned = [rank, parts - 1 - rank] if load_balance else [rank]
    return [(j * c, (j + 1) * c) for j in owned]


def shard_positions(
    seq_len: int,
    world_size: int,
    rank: int,
    *,
    load_balance: bool = True,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Global positions of the tokens that ``rank`` holds under context parallelism.

    With ``load_balance=True`` the sequence is cut into ``2 * world_size`` chunks of
    ``c = seq_len / (2 * world_size)`` tokens and rank ``g`` holds chunks ``g`` and
    ``2 * world_size - 1 - g``, in that order (Megatron-core, TransformerEngine, PyTorch's
    head-tail load balancer); every rank then does the same causal-attention work. With
    ``load_balance=False`` rank ``g`` holds the contiguous ``[g N_s, (g + 1) N_s)``, ``N_s = seq_len / world_size``.

    Args:
        seq_len: the full sequence length ``N``; divisible by ``2 * world_size`` (load-balanced)
            or ``world_size``.
        world_size: the number of context-parallel ranks ``G >= 1``.
        rank: this rank, ``0 <= rank < world_size``.
        load_balance: the 2G-chunk layout (default) or contiguous shards.
        device: where to put the result.

    Returns:
        int64 ``[N / G]``, to pass as ``positions`` to :class:`ropelib.RotaryEmbedding`.

    Example:
        >>> from ropelib.distributed import shard_positions
        >>> shard_positions(8, 2, 0).tolist(), shard_positions(8, 2, 1).tolist()
        ([0, 1, 6, 7], [2, 3, 4, 5])
    """
    ranges = _chunks(seq_len, world_size, rank, load_balance, "seq_len")
    return torch.cat([torch.arange(start, stop, device=device) for start, stop in ranges])


def shard_sequence(
    x: torch.Tensor, world_size: int, rank: int, *, dim: int = 1, load_balance: bool = True
) -> torch.Tensor:
    """The part of ``x`` along ``dim`` that ``rank`` holds: ``x.index_select(dim, shard_positions(...))``.

    Args:
        x: any tensor, e.g. ``[batch, seq, heads, head_dim]`` or token ids ``[batch, seq]``.
        world_size, rank, load_balance: as in :func:`~ropelib.shard_positions`.
        dim: the sequence dimension (``1`` for ``[batch, seq, ...]``).

    Returns:
        A new tensor like ``x`` with ``x.shape[dim] / world_size`` entries along ``dim``.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    dim = _check_dim(dim, x.ndim)
    ranges = _chunks(x.shape[dim], world_size, rank, load_balance, f"x.shape[{dim}]")
    return torch.cat([x.narrow(dim, start, stop - start) for start, stop in ranges], dim=dim)


def unshard_sequence(shards: Sequence[torch.Tensor], *, dim: int = 1, load_balance: bool = True) -> torch.Tensor:
    """Put the shards of all ranks back into the full sequence (the inverse of :func:`~ropelib.shard_sequence`).

    With ``load_balance=True`` shard ``g`` is ``[chunk g, chunk 2G-1-g]``, so the sequence is the
    first halves of ranks ``0 .. G-1`` followed by the second halves of ranks ``G-1 .. 0``.

    Args:
        shards: the ``world_size`` shards in rank order, all of the same shape, dtype and device
            (e.g. the outputs gathered with ``torch.distributed.all_gather``).
        dim: the sequence dimension.
        load_balance: how the shards were cut.

    Returns:
        The full tensor, ``world_size * shards[0].shape[dim]`` entries along ``dim``.
    """
    if isinstance(shards, torch.Tensor) or not isinstance(shards, Sequence):
        raise TypeError(f"shards must be a list or tuple of tensors (one per rank), got {type(shards).__name__}")
    if len(shards) == 0:
        raise ValueError("shards must hold one tensor per rank (world_size >= 1), got an empty sequence")
    for i, s in enumerate(shards):
        if not isinstance(s, torch.Tensor):
            raise TypeError(f"shards[{i}] must be a torch.Tensor, got {type(s).__name__}")
        if s.shape != shards[0].shape or s.dtype != shards[0].dtype or s.device != shards[0].device:
            raise ValueError(
                f"shards must share shape, dtype and device; shards[0] is {tuple(shards[0].shape)} "
                f"{shards[0].dtype} {shards[0].device}, shards[{i}] is {tuple(s.shape)} {s.dtype} {s.device}"
            )
    dim = _check_dim(dim, shards[0].ndim)
    if not _check_bool(load_balance, "load_balance"):
        return torch.cat(list(shards), dim=dim)
    local = shards[0].shape[dim]
    if local % 2:
        raise ValueError(f"shards[0].shape[{dim}] must be even (two chunks per rank, load_balance=True), got {local}")
    c = local // 2
    heads = [s.narrow(dim, 0, c) for s in shards]
    tails = [s.narrow(dim, c, c) for s in reversed(shards)]
    return torch.cat(heads + tails, dim=dim)


# context_parallel_attention is shown whole in book/rope_at_scale.ipynb (literalinclude): it is laid
# out by hand to fit the book's code blocks (76 columns), so the formatter leaves it alone.
# fmt: off
def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    rope: RotaryEmbedding,
    *,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    r"""Causal attention with RoPE for one rank of a context-parallel group
    (all-gather KV).

    A worked example, forward only, to run inside an initialised
    ``torch.distributed`` process group where every rank calls it with its
    own shard (from :func:`~ropelib.shard_sequence`):

    1. rotate this rank's ``q`` and ``k`` by their *global* ``positions``
       (``rope(q, k, positions=positions)``);
    2. all-gather the rotated ``k``, ``v`` and the positions of every rank
       (``torch.distributed.all_gather``);
    3. ``out = softmax(q k^T / sqrt(d) + M) v`` with ``M[m, n] = 0`` if
       ``pos_k[n] <= pos_q[m]`` else ``-inf``, by
       :func:`torch.nn.functional.scaled_dot_product_attention` with a
       boolean mask.

    Because the mask is built from the gathered positions, the keys need
    not be put back in sequence order (softmax over keys does not depend on
    their order), and every query sees at least its own key, so no row is
    fully masked. Either sharding layout works.

    Grouped-query / multi-query attention is supported: ``k`` and ``v`` may
    have ``kv_heads`` dividing ``heads``; the gathered keys and values are
    repeated per query group after the all-gather (Hugging Face's
    ``repeat_kv``: query head ``h`` uses kv head
    ``h // (heads / kv_heads)``), so only ``kv_heads`` travel over the
    network.

    ``torch.distributed.all_gather`` does not carry gradients, and the dense
    mask costs ``local_seq * seq`` memory per rank: this shows the position
    bookkeeping, not a training kernel (for that, ring attention or
    PyTorch's ``context_parallel`` on CUDA).

    Args:
        q: ``[batch, local_seq, heads, head_dim]``, this rank's queries.
        k, v: ``[batch, local_seq, kv_heads, head_dim]``, this rank's keys
            and values.
        positions: int ``[local_seq]`` or ``[batch, local_seq]``, the global
            positions of this rank's tokens
            (:func:`~ropelib.shard_positions`); every rank must pass the
            same shape.
        rope: a :class:`ropelib.RotaryEmbedding`, called as
            ``rope(q, k, positions=positions)``.
        group: the process group (default: the world).

    Returns:
        ``[batch, local_seq, heads, head_dim]``, this rank's attention
        output in ``q``'s dtype.
    """
    q = check_float_tensor(q, "q", ndim=4)
    k = check_float_tensor(k, "k", ndim=4)
    v = check_float_tensor(v, "v", ndim=4)
    if not isinstance(rope, RotaryEmbedding):
        raise TypeError(
            "rope must be a ropelib.RotaryEmbedding, "
            f"got {type(rope).__name__}"
        )
    if k.shape != v.shape:
        raise ValueError(
            "k and v must have the same shape, "
            f"got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    if k.shape[:2] != q.shape[:2] or k.shape[3] != q.shape[3]:
        raise ValueError(
            "q and k must share batch, local_seq and head_dim, "
            f"got {tuple(q.shape)} and {tuple(k.shape)}"
        )
    heads, kv_heads = q.shape[2], k.shape[2]
    if heads % kv_heads:
        raise ValueError(
            f"the number of kv heads ({kv_heads}) must divide "
            f"the number of query heads ({heads})"
        )
    if v.dtype != q.dtype or v.device != q.device:
        raise ValueError(
            "q and v must share dtype and device, "
            f"got {q.dtype}/{q.device} and {v.dtype}/{v.device}"
        )
    positions = check_positions(
        positions, "positions", batch=q.shape[0], seq_len=q.shape[1]
    ).to(q.device)
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "context_parallel_attention needs an initialised "
            "torch.distributed process group"
        )

    q, k = rope(q, k, positions=positions)
    world = dist.get_world_size(group)

    def gather(t: torch.Tensor) -> list[torch.Tensor]:
        t = t.contiguous()
        out = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(out, t, group=group)
        return out

    # [batch, seq, kv_heads, d], in rank order
    k_all = torch.cat(gather(k), dim=1)
    v_all = torch.cat(gather(v), dim=1)
    pos_k = torch.cat(gather(positions), dim=-1)  # [seq] or [batch, seq]
    if kv_heads != heads:
        k_all = k_all.repeat_interleave(heads // kv_heads, dim=2)
        v_all = v_all.repeat_interleave(heads // kv_heads, dim=2)
    # [local_seq, seq] or [batch, local_seq, seq]
    mask = pos_k.unsqueeze(-2) <= positions.unsqueeze(-1)
    if mask.ndim == 3:
        mask = mask.unsqueeze(1)  # broadcast over heads
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k_all.transpose(1, 2),
        v_all.transpose(1, 2),
        attn_mask=mask,
    )  # [batch, heads, local_seq, d]
    return out.transpose(1, 2)
# fmt: on
