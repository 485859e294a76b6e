"""A load-adaptive speculation policy from a run's measured curves (``python -m analysis policy``).

One deployment hosts one proposer, so a policy is one base strategy plus a map
from the running batch size to the number of speculative tokens k (vLLM's
``num_speculative_tokens_per_batch_size``, PR #32374: inclusive batch-size
ranges ``"a-b"`` -> k, chosen each step from the running batch; k = 0 turns
speculation off). SmartSpec (Liu et al. 2024, arXiv 2406.14066) is why: the k
that pays falls as the batch grows, because every drafted token is verified
inside the batch's forward and at high load those tokens take capacity from
other requests.

Derivation (``derive_policy``), from the run's requests and step log:

1. Levels: each tier of the run (a tier with several users levels, e.g. a
   sweep, gives one level per users value). Each level's typical running batch
   is the median ``batch_size`` of its decode steps (step log, pooled over
   strategies; measured). Without step rows for a level its users count stands in
   (said in ``batch_source``).
2. Candidates: every measured deployment is a (base strategy, k) choice.
   ``autoregressive`` is k = 0 for every base. k of a deployment: the cell
   table's ``k`` column (runs with ``--k`` variants), else the name
   ``<base>-k<N>``, else the step log's ``num_speculative_tokens`` (the k the
   engine used, median over its steps), else the base Serve config's
   ``engine.num_speculative_tokens`` for that name.
3. Scores: per level x output class, each candidate's goodput (output tokens/s
   of requests meeting every SLO) comes from ``analysis.decide.recommend``
   (``goodput_by_strategy``); SLO attainment and tokens/s from
   ``analysis.data.metrics.cell_table``. No throughput arithmetic is repeated here.
   A candidate's score at a band is the sum over the band's level x output class
   cells of its goodput / the best fixed deployment's goodput there (so neither
   output class nor a fast tier dominates).
4. Per base strategy and band: the k with the highest score (ties go to the
   smaller k: no speculation unless it wins). The base strategy chosen is the one
   whose policy scores highest summed over all bands (then the higher summed
   goodput tokens/s); every base's score is returned.
5. Bands: levels sorted by typical batch; levels whose typical batch rounds to
   the same integer share a band. Boundaries lie at the midpoint between
   neighbouring levels' typical batches (``boundary_source: "midpoint"``), unless
   the capacity model (``analysis.model.backtest.fit_all_levels``: the step cost
   fit of ``analysis.model.stepcost`` with its per-cell calibration) predicts
   where the two neighbours' chosen deployments cross in tokens/s strictly
   between them; then the boundary sits there (``"predicted"``; users are
   mapped to batch sizes by interpolating the levels' measured users -> batch).
   The first band starts at 1 (vLLM requires it), the last ends at the engine's
   ``max_num_seqs`` (vLLM uses the last k beyond the last range anyway).

What is measured and what is predicted: each band's goodput, tokens/s and
attainment are the measured ones of the chosen fixed deployment at that band's
level(s); k = 0 is taken to perform as ``autoregressive`` (the base engine with
no drafts); only the boundaries between levels may come from the model.

Errors: ``PolicyError`` (a ValueError) when the run has no speculative
strategy, no ``autoregressive`` baseline, or an unknown ``base_strategy`` /
``output_class`` is asked for.
"""

from __future__ import annotations

import copy
import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import yaml

from analysis.data import metrics
from analysis.data.load import Results
from analysis.decide.recommend import TIE, cell_order, recommend
from configs import metric_names as mn
from configs.paths import CONFIGS_DIR
from configs.serve_config import SPEC_SCHEDULE_KEY, ServeAppConfig, parse_spec_schedule
from configs.tiers import Slo

DEFAULT_BASE_CONFIG = CONFIGS_DIR / "serve.yaml"
DEFAULT_VLLM_BASE_CONFIG = CONFIGS_DIR / "serve-vllm.yaml"   # (--backend vllm)
APP_IMPORT_PATH = "actors.serve.app:build_app"
VARIANT_RE = re.compile(r"^(?P<base>.+?)-k(?P<k>\d+)(?:-c\d+)?$")   # draft_model-k2, dflash2-k4-c16
POLICY_SUFFIX = "-policy"
LEVEL = "level"


