"""Predicted SLO attainment of one replica under open-loop Poisson arrivals, from the
step cost model (``analysis.model.stepcost`` via the calibrated ``analysis.model.backtest.CellModel``).

A replica is a birth-death queue (Kleinrock 1975, *Queueing Systems* vol. 1, ch. 3):
state k = requests in the replica (running + waiting). Arrivals are Poisson at rate
``r`` (requests/s); with k requests in the replica the engine runs a batch of
``b = min(k, S)`` (S = ``max_num_seqs``) and completes requests at

    X(b) = tokens/s(b) / L        (L = mean output tokens; tokens/s from the CellModel)

so the departure rate in state k is X(min(k, S)). Beyond S + W requests (W =
``max_waiting``) the engine answers 429 (a miss). The stationary distribution is
``pi_k ∝ prod_{j<=k} r / X(min(j, S))``; a batched engine serves its requests
together, like a processor-sharing server, whose queue-length distribution does not
depend on the service-time distribution (Kelly 1979, *Reversibility and Stochastic
Networks*, section 3.3, symmetric queues), so exponential service is not assumed
for it. An arrival sees pi (PASTA, Wolff 1982).

Per request, from the state k it finds on arrival:

- TTFT(k) = ttft_a + ttft_b * step_ms(min(k + 1, S)) + wait, with wait =
  (k + 1 - S) / X(S) s when the batch is full (FCFS: that many departures first);
  ttft_a, ttft_b fitted on the measured cells (TTFT p50 against the model's step ms);
- TPOT = the size-biased mean over pi of TPOT(b) (a request in service sees batch
  b for a share of time proportional to b * pi_k).

Each is multiplied by the measured per-request spread: the (TTFT, TPOT) of every
measured request over its cell's median, pooled over the measured users levels
(failed requests: infinite, a miss). Attainment = sum_k pi_k * share of those
spreads meeting both SLOs; rejected arrivals (k = S + W) and an unstable queue
(``r >= X(S)``: the queue grows past every bound) count as misses.

Concurrency beyond the highest measured users level is extrapolated by the step
cost model; ``ReplicaPrediction.extrapolated`` says when the states that matter
(the 99th percentile of k) lie there.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from analysis.model import backtest as bt
from configs import metric_names as mn
from configs.tiers import Slo

MAX_RATE_ITER = 60
DEFAULT_MAX_WAITING = 1024   # actors.engine.config.EngineConfig.max_waiting's default


@dataclass(frozen=True)
class ReplicaPrediction:
    """What the queue model says for one replica at one arrival rate."""

    rate_rps: float            # offered Poisson arrivals, requests/s
    attainment: float          # share of arrivals meeting both SLOs (0..1)
    mean_in_system: float      # E[k], requests
    p99_in_system: int         # 99th percentile of k
    reject_share: float        # arrivals finding S + W requests (429)
    tpot_ms: float             # size-biased mean TPOT before the spread
    ttft_ms_p50: float         # median over arrivals of TTFT(k) before the spread
    stable: bool               # rate below the saturation throughput X(S)
    extrapolated: bool         # p99 of k beyond the highest measured users level


@dataclass(frozen=True)
class ReplicaModel:
    """One replica of ``strategy`` serving ``output_class`` requests (see module doc).

    ``cell``: the calibrated step cost model; ``out_tokens``: mean output tokens per
    request; ``ttft_ab``: (ms, ms per step ms); ``spread``: [R, 2] per measured request
    (TTFT / cell median, TPOT / cell median); ``max_num_seqs`` S, ``max_waiting`` W;
    ``measured_users``: the highest users level measured."""

    strategy: str
    output_class: str
    cell: bt.CellModel
    out_tokens: float
    ttft_ab: tuple[float, float]
    spread: np.ndarray
    max_num_seqs: int
    max_waiting: int
    measured_users: int

    def batch_curve(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(X(b) requests/s, TPOT(b) ms, step(b) ms) for b = 1..S, each shape [S]."""
        b = np.arange(1, self.max_num_seqs + 1, dtype=float)
        tps, tpot = self.cell.predict(b, batch=True)
        step = np.asarray(tpot, float) * self.cell.workload.tau
        return np.asarray(tps, float) / max(self.out_tokens, 1.0), np.asarray(tpot, float), step

    def saturation_rps(self) -> float:
        """X(S): the most requests/s the replica completes (batch full)."""
        return float(self.batch_curve()[0][-1])

    def predict(self, rate_rps: float, slo: Slo) -> ReplicaPrediction:
        """Stationary attainment at ``rate_rps`` Poisson arrivals (requests/s, > 0)."""
        x, tpot_b, step_b = self.batch_curve()
        s, cap = self.max_num_seqs, self.max_num_seqs + self.max_waiting
        k = np.arange(cap + 1)
        served = np.minimum(np.maximum(k, 1), s) - 1            # index into the [S] curves
        stable = bool(rate_rps < x[-1])
        # log pi_k = sum_{j=1..k} log(r / X(min(j, S)))
        logp = np.concatenate([[0.0], np.cumsum(np.log(rate_rps) - np.log(x[served[1:]]))])
        pi = np.exp(logp - logp.max())
        pi /= pi.sum()
        in_service = np.minimum(k, s)
        w = pi * in_service
        tpot = float(np.sum(w[1:] * tpot_b[served[1:]]) / w.sum()) if w.sum() > 0 else float(tpot_b[0])
        nxt = np.minimum(k + 1, s) - 1
        wait_ms = np.where(k + 1 > s, 1000.0 * (k + 1 - s) / x[-1], 0.0)
        ttft = self.ttft_ab[0] + self.ttft_ab[1] * step_b[nxt] + wait_ms   # [cap + 1]
        q_ttft, q_tpot = self.spread[:, 0], self.spread[:, 1]
        ok_tpot = q_tpot * tpot <= slo.tpot_ms                            # [R]
        ok = (q_ttft[None, :] * ttft[:-1, None] <= slo.ttft_ms) & ok_tpot[None, :]
        att = float(np.sum(pi[:-1] * ok.mean(axis=1))) if stable else 0.0
        cdf = np.cumsum(pi)
        p99 = int(np.searchsorted(cdf, 0.99))
        order = np.argsort(ttft[:-1])
        c = np.cumsum(pi[:-1][order])
        ttft50 = float(ttft[:-1][order][min(np.searchsorted(c, 0.5 * c[-1]), len(order) - 1)])
        return ReplicaPrediction(rate_rps=float(rate_rps), attainment=att,
                                 mean_in_system=float(np.sum(k * pi)), p99_in_system=p99,
                                 reject_share=float(pi[-1]), tpot_ms=tpot, ttft_ms_p50=ttft50,
                                 stable=stable,
                                 extrapolated=bool(min(p99, s) > self.measured_users))

    def slo_capacity_rps(self, slo: Slo, target: float) -> float:
        """The highest arrival rate (requests/s) whose predicted attainment >= ``target``
        (bisection on (0, X(S)), to 0.1 %); 0 when even a trickle misses it."""
        hi = self.saturation_rps()
        lo = hi * 1e-6
        if self.predict(lo, slo).attainment < target:
            return 0.0
        for _ in range(MAX_RATE_ITER):
            mid = 0.5 * (lo + hi)
            lo, hi = (mid, hi) if self.predict(mid, slo).attainment >= target else (lo, mid)
            if hi - lo <= 1e-3 * hi:
                break
        return float(lo)


