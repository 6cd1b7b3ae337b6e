"""``rotary_qkv_``: q and k rotated in place inside one packed QKV buffer, v untouched, nothing copied.

The buffer is ``[batch, seq, Hq + 2 Hk, head_dim]`` (``num_heads_q=Hq``) or ``[batch, seq, 3, heads,
head_dim]``. Expected values: ``rotary_qk`` on clones of q and k (the same operator on contiguous
copies: the same bits), and the float64 rotation matrices of ``tests/references.py``.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ropelib import RotaryEmbedding, rotary_qk, rotary_qkv_
from ropelib.kernels import native_build

from references import EPS, rotate_ref

KERNELS = ["torch", "triton"] + (["native"] if native_build.enabled() else [])
KERNEL = pytest.mark.parametrize("kernel", KERNELS)
LAYOUT = pytest.mark.parametrize("layout", ["half", "interleaved"])
#: (Hq, Hk) of the 4-D form (GQA and MQA) and None for the 5-D [.., 3, heads, ..] form (3 heads each)
FORM = pytest.mark.parametrize("form", [(4, 2), (3, 1), None], ids=["gqa", "mqa", "stacked"])
BATCH, SEQ, HEAD_DIM, TABLE = 2, 5, 16, 16


def make_qkv(form: tuple[int, int] | None, dtype: torch.dtype = torch.float32, seq_first: bool = False) -> torch.Tensor:
    lead = (SEQ, BATCH) if seq_first else (BATCH, SEQ)
    heads = (3, 3) if form is None else (form[0] + 2 * form[1],)
    return torch.randn(*lead, *heads, HEAD_DIM).to(dtype)


def split(qkv: torch.Tensor, form: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Copies of q, k, v, cut by hand from the buffer's documented layout."""
    if form is None:
        return qkv[:, :, 0].clone(), qkv[:, :, 1].clone(), qkv[:, :, 2].clone()
    hq, hk = form
    return qkv[:, :, :hq].clone(), qkv[:, :, hq : hq + hk].clone(), qkv[:, :, hq + hk :].clone()


def heads_of(qkv: torch.Tensor, form: tuple[int, int] | None) -> dict[str, int | None]:
    return {"num_heads_q": None if form is None else form[0]}


def close_to_ref(got: torch.Tensor, x: torch.Tensor, positions: torch.Tensor, layout: str, rotary_dim: int) -> bool:
    # float32 tables (each entry rounded once, 2^-24 relative) and float32 products and sum, then one
    # rounding to the storage dtype: within 8 float32 ulps of max|x| plus half an ulp of the output
    want = rotate_ref(x, positions, layout=layout, rotary_dim=rotary_dim)
    bound = EPS[got.dtype] * want.abs() + 8 * EPS[torch.float32] * x.double().abs().max()
    return bool(((got.double() - want).abs() <= bound).all())


def position_cases() -> list[tuple[str, dict[str, object], torch.Tensor]]:
    """(name, keyword arguments, the positions they mean [batch, seq])."""
    rows = torch.tensor([[3, 0, 15, 7, 7], [1, 2, 3, 4, 5]])
    return [
        ("default", {}, torch.arange(SEQ).expand(BATCH, SEQ)),
        ("seq", {"positions": rows[0]}, rows[0].expand(BATCH, SEQ)),
        ("batch_seq", {"positions": rows}, rows),
        ("int_offset", {"seqlen_offsets": 9}, torch.arange(9, 9 + SEQ).expand(BATCH, SEQ)),
        ("tensor_offsets", {"seqlen_offsets": torch.tensor([0, 11])}, torch.tensor([[0], [11]]) + torch.arange(SEQ)),
    ]


POSITIONS = pytest.mark.parametrize("case", position_cases(), ids=[c[0] for c in position_cases()])


@KERNEL
@FORM
@LAYOUT
@pytest.mark.parametrize("rotary_dim", [HEAD_DIM, 8])  # full and partial rotary
@POSITIONS
def test_equals_rotating_copies(kernel: str, form: tuple[int, int] | None, layout: str, rotary_dim: int, case) -> None:
    _, kwargs, positions = case
    cos, sin = RotaryEmbedding(HEAD_DIM, rotary_dim=rotary_dim).cos_sin_cache(TABLE)
    qkv = make_qkv(form)
    q, k, v = split(qkv, form)
    version, storage = qkv._version, qkv.untyped_storage().data_ptr()
    out = rotary_qkv_(qkv, cos, sin, **heads_of(qkv, form), layout=layout, kernel=kernel, **kwargs)
    assert out is qkv and qkv.untyped_storage().data_ptr() == storage and qkv._version > version
    want_q, want_k = rotary_qk(q, k, cos, sin, layout=layout, kernel=kernel, **kwargs)
    got_q, got_k, got_v = split(qkv, form)
    # the same operator and kernel on contiguous copies: the same float32 expression, the same bits
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert torch.equal(got_v, v)  # the values untouched, bit for bit
    assert close_to_ref(got_q, q, positions, layout, rotary_dim)
    assert close_to_ref(got_k, k, positions, layout, rotary_dim)
    if rotary_dim < HEAD_DIM:  # the tail of each head kept
        assert torch.equal(got_q[..., rotary_dim:], q[..., rotary_dim:])


