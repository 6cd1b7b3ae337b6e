"""The fused RoPE kernels (ropelib.kernels) against the float64 rotation-matrix reference of references.py.

Every kernel runs here: the PyTorch kernel, the native C loop (on the CPU), and the Triton kernel
(natively on a GPU, in Triton's interpreter on a CPU, where every program costs milliseconds: the
shapes are tiny, a few dozen programs per launch). Expected values come from
``references.rotate_ref`` (one explicit float64 2x2 rotation per pair and position), never from ropelib.
"""

from __future__ import annotations

import pytest
import torch

from ropelib import RotaryEmbedding, default_device
from ropelib.kernels import choose_kernel, native_build, rotary_qk

from references import EPS, rotate_ref

DEVICE = default_device()
#: The kernels that run on this machine's device: the native C loop is the CPU's.
KERNELS = ["torch", "triton"] + (["native"] if DEVICE.type == "cpu" and native_build.enabled() else [])
KERNEL = pytest.mark.parametrize("kernel", KERNELS)
LAYOUT = pytest.mark.parametrize("layout", ["half", "interleaved"])
THETA = 10000.0


def tables(rotary_dim: int, length: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """The module's cos/sin cache as the kernels take it (input data, not the expected values)."""
    rope = RotaryEmbedding(rotary_dim, theta=THETA)
    if dtype == torch.float64:
        return rope.cos_sin(torch.arange(length), torch.float64)
    cos, sin = rope.cos_sin_cache(length)
    return cos[:length].to(DEVICE), sin[:length].to(DEVICE)


def bound(ref: torch.Tensor, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Allowed ``|out - ref|`` per element: one unit in the last place of the output dtype (its single
    rounding; the interpreter's bfloat16 conversion may truncate instead of rounding to nearest) plus
    8 float32 ulps of the largest input for the float32 tables and products (each of cos, sin and the
    two products and the sum contributes at most half an ulp of a term <= max|x|)."""
    return EPS[dtype] * ref.abs() + 8 * EPS[torch.float32] * x.double().abs().max()


def check(out: torch.Tensor, ref: torch.Tensor, x: torch.Tensor) -> None:
    assert out.dtype == x.dtype and out.shape == x.shape
    err = (out.double().cpu() - ref).abs()
    assert bool((err <= bound(ref, x, x.dtype)).all()), f"max error {err.max().item():.3g}"


# ----------------------------------------------------------------------------- against the reference


@KERNEL
@LAYOUT
@pytest.mark.parametrize("rotary_dim", [16, 8])  # full and partial rotary (head_dim 16)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_float64_reference(kernel: str, layout: str, rotary_dim: int, dtype: torch.dtype) -> None:
    # GQA: 4 query heads, 1 key head (MQA); arbitrary per-batch positions gathered from a 40-row table.
    q = torch.randn(2, 3, 4, 16).to(dtype)
    k = torch.randn(2, 3, 1, 16).to(dtype)
    positions = torch.tensor([[0, 17, 39], [5, 5, 2]])
    cos, sin = tables(rotary_dim, 40)
    q2, k2 = rotary_qk(q.to(DEVICE), k.to(DEVICE), cos, sin, positions, layout=layout, kernel=kernel)
    for out, x in ((q2, q), (k2, k)):
        check(out, rotate_ref(x, positions, theta=THETA, layout=layout, rotary_dim=rotary_dim), x)


@KERNEL
@pytest.mark.parametrize("positions", [None, "seq", "batch"])
def test_position_forms(kernel: str, positions: str | None) -> None:
    q, k = torch.randn(2, 4, 2, 8), torch.randn(2, 4, 2, 8)
    pos = {None: None, "seq": torch.tensor([3, 0, 63, 9]), "batch": torch.tensor([[1, 2, 3, 4], [60, 0, 61, 7]])}[
        positions
    ]
    cos, sin = tables(8, 64)
    q2, k2 = rotary_qk(q.to(DEVICE), k.to(DEVICE), cos, sin, pos, kernel=kernel)
    expected_pos = torch.arange(4) if pos is None else pos
    check(q2, rotate_ref(q, expected_pos, theta=THETA), q)
    check(k2, rotate_ref(k, expected_pos, theta=THETA), k)


@KERNEL
@LAYOUT
def test_in_place_equals_out_of_place(kernel: str, layout: str) -> None:
    q, k = torch.randn(1, 3, 2, 8, device=DEVICE), torch.randn(1, 3, 1, 8, device=DEVICE)
    cos, sin = tables(6, 8)  # partial rotary: the tail must stay untouched in place too
    expected = rotary_qk(q, k, cos, sin, layout=layout, kernel=kernel)
    q_in, k_in = q.clone(), k.clone()
    out = rotary_qk(q_in, k_in, cos, sin, layout=layout, kernel=kernel, inplace=True)
    assert out[0] is q_in and out[1] is k_in
    # Same arithmetic, same rounding: identical bits.
    assert torch.equal(q_in, expected[0]) and torch.equal(k_in, expected[1])


@KERNEL
@LAYOUT
def test_conjugate_undoes_the_rotation(kernel: str, layout: str) -> None:
    q, k = torch.randn(2, 3, 2, 8, dtype=torch.float64), torch.randn(2, 3, 2, 8, dtype=torch.float64)
    cos, sin = tables(8, 16, torch.float64)
    pos = torch.tensor([[1, 9, 15], [0, 4, 4]])
    q2, k2 = rotary_qk(q.to(DEVICE), k.to(DEVICE), cos.to(DEVICE), sin.to(DEVICE), pos, layout=layout, kernel=kernel)
    q3, k3 = rotary_qk(q2, k2, cos.to(DEVICE), sin.to(DEVICE), pos, layout=layout, kernel=kernel, conjugate=True)
    # R(-theta) R(theta) = I up to float64 rounding of a few products (|x| < 6): 1e-12 is ample.
    torch.testing.assert_close(q3.cpu(), q, rtol=0, atol=1e-12)
    torch.testing.assert_close(k3.cpu(), k, rtol=0, atol=1e-12)


@KERNEL
def test_strided_inputs(kernel: str) -> None:
    # q as it comes out of a [batch, heads, seq, d] projection transposed: unit stride on d only.
    q = torch.randn(2, 3, 5, 8).transpose(1, 2)
    k = torch.randn(2, 5, 6, 16)[..., 4:12]
    cos, sin = tables(8, 5)
    q2, k2 = rotary_qk(q.to(DEVICE), k.to(DEVICE), cos, sin, kernel=kernel)
    check(q2, rotate_ref(q, torch.arange(5), theta=THETA), q)
    check(k2, rotate_ref(k, torch.arange(5), theta=THETA), k)


# ----------------------------------------------------------------------------- autograd and compile


@KERNEL
@LAYOUT
def test_gradcheck(kernel: str, layout: str) -> None:
    cos, sin = tables(4, 8, torch.float64)
    cos, sin = cos.to(DEVICE), sin.to(DEVICE)
    q = torch.randn(1, 2, 2, 6, dtype=torch.float64, device=DEVICE, requires_grad=True)
    k = torch.randn(1, 2, 1, 6, dtype=torch.float64, device=DEVICE, requires_grad=True)
    pos = torch.tensor([[3, 7]])

    def f(q, k):
        return rotary_qk(q, k, cos, sin, pos, layout=layout, kernel=kernel)

    assert torch.autograd.gradcheck(f, (q, k), fast_mode=True)
    if kernel == "torch":  # the backward is the same operator, so it is differentiable too
        assert torch.autograd.gradgradcheck(f, (q, k), fast_mode=True)


@LAYOUT
def test_backward_is_the_inverse_rotation(layout: str) -> None:
    # d<g, R x>/dx = R^T g = R(-theta) g: compare with the reference at negated positions.
    q = torch.randn(1, 3, 2, 8, requires_grad=True)
    k = torch.randn(1, 3, 1, 8, requires_grad=True)
    g_q, g_k = torch.randn(1, 3, 2, 8), torch.randn(1, 3, 1, 8)
    cos, sin = tables(8, 8)
    pos = torch.tensor([2, 5, 7])
    q2, k2 = rotary_qk(q, k, cos, sin, pos, layout=layout, kernel="torch")
    dq, dk = torch.autograd.grad((q2, k2), (q, k), (g_q, g_k))
    check(dq, rotate_ref(g_q, -pos, theta=THETA, layout=layout), g_q)
    check(dk, rotate_ref(g_k, -pos, theta=THETA, layout=layout), g_k)


@KERNEL
def test_torch_compile_traces_without_graph_break(kernel: str) -> None:
    rope = RotaryEmbedding(8, kernel=kernel)
    q = torch.randn(1, 4, 2, 8, device=DEVICE, requires_grad=True)
    k = torch.randn(1, 4, 1, 8, device=DEVICE)

    def loss(q, k):
        q2, k2 = rope(q, k)
        return (q2 * 2).sum() + k2.square().sum()

    # fullgraph=True raises on any graph break; aot_eager traces the fake and autograd registrations.
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    value = compiled(q, k)
    (grad,) = torch.autograd.grad(value, q)
    expected = rotate_ref(q.detach().cpu(), torch.arange(4), theta=THETA)
    # loss = 2 sum(R q) + |R k|^2: float32 sums of 64 terms, 1e-4 relative is generous.
    torch.testing.assert_close(
        value.double().cpu(), 2 * expected.sum() + k.double().cpu().square().sum(), rtol=1e-4, atol=1e-4
    )
    # d/dq 2 sum(R q) = 2 R^T 1.
    ones = torch.ones(1, 4, 2, 8)
    torch.testing.assert_close(
        grad.double().cpu(), 2 * rotate_ref(ones, -torch.arange(4), theta=THETA), rtol=0, atol=1e-5
    )


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("frequencies", [False, True])
def test_operator_registrations_are_consistent(inplace: bool, frequencies: bool) -> None:
    # torch.library.opcheck: schema (with what it mutates), fake function, autograd registration and
    # AOT dispatch agree with the kernel, for both operators, with and without rows past the table.
    cos, sin = tables(8, 8)
    rope = RotaryEmbedding(8, theta=THETA)
    freq = rope.cache.tables(cos.device, torch.float32).frequencies if frequencies else None
    positions = torch.tensor([0, 1, 20 if frequencies else 2], device=DEVICE)
    q = torch.randn(1, 3, 2, 8, device=DEVICE)
    q = q.requires_grad_() if not inplace else q
    args = (q, torch.randn(1, 3, 1, 8, device=DEVICE), cos, sin, positions, freq, None, False, False, "auto")
    op = torch.ops.ropelib.rotary_.default if inplace else torch.ops.ropelib.rotary.default
    torch.library.opcheck(op, args)


# ----------------------------------------------------------------------------- the module's kernels


@pytest.mark.parametrize("kernel", ["auto", *KERNELS])
@LAYOUT
def test_rotary_embedding_kernels(kernel: str, layout: str) -> None:
    rope = RotaryEmbedding(8, layout=layout, rotary_dim=6, kernel=kernel)
    q, k = torch.randn(2, 3, 4, 8), torch.randn(2, 3, 2, 8)
    pos = torch.tensor([[0, 30, 2], [7, 7, 1]])
    q2, k2 = rope(q.to(DEVICE), k.to(DEVICE), pos)
    check(q2, rotate_ref(q, pos, theta=THETA, layout=layout, rotary_dim=6), q)
    check(k2, rotate_ref(k, pos, theta=THETA, layout=layout, rotary_dim=6), k)


def test_choose_kernel() -> None:
    assert choose_kernel("auto", torch.device("cpu")) == ("native" if native_build.enabled() else "torch")
    assert choose_kernel("auto", "cpu", torch.int8 if False else torch.float64) in ("native", "torch")
    assert choose_kernel("auto", torch.device("cuda")) == "triton"
    assert choose_kernel("triton", torch.device("cpu")) == "triton"  # forced: the interpreter
    assert choose_kernel("torch", "cuda") == "torch"
    with pytest.raises(RuntimeError, match="does not run"):
        choose_kernel("native", torch.device("cuda"))  # a C loop for the CPU only
    with pytest.raises(ValueError, match="kernel must be one of"):
        choose_kernel("cuda", torch.device("cpu"))
    with pytest.raises(TypeError, match="dtype must be a torch.dtype"):
        choose_kernel("auto", "cpu", "float32")  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- validation


def test_rejects_bad_arguments() -> None:
    q, k = torch.randn(1, 3, 2, 8), torch.randn(1, 3, 1, 8)
    cos, sin = tables(8, 4)
    with pytest.raises(TypeError, match="cos and sin must be torch.float32"):
        rotary_qk(q, k, cos.double(), sin.double())
    with pytest.raises(ValueError, match="positions must be < 4"):
        rotary_qk(q, k, cos, sin, torch.tensor([0, 1, 4]))
    with pytest.raises(TypeError, match="positions must be an integer"):
        rotary_qk(q, k, cos, sin, torch.tensor([0.0, 1.0, 2.0]))
    with pytest.raises(ValueError, match="share \\[batch, seq\\] and head_dim"):
        rotary_qk(q, torch.randn(1, 2, 1, 8), cos, sin)
    with pytest.raises(ValueError, match="head_dim"):
        rotary_qk(torch.randn(1, 3, 2, 6), torch.randn(1, 3, 1, 6), cos, sin)
    with pytest.raises(ValueError, match="inplace=True does not support autograd"):
        rotary_qk(q.requires_grad_(), k, cos, sin, inplace=True)
    with pytest.raises(ValueError, match="layout"):
        rotary_qk(q, k, cos, sin, layout="neox")
    with pytest.raises(ValueError, match="seq_len is 3"):
        rotary_qk(q, k, cos[:2], sin[:2])


# ----------------------------------------------------------------------------- regressions: silently wrong before


@KERNEL
def test_non_contiguous_tables_are_read_by_their_strides(kernel: str) -> None:
    # The Triton kernel used to assume contiguous tables and cos's row stride for sin: sliced or
    # column-strided tables gave errors of 1.4 and 4.6. The expected values are the rotation matrices.
    q, k = torch.randn(1, 4, 2, 8), torch.randn(1, 4, 1, 8)
    cos, sin = tables(8, 4)
    wide_cos = torch.cat([cos, cos], -1)[:, :4]  # row stride 8, unit column stride
    strided_cos, strided_sin = torch.stack([cos, cos], -1).flatten(-2)[:, ::2], sin.repeat_interleave(2, -1)[:, ::2]
    for c, s in ((wide_cos, sin), (strided_cos, strided_sin), (cos, torch.cat([sin, sin], -1)[:, :4])):
        q2, k2 = rotary_qk(q, k, c, s, kernel=kernel)
        check(q2, rotate_ref(q, torch.arange(4), theta=THETA), q)
        check(k2, rotate_ref(k, torch.arange(4), theta=THETA), k)


@KERNEL
def test_in_place_refuses_aliased_or_overlapping_q_and_k(kernel: str) -> None:
    # The same tensor as q and k used to be rotated twice; an expanded (stride-0) q was written
    # through overlapping memory by the Triton kernel.
    cos, sin = tables(8, 4)
    x = torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match="q and k in separate memory"):
        rotary_qk(x, x, cos, sin, inplace=True, kernel=kernel)
    with pytest.raises(ValueError, match="q and k in separate memory"):
        rotary_qk(x[:, :, :2], x[:, :, 1:], cos, sin, inplace=True, kernel=kernel)  # head 1 in both
    expanded = torch.randn(1, 4, 1, 8).expand(1, 4, 3, 8)
    with pytest.raises(ValueError, match="q whose elements do not share memory"):
        rotary_qk(expanded, torch.randn(1, 4, 1, 8), cos, sin, inplace=True, kernel=kernel)
    # separate halves of one buffer do not overlap: allowed, and rotated once each
    buf = torch.randn(1, 4, 2, 8)
    want_q = rotate_ref(buf[:, :, :1], torch.arange(4), theta=THETA)
    want_k = rotate_ref(buf[:, :, 1:], torch.arange(4), theta=THETA)
    q_view, k_view = buf[:, :, :1], buf[:, :, 1:]
    rotary_qk(q_view, k_view, cos, sin, inplace=True, kernel=kernel)
    check(q_view, want_q, q_view)
    check(k_view, want_k, k_view)


@KERNEL
def test_out_of_range_positions_never_give_numbers_under_compile(kernel: str) -> None:
    # Compiled, the torch kernel used to wrap -1 to the last row. Now a queued check raises
    # (RuntimeError: the device-side assertion of ropelib._validation) with the message.
    cos, sin = tables(8, 4)
    q, k = torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8)
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, p: rotary_qk(q, k, cos, sin, p, kernel=kernel), fullgraph=True)
    torch.testing.assert_close(compiled(q, k, torch.tensor([0, 3])), rotary_qk(q, k, cos, sin, torch.tensor([0, 3])))
    for bad in ([0, -1], [0, 4]):
        with pytest.raises(RuntimeError, match=r"positions must be in \[0, 4\)"):
            compiled(q, k, torch.tensor(bad))
    with pytest.raises(ValueError, match="positions must be >= 0"):  # eager on the CPU: a ValueError
        rotary_qk(q, k, cos, sin, torch.tensor([0, -1]), kernel=kernel)


@LAYOUT
@pytest.mark.parametrize("few", [True, False])
@pytest.mark.parametrize("rotary_dim", [16, 12])
@pytest.mark.parametrize("positions", [[[0, 3, 39, 7, 7], [1, 2, 3, 4, 5]], [[39]], [[0], [17]]])
def test_torch_kernel_paths_for_few_and_many_tokens(
    layout: str, few: bool, rotary_dim: int, positions: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The PyTorch kernel rotates a few tokens (decoding) in four list operations and many with
    # whole-tensor ones; both against the rotation matrices, in place and out of place, partial
    # rotary, one token (a decoding step), one token per row and several.
    import ropelib.kernels.torch_kernel as torch_kernel

    monkeypatch.setattr(torch_kernel, "FEW_ELEMENTS", 1 << 30 if few else 0)
    pos = torch.tensor(positions)
    q, k = torch.randn(*pos.shape, 4, 16), torch.randn(*pos.shape, 2, 16)
    cos, sin = tables(rotary_dim, 40)
    positions = pos
    q2, k2 = rotary_qk(q, k, cos, sin, positions, layout=layout, kernel="torch")
    check(q2, rotate_ref(q, positions, theta=THETA, layout=layout, rotary_dim=rotary_dim), q)
    check(k2, rotate_ref(k, positions, theta=THETA, layout=layout, rotary_dim=rotary_dim), k)
    back_q, back_k = rotary_qk(q2, k2, cos, sin, positions, layout=layout, kernel="torch", conjugate=True)
    torch.testing.assert_close(back_q, q, rtol=0, atol=1e-5)  # R(-t) R(t) = I: a few float32 ulps of |x| <= 5
    torch.testing.assert_close(back_k, k, rtol=0, atol=1e-5)
    qi, ki = q.clone(), k.clone()
    rotary_qk(qi, ki, cos, sin, positions, layout=layout, kernel="torch", inplace=True)
    assert torch.equal(qi, q2) and torch.equal(ki, k2)


def test_few_token_rows_follow_the_tables() -> None:
    # The few-token path keeps the rows of the last one-position call (a decoding step's layers share
    # them); a table changed in place, another table or another position must not get stale rows.
    q, k = torch.randn(1, 1, 4, 16), torch.randn(1, 1, 2, 16)
    cos, sin = tables(16, 40)
    cos, sin = cos.clone(), sin.clone()
    position = torch.tensor([[7]])
    first = rotary_qk(q, k, cos, sin, position, kernel="torch")
    check(first[0], rotate_ref(q, position, theta=THETA), q)
    torch.testing.assert_close(rotary_qk(q, k, cos, sin, position, kernel="torch"), first, rtol=0, atol=0)
    check(
        rotary_qk(q, k, cos, sin, torch.tensor([[8]]), kernel="torch")[0],
        rotate_ref(q, torch.tensor([[8]]), theta=THETA),
        q,
    )
    cos.mul_(0.0)  # every pair's cosine gone: only the sine terms are left
    sin_only = rotary_qk(q, k, cos, sin, position, kernel="torch")[0]
    half = q.shape[-1] // 2
    expected = torch.cat((-q[..., half:] * sin[7], q[..., :half] * sin[7]), -1)
    torch.testing.assert_close(sin_only, expected, rtol=0, atol=1e-6)
    other_cos, other_sin = tables(16, 40)
    check(rotary_qk(q, k, other_cos, other_sin, position, kernel="torch")[0], rotate_ref(q, position, theta=THETA), q)


def test_few_token_rows_of_inference_tables() -> None:
    # Tables made under torch.inference_mode have no version counter: the one-position rows are then
    # made afresh at each call, never kept, and still right.
    q, k = torch.randn(1, 1, 4, 16), torch.randn(1, 1, 2, 16)
    with torch.inference_mode():
        cos, sin = (t.clone() for t in tables(16, 40))
    position = torch.tensor([[7]])
    for _ in range(2):
        check(rotary_qk(q, k, cos, sin, position, kernel="torch")[0], rotate_ref(q, position, theta=THETA), q)


@KERNEL
@pytest.mark.parametrize("empty", ["q", "k"])
def test_a_tensor_with_no_heads_leaves_the_other_out_of_place(kernel: str, empty: str) -> None:
    # An empty q (or k) and its fresh output share address 0: the kernel must not take the call for an
    # in-place one and skip the copy of the other tensor's unrotated features (rotary_dim < head_dim).
    positions = torch.arange(5)
    cos, sin = RotaryEmbedding(16, rotary_dim=10).cos_sin_cache(8)
    full = torch.randn(2, 5, 3, 16, generator=torch.Generator().manual_seed(4))
    none = full[:, :, :0]
    q, k = (none, full) if empty == "q" else (full, none)
    q_out, k_out = rotary_qk(q, k, cos, sin, positions, kernel=kernel)
    rotated = q_out if empty == "k" else k_out
    want = rotate_ref(full, positions, rotary_dim=10)
    # float32 rotation of values ~3: a few float32 ulps; the tail (features 10..15) is a copy, exact
    assert torch.allclose(rotated.double(), want, rtol=0, atol=8 * EPS[torch.float32] * full.abs().max().item())
    assert torch.equal(rotated[..., 10:], full[..., 10:])
