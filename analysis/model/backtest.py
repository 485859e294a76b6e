"""Backtest of the capacity model: fit on some concurrency levels of a run, predict the
others, print the error (``python -m analysis backtest RUN_DIR``).

A forecaster's hold-out test (fit on part of the data, predict the rest). Per strategy
the step cost model (``analysis.model.profiled``: the engine profile calibrated on the
step log; without a profile ``analysis.model.stepcost``'s step-log fit) is calibrated on
the held-in users levels only; per strategy x output class the same levels give the
workload: verification tokens per row v (T / B), context per row, acceptance length tau,
mean output tokens L and prompt tokens P, and the client's time between a response's
end and the user's next request (``gap``, Little's law on the closed loop: N x wall /
requests - mean e2e).

At N users the model is a closed loop (mean-value analysis of a batched server with think
time: Lazowska et al. 1984, *Quantitative System Performance*, ch. 6), solved for the
decode rows B per step by fixed-point iteration:

    T = B v,  q = B tau / L  (prefills per decode step)
    step     = draft(B) + decode(B, T, A) + gap(B) + c + q * pre(P)
    step_own = draft(B) + decode(B, T, A) + gap(B) + c + q (B-1)/B pre(P)
    (gap: the engine loop between steps; c: per-step overhead; pre: marginal prefill)
    R_pre = 1.5 step (B-1)/B + c + pre(P),  R_dec = (L - 1) / tau * step_own
    R = R_pre + R_dec,  phi = gap / (R + gap),  busy = 1 - phi^N
    B = max(1, N R_dec / (R + gap) / busy)
    tokens/s = 1000 N L / (R + gap),   TPOT = (step_own - (1 - theta) q (B-1)/B pre(P)) / tau

so the batch, the engine's idle time at low load and the prefill interference at high load
follow from the step costs instead of being read off the held-in levels. theta (measured per
held-in level, ``_decode_share``) is the share of the others' prompts a request meets while
it decodes; the rest lands in its wait for a first token. A per strategy x
output class calibration factor (measured / modelled at each held-in level, interpolated in
log users, their median outside) absorbs what no step sees (the HTTP and
streaming path). The speedup is the predicted tokens/s over the predicted
``autoregressive`` one. Errors are fractions: |predicted - measured| / measured.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from analysis.model import capacity, machine_speed
from analysis.data import metrics
from analysis.data import server as server_data
from analysis.model import server_fit
from analysis.model import stepcost
from analysis.data.load import Results
from configs import metric_names as mn
from configs.tiers import Slo

METRICS = (metrics.OUTPUT_TOKENS_PER_S, "tpot_ms_p50", metrics.SPEEDUP)



def _levels(results):
    """(results with the first sampling label only, request rows flagged against SLOs that
    every request meets, the cell table, the sorted users levels): what a backtest holds out."""
    results = one_sampling(results)
    req = results.requests
    tiers = sorted(req[mn.REQ_TIER].unique())
    loose = {t: Slo(ttft_ms=1e12, tpot_ms=1e12, source="backtest") for t in tiers}
    flagged = metrics.with_slo_flags(req, loose)
    cells = metrics.cell_table(flagged)
    return results, flagged, cells, sorted(int(u) for u in cells[mn.REQ_USERS].unique())

def steps_with_users(steps: pd.DataFrame, requests: pd.DataFrame) -> pd.DataFrame:
    """Step rows with a ``users`` column: the step's own label when the load
    generator wrote one, else the users level of its (run, strategy, tier,
    output class) cell. Steps outside every cell window get NaN."""
    df = steps.copy()
    if df.empty:
        df[mn.REQ_USERS] = pd.Series(dtype=float)
        return df
    keys = [k for k in (mn.REQ_RUN_ID, mn.REQ_STRATEGY, mn.REQ_TIER, mn.REQ_OUTPUT_CLASS)
            if k in df.columns]
    own = (pd.to_numeric(df[mn.REQ_USERS], errors="coerce") if mn.REQ_USERS in df.columns
           else pd.Series(np.nan, index=df.index))
    if len(keys) == 4:
        lut = requests.groupby(keys)[mn.REQ_USERS].max().rename("_u").reset_index()
        merged = df[keys].merge(lut, on=keys, how="left")
        own = own.fillna(pd.Series(merged["_u"].to_numpy(float), index=df.index))
    df[mn.REQ_USERS] = own
    return df


@dataclass(frozen=True)
class Workload:
    """What a strategy x output class runs per step, measured on the fit levels."""

    v: float            # tokens the decode forward computes per row (T / B)
    ctx_per_row: float  # KV tokens attended per row (0 if unlogged)
    tau: float          # output tokens per request per step
    out_tokens: float   # mean output tokens per request
    prompt_tokens: float
    occupancy: float    # mean decode rows / users
    # ((users, occupancy, v, gap_ms, theta), ...) per fit level, sorted: occupancy, v, the
    # client's gap and the decode share of prefill interference at a users level are
    # interpolated linearly in log(users) between them, held at the nearest end outside
    levels: tuple = ()
    gap_ms: float = 0.0  # the client's ms between a response's end and the next request

    def theta_at(self, users) -> np.ndarray:
        """The decode share of the prefill interference (``_decode_share``) at ``users``."""
        n = np.asarray(users, float)
        if len(self.levels) < 1 or len(self.levels[0]) < 5:
            return np.ones_like(n, dtype=float)
        if len(self.levels) < 2:
            return np.full_like(n, self.levels[0][4], dtype=float)
        x = np.log(np.maximum(n, 1e-9))
        return np.interp(x, np.log([lv[0] for lv in self.levels]), [lv[4] for lv in self.levels])

    def gap_at(self, users) -> np.ndarray:
        """The client's gap (ms) at ``users`` (array ok)."""
        n = np.asarray(users, float)
        if len(self.levels) < 2 or len(self.levels[0]) < 4:
            return np.full_like(n, self.gap_ms, dtype=float)
        x = np.log(np.maximum(n, 1e-9))
        return np.interp(x, np.log([lv[0] for lv in self.levels]), [lv[3] for lv in self.levels])

    def at(self, users) -> tuple[np.ndarray, np.ndarray]:
        """(occupancy, v) at ``users`` (array ok)."""
        n = np.asarray(users, float)
        if len(self.levels) < 2:
            return np.full_like(n, self.occupancy, dtype=float), np.full_like(n, self.v, dtype=float)
        x = np.log(np.maximum(n, 1e-9))
        lv = np.log([lv[0] for lv in self.levels])
        return (np.interp(x, lv, [lv[1] for lv in self.levels]),
                np.interp(x, lv, [lv[2] for lv in self.levels]))


