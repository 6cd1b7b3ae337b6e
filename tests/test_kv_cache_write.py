"""ropelib.rotary_kv_cache_write: the rotation fused with the write of a (paged) KV cache.

Expected values never come from the fused write: the caches are compared bit for bit with the
two-step path an engine runs without it (``rotary_qk(kernel="torch")``, then ``index_copy_`` of
the rotated k and of v into the valid slots), and the rotated q with the float64 rotation
matrices of ``references.rotate_ref``. Triton runs in its interpreter on a CPU: shapes are small.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._python_dispatch import TorchDispatchMode

from ropelib import RotaryEmbedding, default_device, rotary_kv_cache_write, rotary_qk
from ropelib.kernels import native_build
from ropelib.kernels.triton_kernel import use_interpreter

from references import EPS, rotate_ref

THETA = 10000.0
DEVICE = default_device()
KERNELS = ["torch", "triton"] + (["native"] if DEVICE.type == "cpu" and native_build.enabled() else [])
KERNEL = pytest.mark.parametrize("kernel", KERNELS)
LAYOUT = pytest.mark.parametrize("layout", ["half", "interleaved"])
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
CACHES = ["contiguous", "paged", "halves"]  # [slots, H, D]; [blocks, bs, H, D]; the two halves of one buffer
OP = torch.ops.ropelib.rotary_kv_write_.default


def tables(rotary_dim: int, length: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The module's cos/sin rows, in the compute dtype the door asks for (input data, not expected values)."""
    rope = RotaryEmbedding(rotary_dim, theta=THETA)
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    cos, sin = rope.cos_sin(torch.arange(length), compute)
    return cos.to(DEVICE), sin.to(DEVICE)


@dataclass
class Case:
    """One call's arguments; the caches hold random values, so that an unwritten row is seen untouched."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slots: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    positions: torch.Tensor

    def args(self) -> tuple[torch.Tensor, ...]:
        return (self.q, self.k, self.v, self.k_cache, self.v_cache, self.slots, self.cos, self.sin, self.positions)


def make_caches(
    kind: str,
    blocks: int,
    block_size: int,
    heads: int,
    dim: int,
    v_dim: int,
    dtype: torch.dtype,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    if kind == "halves":  # one [blocks, 2, block_size, H, D] buffer: k at [:, 0], v at [:, 1] (vLLM's flash layout)
        assert v_dim == dim
        buffer = torch.randn(blocks, 2, block_size, heads, dim, generator=generator).to(dtype).to(DEVICE)
        return buffer[:, 0], buffer[:, 1]
    shape = (blocks * block_size,) if kind == "contiguous" else (blocks, block_size)
    k_cache, v_cache = (torch.randn(*shape, heads, d, generator=generator) for d in (dim, v_dim))
    return k_cache.to(dtype).to(DEVICE), v_cache.to(dtype).to(DEVICE)


def make_case(
    *,
    batch: int | None,
    seq: int,
    q_heads: int,
    k_heads: int,
    dim: int,
    v_dim: int,
    rotary_dim: int,
    blocks: int,
    block_size: int,
    cache: str,
    dtype: torch.dtype,
    padding: float,
    generator: torch.Generator,
) -> Case:
    """``batch=None``: vLLM's flattened ``[tokens, H, D]``; else ``[batch, seq, H, D]``. Distinct valid slots."""
    lead = (seq,) if batch is None else (batch, seq)
    tokens = seq * (batch or 1)
    num_slots = blocks * block_size
    assert tokens <= num_slots

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*lead, *shape, generator=generator).to(dtype).to(DEVICE)

    slots = torch.randperm(num_slots, generator=generator)[:tokens]
    slots[torch.rand(tokens, generator=generator) < padding] = -1
    length = 64
    k_cache, v_cache = make_caches(cache, blocks, block_size, k_heads, dim, v_dim, dtype, generator)
    return Case(
        rand(q_heads, dim),
        rand(k_heads, dim),
        rand(k_heads, v_dim),
        k_cache,
        v_cache,
        slots.view(lead).to(DEVICE),
        *tables(rotary_dim, length, dtype),
        torch.randint(0, length, lead, generator=generator).to(DEVICE),
    )


