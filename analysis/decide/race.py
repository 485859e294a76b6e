"""Racing to a decision: per cell, which strategies still contend, and whether the cell is
decided (a winner), equivalent (any of the contenders will do) or undecided.

One pure function of the request rows, used by the load generator's racing loop
(``python -m loadgen --budget``: which cells to repeat, which strategies to drop) and by
the report (``analysis.decide.recommend``), so the console and the report agree.

The statistic is goodput: output tokens/s of requests meeting every SLO (DistServe,
Zhong et al. 2024), per replicate = good output tokens / the replicate's wall time
(first scheduled send to last end, seconds). A replicate is one (run, users, repeat) of a
strategy's cell; a strategy's estimate is the mean over its replicates (repeats are the
unit across them).

Uncertainty: the bootstrap (Efron 1979, "Bootstrap methods: another look at the
jackknife"). Within a replicate the requests are resampled with replacement and the
replicate's goodput rescaled by the resample's good tokens per second of request time
(a ratio estimator, as ``analysis.decide.recommend`` has always done: resampling good
tokens alone gives no variance when every request has the same length). With >= 2
replicates the bootstrap is two-level: resample the replicates, then the requests within
each resampled replicate; with one, over requests alone. Both levels scale the bootstrap
deviations by sqrt(n / (n - 1)) (n units resampled: requests, or repeats), the usual
small-sample correction of the bootstrap variance of a mean (Efron & Tibshirani 1993, An
Introduction to the Bootstrap, section 5.2): with 2 repeats the plain bootstrap gives half
the variance. Strategies are resampled independently. The generator is seeded, so a
decision is reproducible.

Limits: one repeat sees only request-to-request noise, not drift between cells (a
cell-level slowdown on a busy machine looks like a real difference until a repeat shows
it); and every racing round is another look at the data, so the chance that some round
drops a strategy that is not worse grows with the rounds (no alpha spending here).

Rules, at confidence ``c`` (default 0.9) and margin ``m`` (default 0.03):

- leader: the contender with the highest goodput estimate (ties: ``autoregressive``,
  then alphabetical);
- a contender is dropped once the leader beats it in >= c of the bootstrap replicates
  (a one-sided test at level 1 - c);
- a contender is equivalent to the leader when the central c interval of the relative
  difference (g_s - g_leader) / g_leader lies inside (-m, +m): two one-sided tests (TOST,
  Schuirmann 1987, "A comparison of the two one-sided tests procedure and the power
  approach for assessing the equivalence of average bioavailability") at level
  (1 - c) / 2 each;
- decided: every other strategy dropped; equivalent: every contender left is equivalent to
  the leader; else undecided.

``decide_cell`` replays the rounds: the first evaluation uses the first pass (repeats
< ``first_pass_repeats``), each later repeat index is one racing round, and a strategy
dropped in a round stays dropped (the racing loop stopped running it), so replaying the
finished run's rows gives the loop's own decisions.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np
import pandas as pd

from analysis.data.metrics import GOOD, with_slo_flags
from analysis.data.slo import resolve_slos
from analysis.data.stability import apply_warmup
from configs import metric_names as mn

DEFAULT_CONFIDENCE = 0.9
DEFAULT_MARGIN = 0.03
N_BOOTSTRAP = 1000
DEFAULT_SEED = 0
DECIDED, EQUIVALENT, UNDECIDED = "decided", "equivalent", "undecided"
STATUSES = (DECIDED, EQUIVALENT, UNDECIDED)
REPEAT = getattr(mn, "REQ_REPEAT", "repeat")
# The cell a decision is about: the one cell key without strategy and users (tier, output
# class and whatever else identifies a cell, e.g. a sampling label), as far as the rows have it.
_CELL_KEY = getattr(mn, "CELL_KEY", (mn.REQ_STRATEGY, mn.REQ_TIER, mn.REQ_OUTPUT_CLASS, mn.REQ_USERS))
DECISION_KEY = tuple(k for k in _CELL_KEY if k not in (mn.REQ_STRATEGY, mn.REQ_USERS))


@dataclass
class Replicate:
    """One replicate of one strategy's cell: per request good output tokens (0 when the
    request missed an SLO or failed) and end-to-end ms; the replicate's wall time (s)."""

    tokens: np.ndarray
    e2e_ms: np.ndarray
    duration_s: float
    n_good: int
    repeat: int = 0

    @property
    def goodput(self) -> float:
        """Good output tokens / wall time (tokens/s)."""
        return float(self.tokens.sum() / self.duration_s)


