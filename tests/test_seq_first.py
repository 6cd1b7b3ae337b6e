"""``rotary_qk(..., tensor_format="sbhd")``: Transformer Engine's ``[seq, batch, heads, head_dim]`` tensors.

The expected values are the batch-first call on ``transpose(0, 1)`` of the same tensors (the
positions keep their shapes: ``[seq]``, ``[1, seq]``, ``[batch, seq]``), and the float64
rotation matrices of ``tests/references.py``.
"""

from __future__ import annotations

import pytest
import torch

from ropelib import RotaryEmbedding, rotary_qk
from ropelib.kernels import native_build

from references import EPS, rotate_ref

KERNEL = pytest.mark.parametrize("kernel", ["torch", "triton"] + (["native"] if native_build.enabled() else []))
LAYOUT = pytest.mark.parametrize("layout", ["half", "interleaved"])
SEQ, BATCH, HEAD_DIM = 5, 3, 8
COS, SIN = RotaryEmbedding(HEAD_DIM).cos_sin_cache(32)
ROWS = torch.tensor([[4, 0, 31, 2, 2], [1, 2, 3, 4, 5], [9, 8, 7, 6, 5]])
#: (name, keyword arguments, the positions they mean, [batch, seq])
CASES = [
    ("default", {}, torch.arange(SEQ).expand(BATCH, SEQ)),
    ("seq", {"positions": ROWS[0]}, ROWS[0].expand(BATCH, SEQ)),
    ("one_seq", {"positions": ROWS[:1]}, ROWS[0].expand(BATCH, SEQ)),
    ("batch_seq", {"positions": ROWS}, ROWS),
    ("int_offset", {"seqlen_offsets": 20}, torch.arange(20, 20 + SEQ).expand(BATCH, SEQ)),
    (
        "tensor_offsets",
        {"seqlen_offsets": torch.tensor([0, 3, 27])},
        torch.tensor([[0], [3], [27]]) + torch.arange(SEQ),
    ),
]
POSITIONS = pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])


def seq_first(heads: int) -> torch.Tensor:
    return torch.randn(SEQ, BATCH, heads, HEAD_DIM)


@KERNEL
@LAYOUT
@POSITIONS
def test_equals_the_batch_first_call(kernel: str, layout: str, case) -> None:
    _, kwargs, positions = case
    q, k = seq_first(4), seq_first(2)
    got_q, got_k = rotary_qk(q, k, COS, SIN, layout=layout, kernel=kernel, tensor_format="sbhd", **kwargs)
    want_q, want_k = rotary_qk(
        q.transpose(0, 1).contiguous(), k.transpose(0, 1).contiguous(), COS, SIN, layout=layout, kernel=kernel, **kwargs
    )
    assert got_q.shape == q.shape and got_k.shape == k.shape  # the outputs keep the inputs' format
    # the same operator on the same values, read through other strides: the same bits
    assert torch.equal(got_q.transpose(0, 1), want_q) and torch.equal(got_k.transpose(0, 1), want_k)
    # float32 tables and products: within 8 float32 ulps of max|q| of the float64 rotation
    want = rotate_ref(q.transpose(0, 1), positions, layout=layout)
    assert (got_q.transpose(0, 1).double() - want).abs().max() <= 8 * EPS[torch.float32] * q.abs().max()


@KERNEL
@LAYOUT
@POSITIONS
def test_in_place(kernel: str, layout: str, case) -> None:
    _, kwargs, _ = case
    q, k = seq_first(4), seq_first(2)
    want_q, want_k = rotary_qk(q, k, COS, SIN, layout=layout, kernel=kernel, tensor_format="sbhd", **kwargs)
    versions = q._version, k._version
    out = rotary_qk(q, k, COS, SIN, layout=layout, kernel=kernel, tensor_format="sbhd", inplace=True, **kwargs)
    assert out[0] is q and out[1] is k  # the tensors given, in their format
    assert q._version > versions[0] and k._version > versions[1]
    assert torch.equal(q, want_q) and torch.equal(k, want_k)


@KERNEL
def test_views_of_a_seq_first_projection(kernel: str) -> None:
    # q and k as heads of one contiguous [seq, batch, Hq + 2 Hk, d] buffer: rotated where they lie
    qkv = torch.randn(SEQ, BATCH, 4 + 2 * 2, HEAD_DIM)
    q, k, v = qkv[:, :, :4], qkv[:, :, 4:6], qkv[:, :, 6:]
    want_q, want_k = rotary_qk(q.clone(), k.clone(), COS, SIN, kernel=kernel, tensor_format="sbhd")
    kept = v.clone()
    rotary_qk(q, k, COS, SIN, kernel=kernel, tensor_format="sbhd", inplace=True)
    assert torch.equal(q, want_q) and torch.equal(k, want_k) and torch.equal(v, kept)


def test_autograd_in_the_seq_first_format() -> None:
    q = seq_first(2).double().requires_grad_()
    k = seq_first(1).double().requires_grad_()
    cos, sin = COS.double(), SIN.double()
    assert torch.autograd.gradcheck(lambda a, b: rotary_qk(a, b, cos, sin, tensor_format="sbhd"), (q, k))


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: rotary_qk(seq_first(2), seq_first(1), COS, SIN, tensor_format="bhsd"), ValueError, "tensor_format"),
        (lambda: rotary_qk(seq_first(2), seq_first(1), COS, SIN, tensor_format=None), TypeError, "tensor_format"),
        (
            lambda: rotary_qk(
                seq_first(2), seq_first(1), COS, SIN, tensor_format="sbhd", cu_seqlens=torch.tensor([0, 2, 5])
            ),
            ValueError,
            "cu_seqlens takes packed rows",
        ),
        (
            lambda: rotary_qk(seq_first(2), seq_first(1)[:4], COS, SIN, tensor_format="sbhd"),
            ValueError,
            r"must share \[seq, batch\]",
        ),
        (
            lambda: rotary_qk(seq_first(2), seq_first(1)[:, :2], COS, SIN, tensor_format="sbhd"),
            ValueError,
            r"must share \[seq, batch\]",
        ),
        (
            lambda: rotary_qk(seq_first(2), torch.randn(SEQ, BATCH, 1, 6), COS, SIN, tensor_format="sbhd"),
            ValueError,
            "head_dim",
        ),
        (
            lambda: rotary_qk(seq_first(2)[0], seq_first(1)[0], COS, SIN, tensor_format="sbhd"),
            ValueError,
            "q must have 4 dimensions",
        ),
        (  # positions keep the batch-first shapes: [seq], not [seq, batch]
            lambda: rotary_qk(seq_first(2), seq_first(1), COS, SIN, ROWS.T, tensor_format="sbhd"),
            ValueError,
            r"positions must have shape \[5\]",
        ),
        (
            lambda: rotary_qk(
                seq_first(2), seq_first(1), COS, SIN, seqlen_offsets=torch.tensor([1]), tensor_format="sbhd"
            ),
            ValueError,
            r"seqlen_offsets must be an int or an integer tensor of shape \[batch\] = \[3\]",
        ),
        (
            lambda: rotary_qk(seq_first(2), seq_first(1), COS[:4], SIN[:4], tensor_format="sbhd"),
            ValueError,
            "table has 4 rows but seq_len is 5",
        ),
    ],
)
def test_errors_name_the_argument(call, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        call()