def _workload(steps: pd.DataFrame, req: pd.DataFrame, strategy: str) -> Workload:
    f = stepcost.step_features(steps)
    dec = f[f["B"] > 0]
    b_sum = dec["B"].sum()
    v = float(dec["T"].sum() / b_sum) if b_sum > 0 else 1.0
    ctx = steps.loc[dec.index, mn.STEP_CONTEXT_TOKENS] if mn.STEP_CONTEXT_TOKENS in steps else None
    ctx_row = float(ctx.sum() / b_sum) if ctx is not None and ctx.notna().any() and b_sum > 0 else 0.0
    ok = req[req[mn.REQ_STATUS].eq(mn.STATUS_OK)]
    # tokens per decode step per row: from the decode-only steps where the log has them (a
    # drafter that proposes nothing on some steps, as n-gram does, emits fewer per step than
    # its acceptance length per draft), else the requests' pooled acceptance length
    pure = dec[dec["P"] == 0].index
    emitted = (steps.loc[pure, mn.STEP_EMITTED_TOKENS].astype(float).sum()
               if mn.STEP_EMITTED_TOKENS in steps else 0.0)
    b_pure = float(dec.loc[pure, "B"].sum())
    if strategy == mn.AUTOREGRESSIVE:
        tau = 1.0
    elif emitted > 0 and b_pure > 0:
        tau = float(emitted / b_pure)
    else:
        tau = metrics.pooled_tau(ok)
    if not np.isfinite(tau):
        tau = 1.0
    occ, per_level = [], []
    gaps = _client_gaps(req)
    for users, g in dec.groupby(steps.loc[dec.index, mn.REQ_USERS]):
        if users > 0:
            occ.append(float(g["B"].mean()) / float(users))
            per_level.append((float(users), occ[-1],
                              float(g["T"].sum() / g["B"].sum()) if g["B"].sum() > 0 else v,
                              gaps.get(float(users), float(np.median(list(gaps.values())))
                                       if gaps else 0.0),
                              _decode_share(steps[steps[mn.REQ_USERS].eq(users)],
                                            req[req[mn.REQ_USERS].eq(users)])))
    # a level without others in the batch (one user) has no interference to share: it takes
    # the nearest level's
    known = [lv[4] for lv in per_level if lv[4] is not None]
    per_level = [lv if lv[4] is not None else (*lv[:4], known[0] if known else 1.0)
                 for lv in sorted(per_level)]
    return Workload(v=v, ctx_per_row=ctx_row, tau=float(tau),
                    gap_ms=float(np.median(list(gaps.values()))) if gaps else 0.0,
                    out_tokens=float(ok[mn.REQ_OUTPUT_TOKENS].mean()) if len(ok) else 1.0,
                    prompt_tokens=float(ok[mn.REQ_PROMPT_TOKENS].mean())
                    if ok[mn.REQ_PROMPT_TOKENS].notna().any() else 0.0,
                    occupancy=float(np.median(occ)) if occ else 1.0,
                    levels=tuple(sorted(per_level)) if PER_LEVEL_WORKLOAD else ())


PER_LEVEL_WORKLOAD = True


THETA_RANGE = (0.2, 1.5)


def _decode_share(steps: pd.DataFrame, req: pd.DataFrame) -> float | None:
    """theta: how much of the prefill interference a request meets while it decodes, against
    the engine's mean, at one users level (1 = every decode step carries the mean share of
    the other requests' prompts; None where no other request shares the batch: one user).

    From the step log (one replica) and the requests' first-token and end times: a mixed
    step's excess is its ms over the median decode-only step; the excess inside the
    requests' decode windows per decode step they span, over the engine's mean excess per
    decode step x (B - 1) / B (their own prompts are not in their decode). The three main
    jobs of 2026-12-06: 0.97-1.19 for every strategy but autoregressive with short outputs,
    0.52-0.56 there at 4 and at 16 users alike: exactly 32 tokens, one per step, so requests
    prefilled in one step finish in one step, and their users' next prompts arrive together,
    in the mixed steps that their own first tokens wait through, not in other requests'
    decode. Clipped to THETA_RANGE; 1.0 without the columns, a multi-replica cell or fewer
    than 3 mixed and 3 decode-only steps."""
    need = (mn.STEP_TS, mn.STEP_BATCH_SIZE, mn.STEP_PREFILL_TOKENS, mn.STEP_MS)
    if steps.empty or req.empty or any(c not in steps for c in need) \
            or any(c not in req for c in (mn.REQ_FIRST_TOKEN_TS, mn.REQ_END_TS)):
        return 1.0
    if mn.STEP_REPLICA in steps and steps[mn.STEP_REPLICA].nunique() > 1:
        return 1.0
    st = steps.sort_values(mn.STEP_TS)
    b = st[mn.STEP_BATCH_SIZE].to_numpy(float)
    p = st[mn.STEP_PREFILL_TOKENS].to_numpy(float)
    ms = st[mn.STEP_MS].to_numpy(float)
    dec = b > 0
    mixed, pure = dec & (p > 0), dec & (p == 0)
    bm = float(b[dec].mean()) if dec.any() else 0.0
    if bm <= 1.0:
        return None
    if mixed.sum() < 3 or pure.sum() < 3:
        return 1.0
    ex = np.where(mixed, np.maximum(ms - float(np.median(ms[pure])), 0.0), 0.0)
    mean_ex = float(ex[dec].sum() / dec.sum())
    if not mean_ex > 0:
        return 1.0
    ok = req[req[mn.REQ_STATUS].eq(mn.STATUS_OK)] if mn.REQ_STATUS in req else req
    ok = ok[ok[mn.REQ_FIRST_TOKEN_TS].notna() & ok[mn.REQ_END_TS].notna()]
    ts = st[mn.STEP_TS].to_numpy(float)
    i1 = np.searchsorted(ts, ok[mn.REQ_FIRST_TOKEN_TS].to_numpy(float), side="right")
    i2 = np.searchsorted(ts, ok[mn.REQ_END_TS].to_numpy(float), side="right")
    cs = np.concatenate([[0.0], np.cumsum(ex)])
    cn = np.concatenate([[0.0], np.cumsum(dec)])
    n = float((cn[i2] - cn[i1]).sum())
    if n <= 0:
        return 1.0
    theta = float((cs[i2] - cs[i1]).sum()) / n / (mean_ex * (bm - 1.0) / bm)
    return float(np.clip(theta, *THETA_RANGE))


