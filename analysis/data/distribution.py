"""Shape of a per-request latency distribution: mean and percentiles, and a bimodality test.

Pure Python (no numpy / pandas), so the load generator's live summary and the report
share one definition (docs/metrics.md, "Distributions").

Bimodality (``bimodality``) is flagged when both of two simple, documented tests agree:

- Sarle's bimodality coefficient BC = (g1^2 + 1) / (g2 + 3 (n-1)^2 / ((n-2)(n-3)))
  with g1 the sample skewness and g2 the sample excess kurtosis (SAS, Pfister et al.
  2013, Front. Psychol. 4:700) is above 5/9 (the uniform distribution's value); and
- the best split of the sorted values in two groups (the 1-D two-means split: the cut
  that minimises the within-group sum of squares, Fisher 1958 / Jenks) separates them by
  Ashman's D = sqrt(2) |m1 - m2| / sqrt(s1^2 + s2^2) >= 2 (Ashman et al. 1994), each group
  holding at least 10% of the values, and the high mode at least 20% above the low one.

The two modes reported are the two groups' medians. With fewer than ``MIN_N`` values
nothing is flagged.
"""

from __future__ import annotations

import math
from typing import Iterable

BC_THRESHOLD = 5.0 / 9.0
ASHMAN_D_MIN = 2.0
MIN_GROUP_SHARE = 0.10
# the two modes must differ by at least this share of the lower one: tight groups 0.3 ms apart
# (10.5 vs 10.8 ms) pass Ashman's D but are one mode for anyone reading a latency
MIN_MODE_GAP = 0.20
MIN_N = 20


def percentile(values: Iterable[float], q: float) -> float:
    """Percentile ``q`` (0..100), linear interpolation (numpy's default); NaN for no data."""
    v = sorted(x for x in values if x is not None and not math.isnan(x))
    if not v:
        return math.nan
    k = (len(v) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def _median(v: list[float]) -> float:
    return percentile(v, 50)


def bimodality_coefficient(values: list[float]) -> float:
    """Sarle's bimodality coefficient (sample skewness and excess kurtosis, bias-corrected);
    NaN with fewer than 4 values or zero spread."""
    n = len(values)
    if n < 4:
        return math.nan
    m = sum(values) / n
    m2 = sum((x - m) ** 2 for x in values) / n
    if m2 <= 0:
        return math.nan
    m3 = sum((x - m) ** 3 for x in values) / n
    m4 = sum((x - m) ** 4 for x in values) / n
    g1 = math.sqrt(n * (n - 1)) / (n - 2) * m3 / m2 ** 1.5
    g2 = (n - 1) / ((n - 2) * (n - 3)) * ((n + 1) * (m4 / m2 ** 2 - 3) + 6)
    return (g1 ** 2 + 1) / (g2 + 3 * (n - 1) ** 2 / ((n - 2) * (n - 3)))


def two_means_split(values: list[float]) -> tuple[list[float], list[float]] | None:
    """The cut of the sorted values in two non-empty groups that minimises the summed
    within-group squared deviations; None with fewer than 2 values."""
    v = sorted(values)
    n = len(v)
    if n < 2:
        return None
    pre, pre2 = [0.0], [0.0]
    for x in v:
        pre.append(pre[-1] + x)
        pre2.append(pre2[-1] + x * x)

    def sse(a: int, b: int) -> float:   # values v[a:b]
        s, s2, k = pre[b] - pre[a], pre2[b] - pre2[a], b - a
        return s2 - s * s / k

    best = min(range(1, n), key=lambda i: sse(0, i) + sse(i, n))
    return v[:best], v[best:]


def bimodality(values: Iterable[float]) -> dict:
    """``{"n", "bc", "ashman_d", "bimodal", "low_mode", "high_mode", "low_share"}`` of the
    values (NaN / None dropped); ``bimodal`` per the module's two tests."""
    v = [float(x) for x in values if x is not None and not math.isnan(float(x))]
    out = {"n": len(v), "bc": bimodality_coefficient(v), "ashman_d": math.nan, "bimodal": False,
           "low_mode": math.nan, "high_mode": math.nan, "low_share": math.nan}
    split = two_means_split(v)
    if split is None:
        return out
    lo, hi = split
    def var(g: list[float]) -> float:
        m = sum(g) / len(g)
        return sum((x - m) ** 2 for x in g) / len(g)
    spread = math.sqrt(var(lo) + var(hi))
    d = math.inf if spread == 0 else math.sqrt(2) * abs(sum(hi) / len(hi) - sum(lo) / len(lo)) / spread
    out.update(ashman_d=d, low_mode=_median(lo), high_mode=_median(hi), low_share=len(lo) / len(v))
    out["bimodal"] = bool(len(v) >= MIN_N and not math.isnan(out["bc"]) and out["bc"] > BC_THRESHOLD
                          and d >= ASHMAN_D_MIN and min(len(lo), len(hi)) >= MIN_GROUP_SHARE * len(v)
                          and out["high_mode"] >= (1 + MIN_MODE_GAP) * out["low_mode"])
    return out


def describe(values: Iterable[float]) -> dict:
    """mean, p50, p90, p99 of the values (NaN / None dropped; NaN for no data)."""
    v = [float(x) for x in values if x is not None and not math.isnan(float(x))]
    return {"mean": sum(v) / len(v) if v else math.nan, "p50": percentile(v, 50),
            "p90": percentile(v, 90), "p99": percentile(v, 99)}
