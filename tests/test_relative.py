"""Relative encodings (ropelib.relative): T5 buckets, ALiBi, Shaw et al. and the distance matrix.

All expected values are worked out by hand from the papers (in the comments) or computed with
explicit Python loops over (i, j), independently of ropelib's vectorised code.
"""

from __future__ import annotations

import math

import pytest
import torch

from ropelib import (
    ShawRelativePosition,
    T5RelativeBias,
    alibi_bias,
    alibi_slopes,
    relative_positions,
    t5_relative_bucket,
)

from references import t5_bucket_peer


def test_relative_positions_by_hand() -> None:
    # R[i, j] = j - i: row i counts from -i.
    assert relative_positions(3).tolist() == [[0, 1, 2], [-1, 0, 1], [-2, -1, 0]]
    # Two queries that are the last tokens of four keys (offset 2): R[i, j] = j - (i + 2).
    assert relative_positions(2, 4, offset=2).tolist() == [[-2, -1, 0, 1], [-3, -2, -1, 0]]


# ----------------------------------------------------------------------------- T5 (Raffel et al., 2020)

# Bidirectional, 32 buckets, max_distance 128: each direction has 16 buckets, max_exact = 8.
# A key n positions back (j - i = -n) gets bucket n for n < 8, else
#     8 + floor(ln(n / 8) / ln(128 / 8) * (16 - 8)) = 8 + floor(8 ln(n/8) / ln 16), at most 15;
# keys in the future (j - i = +n) get the same plus 16.
#   n = 12:  8 ln 1.5  / ln 16 = 8 * 0.405465 / 2.772589 = 1.170 -> 9
#   n = 20:  8 ln 2.5  / ln 16 = 8 * 0.916291 / 2.772589 = 2.644 -> 10
#   n = 50:  8 ln 6.25 / ln 16 = 8 * 1.832581 / 2.772589 = 5.288 -> 13
#   n = 100: 8 ln 12.5 / ln 16 = 8 * 2.525729 / 2.772589 = 7.288 -> 15
#   n = 127: 7.977 -> 15;  n = 1000: 8 + 13.9 -> clipped to 15
BIDIRECTIONAL = {
    0: 0,
    -1: 1,
    -7: 7,
    -12: 9,
    -20: 10,
    -50: 13,
    -100: 15,
    -127: 15,
    -1000: 15,
    1: 17,
    3: 19,
    7: 23,
    12: 25,
    20: 26,
    50: 29,
    1000: 31,
}
# Unidirectional (decoder), 32 buckets, max_distance 128: max_exact = 16, future keys -> bucket 0.
#     bucket(n) = 16 + floor(ln(n / 16) / ln(128 / 16) * 16) = 16 + floor(16 ln(n/16) / ln 8), at most 31
#   n = 20:  16 ln 1.25  / ln 8 = 16 * 0.223144 / 2.079442 = 1.717  -> 17
#   n = 32:  16 ln 2     / ln 8 = 16 / 3 = 5.333                   -> 21
#   n = 50:  16 ln 3.125 / ln 8 = 16 * 1.139434 / 2.079442 = 8.767  -> 24
#   n = 100: 16 ln 6.25  / ln 8 = 16 * 1.832581 / 2.079442 = 14.101 -> 30
#   n = 127: 15.940 -> 31;  n = 200: clipped to 31
UNIDIRECTIONAL = {0: 0, -1: 1, -15: 15, -20: 17, -32: 21, -50: 24, -100: 30, -127: 31, -200: 31, 1: 0, 5: 0, 500: 0}


@pytest.mark.parametrize("bidirectional, table", [(True, BIDIRECTIONAL), (False, UNIDIRECTIONAL)])
def test_t5_buckets_by_hand(bidirectional: bool, table: dict[int, int]) -> None:
    distances = torch.tensor(list(table))
    buckets = t5_relative_bucket(distances, bidirectional=bidirectional, num_buckets=32, max_distance=128)
    assert buckets.dtype == torch.int64
    assert dict(zip(table, buckets.tolist())) == table


def test_t5_small_configuration_by_hand() -> None:
    # Bidirectional, 8 buckets, max_distance 20: 4 per direction, max_exact 2.
    #   n = 2: 2 + floor(2 ln 1 / ln 10) = 2;  n = 5: 2 + floor(2 * 0.916291 / 2.302585 = 0.796) = 2
    #   n = 9: 2 + floor(2 * 1.504077 / 2.302585 = 1.306) = 3;  n = 25: clipped to 3
    distances = torch.tensor([0, -1, -2, -5, -9, -25, 1, 5, 9])
    assert t5_relative_bucket(distances, True, 8, 20).tolist() == [0, 1, 2, 2, 3, 3, 5, 6, 7]