@KERNEL
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_bits(kernel: str, dtype: torch.dtype) -> None:
    cos, sin = RotaryEmbedding(HEAD_DIM).cos_sin_cache(TABLE)
    qkv = make_qkv((4, 2), dtype)
    q, k, v = split(qkv, (4, 2))
    rotary_qkv_(qkv, cos, sin, num_heads_q=4, kernel=kernel)
    want_q, want_k = rotary_qk(q, k, cos, sin, kernel=kernel)
    got_q, got_k, got_v = split(qkv, (4, 2))
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k) and torch.equal(got_v, v)
    assert close_to_ref(got_q, q, torch.arange(SEQ), "half", HEAD_DIM)


@KERNEL
@FORM
@LAYOUT
def test_seq_first_buffer(kernel: str, form: tuple[int, int] | None, layout: str) -> None:
    # Transformer Engine's [seq, batch, ...] buffer: the same rotation as its batch-first copy
    cos, sin = RotaryEmbedding(HEAD_DIM).cos_sin_cache(TABLE)
    qkv = make_qkv(form, seq_first=True)
    batch_first = qkv.transpose(0, 1).contiguous()
    offsets = torch.tensor([2, 6])
    storage = qkv.untyped_storage().data_ptr()
    out = rotary_qkv_(
        qkv, cos, sin, **heads_of(qkv, form), layout=layout, kernel=kernel, seqlen_offsets=offsets, tensor_format="sbhd"
    )
    rotary_qkv_(batch_first, cos, sin, **heads_of(qkv, form), layout=layout, kernel=kernel, seqlen_offsets=offsets)
    assert out is qkv and qkv.untyped_storage().data_ptr() == storage
    assert torch.equal(qkv.transpose(0, 1), batch_first)


