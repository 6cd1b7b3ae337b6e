"""KERPLE (Chi et al., 2022): the two kernels against the paper's formulas by loops, their conditional
positive definiteness, ALiBi as the power kernel at r2 = 1, attention, flex, gradients, errors.

Expected values: ``-r1 log(1 + r2 |i - j|)`` and ``-r1 |i - j|^r2`` per entry in Python floats, with
``r1, r2`` computed here from the raw parameters (softplus, 2 sigmoid) by ``math``; ALiBi's slopes
written out (Press et al., 2022: 2^-2, 2^-4, 2^-6, 2^-8 for four heads).
"""

from __future__ import annotations

import math

import pytest
import torch

from ropelib import MultiHeadAttention, relative_positions
from ropelib.encodings.flex import flex_bias_attention
from ropelib.encodings.kerple import KerpleBias, kerple_kernel, kerple_score_mod

from bias_references import biased_scores, output_ref, sigmoid_ref, softplus_ref
from hot_path import graph_breaks
from references import attention_ref

# float64 module vs float64 loops: a handful of operations per entry (log1p or pow); 1e-12 is
# thousands of ulps of margin for values of order 1-10, far below any wrong formula.
TIGHT64 = dict(rtol=0.0, atol=1e-12)
FOUR_HEAD_SLOPES = [2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8]


def params_ref(kerple: KerpleBias) -> list[tuple[float, float]]:
    raw1, raw2 = kerple.raw_r1.tolist(), kerple.raw_r2.tolist()
    if kerple.kind == "power":
        return [(softplus_ref(a), 2.0 * sigmoid_ref(b)) for a, b in zip(raw1, raw2)]
    return [(softplus_ref(a), softplus_ref(b)) for a, b in zip(raw1, raw2)]


def kerple_ref(kerple: KerpleBias, query_len: int, key_len: int) -> torch.Tensor:
    """``[heads, q, k]`` from the paper's formulas, one entry at a time."""
    rows = []
    for r1, r2 in params_ref(kerple):
        if kerple.kind == "log":
            rows.append([[-r1 * math.log(1 + r2 * abs(i - j)) for j in range(key_len)] for i in range(query_len)])
        else:
            rows.append([[-r1 * abs(i - j) ** r2 for j in range(key_len)] for i in range(query_len)])
    return torch.tensor(rows, dtype=torch.float64)


def randomised(kind: str, heads: int = 4, seed: int = 0) -> KerpleBias:
    torch.manual_seed(seed)
    kerple = KerpleBias(heads, kind).double()
    with torch.no_grad():
        kerple.raw_r1.normal_(0.0, 1.5)
        kerple.raw_r2.normal_(0.0, 1.5)
    return kerple


@pytest.mark.parametrize("kind", ["log", "power"])
def test_bias_matches_the_paper_formula(kind: str) -> None:
    kerple = randomised(kind)
    rel = relative_positions(5, 9, offset=4)  # keys 0..8, queries 4..8
    want = kerple_ref(kerple, 9, 9)[:, 4:]
    torch.testing.assert_close(kerple(rel), want, **TIGHT64)
    batched = torch.stack([rel, rel + 1])  # [batch, q, k] -> [batch, heads, q, k]
    torch.testing.assert_close(kerple(batched)[0], want, **TIGHT64)


def test_initial_kernels_start_at_alibi() -> None:
    # Power kernel: r1 = ALiBi's slopes, r2 = 1, so the bias is ALiBi's -m |i - j| (float32 params:
    # the slopes are powers of two and softplus's inverse round-trips them to ~1 ulp, hence 1e-6 relative).
    power = KerpleBias(4, "power").double()
    alibi = torch.tensor(
        [[[-m * abs(i - j) for j in range(6)] for i in range(6)] for m in FOUR_HEAD_SLOPES], dtype=torch.float64
    )
    torch.testing.assert_close(power(relative_positions(6)), alibi, rtol=1e-6, atol=0.0)
    # Log kernel: r1 = 1, r2 = the slopes: the same slope at the diagonal, d/dd -log(1 + m d) = -m at d = 0.
    log = KerpleBias(4, "log").double()
    torch.testing.assert_close(log.r1, torch.ones(4, dtype=torch.float64), rtol=1e-6, atol=0.0)
    torch.testing.assert_close(log.r2, torch.tensor(FOUR_HEAD_SLOPES, dtype=torch.float64), rtol=1e-6, atol=0.0)


