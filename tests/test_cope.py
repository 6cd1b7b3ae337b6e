"""CoPE (Golovneva et al., 2024): scores against the paper's definition by loops, positions that count
tokens when every gate is 1 and count only the selected tokens otherwise, attention, gradients, errors.

Expected values: ``g_it = sigmoid(q_i . k_t / sqrt(d))``, ``p_ij = sum_{t=j}^{i} g_it`` clamped to
``npos - 1``, ``b_ij = (ceil p - p) z[floor p] + (p - floor p) z[ceil p]`` (``z[p]`` at integer
``p``) with ``z[m] = q_i . e[m]``, all in Python floats.
"""

from __future__ import annotations

import math

import pytest
import torch

from ropelib import MultiHeadAttention
from ropelib.encodings.cope import ContextualPosition, contextual_positions

from bias_references import output_ref, sigmoid_ref
from hot_path import graph_breaks

# float64 module vs float64 loops: a sigmoid, a sum of up to 8 gates and two d-term dot products
# per entry; 1e-12 is thousands of ulps of margin for values of order 1.
TIGHT64 = dict(rtol=0.0, atol=1e-12)


def scores_ref(cope: ContextualPosition, q: torch.Tensor, k: torch.Tensor, causal: bool = True) -> torch.Tensor:
    """``[seq, seq]`` scores of one head: ``q_i . k_j / sqrt(d) + b_ij`` (j <= i; the non-causal extension after)."""
    n, d = q.shape
    e = cope.embeddings.detach().double()
    out = torch.zeros(n, n, dtype=torch.float64)
    for i in range(n):
        logit = [float(q[i] @ k[t]) / math.sqrt(d) for t in range(n)]
        z = [float(q[i] @ e[m]) for m in range(cope.npos)]
        for j in range(n):
            if j > i and causal:
                continue
            span = range(j, i + 1) if j <= i else range(i, j + 1)
            p = min(sum(sigmoid_ref(logit[t]) for t in span), cope.npos - 1)
            lo, hi = math.floor(p), math.ceil(p)
            bias = z[lo] if lo == hi else (hi - p) * z[lo] + (p - lo) * z[hi]
            out[i, j] = logit[j] + bias
    return out


def randomised(head_dim: int = 4, npos: int = 16) -> ContextualPosition:
    torch.manual_seed(0)
    cope = ContextualPosition(head_dim, npos).double()
    torch.nn.init.normal_(cope.embeddings, std=1.0)
    return cope


@pytest.mark.parametrize("causal", [True, False])
def test_scores_match_the_paper_definition(causal: bool) -> None:
    cope = randomised()
    torch.manual_seed(1)
    q, k = (torch.randn(2, 3, 8, 4, dtype=torch.float64) for _ in range(2))
    got = cope(q, k, causal=causal)
    visible = torch.ones(8, 8, dtype=torch.bool).tril() if causal else torch.ones(8, 8, dtype=torch.bool)
    for b in range(2):
        for h in range(3):
            want = scores_ref(cope, q[b, h], k[b, h], causal)
            torch.testing.assert_close(got[b, h][visible], want[visible], **TIGHT64)


def test_positions_are_clamped_to_the_table() -> None:
    # npos = 3 over 8 tokens with gates near 1: positions up to ~8 clamp to 2 (the last embedding).
    cope = randomised(npos=3)
    q = torch.full((1, 1, 8, 4), 3.0, dtype=torch.float64)
    got = cope(q, q)
    want = scores_ref(cope, q[0, 0], q[0, 0])
    visible = torch.ones(8, 8, dtype=torch.bool).tril()
    torch.testing.assert_close(got[0, 0][visible], want[visible], **TIGHT64)


def test_gates_of_one_count_tokens() -> None:
    # Every gate exactly 1: p_ij = i - j + 1 (the relative position, counting the key itself).
    n = 6
    positions = contextual_positions(torch.ones(n, n, dtype=torch.float64))
    want = torch.tensor([[i - j + 1 if j <= i else 0 for j in range(n)] for i in range(n)], dtype=torch.float64)
    assert torch.equal(positions, want)
    # through the module: q = k = 10 * ones (d = 4) gives logits 400 / sqrt(4) = 200, sigmoid(200) == 1.0 in float64,
    # so each bias is exactly z_i[i - j + 1] = q_i . e[i - j + 1] (integer positions: no interpolation).
    cope = randomised(head_dim=4, npos=8)
    q = torch.full((1, 1, n, 4), 10.0, dtype=torch.float64)
    bias = cope(q, q).detach()[0, 0] - q[0, 0] @ q[0, 0].T / 2.0
    e = cope.embeddings.detach()
    for i in range(n):
        for j in range(i + 1):
            assert float(bias[i, j]) == pytest.approx(float(q[0, 0, i] @ e[i - j + 1]), abs=1e-12)