def _client_gaps(req: pd.DataFrame) -> dict[float, float]:
    """{users: the client's mean ms between a response's end and that user's next request}
    of a closed loop, by Little's law on the steady part of each cell (run x repeat): the
    mean number of requests in flight C over the window from the first send plus the longest
    request (every user's request in flight there was sent inside the cell's kept rows:
    a warm-up cut drops the requests sent before it) to the last send (past it the users
    stop sending), then N = C (e2e + gap) / e2e, gap = e2e (N / C - 1) >= 0, pooled over
    the cell's repeats. The whole cell's wall (first send to last end) instead counts the
    cut's and the tail's empty slots as the client's: 23-174 ms at 16 users on the
    2026-12-06 main jobs, for 1-2 ms here."""
    need = (mn.REQ_SCHEDULED_TS, mn.REQ_END_TS, mn.REQ_USERS)
    if req.empty or any(c not in req for c in need):
        return {}
    keys = [k for k in (mn.REQ_RUN_ID, mn.REQ_REPEAT, mn.REQ_TIER) if k in req]
    out = {}
    for users, g in req.groupby(mn.REQ_USERS):
        if not users > 0:
            continue
        busy = window = dur_sum = 0.0
        count = 0
        for _, h in (g.groupby(keys, dropna=False) if keys else [(None, g)]):
            s0 = h[mn.REQ_SCHEDULED_TS].to_numpy(float)
            e0 = h[mn.REQ_END_TS].to_numpy(float)
            ok = np.isfinite(s0) & np.isfinite(e0) & (e0 >= s0)
            s0, e0 = s0[ok], e0[ok]
            if s0.size < 2:
                continue
            t0, t1 = s0.min() + float(np.max(e0 - s0)), s0.max()
            if t1 <= t0:
                continue
            busy += float(np.clip(np.minimum(e0, t1) - np.maximum(s0, t0), 0.0, None).sum())
            window += t1 - t0
            dur_sum += float(np.sum(e0 - s0))
            count += s0.size
        if window > 0 and busy > 0 and count:
            conc = busy / window
            out[float(users)] = max(0.0, 1000.0 * dur_sum / count * (float(users) / conc - 1.0))
    return out


FIXED_POINT_ITER = 60


def batch_point(model: stepcost.StepModel, w: Workload, rows) -> tuple[np.ndarray, np.ndarray]:
    """(tokens/s, TPOT ms) of the engine holding ``rows`` requests in decode (array ok): the
    step at B = rows with its share of prefills (q = B tau / L per step), tokens/s = 1000 B
    tau / step, TPOT = the step without the row's own prefill / tau. What a replica's queue
    (``analysis.model.replica_model``) serves at batch B; no client in the loop."""
    bb = np.maximum(np.asarray(rows, float), 1e-9)
    out, tau = max(w.out_tokens, 1.0), max(w.tau, 1e-9)
    _, v = w.at(bb)
    c = float(model.overhead_ms)
    pre = _marginal_prefill(model, w)
    t = bb * v
    dec = ((model.decode(bb, t, t * w.ctx_per_row / 1000.0) if model.decode is not None else 0.0)
           + model.draft_ms(bb) + model.gap_ms(bb))
    q = bb * tau / out
    step = dec + c + q * pre
    own = dec + c + q * np.maximum(bb - 1.0, 0.0) / bb * pre
    return 1000.0 * bb * tau / np.maximum(step, 1e-6), np.maximum(own, 1e-6) / tau


def _marginal_prefill(model: stepcost.StepModel, w: Workload) -> float:
    """ms one request's prompt adds to the step it rides in (the prefill curve at P minus
    the step's overhead; 0 without a prompt)."""
    c = float(model.overhead_ms)
    if model.prefill is None or not w.prompt_tokens > 0:
        return 0.0
    return max(float(np.asarray(model.prefill(np.array([w.prompt_tokens])), float)[0]) - c, 0.0)


def model_point(model: stepcost.StepModel, w: Workload, users, gap_ms=None
                ) -> tuple[np.ndarray, np.ndarray]:
    """(tokens/s, TPOT ms) the uncalibrated closed-loop model gives at ``users`` (array ok;
    module doc). ``gap_ms``: the client's gap per request (default: the workload's at that
    level)."""
    n = np.maximum(np.asarray(users, float), 1e-9)
    _, v = w.at(n)
    theta = w.theta_at(n)
    gap = w.gap_at(n) if gap_ms is None else np.full_like(n, float(gap_ms), dtype=float)
    out = max(w.out_tokens, 1.0)
    tau = max(w.tau, 1e-9)
    c = float(model.overhead_ms)
    pre = _marginal_prefill(model, w)
    b = n.copy()
    for _ in range(FIXED_POINT_ITER):
        bb = np.maximum(b, 1.0)
        t = bb * v
        a = t * w.ctx_per_row / 1000.0
        q = bb * tau / out
        dec = ((model.decode(bb, t, a) if model.decode is not None else 0.0) + model.draft_ms(bb)
               + model.gap_ms(bb))
        step = dec + c + q * pre
        inter = q * (bb - 1.0) / bb * pre       # the others' prompts per step
        own = dec + c + inter
        r_pre = 1.5 * step * (bb - 1.0) / bb + c + pre
        r_dec = max(out - 1.0, 0.0) / tau * own
        r = r_pre + r_dec
        phi = np.where(gap > 0, gap / np.maximum(r + gap, 1e-9), 0.0)
        busy = np.maximum(1.0 - phi ** n, 1e-9)
        b_new = np.clip(n * r_dec / np.maximum(r + gap, 1e-9) / busy, 1.0, np.maximum(n, 1.0))
        if np.allclose(b_new, b, rtol=1e-4):
            b = b_new
            break
        b = 0.5 * b + 0.5 * b_new
    # TPOT: the share theta of the others' prompts a request meets while it decodes; the
    # rest it waits through for its first token (the request's time, hence the batch and
    # tokens/s, stay as they are)
    tpot = (own - (1.0 - theta) * inter) / tau
    return 1000.0 * n * out / np.maximum(r + gap, 1e-6), np.maximum(tpot, 1e-6)


def _inside_levels(levels: tuple, col: int, users, outside: float) -> np.ndarray:
    """Column ``col`` of ``levels`` ((users, ...) rows, sorted) at ``users`` (array ok):
    interpolated linearly in log(users) between the levels, ``outside`` beyond them (and
    everywhere without levels)."""
    n = np.asarray(users, float)
    if len(levels) < 1:
        return np.full_like(n, outside, dtype=float)
    lv = np.log(np.array([k[0] for k in levels], float))
    x = np.log(np.maximum(n, 1e-9))
    inside = (x >= lv[0] - 1e-9) & (x <= lv[-1] + 1e-9)
    return np.where(inside, np.interp(x, lv, [k[col] for k in levels]), outside)