def test_t5_buckets_are_monotone_and_in_range() -> None:
    back = t5_relative_bucket(-torch.arange(0, 2000), bidirectional=True)
    ahead = t5_relative_bucket(torch.arange(1, 2000), bidirectional=True)
    assert (back.diff() >= 0).all() and (ahead.diff() >= 0).all()
    assert back.min() == 0 and back.max() == 15 and ahead.min() == 17 and ahead.max() == 31


def test_t5_bias_module_indexes_its_table() -> None:
    module = T5RelativeBias(num_heads=3, num_buckets=8, max_distance=20).double()
    rel = relative_positions(6)
    bias = module(rel)
    assert bias.shape == (3, 6, 6)
    buckets_by_hand = {0: 0, -1: 1, -2: 2, -3: 2, -4: 2, -5: 2, 1: 5, 2: 6, 3: 6, 4: 6, 5: 6}  # as above
    for h in range(3):
        for i in range(6):
            for j in range(6):
                assert bias[h, i, j] == module.weight[buckets_by_hand[j - i], h]
    # Batched relative positions [batch, q, k] give [batch, heads, q, k].
    assert module(torch.stack((rel, rel))).shape == (2, 3, 6, 6)


def test_gradcheck_t5_bias() -> None:
    module = T5RelativeBias(num_heads=2, num_buckets=8, max_distance=20)
    rel = relative_positions(5)
    weight = module.weight.detach().double().requires_grad_()
    assert torch.autograd.gradcheck(lambda w: torch.func.functional_call(module, {"weight": w}, (rel,)), (weight,))


# ----------------------------------------------------------------------------- ALiBi (Press et al., 2022)


def test_alibi_slopes_eight_heads() -> None:
    # Section 3: for 8 heads the slopes are 1/2^1, 1/2^2, ..., 1/2^8.
    assert alibi_slopes(8).tolist() == [1 / 2**h for h in range(1, 9)]


def test_alibi_slopes_sixteen_heads() -> None:
    # Power of two n: geometric sequence from 2^(-8/n) with ratio 2^(-8/n): for 16 heads
    # 2^-0.5, 2^-1, ..., 2^-8 (the paper: "interpolate 1/sqrt(2), 1/2, ...").
    expected = [2 ** (-0.5 * h) for h in range(1, 17)]
    torch.testing.assert_close(alibi_slopes(16), torch.tensor(expected, dtype=torch.float64), rtol=1e-15, atol=0.0)


def test_alibi_slopes_non_powers_of_two() -> None:
    # The paper's rule for other n: take the slopes of the closest smaller power of two m, then
    # every other slope of 2m heads for the remaining n - m.
    # 6 heads: m = 4 -> 2^-2, 2^-4, 2^-6, 2^-8; 8 heads' slopes are 2^-1 .. 2^-8, every other
    # one from the first is 2^-1, 2^-3 (2 needed).
    assert alibi_slopes(6).tolist() == [1 / 4, 1 / 16, 1 / 64, 1 / 256, 1 / 2, 1 / 8]
    # 12 heads: m = 8 -> 2^-1 .. 2^-8; 16 heads' slopes are 2^-0.5, 2^-1, ..., every other one from
    # the first is 2^-0.5, 2^-1.5, 2^-2.5, 2^-3.5 (4 needed).
    expected = [2.0**-h for h in range(1, 9)] + [2**-0.5, 2**-1.5, 2**-2.5, 2**-3.5]
    torch.testing.assert_close(alibi_slopes(12), torch.tensor(expected, dtype=torch.float64), rtol=1e-15, atol=0.0)
    # 1 head: m = 1 -> 2^-8. 3 heads: m = 2 -> 2^-4, 2^-8, then 4 heads' 2^-2.
    assert alibi_slopes(1).tolist() == [2.0**-8]
    assert alibi_slopes(3).tolist() == [2.0**-4, 2.0**-8, 2.0**-2]


def test_alibi_bias_by_hand() -> None:
    # 2 heads: slopes 2^-4, 2^-8. b[h, i, j] = -m_h |j - i|.
    bias = alibi_bias(2, 3, dtype=torch.float64)
    assert bias.shape == (2, 3, 3)
    d = [[0, 1, 2], [1, 0, 1], [2, 1, 0]]
    assert bias[0].tolist() == [[-x / 16 for x in row] for row in d]
    assert bias[1].tolist() == [[-x / 256 for x in row] for row in d]
    # With an offset (decoding the last query of 4 keys): distances 3, 2, 1, 0.
    assert alibi_bias(1, 1, 4, offset=3, dtype=torch.float64)[0].tolist() == [[-3 / 256, -2 / 256, -1 / 256, 0.0]]