def two_step(case: Case, layout: str, kernel: str = "torch") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What an engine does without the fused write: rotate q and k, then copy k and v into the valid slots."""
    flat = case.q.ndim == 3
    q, k = (case.q[None], case.k[None]) if flat else (case.q, case.k)
    q_rot, k_rot = rotary_qk(q, k, case.cos, case.sin, case.positions, layout=layout, kernel=kernel)
    slots = case.slots.reshape(-1).long()
    valid = slots >= 0
    caches = []
    for rows, cache in ((k_rot, case.k_cache), (case.v, case.v_cache)):
        expected = cache.clone(memory_format=torch.contiguous_format)
        rows = rows.reshape(-1, *rows.shape[-2:])
        expected.view(-1, *expected.shape[-2:]).index_copy_(0, slots[valid], rows[valid])
        caches.append(expected)
    return (q_rot[0] if flat else q_rot), caches[0], caches[1]


def bound(ref: torch.Tensor, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``|q_out - ref|`` allowed: one ulp of the output dtype (its single rounding; Triton's interpreter may
    truncate bfloat16 rather than round it) plus 8 ulps of the compute dtype (float32 tables, float64 for
    float64) times max|x|: cos and sin rounded once each, two products and a sum, each at most half an
    ulp of a term <= max|x|, and the tables' angles rounded once."""
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    return EPS[dtype] * ref.abs() + 8 * EPS[compute] * x.double().abs().max()


def assert_close_to_reference(q_out: torch.Tensor, case: Case, layout: str, rotary_dim: int) -> None:
    q = case.q if case.q.ndim == 4 else case.q[None]
    positions = case.positions if case.q.ndim == 4 else case.positions[None]
    ref = rotate_ref(q.cpu(), positions.cpu(), theta=THETA, layout=layout, rotary_dim=rotary_dim)
    got = (q_out if q_out.ndim == 4 else q_out[None]).double().cpu()
    err = (got - ref).abs()
    assert bool((err <= bound(ref, q, q.dtype)).all()), f"max error {err.max().item():.3g}"


def reference_kernel(kernel: str, dtype: torch.dtype) -> str:
    """The kernel of the two-step path: PyTorch's, except for Triton's interpreter in bfloat16, whose
    conversion truncates (rotary_qk(kernel="triton") shows the same bits; on a GPU it rounds)."""
    return "triton" if kernel == "triton" and dtype == torch.bfloat16 and use_interpreter() else "torch"


def assert_two_step_bits(case: Case, layout: str, kernel: str, **kwargs: str) -> torch.Tensor:
    want = two_step(case, layout, reference_kernel(kernel, case.q.dtype))
    q_out = rotary_kv_cache_write(*case.args(), layout=layout, kernel=kernel, **kwargs)
    assert q_out.shape == case.q.shape and q_out.dtype == case.q.dtype
    for got, expected in zip((q_out, case.k_cache, case.v_cache), want):
        assert torch.equal(got, expected)
    return q_out


# ----------------------------------------------------------------------------- the two-step path's bits


@KERNEL
@LAYOUT
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("batch", [None, 2])  # flat [tokens, H, D] and batched [B, S, H, D]
def test_equals_the_two_step_path(kernel: str, layout: str, dtype: torch.dtype, cache: str, batch: int | None) -> None:
    # GQA (4 query heads, 2 key heads), a partial rotation (12 of 16 features), padding slots.
    generator = torch.Generator().manual_seed(hash((kernel, layout, str(dtype), cache, batch)) % 2**31)
    v_dim = 16 if cache == "halves" else 8
    case = make_case(
        batch=batch,
        seq=3,
        q_heads=4,
        k_heads=2,
        dim=16,
        v_dim=v_dim,
        rotary_dim=12,
        blocks=4,
        block_size=3,
        cache=cache,
        dtype=dtype,
        padding=0.3,
        generator=generator,
    )
    q_out = assert_two_step_bits(case, layout, kernel)
    assert_close_to_reference(q_out, case, layout, rotary_dim=12)


