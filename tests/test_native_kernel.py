"""The native CPU kernel (ropelib.kernels.native_kernel): the rotation matrices, and the PyTorch kernel's bits.

Expected values come from ``references.rotate_ref`` (explicit float64 2x2 rotations) or, for the
bitwise checks, from the PyTorch kernel (``kernel="torch"``, PyTorch's own operations): the two
kernels compute one expression, ``(a c - b s, b c + a s)`` with every product and sum rounded, so
they must agree bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ropelib import RotaryEmbedding, rotary_qk
from ropelib.kernels import native_build, native_kernel

from references import EPS, rotate_ref

pytestmark = pytest.mark.skipif(
    not native_build.enabled(), reason="the native kernel is off (ROPELIB_CPU_COMPILE=0 or no C compiler)"
)
THETA = 10000.0
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
LAYOUT = pytest.mark.parametrize("layout", ["half", "interleaved"])


def tables(rotary_dim: int, length: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """The tables the kernels read (input data, not expected values)."""
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    return RotaryEmbedding(rotary_dim, theta=THETA).cos_sin(torch.arange(length), compute)


def bound(x: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """One unit in the last place of the output (its one rounding) plus 8 float32 ulps of max|x| for
    the float32 tables, products and sum (float64: 8 float64 ulps)."""
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    return EPS[x.dtype] * ref.abs() + 8 * EPS[compute] * x.double().abs().max()


@LAYOUT
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rotary_dim", [16, 10])  # all features, and a partial rotation with an odd pair count
@pytest.mark.parametrize("inplace", [False, True])
def test_matches_the_rotation_matrices(layout: str, dtype: torch.dtype, rotary_dim: int, inplace: bool) -> None:
    q, k = torch.randn(2, 3, 4, 16).to(dtype), torch.randn(2, 3, 1, 16).to(dtype)
    positions = torch.tensor([[0, 17, 39], [5, 5, 2]])
    cos, sin = tables(rotary_dim, 40, dtype)
    q_in, k_in = q.clone(), k.clone()
    out = rotary_qk(q_in, k_in, cos, sin, positions, layout=layout, kernel="native", inplace=inplace)
    for got, x in zip(out, (q, k)):
        ref = rotate_ref(x, positions, theta=THETA, layout=layout, rotary_dim=rotary_dim)
        assert got.dtype == dtype
        assert bool(((got.double() - ref).abs() <= bound(x, ref)).all())
    if inplace:
        assert out[0] is q_in and out[1] is k_in


@st.composite
def calls(draw: st.DrawFn) -> dict:
    """A random call: shape, dtype, layout, partial rotation, positions, direction, in place or not."""
    head_dim = 2 * draw(st.integers(1, 40))
    pairs = draw(st.integers(1, head_dim // 2))
    return {
        "batch": draw(st.integers(1, 3)),
        "seq": draw(st.integers(1, 9)),
        "q_heads": draw(st.integers(1, 5)),
        "k_heads": draw(st.integers(1, 3)),
        "head_dim": head_dim,
        "rotary_dim": 2 * pairs,
        "dtype": draw(st.sampled_from(DTYPES)),
        "layout": draw(st.sampled_from(["half", "interleaved"])),
        "conjugate": draw(st.booleans()),
        "inplace": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**16)),
    }


@settings(max_examples=150, deadline=None)
@given(calls())
def test_gives_the_pytorch_kernels_bits(call: dict) -> None:
    gen = torch.Generator().manual_seed(call["seed"])
    b, s, d = call["batch"], call["seq"], call["head_dim"]
    q = (torch.randn(b, s, call["q_heads"], d, generator=gen) * 10).to(call["dtype"])
    k = (torch.randn(b, s, call["k_heads"], d, generator=gen) * 10).to(call["dtype"])
    cos, sin = tables(call["rotary_dim"], 50, call["dtype"])
    positions = torch.randint(0, 50, (b, s), generator=gen)
    outs = {}
    for kernel in ("torch", "native"):
        q_in, k_in = q.clone(), k.clone()
        outs[kernel] = rotary_qk(
            q_in,
            k_in,
            cos,
            sin,
            positions,
            layout=call["layout"],
            conjugate=call["conjugate"],
            inplace=call["inplace"],
            kernel=kernel,
        )
    assert torch.equal(outs["torch"][0], outs["native"][0]) and torch.equal(outs["torch"][1], outs["native"][1])


@pytest.mark.parametrize("pairs", [16, 32, 64])
@pytest.mark.parametrize("extra", [0, 6])
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_half_layouts_held_tables_give_the_pytorch_kernels_bits(pairs: int, extra: int, dtype: torch.dtype) -> None:
    """16, 32 and 64 pairs (head_dim 32, 64, 128) take the half layout's own loop: the same bits, both ways."""
    gen = torch.Generator().manual_seed(pairs + extra)
    d = 2 * pairs + extra
    q = (torch.randn(2, 5, 6, d, generator=gen) * 10).to(dtype)
    k = (torch.randn(2, 5, 2, d, generator=gen) * 10).to(dtype)
    cos, sin = tables(2 * pairs, 50, dtype)
    positions = torch.randint(0, 50, (2, 5), generator=gen)
    for conjugate, inplace in ((False, False), (True, False), (False, True)):
        outs = [
            rotary_qk(q.clone(), k.clone(), cos, sin, positions, conjugate=conjugate, inplace=inplace, kernel=kernel)
            for kernel in ("torch", "native")
        ]
        assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