class PolicyError(ValueError):
    """The run cannot give a policy (no speculative strategy, no baseline, bad choice)."""


# --- candidates: (base strategy, k) per measured deployment ---------------------------------

RUN_SERVE_CONFIG = "serve_config.yaml"   # the Serve config a run deployed (loadgen writes it)


def deployment_engines(results: Results) -> dict[str, dict]:
    """{deployment name: {"backend": "embedded" | "vllm", "strategy": engine strategy}} from
    the Serve config each run deployed (``<run>/serve_config.yaml``); {} when no run kept
    one (a run against an external server)."""
    out: dict[str, dict] = {}
    for run in results.runs:
        path = Path(run.path) / RUN_SERVE_CONFIG
        if not path.is_file():
            continue
        cfg = yaml.safe_load(path.read_text()) or {}
        for app in cfg.get("applications") or []:
            for e in (app.get("args") or {}).get("strategies") or []:
                eng = e.get("engine") or {}
                name = e.get("name") or eng.get("strategy")
                if name:
                    out.setdefault(name, {"backend": eng.get("backend", "embedded"),
                                          "strategy": eng.get("strategy", name)})
    return out


def baseline_for(results: Results, backend: str | None, strategies: list[str]
                 ) -> tuple[str, list[str]]:
    """(the k = 0 deployment, the deployments the policy is derived from).

    backend None, or no measured deployment on ``backend``: ``autoregressive`` and every
    deployment (a policy measured on the embedded engine may deploy on vLLM with the same
    k map). Else only the deployments the run served on ``backend``, and its
    autoregressive one (e.g. ``vllm-autoregressive``): k = 0 is the base's own engine with
    no drafts, and the best fixed choice is one on the same engine. Raises PolicyError
    when that backend has speculative deployments but no autoregressive one."""
    engines = deployment_engines(results)
    mine = [s for s in strategies if engines.get(s, {}).get("backend") == backend]
    if backend is None or not mine:
        return mn.AUTOREGRESSIVE, strategies
    ar = [s for s in mine if engines[s]["strategy"] == mn.AUTOREGRESSIVE]
    if not ar:
        raise PolicyError(f"the run has no autoregressive deployment on backend {backend} "
                          f"(its {backend} deployments: {mine}): k = 0 needs one")
    return ar[0], mine

def _base_entries(base_config: str | Path) -> dict[str, dict]:
    """{served name: strategy entry dict} of the base Serve config's specload app."""
    cfg = yaml.safe_load(Path(base_config).read_text()) or {}
    for app in cfg.get("applications") or []:
        if app.get("import_path") == APP_IMPORT_PATH:
            args = ServeAppConfig.model_validate(app.get("args") or {})
            return {e.name: raw for e, raw in zip(args.strategies, app["args"]["strategies"])}
    raise PolicyError(f"{base_config}: no application with import_path {APP_IMPORT_PATH!r}")


def deployment_k(name: str, cells: pd.DataFrame, steps: pd.DataFrame,
                 entries: dict[str, dict], baseline: str = mn.AUTOREGRESSIVE
                 ) -> tuple[str, int | None, str]:
    """(base strategy, k, where k came from) of one measured deployment (module docstring, 2);
    ``baseline`` is the k = 0 deployment (``baseline_for``)."""
    if name == baseline:
        return name, 0, "autoregressive"
    sel = cells[cells[mn.REQ_STRATEGY].eq(name)] if not cells.empty else cells
    base = name
    if "base_strategy" in sel and sel["base_strategy"].notna().any():
        base = str(sel["base_strategy"].dropna().iloc[0])
    if "k" in sel and sel["k"].notna().any():
        return base, int(sel["k"].dropna().iloc[0]), "run variants"
    m = VARIANT_RE.match(name)
    if m:
        return m.group("base"), int(m.group("k")), "deployment name"
    if not steps.empty and mn.STEP_NUM_SPEC_TOKENS in steps:
        ks = pd.to_numeric(steps.loc[steps[mn.STEP_STRATEGY].eq(name) & steps[mn.STEP_BATCH_SIZE].gt(0),
                                     mn.STEP_NUM_SPEC_TOKENS], errors="coerce").dropna()
        if len(ks):
            return base, int(ks.median()), "step log num_speculative_tokens"
    entry = entries.get(name)
    if entry is not None and entry.get("engine", {}).get("num_speculative_tokens") is not None:
        return (str(entry["engine"].get("strategy", base)),
                int(entry["engine"]["num_speculative_tokens"]), "base config")
    return base, None, "unknown"


