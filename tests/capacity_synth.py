"""Synthetic runs generated from a known step cost model (for the capacity tests).

Every cell is a closed loop of N users on one replica whose decode step costs

    verify_ms = FLOOR + ROW_MS * B + TOKEN_MS * max(0, T - KNEE)     (T = B * (k + 1))
    step_ms   = verify_ms + DRAFT_MS[strategy]

with B = N (every user always in the batch). Each request emits L tokens in
L / tau steps, so TPOT = step_ms / tau, e2e = L * TPOT and a cell's output
tokens/s = 1000 * N * tau / step_ms exactly. The true speedup curve and its
crossover follow from these numbers alone (``true_speedup``).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from configs import metric_names as mn

FLOOR, ROW_MS, TOKEN_MS, KNEE = 4.0, 0.05, 0.08, 48.0
K = {mn.AUTOREGRESSIVE: 0, mn.DFLASH: 7}
TAU = {mn.AUTOREGRESSIVE: 1.0, mn.DFLASH: 3.0}
DRAFT_MS = {mn.AUTOREGRESSIVE: 0.0, mn.DFLASH: 1.0}
OUT_TOKENS = {"short": 30, "long": 120}


def true_step_ms(strategy: str, users) -> np.ndarray:
    b = np.asarray(users, float)
    t = b * (K[strategy] + 1)
    return FLOOR + ROW_MS * b + TOKEN_MS * np.maximum(0.0, t - KNEE) + DRAFT_MS[strategy]


def true_speedup(users) -> np.ndarray:
    """dflash tokens/s over autoregressive tokens/s at ``users``."""
    s = TAU[mn.DFLASH] * 1000.0 * np.asarray(users, float) / true_step_ms(mn.DFLASH, users)
    a = 1000.0 * np.asarray(users, float) / true_step_ms(mn.AUTOREGRESSIVE, users)
    return s / a


def write_sweep_run(path: Path, levels=(1, 2, 4, 8, 16, 32), requests_per_user: int = 4,
                    seed: int = 0, slow: dict | None = None) -> Path:
    """One run directory: tier ``sweep``, both output classes, every level; step
    times carry 1% multiplicative noise. ``slow``: {users level: factor} the machine ran
    that level's cells slower by (every step and request time x factor)."""
    rng = np.random.default_rng(seed)
    path.mkdir(parents=True, exist_ok=True)
    rows, steps = [], []
    t0 = 1.7e9
    for strategy in (mn.AUTOREGRESSIVE, mn.DFLASH):
        k, tau = K[strategy], TAU[strategy]
        for oc, length in OUT_TOKENS.items():
            for n in levels:
                f = float((slow or {}).get(n, 1.0))
                step = float(true_step_ms(strategy, n)) * f
                tpot = step / tau
                e2e = length * tpot
                for u in range(n):
                    for j in range(requests_per_user):
                        start = t0 + j * e2e / 1000.0
                        acc = int(round((tau - 1.0) * length / tau))
                        drafts = int(round(length / tau)) if k else 0
                        rows.append({
                            mn.REQ_RUN_ID: "synth", mn.REQ_STRATEGY: strategy, mn.REQ_TIER: "sweep",
                            mn.REQ_OUTPUT_CLASS: oc, mn.REQ_USERS: n, mn.REQ_DATASET: "synthetic",
                            mn.REQ_PROMPT_ID: f"p{u}-{j}", mn.REQ_SCHEDULED_TS: start,
                            mn.REQ_SENT_TS: start, mn.REQ_FIRST_TOKEN_TS: start + tpot / 1000.0,
                            mn.REQ_END_TS: start + e2e / 1000.0, mn.REQ_TTFT_MS: tpot,
                            mn.REQ_TPOT_MS: tpot, mn.REQ_ITL_P50_MS: tpot, mn.REQ_ITL_P99_MS: tpot,
                            mn.REQ_E2E_MS: e2e, mn.REQ_OUTPUT_TOKENS: length,
                            mn.REQ_PROMPT_TOKENS: 50, mn.REQ_STATUS: mn.STATUS_OK,
                            mn.NUM_DRAFTS: drafts, mn.NUM_DRAFT_TOKENS: drafts * k,
                            mn.NUM_ACCEPTED_TOKENS: acc if k else 0})
                for _ in range(40):
                    verify = (step - f * DRAFT_MS[strategy]) * (1.0 + 0.01 * rng.standard_normal())
                    steps.append({
                        mn.STEP_TS: t0 + len(steps) * 1e-3, mn.STEP_STRATEGY: strategy,
                        mn.STEP_REPLICA: "r0", mn.STEP_BATCH_SIZE: n, mn.STEP_PREFILL_TOKENS: 0,
                        mn.STEP_VERIFICATION_TOKENS: n * (k + 1), mn.STEP_DRAFT_TOKENS: n * k,
                        mn.STEP_ACCEPTED_TOKENS: n * (tau - 1), mn.STEP_EMITTED_TOKENS: n * tau,
                        mn.STEP_MS: verify + f * DRAFT_MS[strategy],
                        mn.STEP_DRAFT_MS: f * DRAFT_MS[strategy],
                        mn.STEP_VERIFY_MS: verify, mn.STEP_QUEUE_DEPTH: 0,
                        mn.STEP_PADDED_TOKENS: n * (k + 1), mn.STEP_CONTEXT_TOKENS: n * 100,
                        mn.REQ_RUN_ID: "synth", mn.REQ_TIER: "sweep", mn.REQ_OUTPUT_CLASS: oc,
                        mn.REQ_USERS: n})
                t0 += 10_000.0
    pd.DataFrame(rows).to_parquet(path / "requests.parquet")
    pd.DataFrame(steps).to_parquet(path / "steps.parquet")
    (path / "manifest.json").write_text(json.dumps({"run_id": "synth", "schema_version": 2}))
    return path