@dataclass
class Decision:
    """A cell's decision. Fractions, not percents; goodput in tokens/s, time in s."""

    status: str                          # decided | equivalent | undecided
    leader: str | None
    contenders: list[str]                # still in the race, leader first
    equivalent: list[str]                # status equivalent: the leader and its equivalents
    dropped: dict[str, int]              # strategy -> repeat index of the round that dropped it
    confidence: float | None             # see ``decide_cell``
    win_probability: dict[str, float]    # P(leader beats s), at s's last evaluation
    relative_interval: dict[str, list]   # s -> [lo, hi] of (g_s - g_leader) / g_leader, level c
    goodput: dict[str, float]            # estimate per strategy (mean over its replicates)
    goodput_rps: dict[str, float]        # good requests/s, same way
    # s -> [goodput of s, goodput of the leader, repeats] over the repeats both ran: a dropped
    # strategy stopped running, so its own mean and the leader's are of different times
    paired: dict[str, list]
    repeats: dict[str, int]              # replicates per strategy
    time_s: float                        # wall time of every replicate of the cell, summed
    rounds: int                          # evaluations made (1 = the first pass only)
    decided_at_repeat: int | None        # repeat index of the round that settled it
    bootstrap: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def _ordered(frame: pd.DataFrame) -> pd.DataFrame:
    """Rows in a stable order (the bootstrap draws by position: the loop's in-memory rows and
    requests.parquet must give the same draws)."""
    cols = [c for c in (mn.REQ_SCHEDULED_TS, mn.REQ_SENT_TS, mn.REQ_REQUEST_INDEX, mn.REQ_END_TS)
            if c in frame.columns]
    return frame.sort_values(cols, kind="mergesort") if cols else frame


def replicates(rows: pd.DataFrame) -> dict[str, list[Replicate]]:
    """{strategy: [Replicate, ...]} of one cell's flagged request rows (column ``meets_slo``),
    replicates in (run, users, repeat) order. A replicate without a positive wall time is left
    out."""
    df = rows.copy()
    df[REPEAT] = pd.to_numeric(df[REPEAT], errors="coerce").fillna(0).astype(int) \
        if REPEAT in df.columns else 0
    keys = [c for c in (mn.REQ_RUN_ID, mn.REQ_USERS, REPEAT) if c in df.columns]
    out: dict[str, list[Replicate]] = {}
    for strategy, g in df.groupby(mn.REQ_STRATEGY, sort=True):
        reps = []
        for key, r in g.groupby(keys, sort=True):
            r = _ordered(r)
            start, end = r[mn.REQ_SCHEDULED_TS].min(), r[mn.REQ_END_TS].max()
            duration = float(end - start) if pd.notna(start) and pd.notna(end) else math.nan
            if not duration > 0:
                continue
            good = r[GOOD].to_numpy(dtype=bool)
            tokens = np.where(good, r[mn.REQ_OUTPUT_TOKENS].fillna(0).to_numpy(dtype=float), 0.0)
            e2e = (r[mn.REQ_E2E_MS].astype(float) if mn.REQ_E2E_MS in r
                   else pd.Series(np.ones(len(r))))
            e2e = e2e.fillna(e2e.median() if e2e.notna().any() else 1.0).clip(lower=1e-3)
            key = key if isinstance(key, tuple) else (key,)
            reps.append(Replicate(tokens, e2e.to_numpy(dtype=float), duration, int(good.sum()),
                                  int(key[-1]) if keys and keys[-1] == REPEAT else 0))
        if reps:
            out[str(strategy)] = reps
    return out