# --- levels and their running batch ---------------------------------------------------------

def label_levels(flagged: pd.DataFrame) -> tuple[pd.DataFrame, dict[str, tuple[str, int]]]:
    """Requests with a ``level`` column: the tier, or ``<tier>@<users>`` for a tier measured
    at several users levels. Returns (frame, {level: (tier, users)})."""
    df = flagged.copy()
    per_tier = df.groupby(mn.REQ_TIER)[mn.REQ_USERS].nunique()
    multi = set(per_tier[per_tier > 1].index)
    df[LEVEL] = [f"{t}@{int(u)}" if t in multi else str(t)
                 for t, u in zip(df[mn.REQ_TIER], df[mn.REQ_USERS])]
    levels = {lv: (str(g[mn.REQ_TIER].iloc[0]), int(g[mn.REQ_USERS].max()))
              for lv, g in df.groupby(LEVEL)}
    return df, levels


def level_batches(steps: pd.DataFrame, requests: pd.DataFrame,
                  levels: dict[str, tuple[str, int]]) -> dict[str, tuple[float, str]]:
    """{level: (typical running batch, source)}: the median ``batch_size`` of the level's
    decode steps (pooled over strategies), else its users count."""
    from analysis.model.backtest import steps_with_users

    out: dict[str, tuple[float, str]] = {}
    st = steps_with_users(steps, requests) if steps is not None and not steps.empty else None
    for lv, (tier, users) in levels.items():
        if st is not None:
            sel = st[st[mn.STEP_BATCH_SIZE].gt(0) & st[mn.REQ_USERS].eq(users)]
            if mn.REQ_TIER in sel and sel[mn.REQ_TIER].notna().any():
                sel = sel[sel[mn.REQ_TIER].eq(tier)]
            if len(sel):
                out[lv] = (float(sel[mn.STEP_BATCH_SIZE].median()),
                           f"step log: median batch_size of {len(sel)} decode steps")
                continue
        out[lv] = (float(users), "users (no step rows for this level)")
    return out


# --- derivation -----------------------------------------------------------------------------

def _level_slos(flagged: pd.DataFrame, slos: dict[str, Slo]) -> dict[str, Slo]:
    return {lv: slos[t] for lv, t in flagged[[LEVEL, mn.REQ_TIER]].drop_duplicates().itertuples(
        index=False, name=None)}


def _cell_stats(cells: pd.DataFrame) -> dict[tuple[str, str, str], dict]:
    """{(level, output class, strategy): {"tokens_per_s", "slo_attainment", "n_requests"}}:
    cell_table rows pooled over runs / repeats (mean tokens/s, request-weighted attainment)."""
    out = {}
    for (lv, oc, s), g in cells.groupby([LEVEL, mn.REQ_OUTPUT_CLASS, mn.REQ_STRATEGY]):
        n = g[mn.CELL_N_REQUESTS].sum()
        out[(lv, oc, s)] = {
            "tokens_per_s": float(g[metrics.OUTPUT_TOKENS_PER_S].mean()),
            "slo_attainment": float((g[metrics.SLO_ATTAINMENT] * g[mn.CELL_N_REQUESTS]).sum() / n)
            if n else None,
            "n_requests": int(n)}
    return out


def _group_bands(batches: dict[str, tuple[float, str]]) -> list[list[str]]:
    """Levels sorted by typical batch; those rounding to one integer share a group."""
    order = sorted(batches, key=lambda lv: (batches[lv][0], lv))
    groups: list[list[str]] = []
    for lv in order:
        if groups and round(batches[groups[-1][0]][0]) == round(batches[lv][0]):
            groups[-1].append(lv)
        else:
            groups.append([lv])
    return groups


def _users_to_batch(points: list[tuple[float, float]], users: float) -> float:
    """Linear interpolation of measured (users, typical batch) points (clamped at the ends)."""
    pts = sorted(points)
    u = np.array([p[0] for p in pts], float)
    b = np.array([p[1] for p in pts], float)
    return float(np.interp(users, u, b))


