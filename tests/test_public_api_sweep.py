"""Every public entry point of ``ropelib.__all__`` called the way a careless or hostile user would.

Each case either gives the right answer (checked against a float64 reference, a hand-worked value
or the plain contiguous call) or raises :class:`TypeError`/:class:`ValueError` whose message names
the argument. Wrong types, ranks, empty tensors, NaN/inf, extreme and negative positions,
non-contiguous/expanded/aliased inputs, mixed dtypes and devices, meta tensors.
``test_every_public_name_is_swept`` fails when a public name has no case here.
"""

from __future__ import annotations

import math
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

import ropelib as rl
from ropelib.frequencies import ntk_rescaled_theta, pixel_inverse_frequencies
from ropelib.kernels.door import no_offsets, offset_positions

from references import rotate_ref

Q, K = torch.randn(1, 4, 2, 8, generator=torch.Generator().manual_seed(0)), torch.randn(1, 4, 1, 8)
X = torch.randn(2, 4, 8)
COS, SIN = rl.RotaryEmbedding(8).cos_sin_cache(16)
COS, SIN = COS[:16], SIN[:16]
CONFIG = {"hidden_size": 32, "num_attention_heads": 4, "max_position_embeddings": 64}
LINEAR = {"rope_type": "linear", "factor": 2.0}
META = torch.device("meta")


@dataclass(frozen=True)
class Case:
    name: str  # the public name it exercises
    call: Callable[[], Any]
    error: type[Exception] | None = None  # expected exception, or None for a result
    match: str = ""  # regex the message must contain (it names the argument)
    check: Callable[[Any], bool] | None = None  # for results: must return True


def raises(name: str, error: type[Exception], match: str, call: Callable[[], Any]) -> Case:
    return Case(name, call, error, match)


def gives(name: str, check: Callable[[Any], bool], call: Callable[[], Any]) -> Case:
    return Case(name, call, check=check)


def close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-6) -> bool:
    """float32 rotations of values ~3: a few float32 ulps (1e-7 relative) apart at most."""
    return a.shape == b.shape and bool(((a.double() - b.double()).abs() <= tol * (1 + b.double().abs())).all())


def rotated(q: torch.Tensor, positions: torch.Tensor, layout: str = "half") -> torch.Tensor:
    return rotate_ref(q, positions, layout=layout)


def shapes(*expected: tuple[int, ...]) -> Callable[[Any], bool]:
    def ok(result: Any) -> bool:
        results = result if isinstance(result, tuple) else (result,)
        return [tuple(r.shape) for r in results] == [tuple(e) for e in expected]

    return ok


def empty_like_ok(result: Any) -> bool:
    results = result if isinstance(result, tuple) else (result,)
    return all(r.numel() == 0 for r in results)


ROPE = rl.RotaryEmbedding(8)
CPU = torch.device("cpu")
#: the native kernel builds where a C compiler is found (``$CC``, cc, gcc or clang) unless turned off
NATIVE = os.environ.get("ROPELIB_CPU_COMPILE", "1") != "0" and any(
    map(shutil.which, [os.environ["CC"]] if os.environ.get("CC") else ["cc", "gcc", "clang"])
)


def cache_is_bounded(rope: rl.RotaryEmbedding) -> bool:
    """The cache holds at most 2^16 rows per table: a few MB for every (device, dtype) it has, not 2^31 rows."""
    rows = rope.cache.tables(CPU, torch.float32).length
    return rope.cache.limit <= 1 << 16 and rows <= rope.cache.limit and rope.cache.nbytes() <= 1 << 24


def spec_frequencies_by_hand(r: Any) -> bool:
    inv, scale = r.frequencies()
    want = [100.0 ** (-2 * i / 8) for i in range(4)]
    return inv.dtype == torch.float64 and inv.tolist() == pytest.approx(want, rel=1e-15) and scale == 1.0


def cache_rows_by_hand(tables: Any) -> bool:
    """Row p holds cos(p theta^(-2i/r)), sin(...) rounded once to float32 (half an ulp of values <= 1: 2^-24),
    with at least the rows asked for."""
    angles = [[p * 1e4 ** (-2 * i / 8) for i in range(4)] for p in range(10)]
    want_cos = torch.tensor([[math.cos(a) for a in row] for row in angles], dtype=torch.float64)
    want_sin = torch.tensor([[math.sin(a) for a in row] for row in angles], dtype=torch.float64)
    return (
        tables.length >= 10
        and tables.cos.dtype == tables.sin.dtype == torch.float32
        and float((tables.cos[:10].double() - want_cos).abs().max()) <= 2**-24
        and float((tables.sin[:10].double() - want_sin).abs().max()) <= 2**-24
    )


EXPANDED_K = torch.randn(1, 4, 1, 8).expand(1, 4, 2, 8)
STRIDED_Q = torch.randn(1, 4, 8, 8)[:, :, ::4]  # [1, 4, 2, 8], head stride 32

SERVING_CACHE = rl.make_cos_sin_cache(ROPE, 16)
SLOTS = torch.tensor([5, -1, 0, 2])  # block 1 row 1, padding, block 0 rows 0 and 2 of [2, 4, ...] caches


def rotated_in_place(call: Callable[[torch.Tensor], Any]) -> tuple[Any, torch.Tensor]:
    """``(result, buffer)`` of an in-place call on a fresh copy of ``Q`` laid out ``[tokens, heads, d]``."""
    buffer = Q[0].clone()
    return call(buffer), buffer


def kv_written() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    caches = torch.zeros(2, 2, 4, 1, 8)
    with torch.no_grad():
        q_rot = rl.rotary_kv_cache_write(
            Q[0], K[0], K[0] * 2, caches[0], caches[1], SLOTS, COS, SIN, torch.tensor([3, 1, 4, 1])
        )
    return q_rot, caches[0], caches[1]