def test_alibi_is_the_power_kernel_at_r2_one() -> None:
    # Any slope: set r1 = m (raw = softplus^-1(m)) and r2 = 1 (raw = logit(1/2) = 0).
    slopes = [0.7, 0.3, 0.05]
    kerple = KerpleBias(3, "power").double()
    with torch.no_grad():
        kerple.raw_r1.copy_(torch.tensor([math.log(math.expm1(m)) for m in slopes], dtype=torch.float64))
        kerple.raw_r2.zero_()
    want = torch.tensor([[[-m * abs(i - j) for j in range(7)] for i in range(7)] for m in slopes], dtype=torch.float64)
    torch.testing.assert_close(kerple(relative_positions(7)), want, **TIGHT64)


def cpd_floor(bias: torch.Tensor) -> float:
    """min over ``x`` with ``sum x = 0``, ``|x| = 1`` of ``x^T B x``: the least eigenvalue of ``P B P`` on ``1^perp``."""
    n = bias.shape[-1]
    basis = torch.linalg.qr(torch.eye(n, dtype=torch.float64) - 1.0 / n)[0][:, : n - 1]  # orthonormal, 1^perp
    return float(torch.linalg.eigvalsh(basis.T @ bias.detach() @ basis).min())


@pytest.mark.parametrize("kind", ["log", "power"])
def test_bias_is_conditionally_positive_definite(kind: str) -> None:
    # The paper's property: sum_ij c_i c_j b_ij >= 0 whenever sum_i c_i = 0, for every head's r1, r2 in range.
    # Tolerance: eigenvalues of a 24x24 float64 matrix with entries up to ~50 are exact to ~1e-12.
    kerple = randomised(kind, heads=8, seed=3)
    for head in kerple(relative_positions(24)):
        assert cpd_floor(head) >= -1e-10
    torch.manual_seed(1)
    x = torch.randn(200, 24, dtype=torch.float64)
    x = x - x.mean(-1, keepdim=True)  # sum x = 0
    quad = torch.einsum("ni,hij,nj->hn", x, kerple(relative_positions(24)), x)
    assert bool((quad >= -1e-10).all())


def test_power_kernel_beyond_two_is_not_cpd() -> None:
    # Why r2 <= 2: -|i - j|^3 has a direction in 1^perp with x^T B x < 0 (so the range is needed, not decorative).
    distance = relative_positions(8).abs().double()
    bias = kerple_kernel(
        distance, torch.tensor(1.0, dtype=torch.float64), torch.tensor(3.0, dtype=torch.float64), "power"
    )
    assert cpd_floor(bias) < -1.0
    inside = kerple_kernel(
        distance, torch.tensor(1.0, dtype=torch.float64), torch.tensor(2.0, dtype=torch.float64), "power"
    )
    assert cpd_floor(inside) >= -1e-10  # r2 = 2: -(i - j)^2 is CPD (rank 2, null on 1^perp up to sign)


def test_parameters_stay_in_range() -> None:
    power = KerpleBias(3, "power").double()
    with torch.no_grad():
        power.raw_r1.copy_(torch.tensor([-30.0, 0.0, 30.0]))
        power.raw_r2.copy_(torch.tensor([-30.0, 0.0, 30.0]))
    assert bool((power.r1 > 0).all()) and bool((power.r2 > 0).all()) and bool((power.r2 <= 2).all())