@dataclass(frozen=True)
class CellModel:
    """A calibrated predictor for one strategy x output class.

    ``k_tps`` / ``k_tpot``: the median calibration over the fit levels; ``k_levels``:
    ((users, k_tps, k_tpot), ...) per fit level, sorted. With ``k_levels`` the factor at
    ``users`` is interpolated linearly in log(users) between the fit levels (so at a
    measured level the model gives the measured figure back: calibration, not a fit
    through it) and is the median outside them (one level's cell noise is not carried
    into an extrapolation)."""

    strategy: str
    output_class: str
    model: stepcost.StepModel
    workload: Workload
    k_tps: float
    k_tpot: float
    k_levels: tuple = ()
    # the machine speed (``analysis.model.machine_speed``) the predictions are made at: the
    # model is fitted at s = 1 (the profile's machine); 1.0 without a profile
    speed_ref: float = 1.0
    # ((users, speed), ...) of this strategy x output class's fitted cells: the speed at a
    # users level inside them is interpolated in log(users) like the factors (a measured
    # load is predicted at the speed it was measured at), ``speed_ref`` outside
    speed_levels: tuple = ()

    def speed_at(self, users) -> np.ndarray:
        """The machine speed the model predicts at for ``users`` (array ok)."""
        return _inside_levels(self.speed_levels, 1, users, self.speed_ref)

    def factors(self, users) -> tuple[np.ndarray, np.ndarray]:
        """(k_tps, k_tpot) at ``users`` (array ok)."""
        return (_inside_levels(self.k_levels, 1, users, self.k_tps),
                _inside_levels(self.k_levels, 2, users, self.k_tpot))

    def predict(self, users, gap_ms=None, batch: bool = False, speed: float | None = None
                ) -> tuple[np.ndarray, np.ndarray]:
        """Calibrated (tokens/s, TPOT ms) at ``users`` closed-loop users (``model_point``;
        ``gap_ms`` as there), or with ``batch`` at that many requests in decode
        (``batch_point``: a replica's queue), on a machine of speed ``speed`` (default
        ``speed_ref``: the strategy's typical speed in the fitted cells; ex-ante)."""
        tps, tpot = (batch_point(self.model, self.workload, users) if batch
                     else model_point(self.model, self.workload, users, gap_ms))
        k_tps, k_tpot = self.factors(users)
        s = self.speed_at(users) if speed is None or not np.isfinite(speed) else float(speed)
        return k_tps * tps / s, k_tpot * tpot * s


def _measured(cells: pd.DataFrame) -> pd.DataFrame:
    """Mean per (strategy, output class, users) over runs / repeats / tiers."""
    cols = [metrics.OUTPUT_TOKENS_PER_S, "tpot_ms_p50", metrics.SPEEDUP]
    return cells.groupby([mn.REQ_STRATEGY, mn.REQ_OUTPUT_CLASS, mn.REQ_USERS])[cols].mean()


def held_in_speeds(steps: pd.DataFrame, profile: dict | None, results=None
                   ) -> machine_speed.Speeds:
    """The machine's speed in each cell of ``steps`` (``machine_speed.cell_speeds``; none for
    a strategy the profile timed on another backend than the run's, ``profiled.profile_applies``)."""
    from analysis.model import profiled

    skip = {str(s) for s in steps[mn.STEP_STRATEGY].unique()
            if not profiled.profile_applies(profile, str(s), results)} \
        if not steps.empty else set()
    return machine_speed.cell_speeds(steps, profile, skip)


def fit_cell_models(steps: pd.DataFrame, flagged: pd.DataFrame, cells: pd.DataFrame,
                    levels: list[int], profile: dict | None = None, results=None
                    ) -> tuple[dict[tuple[str, str], CellModel], dict]:
    """Fit per strategy (step model) and strategy x output class (workload,
    calibration) on the given users ``levels``. With an engine ``profile``
    (``analysis.model.profiled``) the step model is the profile calibrated on those levels'
    steps, each cell's steps and figures first brought to the profile's machine speed
    (``analysis.model.machine_speed``; the models predict at each strategy's median speed
    over these cells, ``CellModel.speed_ref``), else the step-log fit. Returns (models, step
    models)."""
    st = steps[steps[mn.REQ_USERS].isin(levels)]
    speeds = machine_speed.cell_speeds(st, None)          # none without a profile
    if profile is not None:
        from analysis.model import profiled
        speeds = held_in_speeds(st, profile, results)
        steps_models = profiled.fit_step_models(machine_speed.normalized_steps(st, speeds),
                                                profile, results)
    else:
        steps_models = stepcost.fit_step_models(st)
    meas = _measured(cells[cells[mn.REQ_USERS].isin(levels)])
    out = {}
    for (strategy, oc), req in flagged[flagged[mn.REQ_USERS].isin(levels)].groupby(
            [mn.REQ_STRATEGY, mn.REQ_OUTPUT_CLASS]):
        model = steps_models.get(strategy)
        if model is None:
            continue
        s_steps = st[st[mn.STEP_STRATEGY].eq(strategy)]
        if mn.REQ_OUTPUT_CLASS in s_steps and s_steps[mn.REQ_OUTPUT_CLASS].eq(oc).any():
            s_steps = s_steps[s_steps[mn.REQ_OUTPUT_CLASS].eq(oc)]
        w = _workload(s_steps, req, strategy)
        out[(strategy, oc)] = _calibrated(strategy, oc, model, w, meas, levels, speeds)
    return out, steps_models


def _calibrated(strategy: str, oc: str, model, w, meas: pd.DataFrame, levels,
                speeds: machine_speed.Speeds | None = None) -> "CellModel":
    """``CellModel`` of one strategy x output class, calibrated per output class: the median
    over the fitted users levels of measured / modelled output tokens/s and TPOT p50 (1.0
    where no level has both). With ``speeds`` each level's measured figures are first
    brought to the profile's machine speed (tokens/s x s, TPOT / s; the cell's own speed,
    the strategy's reference where it has none), and the model predicts at the strategy's
    reference speed over these cells."""
    r_tps, r_tpot, per_level, speed_levels = [], [], [], []
    has_speed = speeds is not None and not speeds.cells.empty \
        and speeds.cells["strategy"].eq(strategy).any()
    ref = speeds.reference(strategy) if has_speed else 1.0
    for users in sorted(levels):
        key = (strategy, oc, users)
        if key not in meas.index:
            continue
        tps, tpot = model_point(model, w, users)
        m = meas.loc[key]
        sp = speeds.at(strategy, oc, users) if has_speed else 1.0
        sp = sp if np.isfinite(sp) else ref
        a = b = None
        if np.isfinite(m[metrics.OUTPUT_TOKENS_PER_S]) and tps > 0:
            a = float(m[metrics.OUTPUT_TOKENS_PER_S] * sp / float(tps))
            r_tps.append(a)
        if np.isfinite(m["tpot_ms_p50"]) and tpot > 0:
            b = float(m["tpot_ms_p50"] / sp / float(tpot))
            r_tpot.append(b)
        if a is not None and b is not None:
            per_level.append((float(users), a, b))
            if has_speed:
                speed_levels.append((float(users), float(sp)))
    k_levels = tuple(per_level) if model.source == "profiled" else ()
    return CellModel(strategy, oc, model, w, float(np.median(r_tps)) if r_tps else 1.0,
                     float(np.median(r_tpot)) if r_tpot else 1.0, k_levels, speed_ref=ref,
                     speed_levels=tuple(speed_levels) if k_levels else ())


