"""p-RoPE (Barbero et al., 2024): the frequencies from the paper's definition, transformers' proportional RoPE,
its position-free channels, the relative property of the rest, every kernel, gradients, compile, the plug.

References: the frequencies written from the definition in Python floats; transformers'
``_compute_proportional_rope_parameters`` (the peer); explicit float64 2x2 rotation matrices.
"""

from __future__ import annotations

import math

import pytest
import torch

from ropelib import MultiHeadAttention
from ropelib.kernels import native_build
from ropelib.rotary.p_rope import PRotaryEmbedding, p_rope_scaling

from hot_path import graph_breaks
from references import pair_indices

KERNELS = ["torch", "triton"] + (["native"] if native_build.enabled() else [])


def p_rope_ref(head_dim: int, p: float, theta: float) -> list[float]:
    """Barbero et al.: the first floor(p d / 2) pairs keep theta^(-2i/d), the other pairs get frequency 0."""
    kept = math.floor(p * head_dim / 2)
    return [theta ** (-2.0 * i / head_dim) if i < kept else 0.0 for i in range(head_dim // 2)]


def rotation_ref(position: int, freqs: list[float], layout: str) -> torch.Tensor:
    """The [d, d] float64 matrix: a 2x2 rotation by position * f on each pair."""
    d = 2 * len(freqs)
    R = torch.eye(d, dtype=torch.float64)
    for (a, b), f in zip(pair_indices(d, layout), freqs):
        c, s = math.cos(position * f), math.sin(position * f)
        R[a, a], R[a, b], R[b, a], R[b, b] = c, -s, s, c
    return R


@pytest.mark.parametrize("head_dim,p", [(8, 0.0), (8, 0.5), (16, 0.25), (16, 0.75), (12, 1.0), (10, 0.7)])
def test_frequencies_follow_the_definition(head_dim: int, p: float) -> None:
    rope = PRotaryEmbedding(head_dim, p=p, theta=500.0)
    # float64 pow on both sides: equal to a few ulps
    torch.testing.assert_close(
        rope.cache.inv_freq, torch.tensor(p_rope_ref(head_dim, p, 500.0), dtype=torch.float64), rtol=1e-15, atol=0.0
    )
    assert rope.rotated_pairs == math.floor(p * head_dim / 2)


@pytest.mark.parametrize("head_dim,p", [(8, 0.5), (16, 0.25), (32, 0.75)])
def test_is_transformers_proportional_rope_with_factor_one(head_dim: int, p: float) -> None:
    from transformers import PretrainedConfig
    from transformers.modeling_rope_utils import _compute_proportional_rope_parameters

    params = {"rope_type": "proportional", "rope_theta": 10000.0, "partial_rotary_factor": p}
    config = PretrainedConfig(hidden_size=head_dim, num_attention_heads=1, head_dim=head_dim, rope_parameters=params)
    want, _ = _compute_proportional_rope_parameters(config)
    got = PRotaryEmbedding(head_dim, p=p).inv_freq
    # transformers computes in float32 (1 / base^x): a few float32 ulps
    torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=0.0)
    assert p_rope_scaling(p) == {"rope_type": "proportional", "partial_rotary_factor": p}


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_rotation_matches_the_reference_on_every_kernel(kernel: str, layout: str) -> None:
    rope = PRotaryEmbedding(16, p=0.5, layout=layout, kernel=kernel)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 5, 3, 16, generator=g), torch.randn(2, 5, 1, 16, generator=g)
    positions = torch.tensor([[0, 3, 7, 100, 4095], [1, 2, 3, 4, 5]])
    got_q, got_k = rope(q, k, positions)
    freqs = p_rope_ref(16, 0.5, 10000.0)
    for b in range(2):
        for s in range(5):
            R = rotation_ref(int(positions[b, s]), freqs, layout)
            # float32 tables and products of O(1) values: a few float32 ulps
            torch.testing.assert_close(got_q[b, s].double(), q[b, s].double() @ R.T, rtol=0.0, atol=2e-6)
            torch.testing.assert_close(got_k[b, s].double(), k[b, s].double() @ R.T, rtol=0.0, atol=2e-6)


@pytest.mark.parametrize("kernel", KERNELS)
def test_zero_frequency_pairs_are_position_free(kernel: str) -> None:
    # The truncated pairs turn by angle 0: exactly unchanged, so their share of q . k ignores any positions.
    rope = PRotaryEmbedding(16, p=0.25, kernel=kernel)  # pairs 0, 1 rotate; 2 .. 7 do not
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 6, 2, 16, generator=g), torch.randn(1, 6, 2, 16, generator=g)
    free = [f for a, b in pair_indices(16, "half")[2:] for f in (a, b)]
    for positions in (torch.arange(6), torch.tensor([50, 3, 0, 999, 7, 7]), torch.randperm(6, generator=g)):
        q2, k2 = rope(q, k, positions)
        assert torch.equal(q2[..., free], q[..., free]) and torch.equal(k2[..., free], k[..., free])


def test_rotated_pairs_stay_relative() -> None:
    # R(m)^T R(n) = R(n - m) on the rotated pairs: the score depends on n - m only (float64).
    rope = PRotaryEmbedding(8, p=0.5)
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(1, 1, 1, 8, generator=g, dtype=torch.float64), torch.randn(1, 1, 1, 8, dtype=torch.float64)
    freqs = p_rope_ref(8, 0.5, 10000.0)
    for m, n in [(0, 5), (10, 15), (1000, 1005), (7, 2)]:
        qm, _ = rope(q, q, torch.tensor([m]))
        kn, _ = rope(k, k, torch.tensor([n]))
        want = q[0, 0, 0] @ rotation_ref(n - m, freqs, "half") @ k[0, 0, 0]
        # float64 angles up to 1e3 rad: ~1e-13 absolute
        torch.testing.assert_close((qm * kn).sum(), want, rtol=0.0, atol=1e-12)


def test_gradcheck_float64() -> None:
    rope = PRotaryEmbedding(8, p=0.5, kernel="torch")
    q = torch.randn(1, 3, 2, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 3, 1, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda q, k: rope(q, k, torch.tensor([0, 4, 9])), (q, k))


def test_attention_layer_has_no_graph_break() -> None:
    module = MultiHeadAttention(32, 4, "p_rope", causal=True, p=0.5)
    breaks, reasons = graph_breaks(module, torch.randn(2, 6, 32))
    assert breaks == 0, reasons


def test_attention_plug_builds_the_module_and_scores_are_relative() -> None:
    module = MultiHeadAttention(16, 2, "p_rope", p=0.5, theta=100.0).double()
    assert isinstance(module.encoding, PRotaryEmbedding) and module.encoding.p == 0.5
    x = torch.randn(1, 4, 16, dtype=torch.float64)
    # shifting every position by the same amount leaves the scores unchanged (float64 angles)
    torch.testing.assert_close(module.scores(x, torch.arange(4) + 37), module.scores(x), rtol=0.0, atol=1e-12)
    default = MultiHeadAttention(16, 2, "p_rope").encoding
    assert isinstance(default, PRotaryEmbedding) and default.p == 0.75


@pytest.mark.parametrize(
    "p,error", [(1.5, ValueError), (-0.1, ValueError), (float("nan"), ValueError), (True, TypeError), ("1", TypeError)]
)
def test_p_is_checked(p: object, error: type[Exception]) -> None:
    with pytest.raises(error, match="p must"):
        PRotaryEmbedding(8, p=p)  # type: ignore[arg-type]
