"""The compiled C loop on the CPU (ropelib.kernels.native_kernel): same rotation, built off the caller's path, eager fallback.

Expected values come from ``references.rotate_ref`` (float64 rotation matrices), never from
ropelib. ``built`` waits for the library; ``eager`` forces the fallback; ``fresh`` starts from an
empty build state, to watch a build begin.
"""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ropelib import RotaryEmbedding
from ropelib.kernels import native_kernel, rotary_qk, torch_kernel

from references import rotate_ref

THETA = 10000.0
COMPILER = pytest.mark.skipif(not native_kernel.enabled(), reason="no C compiler: the compiled path is off")


@pytest.fixture
def built(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch_kernel, "FEW_ELEMENTS", 0)  # not the decoding path
    native_kernel.functions()
    assert native_kernel.wait(120) is True


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> native_kernel._Library:
    library = native_kernel._Library()
    monkeypatch.setattr(native_kernel, "_LIBRARY", library)
    monkeypatch.setattr(torch_kernel, "FEW_ELEMENTS", 0)
    return library


def inputs(rotary_dim: int = 16, dtype: torch.dtype = torch.float32, length: int = 40) -> tuple[torch.Tensor, ...]:
    q, k = torch.randn(2, 6, 4, 16, dtype=dtype), torch.randn(2, 6, 2, 16, dtype=dtype)
    rope = RotaryEmbedding(rotary_dim, theta=THETA)
    cos, sin = rope.cos_sin(torch.arange(length), dtype) if dtype == torch.float64 else rope.cos_sin_cache(length)
    positions = torch.tensor([[0, 3, 39, 7, 7, 1], [1, 2, 3, 4, 5, 6]])
    return q, k, cos[:length], sin[:length], positions


def assert_rotated(out: tuple[torch.Tensor, ...], q: torch.Tensor, k: torch.Tensor, positions, r: int, layout="half"):
    # float32 tables and products on inputs of size ~4: a few float32 ulps of |x| (1e-6 each)
    for got, x in zip(out, (q, k)):
        ref = rotate_ref(x, positions, theta=THETA, rotary_dim=r, layout=layout)
        assert got.dtype == x.dtype
        assert (got.double() - ref).abs().max().item() < 1e-5