def _boot_replicate(rep: Replicate, n_boot: int, rng: np.random.Generator) -> np.ndarray:
    """n_boot bootstrap goodputs of one replicate (requests resampled, ratio estimator)."""
    point = rep.goodput
    if rep.tokens.size == 0 or point <= 0:
        return np.zeros(n_boot)
    idx = rng.integers(0, rep.tokens.size, size=(n_boot, rep.tokens.size))
    full_rate = rep.tokens.sum() / rep.e2e_ms.sum()
    rate = rep.tokens[idx].sum(axis=1) / rep.e2e_ms[idx].sum(axis=1)
    return _unshrink(point * rate / full_rate, point, rep.tokens.size)


def _unshrink(boot: np.ndarray, centre: float, n: int) -> np.ndarray:
    """Scale bootstrap deviations by sqrt(n / (n - 1)): the bootstrap variance of a mean of
    n units is (n - 1) / n of the unbiased estimate, which matters with few units (2 repeats:
    half the variance)."""
    return centre + (boot - centre) * math.sqrt(n / (n - 1)) if n > 1 else boot


def bootstrap_goodput(reps: list[Replicate], n_boot: int, rng: np.random.Generator) -> np.ndarray:
    """n_boot bootstrap replicates of the mean goodput over ``reps`` (tokens/s): over requests
    with one replicate; two-level (replicates, then requests within each) with >= 2."""
    pools = np.stack([_boot_replicate(r, n_boot, rng) for r in reps])   # [R, n_boot]
    if len(reps) == 1:
        return pools[0]
    which = rng.integers(0, len(reps), size=(n_boot, len(reps)))       # replicates drawn
    draw = rng.integers(0, n_boot, size=(n_boot, len(reps)))           # an independent request resample each
    return _unshrink(pools[which, draw].mean(axis=1), float(np.mean([r.goodput for r in reps])), len(reps))


def _rank(point: dict[str, float]) -> list[str]:
    return sorted(point, key=lambda s: (-point[s], s != mn.AUTOREGRESSIVE, s))


def _relative(other: np.ndarray, lead: np.ndarray) -> np.ndarray:
    """(other - lead) / lead per replicate; 0 where both are 0, +inf where only lead is 0."""
    with np.errstate(divide="ignore", invalid="ignore"):
        d = (other - lead) / lead
    d = np.where(lead > 0, d, np.where(other > 0, np.inf, 0.0))
    return d


def _evaluate(reps: dict[str, list[Replicate]], contenders: list[str], confidence: float,
              margin: float, n_boot: int, rng: np.random.Generator) -> dict:
    """One evaluation among ``contenders``: leader, P(leader beats s), the level-c interval of
    the relative difference, which to drop and which are equivalent."""
    point = {s: float(np.mean([r.goodput for r in reps[s]])) for s in contenders}
    boot = {s: bootstrap_goodput(reps[s], n_boot, rng) for s in sorted(contenders)}
    leader = _rank(point)[0]
    lo_q, hi_q = (1 - confidence) / 2, (1 + confidence) / 2
    win, interval, tost, drop, equiv = {}, {}, {}, [], []
    for s in contenders:
        if s == leader:
            continue
        win[s] = float((boot[leader] > boot[s]).mean())
        d = _relative(boot[s], boot[leader])
        lo, hi = (float(v) for v in np.quantile(d, [lo_q, hi_q]))
        interval[s] = [lo, hi]
        # TOST: the larger one-sided tail beyond the margin; the equivalence holds at level
        # 1 - 2 * tail (the central interval of that level touches the margin)
        tost[s] = max(0.0, 1.0 - 2.0 * max(float((d <= -margin).mean()), float((d >= margin).mean())))
        if win[s] >= confidence:
            drop.append(s)
        elif -margin < lo and hi < margin:
            equiv.append(s)
    return {"leader": leader, "win": win, "interval": interval, "tost": tost, "drop": drop,
            "equiv": equiv}