def test_gates_that_select_sentence_ends_count_sentences() -> None:
    # Keys of "sentence end" tokens point along u, the others against it; every query is u. The gates are
    # sigmoid(+-100) = 1 or 4e-44, so p_ij is the number of sentence ends among tokens j .. i (to 1e-40).
    ends = [0, 0, 1, 0, 1, 0, 0, 1, 0]
    n, d = len(ends), 4
    u = torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    k = torch.stack([(100.0 * math.sqrt(d) if e else -100.0 * math.sqrt(d)) * u for e in ends])
    q = u.expand(n, d)
    gates = torch.sigmoid(q @ k.T / math.sqrt(d))
    positions = contextual_positions(gates)
    for i in range(n):
        for j in range(i + 1):
            assert float(positions[i, j]) == pytest.approx(sum(ends[j : i + 1]), abs=1e-12)
    # and so the bias a query gives a key depends on the sentences between them, not the tokens:
    cope = randomised(head_dim=d, npos=8)
    scores = cope(q[None, None], k[None, None]).detach()[0, 0]
    bias = scores - q @ k.T / math.sqrt(d)
    e = cope.embeddings.detach()
    for i in range(n):
        for j in range(i + 1):
            assert float(bias[i, j]) == pytest.approx(float(q[i] @ e[sum(ends[j : i + 1])]), abs=1e-10)


@pytest.mark.parametrize("causal", [False, True])
def test_attention_matches_reference(causal: bool) -> None:
    torch.manual_seed(2)
    module = MultiHeadAttention(16, 4, "cope", causal=causal, num_kv_heads=2, npos=6).double()
    torch.nn.init.normal_(module.encoding.embeddings, std=1.0)
    x = torch.randn(2, 7, 16, dtype=torch.float64)

    def scores_of(b: int, h: int, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return scores_ref(module.encoding, q, k, causal)

    torch.testing.assert_close(module(x), output_ref(module, x, scores_of), **TIGHT64)
    # CoPE reads no position indices: the same output with any positions
    torch.testing.assert_close(module(x, torch.tensor([0, 0, 1, 2, 3, 4, 5])), module(x), **TIGHT64)


def test_gradcheck() -> None:
    # Through q, k (the gates and the logits z) and the embeddings; random fractional positions, away
    # from the integers where the interpolation's slope jumps.
    cope = randomised(head_dim=3, npos=6)
    torch.manual_seed(3)
    q, k = (torch.randn(1, 2, 4, 3, dtype=torch.float64, requires_grad=True) for _ in range(2))
    e = cope.embeddings.detach().clone().requires_grad_()

    def run(q: torch.Tensor, k: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(cope, {"embeddings": e}, (q, k))

    assert torch.autograd.gradcheck(run, (q, k, e))


def test_module_traces_without_graph_breaks() -> None:
    module = MultiHeadAttention(16, 4, "cope", causal=True)
    breaks, reasons = graph_breaks(module, torch.randn(1, 5, 16))
    assert breaks == 0, reasons


def test_errors() -> None:
    with pytest.raises(ValueError, match="npos must be >= 2"):
        ContextualPosition(4, npos=1)
    with pytest.raises(TypeError, match="head_dim must be an int"):
        ContextualPosition(4.0)  # type: ignore[arg-type]
    cope = ContextualPosition(4)
    q = torch.randn(1, 2, 5, 4)
    with pytest.raises(ValueError, match=r"q and k must be \[batch, heads, seq, 4\] of one shape"):
        cope(q, q[:, :, :3])
    with pytest.raises(ValueError, match="q must have 4 dimensions"):
        cope(q[0], q[0])
    with pytest.raises(TypeError, match="k must be a floating-point tensor"):
        cope(q, q.long())
    with pytest.raises(ValueError, match="q and k must share dtype and device"):
        cope(q, q.double())
    with pytest.raises(TypeError, match="causal must be a bool"):
        cope(q, q, causal="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="takes options"):
        MultiHeadAttention(16, 4, "cope", mlp_width=3)