@pytest.mark.parametrize("position", ["kerple_log", "kerple_power"])
@pytest.mark.parametrize("causal", [False, True])
def test_attention_matches_reference(position: str, causal: bool) -> None:
    torch.manual_seed(0)
    module = MultiHeadAttention(16, 4, position, causal=causal, num_kv_heads=2).double()
    with torch.no_grad():
        module.encoding.raw_r1.normal_(0.0, 1.0)
        module.encoding.raw_r2.normal_(0.0, 1.0)
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    table = kerple_ref(module.encoding, 6, 6)
    got = module(x)
    torch.testing.assert_close(
        got, output_ref(module, x, biased_scores(lambda b, h, i, j: float(table[h, i, j]), 6)), **TIGHT64
    )
    # positions: left padding in row 1, the bias reads |p_j - p_i|
    positions = torch.tensor([[0, 1, 2, 3, 4, 5], [0, 0, 0, 1, 2, 3]])
    wide = kerple_ref(module.encoding, 6, 6)

    def bias_of(b: int, h: int, i: int, j: int) -> float:
        return float(wide[h, int(positions[b, i]), int(positions[b, j])])

    torch.testing.assert_close(module(x, positions), output_ref(module, x, biased_scores(bias_of, 6)), **TIGHT64)


@pytest.mark.parametrize("kind", ["log", "power"])
def test_gradcheck(kind: str) -> None:
    # Through r1 and r2, with d = 0 on the diagonal (the power kernel's d^r2 has no 0 * log 0 there).
    kerple = randomised(kind, heads=2)
    rel = relative_positions(4)
    raw = (kerple.raw_r1.detach().clone().requires_grad_(), kerple.raw_r2.detach().clone().requires_grad_())

    def run(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(kerple, {"raw_r1": a, "raw_r2": b}, (rel,))

    assert torch.autograd.gradcheck(run, raw)
    out = run(*raw).sum()
    out.backward()
    assert all(bool(torch.isfinite(t.grad).all()) for t in raw)


@pytest.mark.parametrize("kind", ["log", "power"])
def test_flex_score_mod_matches_the_materialized_bias(kind: str) -> None:
    # float32 flex (PyTorch's unfused reference) against float64 attention with the reference bias:
    # 8-term scores and a 10-term softmax, errors of a few float32 ulps; 1e-5 is ample.
    kerple = randomised(kind).float()
    torch.manual_seed(2)
    q, k, v = (torch.randn(2, 4, 10, 8) for _ in range(3))
    want = attention_ref(q.double(), k.double(), v.double(), kerple_ref(kerple, 10, 10))
    got = flex_bias_attention(q, k, v, kerple_score_mod(kerple), compiled=False)
    torch.testing.assert_close(got.double(), want, rtol=0.0, atol=1e-5)
    with pytest.raises(ValueError, match="built by kerple_score_mod for 4 heads"):
        flex_bias_attention(q[:, :2], k[:, :2], v[:, :2], kerple_score_mod(kerple), compiled=False)


def test_module_traces_without_graph_breaks() -> None:
    module = MultiHeadAttention(16, 4, "kerple_power", causal=True)
    breaks, reasons = graph_breaks(module, torch.randn(1, 5, 16))
    assert breaks == 0, reasons


def test_errors() -> None:
    with pytest.raises(ValueError, match="kind must be one of"):
        KerpleBias(4, "cubic")
    with pytest.raises(TypeError, match="num_heads must be an int"):
        KerpleBias(4.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_heads must be >= 1"):
        KerpleBias(0)
    with pytest.raises(TypeError, match="relative_position must be an integer tensor"):
        KerpleBias(2)(torch.zeros(3, 3))
    with pytest.raises(ValueError, match="relative_position must have at least 2 dimensions"):
        KerpleBias(2)(torch.zeros(3, dtype=torch.long))
    with pytest.raises(TypeError, match="kerple must be a KerpleBias"):
        kerple_score_mod(torch.ones(4))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="takes options"):
        MultiHeadAttention(16, 4, "kerple_log", npos=4)
