"""Context parallelism (ropelib.distributed): shard layouts by hand, round trips, validation, and real processes.

The multi-process tests spawn 2 and 4 CPU processes on the gloo backend; each computes
``context_parallel_attention`` on its shard and the parent compares the unsharded outputs with
causal attention over the whole sequence, computed here with a plain softmax.
"""

from __future__ import annotations

import datetime
import math
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ropelib.distributed import context_parallel_attention, shard_positions, shard_sequence, unshard_sequence
from ropelib.rotary import RotaryEmbedding

# Small shapes: a batch of 2, 16 tokens (divisible by 2 * 4), 4 query heads, head_dim 8.
BATCH, SEQ, HEADS, HEAD_DIM = 2, 16, 4, 8
# (kv_heads, load_balance, per-batch [batch, seq] positions instead of [seq]); kv_heads=2 is GQA.
CASES = [(4, True, False), (4, False, False), (2, True, True), (2, False, False)]


@pytest.mark.parametrize(
    ("world_size", "load_balance", "expected"),
    [
        (2, True, [[0, 1, 6, 7], [2, 3, 4, 5]]),  # chunks of 2: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
        (2, False, [[0, 1, 2, 3], [4, 5, 6, 7]]),
        (4, True, [[0, 7], [1, 6], [2, 5], [3, 4]]),
        (4, False, [[0, 1], [2, 3], [4, 5], [6, 7]]),
        (1, True, [[0, 1, 2, 3, 4, 5, 6, 7]]),
        (1, False, [[0, 1, 2, 3, 4, 5, 6, 7]]),
    ],
)
def test_shard_positions_by_hand(world_size: int, load_balance: bool, expected: list[list[int]]) -> None:
    for rank in range(world_size):
        pos = shard_positions(8, world_size, rank, load_balance=load_balance)
        assert pos.dtype == torch.int64
        assert pos.tolist() == expected[rank]


@pytest.mark.parametrize("load_balance", [True, False])
@pytest.mark.parametrize(("seq_len", "world_size"), [(8, 1), (8, 2), (24, 3), (16, 4), (48, 6)])
def test_shards_are_a_permutation(seq_len: int, world_size: int, load_balance: bool) -> None:
    together = []
    for rank in range(world_size):
        together += shard_positions(seq_len, world_size, rank, load_balance=load_balance).tolist()
    assert sorted(together) == list(range(seq_len))
    if not load_balance:
        assert together == list(range(seq_len))


def test_matches_pytorch_head_tail_load_balancer() -> None:
    # PyTorch's context_parallel shards buffers with this index (a private class, so skip if it moves).
    try:
        from torch.distributed.tensor.experimental._context_parallel._load_balancer import _HeadTailLoadBalancer
    except ImportError:
        pytest.skip("torch has no _HeadTailLoadBalancer")
    for seq_len, world_size in [(16, 4), (24, 3), (8, 2)]:
        index = _HeadTailLoadBalancer(seq_len, world_size, "cpu")._generate_indices()[0]
        ours = torch.cat([shard_positions(seq_len, world_size, r) for r in range(world_size)])
        assert ours.tolist() == index.tolist()


def test_load_balancing_evens_out_causal_work() -> None:
    # Work of a rank = number of (query, key) pairs with key <= query = sum over its positions of (p + 1).
    seq_len, world_size = 1024, 4
    chunk = seq_len // (2 * world_size)

    def work(load_balance: bool) -> list[int]:
        return [
            sum(p + 1 for p in shard_positions(seq_len, world_size, r, load_balance=load_balance).tolist())
            for r in range(world_size)
        ]

    assert work(True) == [chunk * (2 * world_size * chunk + 1)] * world_size  # c (2Wc + 1) on every rank
    contiguous = work(False)
    assert contiguous[-1] / contiguous[0] == pytest.approx(2 * world_size - 1, rel=0.01)  # 6.98 ~ 2W - 1