def _predicted_boundary(models: dict, lower: str, upper: str, ocs: list[str], u_lo: float,
                        u_hi: float) -> float | None:
    """Users level in (u_lo, u_hi) where ``upper``'s predicted tokens/s (summed over output
    classes) first reaches ``lower``'s; None when the model lacks either or they do not cross."""
    if lower == upper or not u_hi > u_lo:
        return None
    grid = np.geomspace(u_lo, u_hi, 200)[1:-1]
    lo_t = np.zeros_like(grid)
    up_t = np.zeros_like(grid)
    for oc in ocs:
        a, b = models.get((lower, oc)), models.get((upper, oc))
        if a is None or b is None:
            return None
        lo_t += a.predict(grid)[0]
        up_t += b.predict(grid)[0]
    idx = np.flatnonzero(up_t >= lo_t)
    if not idx.size or up_t[0] >= lo_t[0]:
        return None   # no crossing strictly inside (or the upper one already wins at u_lo)
    return float(grid[idx[0]])


def _policy_inputs(results: Results, slos: dict[str, Slo], output_class: str | None,
                   base_strategy: str | None, base_config: str | Path,
                   backend: str | None = None):
    """(flagged rows with their LEVEL, levels, cells, step log, Serve entries, candidates
    {deployment: {base_strategy, k, k_source}}, speculative bases, notes, the k = 0
    deployment). Raises PolicyError for an absent output class, no baseline, no speculative
    strategy or an unknown base."""
    flagged = results.requests if metrics.GOOD in results.requests else metrics.with_slo_flags(
        results.requests, slos)
    baseline, keep = baseline_for(results, backend,
                                  sorted(flagged[mn.REQ_STRATEGY].unique()))
    flagged = flagged[flagged[mn.REQ_STRATEGY].isin(keep)]
    if output_class is not None:
        if not flagged[mn.REQ_OUTPUT_CLASS].eq(output_class).any():
            raise PolicyError(f"output class {output_class!r} is not in the run (it has "
                              f"{sorted(flagged[mn.REQ_OUTPUT_CLASS].unique())})")
        flagged = flagged[flagged[mn.REQ_OUTPUT_CLASS].eq(output_class)]
    flagged, levels = label_levels(flagged)
    strategies = sorted(flagged[mn.REQ_STRATEGY].unique())
    if baseline not in strategies:
        raise PolicyError(f"the run has no {baseline!r} cells: k = 0 (speculation off) "
                          "needs the baseline measured beside the speculative strategies")
    cells = metrics.cell_table(flagged.drop(columns=[LEVEL]))
    cells = cells.merge(flagged[[mn.REQ_RUN_ID, mn.REQ_TIER, mn.REQ_USERS, LEVEL]].drop_duplicates(),
                        on=[mn.REQ_RUN_ID, mn.REQ_TIER, mn.REQ_USERS], how="left")
    entries = _base_entries(base_config)
    steps = results.steps if results.steps is not None else pd.DataFrame()
    cand = {}
    for s in strategies:
        base, k, src = deployment_k(s, cells, steps, entries, baseline)
        cand[s] = {"base_strategy": base, "k": k, "k_source": src}
    notes = [f"{s}: k unknown (not in the name, the step log or {base_config}); left out"
             for s, c in cand.items() if c["k"] is None]
    bases = sorted({c["base_strategy"] for s, c in cand.items()
                    if c["k"] and s != baseline})
    if not bases:
        raise PolicyError(f"the run has no speculative strategy with a known k (measured: "
                          f"{strategies}); nothing to switch on or off")
    if base_strategy is not None and base_strategy not in bases:
        raise PolicyError(f"base strategy {base_strategy!r} was not measured with k > 0 "
                          f"(the run's speculative bases: {bases})")
    if baseline != mn.AUTOREGRESSIVE:
        notes.append(f"backend {backend}: derived from the run's {backend} deployments only "
                     f"(k = 0 is {baseline}; the best fixed choice is one on {backend})")
    return flagged, levels, cells, steps, entries, cand, bases, notes, baseline