def replicas_needed(model: ReplicaModel, qps: float, slo: Slo, target: float,
                    max_replicas: int = 10_000) -> tuple[int | None, ReplicaPrediction | None,
                                                         ReplicaPrediction | None]:
    """Smallest N with predicted attainment at ``qps / N`` per replica >= ``target``
    (arrivals split evenly); returns (N, prediction at N, prediction at N - 1 or None
    for N = 1). (None, None, None) when no N up to ``max_replicas`` meets it."""
    cap = model.slo_capacity_rps(slo, target)
    if cap <= 0:
        return None, None, None
    n = max(1, int(np.floor(qps / cap)))   # the bisection's rate: start just below the answer
    while n > 1 and model.predict(qps / (n - 1), slo).attainment >= target:
        n -= 1
    while n <= max_replicas:
        at_n = model.predict(qps / n, slo)
        if at_n.attainment >= target:
            below = model.predict(qps / (n - 1), slo) if n > 1 else None
            return n, at_n, below
        n += 1
    return None, None, None


def request_spread(flagged: pd.DataFrame) -> np.ndarray:
    """[R, 2]: each request's (TTFT, TPOT) over its cell's median (ok requests);
    failed requests +inf (always a miss). Cells: run x tier x users x repeat."""
    keys = [c for c in (mn.REQ_RUN_ID, mn.REQ_TIER, mn.REQ_USERS, mn.REQ_REPEAT) if c in flagged]
    out = []
    for _, g in flagged.groupby(keys, dropna=False):
        ok = g[mn.REQ_STATUS].eq(mn.STATUS_OK)
        med_ttft, med_tpot = g.loc[ok, mn.REQ_TTFT_MS].median(), g.loc[ok, mn.REQ_TPOT_MS].median()
        ttft = np.where(ok, g[mn.REQ_TTFT_MS] / med_ttft if med_ttft > 0 else 1.0, np.inf)
        tpot = np.where(ok, g[mn.REQ_TPOT_MS].fillna(med_tpot) / med_tpot if med_tpot > 0 else 1.0,
                        np.inf)
        out.append(np.column_stack([ttft, tpot]))
    return np.vstack(out) if out else np.ones((1, 2))


