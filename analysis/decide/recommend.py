"""Per tier x output class recommendation: the strategy with the highest goodput
(output tokens/s of requests meeting every SLO), its margin over the runner-up, and the
cell's race status with its confidence (``analysis.decide.race``, the one decision
function the load generator's racing loop uses too).

Status: ``decided`` (every other strategy's interval of goodput relative to the winner
lies below 0), ``equivalent`` (the contenders left are within +-max(3 %, the run's
cell-to-cell noise) of the leader: TOST, Schuirmann 1987) or ``undecided`` (shown as
``"strategy": "tie"``, never a coin-flip winner). The intervals are over replicates (cell
runs), with the run's pooled cell-to-cell noise and alpha spent per racing look
(``analysis.decide.race``). Ties go to ``autoregressive`` (no speculation unless it wins).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from analysis.data.metrics import DURATION_S, GOOD, SPEEDUP
from configs import metric_names as mn
from configs.tiers import OUTPUT_CLASSES, TIER_NAMES
from analysis.decide import race

TIE_CONFIDENCE = 0.9
TIE = "tie"
# 2: top-level schema_version; "tie" cells with "tied"
# 3: per cell "status" (decided | equivalent | undecided, analysis.decide.race), "repeats",
#    "repeats_by_strategy", "time_s", "equivalent", "contenders", "dropped", "win_probability",
#    "relative_interval", "decided_at_repeat"; "confidence" is the status's confidence; "tie"
#    only when undecided; top-level "race" (the run's racing settings and outcome) and "claims"
# 4: per cell "noise" (the run's cell-to-cell noise the decision used), "alpha" (spent per
#    look), "looks", "needs_repeats", "reason"; "bootstrap" holds the settings (no resampling)
RECOMMENDATION_SCHEMA_VERSION = 4


def _race_fields(d: "race.Decision") -> dict:
    """The decision's own fields every recommendation carries (status, contenders, dropped,
    intervals, repeats, time, noise, alpha per look, looks, why)."""
    return {"status": d.status, "contenders": list(d.contenders), "dropped": dict(d.dropped),
            "equivalent": list(d.equivalent), "win_probability": dict(d.win_probability),
            "relative_interval": dict(d.relative_interval),
            "repeats": max(d.repeats.values()), "repeats_by_strategy": dict(d.repeats),
            "time_s": d.time_s, "decided_at_repeat": d.decided_at_repeat,
            "noise": dict(d.noise), "alpha": list(d.alpha), "looks": d.rounds,
            "needs_repeats": d.needs_repeats, "reason": d.reason, "level": d.level}


def _runner_up(d: "race.Decision", best: str, ranked: list[str]):
    """(runner-up, leader's goodput, runner-up's goodput; tokens/s). The runner-up: the best
    other contender (same repeats as the leader), else the dropped strategy closest to the
    leader over the repeats both ran (their own means are of different times); both goodputs
    over those same repeats where paired."""
    point = d.goodput
    others = [s for s in d.contenders if s != best and s in point] or sorted(
        (s for s in ranked[1:] if s in d.paired),
        key=lambda s: -(d.paired[s][0] / d.paired[s][1] if d.paired[s][1] > 0 else 0.0)) or ranked[1:]
    runner = others[0] if others else None
    lead_gp = point[best]
    runner_gp = point[runner] if runner else None
    if runner is not None and runner in d.paired and best == d.leader:
        runner_gp, lead_gp = d.paired[runner][0], d.paired[runner][1]
    return runner, lead_gp, runner_gp


def _status_note(d: "race.Decision", best: str, note: str) -> tuple[list[str], str]:
    """(tied strategies, the note extended by the status): undecided names the contenders
    left and what would separate them; equivalent says to run any of them."""
    tied: list[str] = []
    margin_pct = f"{100 * d.bootstrap.get('effective_margin', d.bootstrap.get('equivalence_margin', race.DEFAULT_MARGIN)):.0f}%"
    level = f"{100 * d.bootstrap.get('confidence', TIE_CONFIDENCE):.0f}%"
    if d.status == race.UNDECIDED and d.goodput[best] > 0:
        tied = list(d.contenders)
        note = (note + "; " if note else "") + (
            f"tie: {best} leads {', '.join(tied[1:])} but not at {level} and they are not within "
            f"+-{margin_pct}: {d.reason}; run --repeats, a longer --budget or a quieter machine "
            f"to separate {', '.join(tied)}")
    elif d.status == race.EQUIVALENT:
        note = (note + "; " if note else "") + (
            f"equivalent: {', '.join(d.equivalent)} are within +-{margin_pct} of each other's goodput "
            f"at {level} (run any of them)")
    return tied, note


def from_decision(d: "race.Decision") -> dict:
    """The recommendation dict of one cell from its race decision.

    Returns {"strategy" (the winner; the leader when equivalent; "tie" when undecided;
    None when nothing met an SLO and no baseline ran), "leader", "status" (decided |
    equivalent | undecided), "tied" (undecided: the contenders left), "equivalent"
    (equivalent: the leader and its equivalents), "contenders", "dropped", "goodput"
    (tokens/s), "goodput_rps", "runner_up", "runner_up_goodput", "margin" (the leader's fitted
    lead over the runner-up, ``Decision.lead``; else the goodputs' ratio - 1; None if the
    runner-up is 0), "margin_abs" (tokens/s), "confidence" (0..1, ``race.decide_cell``),
    "win_probability", "relative_interval", "paired" (per other strategy: its goodput and the
    leader's over the repeats both ran; the runner-up and margin use these), "repeats" (most
    replicates of a strategy),
    "repeats_by_strategy", "time_s", "goodput_by_strategy", "note"}.
    """
    point = d.goodput
    ranked = sorted(point, key=lambda s: (-point[s], s != mn.AUTOREGRESSIVE, s))
    best = d.leader
    ranked = [best] + [s for s in ranked if s != best]
    race_fields = _race_fields(d)
    note = ""
    if point[best] <= 0:
        if mn.AUTOREGRESSIVE not in point:
            return {"strategy": None, "leader": None, "tied": [], "goodput": 0.0,
                    "goodput_rps": 0.0, "runner_up": None,
                    "runner_up_goodput": None, "margin": None, "margin_abs": None,
                    "confidence": None, "goodput_by_strategy": {s: 0.0 for s in ranked},
                    "note": "no strategy met the SLOs (no successful request within them)",
                    **race_fields}
        best = mn.AUTOREGRESSIVE
        ranked = [best] + [s for s in ranked if s != best]
        note = "no strategy met the SLOs; showing the baseline"
    runner, lead_gp, runner_gp = _runner_up(d, best, ranked)
    tied, note = _status_note(d, best, note)
    return {
        "strategy": TIE if tied else best,
        "leader": best,
        "tied": tied,
        "goodput": float(point[best]),
        "goodput_rps": float(d.goodput_rps[best]),
        "runner_up": runner,
        "runner_up_goodput": float(runner_gp) if runner_gp is not None else None,
        # the lead the decision used (pass-adjusted fit), so its sign always matches "leader";
        # without a fit (one replicate each), the goodputs' ratio
        "margin": (float(d.lead[runner]) if runner in d.lead
                   else float((lead_gp - runner_gp) / runner_gp) if runner_gp else None),
        "margin_abs": float(lead_gp - runner_gp) if runner_gp is not None else None,
        "paired": {s: {"goodput": v[0], "leader_goodput": v[1], "repeats": v[2]}
                   for s, v in d.paired.items()},
        "confidence": d.confidence if runner is not None else 1.0,
        "goodput_by_strategy": {s: float(point[s]) for s in ranked},
        "note": note,
        **race_fields,
    }


def recommend(flagged: pd.DataFrame, cells: pd.DataFrame, slos: dict,
              confidence: float = TIE_CONFIDENCE, margin: float = race.DEFAULT_MARGIN,
              looks: list[float] | None = None, noise=None) -> dict:
    """``{tier: {output_class: {...from_decision..., "users", "speedup", "slo"}}}``.

    Runs, users levels and repeats inside one tier x output class are its replicates
    (``analysis.decide.race``); ``looks`` replays a raced run's looks (manifest
    ``race.looks``); ``noise`` is the run's noise function (``race.run_noise``; default: the
    noise of ``flagged`` itself).
    Forced-acceptance deployments (``--acceptance-length``) never compete: their text is not
    the target's (``analysis.data.dimensions.real_only``).
    """
    from analysis.data.dimensions import real_only

    flagged, cells = real_only(flagged), real_only(cells)
    if noise is None:
        noise = race.run_noise(race.cell_replicates(flagged))
    out: dict = {}
    keys = flagged[[mn.REQ_TIER, mn.REQ_OUTPUT_CLASS]].drop_duplicates()
    for tier, oc in sorted(keys.itertuples(index=False, name=None), key=cell_order):
        sel = flagged[flagged[mn.REQ_TIER].eq(tier) & flagged[mn.REQ_OUTPUT_CLASS].eq(oc)]
        d = race.decide_cell(sel, confidence, margin, looks, noise)
        if d is None:
            continue
        rec = from_decision(d)
        csel = cells[cells[mn.REQ_TIER].eq(tier) & cells[mn.REQ_OUTPUT_CLASS].eq(oc)
                     & cells[mn.REQ_STRATEGY].eq(rec.get("leader") or rec["strategy"])]
        speedup = csel[SPEEDUP].mean()
        rec.update({
            "users": sorted(int(u) for u in csel[mn.REQ_USERS].unique()),
            "speedup": None if pd.isna(speedup) else float(speedup),
            "slo": {"ttft_ms": slos[tier].ttft_ms, "tpot_ms": slos[tier].tpot_ms,
                    "source": slos[tier].source},
            "n_requests": int(csel["n_requests"].sum()),
            "bootstrap": dict(d.bootstrap),
        })
        out.setdefault(tier, {})[oc] = rec
    return out


def recommend_by_sampling(flagged: pd.DataFrame, cells: pd.DataFrame, slos: dict,
                          confidence: float = TIE_CONFIDENCE, margin: float = race.DEFAULT_MARGIN,
                          looks: list[float] | None = None) -> dict:
    """``recommend`` per tier x output class x sampling label (``metric_names.CELL_KEY``).

    Returns ``{tier: {output_class: rec}}`` where ``rec`` is the first sampling label's
    (``analysis.data.dimensions.sampling_labels``: greedy first) and carries the others in
    ``rec["by_sampling"] = {label: rec}``. Every rec gets ``sampling``, ``temperature`` and
    the recommended deployment's ``base_strategy``, ``k`` and ``top_k_candidates`` (from the
    cell table; None when unknown or a tie). A run with one sampling setting gives exactly
    ``recommend``'s dict plus those fields.
    """
    from analysis.data.dimensions import BASE_STRATEGY, CANDIDATES, K, sampling_labels

    attrs = {}
    if not cells.empty:
        cols = [c for c in (BASE_STRATEGY, K, CANDIDATES) if c in cells.columns]
        attrs = cells.groupby(mn.REQ_STRATEGY)[cols].first().to_dict("index") if cols else {}
    from analysis.data.dimensions import real_only

    labels = sampling_labels(flagged) or [None]
    noise = race.run_noise(race.cell_replicates(real_only(flagged)))   # pooled over every label
    out: dict = {}
    for label in labels:
        f = flagged if label is None else flagged[flagged[mn.REQ_SAMPLING].eq(label)]
        c = cells if label is None else cells[cells[mn.REQ_SAMPLING].eq(label)]
        temp = (f[mn.REQ_TEMPERATURE].dropna().iloc[0] if mn.REQ_TEMPERATURE in f
                and f[mn.REQ_TEMPERATURE].notna().any() else None)
        for tier, by in recommend(f, c, slos, confidence, margin, looks, noise).items():
            for oc, r in by.items():
                a = attrs.get(r.get("strategy"), {})
                r.update(sampling=label or mn.GREEDY, temperature=None if temp is None else float(temp),
                         base_strategy=a.get(BASE_STRATEGY, r.get("strategy") if r.get("strategy") != TIE
                                             else None),
                         k=_int_or_none(a.get(K)), top_k_candidates=_int_or_none(a.get(CANDIDATES)))
                slot = out.setdefault(tier, {})
                if oc not in slot:
                    slot[oc] = r
                else:
                    slot[oc].setdefault("by_sampling", {})[r["sampling"]] = r
    return out


def _int_or_none(v) -> int | None:
    return None if v is None or (isinstance(v, float) and np.isnan(v)) else int(v)


def entries(rec: dict):
    """Every (tier, output_class, rec) of a recommendation, low to high; per cell the first
    sampling label's rec, then the others (``by_sampling``)."""
    for tier, oc in sorted(((t, o) for t, by in rec.items() if isinstance(by, dict) for o in by),
                           key=cell_order):
        r = rec[tier][oc]
        yield tier, oc, r
        for other in (r.get("by_sampling") or {}).values():
            yield tier, oc, other