def _best_fixed(flagged: pd.DataFrame, cells: pd.DataFrame, slos: dict[str, Slo], seed: int,
                n_boot: int) -> tuple[dict, dict]:
    """(best fixed deployment per level x output class: the recommendation's own figures
    (goodput tokens/s per deployment), the per-cell stats by (level, output class, strategy))."""
    lslos = _level_slos(flagged, slos)
    lflag = flagged.assign(**{mn.REQ_TIER: flagged[LEVEL]})
    lcells = cells.assign(**{mn.REQ_TIER: cells[LEVEL]})
    rec = recommend(lflag, lcells, lslos)
    stats = _cell_stats(cells)
    best_fixed: dict[str, dict[str, dict]] = {}
    for lv, by in rec.items():
        for oc, r in by.items():
            leader = r.get("leader") or r.get("strategy")
            st = stats.get((lv, oc, leader), {})
            best_fixed.setdefault(lv, {})[oc] = {
                "strategy": leader, "recommended": r["strategy"], "tied": r.get("tied", []),
                "confidence": r.get("confidence"), "goodput_tok_s": r["goodput"], **st,
                "goodput_by_strategy": r["goodput_by_strategy"]}
    return best_fixed, stats


def _choose_per_base(bases: list[str], cand: dict, groups: list[list[str]],
                     best_fixed: dict, baseline: str = mn.AUTOREGRESSIVE) -> dict[str, dict]:
    """Per base strategy, the k (or autoregressive, k = 0) of each band of levels: the
    highest goodput relative to the best fixed deployment, then goodput; ties to the
    smaller k. {base: {"score", "goodput_tok_s", "ks", "chosen", "options"}}."""
    def score(strategy: str, group: list[str]) -> tuple[float, float]:
        rel, tok = 0.0, 0.0
        for lv in group:
            for b in best_fixed.get(lv, {}).values():
                g = b["goodput_by_strategy"].get(strategy)
                if g is None:
                    continue
                rel += g / b["goodput_tok_s"] if b["goodput_tok_s"] > 0 else 0.0
                tok += g
        return rel, tok

    per_base: dict[str, dict] = {}
    for base in bases:
        options = [(0, baseline)] + sorted(
            (c["k"], s) for s, c in cand.items()
            if c["base_strategy"] == base and c["k"] and s != baseline)
        chosen = []
        for group in groups:
            scored = [(score(s, group), k, s) for k, s in options]
            (rel, tok), k, s = max(scored, key=lambda x: (round(x[0][0], 9), round(x[0][1], 6), -x[1]))
            chosen.append({"k": k, "strategy": s, "score": rel, "goodput_tok_s": tok})
        per_base[base] = {"score": sum(c["score"] for c in chosen),
                          "goodput_tok_s": sum(c["goodput_tok_s"] for c in chosen),
                          "ks": [c["k"] for c in chosen], "chosen": chosen,
                          "options": [s for _, s in options]}
    return per_base


def _capacity_models(results: Results, slos: dict[str, Slo], steps: pd.DataFrame,
                     predict: bool, notes: list[str]) -> dict:
    """The capacity model fitted on every users level (``backtest.fit_all_levels``) for
    predicted band boundaries; {} when not asked, without a step log, or when it cannot be
    fitted (said in ``notes``: boundaries then at midpoints)."""
    if not predict or steps is None or steps.empty:
        return {}
    from analysis.model.backtest import fit_all_levels
    try:
        all_flagged = metrics.with_slo_flags(results.requests, slos)
        return fit_all_levels(results, all_flagged, metrics.cell_table(all_flagged))
    except Exception as exc:  # noqa: BLE001  (a model that cannot be fitted leaves midpoints)
        notes.append(f"capacity model not fitted ({exc!r}): boundaries at midpoints")
        return {}


