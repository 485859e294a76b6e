"""Speedup against concurrency on a device, from a run's acceptance and a measured step-cost
curve (``--cost-curve`` of ``python -m analysis plan`` / ``policy``).

At concurrency N (requests in one replica's batch, every one decoding) a strategy's
output tokens/s is ``N * tau / (g(N * v) * (1 + r))`` and autoregressive's ``N / g(N)``,
where g is the curve's step ms per batch tokens (``analysis.decide.plan.PointsCurve``),
tau the run's measured acceptance length (tokens per verify step, the target's own
counted), v the verification tokens per request per step and r the draft / verify time
ratio measured in the run. speedup(N) = tau * g(N) / (g(N v) (1 + r)). The crossover
concurrency is the smallest N whose speedup is below 1.

Per k (``by_k``): the run measured one k per strategy; other k are modelled with i.i.d.
per-token acceptance alpha (Leviathan et al. 2023, "Fast Inference from Transformers via
Speculative Decoding", eq. 1: tau(k) = (1 - alpha^(k+1)) / (1 - alpha)), alpha solved from
the measured (tau, k), v(k) = 1 + (v - 1) k / k_measured (drafted tokens per step scale with k;
k_measured: the step log's median ``num_speculative_tokens``, else round(v - 1)).

Measured vs modelled: a speedup point is ``measured`` when both step costs it uses, g(N) and
g(N v), lie inside the curve's measured batch-token range (interpolated between measured
grid points), else ``extrapolated`` (the curve's last slope); acceptance is the run's at the
measured k and ``modelled`` at every other k. The draft ratio r is the run's own device's,
not the curve's: on another device it is an assumption.
"""

from __future__ import annotations

import math

import numpy as np

from analysis.data import metrics
from analysis.model import capacity
from configs import metric_names as mn

KS = (1, 2, 3, 4, 5, 6, 7, 8)


def alpha_from_tau(tau: float, k: int) -> float:
    """Per-token acceptance alpha in [0, 1) with (1 - alpha^(k+1)) / (1 - alpha) = tau
    (bisection; tau clipped to [1, k + 1))."""
    tau = min(max(tau, 1.0), k + 1 - 1e-9)
    lo, hi = 0.0, 1.0 - 1e-12
    for _ in range(100):
        mid = (lo + hi) / 2
        if (1 - mid ** (k + 1)) / (1 - mid) < tau:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def tau_at_k(alpha: float, k: int) -> float:
    return (1 - alpha ** (k + 1)) / (1 - alpha)


def _speedups(curve, tau: float, v: float, r: float, ns: np.ndarray) -> np.ndarray:
    return tau * curve(ns) / (curve(ns * v) * (1.0 + r))


def _status(curve, n: float, v: float) -> str:
    lo, hi = curve.tokens[0], curve.tokens[-1]
    return "measured" if lo <= n and n * v <= hi else "extrapolated"


