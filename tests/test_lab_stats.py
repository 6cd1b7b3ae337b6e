"""The lab's tests of significance: Student's t tail, Welch's one-sided test, Holm's correction, the sign test.

Expected values come from published t tables, hand-worked cases and a numerical integral of the
t density, never from the functions under test.
"""

from __future__ import annotations

import math

import pytest

from ropelib.lab.stats import holm, sign_test_p_value, t_sf, welch_p_value


def _t_density(x: float, df: int) -> float:
    norm = math.gamma((df + 1) / 2) / (math.sqrt(df * math.pi) * math.gamma(df / 2))
    return norm * (1 + x * x / df) ** (-(df + 1) / 2)


def _tail_by_quadrature(t: float, df: int) -> float:
    """``1/2 - integral_0^t density`` by Simpson's rule on 20000 intervals (error ~1e-12 here)."""
    n, h = 20000, t / 20000
    inner = sum((4 if i % 2 else 2) * _t_density(i * h, df) for i in range(1, n))
    return 0.5 - h / 3 * (_t_density(0.0, df) + inner + _t_density(t, df))


# two-sided 5% critical values of published t tables (e.g. Fisher and Yates), 4 to 6 digits
@pytest.mark.parametrize(("df", "critical"), [(1, 12.7062), (2, 4.3027), (3, 3.18245), (4, 2.77645), (10, 2.22814)])
def test_t_sf_at_the_tables_critical_values(df: int, critical: float) -> None:
    # the tables round to the digits shown: a relative 1e-4 on the tail
    assert t_sf(critical, df) == pytest.approx(0.025, rel=1e-4)


@pytest.mark.parametrize("df", [1, 2, 3, 4, 5, 7, 12])
@pytest.mark.parametrize("t", [0.3, 1.0, 2.5, 6.0])
def test_t_sf_matches_the_integral_of_the_density(df: int, t: float) -> None:
    # closed form against quadrature: both float64, agreement to 1e-9 absolute
    assert t_sf(t, df) == pytest.approx(_tail_by_quadrature(t, df), abs=1e-9)
    assert t_sf(-t, df) == pytest.approx(1 - t_sf(t, df), abs=1e-15)  # symmetry


def test_t_sf_by_hand_and_at_the_ends() -> None:
    assert t_sf(1.0, 1) == pytest.approx(0.25, abs=1e-15)  # Cauchy: 1/2 - atan(1)/pi
    assert t_sf(2.0, 2) == pytest.approx(0.5 - 1 / math.sqrt(6), abs=1e-15)  # 1/2 - t / (2 sqrt(2 + t^2))
    assert t_sf(0.0, 3) == 0.5 and t_sf(math.inf, 4) == 0.0 and t_sf(-math.inf, 4) == 1.0
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match="df"):
            t_sf(1.0, bad)  # type: ignore[arg-type]


def test_welch_by_hand() -> None:
    # means 4 and 1, s = 1 on each side, k = 3: se = sqrt(2/3), t = 3 / se, df = 4 exactly;
    # for df = 4, P(T > t) = 1/2 - (x/2)(1 + (1 - x^2)/2) with x = t / sqrt(4 + t^2)
    t = 3 / math.sqrt(2 / 3)
    x = t / math.sqrt(4 + t * t)
    assert welch_p_value([3.0, 4.0, 5.0], [0.0, 1.0, 2.0]) == pytest.approx(0.5 - x / 2 * (1 + (1 - x * x) / 2))
    # unequal spreads: df = (1/3 + 4/3)^2 / ((1/3)^2/2 + (4/3)^2/2) = 50/17 = 2.94, rounded down to 2
    t2 = 3 / math.sqrt(5 / 3)
    expected = 0.5 - t2 / (2 * math.sqrt(2 + t2 * t2))
    assert welch_p_value([3.0, 4.0, 5.0], [-1.0, 1.0, 3.0]) == pytest.approx(expected, rel=1e-12)
    assert welch_p_value([1.0, 1.0], [0.5, 0.5]) == 0.0 and welch_p_value([0.5, 0.5], [1.0, 1.0]) == 1.0
    with pytest.raises(ValueError, match="two values"):
        welch_p_value([1.0], [0.0, 1.0])


def test_holm_by_hand() -> None:
    # sorted 0.005 <= 0.05/4, 0.01 <= 0.05/3, then 0.03 > 0.05/2 stops: the rest stand
    assert holm([0.01, 0.04, 0.03, 0.005], 0.05) == [True, False, False, True]
    # Bonferroni (p <= 0.05/4 = 0.0125) keeps only 0.012; Holm steps down and keeps three
    assert holm([0.012, 0.013, 0.014, 0.2], 0.05) == [True, True, True, False]
    assert holm([0.04, 0.001], 0.05) == [True, True]  # 0.001 <= 0.025, then 0.04 <= 0.05
    assert holm([], 0.05) == []
    with pytest.raises(ValueError, match="alpha"):
        holm([0.01], 1.0)


# hand-worked binomial tails: C(11, 8..11) = 165, 55, 11, 1 of 2048; C(10, 0) + C(10, 1) = 11 of 1024
@pytest.mark.parametrize(
    ("wins", "rounds", "two_sided", "expected"),
    [
        (8, 11, False, 232 / 2048),
        (8, 11, True, 464 / 2048),
        (3, 11, True, 464 / 2048),
        (11, 11, False, 1 / 2048),
        (0, 10, False, 1.0),
        (1, 10, True, 22 / 1024),
        (5, 10, True, 1.0),
    ],
)
def test_sign_test_p_value_against_hand_worked_tails(wins: int, rounds: int, two_sided: bool, expected: float) -> None:
    assert sign_test_p_value(wins, rounds, two_sided=two_sided) == expected


@pytest.mark.parametrize(("wins", "rounds"), [(-1, 5), (6, 5), (2, 0), (2.0, 5)])
def test_sign_test_p_value_rejects_impossible_counts(wins: object, rounds: object) -> None:
    with pytest.raises((ValueError, TypeError)):
        sign_test_p_value(wins, rounds)  # type: ignore[arg-type]