def fit_all_levels(results: Results, flagged: pd.DataFrame, cells: pd.DataFrame,
                   notes: list[str] | None = None, profile: dict | None | bool = True
                   ) -> dict[tuple[str, str], CellModel]:
    """``fit_cell_models`` on every users level of the run: the one capacity model the
    report's crossover and ``analysis plan`` use. Step rows outside every cell (no users
    label) take their batch size as the users level (batch occupancy 1); ``notes`` gets
    a sentence saying so. Empty without a step log."""
    if results.steps is None or results.steps.empty:
        srv = server_data.cell_table(results)
        if srv.empty:
            return {}
        if notes is not None:
            notes.append("no step log: the capacity model is fitted on the target's own counters "
                         "(server /metrics: cell wall / engine steps against tokens per step)")
        levels = sorted({int(u) for u in cells[mn.REQ_USERS].unique()})
        return fit_server_cell_models(srv, flagged, cells, levels)[0]
    steps = steps_with_users(results.steps, results.requests)
    unlabelled = steps[mn.REQ_USERS].isna()
    if unlabelled.any():
        steps.loc[unlabelled, mn.REQ_USERS] = steps.loc[unlabelled, mn.STEP_BATCH_SIZE]
        if notes is not None:
            notes.append(f"{int(unlabelled.sum())} step rows lie outside every cell (no users "
                         "label): their batch size is taken as the users level (occupancy 1)")
    levels = sorted({int(u) for u in cells[mn.REQ_USERS].unique()}
                    | {int(u) for u in steps[mn.REQ_USERS].dropna().unique()})
    prof = _profile(results, profile, notes)
    return fit_cell_models(steps, flagged, cells, levels, prof, results)[0]


def _profile(results: Results, profile, notes: list[str] | None = None) -> dict | None:
    """The engine profile to use: ``profile`` True = look for one (``profiled.find_profile``),
    None / False = none, a dict = that one; ``notes`` gets a sentence on which."""
    from analysis.model import profiled

    if profile is True:
        profile, path = profiled.find_profile(results)
        if notes is not None:
            notes.append(f"step cost: engine profile {path}, calibrated on this run's step log"
                         if profile is not None else
                         "step cost: no engine profile (RUN_DIR/cost_curve.json): fitted on the "
                         "run's own users levels, EXTRAPOLATED beyond its batches")
    return profile or None


def _server_workload(g: pd.DataFrame, req: pd.DataFrame, strategy: str) -> Workload:
    """What a strategy x output class runs per step, from its server cells: v = verification
    tokens / decode request-steps, tau from the drafts and accepted counters (else the
    requests'), occupancy = mean running batch / users."""
    steps = g["request_steps"].astype(float).sum()
    verif = g["verification_tokens_total"].astype(float).sum()
    v = float(verif / steps) if steps > 0 and np.isfinite(verif) else 1.0
    drafts = g[mn.SRV_NUM_DRAFTS].astype(float).sum() if mn.SRV_NUM_DRAFTS in g else np.nan
    acc = g[mn.SRV_NUM_ACCEPTED_TOKENS].astype(float).sum() if mn.SRV_NUM_ACCEPTED_TOKENS in g else np.nan
    ok = req[req[mn.REQ_STATUS].eq(mn.STATUS_OK)]
    tau = 1.0 + acc / drafts if drafts > 0 else metrics.pooled_tau(ok)
    if not np.isfinite(tau):
        tau = 1.0
    occ = (g["batch_size_mean"].astype(float) / g[mn.REQ_USERS].astype(float)).dropna()
    return Workload(v=v, ctx_per_row=0.0, tau=float(tau),
                    out_tokens=float(ok[mn.REQ_OUTPUT_TOKENS].mean()) if len(ok) else 1.0,
                    prompt_tokens=0.0,   # the hinge's T already carries the prompt tokens
                    occupancy=float(np.median(occ)) if len(occ) else 1.0)


def fit_server_cell_models(srv: pd.DataFrame, flagged: pd.DataFrame, cells: pd.DataFrame,
                levels: list[int]) -> tuple[dict[tuple[str, str], CellModel], dict[str, stepcost.StepModel]]:
    """``fit_cell_models`` from a target's own counters (``analysis.data.server.cell_table``), for
    a run without a step log: the hinge of ``analysis.model.server_fit`` as the step model, the
    workload from the counters (``_server_workload``). Returns (models, step models)."""
    if srv is None or srv.empty:
        return {}, {}
    curves = server_fit.fit_curves(srv, levels)
    step_models = {s: server_fit.step_model(s, c) for s, c in curves.items()}
    meas = _measured(cells[cells[mn.REQ_USERS].isin(levels)])
    out = {}
    for (strategy, oc), req in flagged[flagged[mn.REQ_USERS].isin(levels)].groupby(
            [mn.REQ_STRATEGY, mn.REQ_OUTPUT_CLASS]):
        model = step_models.get(strategy)
        g = srv[srv[mn.REQ_STRATEGY].eq(strategy) & srv[mn.REQ_OUTPUT_CLASS].eq(oc)
                & srv[mn.REQ_USERS].isin(levels)]
        if model is None or g.empty:
            continue
        w = _server_workload(g, req, strategy)
        out[(strategy, oc)] = _calibrated(strategy, oc, model, w, meas, levels)
    return out, step_models


def predicted_speedup(models: dict, strategy: str, oc: str, users, speed_of=None
                      ) -> np.ndarray | None:
    """Calibrated predicted speedup vs autoregressive at ``users`` (None if either is
    unfitted); ``speed_of(strategy, oc, users)``: the machine speed each is predicted at
    (default: each model's ``speed_ref``)."""
    s, ar = models.get((strategy, oc)), models.get((mn.AUTOREGRESSIVE, oc))
    if s is None or ar is None:
        return None
    sp = (lambda name: speed_of(name, oc, users) if speed_of is not None else None)  # noqa: E731
    return s.predict(users, speed=sp(strategy))[0] / ar.predict(users, speed=sp(mn.AUTOREGRESSIVE))[0]


