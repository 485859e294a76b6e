"""Synthetic results with known answers for the analysis tests.

``write_run`` writes a run directory (requests.parquet, steps.parquet,
manifest.json) whose throughputs, SLO violations, acceptance statistics and
step costs are set exactly, so the tests can assert the analysis recovers:

- speedups per users level -> the measured crossover concurrency;
- SLO violations -> the best strategy per tier (goodput, not raw speed);
- step_ms = max(FLOOR_MS, INTERCEPT_MS + SLOPE_MS * batch_tokens) -> the step cost
  model's floor, slope and knee KNEE_TOKENS (the request-side throughputs are set
  apart from it, so a predicted crossover is tested on tests/capacity_synth.py);
- per-position accepted counts -> acceptance length tau.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from configs import metric_names as mn

FLOOR_MS, INTERCEPT_MS, SLOPE_MS = 5.0, 1.0, 0.05
KNEE_TOKENS = (FLOOR_MS - INTERCEPT_MS) / SLOPE_MS      # 80 tokens
AR_TOKENS_PER_S = {1: 50.0, 8: 300.0, 64: 900.0}        # autoregressive, per users level
OUTPUT_TOKENS = {"short": 32, "long": 128}
DRAFTS_PER_REQUEST = 10
SLO = {"low": {"ttft_ms": 500.0, "tpot_ms": 1000.0},
       "mid": {"ttft_ms": 500.0, "tpot_ms": 1000.0},
       "high": {"ttft_ms": 500.0, "tpot_ms": 1000.0}}
TIERS = {"low": 1, "mid": 8, "high": 64}


@dataclass
class Strat:
    """A synthetic strategy: speedup per users level, per-position acceptance
    rates (unconditional, tau = 1 + sum), draft length k, draft ms per step,
    share of requests violating TTFT per tier."""

    name: str
    speedup: dict[int, float]
    accept_rates: tuple[float, ...] = ()
    draft_ms: float = 0.0
    ttft_violation: dict[str, float] = field(default_factory=dict)

    @property
    def tau(self) -> float:
        return 1.0 + sum(self.accept_rates)

    @property
    def k(self) -> int:
        return len(self.accept_rates)


AR = Strat(mn.AUTOREGRESSIVE, {1: 1.0, 8: 1.0, 64: 1.0})
# dflash: speedup 3.0 / 2.0 / 0.6 -> measured crossover 8 + (2-1)/(2-0.6)*56 = 48 users;
# tau = 4.0 with k = 7; half its mid-tier requests miss the TTFT SLO.
DFLASH = Strat(mn.DFLASH, {1: 3.0, 8: 2.0, 64: 0.6}, (0.9, 0.8, 0.6, 0.4, 0.2, 0.1, 0.0),
               draft_ms=0.5, ttft_violation={"mid": 0.5})
# ngram: 1.5 / 1.1 / 0.9 -> crossover 8 + 0.1/0.2*56 = 36 users; tau = 2.5 with k = 3.
NGRAM = Strat(mn.NGRAM, {1: 1.5, 8: 1.1, 64: 0.9}, (0.7, 0.5, 0.3), draft_ms=0.2)
STRATS = (AR, DFLASH, NGRAM)
# Known answers (hand-computed from the numbers above).
MEASURED_CROSSOVER = {mn.DFLASH: 48.0, mn.NGRAM: 36.0}
# mid: dflash goodput = 2.0 * 0.5 = 1.0x AR < ngram's 1.1x; high: nothing beats AR.
BEST = {"low": mn.DFLASH, "mid": mn.NGRAM, "high": mn.AUTOREGRESSIVE}
DATASETS = ("humaneval", "pydoc")


def _requests(strat: Strat, tier: str, users: int, oc: str, run_id: str, t0: float,
              tau_scale: dict[str, float], ar_tps: dict[int, float]) -> list[dict]:
    n = max(40, 2 * users)
    length = OUTPUT_TOKENS[oc]
    tput = ar_tps[users] * strat.speedup.get(users, 1.0)
    duration = n * length / tput                  # wall time -> exact tokens/s
    e2e = users * length / tput                   # Little's law for a closed loop
    sched = t0 + np.linspace(0.0, duration - e2e, n)
    n_bad = int(round(strat.ttft_violation.get(tier, 0.0) * n))
    rows = []
    for i in range(n):
        ttft = 5000.0 if i < n_bad else 50.0
        e2e_i = max(e2e * 1000.0, ttft + 1.0)
        dataset = DATASETS[i % len(DATASETS)]
        scale = tau_scale.get(dataset, 1.0)
        per_pos = [int(round(DRAFTS_PER_REQUEST * r * scale)) for r in strat.accept_rates]
        row = {mn.REQ_RUN_ID: run_id, mn.REQ_STRATEGY: strat.name, mn.REQ_TIER: tier,
               mn.REQ_OUTPUT_CLASS: oc, mn.REQ_DATASET: dataset, mn.REQ_PROMPT_ID: f"p{i}",
               mn.REQ_USERS: users, mn.REQ_SCHEDULED_TS: sched[i], mn.REQ_SENT_TS: sched[i],
               mn.REQ_FIRST_TOKEN_TS: sched[i] + ttft / 1000.0,
               mn.REQ_END_TS: sched[i] + e2e,
               mn.REQ_TTFT_MS: ttft, mn.REQ_TPOT_MS: (e2e_i - ttft) / (length - 1),
               mn.REQ_ITL_P50_MS: (e2e_i - ttft) / (length - 1),
               mn.REQ_ITL_P99_MS: 2 * (e2e_i - ttft) / (length - 1),
               mn.REQ_E2E_MS: e2e_i, mn.REQ_OUTPUT_TOKENS: length, mn.REQ_PROMPT_TOKENS: 100,
               mn.REQ_STATUS: "ok", mn.REQ_ERROR: None,
               mn.NUM_DRAFTS: DRAFTS_PER_REQUEST if strat.k else 0,
               mn.NUM_DRAFT_TOKENS: DRAFTS_PER_REQUEST * strat.k,
               mn.NUM_ACCEPTED_TOKENS: sum(per_pos),
               mn.NUM_ACCEPTED_TOKENS_PER_POS: per_pos,
               mn.DRAFT_MS: 1.0, mn.VERIFY_MS: 2.0, mn.QUEUE_MS: 0.0}
        rows.append(row)
    return rows


def _steps(strat: Strat, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    rows = []
    for batch in range(1, 65):
        for _ in range(3):
            verif = batch * (strat.k + 1)
            verify_ms = max(FLOOR_MS, INTERCEPT_MS + SLOPE_MS * verif)
            verify_ms *= 1.0 + 0.002 * rng.standard_normal()
            emitted = batch * strat.tau
            rows.append({mn.STEP_TS: 1.0e9 + len(rows), mn.STEP_STRATEGY: strat.name,
                         mn.STEP_REPLICA: "r0", mn.STEP_BATCH_SIZE: batch,
                         mn.STEP_PREFILL_TOKENS: 0, mn.STEP_VERIFICATION_TOKENS: verif,
                         mn.STEP_DRAFT_TOKENS: batch * strat.k,
                         mn.STEP_ACCEPTED_TOKENS: emitted - batch,
                         mn.STEP_EMITTED_TOKENS: emitted,
                         mn.STEP_MS: verify_ms + strat.draft_ms, mn.STEP_DRAFT_MS: strat.draft_ms,
                         mn.STEP_VERIFY_MS: verify_ms, mn.STEP_QUEUE_DEPTH: 0})
    return rows


def sampled(strat: Strat, scale: float) -> Strat:
    """``strat`` at a sampling setting whose acceptance rates and speedup gain are ``scale``
    times the greedy ones (speedup = 1 + scale * (speedup - 1))."""
    return Strat(strat.name, {u: 1.0 + scale * (v - 1.0) for u, v in strat.speedup.items()},
                 tuple(r * scale for r in strat.accept_rates), strat.draft_ms,
                 dict(strat.ttft_violation))


def synth_tau(strat: Strat, scale: float = 1.0) -> float:
    """The tau the rows of ``write_run`` give ``strat`` at ``scale`` (per-position counts are
    rounded to integers per request, as a real run's are)."""
    if not strat.k:
        return 1.0
    acc = sum(int(round(DRAFTS_PER_REQUEST * r * scale)) for r in strat.accept_rates)
    return 1.0 + acc / DRAFTS_PER_REQUEST


def write_run(path: Path, run_id: str = "run-a", strats=STRATS, tiers=None,
              tau_scale: dict[str, float] | None = None, with_steps: bool = True,
              with_spec_columns: bool = True, manifest_slo: dict | None = SLO,
              ar_tps: dict[int, float] | None = None,
              samplings: dict[str, tuple[float, float]] | None = None,
              manifest_extra: dict | None = None, aa: bool = True) -> Path:
    """Write one synthetic run directory; ``tau_scale`` scales accepted counts per
    dataset (e.g. {"pydoc": 0.8} for a known acceptance drop); ``tiers`` maps
    tier -> users; ``ar_tps`` maps users -> autoregressive tokens/s. ``samplings``:
    label -> (temperature, scale): every cell once per label with columns ``sampling`` /
    ``temperature``, acceptance and speedup gain scaled (``sampled``); None: no such
    columns (a run before schema 4). ``manifest_extra`` is merged into the manifest.
    ``aa``: autoregressive runs every cell twice (repeat 1: the run's A/A, identical
    numbers), so the decisions have a measured noise (zero here: exact answers)."""
    path.mkdir(parents=True, exist_ok=True)
    tiers = tiers or TIERS
    rows = []
    t0 = 1.7e9
    for label, (temp, scale) in (samplings or {None: (None, 1.0)}).items():
        for strat in strats:
            for tier, users in tiers.items():
                for oc in OUTPUT_TOKENS:
                    new = _requests(sampled(strat, scale), tier, users, oc, run_id, t0,
                                    tau_scale or {}, ar_tps or AR_TOKENS_PER_S)
                    for r in new:
                        r[mn.REQ_REPEAT] = 0
                    if aa and strat.name == mn.AUTOREGRESSIVE:
                        again = _requests(sampled(strat, scale), tier, users, oc, run_id, t0 + 5_000.0,
                                          tau_scale or {}, ar_tps or AR_TOKENS_PER_S)
                        new += [{**r, mn.REQ_REPEAT: 1} for r in again]
                    if label is not None:
                        for r in new:
                            r[mn.REQ_SAMPLING], r[mn.REQ_TEMPERATURE] = label, temp
                    rows += new
                    t0 += 10_000.0
    df = pd.DataFrame(rows)
    if not with_spec_columns:
        df = df.drop(columns=[c for c in df.columns if c.startswith("num_") or c.endswith("_per_pos")
                              or c in (mn.DRAFT_MS, mn.VERIFY_MS, mn.QUEUE_MS)])
    df.to_parquet(path / "requests.parquet")
    if with_steps:
        steps = [r for i, s in enumerate(strats) for r in _steps(s, seed=i)]
        pd.DataFrame(steps).to_parquet(path / "steps.parquet")
    config = {"profile": "synthetic"}
    if manifest_slo is not None:
        config["slo"] = manifest_slo
    (path / "manifest.json").write_text(json.dumps({
        "run_id": run_id, "started": "2026-01-01T00:00:00Z", "config": config,
        "versions": {"specload": "test"}, "git_sha": "0" * 40, "machine": {"cpus": 2},
        **(manifest_extra or {})}))
    return path