def decide_cell(rows: pd.DataFrame, confidence: float = DEFAULT_CONFIDENCE,
                margin: float = DEFAULT_MARGIN, first_pass_repeats: int | None = None,
                n_boot: int = N_BOOTSTRAP, seed: int = DEFAULT_SEED) -> Decision | None:
    """The decision for one cell from its flagged request rows (every strategy's; column
    ``meets_slo`` from ``analysis.data.metrics.with_slo_flags``): ``decide_replicates``
    over ``replicates(rows)``."""
    return decide_replicates(replicates(rows), confidence, margin, first_pass_repeats, n_boot, seed)


def decide_replicates(reps: dict[str, list[Replicate]], confidence: float = DEFAULT_CONFIDENCE,
                      margin: float = DEFAULT_MARGIN, first_pass_repeats: int | None = None,
                      n_boot: int = N_BOOTSTRAP, seed: int = DEFAULT_SEED) -> Decision | None:
    """The decision for one cell from its replicates per strategy (``replicates``).

    first_pass_repeats: repeats of the first pass (``loadgen --repeats``); each later
    repeat index is replayed as one racing round (drops are sticky). None: one evaluation
    over every replicate (merged runs, or a run without racing).
    confidence in (0.5, 1), margin > 0 (a fraction). Returned ``confidence``: decided = the
    smallest share of bootstrap replicates in which the winner beat a dropped strategy (when
    it was dropped); equivalent = the smallest TOST level at which an equivalent contender is
    within the margin (>= c); undecided = the smallest share in which the leader beats a
    contender still left (how close the cell came to a winner). None without any replicate.
    Raises ValueError for a confidence or margin out of range.
    """
    if not 0.5 < confidence < 1:
        raise ValueError(f"confidence must be in (0.5, 1), got {confidence!r}")
    if not margin > 0:
        raise ValueError(f"margin must be > 0, got {margin!r}")
    reps = {s: v for s, v in reps.items() if v}
    if not reps:
        return None
    all_repeats = sorted({r.repeat for v in reps.values() for r in v})
    last = all_repeats[-1]
    if first_pass_repeats is None:
        rounds = [last]
    else:
        first = min(max(first_pass_repeats - 1, 0), last)
        rounds = [first] + [r for r in all_repeats if r > first]
    contenders = _rank({s: float(np.mean([r.goodput for r in v])) for s, v in reps.items()})
    dropped: dict[str, int] = {}
    win_at_drop: dict[str, float] = {}
    status, ev, settled_at, n_eval = UNDECIDED, None, None, 0
    for k, upto in enumerate(rounds):
        sub = {s: [r for r in reps[s] if r.repeat <= upto] for s in contenders}
        live = [s for s in contenders if sub[s]]
        if not live:
            continue
        rng = np.random.default_rng([seed, k])
        n_eval += 1
        if len(live) == 1:
            ev = {"leader": live[0], "win": {}, "interval": {}, "tost": {}, "drop": [], "equiv": []}
        else:
            ev = _evaluate(sub, live, confidence, margin, n_boot, rng)
        for s in ev["drop"]:
            dropped[s] = upto
            win_at_drop[s] = ev["win"][s]
        contenders = [ev["leader"]] + [s for s in live if s != ev["leader"] and s not in ev["drop"]]
        if len(contenders) == 1:
            status, settled_at = DECIDED, upto
            break
        if len(ev["equiv"]) == len(contenders) - 1:
            status, settled_at = EQUIVALENT, upto
            break
    leader = contenders[0]
    others = [s for s in contenders if s != leader]
    if status == DECIDED:
        conf = min(win_at_drop.values()) if win_at_drop else 1.0
    elif status == EQUIVALENT:
        conf = min(ev["tost"][s] for s in others)
    else:
        conf = min(ev["win"][s] for s in others) if others else None
    win = dict(win_at_drop)
    interval = {}
    if ev is not None:
        win.update({s: ev["win"][s] for s in others if s in ev["win"]})
        interval = {s: v for s, v in ev["interval"].items()}
    duration = {s: float(sum(r.duration_s for r in v)) for s, v in reps.items()}
    paired = {}
    lead_by_repeat = {r.repeat: r.goodput for r in reps[leader]}
    for s, v in reps.items():
        if s == leader:
            continue
        common = [r for r in v if r.repeat in lead_by_repeat]
        if common:
            paired[s] = [float(np.mean([r.goodput for r in common])),
                         float(np.mean([lead_by_repeat[r.repeat] for r in common])), len(common)]
    return Decision(
        status=status, leader=leader, contenders=contenders,
        equivalent=contenders if status == EQUIVALENT else [],
        dropped=dropped, confidence=conf, win_probability=win, relative_interval=interval,
        goodput={s: float(np.mean([r.goodput for r in v])) for s, v in reps.items()},
        goodput_rps={s: float(np.mean([r.n_good / r.duration_s for r in v])) for s, v in reps.items()},
        paired=paired,
        repeats={s: len(v) for s, v in reps.items()},
        time_s=float(sum(duration.values())), rounds=n_eval, decided_at_repeat=settled_at,
        bootstrap={"replicates": n_boot, "seed": seed,
                   "over": "repeats x requests" if max(len(v) for v in reps.values()) > 1
                   else "requests",
                   "confidence": confidence, "equivalence_margin": margin})