def predicted_crossover(models: dict, strategy: str, oc: str, max_users: float = 4096.0):
    """Smallest users level in [1, max_users] where the predicted speedup < 1
    (geometric scan, then bisection to 0.01 users); None if never."""
    return capacity.first_users_below_one(lambda u: predicted_speedup(models, strategy, oc, u),
                                          max_users, points=2000, tol=0.01)


def measured_crossover_interval(cells: pd.DataFrame) -> pd.DataFrame:
    """Per strategy x output class: the measured crossover as an interval.

    ``lo`` = the highest users level with mean speedup >= 1 before the first
    level below 1, ``hi`` = that first level; ``point`` interpolates the speedup
    linearly in log(users) between them. Status ``crossed``, ``never`` (>= 1 at
    every level; lo = the highest level) or ``below_at_min``.
    """
    rows = []
    spec = cells[~cells[mn.REQ_STRATEGY].eq(mn.AUTOREGRESSIVE) & cells[metrics.SPEEDUP].notna()]
    for (strategy, oc), g in spec.groupby([mn.REQ_STRATEGY, mn.REQ_OUTPUT_CLASS], sort=True):
        curve = g.groupby(mn.REQ_USERS)[metrics.SPEEDUP].mean().sort_index()
        u, s = curve.index.to_numpy(float), curve.to_numpy(float)
        row = {"strategy": strategy, "output_class": oc, "status": "never", "lo": float(u[-1]),
               "hi": None, "point": None,
               "levels": ", ".join(f"{int(a)}:{b:.2f}x" for a, b in zip(u, s))}
        if s[0] < 1:
            row.update(status="below_at_min", lo=None, hi=float(u[0]), point=float(u[0]))
        else:
            for i in range(1, len(s)):
                if s[i] < 1 <= s[i - 1]:
                    frac = (s[i - 1] - 1.0) / (s[i - 1] - s[i])
                    point = float(np.exp(np.log(u[i - 1]) + frac * (np.log(u[i]) - np.log(u[i - 1]))))
                    row.update(status="crossed", lo=float(u[i - 1]), hi=float(u[i]), point=point)
                    break
        rows.append(row)
    return pd.DataFrame(rows, columns=["strategy", "output_class", "status", "lo", "hi", "point",
                                       "levels"])


def _held_rows(models: dict, meas: pd.DataFrame, users: int, spread: pd.DataFrame | None = None,
               speed_of=None) -> list[dict]:
    """Prediction rows at ``users`` for every fitted strategy x output class measured there;
    ``speed_of(strategy, oc, users)``: the machine speed to predict at (ex-post: the held
    cell's measured one; default each model's ``speed_ref``: ex-ante)."""
    rows = []
    for (strategy, oc), cm in sorted(models.items()):
        key = (strategy, oc, users)
        if key not in meas.index:
            continue
        tps, tpot = cm.predict(users, speed=speed_of(strategy, oc, users) if speed_of else None)
        pred = {metrics.OUTPUT_TOKENS_PER_S: float(tps), "tpot_ms_p50": float(tpot)}
        sp = predicted_speedup(models, strategy, oc, users, speed_of)
        if strategy != mn.AUTOREGRESSIVE and sp is not None:
            pred[metrics.SPEEDUP] = float(sp)
        for metric, p in pred.items():
            m = float(meas.loc[key, metric])
            if not np.isfinite(m) or m == 0:
                continue
            row = {"strategy": strategy, "output_class": oc, "metric": metric,
                   "users": int(users), "predicted": p, "measured": m,
                   "abs_error": abs(p - m) / abs(m), "model": cm.model.source}
            if spread is not None and (strategy, oc, users) in spread.index:
                row["repeat_spread"] = float(spread.loc[(strategy, oc, users), metric])
            rows.append(row)
    return rows


def one_sampling(results: Results) -> Results:
    """The results of the first sampling label only (greedy first,
    ``analysis.data.dimensions.sampling_labels``): acceptance, hence the workload and the
    measured figures, differ by setting, so a backtest never pools them. Unchanged with
    one label."""
    import dataclasses

    from analysis.data.dimensions import sampling_labels

    labels = sampling_labels(results.requests)
    if len(labels) < 2:
        return results
    req, st = results.requests, results.steps
    keep = st[mn.REQ_SAMPLING].eq(labels[0]) | st[mn.REQ_SAMPLING].isna() \
        if mn.REQ_SAMPLING in st else pd.Series(True, index=st.index)
    return dataclasses.replace(results, requests=req[req[mn.REQ_SAMPLING].eq(labels[0])],
                               steps=st[keep])


def _repeat_spread(flagged: pd.DataFrame) -> pd.DataFrame | None:
    """Per (strategy, output class, users): half the range of each metric over the cell's
    replicates (repeats, runs) relative to their mean: the run's own noise on that figure;
    None when no cell has two replicates."""
    cols = [metrics.OUTPUT_TOKENS_PER_S, "tpot_ms_p50", metrics.SPEEDUP]
    if mn.REQ_REPEAT not in flagged:
        return None
    per = flagged.assign(**{mn.REQ_RUN_ID: flagged[mn.REQ_RUN_ID].astype(str) + "#r"
                            + flagged[mn.REQ_REPEAT].astype(str)})
    cells = metrics.cell_table(per)
    g = cells.groupby([mn.REQ_STRATEGY, mn.REQ_OUTPUT_CLASS, mn.REQ_USERS])[cols]
    n = g.size()
    if not (n >= 2).any():
        return None
    return ((g.max() - g.min()) / 2.0 / g.mean().abs()).where(n >= 2)


def _r2(y: np.ndarray, p: np.ndarray) -> float:
    return stepcost.r2_score(np.asarray(y, float), np.asarray(p, float)) if len(y) >= 2 else float("nan")


