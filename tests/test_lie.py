"""ComRoPE and LieRE: rotations exp(sum_a p_a A_a) of learned skew-symmetric generators.

Expected values: a dense float64 reference written here from the papers' definition (the generators
assembled as d x d matrices, exponentiated by an eigendecomposition, not by matrix_exp), RoPE's
reference rotation, and the group identities the definitions imply.
"""

from __future__ import annotations

import pytest
import torch

from ropelib import MultiHeadAttention, cos_sin_table
from ropelib.frequencies import default_inverse_frequencies
from ropelib.reference import apply_rotary
from ropelib.rotary.lie import ComRoPE, LieRE, rope_generators


def expm_skew(a: torch.Tensor) -> torch.Tensor:
    """exp(A) of a real skew-symmetric float64 A: A = i H with H Hermitian, H = V diag(l) V^*, exp(A) = V e^{i l} V^*."""
    lam, vec = torch.linalg.eigh(-1j * a.to(torch.complex128))
    return ((vec * torch.exp(1j * lam)[..., None, :]) @ vec.mH).real


def dense_generators(module: ComRoPE | LieRE) -> torch.Tensor:
    """``[heads, axes, d, d]`` from the parameters, by the papers' definitions (block_diag of the blocks)."""
    if isinstance(module, ComRoPE):
        b = (module.blocks - module.blocks.mT) / 2  # the learned skew blocks B_j
        per_axis = [
            [
                torch.block_diag(*(module.scales[h, a, j] * b[h, j] for j in range(module.num_blocks)))
                for a in range(module.axes)
            ]
            for h in range(module.num_heads)
        ]
    else:
        w = (module.weight - module.weight.mT) / 2
        per_axis = [[torch.block_diag(*w[h, a]) for a in range(module.axes)] for h in range(module.num_heads)]
    return torch.stack([torch.stack(row) for row in per_axis]).detach().double()


