"""cos/sin tables stay within 1e-6 of a float64 reference at every position up to 2^20, stored in float32.

The reference here is numpy float64: ``theta ** (-2i/d)`` by numpy's power and ``cos(p * w)`` per
entry. float64 angles at ``p <= 2^20`` carry an absolute error below ``2^20 * 2^-52 ~ 2e-10`` rad,
so the reference is good to ~1e-9, far inside the bound under test; a float32 table can be no closer
than its own rounding, ``2^-25 ~ 3e-8``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ropelib import RotaryEmbedding, cos_sin_table, relative_decay_bound, rope_frequencies
from ropelib.scaling import inverse_frequencies64

from references import yarn_ref

BOUND = 1e-6  # the bound on |table - float64 reference|
LAST = 1 << 20
CHUNK = 1 << 16


def reference_inverse_frequencies(head_dim: int, theta: float) -> np.ndarray:
    return np.power(np.float64(theta), -np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)


@pytest.mark.parametrize("head_dim,theta", [(32, 10000.0), (16, 500000.0)])
def test_table_within_bound_at_every_position_up_to_2_pow_20(head_dim, theta):
    inv64, _ = inverse_frequencies64(head_dim, theta)
    reference_inv = reference_inverse_frequencies(head_dim, theta)
    worst = 0.0
    for start in range(0, LAST + 1, CHUNK):
        positions = torch.arange(start, min(start + CHUNK, LAST + 1))
        cos, sin = cos_sin_table(inv64, positions)
        assert cos.dtype == torch.float32
        angles = positions.numpy().astype(np.float64)[:, None] * reference_inv
        worst = max(worst, np.abs(cos.numpy() - np.cos(angles)).max(), np.abs(sin.numpy() - np.sin(angles)).max())
    assert worst <= BOUND, worst
    assert worst <= 2**-24  # in fact: the float32 rounding of the result, nothing more


def test_the_usual_float32_product_misses_the_bound():
    # The common recipe: float32 inv_freq, float32 positions, float32 product. At p ~ 2^20 the product
    # is rounded to a multiple of 2^-4 (its ulp), so the angle can be off by ~3e-2 rad.
    inv32, _ = rope_frequencies(64, 10000.0)
    positions = torch.arange(LAST - CHUNK, LAST + 1)
    naive = torch.cos(positions.float()[:, None] * inv32[None, :])
    reference = np.cos(positions.numpy().astype(np.float64)[:, None] * reference_inverse_frequencies(64, 10000.0))
    error = np.abs(naive.numpy() - reference).max()
    assert error > 1e-3, error


@pytest.mark.parametrize(
    "scaling,max_pos", [({"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536}, None)]
)
def test_rotary_embedding_cache_within_bound(scaling, max_pos):
    # The module's float32 cache (grown by doubling) over all positions up to 2^20, with YaRN's temperature too.
    rope = RotaryEmbedding(16, 10000.0, scaling=scaling, max_position_embeddings=max_pos)
    positions = torch.arange(LAST + 1)
    cos, sin = rope.cos_sin(positions)
    inv_list, scale = yarn_ref(16, 10000.0, scaling["factor"], scaling["original_max_position_embeddings"])
    inv = np.array(inv_list)  # from the paper's formulas, not from the module
    angles = positions.numpy().astype(np.float64)[:, None] * inv
    assert np.abs(cos.numpy() - scale * np.cos(angles)).max() <= BOUND
    assert np.abs(sin.numpy() - scale * np.sin(angles)).max() <= BOUND


def test_reference_agrees_with_python_math_on_samples():
    # A spot check of the numpy reference itself, against math.cos on Python floats.
    import math

    inv = reference_inverse_frequencies(64, 10000.0)
    for p in (0, 1, 12345, 999999, LAST):
        for w in inv[::7]:
            assert abs(np.cos(np.float64(p) * w) - math.cos(p * float(w))) < 1e-12


def test_relative_decay_bound_by_hand_and_by_its_definition() -> None:
    # At r = 0 every phase is 1: |U_j| = j, mean (d/2 + 1) / 2. Elsewhere, against the partial sums
    # written out one by one in Python complex arithmetic (float64, as the function).
    import cmath

    inv_freq = torch.tensor([1.0, 0.1, 0.01, 0.001], dtype=torch.float64)
    distances = torch.tensor([0, 3, 250])
    got = relative_decay_bound(inv_freq, distances)
    assert got.dtype == torch.float64 and got[0].item() == 2.5
    for r, value in zip(distances.tolist()[1:], got.tolist()[1:]):
        partial, total = 0j, 0.0
        for theta in inv_freq.tolist():
            partial += cmath.exp(1j * r * theta)
            total += abs(partial)
        assert abs(value - total / 4) < 1e-12