# ----------------------------------------------------------------------------- Shaw et al. (2018)


def test_shaw_index_clips_by_hand() -> None:
    # k = 2: clip(j - i, -2, 2) + 2, so the 5 rows stand for distances -2 .. 2.
    module = ShawRelativePosition(head_dim=4, max_relative_position=2)
    rel = torch.tensor([[-5, -2, -1, 0, 1, 2, 9]])
    assert module.index(rel).tolist() == [[0, 0, 1, 2, 3, 4, 4]]


def test_shaw_score_bias_and_value_term_by_loops() -> None:
    module = ShawRelativePosition(head_dim=4, max_relative_position=2).double()
    q = torch.randn(2, 3, 5, 4, dtype=torch.float64)  # [batch, heads, seq, d]
    rel = relative_positions(5)
    weights = torch.rand(2, 3, 5, 5, dtype=torch.float64)
    with torch.no_grad():
        bias = module.score_bias(q, rel)
        value = module.value_term(weights, rel)
        key_table, value_table = module.key_table.detach(), module.value_table.detach()
    for b in range(2):
        for h in range(3):
            for i in range(5):
                z = torch.zeros(4, dtype=torch.float64)
                for j in range(5):
                    row = min(max(j - i, -2), 2) + 2
                    expected = float(q[b, h, i] @ key_table[row]) / 2.0  # / sqrt(d) = / 2
                    assert math.isclose(float(bias[b, h, i, j]), expected, rel_tol=1e-12, abs_tol=1e-15)
                    z += weights[b, h, i, j] * value_table[row]
                torch.testing.assert_close(value[b, h, i], z, rtol=1e-12, atol=1e-15)


class _ShawBoth(torch.nn.Module):
    """Calls score_bias and value_term as one forward, so functional_call can swap the tables."""

    def __init__(self, shaw: ShawRelativePosition, rel: torch.Tensor) -> None:
        super().__init__()
        self.shaw, self.rel = shaw, rel

    def forward(self, q: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.shaw.score_bias(q, self.rel), self.shaw.value_term(weights, self.rel)


def test_gradcheck_shaw() -> None:
    both = _ShawBoth(ShawRelativePosition(head_dim=4, max_relative_position=2), relative_positions(4))
    q = torch.randn(1, 2, 4, 4, dtype=torch.float64, requires_grad=True)
    weights = torch.rand(1, 2, 4, 4, dtype=torch.float64, requires_grad=True)
    kt = both.shaw.key_table.detach().double().requires_grad_()
    vt = both.shaw.value_table.detach().double().requires_grad_()

    def run(q, weights, kt, vt):
        return torch.func.functional_call(both, {"shaw.key_table": kt, "shaw.value_table": vt}, (q, weights))

    assert torch.autograd.gradcheck(run, (q, weights, kt, vt))


# ----------------------------------------------------------------------------- T5 exactly, against T5's own function


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize("num_buckets, max_distance", [(32, 128), (18, 128), (8, 20), (64, 512), (4, 5)])
def test_t5_buckets_equal_t5_everywhere(bidirectional: bool, num_buckets: int, max_distance: int) -> None:
    # Every offset in [-2 max_distance, 2 max_distance], the exact boundaries included (where a float64
    # log lands just below an integer and T5's float32 one does not, e.g. -64 with 18 buckets), against
    # transformers' T5Attention._relative_position_bucket: the peer's output, not ropelib's.
    pytest.importorskip("transformers")
    rel = torch.arange(-2 * max_distance, 2 * max_distance + 1)
    want = t5_bucket_peer(rel, bidirectional, num_buckets, max_distance)
    got = t5_relative_bucket(rel, bidirectional, num_buckets, max_distance)
    assert torch.equal(got, want), rel[got != want].tolist()


def test_t5_bucket_at_the_reported_boundary() -> None:
    # The case found by hand: 18 buckets, distance 64 back: T5 puts it in bucket 8.
    assert t5_relative_bucket(torch.tensor([-64]), True, 18, 128).tolist() == [8]


def test_t5_bucket_of_extreme_offsets_is_the_last_bucket() -> None:
    # |j - i| beyond max_distance shares the last bucket of its direction; no overflow at the int64 ends.
    rel = torch.tensor([-(2**63), -(10**12), 10**12, 2**63 - 1])
    assert t5_relative_bucket(rel, True, 32, 128).tolist() == [15, 15, 31, 31]
    assert t5_relative_bucket(rel, False, 32, 128).tolist() == [31, 31, 0, 0]