@pytest.mark.parametrize("load_balance", [True, False])
@pytest.mark.parametrize("dim", [1, -3, 0, 2])
def test_unshard_inverts_shard(load_balance: bool, dim: int) -> None:
    x = torch.randn(8, 8, 8, 3)
    world_size = 2 if dim % 4 == 0 else 4
    shards = [shard_sequence(x, world_size, r, dim=dim, load_balance=load_balance) for r in range(world_size)]
    assert all(s.shape[dim] == 8 // world_size for s in shards)
    assert torch.equal(unshard_sequence(shards, dim=dim, load_balance=load_balance), x)


def test_shard_sequence_takes_the_shard_positions() -> None:
    x = torch.arange(2 * 12).reshape(2, 12)  # token ids [batch, seq]: x[b, p] = 12 b + p
    shard = shard_sequence(x, 3, 1)  # chunks of 2: rank 1 holds chunks 1 and 4, positions [2, 3, 8, 9]
    assert shard.tolist() == [[2, 3, 8, 9], [14, 15, 20, 21]]
    assert shard_sequence(x, 3, 1, load_balance=False).tolist() == [[4, 5, 6, 7], [16, 17, 18, 19]]


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: shard_positions(10, 2, 0), ValueError, r"seq_len must be divisible by 2 \* world_size = 4"),
        (
            lambda: shard_positions(10, 4, 0, load_balance=False),
            ValueError,
            r"seq_len must be divisible by world_size = 4",
        ),
        (lambda: shard_positions(8, 0, 0), ValueError, r"world_size must be >= 1, got 0"),
        (lambda: shard_positions(8, 2, 2), ValueError, r"rank must be in \[0, 2\) .* got 2"),
        (lambda: shard_positions(8, 2, -1), ValueError, r"rank must be >= 0, got -1"),
        (lambda: shard_positions(-8, 2, 0), ValueError, r"seq_len must be >= 0, got -8"),
        (lambda: shard_positions(8.0, 2, 0), TypeError, r"seq_len must be an int, got float"),
        (lambda: shard_positions(8, True, 0), TypeError, r"world_size must be an int, got bool"),
        (lambda: shard_positions(8, 2, False), TypeError, r"rank must be an int, got bool"),
        (lambda: shard_positions(8, 2, 0, load_balance=1), TypeError, r"load_balance must be a bool, got int"),
        (lambda: shard_sequence([1, 2], 2, 0), TypeError, r"x must be a torch.Tensor, got list"),
        (
            lambda: shard_sequence(torch.zeros(2, 6), 2, 0),
            ValueError,
            r"x.shape\[1\] must be divisible by 2 \* world_size = 4",
        ),
        (lambda: shard_sequence(torch.zeros(2, 8), 2, 0, dim=2), ValueError, r"dim must be in \[-2, 2\) .* got 2"),
        (lambda: shard_sequence(torch.zeros(2, 8), 2, 0, dim=1.0), TypeError, r"dim must be an int, got float"),
        (lambda: unshard_sequence([]), ValueError, r"shards must hold one tensor per rank"),
        (lambda: unshard_sequence(torch.zeros(2, 4)), TypeError, r"shards must be a list or tuple of tensors"),
        (lambda: unshard_sequence([torch.zeros(1, 4), "a"]), TypeError, r"shards\[1\] must be a torch.Tensor, got str"),
        (lambda: unshard_sequence([torch.zeros(1, 4), torch.zeros(1, 2)]), ValueError, r"shards must share shape"),
        (lambda: unshard_sequence([torch.zeros(1, 3)] * 2), ValueError, r"shards\[0\].shape\[1\] must be even"),
        (lambda: unshard_sequence([torch.zeros(1, 4)] * 2, dim=-3), ValueError, r"dim must be in \[-2, 2\)"),
        (
            lambda: unshard_sequence([torch.zeros(1, 4)] * 2, load_balance="yes"),
            TypeError,
            r"load_balance must be a bool",
        ),
    ],
)
def test_bad_arguments_raise(call, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        call()


def test_attention_validates_before_communicating() -> None:
    rope = RotaryEmbedding(HEAD_DIM)
    q, k = torch.randn(1, 4, 4, HEAD_DIM), torch.randn(1, 4, 3, HEAD_DIM)
    with pytest.raises(ValueError, match=r"kv heads \(3\) must divide the number of query heads \(4\)"):
        context_parallel_attention(q, k, k, torch.arange(4), rope)
    with pytest.raises(TypeError, match=r"rope must be a ropelib.RotaryEmbedding"):
        context_parallel_attention(q, q, q, torch.arange(4), lambda q, k, positions: (q, k))
    with pytest.raises(ValueError, match=r"positions must have shape \[4\] or \[1, 4\]"):
        context_parallel_attention(q, q, q, torch.arange(5), rope)
    with pytest.raises(RuntimeError, match=r"needs an initialised torch.distributed process group"):
        context_parallel_attention(q, q, q, torch.arange(4), rope)


def make_qkv(kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same float64 q, k, v in every process (a fixed seed)."""
    g = torch.Generator().manual_seed(kv_heads)
    q = torch.randn(BATCH, SEQ, HEADS, HEAD_DIM, generator=g, dtype=torch.float64)
    k = torch.randn(BATCH, SEQ, kv_heads, HEAD_DIM, generator=g, dtype=torch.float64)
    v = torch.randn(BATCH, SEQ, kv_heads, HEAD_DIM, generator=g, dtype=torch.float64)
    return q, k, v


def _worker(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    """One context-parallel rank: attention on its shards for every case, saved to ``out_dir/rank{rank}.pt``."""
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=60)  # a failed peer ends the collective instead of hanging
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size, timeout=timeout
    )
    try:
        rope = RotaryEmbedding(HEAD_DIM)
        results = {}
        for kv_heads, load_balance, per_batch in CASES:
            q, k, v = (shard_sequence(t, world_size, rank, load_balance=load_balance) for t in make_qkv(kv_heads))
            pos = shard_positions(SEQ, world_size, rank, load_balance=load_balance)
            if per_batch:
                pos = pos.expand(BATCH, -1)
            results[(kv_heads, load_balance, per_batch)] = context_parallel_attention(q, k, v, pos, rope)
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def causal_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v with key j <= query i, per head, on ``[batch, seq, heads, d]``.

    Query head ``h`` uses kv head ``h // (heads / kv_heads)`` (grouped-query attention).
    """
    batch, seq, heads, d = q.shape
    group = heads // k.shape[2]
    out = torch.empty_like(q)
    future = torch.tensor([[j > i for j in range(seq)] for i in range(seq)])
    for h in range(heads):
        qh, kh, vh = q[:, :, h], k[:, :, h // group], v[:, :, h // group]  # [batch, seq, d]
        scores = (qh @ kh.transpose(-1, -2) / math.sqrt(d)).masked_fill(future, float("-inf"))
        weights = (scores - scores.amax(-1, keepdim=True)).exp()
        out[:, :, h] = (weights / weights.sum(-1, keepdim=True)) @ vh
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_context_parallel_attention_matches_full_attention(world_size: int, tmp_path: Path) -> None:
    context = mp.spawn(
        _worker, args=(world_size, str(tmp_path / "store"), str(tmp_path)), nprocs=world_size, join=False
    )
    deadline = time.monotonic() + 120
    while not context.join(timeout=2):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.terminate()
            pytest.fail(f"the {world_size} processes did not finish in 120 s")
    outputs = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world_size)]

    rope = RotaryEmbedding(HEAD_DIM)
    for case in CASES:
        kv_heads, load_balance, _ = case
        q, k, v = make_qkv(kv_heads)
        q_rot, k_rot = rope(q, k)  # float64, positions 0 .. SEQ-1
        expected = causal_attention_ref(q_rot, k_rot, v)
        shards = [out[case] for out in outputs]
        assert all(s.shape == (BATCH, SEQ // world_size, HEADS, HEAD_DIM) for s in shards)
        got = unshard_sequence(shards, load_balance=load_balance)
        # Everything is float64; the two sides differ only in summation order (SDPA vs the loop above)
        # over <= 16 keys of O(1) terms: measured <= 7e-16 (3 ulp of outputs ~3). 1e-12 leaves a
        # 1000x margin yet catches any wrong position or mask entry, which changes outputs by O(0.1-1).
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