def _band_hi(i: int, groups: list[list[str]], batches: dict, levels: dict, chosen: list[dict],
             models: dict, ocs: list[str], points: list, lo: int, top: int) -> tuple[int, str]:
    """The last batch size of band ``i`` and where it comes from: the midpoint between the
    bands' median batches, or the capacity model's predicted crossing of the two bands'
    choices when it lies between them; the last band ends at ``top``."""
    if i + 1 >= len(groups):
        return top, "last band: up to max_num_seqs"
    b_here = float(np.median([batches[lv][0] for lv in groups[i]]))
    b_next = float(np.median([batches[lv][0] for lv in groups[i + 1]]))
    hi, source = int(math.floor((b_here + b_next) / 2.0)), "midpoint"
    u_lo = max(levels[lv][1] for lv in groups[i])
    u_hi = min(levels[lv][1] for lv in groups[i + 1])
    cross = _predicted_boundary(models, chosen[i]["strategy"], chosen[i + 1]["strategy"],
                                ocs, float(u_lo), float(u_hi)) if models else None
    if cross is not None:
        b_cross = _users_to_batch(points, cross)
        if b_here < b_cross < b_next:
            hi, source = int(math.floor(b_cross)), (
                f"predicted: the capacity model's tokens/s crossing of "
                f"{chosen[i]['strategy']} and {chosen[i + 1]['strategy']} at {cross:.1f} "
                f"users (batch {b_cross:.1f})")
    return max(hi, lo), source


def _bands(groups: list[list[str]], chosen: list[dict], batches: dict, levels: dict,
           models: dict, ocs: list[str], best_fixed: dict, stats: dict, top: int) -> list[dict]:
    """One band per group of levels: batch range [lo, hi], its k and deployment, the
    measured figures behind it (``derive_policy``'s "bands")."""
    points = [(float(levels[lv][1]), batches[lv][0]) for lv in batches]
    bands, lo = [], 1
    for i, group in enumerate(groups):
        hi, boundary_source = _band_hi(i, groups, batches, levels, chosen, models, ocs, points,
                                       lo, top)
        strategy = chosen[i]["strategy"]
        per_oc = {oc: {"strategy": strategy, **stats.get((lv, oc, strategy), {}),
                       "goodput_tok_s": best_fixed[lv][oc]["goodput_by_strategy"].get(strategy),
                       "level": lv}
                  for lv in group for oc in best_fixed.get(lv, {})}
        bands.append({
            "lo": lo, "hi": hi, "k": chosen[i]["k"], "strategy": strategy,
            "levels": group, "tiers": sorted({levels[lv][0] for lv in group}),
            "users": sorted({levels[lv][1] for lv in group}),
            "batch": float(np.median([batches[lv][0] for lv in group])),
            "batch_source": "; ".join(sorted({batches[lv][1] for lv in group})),
            "boundary_source": boundary_source, "score": chosen[i]["score"],
            "policy": per_oc,
            "best_fixed": {lv: best_fixed.get(lv, {}) for lv in group}})
        lo = hi + 1
    return bands


def _spec_map(bands: list[dict]) -> dict[str, int]:
    """vLLM's ``num_speculative_tokens_per_batch_size`` from the bands, adjacent equal k merged."""
    merged: list[list[int]] = []
    for b in bands:
        if merged and merged[-1][2] == b["k"]:
            merged[-1][1] = b["hi"]
        else:
            merged.append([b["lo"], b["hi"], b["k"]])
    return {f"{a}-{z}": int(k) for a, z, k in merged}