def reference_rotate(module: ComRoPE | LieRE, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``R(p) x`` per token and head, dense: ``x`` ``[batch, seq, heads, d]``, ``positions`` ``[seq, axes]``."""
    gens = dense_generators(module)
    out = torch.empty_like(x, dtype=torch.float64)
    for s in range(x.shape[1]):
        for h in range(x.shape[2]):
            g = gens[h if module.num_heads > 1 else 0]
            rotation = expm_skew(sum(positions[s, a].double() * g[a] for a in range(module.axes)))
            out[:, s, h] = x[:, s, h].double() @ rotation.T
    return out


def random_module(kind: type, **kwargs: object) -> ComRoPE | LieRE:
    torch.manual_seed(0)
    module = kind(8, init_std=0.5, **kwargs).double()
    if isinstance(module, ComRoPE):
        with torch.no_grad():
            module.scales.normal_()  # every axis on every block: the generators still commute
    return module


@pytest.mark.parametrize(
    ("kind", "options"),
    [
        (ComRoPE, {"axes": 2, "block_size": 4}),
        (ComRoPE, {"axes": 1, "num_heads": 3}),
        (LieRE, {"axes": 2}),
        (LieRE, {"axes": 3, "block_size": 4}),
    ],
)
def test_rotation_equals_the_dense_definition(kind: type, options: dict) -> None:
    module = random_module(kind, **options)
    axes = module.axes
    torch.manual_seed(1)
    q, k = torch.randn(2, 5, 3, 8, dtype=torch.float64), torch.randn(2, 5, 3, 8, dtype=torch.float64)
    positions = torch.randn(5, axes, dtype=torch.float64) * 3
    given = positions if axes > 1 else positions[:, 0]
    q2, k2 = module(q, k, given)
    # block matrix_exp vs dense eigendecomposition, angles up to ~10 rad: float64 rounding, a few 1e-14
    torch.testing.assert_close(q2, reference_rotate(module, q, positions), rtol=0, atol=1e-12)
    torch.testing.assert_close(k2, reference_rotate(module, k, positions), rtol=0, atol=1e-12)


def relative_error(module: ComRoPE | LieRE, m: torch.Tensor, n: torch.Tensor) -> float:
    """max |R(m)^T R(n) - R(n - m)| over heads and blocks."""
    r_m, r_n, r_d = (module.rotation_matrices(p) for p in (m, n, n - m))
    return float((r_m.mT @ r_n - r_d).abs().max().detach())


def test_commuting_generators_have_the_relative_property() -> None:
    module = random_module(ComRoPE, axes=2, block_size=4)
    gens = dense_generators(module)[0]
    torch.testing.assert_close(gens[0] @ gens[1], gens[1] @ gens[0], rtol=0, atol=1e-14)  # they commute
    torch.manual_seed(2)
    m, n = torch.randn(20, 2, dtype=torch.float64) * 5, torch.randn(20, 2, dtype=torch.float64) * 5
    # exp(-M) exp(N) = exp(N - M) exactly for commuting M, N; float64 exponentials of norm ~ 30: ~1e-13
    assert relative_error(module, m, n) < 1e-11


def test_non_commuting_generators_break_the_relative_property() -> None:
    module = random_module(LieRE, axes=2)
    gens = dense_generators(module)[0]
    assert (gens[0] @ gens[1] - gens[1] @ gens[0]).abs().max() > 1e-2  # they do not commute
    torch.manual_seed(2)
    m, n = torch.randn(20, 2, dtype=torch.float64) * 5, torch.randn(20, 2, dtype=torch.float64) * 5
    assert relative_error(module, m, n) > 1e-1  # far above rounding: the property FAILS
    one_axis = random_module(LieRE, axes=1)  # a single generator commutes with itself
    assert relative_error(one_axis, m[:, :1], n[:, :1]) < 1e-11


@pytest.mark.parametrize("block_size", [2, 4, 8])
def test_rope_generators_recover_rope(block_size: int) -> None:
    com = ComRoPE(8, block_size=block_size).double()
    with torch.no_grad():
        com.blocks.copy_(rope_generators(8, 100.0, block_size))  # RoPE's blocks, in float64; scales 1
    torch.manual_seed(3)
    q = torch.randn(2, 40, 3, 8, dtype=torch.float64)
    positions = torch.arange(40)
    cos, sin = cos_sin_table(default_inverse_frequencies(8, 100.0), positions, dtype=torch.float64)
    expected = apply_rotary(q, cos, sin, layout="interleaved")
    # matrix_exp of angles up to 39 rad vs cos/sin of the same float64 angles: a few 1e-15 times the angle
    torch.testing.assert_close(com(q, q, positions)[0], expected, rtol=0, atol=1e-12)


def test_rope_generators_hand_values() -> None:
    gens = rope_generators(4, 100.0)  # theta_i = 100^(-2i/4): 1, 0.1
    expected = torch.tensor([[[0.0, -1.0], [1.0, 0.0]], [[0.0, -0.1], [0.1, 0.0]]], dtype=torch.float64)
    torch.testing.assert_close(gens, expected, rtol=0, atol=1e-16)


def test_comrope_layer_with_rope_generators_is_the_rope_layer() -> None:
    torch.manual_seed(4)
    com = MultiHeadAttention(16, 2, "comrope", causal=True, block_size=2, num_kv_heads=1).double()
    rope = MultiHeadAttention(16, 2, "rope", causal=True, layout="interleaved", num_kv_heads=1).double()
    rope.load_state_dict({k: v for k, v in com.state_dict().items() if not k.startswith("encoding")})
    with torch.no_grad():
        com.encoding.blocks.copy_(rope_generators(8, 10000.0))  # the float64 frequencies (init rounds to float32)
    x = torch.randn(2, 9, 16, dtype=torch.float64)
    torch.testing.assert_close(com(x), rope(x), rtol=0, atol=1e-12)  # as above, angles < 9 rad


@pytest.mark.parametrize("position", ["comrope", "liere"])
def test_learned_layer_scores_read_offsets_only(position: str) -> None:
    torch.manual_seed(5)
    layer = MultiHeadAttention(16, 2, position, init_std=0.3).double()
    x = torch.randn(1, 7, 16, dtype=torch.float64)
    base = torch.arange(7)
    # one axis: one generator, R(m)^T R(n) = R(n - m); float64 exponentials at positions < 60
    torch.testing.assert_close(layer.scores(x, base + 50), layer.scores(x, base), rtol=0, atol=1e-10)


def test_rotations_are_orthogonal() -> None:
    module = random_module(LieRE, axes=2)
    r = module.rotation_matrices(torch.randn(6, 2, dtype=torch.float64))
    torch.testing.assert_close(r.mT @ r, torch.eye(8, dtype=torch.float64).expand_as(r), rtol=0, atol=1e-13)


@pytest.mark.parametrize("kind", [ComRoPE, LieRE])
def test_gradcheck_through_inputs_and_generators(kind: type) -> None:
    module = random_module(kind, axes=2, block_size=4)
    torch.manual_seed(6)
    q = torch.randn(1, 3, 1, 8, dtype=torch.float64, requires_grad=True)
    positions = torch.randn(3, 2, dtype=torch.float64)
    params = tuple(module.parameters())

    def f(q: torch.Tensor, *ps: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(
            module, dict(zip([n for n, _ in module.named_parameters()], ps)), (q, q, positions)
        )[0]

    assert torch.autograd.gradcheck(f, (q, *params))


def test_comrope_compiles_to_one_graph() -> None:
    torch.manual_seed(7)
    module = ComRoPE(8, block_size=4, init_std=0.1)
    q = torch.randn(1, 5, 2, 8)
    compiled = torch.compile(module, fullgraph=True)
    # float32 exponentials of 4 x 4 blocks, eager vs Inductor: float32 rounding of O(1) values
    torch.testing.assert_close(compiled(q, q)[0], module(q, q)[0], rtol=0, atol=1e-5)


def test_doors_reject_bad_arguments() -> None:
    with pytest.raises(ValueError, match="block_size"):
        ComRoPE(8, block_size=3)
    with pytest.raises(ValueError, match="block_size"):
        ComRoPE(12, block_size=8)
    with pytest.raises(ValueError, match="head_dim"):
        LieRE(7)
    with pytest.raises(ValueError, match="axes"):
        LieRE(8, axes=0)
    module = ComRoPE(8, axes=2)
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match="positions are required"):
        module(q, q)
    with pytest.raises(ValueError, match="positions"):
        module(q, q, torch.zeros(4, 3))
    with pytest.raises(TypeError, match="positions"):
        module(q, q, torch.zeros(4, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="finite"):
        module(q, q, torch.full((4, 2), float("nan")))
    with pytest.raises(ValueError, match="heads"):
        ComRoPE(8, num_heads=3)(q, q)
    with pytest.raises(ValueError, match="head_dim"):
        ComRoPE(8)(torch.randn(1, 4, 2, 6), torch.randn(1, 4, 2, 6))
    with pytest.raises(ValueError, match="unknown"):
        MultiHeadAttention(16, 2, "comrope", axes=2)