def fit_ttft(cell: bt.CellModel, measured: pd.DataFrame) -> tuple[float, float]:
    """(a ms, b) of TTFT p50 = a + b * step_ms(users) over the measured users levels
    (non-negative least squares; one level: a = 0, b = the ratio).
    ``measured``: columns users, ttft_ms_p50."""
    from scipy.optimize import nnls

    m = measured.dropna()
    if m.empty:
        return 0.0, 1.0
    _, tpot = cell.predict(m[mn.REQ_USERS].to_numpy(float))
    step = np.asarray(tpot, float) * cell.workload.tau
    y = m["ttft_ms_p50"].to_numpy(float)
    if len(m) == 1 or np.ptp(step) == 0:
        return 0.0, float(y.mean() / max(step.mean(), 1e-9))
    coef, _ = nnls(np.column_stack([np.ones_like(step), step]), y)
    return float(coef[0]), float(coef[1])


def engine_limits(strategy: str, base=None) -> tuple[int, int]:
    """(max_num_seqs, max_waiting) of ``strategy`` in the Serve config ``base`` (default
    configs/serve.yaml, what ``plan --validate`` deploys); the engine defaults when absent."""
    import yaml

    from configs.paths import CONFIGS_DIR
    from configs.serve_config import ENGINE_DEFAULT_MAX_NUM_SEQS

    cfg = yaml.safe_load(Path(base or CONFIGS_DIR / "serve.yaml").read_text(encoding="utf-8"))
    for app in cfg.get("applications") or []:
        for e in (app.get("args") or {}).get("strategies") or []:
            eng = e.get("engine") or {}
            if eng.get("strategy") == strategy:
                return (int(eng.get("max_num_seqs", ENGINE_DEFAULT_MAX_NUM_SEQS)),
                        int(eng.get("max_waiting", DEFAULT_MAX_WAITING)))
    return ENGINE_DEFAULT_MAX_NUM_SEQS, DEFAULT_MAX_WAITING


def fit_replica_models(results, flagged: pd.DataFrame, cells: pd.DataFrame,
                       limits=engine_limits, notes: list[str] | None = None
                       ) -> dict[tuple[str, str], ReplicaModel]:
    """{(strategy, output_class): ReplicaModel} fitted on every users level of the run
    (the step cost model of ``analysis.model.stepcost``, calibrated as in the backtest).
    ``limits(strategy) -> (max_num_seqs, max_waiting)``. Empty without a step log;
    ``notes`` as in ``analysis.model.backtest.fit_all_levels``."""
    cell_models = bt.fit_all_levels(results, flagged, cells, notes)
    out = {}
    for (strategy, oc), cm in cell_models.items():
        req = flagged[flagged[mn.REQ_STRATEGY].eq(strategy) & flagged[mn.REQ_OUTPUT_CLASS].eq(oc)]
        ok = req[req[mn.REQ_STATUS].eq(mn.STATUS_OK)]
        measured = (ok.groupby(mn.REQ_USERS)[mn.REQ_TTFT_MS].median().rename("ttft_ms_p50")
                    .reset_index())
        s, w = limits(strategy)
        out[(strategy, oc)] = ReplicaModel(
            strategy=strategy, output_class=oc, cell=cm,
            out_tokens=float(ok[mn.REQ_OUTPUT_TOKENS].mean()) if len(ok) else 1.0,
            ttft_ab=fit_ttft(cm, measured), spread=request_spread(req),
            max_num_seqs=s, max_waiting=w, measured_users=int(req[mn.REQ_USERS].max()))
    return out
