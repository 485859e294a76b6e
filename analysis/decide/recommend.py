"""Per tier x output class recommendation: the strategy with the highest goodput
(output tokens/s of requests meeting every SLO), its margin over the runner-up
and a bootstrap confidence.

Confidence is the share of bootstrap replicates (Efron 1979, "Bootstrap
methods: another look at the jackknife") in which the recommended strategy
still has the highest goodput. Each replicate resamples every strategy's
requests with replacement (same count) and rescales the measured goodput by
the replicate's good tokens per second of request time relative to the full
sample's (a ratio estimator: in a closed loop each user's throughput is its
tokens over the time its requests took). Resampling good tokens alone would
give zero variance whenever every request has the same length and meets the
SLOs. The generator is seeded, so a report is reproducible. Ties go to
``autoregressive`` (no speculation unless it wins).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from analysis.data.metrics import DURATION_S, GOOD, SPEEDUP
from configs import metric_names as mn
from configs.tiers import OUTPUT_CLASSES, TIER_NAMES

N_BOOTSTRAP = 1000
DEFAULT_SEED = 0
TIE_CONFIDENCE = 0.9
TIE = "tie"
RECOMMENDATION_SCHEMA_VERSION = 2   # 2: top-level schema_version; "tie" cells with "tied"


def _goodput_inputs(flagged: pd.DataFrame, cells: pd.DataFrame, tier: str, oc: str):
    """{strategy: (good tokens per request [n], good flags [n], total wall time s,
    request time per request [n] in ms)}."""
    sel = flagged[flagged[mn.REQ_TIER].eq(tier) & flagged[mn.REQ_OUTPUT_CLASS].eq(oc)]
    csel = cells[cells[mn.REQ_TIER].eq(tier) & cells[mn.REQ_OUTPUT_CLASS].eq(oc)]
    out = {}
    for strategy, g in sel.groupby(mn.REQ_STRATEGY, sort=True):
        duration = csel.loc[csel[mn.REQ_STRATEGY].eq(strategy), DURATION_S].sum()
        if not duration > 0:
            continue
        good = g[GOOD].to_numpy(dtype=bool)
        tokens = np.where(good, g[mn.REQ_OUTPUT_TOKENS].fillna(0).to_numpy(dtype=float), 0.0)
        e2e = g[mn.REQ_E2E_MS].astype(float) if mn.REQ_E2E_MS in g else pd.Series(
            np.ones(len(g)))
        e2e = e2e.fillna(e2e.median() if e2e.notna().any() else 1.0).clip(lower=1e-3)
        out[strategy] = (tokens, good, float(duration), e2e.to_numpy(dtype=float))
    return out


def recommend_cell(inputs: dict, n_boot: int = N_BOOTSTRAP, seed: int = DEFAULT_SEED) -> dict:
    """Recommendation for one tier x output class from ``_goodput_inputs`` output.

    Returns {"strategy", "goodput" (tokens/s), "goodput_rps", "runner_up",
    "runner_up_goodput", "margin" (relative, None if the runner-up is 0),
    "margin_abs" (tokens/s), "confidence" (0..1), "goodput_by_strategy", "note"}.
    """
    names = sorted(inputs)
    point = {s: inputs[s][0].sum() / inputs[s][2] for s in names}
    # Highest goodput first; on a tie autoregressive, then alphabetical.
    ranked = sorted(names, key=lambda s: (-point[s], s != mn.AUTOREGRESSIVE, s))
    best = ranked[0]
    note = ""
    if point[best] <= 0:
        if mn.AUTOREGRESSIVE not in names:
            return {"strategy": None, "leader": None, "tied": [], "goodput": 0.0,
                    "goodput_rps": 0.0, "runner_up": None,
                    "runner_up_goodput": None, "margin": None, "margin_abs": None,
                    "confidence": None, "goodput_by_strategy": {s: 0.0 for s in ranked},
                    "note": "no strategy met the SLOs (no successful request within them)"}
        best = mn.AUTOREGRESSIVE
        ranked = [best] + [s for s in ranked if s != best]
        note = "no strategy met the SLOs; showing the baseline"
    runner = ranked[1] if len(ranked) > 1 else None
    rng = np.random.default_rng(seed)
    boot = {}
    for s in names:  # sorted order keeps the random stream reproducible
        tokens, _, duration, e2e = inputs[s][:4] if len(inputs[s]) > 3 else (
            *inputs[s], np.ones_like(inputs[s][0]))
        idx = rng.integers(0, tokens.size, size=(n_boot, tokens.size))
        full_rate = tokens.sum() / e2e.sum()
        rate = tokens[idx].sum(axis=1) / e2e[idx].sum(axis=1)
        boot[s] = point[s] * (rate / full_rate if full_rate > 0 else 0.0 * rate)
    stacked = np.column_stack([boot[s] for s in names])
    wins = stacked[:, names.index(best)] >= stacked.max(axis=1)
    confidence = float(wins.mean()) if runner is not None else 1.0
    good, duration = inputs[best][1], inputs[best][2]
    runner_gp = point[runner] if runner else None
    tied: list[str] = []
    if runner is not None and confidence < TIE_CONFIDENCE and point[best] > 0:
        b = stacked[:, names.index(best)]
        tied = [best] + [s for s in ranked[1:]
                         if float((stacked[:, names.index(s)] >= b).mean()) >= 1 - TIE_CONFIDENCE]
        if len(tied) == 1:
            tied.append(runner)
        note = (note + "; " if note else "") + (
            f"tie: {best} leads but wins only {confidence:.0%} of bootstrap replicates "
            f"(< {TIE_CONFIDENCE:.0%}); run longer cells or --repeats to separate {', '.join(tied)}")
    return {
        "strategy": TIE if tied else best,
        "leader": best,
        "tied": tied,
        "goodput": float(point[best]),
        "goodput_rps": float(good.sum() / duration),
        "runner_up": runner,
        "runner_up_goodput": float(runner_gp) if runner_gp is not None else None,
        "margin": (float((point[best] - runner_gp) / runner_gp)
                   if runner_gp else None),
        "margin_abs": float(point[best] - runner_gp) if runner_gp is not None else None,
        "confidence": confidence,
        "goodput_by_strategy": {s: float(point[s]) for s in ranked},
        "note": note,
    }


def recommend(flagged: pd.DataFrame, cells: pd.DataFrame, slos: dict,
              n_boot: int = N_BOOTSTRAP, seed: int = DEFAULT_SEED) -> dict:
    """``{tier: {output_class: {...recommend_cell..., "users", "speedup", "slo"}}}``.

    Runs and users levels inside one tier x output class are pooled.
    """
    out: dict = {}
    keys = flagged[[mn.REQ_TIER, mn.REQ_OUTPUT_CLASS]].drop_duplicates()
    for tier, oc in sorted(keys.itertuples(index=False, name=None), key=cell_order):
        inputs = _goodput_inputs(flagged, cells, tier, oc)
        if not inputs:
            continue
        rec = recommend_cell(inputs, n_boot, seed)
        csel = cells[cells[mn.REQ_TIER].eq(tier) & cells[mn.REQ_OUTPUT_CLASS].eq(oc)
                     & cells[mn.REQ_STRATEGY].eq(rec.get("leader") or rec["strategy"])]
        speedup = csel[SPEEDUP].mean()
        rec.update({
            "users": sorted(int(u) for u in csel[mn.REQ_USERS].unique()),
            "speedup": None if pd.isna(speedup) else float(speedup),
            "slo": {"ttft_ms": slos[tier].ttft_ms, "tpot_ms": slos[tier].tpot_ms,
                    "source": slos[tier].source},
            "n_requests": int(csel["n_requests"].sum()),
            "bootstrap": {"replicates": n_boot, "seed": seed, "over": "requests"},
        })
        out.setdefault(tier, {})[oc] = rec
    return out


def recommend_by_sampling(flagged: pd.DataFrame, cells: pd.DataFrame, slos: dict,
                          n_boot: int = N_BOOTSTRAP, seed: int = DEFAULT_SEED) -> dict:
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
    labels = sampling_labels(flagged) or [None]
    out: dict = {}
    for label in labels:
        f = flagged if label is None else flagged[flagged[mn.REQ_SAMPLING].eq(label)]
        c = cells if label is None else cells[cells[mn.REQ_SAMPLING].eq(label)]
        temp = (f[mn.REQ_TEMPERATURE].dropna().iloc[0] if mn.REQ_TEMPERATURE in f
                and f[mn.REQ_TEMPERATURE].notna().any() else None)
        for tier, by in recommend(f, c, slos, n_boot, seed).items():
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
        return "no bootstrap"
    word = "sure" if confidence >= 0.95 else "likely" if confidence >= 0.75 else "uncertain"
    return f"{word}: confidence {percent(confidence, 0)}"


def headline_lines(rec: dict) -> list[str]:
    """The answer first, one line per tier x output class, low to high.

    ``"low / short: run ngram; 23.4% more goodput than autoregressive (sure: confidence 99%)"``;
    with several sampling settings one line each: ``"low / short / t0.7: run ..."``.
    Confidence words: sure >= 95%, likely >= 75%, else uncertain (bootstrap share).
    """
    lines = []
    several = any(r.get("by_sampling") for _, _, r in entries(rec))
    for tier, oc, r in entries(rec):
        head = f"{tier} / {oc}{' / ' + r['sampling'] if several and r.get('sampling') else ''}:"
        if r.get("strategy") is None:
            lines.append(f"{head} no strategy met the SLOs; nothing to recommend")
        elif r.get("strategy") == TIE:
            lines.append(f"{head} run any of {', '.join(r.get('tied', []))} (a tie: {r.get('leader')} leads "
                         f"by {percent(r.get('margin'))}, confidence {percent(r.get('confidence'), 0)} "
                         f"< {percent(TIE_CONFIDENCE, 0)})")
        elif r.get("note"):
            lines.append(f"{head} run {r['strategy']} ({r['note']})")
        elif r.get("runner_up") is None:
            lines.append(f"{head} run {r['strategy']} (the only strategy measured)")
        else:
            by = (f"{percent(r['margin'])} more goodput than {r['runner_up']}" if r.get("margin") is not None
                  else f"ahead of {r['runner_up']}, which met no SLO")
            lines.append(f"{head} run {r['strategy']}; {by} ({_sureness(r.get('confidence'))})")
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
        rows.append({"tier": tier, "output_class": oc,
                     **({"sampling": r.get("sampling", mn.GREEDY)} if several else {}),
                     "users": r["users"], "strategy": strategy,
                     **({"base_strategy": r.get("base_strategy"), "k": r.get("k")} if variants else {}),
                     "goodput_tok_s": r["goodput"],
                     "goodput_rps": r["goodput_rps"], "speedup": r["speedup"],
                     "runner_up": r["runner_up"], "margin": percent(r["margin"]),
                     "confidence": percent(r["confidence"], 0), "note": r["note"]})
    return rows
