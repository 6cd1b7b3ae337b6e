"""Positions of packed sequences (ropelib.packing): hand-worked values, a loop reference, validation, compile."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ropelib.kernels import native_build, rotary_qk
from ropelib.packing import check_cu_seqlens, packed_positions
from ropelib.rotary import RotaryEmbedding

from references import rotate_ref


def positions_loop(lengths: list[int]) -> list[int]:
    """The reference: count from 0 in every document, one token at a time."""
    out = []
    for n in lengths:
        for i in range(n):
            out.append(i)
    return out


def cumulative(lengths: list[int]) -> list[int]:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_worked_example(dtype: torch.dtype) -> None:
    # Documents of 3, 0, 5 and 2 tokens.
    cu = torch.tensor([0, 3, 3, 8, 10], dtype=dtype)
    expected = [0, 1, 2, 0, 1, 2, 3, 4, 0, 1]
    for total in (None, 10):
        pos = packed_positions(cu, total_tokens=total)
        assert pos.dtype == torch.int64 and pos.device == cu.device
        assert pos.tolist() == expected


@pytest.mark.parametrize(
    ("cu", "expected"),
    [
        ([0], []),  # no documents
        ([0, 0, 0], []),  # only empty documents
        ([0, 0, 2], [0, 1]),  # an empty document first
        ([0, 2, 2, 2], [0, 1]),  # empty documents last
        ([0, 1, 2, 3], [0, 0, 0]),  # one-token documents
        ([0, 4], [0, 1, 2, 3]),  # one document: 0 .. T-1
    ],
)
def test_empty_and_edge_documents(cu: list[int], expected: list[int]) -> None:
    assert packed_positions(torch.tensor(cu)).tolist() == expected
    assert packed_positions(torch.tensor(cu, dtype=torch.int32), total_tokens=cu[-1]).tolist() == expected


@settings(deadline=None, max_examples=60)
@given(
    lengths=st.lists(st.integers(min_value=0, max_value=12), min_size=0, max_size=10),
    int32=st.booleans(),
    pass_total=st.booleans(),
)
def test_matches_python_loop(lengths: list[int], int32: bool, pass_total: bool) -> None:
    cu = torch.tensor(cumulative(lengths), dtype=torch.int32 if int32 else torch.int64)
    total = sum(lengths) if pass_total else None
    assert packed_positions(cu, total_tokens=total).tolist() == positions_loop(lengths)


def test_rotating_a_packed_row_equals_rotating_each_document() -> None:
    # The point of packed positions: a document's rotation does not depend on what is packed before it.
    lengths = [3, 0, 5, 2]
    rope = RotaryEmbedding(8)
    q, k = torch.randn(1, 10, 2, 8, dtype=torch.float64), torch.randn(1, 10, 1, 8, dtype=torch.float64)
    q2, k2 = rope(q, k, positions=packed_positions(torch.tensor(cumulative(lengths))))
    start = 0
    for n in lengths:
        q_doc, k_doc = rope(q[:, start : start + n], k[:, start : start + n])  # default positions 0 .. n-1
        torch.testing.assert_close(q2[:, start : start + n], q_doc, rtol=0, atol=0)
        torch.testing.assert_close(k2[:, start : start + n], k_doc, rtol=0, atol=0)
        start += n


@pytest.mark.parametrize(
    ("cu", "total", "error", "match"),
    [
        (
            torch.tensor([0, 3, 2, 5]),
            None,
            ValueError,
            r"cu_seqlens must be non-decreasing, got cu_seqlens\[1\] = 3 > cu_seqlens\[2\] = 2",
        ),
        (torch.tensor([1, 3, 5]), None, ValueError, r"cu_seqlens\[0\] must be 0, got 1"),
        (torch.tensor([0, 3, 10]), 12, ValueError, r"cu_seqlens\[-1\] must equal the number of tokens 12, got 10"),
        (torch.tensor([0.0, 3.0]), None, TypeError, r"cu_seqlens must be an integer tensor .* got torch.float32"),
        (torch.tensor([False, True]), None, TypeError, r"cu_seqlens must be an integer tensor .* got torch.bool"),
        (torch.tensor([[0, 3], [3, 5]]), None, ValueError, r"cu_seqlens must be 1-D .* got shape \(2, 2\)"),
        (torch.tensor([], dtype=torch.int64), None, ValueError, r"cu_seqlens must have at least one entry"),
        ([0, 3, 5], None, TypeError, r"cu_seqlens must be an integer torch.Tensor, got list"),
        (torch.tensor([0, 3]), 3.0, TypeError, r"total_tokens must be an int, got float"),
        (torch.tensor([0, 3]), True, TypeError, r"total_tokens must be an int, got bool"),
        (torch.tensor([0, 3]), -1, ValueError, r"total_tokens must be >= 0, got -1"),
    ],
)
def test_bad_input_raises(cu: object, total: object, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        check_cu_seqlens(cu, total)
    with pytest.raises(error, match=match):
        packed_positions(cu, total_tokens=total)  # type: ignore[arg-type]


def test_check_names_the_argument() -> None:
    with pytest.raises(ValueError, match=r"cu_seqlens_k\[0\] must be 0"):
        check_cu_seqlens(torch.tensor([2, 4]), name="cu_seqlens_k")
    cu = torch.tensor([0, 2, 4], dtype=torch.int32)
    assert check_cu_seqlens(cu, 4) is cu


def test_compiles_in_one_graph() -> None:
    def fn(cu: torch.Tensor, n: int) -> torch.Tensor:
        return packed_positions(cu, total_tokens=n)

    cu = torch.tensor([0, 3, 3, 8, 10])
    explained = torch._dynamo.explain(fn)(cu, 10)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
    compiled = torch.compile(fn, fullgraph=True)
    assert compiled(cu, 10).tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 0, 1]
    # A second length makes the size symbolic (automatic dynamic shapes): still one graph, still right.
    lengths = [2, 0, 4, 1, 5]
    cu2 = torch.tensor(cumulative(lengths), dtype=torch.int32)
    assert compiled(cu2, sum(lengths)).tolist() == positions_loop(lengths)


# ----------------------------------------------------------------------------- rotating a packed row


@pytest.mark.parametrize("kernel", ["torch", "triton"] + (["native"] if native_build.enabled() else []))
@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("flat", [True, False])
def test_rotation_of_a_packed_row_restarts_in_each_document(kernel: str, layout: str, flat: bool) -> None:
    # Expected: every document rotated from position 0 by the float64 rotation matrices, one at a time.
    cu = torch.tensor([0, 3, 3, 8, 10], dtype=torch.int32)
    q, k = torch.randn(1, 10, 4, 16), torch.randn(1, 10, 2, 16)
    want_q = torch.cat([rotate_ref(q[:, a:b], torch.arange(b - a), layout=layout, rotary_dim=12) for a, b in
                        zip(cu[:-1].tolist(), cu[1:].tolist())], 1)  # fmt: skip
    want_k = torch.cat([rotate_ref(k[:, a:b], torch.arange(b - a), layout=layout, rotary_dim=12) for a, b in
                        zip(cu[:-1].tolist(), cu[1:].tolist())], 1)  # fmt: skip
    rope = RotaryEmbedding(16, layout=layout, rotary_dim=12, kernel=kernel)
    args = (q[0], k[0]) if flat else (q, k)
    cos, sin = rope.cos_sin_cache(10)
    for got_q, got_k in (
        rope(*args, cu_seqlens=cu),
        rotary_qk(*args, cos[:5], sin[:5], cu_seqlens=cu, layout=layout, kernel=kernel),  # longest document: 5
    ):
        got_q, got_k = (got_q[None], got_k[None]) if flat else (got_q, got_k)
        # float32 rotation of values ~3 with float32 tables: a few ulps (8 * 2^-23 * max|x|)
        assert (got_q.double() - want_q).abs().max() <= 8 * 2**-23 * q.abs().max()
        assert (got_k.double() - want_k).abs().max() <= 8 * 2**-23 * k.abs().max()


def test_packed_rotation_refuses_bad_input() -> None:
    rope = RotaryEmbedding(8)
    q, k = torch.randn(1, 6, 2, 8), torch.randn(1, 6, 1, 8)
    cos, sin = rope.cos_sin_cache(6)
    with pytest.raises(ValueError, match="cu_seqlens\\[-1\\] must equal the number of tokens 6"):
        rope(q, k, cu_seqlens=torch.tensor([0, 2, 5]))
    with pytest.raises(ValueError, match="positions or cu_seqlens, not both"):
        rope(q, k, torch.arange(6), cu_seqlens=torch.tensor([0, 6]))
    with pytest.raises(ValueError, match="one packed row"):
        rope(q.expand(2, 6, 2, 8), k.expand(2, 6, 1, 8), cu_seqlens=torch.tensor([0, 6]))
    with pytest.raises(ValueError, match="non-decreasing"):
        rotary_qk(q, k, cos, sin, cu_seqlens=torch.tensor([0, 4, 2, 6]))
    with pytest.raises(ValueError, match="document lengths must be < 4"):
        rotary_qk(q, k, cos[:3], sin[:3], cu_seqlens=torch.tensor([0, 2, 6]))  # a document of 4 > 3 rows


def test_packed_rotation_compiles_to_one_graph() -> None:
    rope = RotaryEmbedding(8)
    q, k = torch.randn(1, 6, 2, 8), torch.randn(1, 6, 1, 8)
    cu = torch.tensor([0, 2, 6])
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(lambda q, k, cu: rope(q, k, cu_seqlens=cu))(q, k, cu)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, cu: rope(q, k, cu_seqlens=cu), fullgraph=True)
    for got, want in zip(compiled(q, k, cu), rope(q, k, cu_seqlens=cu)):
        torch.testing.assert_close(got, want, rtol=0.0, atol=1e-6)


# ----------------------------------------------------------------------------- sizes at the edge of int64


@pytest.mark.parametrize("end", [2**63 - 1, 2**62, 2**60])
def test_an_end_past_what_int64_positions_can_hold_raises(end: int) -> None:
    # T int64 positions take 8 T bytes, and PyTorch sizes a tensor by a signed 64-bit byte count:
    # T <= (2^63 - 1) // 8 = 2^60 - 1 (by hand). arange(T) past that overflowed in a RuntimeError.
    with pytest.raises(ValueError, match=rf"cu_seqlens\[-1\] = {end} tokens is more than .* {2**60 - 1} tokens"):
        packed_positions(torch.tensor([0, 3, end]))
    with pytest.raises(ValueError, match=rf"total_tokens must be <= {2**60 - 1}, got {end}"):
        packed_positions(torch.tensor([0, 3, end]), total_tokens=end)
    with pytest.raises(ValueError, match=rf"total_tokens must be <= {2**60 - 1}, got {end}"):
        check_cu_seqlens(torch.tensor([0, end]), end)
    # The largest allowed size itself is one PyTorch can make (a meta tensor: no memory).
    limit = 2**60 - 1
    assert packed_positions(torch.tensor([0, limit], device="meta"), total_tokens=limit).shape == (limit,)


def test_packed_rotation_messages_describe_what_was_given() -> None:
    rope = RotaryEmbedding(8)
    q, k = torch.randn(1, 6, 2, 8), torch.randn(1, 6, 1, 8)
    cos, sin = rope.cos_sin_cache(6)
    cu = torch.tensor([0, 2, 6])
    # flash-attn's [tokens, heads, d] beside a [1, tokens, heads, d]: both shapes as given
    for q_in, k_in in ((q[0], k), (q, k[0])):
        with pytest.raises(ValueError, match="must both be") as caught:
            rotary_qk(q_in, k_in, cos, sin, cu_seqlens=cu)
        message = str(caught.value)
        assert f"q of shape {tuple(q_in.shape)}" in message and f"k of shape {tuple(k_in.shape)}" in message
    # a document of 4 tokens needs 4 rows; the table has 3
    with pytest.raises(ValueError, match=r"must be < 4 \(at most the table's 3 rows\), got a document of 4 tokens"):
        rotary_qk(q, k, cos[:3], sin[:3], cu_seqlens=cu)
    got = rotary_qk(q, k, cos[:4], sin[:4], cu_seqlens=cu)  # 4 rows suffice for a document of 4
    for out, x in zip(got, (q, k)):
        want = torch.cat([rotate_ref(x[:, a:b], torch.arange(b - a)) for a, b in ((0, 2), (2, 6))], 1)
        assert (out.double() - want).abs().max() <= 8 * 2**-23 * x.abs().max()