def loo_backtest(results: Results, profile: dict | None | bool = True) -> dict:
    """Leave-one-level-out: for every users level u of the run, fit the capacity model on
    the other levels (step model: the engine profile calibrated on their steps where a
    profile exists, else the step-log fit; workload and calibration from them) and predict
    u. A forecaster's hold-out test over every level, not only the highest.

    Returns {"levels", "profile" (its path or None), "rows": [{"strategy", "output_class",
    "metric", "users", "predicted", "measured", "abs_error", "model" (profiled | fitted),
    "repeat_spread" (the cell's own noise, when it has replicates)}], "summary": [{"strategy",
    "output_class", "metric", "median_abs_error", "worst_abs_error", "n"}], "overall":
    {metric: {"median_abs_error", "worst_abs_error"}}, "r2_holdout": {strategy: r² of the
    whole step on the steps of the held-out levels}}. Raises ValueError with fewer than two
    users levels or no step log (the server-counter fit has no steps to hold out)."""
    from analysis.model import profiled

    results, flagged, cells, levels = _levels(results)
    req = results.requests
    if len(levels) < 2:
        raise ValueError(f"backtest needs >= 2 users levels, the run has {levels}")
    if results.steps is None or results.steps.empty:
        raise ValueError("leave-one-level-out needs the step log (steps.parquet)")
    path = None
    if profile is True:
        profile, path = profiled.find_profile(results)
    steps = steps_with_users(results.steps, req)
    meas, spread = _measured(cells), _repeat_spread(flagged)
    speeds = held_in_speeds(steps, profile or None, results)
    rows: list[dict] = []
    post: list[dict] = []
    held: dict[str, list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = {}
    for u in levels:
        fit_levels = [v for v in levels if v != u]
        models, step_models = fit_cell_models(steps, flagged, cells, fit_levels, profile or None,
                                              results)
        rows += _held_rows(models, meas, u, spread)
        if not speeds.cells.empty:
            post += _held_rows(models, meas, u, spread, speeds.at)
        _held_steps(steps[steps[mn.REQ_USERS].eq(u)], models, step_models, speeds, held)
    summary, overall = _error_summary(pd.DataFrame(rows))
    r2 = {s: _r2(np.concatenate([y for y, _, _ in v]), np.concatenate([p for _, p, _ in v]))
          for s, v in held.items()}
    out = {"levels": levels, "profile": path if profile else None, "rows": rows,
           "summary": summary, "overall": overall, "r2_holdout": r2,
           "r2_ceiling": r2_ceiling(steps), "machine_speed": None, "ex_post": None}
    if post:
        p_summary, p_overall = _error_summary(pd.DataFrame(post))
        out["ex_post"] = {"rows": post, "summary": p_summary, "overall": p_overall,
                          "r2_holdout": {s: _r2(np.concatenate([y for y, _, _ in v]),
                                                np.concatenate([q for _, _, q in v]))
                                         for s, v in held.items()}}
        out["machine_speed"] = {**speeds.spread(), "cells": speeds.cells.to_dict("records")}
    return out


def _held_steps(hs: pd.DataFrame, models: dict, step_models: dict, speeds, held: dict) -> None:
    """Append to ``held[strategy]`` (measured step ms, predicted ex-ante, predicted ex-post)
    over the held-out steps ``hs``: the step model (fitted at s = 1 where it has a profile)
    at the strategy's reference speed, and at each step's cell speed."""
    for strategy, g in hs.groupby(mn.STEP_STRATEGY):
        m = step_models.get(str(strategy))
        if m is None:
            continue
        f = stepcost.step_features(g)
        keep = ((f["B"] > 0) | (f["P"] > 0)).to_numpy()
        f = f[keep]
        pred = np.asarray(m.step_ms(f["B"], f["T"], f["A"], f["P"]), float)
        refs = [cm.speed_ref for (s, _), cm in models.items() if s == strategy]
        ref = float(refs[0]) if refs else 1.0
        cell = speeds.of_rows(g)[keep] if not speeds.cells.empty else np.full(len(f), ref)
        held.setdefault(str(strategy), []).append((f["step_ms"].to_numpy(float), pred * ref,
                                                   pred * cell))


def lro_backtest(results: Results, profile: dict | None | bool = True) -> dict | None:
    """Leave-one-repeat-out over the run's repeats (the racing repeats of the main job):
    for every repeat index j, the repeat j of each cell that has at least two repeats is held
    out, the capacity model is fitted on everything else (every users level, the other
    repeats of the held cells included: the step model on their steps, the workload and the
    calibration on their requests) and predicts the held cells. A forecaster's test on a
    new measurement at a load the run measured: the model's error there is the floor under
    every other backtest, to be read beside the cells' own noise ("repeat_spread").

    Returns {"rows": [{"strategy", "output_class", "metric", "users", "repeat",
    "predicted", "measured", "abs_error", "model", "repeat_spread"}], "summary": [per
    strategy x output class x metric: "median_abs_error", "worst_abs_error", "n"],
    "overall": {metric: {"median_abs_error", "worst_abs_error", "n"}}, "held_cells"}; None
    when no cell has two repeats or the run has no step log."""
    results, flagged, cells, levels = _levels(results)
    req = results.requests
    if mn.REQ_REPEAT not in flagged or results.steps is None or results.steps.empty:
        return None
    keys = [mn.REQ_STRATEGY, mn.REQ_OUTPUT_CLASS, mn.REQ_USERS]
    reps = flagged.groupby(keys)[mn.REQ_REPEAT].nunique()
    multi = reps[reps >= 2]
    if multi.empty:
        return None
    if profile is True:
        from analysis.model import profiled
        profile, _ = profiled.find_profile(results)
    steps = steps_with_users(results.steps, req)
    spread = _repeat_spread(flagged)
    in_multi = pd.MultiIndex.from_frame(flagged[keys]).isin(multi.index)
    s_rep = steps[mn.REQ_REPEAT] if mn.REQ_REPEAT in steps else pd.Series(np.nan, index=steps.index)
    s_oc = steps[mn.REQ_OUTPUT_CLASS] if mn.REQ_OUTPUT_CLASS in steps \
        else pd.Series(np.nan, index=steps.index)
    s_multi = pd.MultiIndex.from_arrays([steps[mn.STEP_STRATEGY], s_oc,
                                         steps[mn.REQ_USERS]]).isin(multi.index)
    rows: list[dict] = []
    post: list[dict] = []
    speeds = held_in_speeds(steps, profile or None, results)
    held_cells = 0
    for j in sorted(flagged.loc[in_multi, mn.REQ_REPEAT].dropna().unique()):
        held = in_multi & flagged[mn.REQ_REPEAT].eq(j).to_numpy()
        fit_req = flagged[~held]
        fit_steps = steps[~(s_multi & s_rep.eq(j).to_numpy())]
        models, _ = fit_cell_models(fit_steps, fit_req, metrics.cell_table(fit_req), levels,
                                    profile or None, results)
        meas = _measured(metrics.cell_table(flagged[held]))
        held_cells += len(meas)
        at_j = (lambda s, oc, u, j=j: speeds.at(s, oc, u, repeat=j))  # noqa: E731
        for u in sorted(meas.index.get_level_values(2).unique()):
            for row in _held_rows(models, meas, int(u), spread):
                rows.append({**row, "repeat": int(j)})
            if not speeds.cells.empty:
                post += [{**r, "repeat": int(j)} for r in _held_rows(models, meas, int(u), spread,
                                                                      at_j)]
    summary, overall = _error_summary(pd.DataFrame(rows))
    out = {"rows": rows, "summary": summary, "overall": overall, "held_cells": held_cells,
           "ex_post": None}
    if post:
        p_summary, p_overall = _error_summary(pd.DataFrame(post))
        out["ex_post"] = {"rows": post, "summary": p_summary, "overall": p_overall}
    return out


def _error_summary(df: pd.DataFrame) -> tuple[list[dict], dict]:
    """(per strategy x output class x metric, per metric): median and worst absolute error."""
    summary, overall = [], {}
    if df.empty:
        return summary, overall
    for (s, oc, metric), g in df.groupby(["strategy", "output_class", "metric"]):
        summary.append({"strategy": s, "output_class": oc, "metric": metric,
                        "median_abs_error": float(g["abs_error"].median()),
                        "worst_abs_error": float(g["abs_error"].max()), "n": int(len(g))})
    for metric, g in df.groupby("metric"):
        overall[metric] = {"median_abs_error": float(g["abs_error"].median()),
                           "worst_abs_error": float(g["abs_error"].max()), "n": int(len(g))}
    return summary, overall


def r2_ceiling(steps: pd.DataFrame) -> dict[str, float]:
    """Per strategy: the r² of the whole step time that the step's own shape can explain at
    most: every step predicted by the mean of the steps with the same B, T, prefill tokens
    (log2 bins, 0 apart) and context per row (half-log2 bins), in sample. What remains is the step-to-step noise no model of B, T, context and
    prefill sees (on a shared CPU: waits for a core); a hold-out r² near this ceiling
    means the model lost nothing it could have seen."""
    out = {}
    for strategy, g in steps.groupby(mn.STEP_STRATEGY):
        f = stepcost.step_features(g)
        f = f[(f["B"] > 0) | (f["P"] > 0)]
        if len(f) < 3:
            continue
        p_bin = np.where(f["P"] > 0, np.round(np.log2(np.maximum(f["P"], 1.0))), -1.0)
        ctx = (f["A"] * 1000.0 / f["T"].where(f["T"] > 0)).fillna(0.0)
        c_bin = np.round(2.0 * np.log2(ctx + 1.0))
        m = f.groupby([f["B"], f["T"], p_bin, c_bin])["step_ms"].transform("mean")
        out[str(strategy)] = _r2(f["step_ms"].to_numpy(float), m.to_numpy(float))
    return out


def backtest(results: Results, holdout: int | None = None, profile: dict | None | bool = True) -> dict:
    """Fit on every users level below ``holdout`` (default: the highest), predict it.

    Returns {"holdout_users", "fit_levels", "median_abs_error", "fit_r2": {strategy:
    r² of the whole step on the fit levels}, "rows": [{"strategy", "output_class",
    "metric", "users", "predicted", "measured", "abs_error"}], "models" (not
    JSON), "rows_ex_post" (the same rows at each held cell's own measured machine speed,
    ``analysis.model.machine_speed``; None without an engine profile), "crossover": [rows],
    "step_model": {strategy: profiled | fitted}, "profile" (the
    engine profile's path or None), "loo" (``loo_backtest``, None where it cannot run), "lro"
    (``lro_backtest``: leave one repeat out; None without repeats or a step log)}.
    ``profile``: True = look for one (``analysis.model.profiled.find_profile``), None = the
    step-log fit, a dict = that profile. The first sampling label only (``one_sampling``).
    Raises ValueError when the run has fewer than two users levels or no step log.
    """
    results, flagged, cells, levels = _levels(results)
    req = results.requests
    if len(levels) < 2:
        raise ValueError(f"backtest needs >= 2 users levels, the run has {levels}; run more "
                         "than one tier (`--tier all`) or a sweep (`--sweep`)")
    srv = server_data.cell_table(results) if results.steps.empty else None
    if results.steps.empty and (srv is None or srv.empty):
        raise ValueError("backtest needs the server's step log (steps.parquet) or its Prometheus "
                         "counters (--server-metrics); the target gave neither")
    top = holdout if holdout is not None else levels[-1]
    if top not in levels:
        raise ValueError(f"holdout users level {top} was not measured; levels are {levels}")
    fit_levels = [u for u in levels if u < top]
    if not fit_levels:
        raise ValueError(f"no users level below the holdout {top}; levels are {levels}")
    path = None
    if profile is True:
        from analysis.model import profiled
        profile, path = profiled.find_profile(results)
    if srv is not None:
        models, step_models = fit_server_cell_models(srv, flagged, cells, fit_levels)
        profile = None
    else:
        steps = steps_with_users(results.steps, req)
        models, step_models = fit_cell_models(steps, flagged, cells, fit_levels, profile or None,
                                              results)
    if path is None and profile:
        path = str(profile.get("path") or "given")
    meas = _measured(cells)
    rows = _held_rows(models, meas, top, _repeat_spread(flagged))
    rows_post = (_ex_post_rows(steps, profile, results, models, meas, top, flagged)
                 if srv is None else None)
    errs = [r["abs_error"] for r in rows]
    crossover = [{**r, "predicted": predicted_crossover(models, r["strategy"], r["output_class"])}
                 for r in measured_crossover_interval(cells).to_dict("records")]
    return {"holdout_users": int(top), "fit_levels": fit_levels,
            "median_abs_error": float(np.median(errs)) if errs else None,
            "fit_r2": {s: float(m.r2_step) for s, m in step_models.items()},
            "step_model": {s: m.source for s, m in step_models.items()},
            "profile": path if profile else None,
            "rows": rows, "rows_ex_post": rows_post, "crossover": crossover, "models": models,
            "cells": cells, "loo": _loo_or_none(results, profile, path),
            "lro": lro_backtest(results, profile if profile else None) if srv is None else None}


def _ex_post_rows(steps, profile, results, models, meas, users, flagged) -> list[dict] | None:
    """``_held_rows`` at ``users`` with each held cell at its own measured machine speed;
    None without an engine profile (no speeds)."""
    speeds = held_in_speeds(steps, profile or None, results)
    if speeds.cells.empty:
        return None
    return _held_rows(models, meas, users, _repeat_spread(flagged), speeds.at)


def _loo_or_none(results: Results, profile, path) -> dict | None:
    try:
        loo = loo_backtest(results, profile if profile else None)
    except ValueError:
        return None
    if profile:
        loo["profile"] = path
    return loo


def to_json(bt: dict) -> dict:
    """The command contract's JSON (the ``models`` and ``cells`` objects dropped)."""
    return {k: v for k, v in bt.items() if k not in ("models", "cells")}