def crossover_rows(curve, results, max_batch: int = 1024,
                   grid: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)) -> list[dict]:
    """One row per speculative strategy x output class of the run (ok requests):
    {"strategy", "output_class", "k", "tau", "v", "draft_ratio", "speedup": [{"users",
    "speedup", "step_cost"}], "crossover_users", "crossover_step_cost", "by_k": [{"k",
    "tau", "acceptance", "crossover_users", "crossover_step_cost", "speedup_at_1"}]}.
    crossover_users None: the speedup stays >= 1 up to ``max_batch`` (or ``wins`` False: it
    is below 1 at every N)."""
    req = results.requests
    ok = req[req[mn.REQ_STATUS].eq(mn.STATUS_OK)]
    cap = capacity.capacity_table(results.steps)
    v_by = capacity.verification_per_request(cap, ok)
    ratio = capacity.draft_ratio(results.steps)
    ns = np.arange(1, max_batch + 1, dtype=float)
    k_by = {}
    st = results.steps
    if st is not None and not st.empty and mn.STEP_NUM_SPEC_TOKENS in st.columns:
        med = st[st[mn.STEP_NUM_SPEC_TOKENS].fillna(0) > 0].groupby(mn.STEP_STRATEGY)[
            mn.STEP_NUM_SPEC_TOKENS].median()
        k_by = {s_: int(round(x)) for s_, x in med.items()}
    rows = []
    for (strategy, oc), g in ok.groupby([mn.REQ_STRATEGY, mn.REQ_OUTPUT_CLASS]):
        if strategy == "autoregressive":
            continue
        tau = metrics.pooled_tau(g)
        v = float(v_by.get(strategy, 1.0))
        if math.isnan(tau) or v <= 1.0:
            continue
        r = float(ratio.get(strategy, 0.0))
        k = k_by.get(strategy) or max(1, int(round(v - 1)))
        row = {"strategy": strategy, "output_class": oc, "k": k, "tau": float(tau), "v": v,
               "draft_ratio": r}
        row.update(_cross(curve, tau, v, r, ns, "measured"))
        row["speedup"] = [{"users": n, "speedup": float(_speedups(curve, tau, v, r, np.array([n]))[0]),
                           "step_cost": _status(curve, n, v)} for n in grid if n <= max_batch]
        alpha = alpha_from_tau(tau, k)
        row["alpha"] = alpha
        row["by_k"] = []
        for kk in KS:
            t = tau if kk == k else tau_at_k(alpha, kk)
            vk = v if kk == k else 1.0 + (v - 1.0) * kk / k
            c = _cross(curve, t, vk, r, ns, "measured" if kk == k else "modelled")
            row["by_k"].append({"k": kk, "tau": t, **c})
        rows.append(row)
    return rows


def _cross(curve, tau, v, r, ns, acceptance: str) -> dict:
    s = _speedups(curve, tau, v, r, ns)
    wins = np.nonzero(s >= 1.0)[0]
    if not wins.size:   # never faster than autoregressive at any N
        return {"acceptance": acceptance, "speedup_at_1": float(s[0]), "wins": False,
                "crossover_users": None, "crossover_step_cost": None}
    below = np.nonzero(s[wins[0]:] < 1.0)[0]
    n = int(ns[wins[0] + below[0]]) if below.size else None
    return {"acceptance": acceptance, "speedup_at_1": float(s[0]), "wins": True,
            "crossover_users": n, "crossover_step_cost": None if n is None else _status(curve, n, v)}


def describe(curve_path, meta: dict, curve) -> str:
    """One assumption line: which curve, which points are measured."""
    return (f"speedup vs concurrency: step cost from {curve_path} ({meta.get('shape')}, "
            f"{meta.get('device')}, {meta.get('dtype', '?')}, context {meta.get('context_len')}, "
            f"clock {meta.get('clock')}); measured batch tokens {curve.tokens[0]:g}..{curve.tokens[-1]:g}, "
            "points beyond are extrapolated on the last slope; acceptance (tau, v) and the draft "
            "ratio are this run's, measured at its k; other k modelled (i.i.d. acceptance)")


def format_rows(rows: list[dict]) -> list[str]:
    """Text lines of the crossover table (plan / policy print them)."""
    if not rows:
        return ["  (no speculative strategy with measured acceptance in this run)"]
    out = []
    for r in rows:
        sp = ", ".join(f"N={p['users']}: {p['speedup']:.2f}x{'' if p['step_cost'] == 'measured' else '*'}"
                       for p in r["speedup"])
        cu = r["crossover_users"]
        out.append(f"  {r['strategy']:<14} {r['output_class']:<6} k={r['k']} tau={r['tau']:.2f} "
                   f"v={r['v']:.2f} r={r['draft_ratio']:.2f}: crossover "
                   f"{'never faster' if not r['wins'] else 'none <= max batch' if cu is None else f'N={cu}'}"
                   f"{'' if cu is None or r['crossover_step_cost'] == 'measured' else ' (extrapolated)'}")
        out.append(f"      speedup {sp}")
        ks = ", ".join(f"k={b['k']}{'' if b['acceptance'] == 'measured' else '~'}: "
                       f"{'never' if not b['wins'] else '-' if b['crossover_users'] is None else b['crossover_users']}"
                       for b in r["by_k"])
        out.append(f"      crossover N per k ({'~'} acceptance modelled): {ks}")
    out.append("  (* step cost extrapolated past the curve's measured batch tokens; unmarked: measured; "
               "'-': no crossover up to the max batch; 'never': never faster)")
    return out