@KERNEL
@LAYOUT
@pytest.mark.parametrize("rotary_dim", [8, 4])  # full and partial rotation of head_dim 8
def test_padding_leaves_cache_rows_untouched(kernel: str, layout: str, rotary_dim: int) -> None:
    generator = torch.Generator().manual_seed(7)
    case = make_case(
        batch=None,
        seq=4,
        q_heads=2,
        k_heads=1,
        dim=8,
        v_dim=8,
        rotary_dim=rotary_dim,
        blocks=2,
        block_size=4,
        cache="paged",
        dtype=torch.float32,
        padding=0.0,
        generator=generator,
    )
    case.slots = torch.tensor([6, -1, 1, -1], device=DEVICE)
    before = case.k_cache.clone(), case.v_cache.clone()
    q_out = assert_two_step_bits(case, layout, kernel)
    written = torch.zeros(8, dtype=torch.bool)
    written[[6, 1]] = True
    for cache, old in zip((case.k_cache, case.v_cache), before):
        rows, old_rows = cache.reshape(8, -1).cpu(), old.reshape(8, -1).cpu()
        assert torch.equal(rows[~written], old_rows[~written])  # every other row: the same bits
        assert not torch.equal(rows[written], old_rows[written])
    assert torch.equal(case.v_cache.reshape(8, 1, 8)[6], case.v[0])  # block 1, row 2 holds token 0's value
    assert_close_to_reference(q_out, case, layout, rotary_dim)
    # only padding: nothing written, q rotated all the same
    case.slots = torch.full((4,), -1, device=DEVICE)
    before = case.k_cache.clone(), case.v_cache.clone()
    q_out = assert_two_step_bits(case, layout, kernel)
    assert torch.equal(case.k_cache, before[0]) and torch.equal(case.v_cache, before[1])
    assert_close_to_reference(q_out, case, layout, rotary_dim)


@KERNEL
def test_no_tokens_and_one_decoding_token(kernel: str) -> None:
    generator = torch.Generator().manual_seed(3)
    for seq in (0, 1):
        case = make_case(
            batch=None,
            seq=seq,
            q_heads=2,
            k_heads=1,
            dim=8,
            v_dim=4,
            rotary_dim=8,
            blocks=2,
            block_size=2,
            cache="paged",
            dtype=torch.float32,
            padding=0.0,
            generator=generator,
        )
        assert_two_step_bits(case, "half", kernel)


@KERNEL
def test_strided_views_of_one_projection(kernel: str) -> None:
    # q, k and v split from one [tokens, Hq + 2 Hk, D] projection (non-contiguous views), int32 slots
    # and positions, as vLLM passes them.
    generator = torch.Generator().manual_seed(11)
    qkv = torch.randn(5, 4 + 2 * 2, 8, generator=generator).to(DEVICE)
    cos, sin = tables(8, 32, torch.float32)
    k_cache, v_cache = make_caches("paged", 3, 4, 2, 8, 8, torch.float32)
    slots = torch.tensor([3, 9, -1, 0, 11], dtype=torch.int32, device=DEVICE)
    positions = torch.tensor([30, 2, 7, 0, 31], dtype=torch.int32, device=DEVICE)
    case = Case(qkv[:, :4], qkv[:, 4:6], qkv[:, 6:], k_cache, v_cache, slots, cos, sin, positions)
    assert_two_step_bits(case, "half", kernel)


HYPOTHESIS_KERNELS = ["torch"] + (["native"] if "native" in KERNELS else [])