def derive_policy(results: Results, slos: dict[str, Slo], base_strategy: str | None = None,
                  output_class: str | None = None, base_config: str | Path = DEFAULT_BASE_CONFIG,
                  seed: int = 0, n_boot: int = 200, predict: bool = True,
                  backend: str | None = None) -> dict:
    """The policy of one run (module docstring). ``slos``: {tier: Slo}. ``backend``
    ("embedded" / "vllm"): derive from the run's deployments on that engine only, with its
    autoregressive deployment as k = 0 (``baseline_for``); None: every deployment.

    Returns {"base_strategy", "name", "map" ({"a-b": k}, adjacent equal k merged),
    "num_speculative_tokens" (the largest k), "bands": [{"lo", "hi", "k", "strategy"
    (the fixed deployment whose measurements back the band), "levels", "tiers", "users",
    "batch", "batch_source", "boundary_source", "score", "goodput_tok_s", "tokens_per_s",
    "slo_attainment", "best_fixed"}], "bases": {base: {"score", "goodput_tok_s", "ks"}},
    "candidates": {deployment: {"base_strategy", "k", "k_source"}}, "best_fixed":
    {level: {output class: {"strategy", "goodput_tok_s", ...}}}, "levels": {...},
    "notes": [...]}. Raises PolicyError (module docstring)."""
    flagged, levels, cells, steps, entries, cand, bases, notes, baseline = _policy_inputs(
        results, slos, output_class, base_strategy, base_config, backend)
    best_fixed, stats = _best_fixed(flagged, cells, slos, seed, n_boot)
    batches = level_batches(steps, flagged, levels)
    groups = _group_bands(batches)
    per_base = _choose_per_base(bases, cand, groups, best_fixed, baseline)
    pick = base_strategy or max(bases, key=lambda b: (round(per_base[b]["score"], 9),
                                                      per_base[b]["goodput_tok_s"], b))
    entry = entries.get(pick)
    max_seqs = int(((entry or {}).get("engine") or {}).get("max_num_seqs", 32))
    top = max(max_seqs, int(math.ceil(max(b for b, _ in batches.values()))))
    models = _capacity_models(results, slos, steps, predict, notes)
    ocs = sorted(flagged[mn.REQ_OUTPUT_CLASS].unique())
    bands = _bands(groups, per_base[pick]["chosen"], batches, levels, models, ocs, best_fixed,
                   stats, top)
    if all(b["k"] == 0 for b in bands):
        notes.append(f"speculation pays at no measured level: the policy runs {pick} with k = 0 "
                     "everywhere (autoregressive decoding)")
    return {"base_strategy": pick, "name": pick + POLICY_SUFFIX, "map": _spec_map(bands),
            "num_speculative_tokens": max([b["k"] for b in bands] + [0]),
            "bands": bands, "levels": {lv: {"tier": t, "users": u, "batch": batches[lv][0],
                                            "batch_source": batches[lv][1]}
                                       for lv, (t, u) in levels.items()},
            "bases": {b: {k: v for k, v in p.items() if k != "chosen"} for b, p in per_base.items()},
            "base_choice": ("given (--base-strategy)" if base_strategy else
                            "the base whose policy has the highest goodput relative to the best "
                            "fixed deployment, summed over bands"),
            "candidates": cand, "best_fixed": best_fixed,
            "output_classes": ocs, "notes": notes}


# --- the Serve config -----------------------------------------------------------------------

def policy_entry(policy: dict, base_config: str | Path = DEFAULT_BASE_CONFIG) -> dict:
    """The strategy entry (a dict) deploying ``policy``: the base strategy's entry of the base
    config, named ``<base>-policy``, ``num_speculative_tokens`` = the map's largest k (so
    every k of the map is allowed) and ``num_speculative_tokens_per_batch_size`` = the map.
    Raises PolicyError when the base config has no entry for the base strategy; ValueError
    (naming the key) when the map does not validate."""
    entries = _backend_entries(_base_entries(base_config), policy.get("backend"))
    base = policy["base_strategy"]
    entry = entries.get(base) or next(
        (e for e in entries.values() if (e.get("engine") or {}).get("strategy") == base), None)
    if entry is None:
        raise PolicyError(f"{base_config} has no strategy entry for {base!r}"
                          + (f" on backend {policy['backend']}" if policy.get("backend") else ""))
    entry = copy.deepcopy(entry)
    entry["name"] = policy["name"]
    entry.pop("autoscaling_config", None)
    engine = entry.setdefault("engine", {})
    engine["num_speculative_tokens"] = max(int(policy["num_speculative_tokens"]), 1)
    engine[SPEC_SCHEDULE_KEY] = dict(policy["map"])
    parse_spec_schedule(engine[SPEC_SCHEDULE_KEY], engine["num_speculative_tokens"],
                        "engine.num_speculative_tokens")
    return entry


def _backend_entries(entries: dict, backend: str | None) -> dict:
    """``entries`` (name -> strategy entry) as seen for ``backend``: None = as they are;
    "vllm" = the base config's backend-vllm entries under the name of the strategy they
    run (``vllm-ngram`` answers for ``ngram``), so a policy measured on the embedded
    engine deploys on vLLM (vLLM's ``num_speculative_tokens_per_batch_size``, same k map);
    "embedded" = the embedded entries only."""
    if backend is None:
        return entries
    out = {}
    for name, e in entries.items():
        eng = e.get("engine") or {}
        if (eng.get("backend", "embedded") == "vllm") != (backend == "vllm"):
            continue
        out[name] = e
        if backend == "vllm" and name.startswith("vllm-"):
            out.setdefault(name[len("vllm-"):], e)
    return out


