"""Racing to a decision: per cell, which strategies still contend, and whether the cell is
decided (a winner), equivalent (any of the contenders will do) or undecided.

One pure function of the request rows, used by the load generator's racing loop
(``python -m loadgen --budget``: which cells to repeat, which strategies to drop) and by
the report (``analysis.decide.recommend``), so the console and the report agree.

The statistic is goodput: output tokens/s of requests meeting every SLO (DistServe,
Zhong et al. 2024), per replicate = good output tokens / the replicate's wall time
(first scheduled send to last end, seconds). A replicate is one (run, users, repeat) of a
strategy's cell: one cell run. **The replicate is the unit of evidence**: requests inside
one 10-s cell share its machine state, so their spread says nothing about the drift from
one cell to the next, which on a shared box is the larger noise (5-25 % between cells of
the same deployment).

Uncertainty, per look at the data:

- the model: ln(goodput) of a replicate = strategy effect + pass effect + noise, fitted by
  least squares per cell (``_fit``): a randomized block design whose blocks are the racing
  passes (the first pass, then each round; Fisher 1935, The Design of Experiments, ch. IV),
  so drift from one pass to the next cancels out of every comparison, and a ratio of two
  strategies' goodput is a difference of effects;
- the noise is the residual standard deviation of that fit, pooled over every cell of the
  run (``pooled_noise``). The first pass runs the baseline twice per cell (the run's A/A:
  A B C A), which is what measures it before any contender has run twice. A cell whose own
  residual deviation is larger (>= 2 degrees of freedom) uses its own;
- the interval of ln(g_s / g_leader) is a Student t interval over the pooled degrees of
  freedom, effect difference +- t(1 - a/2, df) * sd * sqrt(contrast variance);
- sequential looks are controlled by alpha spending: look k of a raced cell spends
  a_k = (1 - c) / (k (k + 1)), which sums to 1 - c over any number of looks (a
  Bonferroni-type spending; Lan & DeMets 1983 for spending functions); a single
  evaluation (a run without racing) spends 1 - c at once. Within a look the comparisons of
  the leader with the m other contenders share it (a_k / m each, Bonferroni).

Rules, at confidence ``c`` (default 0.9) and margin ``m`` (default 0.03):

- leader: the contender with the highest strategy effect (ties: ``autoregressive``, then
  alphabetical);
- a contender is dropped when the upper end of its interval lies below 0 (the leader is
  better at the look's level);
- a contender is equivalent to the leader when its interval lies inside +-m_eff, where
  m_eff = max(m, the noise of one replicate): a difference smaller than the box's own
  cell-to-cell noise is not one a team can act on here (two one-sided tests, TOST,
  Schuirmann 1987);
- decided: every other strategy dropped; equivalent: every contender left is equivalent to
  the leader; else undecided;
- no noise measured (one replicate per strategy and no A/A anywhere in the run): nothing
  is dropped or declared; the cell is undecided and says so.

An A/A (one deployment raced against itself) is decided at most 1 - c of the time: a
twin is dropped only when its interval excludes 0, and the spending keeps the chance
over every look of the race under 1 - c.

``decide_replicates`` replays the looks: ``looks`` are the times (unix s) at which the
racing loop evaluated (``manifest.json`` ``race.looks``); look k sees the replicates that
had ended by then, and a strategy dropped at a look stays dropped (the loop stopped
running it), so replaying a finished run's rows gives the loop's own decisions.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterable

import numpy as np
import pandas as pd
from scipy import stats

from analysis.data.metrics import GOOD, with_slo_flags
from analysis.data.slo import resolve_slos
from analysis.data.stability import apply_warmup
from configs import metric_names as mn

DEFAULT_CONFIDENCE = 0.9
DEFAULT_MARGIN = 0.03
DECIDED, EQUIVALENT, UNDECIDED = "decided", "equivalent", "undecided"
STATUSES = (DECIDED, EQUIVALENT, UNDECIDED)
REPEAT = mn.REQ_REPEAT
# The cell a decision is about: the one cell key without strategy and users (tier, output
# class and whatever else identifies a cell, e.g. a sampling label), as far as the rows have it.
DECISION_KEY = tuple(k for k in mn.CELL_KEY if k not in (mn.REQ_STRATEGY, mn.REQ_USERS))
# ln(goodput) of a replicate with no good token: this fraction of the cell's best replicate
ZERO_FLOOR = 1e-3
_TS_SLACK = 1e-3   # seconds: a replicate that ended at a look's time belongs to it


@dataclass
class Replicate:
    """One replicate of one strategy's cell (one cell run): per request good output tokens
    (0 when the request missed an SLO or failed); the replicate's wall time (s), repeat
    index and end (unix s, its last request's end)."""

    tokens: np.ndarray
    duration_s: float
    n_good: int
    repeat: int = 0
    end_ts: float = math.inf

    @property
    def goodput(self) -> float:
        """Good output tokens / wall time (tokens/s)."""
        return float(self.tokens.sum() / self.duration_s)


@dataclass
class Noise:
    """The run's cell-to-cell noise: the pooled standard deviation of one replicate's
    ln(goodput) around its (cell, strategy) mean. ``sd`` None when nothing ran twice.
    ``aa``: per cell label, the baseline's A/A (its second replicate over its first, minus
    1: a fraction)."""

    sd: float | None
    df: int
    groups: int
    source: str = "run"   # run | cell | none
    aa: dict[str, float] = field(default_factory=dict)

    @property
    def relative(self) -> float | None:
        """The noise as a fraction of goodput (exp(sd) - 1)."""
        return None if self.sd is None else math.expm1(self.sd)

    def to_dict(self) -> dict:
        return {"sd_log": self.sd, "relative": self.relative, "df": self.df, "groups": self.groups,
                "source": self.source, "aa": dict(self.aa)}


@dataclass
class Decision:
    """A cell's decision. Fractions, not percents; goodput in tokens/s, time in s."""

    status: str                          # decided | equivalent | undecided
    leader: str | None
    contenders: list[str]                # still in the race, leader first
    equivalent: list[str]                # status equivalent: the leader and its equivalents
    dropped: dict[str, int]              # strategy -> the look (1-based) that dropped it
    confidence: float | None             # see ``decide_replicates``
    win_probability: dict[str, float]    # P(leader ahead of s) under the t model, s's last look
    relative_interval: dict[str, list]   # s -> [lo, hi] of g_s / g_leader - 1, at the look's level
    goodput: dict[str, float]            # per strategy: good tokens / summed wall time (``pooled_goodput``)
    goodput_rps: dict[str, float]        # good requests/s, same way
    # s -> [goodput of s, goodput of the leader, repeats] over the repeats both ran: a dropped
    # strategy stopped running, so its own mean and the leader's are of different times
    paired: dict[str, list]
    repeats: dict[str, int]              # replicates per strategy
    time_s: float                        # wall time of every replicate of the cell, summed
    rounds: int                          # looks taken (1 = the first evaluation only)
    decided_at_repeat: int | None        # the look (1-based) that settled it
    noise: dict = field(default_factory=dict)      # Noise.to_dict() of the last look
    alpha: list = field(default_factory=list)      # alpha spent per look (before / m)
    needs_repeats: int | None = None     # undecided: replicates per contender that would decide
    level: float | None = None           # the last look's interval level (1 - its alpha / m)
    reason: str = ""                     # undecided: why, in words
    lead: dict = field(default_factory=dict)  # s -> the leader's fitted lead g_leader / g_s - 1, s's last look
    bootstrap: dict = field(default_factory=dict)  # the settings (name kept for readers)

    def to_dict(self) -> dict:
        return asdict(self)


def _ordered(frame: pd.DataFrame) -> pd.DataFrame:
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
            key = key if isinstance(key, tuple) else (key,)
            reps.append(Replicate(tokens, duration, int(good.sum()),
                                  int(key[-1]) if keys and keys[-1] == REPEAT else 0, float(end)))
        if reps:
            out[str(strategy)] = reps
    return out


def pooled_goodput(reps: list[Replicate]) -> float:
    """A strategy's goodput over its replicates: good tokens / summed wall time (tokens/s),
    the cell table's ``goodput_tokens_per_s`` (``analysis.data.metrics``) on the same rows:
    one number wherever it is printed."""
    return float(sum(r.tokens.sum() for r in reps) / sum(r.duration_s for r in reps))


def _window(end_ts: float, cutoffs: list[float] | None) -> int:
    """The racing pass a replicate belongs to: the index of the first look at or after its
    end (0 without looks); past the last look, one more."""
    if not cutoffs:
        return 0
    for i, c in enumerate(cutoffs):
        if end_ts <= c + _TS_SLACK:
            return i
    return len(cutoffs)


def _repeat_blocks(reps: dict[str, list[Replicate]]) -> dict[int, int]:
    """Without racing looks, the passes are the repeat indices (``--repeats K --interleave``
    runs every strategy once per repeat, mirrored): repeat -> block. A repeat that only one
    strategy ran (the A/A's second baseline, repeat 1 of a one-repeat pass) joins the block
    before it, so the A/A still measures the noise."""
    by: dict[int, set[str]] = {}
    for s, v in reps.items():
        for r in v:
            by.setdefault(r.repeat, set()).add(s)
    out, cur = {}, None
    for k in sorted(by):
        if cur is None or len(by[k]) >= 2:
            cur = k
        out[k] = cur
    return out


def _observations(reps: dict[str, list[Replicate]], cutoffs: list[float] | None,
                  upto: int | None) -> list[tuple[str, int, float]]:
    """(strategy, pass, ln goodput) of every replicate in looks <= ``upto`` (None: all); a
    replicate without a good token at ZERO_FLOOR of the cell's best. The pass (the block of
    the design): a raced run's look window (``_window``), else its repeat (``_repeat_blocks``):
    drift shared by the strategies of one pass cancels out of every comparison."""
    best = max((r.goodput for v in reps.values() for r in v), default=0.0)
    floor = max(best * ZERO_FLOOR, 1e-9)
    blocks = None if cutoffs else _repeat_blocks(reps)
    out = []
    for s, v in reps.items():
        for r in v:
            w = _window(r.end_ts, cutoffs)
            if upto is None or w <= upto:
                out.append((s, w if blocks is None else blocks[r.repeat], math.log(max(r.goodput, floor))))
    return out


@dataclass
class _Fit:
    """Least squares of ln goodput = strategy + pass (a randomized block design, the pass
    the block: Fisher 1935, The Design of Experiments, ch. IV); ``cov`` unscaled."""

    names: list[str]
    beta: np.ndarray
    cov: np.ndarray
    ss: float
    df: int
    n: dict[str, int]

    def effect(self, s: str) -> float:
        return float(self.beta[self.names.index(s)])

    def contrast_var(self, s: str, t: str) -> float:
        """Var(effect s - effect t) / sigma^2."""
        i, j = self.names.index(s), self.names.index(t)
        return float(self.cov[i, i] + self.cov[j, j] - 2 * self.cov[i, j])


def _fit(obs: list[tuple[str, int, float]]) -> _Fit | None:
    if not obs:
        return None
    names = sorted({o[0] for o in obs})
    blocks = sorted({o[1] for o in obs})
    x = np.zeros((len(obs), len(names) + len(blocks) - 1))
    y = np.array([o[2] for o in obs])
    for row, (s, b, _) in enumerate(obs):
        x[row, names.index(s)] = 1.0
        k = blocks.index(b)
        if k:
            x[row, len(names) + k - 1] = 1.0
    beta, *_ = np.linalg.lstsq(x, y, rcond=None)
    resid = y - x @ beta
    df = len(obs) - int(np.linalg.matrix_rank(x))
    return _Fit(names, beta, np.linalg.pinv(x.T @ x), float(resid @ resid), df,
                {s: sum(1 for o in obs if o[0] == s) for s in names})


def pooled_noise(cells: dict[tuple, dict[str, list[Replicate]]], cutoffs: list[float] | None = None,
                 upto: int | None = None, baseline: str = mn.AUTOREGRESSIVE) -> Noise:
    """The run's cell-to-cell noise over every cell's replicates in passes <= ``upto``: the
    residual sd of the block design's fit (``_fit``), pooled over cells (sums of squares and
    degrees of freedom added); and the baseline's A/A per cell (its first two replicates)."""
    ss, df, n, aa = 0.0, 0, 0, {}
    for key, reps in cells.items():
        f = _fit(_observations(reps, cutoffs, upto))
        if f is not None and f.df > 0:
            ss, df, n = ss + f.ss, df + f.df, n + 1
        base = sorted(reps.get(baseline, []), key=lambda r: r.end_ts)
        if len(base) >= 2 and _window(base[1].end_ts, cutoffs) <= (upto if upto is not None else 1 << 30) \
                and base[0].goodput > 0:
            aa[key_label(key)] = base[1].goodput / base[0].goodput - 1
    if df == 0:
        return Noise(None, 0, 0, "none", aa)
    return Noise(math.sqrt(ss / df), df, n, "run", aa)


def alpha_at(look: int, confidence: float, single: bool = False) -> float:
    """The alpha look ``look`` (1-based) spends: (1 - c) / (k (k + 1)); a single evaluation
    (``single``) spends 1 - c."""
    return (1 - confidence) if single else (1 - confidence) / (look * (look + 1))


_TIE_LOG = 1e-9   # ln-goodput differences below this are numerical ties (the baseline wins them)


def _rank(point: dict[str, float]) -> list[str]:
    return sorted(point, key=lambda s: (-round(point[s] / _TIE_LOG), s != mn.AUTOREGRESSIVE, s))


def _noise_for(fit: _Fit, run: Noise | None) -> Noise:
    """The run's noise, or the cell's own residual noise when that is larger (>= 2 df)."""
    own = Noise(math.sqrt(fit.ss / fit.df), fit.df, 1, "cell") if fit.df else None
    if run is None or run.sd is None:
        return own or Noise(None, 0, 0, "none")
    if own is not None and own.df >= 2 and own.sd > run.sd:
        return Noise(own.sd, own.df, 1, "cell", run.aa)
    return run


def _evaluate(fit: _Fit, contenders: list[str], noise: Noise, alpha: float, margin: float) -> dict:
    """One look among ``contenders``: leader, P(leader ahead), the interval of g_s / g_lead - 1
    at level 1 - alpha / m, which to drop and which are equivalent."""
    point = {s: fit.effect(s) for s in contenders}
    leader = _rank(point)[0]
    m = max(len(contenders) - 1, 1)
    a = alpha / m
    out = {"leader": leader, "win": {}, "interval": {}, "drop": [], "equiv": [], "level": 1 - a,
           "needs": None, "margin": margin,
           # the leader's fitted lead over s (pass-adjusted, the interval's centre): >= 0 up
           # to the rank's tie tolerance, whatever the raw means of unbalanced repeats say
           "lead": {s: math.expm1(point[leader] - point[s]) for s in contenders if s != leader}}
    if noise.sd is None or noise.df == 0:
        return out
    q = float(stats.t.ppf(1 - a / 2, noise.df))
    m_eff = max(margin, noise.relative or 0.0)
    out["margin"] = m_eff
    needs = []
    for s in contenders:
        if s == leader:
            continue
        diff = point[s] - point[leader]
        v = fit.contrast_var(s, leader)
        se = noise.sd * math.sqrt(v)
        out["win"][s] = float(stats.t.cdf(-diff / se, noise.df)) if se > 0 else float(diff < 0)
        lo, hi = diff - q * se, diff + q * se
        out["interval"][s] = [math.expm1(lo), math.expm1(hi)]
        if hi < -_TIE_LOG:
            out["drop"].append(s)
        elif math.expm1(lo) > -m_eff and math.expm1(hi) < m_eff:
            out["equiv"].append(s)
        elif diff < 0 and se > 0:
            # replicates per contender at which the gap would clear the interval (se ~ 1/sqrt(n))
            n_now = 2.0 / v
            needs.append(math.ceil(n_now * (q * se / -diff) ** 2))
    out["needs"] = max(needs) if needs else None
    return out


def decide_cell(rows: pd.DataFrame, confidence: float = DEFAULT_CONFIDENCE,
                margin: float = DEFAULT_MARGIN, looks: list[float] | None = None,
                noise: Callable[[list[float] | None, int], Noise] | None = None) -> Decision | None:
    """The decision for one cell from its flagged request rows (every strategy's; column
    ``meets_slo`` from ``analysis.data.metrics.with_slo_flags``): ``decide_replicates``
    over ``replicates(rows)``."""
    return decide_replicates(replicates(rows), confidence, margin, looks, noise)


@dataclass
class _Replay:
    """The racing loop's looks replayed over one cell: drops are sticky, each look spends its
    alpha; ``ev`` is the last look's evaluation (``_evaluate``), ``nz`` its noise."""

    contenders: list[str]
    status: str = UNDECIDED
    ev: dict | None = None
    nz: Noise | None = None
    settled_at: int | None = None
    n_eval: int = 0
    alphas: list = field(default_factory=list)
    dropped: dict = field(default_factory=dict)
    win_at_drop: dict = field(default_factory=dict)
    lead_at_drop: dict = field(default_factory=dict)

    def look(self, fit: _Fit, nz: Noise, confidence: float, margin: float, single: bool) -> bool:
        """One look at ``fit``; True when it settles the cell (decided or equivalent)."""
        live = [s for s in self.contenders if s in fit.names]
        self.n_eval += 1
        self.nz = nz
        alpha = alpha_at(self.n_eval, confidence, single)
        self.alphas.append(alpha)
        if len(live) == 1:
            ev = {"leader": live[0], "win": {}, "interval": {}, "drop": [], "equiv": [],
                  "level": 1 - alpha, "needs": None, "margin": margin, "lead": {}}
        else:
            ev = _evaluate(fit, live, nz, alpha, margin)
        self.ev = ev
        for s in ev["drop"]:
            self.dropped[s] = self.n_eval
            self.win_at_drop[s] = ev["win"][s]
            self.lead_at_drop[s] = ev["lead"][s]
        self.contenders = [ev["leader"]] + [s for s in live if s != ev["leader"] and s not in ev["drop"]]
        if len(self.contenders) == 1:
            self.status, self.settled_at = DECIDED, self.n_eval
        elif len(ev["equiv"]) == len(self.contenders) - 1:
            self.status, self.settled_at = EQUIVALENT, self.n_eval
        return self.status != UNDECIDED

    def confidence_and_reason(self) -> tuple[float | None, str]:
        """``Decision.confidence`` (see ``decide_replicates``) and, undecided, why in words."""
        others = self.contenders[1:]
        if self.status == DECIDED:
            return (min(self.win_at_drop.values()) if self.win_at_drop else 1.0), ""
        if self.status == EQUIVALENT:
            return self.ev["level"], ""
        conf = min((self.ev["win"][s] for s in others if s in self.ev["win"]), default=None)
        if self.nz is None or self.nz.sd is None:
            return conf, ("one replicate per strategy and no A/A: the run did not measure its "
                          "cell-to-cell noise (race with --budget, or --repeats 2)")
        reason = (f"the differences are inside the noise (one replicate's goodput varies "
                  f"+-{100 * self.nz.relative:.0f}% between cells)")
        if self.ev.get("needs"):
            reason += f"; about {self.ev['needs']} replicates per contender would separate them"
        return conf, reason

    def last_look(self) -> tuple[dict, dict, dict]:
        """(P(leader ahead), the leader's fitted lead, the interval) per other strategy: at
        its drop for a dropped one, at the last look for the contenders left."""
        win, lead, interval = dict(self.win_at_drop), dict(self.lead_at_drop), {}
        if self.ev is not None:
            others = self.contenders[1:]
            win.update({s: self.ev["win"][s] for s in others if s in self.ev["win"]})
            lead.update({s: self.ev["lead"][s] for s in others if s in self.ev.get("lead", {})})
            interval = dict(self.ev["interval"])
        return win, lead, interval


def _paired(reps: dict[str, list[Replicate]], leader: str) -> dict[str, list]:
    """s -> [mean goodput of s, the leader's mean goodput, n] over the repeats both ran."""
    lead_by_repeat = {r.repeat: r.goodput for r in reps[leader]}
    out = {}
    for s, v in reps.items():
        common = [r for r in v if r.repeat in lead_by_repeat] if s != leader else []
        if common:
            out[s] = [float(np.mean([r.goodput for r in common])),
                      float(np.mean([lead_by_repeat[r.repeat] for r in common])), len(common)]
    return out


def _replay(reps: dict[str, list[Replicate]], confidence: float, margin: float,
            cutoffs: list[float] | None, noise: Callable | None) -> _Replay:
    """Every look of one cell in order (one over all replicates without ``cutoffs``)."""
    single = cutoffs is None
    n_windows = 1 if single else len(cutoffs) + int(
        any(_window(r.end_ts, cutoffs) == len(cutoffs) for v in reps.values() for r in v))
    run = _Replay(_rank({s: float(np.mean([math.log(max(r.goodput, 1e-9)) for r in v]))
                         for s, v in reps.items()}))
    for w in range(n_windows):
        fit = _fit(_observations(reps, cutoffs, w))
        if fit is None or not any(s in fit.names for s in run.contenders):
            continue
        if run.look(fit, _noise_for(fit, noise(cutoffs, w) if noise else None), confidence, margin, single):
            break
    return run


def decide_replicates(reps: dict[str, list[Replicate]], confidence: float = DEFAULT_CONFIDENCE,
                      margin: float = DEFAULT_MARGIN, looks: list[float] | None = None,
                      noise: Callable[[list[float] | None, int], Noise] | None = None) -> Decision | None:
    """The decision for one cell from its replicates per strategy (``replicates``).

    looks: the racing loop's evaluation times (unix s; ``manifest.json`` ``race.looks``),
    replayed in order, each seeing the replicates ended by then, drops sticky, alpha spent
    per look; None: one evaluation over every replicate spending 1 - c. noise: the run's
    noise at a look's time (``pooled_noise`` over every cell of the run); None: this cell's
    own replicates alone.
    Returned ``confidence``: decided = the smallest P(winner ahead) of a dropped strategy
    when it was dropped; equivalent = the interval level of the settling look; undecided =
    the smallest P(leader ahead) of a contender left (how close the cell came). None
    without any replicate. Raises ValueError for a confidence or margin out of range.
    """
    if not 0.5 < confidence < 1:
        raise ValueError(f"confidence must be in (0.5, 1), got {confidence!r}")
    if not margin > 0:
        raise ValueError(f"margin must be > 0, got {margin!r}")
    reps = {s: v for s, v in reps.items() if v}
    if not reps:
        return None
    cutoffs = sorted(float(t) for t in looks) if looks else None
    run = _replay(reps, confidence, margin, cutoffs, noise)
    leader, ev, nz = run.contenders[0], run.ev, run.nz
    conf, reason = run.confidence_and_reason()
    win, lead, interval = run.last_look()
    return Decision(
        status=run.status, leader=leader, contenders=run.contenders,
        equivalent=run.contenders if run.status == EQUIVALENT else [],
        dropped=run.dropped, confidence=conf, win_probability=win, relative_interval=interval,
        lead=lead, goodput={s: pooled_goodput(v) for s, v in reps.items()},
        goodput_rps={s: float(sum(r.n_good for r in v) / sum(r.duration_s for r in v))
                     for s, v in reps.items()},
        paired=_paired(reps, leader), repeats={s: len(v) for s, v in reps.items()},
        time_s=float(sum(r.duration_s for v in reps.values() for r in v)), rounds=run.n_eval,
        decided_at_repeat=run.settled_at, noise=nz.to_dict() if nz is not None else {},
        alpha=run.alphas, needs_repeats=ev.get("needs") if ev is not None and run.status == UNDECIDED else None,
        level=ev.get("level") if ev is not None else None, reason=reason,
        bootstrap={"over": "replicates (cell runs)", "interval": "t over ln(goodput), pooled sd",
                   "looks": run.n_eval, "alpha_spending": "(1 - c) / (k (k + 1))" if cutoffs
                   else "1 - c (one evaluation)",
                   "confidence": confidence, "equivalence_margin": margin,
                   "effective_margin": (ev or {}).get("margin", margin)})


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


def cell_replicates(flagged: pd.DataFrame) -> dict[tuple, dict[str, list[Replicate]]]:
    """{cell key tuple: ``replicates``} for every decision cell of ``flagged``."""
    keys = decision_key(flagged)
    out = {}
    for key, g in flagged.groupby(keys, sort=True):
        out[key if isinstance(key, tuple) else (key,)] = replicates(g)
    return out


def run_noise(cells: dict[tuple, dict[str, list[Replicate]]],
              baseline: str = mn.AUTOREGRESSIVE) -> Callable[[list[float] | None, int], Noise]:
    """``pooled_noise`` of the run's cells at a look (what ``decide_replicates`` takes)."""
    return lambda cutoffs, upto: pooled_noise(cells, cutoffs, upto, baseline)


def race_status(flagged: pd.DataFrame, confidence: float = DEFAULT_CONFIDENCE,
                margin: float = DEFAULT_MARGIN, looks: list[float] | None = None,
                ) -> dict[tuple, Decision]:
    """``decide_replicates`` for every cell of ``flagged`` (grouped by ``decision_key``),
    the noise pooled over the whole run: ``{cell key tuple: Decision}``."""
    cells = cell_replicates(flagged)
    noise = run_noise(cells)
    out: dict[tuple, Decision] = {}
    for key, reps in cells.items():
        d = decide_replicates(reps, confidence, margin, looks, noise)
        if d is not None:
            out[key] = d
    return out


def _pct(frac: float | None) -> str:
    return "-" if frac is None or (isinstance(frac, float) and math.isnan(frac)) else f"{100 * frac:.0f}%"


def key_label(key: tuple) -> str:
    """``low/long`` for a decision cell key; a sampling label other than greedy is kept
    (``low/short/t0.7``), greedy (the default) is left out."""
    parts = [str(k) for k in key if k is not None]
    if len(parts) > 2 and parts[-1] in (mn.GREEDY, ""):
        parts = parts[:-1]
    return "/".join(parts)


def status_line(key: tuple, d: Decision) -> str:
    """One console / report line: ``low/long: decided dflash2 (confidence 97%, 4 repeats,
    2 looks, noise +-8%, 2:10 of cell time)``; equivalent lists the set; undecided the
    contenders left and why."""
    label = key_label(key)
    reps = max(d.repeats.values()) if d.repeats else 0
    m, s = divmod(int(round(d.time_s)), 60)
    noise = d.noise.get("relative") if d.noise else None
    tail = (f"confidence {_pct(d.confidence)}, {reps} repeat{'s' if reps != 1 else ''}, "
            f"{d.rounds} look{'s' if d.rounds != 1 else ''}, noise "
            f"{'+-' + _pct(noise) if noise is not None else 'unmeasured'}, {m}:{s:02d} of cell time")
    if d.status == DECIDED:
        return f"{label}: decided {d.leader} ({tail})"
    if d.status == EQUIVALENT:
        return (f"{label}: equivalent {', '.join(d.equivalent)} (within +-"
                f"{_pct(d.bootstrap.get('effective_margin'))}; {tail})")
    return f"{label}: undecided between {', '.join(d.contenders)} ({tail}; {d.reason})"