@pytest.mark.parametrize("few", [True, False])
def test_decoding_paths_give_the_same_bits(few: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # The PyTorch kernel rotates a decoding step in list operations (FEW_ELEMENTS) and larger calls
    # block by block; both must give the native kernel's bits.
    from ropelib.kernels import torch_kernel

    monkeypatch.setattr(torch_kernel, "FEW_ELEMENTS", 1 << 30 if few else 0)
    q, k = torch.randn(1, 1, 32, 128), torch.randn(1, 1, 8, 128)
    cos, sin = tables(128, 1001)
    for layout in ("half", "interleaved"):
        want = rotary_qk(q, k, cos, sin, torch.tensor([[1000]]), layout=layout, kernel="native")
        got = rotary_qk(q, k, cos, sin, torch.tensor([[1000]]), layout=layout, kernel="torch")
        assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])


def test_the_thread_split_changes_no_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    q, k = torch.randn(2, 64, 8, 64), torch.randn(2, 64, 2, 64)
    cos, sin = tables(64, 64)
    monkeypatch.setattr(native_kernel, "PARALLEL_ELEMENTS", 1 << 40)  # one thread
    one = rotary_qk(q, k, cos, sin, kernel="native")
    monkeypatch.setattr(native_kernel, "PARALLEL_ELEMENTS", 0)  # torch.get_num_threads() threads
    many = rotary_qk(q, k, cos, sin, kernel="native")
    assert torch.equal(one[0], many[0]) and torch.equal(one[1], many[1])


@LAYOUT
def test_an_output_with_other_strides_than_its_input(layout: str) -> None:
    # The loop reads and writes by each tensor's own strides: a contiguous input rotated into a
    # [B, H, S, D]-ordered output (transposed view) and a strided input into a contiguous output.
    q, k = torch.randn(2, 5, 3, 8), torch.randn(2, 5, 1, 8)
    cos, sin = tables(8, 5)
    positions = torch.arange(5)
    q_out = torch.empty(2, 3, 5, 8).transpose(1, 2)
    k_out = torch.empty(2, 1, 5, 8).transpose(1, 2)
    native_kernel.launch(q, k, q_out, k_out, cos, sin, positions, interleaved=layout == "interleaved", conjugate=False)
    for got, x in ((q_out, q), (k_out, k)):
        ref = rotate_ref(x, positions, theta=THETA, layout=layout)
        assert bool(((got.double() - ref).abs() <= bound(x, ref)).all())
    strided = torch.randn(2, 3, 5, 8).transpose(1, 2)  # [B, S, H, D] with the heads' stride first
    out = torch.empty(2, 5, 3, 8)
    native_kernel.launch(
        strided, k, out, k_out, cos, sin, positions, interleaved=layout == "interleaved", conjugate=False
    )
    ref = rotate_ref(strided, positions, theta=THETA, layout=layout)
    assert bool(((out.double() - ref).abs() <= bound(strided, ref)).all())


@pytest.mark.parametrize("inplace", [False, True])
def test_a_feature_stride_other_than_one(inplace: bool) -> None:
    # The loop reads features at unit stride; the operator hands it a unit-stride copy of a tensor whose
    # features are spaced (every other feature of a buffer), and writes the result back in place.
    buffer, k = torch.randn(1, 4, 2, 16), torch.randn(1, 4, 1, 8)
    q = buffer[..., ::2]
    assert q.stride(-1) == 2
    cos, sin = tables(8, 4)
    want = rotate_ref(q, torch.arange(4), theta=THETA)
    out, _ = rotary_qk(q, k, cos, sin, kernel="native", inplace=inplace)
    assert bool(((out.double() - want).abs() <= bound(q, want)).all())
    if inplace:
        assert torch.equal(buffer[..., ::2], out) and out.data_ptr() == q.data_ptr()


def test_positions_outside_the_table_raise_rather_than_write() -> None:
    # The operators' kernel hands the loop only positions inside its table (rows past it are
    # computed first); the loop itself leaves any other token unwritten and reports it.
    q, k = torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8)
    cos, sin = tables(8, 4)
    with pytest.raises(IndexError, match="outside the table"):
        native_kernel.launch(
            q, k, q.clone(), k.clone(), cos, sin, torch.tensor([0, 4]), interleaved=False, conjugate=False
        )


def test_rows_past_the_table_are_the_rows_a_longer_table_holds() -> None:
    # A position past the cache's rows gets its row computed from the float64 frequencies: the same
    # bits as that row of a table long enough to hold it.
    rope = RotaryEmbedding(16, theta=THETA)
    q, k = torch.randn(1, 1, 4, 16), torch.randn(1, 1, 2, 16)
    tables_ = rope.cache.tables(torch.device("cpu"), torch.float32, 100)
    far = tables_.length + 37
    got = torch.ops.ropelib.rotary(
        q, k, tables_.cos, tables_.sin, torch.tensor([far]), tables_.frequencies, None, False, False, "native"
    )
    long_cos, long_sin = rope.cos_sin(torch.arange(far + 1))
    want = rotary_qk(q, k, long_cos, long_sin, torch.tensor([far]), kernel="native")
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