def counted(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Record what each native_kernel.rotate_qk call returned (True: the C loop did the work)."""
    served: list[bool] = []
    inner = native_kernel.rotate_qk

    def spy(*args: object, **kwargs: object) -> bool:
        served.append(inner(*args, **kwargs))  # type: ignore[arg-type]
        return served[-1]

    monkeypatch.setattr(native_kernel, "rotate_qk", spy)
    return served


@COMPILER
@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("rotary_dim", [16, 12])
@pytest.mark.parametrize("inplace", [False, True])
def test_the_c_loop_matches_the_reference(
    built: None, layout: str, rotary_dim: int, inplace: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    served = counted(monkeypatch)
    q, k, cos, sin, positions = inputs(rotary_dim)
    out = rotary_qk(q.clone(), k.clone(), cos, sin, positions, layout=layout, inplace=inplace)
    assert_rotated(out, q, k, positions, rotary_dim, layout)
    assert served == [True]


@COMPILER
def test_strided_inputs_float64_and_a_broadcast_row_of_positions(built: None, monkeypatch: pytest.MonkeyPatch) -> None:
    served = counted(monkeypatch)
    q64, k64, cos, sin, _ = inputs(16, torch.float64)
    q = torch.randn(2, 4, 6, 16, dtype=torch.float64).transpose(1, 2)  # [B, S, H, D] with heads outermost
    positions = torch.tensor([4, 0, 39, 2, 2, 9])  # [S]: one row for the whole batch (a stride-0 view inside)
    out = rotary_qk(q, k64, cos, sin, positions)
    # float64 all the way: rounding of order 1e-15
    for got, x in zip(out, (q, k64)):
        assert (got - rotate_ref(x, positions, theta=THETA)).abs().max().item() < 1e-12
    assert served == [True]


@COMPILER
@settings(max_examples=20, deadline=None)
@given(
    st.integers(1, 3),
    st.integers(1, 9),
    st.integers(1, 4),
    st.sampled_from([2, 4, 8, 10, 64]),
    st.booleans(),
    st.booleans(),
)
def test_threads_split_tokens_without_changing_a_value(
    batch: int, seq: int, heads: int, head_dim: int, interleaved: bool, conjugate: bool
) -> None:
    # property: the work split between threads (every call split, PARALLEL_ELEMENTS 0) gives the
    # result of one thread bit for bit, and the inverse rotation undoes the rotation
    native_kernel.functions()
    assert native_kernel.wait(120)
    q, k = torch.randn(batch, seq, heads, head_dim), torch.randn(batch, seq, 1, head_dim)
    cos, sin = RotaryEmbedding(head_dim).cos_sin_cache(16)
    positions = torch.randint(0, 16, (batch, seq))
    outs = []
    for threshold in (0, 1 << 40):
        pair = (torch.empty_like(q), torch.empty_like(k))
        old, native_kernel.PARALLEL_ELEMENTS = native_kernel.PARALLEL_ELEMENTS, threshold
        try:
            assert native_kernel.rotate_qk(
                q, k, *pair, cos, sin, positions, interleaved=interleaved, conjugate=conjugate
            )
        finally:
            native_kernel.PARALLEL_ELEMENTS = old
        outs.append(pair)
    assert all(torch.equal(a, b) for a, b in zip(*outs))
    back = (torch.empty_like(q), torch.empty_like(k))
    assert native_kernel.rotate_qk(
        *outs[0], *back, cos, sin, positions, interleaved=interleaved, conjugate=not conjugate
    )
    for x, y in zip((q, k), back):
        assert (x - y).abs().max().item() < 1e-5  # two float32 rotations of |x| ~ 4


@COMPILER
def test_gradients_through_the_operator(built: None, monkeypatch: pytest.MonkeyPatch) -> None:
    # the custom operator's forward and backward (the inverse rotation) both run the C loop
    served = counted(monkeypatch)
    q, k, cos, sin, positions = inputs(12, torch.float64)
    q.requires_grad_(True)
    k.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda a, b: rotary_qk(a, b, cos, sin, positions), (q, k))
    assert served and all(served)


@COMPILER
def test_positions_outside_the_table_raise_rather_than_read_past_it(built: None) -> None:
    q, k, cos, sin, positions = inputs()
    positions[1, 2] = 40  # the table has 40 rows; the public doors reject this earlier
    with pytest.raises(IndexError, match=r"outside \[0, 40\)"):
        native_kernel.rotate_qk(
            q, k, torch.empty_like(q), torch.empty_like(k), cos, sin, positions, interleaved=False, conjugate=False
        )


@COMPILER
def test_first_call_is_eager_and_starts_the_build(
    fresh: native_kernel._Library, monkeypatch: pytest.MonkeyPatch
) -> None:
    served = counted(monkeypatch)
    q, k, cos, sin, positions = inputs()
    assert_rotated(rotary_qk(q, k, cos, sin, positions), q, k, positions, 16)
    assert served == [False]  # not built yet: the eager kernel served it
    assert isinstance(fresh.state, (threading.Thread, dict))
    assert native_kernel.wait(120) is True
    assert_rotated(rotary_qk(q, k, cos, sin, positions), q, k, positions, 16)
    assert served == [False, True]


def test_a_failed_build_leaves_the_eager_kernel(fresh: native_kernel._Library, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native_kernel, "compiler", lambda: "/bin/false")  # a "compiler" that always fails
    monkeypatch.setenv(native_kernel.ENV, "1")
    served = counted(monkeypatch)
    q, k, cos, sin, positions = inputs()
    assert_rotated(rotary_qk(q, k, cos, sin, positions), q, k, positions, 16)
    assert native_kernel.wait(60) is False
    assert fresh.state is False
    assert_rotated(rotary_qk(q, k, cos, sin, positions, inplace=False), q, k, positions, 16)
    assert served == [False, False] and fresh.state is False  # no second build


def test_no_compiler_or_turned_off_never_builds(fresh: native_kernel._Library, monkeypatch: pytest.MonkeyPatch) -> None:
    q, k, cos, sin, positions = inputs()
    monkeypatch.setenv(native_kernel.ENV, "0")
    assert native_kernel.enabled() is False
    assert_rotated(rotary_qk(q, k, cos, sin, positions), q, k, positions, 16)
    monkeypatch.setenv(native_kernel.ENV, "1")
    monkeypatch.setattr(native_kernel, "compiler", lambda: None)
    assert native_kernel.enabled() is False
    assert_rotated(rotary_qk(q, k, cos, sin, positions, layout="interleaved"), q, k, positions, 16, "interleaved")
    assert fresh.state is False  # looked at once: nothing started, nothing will be


def test_low_precision_stays_on_the_eager_kernel(built: None, monkeypatch: pytest.MonkeyPatch) -> None:
    served = counted(monkeypatch)
    q, k, cos, sin, positions = inputs()
    out = rotary_qk(q.bfloat16(), k.bfloat16(), cos, sin, positions)
    assert served == [False] and out[0].dtype == torch.bfloat16


@COMPILER
@pytest.mark.parametrize("hf_layout", [False, True])
def test_one_position_in_one_call(built: None, hf_layout: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # a decoding step: q [1, 1, 32, 128] (or Hugging Face's [1, 32, 1, 128], a transposed view), one
    # wide row of the tables; the C call is used (the four list operations are not)
    monkeypatch.setattr(torch_kernel, "FEW_ELEMENTS", 1 << 14)
    fallback: list[int] = []
    monkeypatch.setattr(native_kernel, "rotate_half_few", lambda *a: fallback.append(1))
    q, k = torch.randn(1, 1, 32, 128), torch.randn(1, 1, 8, 128)
    cos, sin = RotaryEmbedding(128, theta=THETA).cos_sin_cache(1001)
    rows = torch_kernel.wide_rows(cos, sin, torch.tensor([[1000]]))
    args = (q.transpose(1, 2), k.transpose(1, 2)) if hf_layout else (q, k)
    out = native_kernel.rotate_few(*args, *rows)
    if hf_layout:
        out = tuple(t.transpose(1, 2) for t in out)
    assert_rotated(out, q, k, torch.tensor([[1000]]), 128)
    assert fallback == []


@COMPILER
def test_several_positions_take_the_list_operations(built: None) -> None:
    q, k = torch.randn(2, 1, 4, 16), torch.randn(2, 1, 2, 16)
    cos, sin = RotaryEmbedding(16, theta=THETA).cos_sin_cache(40)
    positions = torch.tensor([[3], [39]])
    rows = torch_kernel.wide_rows(cos, sin, positions)  # [2, 1, 1, 16]: a row per batch entry
    assert_rotated(native_kernel.rotate_few(q, k, *rows), q, k, positions, 16)


@COMPILER
def test_one_position_under_compile_traces_the_list_operations(built: None) -> None:
    # the C call is invisible to a graph: compiled, the same function traces the four list
    # operations, with no graph break, and gives the eager result within float32 rounding
    q, k = torch.randn(1, 1, 32, 128), torch.randn(1, 1, 8, 128)
    cos, sin = RotaryEmbedding(128, theta=THETA).cos_sin_cache(1001)
    rows = torch_kernel.wide_rows(cos, sin, torch.tensor([[1000]]))
    explained = torch._dynamo.explain(native_kernel.rotate_few)(q, k, *rows)
    assert explained.graph_break_count == 0
    compiled = torch.compile(native_kernel.rotate_few, fullgraph=True)(q, k, *rows)
    assert_rotated(compiled, q, k, torch.tensor([[1000]]), 128)


@COMPILER
def test_tables_it_cannot_read_row_by_row_are_left_to_eager(built: None) -> None:
    q, k, cos, sin, positions = inputs()
    strided = torch.cat((cos, cos), -1)[:, ::2]  # a view of every other column: not contiguous
    outs = (torch.empty_like(q), torch.empty_like(k))
    assert not native_kernel.rotate_qk(q, k, *outs, strided, sin, positions, interleaved=False, conjugate=False)
    assert not native_kernel.rotate_qk(q, k, *outs, cos, sin[:, :4], positions, interleaved=False, conjugate=False)