def emit_serve_config(policy: dict, base_config: str | Path = DEFAULT_BASE_CONFIG,
                      extra_entries: list[dict] | None = None) -> dict:
    """The base Serve config with one strategy deployment, the policy (``policy_entry``),
    plus ``extra_entries`` (the validation's fixed strategies). Validated with
    ``ServeAppConfig``; raises PolicyError / ValueError as ``policy_entry``."""
    cfg = copy.deepcopy(yaml.safe_load(Path(base_config).read_text()))
    app = next(a for a in cfg["applications"] if a.get("import_path") == APP_IMPORT_PATH)
    app["args"]["strategies"] = [policy_entry(policy, base_config)] + list(extra_entries or [])
    ServeAppConfig.model_validate(app["args"])
    cfg["applications"] = [app]
    return cfg


def write_serve_config(cfg: dict, path: str | Path, policy: dict) -> Path:
    """Write ``cfg`` as YAML with a header naming the policy and its bands."""
    lines = [f"# Serve config emitted by `python -m analysis policy`: {policy['name']} "
             f"({policy['base_strategy']}, k per running batch size, vLLM PR #32374).",
             f"# Deploy: `serve deploy {Path(path).name}` or `python -m cluster up --config "
             f"{Path(path).name}`.",
             f"# {SPEC_SCHEDULE_KEY}: {policy['map']}"]
    for b in policy["bands"]:
        lines.append(f"#   batch {b['lo']}-{b['hi']}: k={b['k']} (measured at tiers "
                     f"{','.join(b['tiers'])}, users {b['users']}, typical batch {b['batch']:g}; "
                     f"upper bound: {b['boundary_source'].split(':')[0]})")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n" + yaml.safe_dump(cfg, sort_keys=False))
    return path


def fixed_entry(name: str, candidates: dict, base_config: str | Path = DEFAULT_BASE_CONFIG,
                policy_backend: str | None = None) -> dict:
    """The strategy entry deploying one measured fixed deployment ``name`` again: its own
    entry of the base config, else (a ``<base>-k<N>`` variant) the base's entry named
    ``name`` at k = N; ``policy_backend`` as ``_backend_entries`` (vllm: the vLLM entry of
    that strategy, under the measured name, so the comparison is vLLM against vLLM).
    Raises PolicyError when neither exists."""
    entries = _backend_entries(_base_entries(base_config), policy_backend)
    if name in entries:
        e = copy.deepcopy(entries[name])
    else:
        c = candidates.get(name) or {}
        base = c.get("base_strategy")
        if base not in entries or c.get("k") is None:
            raise PolicyError(f"cannot deploy {name!r} again: not in {base_config}")
        e = copy.deepcopy(entries[base])
        e["engine"]["num_speculative_tokens"] = int(c["k"])
    e["name"] = name
    e.pop("autoscaling_config", None)
    return e


def policy_rows(policy: dict) -> list[dict]:
    """One display row per band (for the CLI table)."""
    rows = []
    for b in policy["bands"]:
        fixed = [f"{lv}/{oc}: {v['strategy']}" for lv, by in b["best_fixed"].items()
                 for oc, v in sorted(by.items(), key=lambda kv: cell_order((lv, kv[0])))]
        gps = [v.get("goodput_tok_s") for v in b["policy"].values() if v.get("goodput_tok_s") is not None]
        rows.append({"batch": f"{b['lo']}-{b['hi']}", "k": b["k"], "measured_as": b["strategy"],
                     "tiers": ",".join(b["tiers"]), "users": ",".join(map(str, b["users"])),
                     "typical_batch": b["batch"], "goodput_tok_s": sum(gps) if gps else None,
                     "best_fixed": "; ".join(fixed),
                     "upper_bound": b["boundary_source"].split(":")[0]})
    return rows


__all__ = ["PolicyError", "derive_policy", "emit_serve_config", "policy_entry", "fixed_entry",
           "write_serve_config", "policy_rows", "TIE"]