def kv_cache_as_two_steps(r: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> bool:
    """The fused write against the reference rotation and the slots by hand (rows 1.1, 0.0, 0.2; -1 skipped)."""
    q_rot, k_cache, v_cache = r
    positions = torch.tensor([3, 1, 4, 1])
    k_rot = rotated(K, positions)[0]
    written = [(1, 1, 0), (0, 0, 2), (0, 2, 3)]  # (block, row, token)
    return (
        close(q_rot, rotated(Q, positions)[0])
        and all(close(k_cache[b, r], k_rot[t]) and torch.equal(v_cache[b, r], K[0, t] * 2) for b, r, t in written)
        and int((k_cache.abs().sum(-1) > 0).sum()) == 3  # nothing written for the padding token
    )


@dataclass(frozen=True)
class CosSin:
    """The halves of a ``cos_sin_cache`` as :func:`cache_rows_by_hand` reads tables."""

    cos: torch.Tensor
    sin: torch.Tensor

    @property
    def length(self) -> int:
        return self.cos.shape[0]


def packed_rotated() -> tuple[torch.Tensor, torch.Tensor]:
    """A packed ``[1, 4, 2 + 2 * 1, 8]`` buffer (q = Q, k = K, a v head) after ``rotary_qkv_``, and v before."""
    qkv = torch.cat([Q, K, torch.randn(1, 4, 1, 8)], 2)
    v = qkv[:, :, 3:].clone()
    return rl.rotary_qkv_(qkv, COS, SIN, num_heads_q=2), v


def sink_stream(steps: int) -> rl.SinkCache:
    """A sink cache (1 sink, a window of 2) fed ``steps`` tokens whose unrotated keys are ``X[0, t]``."""
    cache = rl.SinkCache(ROPE, sink=1, window=2)
    for t in range(steps):
        k = X[0, t % 4].view(1, 1, 1, 8).double()
        _, k_rot = ROPE(k, k, cache.make_room(1))
        cache.append(k_rot, k)
    return cache


def sink_holds_tokens_re_encoded(cache: rl.SinkCache) -> bool:
    """Tokens 0, 4 and 5 of 6 kept (keys X[0, 0], X[0, 0], X[0, 1]), encoded at cache positions 0, 1, 2."""
    kept = X[0, [0, 0, 1]].view(1, 3, 1, 8)
    return (cache.length, cache.evicted) == (3, 3) and close(cache.keys, rotated(kept, torch.arange(3)), tol=1e-12)


CASES: list[Case] = [
    # ---- RotaryEmbedding
    raises("RotaryEmbedding", TypeError, "head_dim must be an int", lambda: rl.RotaryEmbedding(8.0)),
    raises("RotaryEmbedding", ValueError, "head_dim must be even", lambda: rl.RotaryEmbedding(7)),
    raises("RotaryEmbedding", ValueError, "theta must be a finite number > 0", lambda: rl.RotaryEmbedding(8, math.nan)),
    raises("RotaryEmbedding", ValueError, "theta must be a finite number > 0", lambda: rl.RotaryEmbedding(8, -1.0)),
    raises(
        "RotaryEmbedding", ValueError, "rotary_dim must be <= head_dim", lambda: rl.RotaryEmbedding(8, rotary_dim=10)
    ),
    raises("RotaryEmbedding", ValueError, "layout must be one of", lambda: rl.RotaryEmbedding(8, layout="neox")),
    raises("RotaryEmbedding", TypeError, "scaling must be a dict", lambda: rl.RotaryEmbedding(8, scaling="linear")),
    raises("RotaryEmbedding", ValueError, "kernel must be one of", lambda: rl.RotaryEmbedding(8, kernel="cuda")),
    raises("RotaryEmbedding", TypeError, "q must be a torch.Tensor", lambda: ROPE([[1.0]], K)),
    raises("RotaryEmbedding", ValueError, "q must have 4 dimensions", lambda: ROPE(Q[0], K)),
    raises("RotaryEmbedding", TypeError, "q must be a floating-point tensor", lambda: ROPE(Q.long(), K)),
    raises("RotaryEmbedding", ValueError, "must share dtype and device", lambda: ROPE(Q, K.double())),
    raises("RotaryEmbedding", ValueError, "must share dtype and device", lambda: ROPE(Q, K.to(META))),
    raises("RotaryEmbedding", ValueError, "head_dim=8", lambda: ROPE(torch.randn(1, 4, 2, 6), torch.randn(1, 4, 1, 6))),
    raises("RotaryEmbedding", ValueError, "positions must be >= 0", lambda: ROPE(Q, K, torch.tensor([0, 1, -1, 2]))),
    raises("RotaryEmbedding", TypeError, "positions must be an integer tensor", lambda: ROPE(Q, K, torch.ones(4))),
    raises(
        "RotaryEmbedding", TypeError, "positions must be an integer tensor", lambda: ROPE(Q, K, torch.ones(4).bool())
    ),
    raises("RotaryEmbedding", TypeError, "uint64", lambda: ROPE(Q, K, torch.arange(4).to(torch.uint64))),
    raises("RotaryEmbedding", ValueError, "positions must have shape", lambda: ROPE(Q, K, torch.arange(5))),
    gives("RotaryEmbedding", empty_like_ok, lambda: ROPE(torch.randn(0, 4, 2, 8), torch.randn(0, 4, 1, 8))),
    gives("RotaryEmbedding", empty_like_ok, lambda: ROPE(torch.randn(1, 0, 2, 8), torch.randn(1, 0, 1, 8))),
    gives("RotaryEmbedding", empty_like_ok, lambda: ROPE(torch.randn(1, 4, 0, 8), torch.randn(1, 4, 0, 8))),
    gives(
        "RotaryEmbedding",
        lambda r: close(r[0], rotated(Q, torch.tensor([3, 1, 4, 1]))),
        lambda: ROPE(Q, K, torch.tensor([3, 1, 4, 1], dtype=torch.uint8)),
    ),
    gives(
        "RotaryEmbedding",
        lambda r: close(r[0], rotated(Q.expand(2, 4, 2, 8), torch.arange(4))),
        lambda: ROPE(Q.expand(2, 4, 2, 8), K.expand(2, 4, 1, 8), torch.arange(4)[None]),  # [1, seq] over batch 2
    ),
    gives(
        "RotaryEmbedding",  # a far position costs one row, not a table to 2^31 (17 GB)
        lambda r: close(r[0], rotated(Q[:, :1], torch.tensor([2**31])), tol=1e-5) and cache_is_bounded(ROPE),
        lambda: ROPE(Q[:, :1], K[:, :1], torch.tensor([2**31])),
    ),
    gives("RotaryEmbedding", lambda r: close(r[0], rotated(STRIDED_Q, torch.arange(4))), lambda: ROPE(STRIDED_Q, K)),
    gives("RotaryEmbedding", lambda r: close(r[1], rotated(EXPANDED_K, torch.arange(4))), lambda: ROPE(Q, EXPANDED_K)),
    gives("RotaryEmbedding", lambda r: close(r[0], rotated(Q, torch.arange(4))), lambda: ROPE(Q, Q)),  # aliased
    gives("RotaryEmbedding", shapes((1, 4, 2, 8), (1, 4, 1, 8)), lambda: ROPE(Q.to(META), K.to(META))),
    gives(
        "RotaryEmbedding",
        shapes((1, 4, 2, 8), (1, 4, 1, 8)),
        lambda: ROPE(Q.double().to(META), K.double().to(META), torch.arange(4, device=META)),
    ),
    raises("RotaryEmbedding", ValueError, "positions must be >= 0", lambda: ROPE.cos_sin(torch.tensor([-1]))),
    raises("RotaryEmbedding", TypeError, "positions must be an integer", lambda: ROPE.cos_sin(torch.tensor([0.5]))),
    gives(
        "RotaryEmbedding", lambda r: r[0].dtype == torch.float16, lambda: ROPE.cos_sin(torch.tensor([1]), torch.float16)
    ),
    raises(
        "RotaryEmbedding", TypeError, "dtype must be a floating", lambda: ROPE.cos_sin(torch.tensor([1]), torch.int64)
    ),
    # ---- rotary_qk, choose_kernel, BACKENDS, KERNELS
    raises("rotary_qk", TypeError, "cos must be a torch.Tensor", lambda: rl.rotary_qk(Q, K, None, SIN)),
    raises("rotary_qk", ValueError, "cos must have 2 dimensions", lambda: rl.rotary_qk(Q, K, COS[None], SIN)),
    raises(
        "rotary_qk", TypeError, "cos and sin must be torch.float32", lambda: rl.rotary_qk(Q, K, COS.half(), SIN.half())
    ),
    raises("rotary_qk", ValueError, "non-empty", lambda: rl.rotary_qk(Q, K, COS[:0], SIN[:0])),
    raises(
        "rotary_qk",
        ValueError,
        "positions must be < 16",
        lambda: rl.rotary_qk(Q, K, COS, SIN, torch.tensor([0, 1, 2, 16])),
    ),
    raises(
        "rotary_qk",
        ValueError,
        "positions must be >= 0",
        lambda: rl.rotary_qk(Q, K, COS, SIN, torch.tensor([0, 1, 2, -1])),
    ),
    raises("rotary_qk", ValueError, "table has 2 rows but seq_len is 4", lambda: rl.rotary_qk(Q, K, COS[:2], SIN[:2])),
    raises("rotary_qk", TypeError, "inplace must be a bool", lambda: rl.rotary_qk(Q, K, COS, SIN, inplace="yes")),
    raises("rotary_qk", TypeError, "conjugate must be a bool", lambda: rl.rotary_qk(Q, K, COS, SIN, conjugate=1)),
    raises(
        "rotary_qk",
        ValueError,
        "separate memory",
        lambda: (lambda t: rl.rotary_qk(t, t, COS, SIN, inplace=True))(Q.clone()),
    ),
    raises(
        "rotary_qk",
        ValueError,
        "do not share memory",
        lambda: rl.rotary_qk(EXPANDED_K, K.clone(), COS, SIN, inplace=True),
    ),
    raises(
        "rotary_qk",
        ValueError,
        "cos and sin must not require grad",
        lambda: rl.rotary_qk(Q, K, COS.requires_grad_(False).clone().requires_grad_(), SIN),
    ),
    raises("rotary_qk", ValueError, "kernel must be one of", lambda: rl.rotary_qk(Q, K, COS, SIN, kernel="cuda")),
    gives(
        "rotary_qk",
        lambda r: close(r[0], rotated(STRIDED_Q, torch.arange(4))),
        lambda: rl.rotary_qk(STRIDED_Q, K, COS, SIN),
    ),
    gives("rotary_qk", lambda r: close(r[0], rotated(Q, torch.arange(4))), lambda: rl.rotary_qk(Q, Q, COS, SIN)),
    gives(
        "rotary_qk",
        lambda r: close(r[0], rotated(Q, torch.arange(4))),
        lambda: rl.rotary_qk(Q, K, torch.cat([COS, COS], -1)[:, :4], torch.cat([SIN, SIN], -1)[:, :4]),
    ),
    gives("rotary_qk", empty_like_ok, lambda: rl.rotary_qk(torch.randn(0, 4, 2, 8), torch.randn(0, 4, 1, 8), COS, SIN)),
    gives(
        "rotary_qk",
        shapes((1, 4, 2, 8), (1, 4, 1, 8)),
        lambda: rl.rotary_qk(Q.to(META), K.to(META), COS.to(META), SIN.to(META)),
    ),
    gives("choose_kernel", lambda r: r == ("native" if NATIVE else "torch"), lambda: rl.choose_kernel("auto", "cpu")),
    gives("choose_kernel", lambda r: r == "torch", lambda: rl.choose_kernel("auto", "meta")),
    raises("choose_kernel", ValueError, "device must name a torch device", lambda: rl.choose_kernel("auto", "gpu0x")),
    raises("choose_kernel", TypeError, "device must be a torch.device or str", lambda: rl.choose_kernel("auto", 0)),
    gives("KERNEL_CHOICES", lambda r: r == ("auto", "torch", "native", "triton"), lambda: rl.KERNEL_CHOICES),
    gives(
        "KERNELS",
        lambda r: set(r) == {"torch", "native", "triton"} and all(callable(k.launch) for k in r.values()),
        lambda: rl.KERNELS,
    ),
    raises(
        "rotary_qk",  # a forced kernel that cannot run here: refused at the door, with the reason
        ValueError,
        "kernel='native' does not run",
        lambda: rl.rotary_qk(Q.to(META), K.to(META), COS.to(META), SIN.to(META), kernel="native"),
    ),
    raises(
        "RotaryEmbedding",
        ValueError,
        "kernel='native' does not run",
        lambda: rl.RotaryEmbedding(8, kernel="native")(Q.to(META), K.to(META)),
    ),
    # ---- the spec, the cache and a forward pass's rotation
    gives("RopeSpec", spec_frequencies_by_hand, lambda: rl.RopeSpec.create(8, theta=100.0)),
    gives(
        "RopeSpec",  # a value: equal specs are one hash key (layers with one spec share one cache)
        lambda r: r[0] == r[1] and hash(r[0]) == hash(r[1]) and r[0].scaling == LINEAR and r[0].scaling is not LINEAR,
        lambda: (rl.RopeSpec.create(8, scaling=dict(LINEAR)), rl.RopeSpec.create(8, scaling=dict(LINEAR))),
    ),
    raises("RopeSpec", ValueError, "rotary_dim must be even", lambda: rl.RopeSpec.create(7)),
    raises("RopeSpec", TypeError, "scaling must be a dict", lambda: rl.RopeSpec.create(8, scaling="linear")),
    raises("RopeSpec", ValueError, "theta must be a finite number > 0", lambda: rl.RopeSpec.create(8, math.nan)),
    raises("RopeSpec", ValueError, "freqs_for must be one of", lambda: rl.RopeSpec.create(8, freqs_for="px")),
    gives(
        "TableCache", cache_rows_by_hand, lambda: rl.TableCache(rl.RopeSpec.create(8)).tables(CPU, torch.float32, 10)
    ),
    gives(
        "TableCache",  # never more rows than the limit, however many are asked for
        lambda r: r.length == 8,
        lambda: rl.TableCache(rl.RopeSpec.create(8), limit=8).tables(CPU, torch.float32, 100),
    ),
    raises("TableCache", TypeError, "spec must be a RopeSpec", lambda: rl.TableCache("rope")),
    raises("TableCache", ValueError, "limit", lambda: rl.TableCache(rl.RopeSpec.create(8), limit=-3)),
    raises(
        "RotaryEmbedding",
        ValueError,
        "cache must be a TableCache of this module's spec",
        lambda: rl.RotaryEmbedding(8, cache=rl.TableCache(rl.RopeSpec.create(8, theta=100.0))),
    ),
    gives("Rotation", lambda r: close(r[0], rotated(Q, torch.arange(4))), lambda: ROPE.rotation(Q)(Q, K)),
    gives(
        "Rotation",
        lambda r: (
            close(r[0], rotated(Q, torch.tensor([3, 1, 4, 1]))) and close(r[1], rotated(K, torch.tensor([3, 1, 4, 1])))
        ),
        lambda: ROPE.rotation(Q, torch.tensor([3, 1, 4, 1]))(Q, K),
    ),
    raises("Rotation", ValueError, "seq_len 4", lambda: ROPE.rotation(Q)(Q[:, :2], K[:, :2])),
    raises("Rotation", ValueError, "made for torch.float32", lambda: ROPE.rotation(Q)(Q.double(), K.double())),
    raises("Rotation", ValueError, "head_dim=8", lambda: ROPE.rotation(Q)(Q[..., :6], K[..., :6])),
    raises("Rotation", TypeError, "inplace must be a bool", lambda: ROPE.rotation(Q)(Q, K, inplace=1)),
    raises("Rotation", TypeError, "q must be a torch.Tensor", lambda: ROPE.rotation([[1.0]])),
    raises("Rotation", ValueError, "positions must be >= 0", lambda: ROPE.rotation(Q, torch.tensor([0, 1, -1, 2]))),
    # ---- tables and frequencies
    raises(
        "cos_sin_table",
        TypeError,
        "positions must be an integer torch.Tensor",
        lambda: rl.cos_sin_table(torch.ones(4), [0, 1]),
    ),
    raises(
        "cos_sin_table",
        ValueError,
        "attention_scaling must be a finite number > 0",
        lambda: rl.cos_sin_table(torch.ones(4), torch.arange(3), math.nan),
    ),
    raises(
        "cos_sin_table",
        TypeError,
        "dtype must be a floating",
        lambda: rl.cos_sin_table(torch.ones(4), torch.arange(3), dtype=torch.bool),
    ),
    raises(
        "cos_sin_table",
        ValueError,
        "inv_freq must have 1 dimensions",
        lambda: rl.cos_sin_table(torch.ones(2, 2), torch.arange(3)),
    ),
    gives(
        "cos_sin_table",
        lambda r: r[0][0, 1].item() == math.cos(-0.5),
        lambda: rl.cos_sin_table(
            torch.tensor([1.0, 0.5], dtype=torch.float64), torch.tensor([-1]), dtype=torch.float64
        ),
    ),
    raises("rope_frequencies", ValueError, "head_dim must be even", lambda: rl.rope_frequencies(7)),
    raises(
        "rope_frequencies",
        ValueError,
        "partial_rotary_factor must be in",
        lambda: rl.rope_frequencies(8, partial_rotary_factor=1.5),
    ),
    raises(
        "rope_frequencies", ValueError, "theta must be a finite number > 0", lambda: rl.rope_frequencies(8, math.inf)
    ),
    raises(
        "scaled_inverse_frequencies",
        ValueError,
        "theta must be a finite number > 0",
        lambda: rl.scaled_inverse_frequencies(8, math.nan, LINEAR),
    ),
    raises(
        "scaled_inverse_frequencies",
        ValueError,
        "theta must be a finite number > 0",
        lambda: rl.scaled_inverse_frequencies(8, 0.0, LINEAR),
    ),
    raises(
        "scaled_inverse_frequencies",
        ValueError,
        "rotary_dim must be even",
        lambda: rl.scaled_inverse_frequencies(3, 1e4, LINEAR),
    ),
    raises(
        "scaled_inverse_frequencies",
        ValueError,
        "rotary_dim must be >= 2",
        lambda: rl.scaled_inverse_frequencies(-4, 1e4, LINEAR),
    ),
    raises(
        "scaled_inverse_frequencies",
        ValueError,
        "rotary_dim must be >= 2",
        lambda: rl.scaled_inverse_frequencies(0, 1e4, LINEAR),
    ),
    raises(
        "scaled_inverse_frequencies",
        ValueError,
        "needs theta > 1",
        lambda: rl.scaled_inverse_frequencies(8, 1.0, {"rope_type": "yarn", "factor": 2.0}, max_position_embeddings=64),
    ),
    raises(
        "scaled_inverse_frequencies",
        ValueError,
        "original_max_position_embeddings >= 2",
        lambda: rl.scaled_inverse_frequencies(
            8,
            1e4,
            {
                "rope_type": "longrope",
                "short_factor": [1] * 4,
                "long_factor": [1] * 4,
                "original_max_position_embeddings": 1,
                "factor": 2.0,
            },
        ),
    ),  # fmt: skip
    raises(
        "scaled_inverse_frequencies",
        TypeError,
        "must be a list",
        lambda: rl.scaled_inverse_frequencies(
            8,
            1e4,
            {"rope_type": "longrope", "short_factor": {1.0, 2.0, 3.0, 4.0}, "long_factor": [1] * 4},
            max_position_embeddings=64,
        ),
    ),  # fmt: skip
    raises(
        "scaled_inverse_frequencies",
        ValueError,
        "unknown keys",
        lambda: rl.scaled_inverse_frequencies(8, 1e4, {**LINEAR, "mrope_section": [1, 1, 2]}),
    ),
    gives(
        "scaled_inverse_frequencies",
        lambda r: r[0].tolist() == [0.5, 0.005],
        lambda: rl.scaled_inverse_frequencies(4, 1e4, {**LINEAR, "mrope_section": [1]}, ignore_keys=["mrope_section"]),
    ),
    raises(
        "scaled_inverse_frequencies",
        TypeError,
        "scaling must be a dict",
        lambda: rl.scaled_inverse_frequencies(8, 1e4, "linear"),
    ),
    raises("rope_config", TypeError, "config must be a dict", lambda: rl.rope_config("llama")),
    raises(
        "rope_config",
        ValueError,
        "one dict per layer type",
        lambda: rl.rope_config({**CONFIG, "rope_parameters": {"full_attention": {"rope_type": "default"}}}),
    ),
    gives(
        "rope_config",
        lambda r: r["scaling"] == LINEAR,
        lambda: rl.rope_config(
            {**CONFIG, "rope_parameters": {**LINEAR, "mrope_section": [1, 1]}}, ignore_keys=["mrope_section"]
        ),
    ),
    gives(
        "ROPE_SCALINGS",
        lambda r: {"default", "linear", "dynamic", "yarn", "longrope", "llama3"} <= set(r),
        lambda: rl.ROPE_SCALINGS,
    ),
    raises("register_scaling", ValueError, "registered already", lambda: rl.register_scaling("linear")),
    raises("register_scaling", TypeError, "name must be a non-empty str", lambda: rl.register_scaling("")),
    raises(  # a bare string would register its letters
        "register_scaling",
        TypeError,
        "required must be a collection of key names",
        lambda: rl.register_scaling("letters", required="factor"),
    ),
    raises(  # rotary_dim 8 needs 4 frequencies: 3 are refused at registration
        "register_scaling",
        ValueError,
        r"refuses the scaling.*shape \[3\]; expected a float64 tensor \[rotary_dim // 2\] = \[4\]",
        lambda: rl.register_scaling("three")(lambda d, b, p, **_: (torch.ones(3, dtype=torch.float64), 1.0)),
    ),
    # ---- the peers' features (issue 11): one case per new argument or name
    gives(
        "rotary_qk",  # flash-attn's seqlen_offsets: token s of row b at offsets[b] + s
        lambda r: close(r[0], rotated(Q.expand(2, 4, 2, 8), torch.tensor([[0, 1, 2, 3], [9, 10, 11, 12]]))),
        lambda: rl.rotary_qk(Q.expand(2, 4, 2, 8), K.expand(2, 4, 1, 8), COS, SIN, seqlen_offsets=torch.tensor([0, 9])),
    ),
    raises(
        "rotary_qk",
        ValueError,
        "seqlen_offsets must be an int or an integer tensor of shape",
        lambda: rl.rotary_qk(Q, K, COS, SIN, seqlen_offsets=torch.tensor([[1]])),
    ),
    raises(
        "rotary_qk",
        ValueError,
        "inplace=True does not support autograd on q: it is a leaf",
        lambda: rl.rotary_qk(Q.clone().requires_grad_(), K.clone(), COS, SIN, inplace=True),
    ),
    gives(
        "rotary_qk",  # in place with autograd on non-leaves
        lambda r: r[0].grad_fn is not None and close(r[0].detach(), rotated(Q, torch.arange(4))),
        lambda: rl.rotary_qk(Q.clone().requires_grad_() * 1.0, K.clone(), COS, SIN, inplace=True),
    ),
    gives(
        "RotaryEmbedding",
        lambda r: close(r[0], rotated(Q, torch.arange(5, 9))),
        lambda: ROPE(Q, K, seqlen_offsets=5),
    ),
    raises("RotaryEmbedding", ValueError, "seqlen_offsets must be >= 0", lambda: ROPE(Q, K, seqlen_offsets=-1)),
    gives(
        "RotaryEmbedding",  # odd head_dim, even rotary_dim: the tail passes through
        lambda r: torch.equal(r[0][..., 4:], X.view(2, 4, 1, 8)[..., :7][..., 4:]),
        lambda: rl.RotaryEmbedding(7, rotary_dim=4)(X.view(2, 4, 1, 8)[..., :7], X.view(2, 4, 1, 8)[..., :7]),
    ),
    raises(
        "RotaryEmbedding",
        ValueError,
        "theta_rescale_factor must be a finite number > 0",
        lambda: rl.RotaryEmbedding(8, theta_rescale_factor=math.inf),
    ),
    raises("RotaryEmbedding", ValueError, "freqs_for must be one of", lambda: rl.RotaryEmbedding(8, freqs_for="px")),
    raises(
        "RotaryEmbedding",
        ValueError,
        "positions must be finite",
        lambda: rl.RotaryEmbedding(8, continuous_positions=True)(Q, K, torch.tensor([0.0, 1.0, math.nan, 2.0])),
    ),
    raises("RotaryEmbedding", TypeError, "learned_freq must be a bool", lambda: rl.RotaryEmbedding(8, learned_freq=0)),
    gives(
        "RotaryEmbedding",  # learned frequencies: a parameter that receives a gradient
        lambda r: r is not None and bool(torch.isfinite(r).all()),
        lambda: (lambda m: (m(Q, K)[0].sum().backward(), m.learned_inv_freq.grad)[1])(
            rl.RotaryEmbedding(8, learned_freq=True)
        ),
    ),
    gives(
        "alibi_slopes",  # MPT's alibi_bias_max: 2^(-B i / n)
        lambda r: r.tolist() == [2**-1, 2**-2, 2**-3, 2**-4],
        lambda: rl.alibi_slopes(4, alibi_bias_max=4.0),
    ),
    raises(
        "alibi_slopes",
        ValueError,
        "alibi_bias_max must be a finite number > 0",
        lambda: rl.alibi_slopes(4, alibi_bias_max=-8.0),
    ),
    gives(
        "rope_frequencies",  # seq_len as a 0-d integer tensor
        lambda r: torch.equal(
            r[0],
            rl.rope_frequencies(
                8, scaling={"rope_type": "dynamic", "factor": 2.0}, max_position_embeddings=4, seq_len=9
            )[0],
        ),
        lambda: rl.rope_frequencies(
            8, scaling={"rope_type": "dynamic", "factor": 2.0}, max_position_embeddings=4, seq_len=torch.tensor(9)
        ),
    ),
    raises(
        "scaled_inverse_frequencies",
        ValueError,
        "seq_len must be an int or a 0-d integer tensor",
        lambda: rl.scaled_inverse_frequencies(8, 1e4, LINEAR, seq_len=torch.tensor([3])),
    ),
    gives(
        "proportional_scaling",
        lambda r: r[0].tolist() == [1.0, 0.0],
        lambda: rl.scaled_inverse_frequencies(4, 1e4, {"rope_type": "proportional", "partial_rotary_factor": 0.5}),
    ),
    raises(
        "ntk_rescaled_theta",
        ValueError,
        "theta_rescale_factor needs rotary_dim >= 4",
        lambda: ntk_rescaled_theta(1e4, 2, 2.0),
    ),
    gives("pixel_inverse_frequencies", lambda r: r.tolist() == [math.pi], lambda: pixel_inverse_frequencies(2, 3.0)),
    gives(  # one pair: |S_1| = |e^{i r theta}| = 1 at every distance
        "relative_decay_bound",
        lambda r: r.tolist() == [1.0, 1.0],
        lambda: rl.relative_decay_bound(torch.ones(1), torch.tensor([0, 7])),
    ),
    raises(
        "relative_decay_bound",
        TypeError,
        "distances must be a 1-D real torch.Tensor",
        lambda: rl.relative_decay_bound(torch.ones(2), torch.tensor([[1.0]])),
    ),
    raises(
        "offset_positions",
        TypeError,
        "seqlen_offsets must be an int or an integer tensor",
        lambda: offset_positions(2.0, 1, 3, torch.device("cpu")),
    ),
    gives(
        "no_offsets", lambda r: r == (True, True, False), lambda: (no_offsets(0), no_offsets(None), no_offsets(True))
    ),
    raises(
        "RotaryEmbedding",  # real-valued positions: a tensor, integer or floating
        TypeError,
        "positions must be a torch.Tensor",
        lambda: rl.RotaryEmbedding(8, continuous_positions=True)(Q, K, [0.5, 1.0, 2.0, 3.0]),
    ),
    raises(
        "RotaryEmbedding",
        TypeError,
        "continuous_positions must be a bool",
        lambda: rl.RotaryEmbedding(8, continuous_positions="continuous"),
    ),
    # ---- layouts and the reference rotation
    raises("rotate_half", ValueError, "even last dimension", lambda: rl.rotate_half(torch.ones(3))),
    raises("rotate_half", TypeError, "x must be a floating-point tensor", lambda: rl.rotate_half(torch.ones(4).long())),
    gives(
        "rotate_half",
        lambda r: r.tolist() == [-3.0, -4.0, 1.0, 2.0],
        lambda: rl.rotate_half(torch.tensor([1.0, 2.0, 3.0, 4.0])),
    ),
    gives("LAYOUTS", lambda r: r == ("half", "interleaved"), lambda: rl.LAYOUTS),
    raises("layout_permutation", ValueError, "src must be one of", lambda: rl.layout_permutation(4, "neox", "half")),
    raises(
        "layout_permutation", ValueError, "rotary_dim must be even", lambda: rl.layout_permutation(5, "half", "half")
    ),
    raises(
        "convert_rotary_layout",
        ValueError,
        "weight must have shape",
        lambda: rl.convert_rotary_layout(torch.ones(5, 3), 2, 4, src="half", dst="interleaved"),
    ),
    raises(
        "convert_rotary_layout",
        ValueError,
        "rotary_dim must be <= head_dim",
        lambda: rl.convert_rotary_layout(torch.ones(8, 3), 2, 4, src="half", dst="interleaved", rotary_dim=6),
    ),
    raises("apply_rotary", ValueError, "cos and sin must have shape", lambda: rl.apply_rotary(Q, COS, SIN)),
    raises("apply_rotary", ValueError, "cos is on", lambda: rl.apply_rotary(Q, COS[:4].to(META), SIN[:4].to(META))),
    raises(
        "apply_rotary", ValueError, "layout must be one of", lambda: rl.apply_rotary(Q, COS[:4], SIN[:4], layout="x")
    ),
    gives("apply_rotary", empty_like_ok, lambda: rl.apply_rotary(torch.randn(1, 0, 2, 8), COS[:0], SIN[:0])),
    # ---- the seed's complex API
    raises("precompute_pos_cis", ValueError, "dim must be even", lambda: rl.precompute_pos_cis(7)),
    raises("precompute_pos_cis", ValueError, "end must be >= 1", lambda: rl.precompute_pos_cis(8, 0)),
    raises(
        "precompute_pos_cis",
        ValueError,
        "theta must be a finite number > 0",
        lambda: rl.precompute_pos_cis(8, 4, math.nan),
    ),
    raises(
        "apply_rotary_emb", TypeError, "pos_cis must be a complex tensor", lambda: rl.apply_rotary_emb(Q, K, COS[:4])
    ),
    raises(
        "apply_rotary_emb",
        ValueError,
        "xq and xk must share dtype and device",
        lambda: rl.apply_rotary_emb(Q, K.double(), rl.precompute_pos_cis(8, 4)),
    ),
    raises(
        "apply_rotary_emb",
        ValueError,
        "pos_cis is on",
        lambda: rl.apply_rotary_emb(Q, K, rl.precompute_pos_cis(8, 4).to(META)),
    ),
    raises(
        "apply_rotary_emb",
        ValueError,
        "slice it as pos_cis",
        lambda: rl.apply_rotary_emb(Q, K, rl.precompute_pos_cis(8, 16)),
    ),
    gives(
        "apply_rotary_emb",
        empty_like_ok,
        lambda: rl.apply_rotary_emb(torch.randn(0, 4, 2, 8), torch.randn(0, 4, 1, 8), rl.precompute_pos_cis(8, 4)),
    ),
    gives(
        "apply_rotary_emb",
        empty_like_ok,
        lambda: rl.apply_rotary_emb(torch.randn(1, 0, 2, 8), torch.randn(1, 0, 1, 8), rl.precompute_pos_cis(8, 4)[:0]),
    ),
    gives(
        "apply_rotary_emb",
        shapes((1, 4, 0, 8), (1, 4, 0, 8)),
        lambda: rl.apply_rotary_emb(torch.randn(1, 4, 0, 8), torch.randn(1, 4, 0, 8), rl.precompute_pos_cis(8, 4)),
    ),
    gives(
        "apply_rotary_emb",
        lambda r: close(r[0], rotated(Q, torch.arange(4), "interleaved")),
        lambda: rl.apply_rotary_emb(Q, K, rl.precompute_pos_cis(8, 4, 1e4)),
    ),
    # ---- absolute encodings
    raises("sinusoidal_encoding", ValueError, "dim must be even", lambda: rl.sinusoidal_encoding(4, 5)),
    raises(
        "sinusoidal_encoding",
        TypeError,
        "dtype must be a floating dtype",
        lambda: rl.sinusoidal_encoding(4, 6, dtype=torch.int64),
    ),
    raises(
        "sinusoidal_encoding",
        ValueError,
        "base must be a finite number > 0",
        lambda: rl.sinusoidal_encoding(4, 6, math.inf),
    ),
    gives("sinusoidal_encoding", shapes((0, 6)), lambda: rl.sinusoidal_encoding(0, 6)),
    raises("sinusoidal_shift_matrix", TypeError, "shift must be an int", lambda: rl.sinusoidal_shift_matrix(1.5, 4)),
    gives(
        "sinusoidal_shift_matrix",
        lambda r: torch.allclose(r, torch.eye(4, dtype=torch.float64)),
        lambda: rl.sinusoidal_shift_matrix(0, 4),
    ),
    raises(
        "SinusoidalPositionalEncoding",
        ValueError,
        "x must have last dimension 8",
        lambda: rl.SinusoidalPositionalEncoding(8)(torch.randn(2, 4, 6)),
    ),
    raises(
        "SinusoidalPositionalEncoding",
        ValueError,
        "scale must be a finite number > 0",
        lambda: rl.SinusoidalPositionalEncoding(8, scale=math.nan),
    ),
    raises(
        "SinusoidalPositionalEncoding",
        ValueError,
        "positions must be >= 0",
        lambda: rl.SinusoidalPositionalEncoding(8)(X, torch.tensor([0, -1, 2, 3])),
    ),
    raises(
        "LearnedPositionalEmbedding",
        ValueError,
        "positions must be < 4",
        lambda: rl.LearnedPositionalEmbedding(4, 8)(X, torch.tensor([0, 1, 2, 4])),
    ),
    raises(
        "LearnedPositionalEmbedding",
        ValueError,
        "the learned table has only 2",
        lambda: rl.LearnedPositionalEmbedding(2, 8)(X),
    ),
    raises(
        "LearnedPositionalEmbedding",
        ValueError,
        "init_std must be a finite number > 0",
        lambda: rl.LearnedPositionalEmbedding(2, 8, init_std=-1.0),
    ),
    # ---- relative encodings
    raises("relative_positions", ValueError, "query_len must be >= 0", lambda: rl.relative_positions(-1)),
    raises("relative_positions", TypeError, "offset must be an int", lambda: rl.relative_positions(2, offset=0.5)),
    gives("relative_positions", shapes((0, 3)), lambda: rl.relative_positions(0, 3)),
    raises(
        "t5_relative_bucket",
        TypeError,
        "bidirectional must be a bool",
        lambda: rl.t5_relative_bucket(torch.tensor([1]), "yes"),
    ),
    raises(
        "t5_relative_bucket",
        TypeError,
        "relative_position must be an integer tensor",
        lambda: rl.t5_relative_bucket(torch.tensor([1.0])),
    ),
    raises(
        "t5_relative_bucket",
        ValueError,
        "max_distance must be >",
        lambda: rl.t5_relative_bucket(torch.tensor([1]), True, 32, 4),
    ),
    gives(
        "t5_relative_bucket",
        lambda r: r.tolist() == [31, 15],
        lambda: rl.t5_relative_bucket(torch.tensor([2**63 - 1, -(2**63)])),
    ),
    raises(
        "T5RelativeBias", TypeError, "bidirectional must be a bool", lambda: rl.T5RelativeBias(2, bidirectional="no")
    ),
    raises(
        "T5RelativeBias",
        ValueError,
        "relative_position must have at least 2 dimensions",
        lambda: rl.T5RelativeBias(2)(torch.tensor([1])),
    ),
    raises("alibi_slopes", ValueError, "num_heads must be >= 1", lambda: rl.alibi_slopes(0)),
    raises("alibi_bias", TypeError, "dtype must be a floating", lambda: rl.alibi_bias(2, 3, dtype=torch.int64)),
    raises("alibi_bias", TypeError, "dtype must be a floating", lambda: rl.alibi_bias(2, 3, dtype=torch.bool)),
    gives("alibi_bias", shapes((2, 0, 0)), lambda: rl.alibi_bias(2, 0)),
    raises("ShawRelativePosition", TypeError, "values must be a bool", lambda: rl.ShawRelativePosition(8, values="no")),
    raises(
        "ShawRelativePosition", ValueError, "max_relative_position must be >= 1", lambda: rl.ShawRelativePosition(8, 0)
    ),
    # ---- attention
    raises("MultiHeadAttention", TypeError, "causal must be a bool", lambda: rl.MultiHeadAttention(8, 2, causal="no")),
    raises("MultiHeadAttention", ValueError, "position must be one of", lambda: rl.MultiHeadAttention(8, 2, "xpos2")),
    raises("MultiHeadAttention", ValueError, "unknown", lambda: rl.MultiHeadAttention(8, 2, "rope", base=3.0)),
    raises(
        "MultiHeadAttention",
        ValueError,
        "num_kv_heads=3 must divide",
        lambda: rl.MultiHeadAttention(8, 2, num_kv_heads=3),
    ),
    raises(
        "MultiHeadAttention",
        ValueError,
        "x must have last dimension",
        lambda: rl.MultiHeadAttention(8, 2)(torch.randn(1, 4, 6)),
    ),
    raises(
        "MultiHeadAttention",
        ValueError,
        "positions must be >= 0",
        lambda: rl.MultiHeadAttention(8, 2, "rope")(X, torch.tensor([0, 1, -5, 2])),
    ),
    gives(
        "MultiHeadAttention",
        shapes((2, 4, 8)),
        lambda: rl.MultiHeadAttention(8, 2, "alibi", causal=True)(X, torch.arange(4)[None]),
    ),
    gives(
        "POSITION_ENCODINGS",
        # the classic seven first, in order; each later one unique and named by its plug (its paper's name)
        lambda r: (
            r[:7] == ("none", "sinusoidal", "learned", "t5", "alibi", "shaw", "rope")
            and len(set(r)) == len(r)
            and all(rl.attention.plugs.PLUGS[name].label for name in r[7:])
        ),
        lambda: rl.POSITION_ENCODINGS,
    ),
    raises(
        "linear_attention",
        ValueError,
        "eps must be a finite number > 0",
        lambda: rl.linear_attention(Q, Q, Q, eps=math.nan),
    ),
    raises("linear_attention", TypeError, "causal must be a bool", lambda: rl.linear_attention(Q, Q, Q, causal="no")),
    raises(
        "linear_attention",
        ValueError,
        "v must share q's dtype and device",
        lambda: rl.linear_attention(Q, Q, Q.double()),
    ),
    raises(
        "linear_attention",
        TypeError,
        "rope must be a RotaryEmbedding",
        lambda: rl.linear_attention(Q, Q, Q, rope="rope"),
    ),
    gives(
        "linear_attention",
        shapes((1, 0, 2, 8)),
        lambda: rl.linear_attention(*(torch.randn(1, 0, 2, 8),) * 3, causal=True),
    ),
    gives("linear_attention", shapes((1, 0, 2, 8)), lambda: rl.linear_attention(*(torch.randn(1, 0, 2, 8),) * 3)),
    raises(
        "linear_attention_weights",
        ValueError,
        "eps must be a finite number > 0",
        lambda: rl.linear_attention_weights(Q, Q, eps=math.inf),
    ),
    raises(
        "linear_attention_weights",
        ValueError,
        "q and k must have equal shapes",
        lambda: rl.linear_attention_weights(Q, K),
    ),
    raises(
        "elu_feature_map",
        TypeError,
        "x must be a floating-point tensor",
        lambda: rl.elu_feature_map(torch.ones(2).long()),
    ),
    raises("LinearAttention", TypeError, "causal must be a bool", lambda: rl.LinearAttention(8, 2, causal=1)),
    gives("LinearAttention", shapes((1, 0, 8)), lambda: rl.LinearAttention(8, 2, causal=True)(torch.randn(1, 0, 8))),
    # ---- variants
    raises(
        "XPos",
        ValueError,
        "keeps xPos finite in torch.float32",
        lambda: rl.XPos(8)(Q[:, :2], K[:, :2], torch.tensor([0, 100000])),
    ),
    raises("XPos", ValueError, "gamma must be a finite number > 0", lambda: rl.XPos(8, gamma=math.nan)),
    gives(
        "XPos",
        lambda r: bool(torch.isfinite(r[0]).all()),
        lambda: rl.XPos(8)(Q[:, :1], K[:, :1], torch.tensor([2**31])),
    ),
    gives(
        "XPos",
        shapes((1, 4, 2, 8), (1, 4, 1, 8)),
        lambda: rl.XPos(8)(Q.to(META), K.to(META), torch.arange(4, device=META)),
    ),
    raises("xpos_decay_rates", ValueError, "head_dim must be even", lambda: rl.xpos_decay_rates(5)),
    raises("axial_positions", ValueError, "height must be >= 1", lambda: rl.axial_positions(0, 3)),
    raises("AxialRotaryEmbedding", ValueError, "multiple of 4", lambda: rl.AxialRotaryEmbedding(6)),
    raises(
        "AxialRotaryEmbedding",
        ValueError,
        "must share dtype and device",
        lambda: rl.AxialRotaryEmbedding(8)(
            torch.randn(1, 6, 1, 8), torch.randn(1, 6, 1, 8).double(), rl.axial_positions(2, 3)
        ),
    ),
    raises(
        "AxialRotaryEmbedding",
        ValueError,
        "positions must be an integer tensor \\[seq, 2\\]",
        lambda: rl.AxialRotaryEmbedding(8)(torch.randn(1, 6, 1, 8), torch.randn(1, 6, 1, 8), torch.arange(6)),
    ),
    # ---- M-RoPE
    gives("mrope_axes", lambda r: r.tolist() == [0, 0, 1, 2], lambda: rl.mrope_axes([2, 1, 1])),
    raises("mrope_axes", TypeError, "mrope_section must be a sequence of 3 ints", lambda: rl.mrope_axes("211")),
    raises("mrope_axes", TypeError, "interleaved must be a bool", lambda: rl.mrope_axes([2, 1, 1], interleaved="yes")),
    gives(
        "mrope_positions", lambda r: r.tolist() == [[0, 1, 2, 3]] * 3, lambda: rl.mrope_positions([2, (1, 1, 1), 1])
    ),  # image (1,1,1) at 2, text resumes at 2 + 1
    raises("mrope_positions", TypeError, "segments must be a sequence", lambda: rl.mrope_positions(3)),
    raises(
        "mrope_positions",
        ValueError,
        "spatial_merge_size must be >= 1",
        lambda: rl.mrope_positions([2], spatial_merge_size=0),
    ),
    raises("MRotaryEmbedding", TypeError, "mrope_section", lambda: rl.MRotaryEmbedding(8, mrope_section=None)),
    raises(
        "MRotaryEmbedding",
        ValueError,
        "head_dim=8",
        lambda: rl.MRotaryEmbedding(8, mrope_section=[2, 1, 1])(
            torch.randn(1, 3, 2, 6), torch.randn(1, 3, 1, 6), torch.zeros(3, 1, 3).long()
        ),
    ),
    gives(
        "MRotaryEmbedding",
        lambda r: close(r[0], rotated(Q, torch.arange(4))),  # text tokens: plain RoPE
        lambda: rl.MRotaryEmbedding(8, mrope_section=[2, 1, 1])(Q, K, torch.arange(4).expand(3, 1, 4)),
    ),
    # ---- packing and context parallelism
    gives(
        "packed_positions",
        lambda r: r.tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 0, 1],
        lambda: rl.packed_positions(torch.tensor([0, 3, 3, 8, 10])),
    ),
    raises("packed_positions", ValueError, "cu_seqlens", lambda: rl.packed_positions(torch.tensor([0, 3, 2]))),
    raises("packed_positions", TypeError, "cu_seqlens", lambda: rl.packed_positions(torch.tensor([0.0, 3.0]))),
    raises(  # an int64 end near 2^63: more positions than an int64 tensor can hold (2^60 - 1)
        "packed_positions",
        ValueError,
        r"cu_seqlens\[-1\] = 9223372036854775807 tokens",
        lambda: rl.packed_positions(torch.tensor([0, 2**63 - 1])),
    ),
    gives("shard_positions", lambda r: r.tolist() == [0, 1, 6, 7], lambda: rl.shard_positions(8, 2, 0)),
    raises("shard_positions", ValueError, "rank", lambda: rl.shard_positions(8, 2, 2)),
    raises("shard_positions", ValueError, "divisible", lambda: rl.shard_positions(6, 2, 0)),
    raises("shard_sequence", ValueError, "rank", lambda: rl.shard_sequence(X, 2, -1)),
    gives(
        "unshard_sequence",
        lambda r: torch.equal(r, X),
        lambda: rl.unshard_sequence([rl.shard_sequence(X, 2, r) for r in range(2)]),
    ),
    raises(
        "context_parallel_attention",
        TypeError,
        "rope",
        lambda: rl.context_parallel_attention(Q, Q, Q, torch.arange(4), rope="rope"),
    ),
    # ---- Hugging Face and devices
    raises(
        "HFRotaryEmbedding", TypeError, "config must be a transformers config", lambda: rl.HFRotaryEmbedding("llama")
    ),
    raises(
        "HFRotaryEmbedding",
        TypeError,
        "position_ids must be an integer",
        lambda: rl.HFRotaryEmbedding(CONFIG)(torch.zeros(1), torch.ones(1, 3)),
    ),
    raises(
        "HFRotaryEmbedding",
        ValueError,
        "position_ids must have shape",
        lambda: rl.HFRotaryEmbedding(CONFIG)(torch.zeros(1), torch.ones(1, 1, 3).long()),
    ),
    gives(
        "HFRotaryEmbedding",
        shapes((1, 1, 8), (1, 1, 8)),
        lambda: rl.HFRotaryEmbedding(CONFIG)(torch.zeros(1), torch.tensor([[2**31]])),
    ),
    gives(
        "HFRotaryEmbedding",
        lambda r: close(r[0][0, 0, :4], torch.cos(-torch.tensor([1.0, 0.1, 0.01, 0.001]))),
        lambda: rl.HFRotaryEmbedding(CONFIG)(torch.zeros(1), torch.tensor([[-1]])),
    ),
    gives(
        "HFRotaryEmbedding",
        shapes((1, 3, 8), (1, 3, 8)),
        lambda: rl.HFRotaryEmbedding(CONFIG)(torch.zeros(1, device=META), torch.arange(3, device=META)[None]),
    ),
    raises(
        "HFRotaryEmbedding",
        ValueError,
        r"ignore_keys= \(of rope_config, HFRotaryEmbedding",
        lambda: rl.HFRotaryEmbedding({**CONFIG, "rope_parameters": {**LINEAR, "vendor": 1}}),
    ),
    gives(
        "HFRotaryEmbedding",
        lambda r: r.rope.scaling == LINEAR,
        lambda: rl.HFRotaryEmbedding({**CONFIG, "rope_parameters": {**LINEAR, "vendor": 1}}, ignore_keys=["vendor"]),
    ),
    gives(
        "HFRotaryEmbedding",
        shapes((1, 0, 8), (1, 0, 8)),
        lambda: rl.HFRotaryEmbedding(CONFIG)(torch.zeros(1), torch.zeros(1, 0, dtype=torch.long)),
    ),
    raises("patch_hf_rope", TypeError, "model must be a torch.nn.Module", lambda: rl.patch_hf_rope("llama")),
    raises(
        "patch_hf_rope",
        ValueError,
        "kernel must be one of",
        lambda: rl.patch_hf_rope(torch.nn.Linear(2, 2), kernel="cuda"),
    ),
    raises("patch_hf_rope", ValueError, "no rotary module", lambda: rl.patch_hf_rope(torch.nn.Linear(2, 2))),
    raises("unpatch_hf_rope", TypeError, "model must be a torch.nn.Module", lambda: rl.unpatch_hf_rope(None)),
    raises(
        "use_ropelib_rope", TypeError, "model must be a torch.nn.Module", lambda: rl.use_ropelib_rope(3).__enter__()
    ),
    gives("default_device", lambda r: r.type in ("cpu", "cuda"), rl.default_device),
    gives("device_name", lambda r: isinstance(r, str) and "threads" in r, lambda: rl.device_name("cpu")),
    # ---- serving: the engines' cos_sin_cache, packed QKV, the fused cache write, moved keys, sink cache
    raises(
        "make_cos_sin_cache", TypeError, "rope must be a ropelib.RotaryEmbedding", lambda: rl.make_cos_sin_cache(8, 16)
    ),
    raises("make_cos_sin_cache", ValueError, "max_positions must be >= 1", lambda: rl.make_cos_sin_cache(ROPE, 0)),
    gives(
        "make_cos_sin_cache",  # cat(cos, sin) of the rows by hand
        lambda r: r.shape == (10, 8) and cache_rows_by_hand(CosSin(r[:, :4], r[:, 4:])),
        lambda: rl.make_cos_sin_cache(ROPE, 10),
    ),
    raises(
        "apply_rope_with_cos_sin_cache",
        TypeError,
        "cos_sin_cache must be torch.float32",
        lambda: rl.apply_rope_with_cos_sin_cache(torch.arange(4), Q[0], K[0], 8, SERVING_CACHE.half()),
    ),
    raises(
        "apply_rope_with_cos_sin_cache",
        ValueError,
        "positions must be < 16",
        lambda: rl.apply_rope_with_cos_sin_cache(torch.tensor([0, 1, 2, 16]), Q[0], K[0], 8, SERVING_CACHE),
    ),
    raises(
        "apply_rope_with_cos_sin_cache",
        ValueError,
        "query's last dimension must be a multiple of head_size=8",
        lambda: rl.apply_rope_with_cos_sin_cache(torch.arange(4), torch.randn(4, 12), None, 8, SERVING_CACHE),
    ),
    raises(
        "apply_rope_with_cos_sin_cache",
        ValueError,
        r"key must be \[4, heads \* head_size\]",
        lambda: rl.apply_rope_with_cos_sin_cache(torch.arange(4), Q[0], K[0, :3], 8, SERVING_CACHE),
    ),
    raises(
        "apply_rope_with_cos_sin_cache",
        TypeError,
        "is_neox must be a bool",
        lambda: rl.apply_rope_with_cos_sin_cache(torch.arange(4), Q[0], K[0], 8, SERVING_CACHE, "neox"),
    ),
    gives(
        "apply_rope_with_cos_sin_cache",  # flattened [tokens, heads * head_size], positions in any order
        lambda r: close(r[0].view(4, 2, 8), rotated(Q, torch.tensor([3, 1, 4, 1]))[0]) and r[1] is None,
        lambda: rl.apply_rope_with_cos_sin_cache(
            torch.tensor([3, 1, 4, 1]), Q[0].reshape(4, 16), None, 8, SERVING_CACHE
        ),
    ),
    gives(
        "apply_rope_with_cos_sin_cache",  # GPT-J pairs
        lambda r: close(r[1], rotated(K, torch.tensor([9, 0, 2, 15]), "interleaved")[0]),
        lambda: rl.apply_rope_with_cos_sin_cache(torch.tensor([9, 0, 2, 15]), Q[0], K[0], 8, SERVING_CACHE, False),
    ),
    gives(
        "apply_rope_with_cos_sin_cache",
        shapes((0, 2, 8), (0, 1, 8)),
        lambda: rl.apply_rope_with_cos_sin_cache(
            torch.zeros(0, dtype=torch.long), Q[0, :0], K[0, :0], 8, SERVING_CACHE
        ),
    ),
    raises(
        "apply_rope_with_cos_sin_cache_inplace",
        ValueError,
        "separate memory",
        lambda: (lambda t: rl.apply_rope_with_cos_sin_cache_inplace(torch.arange(4), t, t, 8, SERVING_CACHE))(
            Q[0].clone()
        ),
    ),
    raises(
        "apply_rope_with_cos_sin_cache_inplace",
        ValueError,
        "head_size must be >= 2",
        lambda: rl.apply_rope_with_cos_sin_cache_inplace(torch.arange(4), Q[0].clone(), None, 0, SERVING_CACHE),
    ),
    gives(
        "apply_rope_with_cos_sin_cache_inplace",
        lambda r: r[0] is None and close(r[1], rotated(Q, torch.tensor([3, 1, 4, 1]))[0]),
        lambda: rotated_in_place(
            lambda t: rl.apply_rope_with_cos_sin_cache_inplace(torch.tensor([3, 1, 4, 1]), t, None, 8, SERVING_CACHE)
        ),
    ),
    raises(
        "rotary_qkv_",
        ValueError,
        "needs num_heads_q",
        lambda: rl.rotary_qkv_(torch.randn(1, 4, 4, 8), COS, SIN),
    ),
    raises(
        "rotary_qkv_",
        ValueError,
        "minus num_heads_q=3 must be 2 Hk",
        lambda: rl.rotary_qkv_(torch.randn(1, 4, 6, 8), COS, SIN, num_heads_q=3),
    ),
    raises(
        "rotary_qkv_",
        ValueError,
        "leaf tensor that requires grad",
        lambda: rl.rotary_qkv_(torch.randn(1, 4, 3, 2, 8, requires_grad=True), COS, SIN),
    ),
    gives(
        "rotary_qkv_",  # q heads 0-1, k head 2 rotated; v head 3 kept
        lambda r: (
            close(r[0][:, :, :2], rotated(Q, torch.arange(4)))
            and close(r[0][:, :, 2:3], rotated(K, torch.arange(4)))
            and torch.equal(r[0][:, :, 3:], r[1])
        ),
        packed_rotated,
    ),
    raises(
        "rotary_kv_cache_write",
        ValueError,
        r"slot_mapping must have shape \[tokens\] = \[4\]",
        lambda: rl.rotary_kv_cache_write(
            Q[0], K[0], K[0], torch.zeros(8, 1, 8), torch.zeros(8, 1, 8), SLOTS[:3], COS, SIN, torch.arange(4)
        ),
    ),
    raises(
        "rotary_kv_cache_write",
        ValueError,
        "inference-only",
        lambda: rl.rotary_kv_cache_write(
            Q[0].requires_grad_(False).clone().requires_grad_(),
            K[0],
            K[0],
            torch.zeros(8, 1, 8),
            torch.zeros(8, 1, 8),
            SLOTS,
            COS,
            SIN,
            torch.arange(4),
        ),
    ),
    gives("rotary_kv_cache_write", kv_cache_as_two_steps, kv_written),
    raises(
        "rerotate_keys",
        TypeError,
        "shift must be an int or an integer tensor",
        lambda: rl.rerotate_keys(K, 1.0, rope=ROPE),
    ),
    raises(
        "rerotate_keys", ValueError, "keys must have head_dim=8", lambda: rl.rerotate_keys(K[..., :6], 1, rope=ROPE)
    ),
    raises(
        "rerotate_keys",
        ValueError,
        r"shift must have shape \[4\]",
        lambda: rl.rerotate_keys(K, torch.arange(3), rope=ROPE),
    ),
    gives(
        "rerotate_keys",  # R(-3) R(5) = R(2), to float32 rounding of two rotations
        lambda r: close(r, rotated(K, torch.arange(2, 6))),
        lambda: rl.rerotate_keys(ROPE(K, K, torch.arange(5, 9))[1], -3, rope=ROPE),
    ),
    gives(
        "rerotate_keys",  # per-token shifts, negative results allowed: R(-p) R(p) = identity
        lambda r: close(r, K),
        lambda: rl.rerotate_keys(ROPE(K, K, torch.tensor([3, 1, 4, 1]))[1], -torch.tensor([3, 1, 4, 1]), rope=ROPE),
    ),
    raises(
        "SinkCache", TypeError, "rope must be a ropelib.RotaryEmbedding", lambda: rl.SinkCache(None, sink=1, window=2)
    ),
    raises("SinkCache", ValueError, "window must be >= 1", lambda: rl.SinkCache(ROPE, sink=1, window=0)),
    raises("SinkCache", ValueError, "tokens must be <= 2", lambda: rl.SinkCache(ROPE, sink=4, window=2).make_room(3)),
    raises("SinkCache", ValueError, "the cache is empty", lambda: rl.SinkCache(ROPE, sink=1, window=2).values),
    gives("SinkCache", sink_holds_tokens_re_encoded, lambda: sink_stream(6)),
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c.name}-{i}" for i, c in enumerate(CASES)])
def test_hostile_call(case: Case) -> None:
    if case.error is None:
        result = case.call()
        assert case.check is not None and case.check(result), f"{case.name}: wrong result {result!r}"[:500]
        return
    with pytest.raises(case.error) as info:
        case.call()
    assert info.type in (TypeError, ValueError), info.type
    assert re.search(case.match, str(info.value)), f"{case.name}: {info.value}"


def test_every_public_name_is_swept() -> None:
    swept = {case.name for case in CASES}
    missing = [name for name in rl.__all__ if name not in swept]
    assert not missing, f"public names with no hostile case: {missing}"
