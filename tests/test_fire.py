"""FIRE (Li et al., 2023): the bias against the paper's formula by loops, progressive interpolation
(the MLP's input in [0, 1] at every length), ALiBi and T5-like shapes represented by a ReLU MLP,
attention, flex, gradients, errors.

Expected values: ``f(psi(i - j) / psi(max(L, i)))`` with ``psi(x) = log(c x + 1)`` and the MLP
``W2 relu(W1 x + b1) + b2`` written out in Python floats from the module's weights.
"""

from __future__ import annotations

import math

import pytest
import torch

from ropelib import MultiHeadAttention
from ropelib.encodings.fire import FireBias, fire_score_mod
from ropelib.encodings.flex import flex_bias_attention

from bias_references import biased_scores, output_ref
from hot_path import graph_breaks
from references import attention_ref

# float64 module vs float64 loops: two logs, a division and a 32-unit MLP per entry; 1e-12 is
# thousands of ulps of margin for values of order 1.
TIGHT64 = dict(rtol=0.0, atol=1e-12)


def mlp_ref(fire: FireBias, x: float) -> list[float]:
    """One output per head, by sums over the hidden units."""
    w1, b1 = fire.mlp[0].weight.detach().flatten().tolist(), fire.mlp[0].bias.detach().tolist()
    w2, b2 = fire.mlp[2].weight.detach().tolist(), fire.mlp[2].bias.detach().tolist()
    hidden = [max(0.0, w * x + b) for w, b in zip(w1, b1)]
    return [b2[h] + sum(w * u for w, u in zip(w2[h], hidden)) for h in range(len(b2))]


def fire_ref(fire: FireBias, positions: list[int], causal: bool = True) -> torch.Tensor:
    """``[heads, seq, seq]``: the paper's formula where ``j <= i`` (0 after, masked by the layer) when causal;
    non-causal, ropelib's extension: ``psi(|i - j|) / psi(max(L, i, max_j |i - j|))``."""
    c, L = math.exp(fire.log_c.item()), math.exp(fire.log_threshold.item())
    psi = lambda x: math.log(c * x + 1)  # noqa: E731
    n = len(positions)
    out = torch.zeros(fire.num_heads, n, n, dtype=torch.float64)
    for i, pi in enumerate(positions):
        for j, pj in enumerate(positions):
            if causal and j > i:
                continue
            if causal:
                x = psi(pi - pj) / psi(max(L, pi))
            else:
                x = psi(abs(pi - pj)) / psi(max(L, pi, max(abs(pi - p) for p in positions)))
            out[:, i, j] = torch.tensor(mlp_ref(fire, x), dtype=torch.float64)
    return out


def randomised(heads: int = 3, threshold: float = 4.0, c: float = 0.7, width: int = 32) -> FireBias:
    torch.manual_seed(0)
    fire = FireBias(heads, mlp_width=width, init_c=c, init_threshold=threshold).double()
    with torch.no_grad():
        for p in fire.mlp.parameters():
            p.normal_(0.0, 1.0)
    return fire


def test_bias_matches_the_paper_formula() -> None:
    # threshold L = 4 over 9 positions: queries below L (normaliser psi(L)) and above (psi(i)).
    fire = randomised()
    got = fire(torch.arange(9))
    causal = torch.ones(9, 9, dtype=torch.bool).tril()
    want = fire_ref(fire, list(range(9)))
    torch.testing.assert_close(got[:, causal], want[:, causal], **TIGHT64)
    padded = torch.tensor([[0, 1, 2, 3, 4, 5, 6], [0, 0, 0, 1, 2, 3, 4]])  # left padding: the paper's i = position
    got = fire(padded)
    causal = torch.ones(7, 7, dtype=torch.bool).tril()
    for b in range(2):
        torch.testing.assert_close(got[b][:, causal], fire_ref(fire, padded[b].tolist())[:, causal], **TIGHT64)


def test_non_causal_extension() -> None:
    fire = randomised()
    torch.testing.assert_close(fire(torch.arange(7), causal=False), fire_ref(fire, list(range(7)), False), **TIGHT64)


@pytest.mark.parametrize("length", [3, 40, 2000])
def test_input_lies_in_unit_interval_at_every_length(length: int) -> None:
    # Progressive interpolation: psi(i - j) / psi(max(L, i)) in [0, 1] for every visible pair, at
    # every length (so no length gives the MLP an input it was not trained on); 1 at (i, 0) once i >= L.
    fire = FireBias(2, init_threshold=16.0).double()
    x = fire.normalized_distance(torch.arange(length), causal=True).detach()
    visible = torch.ones(length, length, dtype=torch.bool).tril()
    assert float(x[visible].min()) == 0.0 and float(x[visible].max()) <= 1.0
    past_threshold = torch.arange(length) >= 16
    torch.testing.assert_close(x[past_threshold, 0], torch.ones(int(past_threshold.sum()), dtype=torch.float64))
    both = fire.normalized_distance(torch.arange(length), causal=False).detach()
    assert float(both.min()) >= 0.0 and float(both.max()) <= 1.0 + 1e-15  # one rounding of a ratio of equal logs