@pytest.mark.parametrize("kernel", HYPOTHESIS_KERNELS)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_equals_the_two_step_path_for_any_shape_and_slots(kernel: str, data: st.DataObject) -> None:
    draw: Callable = data.draw
    dim = 2 * draw(st.integers(1, 9))
    blocks, block_size = draw(st.integers(1, 4)), draw(st.integers(1, 5))
    batch = draw(st.sampled_from([None, 1, 2]))
    seq = draw(st.integers(0, blocks * block_size // (batch or 1)))
    cache = draw(st.sampled_from(CACHES))
    case = make_case(
        batch=batch,
        seq=seq,
        q_heads=draw(st.integers(1, 4)),
        k_heads=draw(st.integers(1, 3)),
        dim=dim,
        v_dim=dim if cache == "halves" else draw(st.integers(1, 9)),
        rotary_dim=2 * draw(st.integers(1, dim // 2)),
        blocks=blocks,
        block_size=block_size,
        cache=cache,
        dtype=draw(st.sampled_from(DTYPES)),
        padding=draw(st.sampled_from([0.0, 0.5, 1.0])),
        generator=torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1))),
    )
    assert_two_step_bits(case, draw(st.sampled_from(["half", "interleaved"])), kernel)


# ----------------------------------------------------------------------------- as PyTorch sees it


def small_case(dtype: torch.dtype = torch.float32) -> Case:
    return make_case(
        batch=None,
        seq=5,
        q_heads=4,
        k_heads=2,
        dim=8,
        v_dim=8,
        rotary_dim=8,
        blocks=3,
        block_size=4,
        cache="paged",
        dtype=dtype,
        padding=0.3,
        generator=torch.Generator().manual_seed(5),
    )


def operator_args(case: Case, kernel: str) -> tuple[object, ...]:
    """The operator's own arguments, as the door passes them: ``[B, S, ...]`` and int64 ``[B, S]`` slots."""
    return (
        case.q[None],
        case.k[None],
        case.v[None],
        case.k_cache,
        case.v_cache,
        case.slots[None].long(),
        case.cos,
        case.sin,
        case.positions,
        False,
        kernel,
    )


@pytest.mark.parametrize("kernel", HYPOTHESIS_KERNELS)
def test_opcheck(kernel: str) -> None:
    # torch.library.opcheck's tests for an inference-only op that mutates its caches: test_schema (the
    # declared mutations, Tensor(a!)/(b!), are the real ones and nothing else is written),
    # test_faketensor (the fake function's q_out has the kernel's shape, dtype and strides) and
    # test_aot_dispatch_static/dynamic (AOT autograd's functionalisation of the mutation gives the
    # eager result). test_autograd_registration is excluded: it checks the backward of inputs that
    # require grad, and this op refuses them (tested below) rather than register a gradient it has not.
    case = small_case()
    for test in ("test_schema", "test_faketensor", "test_aot_dispatch_static", "test_aot_dispatch_dynamic"):
        torch.library.opcheck(OP, operator_args(case, kernel), test_utils=test)


def test_make_fx_records_the_operator() -> None:
    case = small_case()

    def write(*args: torch.Tensor) -> torch.Tensor:
        return rotary_kv_cache_write(*args, kernel="torch")

    for mode in ("fake", "symbolic"):
        graph = make_fx(write, tracing_mode=mode)(*small_case().args())
        targets = [str(node.target) for node in graph.graph.nodes if node.op == "call_function"]
        assert "ropelib.rotary_kv_write_.default" in targets
        assert not any("index_put" in t or "index_copy" in t for t in targets)  # the write is inside the op
        fresh = small_case()
        q_out = graph(*fresh.args())
        want = two_step(case, "half")
        assert torch.equal(q_out, want[0])
        assert torch.equal(fresh.k_cache, want[1]) and torch.equal(fresh.v_cache, want[2])


def test_compiled_function_gives_the_same_bits() -> None:
    def step(*args: torch.Tensor) -> torch.Tensor:
        return rotary_kv_cache_write(*args, kernel="torch") * 1.0

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    case = small_case()
    want = two_step(case, "half")
    q_out = compiled(*case.args())
    assert torch.equal(q_out, want[0])
    assert torch.equal(case.k_cache, want[1]) and torch.equal(case.v_cache, want[2])


@pytest.mark.parametrize("mode", [torch.inference_mode, torch.no_grad])
def test_under_inference_mode_and_no_grad(mode: Callable) -> None:
    case = small_case()
    want = two_step(case, "half")
    case.q.requires_grad_()  # a leaf that requires grad is fine where no gradient is recorded
    with mode():
        q_out = rotary_kv_cache_write(*case.args())
    assert not q_out.requires_grad
    assert torch.equal(q_out, want[0])
    assert torch.equal(case.k_cache, want[1]) and torch.equal(case.v_cache, want[2])


def test_inference_tensors_as_caches() -> None:
    with torch.inference_mode():  # an engine allocates its caches once, under inference mode
        case = small_case()
        want = two_step(case, "half")
        q_out = rotary_kv_cache_write(*case.args())
    assert case.k_cache.is_inference() and torch.equal(case.k_cache, want[1]) and torch.equal(q_out, want[0])


@KERNEL
def test_version_counters_of_the_caches_bump(kernel: str) -> None:
    case = small_case()
    versions = case.k_cache._version, case.v_cache._version, case.q._version, case.k._version
    rotary_kv_cache_write(*case.args(), kernel=kernel)
    assert case.k_cache._version > versions[0] and case.v_cache._version > versions[1]
    assert (case.q._version, case.k._version) == versions[2:]  # read only


class Dispatched(TorchDispatchMode):
    """Records every operator dispatched below autograd."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def test_a_dispatch_mode_sees_the_operator() -> None:
    case = small_case()
    with Dispatched() as mode:
        rotary_kv_cache_write(*case.args())
    assert mode.ops.count("ropelib.rotary_kv_write_") == 1
    assert not any("index" in op for op in mode.ops)


def test_the_operator_refuses_inputs_that_require_grad() -> None:
    case = small_case()
    args = list(operator_args(case, "torch"))
    args[0] = args[0].clone().requires_grad_()
    with pytest.raises(RuntimeError, match="inference-only"):
        OP(*args)
    with torch.no_grad():
        OP(*args)  # no gradient recorded: allowed


# ----------------------------------------------------------------------------- bad arguments


def overlapping_caches() -> dict[str, object]:
    """Blocks 0-2 and 1-3 of one buffer as the two caches: blocks 1 and 2 are both."""
    buffer = torch.zeros(4, 4, 2, 8, device=DEVICE)
    return {"k_cache": buffer[:3], "v_cache": buffer[1:]}


def bad_calls() -> list[tuple[str, type[Exception], str, Callable[[Case], dict[str, object]]]]:
    """(label, exception, message pattern, the arguments to change)."""

    def buffer_views(case: Case, size: int, name: str) -> dict[str, object]:
        buffer = torch.randn(3, 4, size, 8, device=DEVICE)
        views = {"k": buffer.view(12, size, 8)[:5, :2], "v": buffer.view(12, size, 8)[:5, :2]}
        views["q"] = buffer.view(12, size, 8)[:5, :4]
        return {name: views[name], f"{'v' if name == 'v' else 'k'}_cache": buffer[:, :, :2]}

    return [
        ("slot past the cache", ValueError, r"slot_mapping .* must be < 12", lambda c: {"slot_mapping": c.slots + 12}),
        ("float slots", TypeError, "slot_mapping must be an integer", lambda c: {"slot_mapping": c.slots.float()}),
        ("a list of slots", TypeError, "slot_mapping", lambda c: {"slot_mapping": c.slots.tolist()}),
        (
            "slots [1, tokens]",
            ValueError,
            r"slot_mapping must have shape \[tokens\]",
            lambda c: {"slot_mapping": c.slots[None]},
        ),
        ("slots too few", ValueError, "slot_mapping must have shape", lambda c: {"slot_mapping": c.slots[:4]}),
        (
            "slots on meta",
            ValueError,
            "slot_mapping must be on q's device",
            lambda c: {"slot_mapping": c.slots.to("meta")},
        ),
        ("k_cache head_dim", ValueError, "k_cache must have shape", lambda c: {"k_cache": torch.zeros(3, 4, 2, 6)}),
        ("k_cache heads", ValueError, "k_cache must have shape", lambda c: {"k_cache": torch.zeros(3, 4, 1, 8)}),
        ("k_cache rank", ValueError, "k_cache must have shape", lambda c: {"k_cache": torch.zeros(12, 16)}),
        ("v_cache head_dim", ValueError, "v_cache must have shape", lambda c: {"v_cache": torch.zeros(3, 4, 2, 4)}),
        ("k_cache dtype", ValueError, "k_cache must have k's dtype", lambda c: {"k_cache": c.k_cache.double()}),
        ("v_cache dtype", ValueError, "v_cache must have v's dtype", lambda c: {"v_cache": c.v_cache.half()}),
        (
            "k_cache device",
            ValueError,
            "k_cache must have k's dtype and device",
            lambda c: {"k_cache": c.k_cache.to("meta")},
        ),
        ("integer cache", TypeError, "k_cache must be a floating-point", lambda c: {"k_cache": c.k_cache.int()}),
        (
            "a cache not a tensor",
            TypeError,
            "v_cache must be a torch.Tensor",
            lambda c: {"v_cache": c.v_cache.tolist()},
        ),
        ("fewer value blocks", ValueError, "same slots", lambda c: {"v_cache": c.v_cache[:2]}),
        ("paged and contiguous", ValueError, "same slots", lambda c: {"v_cache": c.v_cache.reshape(12, 2, 8)}),
        (
            "strided head_dim",
            ValueError,
            "k_cache must have unit stride",
            lambda c: {"k_cache": torch.zeros(3, 4, 2, 16)[..., ::2]},
        ),
        (
            "expanded cache",
            ValueError,
            "k_cache's elements must not share",
            lambda c: {"k_cache": c.k_cache[:1, :1].expand(3, 4, 2, 8)},
        ),
        ("caches one tensor", ValueError, "must not share memory", lambda c: {"v_cache": c.k_cache}),
        ("caches overlap", ValueError, "must not share memory", lambda c: overlapping_caches()),
        ("k inside k_cache", ValueError, "k overlaps a cache", lambda c: buffer_views(c, 2, "k")),
        ("v inside v_cache", ValueError, "v overlaps a cache", lambda c: buffer_views(c, 2, "v")),
        ("q inside k_cache", ValueError, "q overlaps a cache", lambda c: buffer_views(c, 4, "q")),
        (
            "cache requires grad",
            ValueError,
            "k_cache must not require grad",
            lambda c: {"k_cache": c.k_cache.clone().requires_grad_()},
        ),
        ("q requires grad", ValueError, "inference-only", lambda c: {"q": c.q.clone().requires_grad_()}),
        ("k requires grad", ValueError, "inference-only", lambda c: {"k": c.k.clone().requires_grad_()}),
        ("v requires grad", ValueError, "inference-only", lambda c: {"v": c.v.clone().requires_grad_()}),
        ("v heads", ValueError, "v must have k's tokens and heads", lambda c: {"v": c.v[:, :1]}),
        ("v dtype", ValueError, "v must have k's tokens and heads", lambda c: {"v": c.v.double()}),
        ("k tokens", ValueError, "q and k must share", lambda c: {"k": c.k[:4]}),
        ("q rank", ValueError, "q must be", lambda c: {"q": c.q[0]}),
        ("q batched, k flat", ValueError, "k must have 4 dimensions", lambda c: {"q": c.q[None]}),
        ("integer q", TypeError, "q must be a floating-point", lambda c: {"q": c.q.int()}),
        ("positions [1, tokens]", ValueError, "positions must have shape", lambda c: {"positions": c.positions[None]}),
        ("positions past the table", ValueError, "positions must be <", lambda c: {"positions": c.positions + 64}),
        (
            "float64 tables for float32",
            TypeError,
            "cos and sin must be torch.float32",
            lambda c: {"cos": c.cos.double(), "sin": c.sin.double()},
        ),
        ("layout", ValueError, "layout must be one of", lambda c: {"layout": "neox"}),
        ("kernel", ValueError, "kernel must be one of", lambda c: {"kernel": "cuda"}),
        ("kernel not a str", TypeError, "kernel must be a str", lambda c: {"kernel": None}),
    ]


@pytest.mark.parametrize(("label", "error", "match", "change"), bad_calls(), ids=[b[0] for b in bad_calls()])
def test_bad_arguments_raise_naming_them(
    label: str, error: type[Exception], match: str, change: Callable[[Case], dict[str, object]]
) -> None:
    case = small_case()
    names = ("q", "k", "v", "k_cache", "v_cache", "slot_mapping", "cos", "sin", "positions")
    kwargs: dict[str, object] = dict(zip(names, case.args()))
    kwargs.update(change(case))
    before = case.k_cache.clone(), case.v_cache.clone()
    with pytest.raises(error, match=match):
        rotary_kv_cache_write(**kwargs)  # type: ignore[arg-type]
    assert torch.equal(case.k_cache, before[0]) and torch.equal(case.v_cache, before[1])  # checked before writing


def test_the_two_halves_of_one_buffer_are_not_aliasing() -> None:
    # [blocks, 2, block_size, H, D]: k at [:, 0], v at [:, 1] share a storage but no element.
    generator = torch.Generator().manual_seed(2)
    case = make_case(
        batch=None,
        seq=4,
        q_heads=2,
        k_heads=2,
        dim=8,
        v_dim=8,
        rotary_dim=8,
        blocks=2,
        block_size=2,
        cache="halves",
        dtype=torch.float32,
        padding=0.0,
        generator=generator,
    )
    assert case.k_cache.untyped_storage().data_ptr() == case.v_cache.untyped_storage().data_ptr()
    assert_two_step_bits(case, "half", "torch")


# ----------------------------------------------------------------------------- q rotated in place (vLLM's order)

INPLACE_OP = torch.ops.ropelib.rotary_kv_write_inplace_.default


@KERNEL
@LAYOUT
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", [None, 2])
def test_in_place_q_equals_the_two_step_path(kernel: str, layout: str, dtype: torch.dtype, batch: int | None) -> None:
    # inplace=True: q itself returned, rotated with rotary_qk's bits, its version moved; the caches as before.
    generator = torch.Generator().manual_seed(hash((kernel, layout, str(dtype), batch)) % 2**31)
    case = make_case(
        batch=batch, seq=3, q_heads=4, k_heads=2, dim=16, v_dim=8, rotary_dim=12, blocks=4, block_size=3,
        cache="paged", dtype=dtype, padding=0.3, generator=generator,
    )  # fmt: skip
    want = two_step(case, layout, reference_kernel(kernel, dtype))
    q = case.q.clone()
    version = q._version
    got = rotary_kv_cache_write(q, *case.args()[1:], layout=layout, kernel=kernel, inplace=True)
    assert got is q and q._version > version
    for have, expected in zip((q, case.k_cache, case.v_cache), want):
        assert torch.equal(have, expected)


def test_in_place_q_with_a_feature_stride_goes_through_a_copy() -> None:
    # q whose features are not at unit stride (a transposed view): rotated where it lies all the same.
    case = small_case()
    want = two_step(case, "half")
    q = case.q.transpose(-1, -2).contiguous().transpose(-1, -2)  # same values, feature stride != 1
    assert q.stride(-1) != 1
    rotary_kv_cache_write(q, *case.args()[1:], kernel="torch", inplace=True)
    assert torch.equal(q, want[0])


@pytest.mark.parametrize("kernel", HYPOTHESIS_KERNELS)
def test_opcheck_in_place(kernel: str) -> None:
    # As test_opcheck, for the operator that also writes q (declared Tensor(a!) q).
    case = small_case()
    args = (case.q[None].clone(), *operator_args(case, kernel)[1:])
    for test in ("test_schema", "test_faketensor", "test_aot_dispatch_static", "test_aot_dispatch_dynamic"):
        torch.library.opcheck(INPLACE_OP, args, test_utils=test)


def test_make_fx_records_the_in_place_operator() -> None:
    def write(q: torch.Tensor, *args: torch.Tensor) -> torch.Tensor:
        return rotary_kv_cache_write(q, *args, kernel="torch", inplace=True)

    graph = make_fx(write, tracing_mode="fake")(*small_case().args())
    targets = [str(node.target) for node in graph.graph.nodes if node.op == "call_function"]
    assert "ropelib.rotary_kv_write_inplace_.default" in targets


@pytest.mark.parametrize(
    ("q_of", "match"),
    [(lambda k, v: k, "q and k in separate memory"), (lambda k, v: v, "q overlaps v")],
    ids=["q is k", "q is v"],
)
def test_in_place_refuses_q_over_what_the_pass_reads(q_of: Callable, match: str) -> None:
    case = small_case()
    k = torch.randn(5, 4, 8)
    v = torch.randn(5, 4, 8)
    caches = torch.zeros(3, 4, 4, 8), torch.zeros(3, 4, 4, 8)
    with pytest.raises(ValueError, match=match):
        rotary_kv_cache_write(q_of(k, v), k, v, *caches, case.slots, case.cos, case.sin, case.positions, inplace=True)
    with pytest.raises(TypeError, match="inplace"):
        rotary_kv_cache_write(*case.args(), inplace="yes")  # type: ignore[arg-type]