def flag_requests(requests: pd.DataFrame, manifest_config: dict, warmup_s: float = 0.0) -> pd.DataFrame:
    """Request rows (``analysis.data.load`` normalised) -> the flagged rows the decision reads,
    the way the report builds them: the warm-up cut (``apply_warmup``, seconds), then the
    SLO flags against the manifest's per-tier SLOs (``resolve_slos``)."""
    if warmup_s:
        requests, _, _ = apply_warmup(requests, None, warmup_s)
    slos = resolve_slos(sorted(requests[mn.REQ_TIER].unique()), manifest_config)
    return with_slo_flags(requests, slos)


def decision_key(frame: pd.DataFrame) -> list[str]:
    """The decision-cell key columns present in ``frame`` (``DECISION_KEY``)."""
    return [k for k in DECISION_KEY if k in frame.columns]


def race_status(flagged: pd.DataFrame, confidence: float = DEFAULT_CONFIDENCE,
                margin: float = DEFAULT_MARGIN, first_pass_repeats: int | None = None,
                n_boot: int = N_BOOTSTRAP, seed: int = DEFAULT_SEED) -> dict[tuple, Decision]:
    """``decide_cell`` for every cell of ``flagged`` (grouped by ``decision_key``):
    ``{cell key tuple: Decision}``."""
    keys = decision_key(flagged)
    out: dict[tuple, Decision] = {}
    for key, g in flagged.groupby(keys, sort=True):
        d = decide_cell(g, confidence, margin, first_pass_repeats, n_boot, seed)
        if d is not None:
            out[key if isinstance(key, tuple) else (key,)] = d
    return out


def _pct(frac: float | None) -> str:
    return "-" if frac is None or (isinstance(frac, float) and math.isnan(frac)) else f"{100 * frac:.0f}%"


def key_label(key: tuple) -> str:
    """``low/long`` for a decision cell key; a sampling label other than greedy is kept
    (``low/short/t0.7``), greedy (the default) is left out."""
    parts = [str(k) for k in key if k is not None]
    if len(parts) > 2 and parts[-1] in (getattr(mn, "GREEDY", "greedy"), ""):
        parts = parts[:-1]
    return "/".join(parts)


def status_line(key: tuple, d: Decision) -> str:
    """One console / report line: ``low/long: decided dflash2 (confidence 97%, 4 repeats,
    2:10 of cell time)``; equivalent lists the set; undecided the contenders left."""
    label = key_label(key)
    reps = max(d.repeats.values()) if d.repeats else 0
    m, s = divmod(int(round(d.time_s)), 60)
    tail = f"confidence {_pct(d.confidence)}, {reps} repeat{'s' if reps != 1 else ''}, {m}:{s:02d} of cell time"
    if d.status == DECIDED:
        return f"{label}: decided {d.leader} ({tail})"
    if d.status == EQUIVALENT:
        return (f"{label}: equivalent {', '.join(d.equivalent)} (within +-"
                f"{_pct(d.bootstrap.get('equivalence_margin'))}; {tail})")
    return f"{label}: undecided between {', '.join(d.contenders)} ({tail})"
