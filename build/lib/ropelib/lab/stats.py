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
