"""Intervals for the numbers experiments report: a t-interval over seeds and a bootstrap over problems.

Pure Python (no scipy in the dependencies for one quantile).
"""

from __future__ import annotations

import math
import random
import statistics

LEVEL = 0.95


def t_quantile(p: float, df: int) -> float:
    """The p-quantile (0.5 <= p < 1) of Student's t with df degrees of freedom.

    Bisection on the CDF, 0.5 + the integral of the density from 0 (Simpson's rule, 2,000 intervals):
    accurate to about 1e-6 for the 95% intervals used here, without scipy in the dependencies.
    """
    log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)

    def density(t: float) -> float:
        return math.exp(log_c - (df + 1) / 2 * math.log1p(t * t / df))

    def cdf(x: float, n: int = 2000) -> float:
        h = x / n
        inner = sum((4 if i % 2 else 2) * density(i * h) for i in range(1, n))
        return 0.5 + (density(0.0) + inner + density(x)) * h / 3

    lo, hi = 0.0, 1.0
    while cdf(hi) < p:
        lo, hi = hi, 2 * hi
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) < p else (lo, mid)
    return (lo + hi) / 2


def t_interval(values: list[float], level: float = LEVEL) -> tuple[float, float | None, float | None]:
    """(mean, low, high): the t-interval for the mean of `values`; no interval (None, None) from one value."""
    m = statistics.fmean(values)
    if len(values) < 2:
        return m, None, None
    half = t_quantile(0.5 + level / 2, len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    return m, m - half, m + half


def _bootstrap_means(per_problem: list[float], draws: int) -> list[float]:
    """The sorted means of `draws` resamples (with replacement, fixed seed) of `per_problem`."""
    rng = random.Random(0)
    n = len(per_problem)
    return sorted(sum(rng.choices(per_problem, k=n)) / n for _ in range(draws))


def bootstrap_interval(per_problem: list[float], level: float = LEVEL, draws: int = 2000) -> tuple[float, float]:
    """Percentile bootstrap over problems of the mean of `per_problem` (fixed seed: the same data, the same
    interval). The evaluation noise of one model on one test set; the seed intervals include it."""
    means = _bootstrap_means(per_problem, draws)
    return means[int((1 - level) / 2 * draws)], means[int((1 + level) / 2 * draws) - 1]


def bootstrap_test(differences: list[float], level: float = LEVEL, draws: int = 10_000) -> tuple[float, float, float]:
    """(low, high, p): the percentile bootstrap interval of the mean of paired per-problem `differences`, and the
    two-sided p-value of "mean 0" read off the same resamples: twice the smaller share of resampled means on
    either side of 0 (at most 1), so p < 1 - level about when the interval leaves 0 out."""
    means = _bootstrap_means(differences, draws)
    below = sum(m <= 0 for m in means) / draws
    above = sum(m >= 0 for m in means) / draws
    low, high = means[int((1 - level) / 2 * draws)], means[int((1 + level) / 2 * draws) - 1]
    return low, high, min(1.0, 2 * min(below, above))


def holm(pvalues: list[float]) -> list[float]:
    """Holm's step-down adjustment of `pvalues` (family-wise error over all of them), in their order: the i-th
    smallest p times (m - i + 1), made non-decreasing along that order, at most 1."""
    m = len(pvalues)
    adjusted = [0.0] * m
    running = 0.0
    for rank, index in enumerate(sorted(range(m), key=lambda i: pvalues[i])):
        running = max(running, min(1.0, (m - rank) * pvalues[index]))
        adjusted[index] = running
    return adjusted


def problem_accuracy(rewards: list[float]) -> float:
    """One problem's accuracy: the share of its scored samples (sandbox errors left out, so non-empty) that
    are right. A problem with no scored sample has none and is left out of every mean by the caller."""
    return sum(r > 0 for r in rewards) / len(rewards)