def cell_order(key: tuple[str, str]) -> tuple:
    """Sort key for (tier, output_class): low, mid, high, then other tiers by name; short before long."""
    tier, oc = key
    t = TIER_NAMES.index(tier) if tier in TIER_NAMES else len(TIER_NAMES)
    o = OUTPUT_CLASSES.index(oc) if oc in OUTPUT_CLASSES else len(OUTPUT_CLASSES)
    return (t, tier, o, oc)


def percent(frac: float | None, digits: int = 1) -> str:
    """A fraction shown as a percent (``0.234`` -> ``23.4%``); ``-`` when undefined.

    Margins and confidences are shown this way in the report, ``python -m
    analysis`` and the load generator's console alike (recommendation.json keeps
    the fractions).
    """
    if frac is None or (isinstance(frac, float) and np.isnan(frac)):
        return "-"
    return f"{100 * frac:.{digits}f}%"


def _sureness(confidence: float | None) -> str:
    if confidence is None:
        return "no interval"
    word = "sure" if confidence >= 0.95 else "likely" if confidence >= 0.75 else "uncertain"
    return f"{word}: confidence {percent(confidence, 0)}"


def _clock(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    m, s = divmod(int(round(seconds)), 60)
    return f"{m}:{s:02d}"


def _effort(r: dict) -> str:
    """``"; 3 repeats, 2 looks, noise +-8%, 1:05 of cell time"`` (race fields), or "" for a
    legacy dict."""
    if r.get("repeats") is None:
        return ""
    n, looks = r["repeats"], r.get("looks")
    noise = (r.get("noise") or {}).get("relative")
    return (f"; {n} repeat{'s' if n != 1 else ''}"
            + (f", {looks} look{'s' if looks != 1 else ''}" if looks else "")
            + (f", noise +-{percent(noise, 0)}" if noise is not None else ", noise unmeasured")
            + f", {_clock(r.get('time_s'))} of cell time")


def headline_lines(rec: dict, undecided_reason: str | None = None) -> list[str]:
    """The answer first, one line per tier x output class, low to high.

    ``"low / short: run ngram; 23.4% more goodput than autoregressive (decided, sure:
    confidence 99%; 3 repeats, 1:05 of cell time)"``; an equivalent cell: ``"run any of
    dflash2, dspark (equivalent within +-3%: ...)"``; an undecided one says why
    (``undecided_reason``, e.g. "budget spent"); with several sampling settings one line
    each: ``"low / short / t0.7: run ..."``. Confidence words: sure >= 95%, likely >= 75%,
    else uncertain (P(winner ahead) under the t model over replicates).
    """
    lines = []
    several = any(r.get("by_sampling") for _, _, r in entries(rec))
    for tier, oc, r in entries(rec):
        head = f"{tier} / {oc}{' / ' + r['sampling'] if several and r.get('sampling') else ''}:"
        status = r.get("status")
        effort = _effort(r)
        level = percent(r.get("bootstrap", {}).get("confidence", TIE_CONFIDENCE), 0)
        if r.get("strategy") is None:
            lines.append(f"{head} no strategy met the SLOs; nothing to recommend")
        elif r.get("strategy") == TIE:
            why = f"undecided{f', {undecided_reason}' if undecided_reason else ''}: " if status else "a tie: "
            # the leader's P(lead) must reach the one-sided end of the look's two-sided interval
            need = percent(1 - (1 - r["level"]) / 2, 1) if r.get("level") else level
            sure = (f"confidence {percent(r.get('confidence'), 1)} short of the {need} its look needed"
                    if r.get("confidence") is not None else "noise unmeasured, so no confidence")
            lines.append(f"{head} run any of {', '.join(r.get('tied', []))} ({why}{r.get('leader')} leads "
                         f"by {percent(r.get('margin'))}, {sure}{effort})")
        elif status == race.EQUIVALENT:
            b = r.get("bootstrap", {})
            m = percent(b.get("effective_margin", b.get("equivalence_margin", race.DEFAULT_MARGIN)), 0)
            lines.append(f"{head} run any of {', '.join(r.get('equivalent', []))} (equivalent within "
                         f"+-{m}: confidence {percent(r.get('confidence'), 0)}{effort}; "
                         f"{r['strategy']} leads by {percent(r.get('margin'))})")
        elif r.get("note"):
            lines.append(f"{head} run {r['strategy']} ({r['note']})")
        elif r.get("runner_up") is None:
            lines.append(f"{head} run {r['strategy']} (the only strategy measured)")
        else:
            by = (f"{percent(r['margin'])} more goodput than {r['runner_up']}" if r.get("margin") is not None
                  else f"ahead of {r['runner_up']}, which met no SLO")
            lines.append(f"{head} run {r['strategy']}; {by} ({'decided, ' if status else ''}"
                         f"{_sureness(r.get('confidence'))}{effort})")
    return lines


def recommendation_rows(rec: dict) -> list[dict]:
    """Flatten the recommendation for tables: one dict per tier x output class x sampling
    label, low to high. ``sampling`` is a column when the run had several settings,
    ``base_strategy`` and ``k`` when a recommended deployment is a variant (``dflash2-k4``).

    ``margin`` and ``confidence`` are percent strings here (display); the
    recommendation dict and recommendation.json keep the fractions.
    """
    rows = []
    every = [r for _, _, r in entries(rec)]
    several = any(r.get("by_sampling") for r in every)
    variants = any(r.get("base_strategy") not in (None, r.get("strategy")) for r in every)
    for tier, oc, r in entries(rec):
        strategy = r["strategy"]
        if strategy == TIE:
            strategy = f"tie ({', '.join(r.get('tied', []))})"
        elif r.get("status") == race.EQUIVALENT:
            strategy = f"any of ({', '.join(r.get('equivalent', []))})"
        rows.append({"tier": tier, "output_class": oc,
                     **({"sampling": r.get("sampling", mn.GREEDY)} if several else {}),
                     "users": r["users"], "strategy": strategy,
                     **({"base_strategy": r.get("base_strategy"), "k": r.get("k")} if variants else {}),
                     "status": r.get("status"), "goodput_tok_s": r["goodput"],
                     "goodput_rps": r["goodput_rps"], "speedup": r["speedup"],
                     "runner_up": r["runner_up"], "margin": percent(r["margin"]),
                     "confidence": percent(r["confidence"], 0), "repeats": r.get("repeats"),
                     "time_s": r.get("time_s"), "note": r["note"]})
    return rows