class Ops(TorchDispatchMode):
    """The operators dispatched below autograd."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


@KERNEL
@FORM
def test_no_copies(kernel: str, form: tuple[int, int] | None) -> None:
    cos, sin = RotaryEmbedding(HEAD_DIM).cos_sin_cache(TABLE)
    qkv = make_qkv(form)
    rotary_qkv_(qkv, cos, sin, **heads_of(qkv, form), kernel=kernel)  # a first call (the native kernel's check)
    with Ops() as mode:
        rotary_qkv_(qkv, cos, sin, **heads_of(qkv, form), kernel=kernel)
    # views of the buffer, the default positions, one in-place operator: no clone, copy or cat
    assert set(mode.ops) <= {"aten.slice", "aten.select", "aten.arange", "ropelib.rotary_"}, mode.ops
    assert mode.ops.count("ropelib.rotary_") == 1


def out_of_place(x: torch.Tensor, form: tuple[int, int] | None, cos, sin, kernel: str, layout: str) -> torch.Tensor:
    """The same function without in-place writes: split, rotate copies, concatenate."""
    if form is None:
        q, k, v = x.unbind(2)
        q, k = rotary_qk(q, k, cos, sin, layout=layout, kernel=kernel)
        return torch.stack((q, k, v), 2)
    hq, hk = form
    q, k, v = x.split([hq, hk, hk], 2)
    q, k = rotary_qk(q, k, cos, sin, layout=layout, kernel=kernel)
    return torch.cat((q, k, v), 2)


def in_place(x: torch.Tensor, form: tuple[int, int] | None, cos, sin, kernel: str, layout: str) -> torch.Tensor:
    qkv = x * 1.0  # a non-leaf packed buffer, as a projection's output
    return rotary_qkv_(qkv, cos, sin, num_heads_q=None if form is None else form[0], layout=layout, kernel=kernel)


@KERNEL
@FORM
@LAYOUT
def test_autograd_matches_the_out_of_place_path(kernel: str, form: tuple[int, int] | None, layout: str) -> None:
    cos, sin = RotaryEmbedding(HEAD_DIM, rotary_dim=12).cos_sin_cache(TABLE)
    x = make_qkv(form).requires_grad_()
    weight = torch.randn(x.shape)
    (in_place(x, form, cos, sin, kernel, layout) * weight).sum().backward()
    grad_in_place, x.grad = x.grad, None
    (out_of_place(x, form, cos, sin, kernel, layout) * weight).sum().backward()
    # both backward passes rotate the same incoming gradient by the conjugate rotation, one operator
    # call each: the same float32 expression per element
    assert grad_in_place is not None and x.grad is not None
    assert torch.equal(grad_in_place, x.grad)


@KERNEL
@FORM
def test_gradcheck(kernel: str, form: tuple[int, int] | None) -> None:
    # small, as Triton runs under its interpreter here; with Triton, fast mode (the Jacobian along
    # random directions), since every numerical column is two interpreted calls
    cos, sin = RotaryEmbedding(6, rotary_dim=4).cos_sin_cache(TABLE)
    cos, sin = cos.double(), sin.double()
    x = torch.randn(1, 3, *((3, 3) if form is None else (sum(form) + form[1],)), 6, dtype=torch.float64)
    x.requires_grad_()
    assert torch.autograd.gradcheck(
        lambda t: in_place(t, form, cos, sin, kernel, "interleaved"), (x,), fast_mode=kernel == "triton"
    )


def test_leaf_that_requires_grad_is_refused() -> None:
    cos, sin = RotaryEmbedding(HEAD_DIM).cos_sin_cache(TABLE)
    qkv = make_qkv((4, 2)).requires_grad_()
    with pytest.raises(ValueError, match="leaf tensor that requires grad"):
        rotary_qkv_(qkv, cos, sin, num_heads_q=4)
    with torch.no_grad():  # no autograd: rotated in place as any buffer
        assert rotary_qkv_(qkv, cos, sin, num_heads_q=4) is qkv


COS, SIN = RotaryEmbedding(HEAD_DIM).cos_sin_cache(TABLE)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (
            lambda: rotary_qkv_(make_qkv((4, 2)), COS, SIN, num_heads_q=5),
            ValueError,
            "minus num_heads_q=5 must be 2 Hk",
        ),
        (
            lambda: rotary_qkv_(make_qkv((4, 2)), COS, SIN, num_heads_q=3),
            ValueError,
            "minus num_heads_q=3 must be 2 Hk",
        ),
        (lambda: rotary_qkv_(make_qkv((4, 2)), COS, SIN, num_heads_q=0), ValueError, "num_heads_q must be >= 1"),
        (lambda: rotary_qkv_(make_qkv((4, 2)), COS, SIN, num_heads_q=9), ValueError, "num_heads_q must be <= 6"),
        (lambda: rotary_qkv_(make_qkv((4, 2)), COS, SIN, num_heads_q=4.0), TypeError, "num_heads_q must be an int"),
        (lambda: rotary_qkv_(make_qkv((4, 2)), COS, SIN), ValueError, "needs num_heads_q"),
        (lambda: rotary_qkv_(torch.randn(5, 8, 16), COS, SIN, num_heads_q=4), ValueError, "qkv must be"),
        (lambda: rotary_qkv_(torch.randn(1, 5, 1, 8, 3, 16), COS, SIN), ValueError, "qkv must be"),
        (lambda: rotary_qkv_(make_qkv(None), COS, SIN, num_heads_q=3), ValueError, "num_heads_q is for the"),
        (lambda: rotary_qkv_(torch.randn(2, 5, 4, 2, 16), COS, SIN), ValueError, r"5-D qkv must be \[batch, seq, 3"),
        (lambda: rotary_qkv_(make_qkv((4, 2)).long(), COS, SIN, num_heads_q=4), TypeError, "qkv must be a floating"),
        (lambda: rotary_qkv_([[1.0]], COS, SIN, num_heads_q=4), TypeError, "qkv must be a torch.Tensor"),
        (lambda: rotary_qkv_(make_qkv((4, 2)), COS, SIN, num_heads_q=4, layout="neox"), ValueError, "layout"),
        (lambda: rotary_qkv_(make_qkv((4, 2)), COS[:3], SIN[:3], num_heads_q=4), ValueError, "table has 3 rows"),
        (
            lambda: rotary_qkv_(make_qkv((4, 2)), COS, SIN, num_heads_q=4, tensor_format="thd"),
            ValueError,
            "tensor_format must be one of",
        ),
        (
            lambda: rotary_qkv_(make_qkv((4, 2)), COS, SIN, torch.arange(4), num_heads_q=4),
            ValueError,
            "positions must have shape",
        ),
    ],
)
def test_errors_name_the_argument(call, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        call()