def interpolating_mlp(fire: FireBias, targets: list[list[float]]) -> None:
    """Set ``fire``'s MLP to the piecewise linear interpolant through ``(x_d, targets[h][d])``, ``x_d = psi(d) / psi(L)``.

    ``relu(x - x_k)`` units, one per knot: ``f(x) = y_0 + s_0 x + sum_k (s_k - s_{k-1}) relu(x - x_k)``.
    """
    c, L = math.exp(fire.log_c.item()), math.exp(fire.log_threshold.item())
    knots = [math.log(c * d + 1) / math.log(c * L + 1) for d in range(len(targets[0]))]
    slopes = [
        [(y[k + 1] - y[k]) / (knots[k + 1] - knots[k]) for k in range(len(knots) - 1)] for y in targets
    ]  # per head
    with torch.no_grad():
        fire.mlp[0].weight.fill_(1.0)
        fire.mlp[0].bias.copy_(torch.tensor([-x for x in knots[:-1]], dtype=torch.float64))
        changes = [[s[0]] + [s[k] - s[k - 1] for k in range(1, len(s))] for s in slopes]
        fire.mlp[2].weight.copy_(torch.tensor(changes, dtype=torch.float64))
        fire.mlp[2].bias.copy_(torch.tensor([y[0] for y in targets], dtype=torch.float64))


@pytest.mark.parametrize("shape", ["alibi", "t5"])
def test_a_relu_mlp_represents_alibi_and_t5_within_the_window(shape: str) -> None:
    # Within the window (i < L, a fixed normaliser) any bias of the distance is reached at the integer
    # distances by n - 1 ReLU units: ALiBi's -m d, and a T5-like step table (a value per bucket).
    n = 12
    if shape == "alibi":
        targets = [[-m * d for d in range(n)] for m in (0.5, 0.125)]
    else:
        buckets = [0, 1, 2, 3, 4, 4, 5, 5, 5, 6, 6, 6]  # exact, then shared buckets
        table = [[0.3, -0.1, -0.4, -0.6, -0.9, -1.2, -1.5], [1.0, 0.5, 0.0, -0.5, -1.0, -1.5, -2.0]]
        targets = [[row[b] for b in buckets] for row in table]
    fire = FireBias(2, mlp_width=n - 1, init_c=0.3, init_threshold=float(n)).double()
    interpolating_mlp(fire, targets)
    got = fire(torch.arange(n))
    want = torch.tensor(
        [[[y[i - j] if j <= i else 0.0 for j in range(n)] for i in range(n)] for y in targets], dtype=torch.float64
    )
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    # float64: a ratio of logs then a sum of 11 units with slopes up to ~1e2; 1e-11 absolute.
    torch.testing.assert_close(got[:, causal], want[:, causal], rtol=0.0, atol=1e-11)


@pytest.mark.parametrize("causal", [False, True])
def test_attention_matches_reference(causal: bool) -> None:
    torch.manual_seed(1)
    module = MultiHeadAttention(16, 4, "fire", causal=causal, init_threshold=3.0, init_c=0.5).double()
    for p in module.encoding.mlp.parameters():
        torch.nn.init.normal_(p, std=1.0)
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    table = fire_ref(module.encoding, list(range(6)), causal)
    want = output_ref(module, x, biased_scores(lambda b, h, i, j: float(table[h, i, j]), 6))
    torch.testing.assert_close(module(x), want, **TIGHT64)


def test_gradcheck() -> None:
    # Through the MLP, c and L (L = 2.5 sits between integer positions: max(L, i) has no tie).
    fire = randomised(heads=2, threshold=2.5, width=4)
    names = [n for n, _ in fire.named_parameters()]
    params = tuple(p.detach().clone().requires_grad_() for p in fire.parameters())
    positions = torch.arange(5)

    def run(*values: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(fire, dict(zip(names, values)), (positions,))

    assert torch.autograd.gradcheck(run, params)


def test_flex_score_mod_is_causal_fire() -> None:
    # float32 flex (unfused reference) against float64 causal attention with the reference bias; 1e-5 as in test_flex.
    fire = randomised(heads=4, threshold=5.0).float()
    torch.manual_seed(2)
    q, k, v = (torch.randn(1, 4, 10, 8) for _ in range(3))
    want = attention_ref(q.double(), k.double(), v.double(), fire_ref(fire.double(), list(range(10))), causal=True)
    got = flex_bias_attention(q, k, v, fire_score_mod(fire.float()), compiled=False)
    torch.testing.assert_close(got.double(), want, rtol=0.0, atol=1e-5)
    with pytest.raises(ValueError, match="built by fire_score_mod for 4 heads"):
        flex_bias_attention(q[:, :1], k[:, :1], v[:, :1], fire_score_mod(fire), compiled=False)


def test_module_traces_without_graph_breaks() -> None:
    module = MultiHeadAttention(16, 4, "fire", causal=True)
    breaks, reasons = graph_breaks(module, torch.randn(1, 5, 16))
    assert breaks == 0, reasons


def test_errors() -> None:
    with pytest.raises(ValueError, match="init_c must be a finite number > 0"):
        FireBias(2, init_c=0.0)
    with pytest.raises(ValueError, match="init_threshold must be a finite number > 0"):
        FireBias(2, init_threshold=-1.0)
    with pytest.raises(ValueError, match="mlp_width must be >= 1"):
        FireBias(2, mlp_width=0)
    with pytest.raises(TypeError, match="positions must be an integer tensor"):
        FireBias(2)(torch.arange(4.0))
    with pytest.raises(ValueError, match=r"positions must have shape \[seq\] or \[batch, seq\]"):
        FireBias(2)(torch.zeros(1, 2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="positions must be >= 0"):
        FireBias(2)(torch.tensor([-1, 0, 1]))
    with pytest.raises(TypeError, match="causal must be a bool"):
        FireBias(2)(torch.arange(3), causal=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="fire must be a FireBias"):
        fire_score_mod(None)  # type: ignore[arg-type]
