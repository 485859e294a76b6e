"""Calibration of the confidence head (DSpark, arXiv 2607.05147, confidence-scheduled verification).

Shared by training (``train.drafter_card``) and evaluation (``bench.acceptance``).
"""

from __future__ import annotations

import numpy as np


def ece(p: np.ndarray, y: np.ndarray, bins: int = 15) -> float:
    """Expected calibration error with equal-width bins."""
    idx = np.minimum((p * bins).astype(int), bins - 1)
    tot = 0.0
    for b in range(bins):
        m = idx == b
        if m.any():
            tot += m.sum() * abs(p[m].mean() - y[m].mean())
    return float(tot / max(len(p), 1))
