"""Summaries over seeds: mean, sample standard deviation, and the "exceeds the spread" rule the chapter uses.

With three seeds a confidence interval is crude; the lab uses a rule that needs no distribution:
``a`` is *separated above* ``b`` when every seed of ``a`` beats every seed of ``b``
(``min(a) > max(b)``), i.e. the seed ranges do not overlap. With ``k`` seeds each and no true
difference (exchangeable values) that happens by chance with probability ``k! k! / (2k)!``
(``1/20`` for ``k = 3``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from .._validation import check_int


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    r"""``(mean, s)`` with the sample standard deviation ``s = sqrt(sum (x - mean)^2 / (k - 1))`` (0 for one value).

    Example:
        >>> mean_std([1.0, 2.0, 3.0])
        (2.0, 1.0)
    """
    if not values:
        raise ValueError("mean_std needs at least one value")
    mean = sum(values) / len(values)
    if len(values) == 1:
        return mean, 0.0
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def separated(above: Sequence[float], below: Sequence[float]) -> bool:
    """True when every value of ``above`` exceeds every value of ``below`` (the seed ranges do not overlap).

    Example:
        >>> separated([0.8, 0.9], [0.5, 0.7]), separated([0.8, 0.9], [0.5, 0.85])
        (True, False)
    """
    if not above or not below:
        raise ValueError("separated needs values on both sides")
    return min(above) > max(below)


def chance_of_separation(seeds: int) -> float:
    """``k! k! / (2k)!``: the probability that ``k`` exchangeable values all exceed ``k`` others.

    Example:
        >>> chance_of_separation(3)
        0.05
    """
    return math.factorial(seeds) ** 2 / math.factorial(2 * seeds)


def format_mean_std(values: Sequence[float] | None, digits: int = 2) -> str:
    """``"0.93 ± 0.02"``, or ``"n/a"`` for a not-applicable entry (``None``)."""
    if values is None:
        return "n/a"
    mean, std = mean_std(values)
    return f"{mean:.{digits}f} ± {std:.{digits}f}"


def t_sf(t: float, df: int) -> float:
    r"""``P(T > t)`` for Student's t with an integer number of degrees of freedom ``df >= 1``.

    Closed form: with ``x = t / sqrt(df + t^2)``, even ``df`` gives
    ``1/2 - (x/2) sum_{j < df/2} C(2j, j) (1 - x^2)^j / 4^j``; odd ``df`` adds the Cauchy term
    ``atan(t / sqrt(df)) / pi`` to ``x sqrt(1 - x^2)/pi`` times a like sum (Abramowitz and Stegun 26.7.3-4).

    Example:
        >>> t_sf(1.0, 1), round(t_sf(2.0, 2), 6)
        (0.25, 0.091752)
    """
    if not isinstance(df, int) or isinstance(df, bool) or df < 1:
        raise ValueError(f"df must be an int >= 1, got {df!r}")
    if math.isinf(t):
        return 0.0 if t > 0 else 1.0
    x = t / math.sqrt(df + t * t)
    c2 = 1.0 - x * x  # cos^2 of the angle atan(t / sqrt(df))
    if df % 2 == 0:
        term, total = 1.0, 1.0
        for j in range(1, df // 2):
            term *= c2 * (2 * j - 1) / (2 * j)
            total += term
        return 0.5 - 0.5 * x * total
    angle = math.atan(t / math.sqrt(df))
    term, total = 1.0, 1.0 if df > 1 else 0.0
    for j in range(1, (df - 1) // 2):
        term *= c2 * (2 * j) / (2 * j + 1)
        total += term
    return 0.5 - (angle + x * math.sqrt(c2) * total) / math.pi


def welch_p_value(above: Sequence[float], below: Sequence[float]) -> float:
    r"""One-sided p-value of Welch's t-test for ``mean(above) > mean(below)``.

    ``t = (mean_a - mean_b) / sqrt(s_a^2/k_a + s_b^2/k_b)`` with the Welch-Satterthwaite degrees of
    freedom rounded *down* to an integer (heavier tails: a conservative p). It assumes the seeds'
    values are roughly normal. With no spread on either side the p-value is 0 when
    ``mean_a > mean_b``, else 1.

    Example:
        >>> round(welch_p_value([3.0, 4.0, 5.0], [0.0, 1.0, 2.0]), 4)  # t = 3.674, df = 4
        0.0107
    """
    if len(above) < 2 or len(below) < 2:
        raise ValueError("welch_p_value needs at least two values on each side")
    (ma, sa), (mb, sb) = mean_std(above), mean_std(below)
    va, vb = sa * sa / len(above), sb * sb / len(below)
    if va + vb == 0.0:
        return 0.0 if ma > mb else 1.0
    df = (va + vb) ** 2 / (va * va / (len(above) - 1) + vb * vb / (len(below) - 1))
    return t_sf((ma - mb) / math.sqrt(va + vb), max(1, math.floor(df + 1e-9)))


def holm(p_values: Sequence[float], alpha: float = 0.05) -> list[bool]:
    """Holm's step-down rejections at family-wise error ``alpha`` (Holm 1979), in the order given.

    The ``j``-th smallest p-value (``j = 0, 1, ...`` of ``N``) is rejected when it and every smaller
    one are ``<= alpha / (N - j)``: never fewer rejections than Bonferroni (``p <= alpha / N``).

    Example:
        >>> holm([0.01, 0.04, 0.03, 0.005], 0.05)
        [True, False, False, True]
    """
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must lie in (0, 1), got {alpha!r}")
    order = sorted(range(len(p_values)), key=lambda i: p_values[i])
    rejected = [False] * len(p_values)
    for j, i in enumerate(order):
        if p_values[i] > alpha / (len(p_values) - j):
            break
        rejected[i] = True
    return rejected


def sign_test_p_value(wins: int, rounds: int, *, two_sided: bool = False) -> float:
    """The sign test's p-value: the chance of ``wins`` or more of ``rounds`` paired rounds under a fair coin.

    One-sided, ``P(X >= wins)`` for ``X ~ Binomial(rounds, 1/2)``; two-sided, twice the tail at
    ``max(wins, rounds - wins)``, at most 1.

    Example:
        >>> sign_test_p_value(8, 11)  # (165 + 55 + 11 + 1) / 2**11
        0.11328125
    """
    rounds = check_int(rounds, "rounds", minimum=1)
    wins = check_int(wins, "wins", minimum=0)
    if wins > rounds:
        raise ValueError(f"wins must be at most rounds ({rounds}), got {wins}")
    far = max(wins, rounds - wins) if two_sided else wins
    tail = sum(math.comb(rounds, j) for j in range(far, rounds + 1)) / 2**rounds
    return min(1.0, 2 * tail) if two_sided else tail
