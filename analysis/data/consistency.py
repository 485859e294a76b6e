"""Output consistency with plain decoding: the comparison arithmetic and the report's view.

Speculative decoding is lossless (Leviathan et al. 2023, arXiv 2211.17192, section 2.3;
Chen et al. 2023, arXiv 2302.01318, theorem 1): greedy output must be token-identical
to ``autoregressive``, sampled output must follow the target's distribution. The
load generator measures both in the run (``loadgen.cli.consistency``) and writes
``consistency.json``::

    {strategy: {"compared": n, "identical": m, "first_divergence": [
        {"prompt_id", "output_class", "position", "baseline", "strategy"}, ...],
     "mode": "token_ids" | "text", "errors": e, "baseline": "autoregressive",
     "sampled": {...} (opt-in, see ``first_token_test``)}}

``position`` is the first differing token index (character index in text mode)
and ``baseline`` / ``strategy`` the token ids (characters) found there; None
past the end of the shorter output.

Numerical ties: two tokens whose target logits differ by ~1e-6 can swap between a
one-token and a block forward, and in bf16 by far more; either is a correct greedy
choice. So each first divergence is classified (``classify_divergence``) from the
BASELINE's own top logprobs at that position (the prefix up to it is shared):
``tie`` when the strategy's token is within ``tolerance`` (logprob units, nats) of the
baseline's best, ``violation`` otherwise (or when the strategy's token is not among the
baseline's top-N and the N-th is already farther than the tolerance), ``unclassified``
when the baseline returned no logprobs. Entries then carry ``ties``, ``violations`` and
``tolerance``; a strategy diverges when it has a violation, or, for entries without
classification (text mode, an engine without logprobs), when ``identical < compared``;
or when its sampled check rejects equality (``diverges``).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path
from typing import Sequence

import pandas as pd

from configs import metric_names as mn

CONSISTENCY_FILE = "consistency.json"
DEFAULT_ALPHA = 0.01          # family-wise level of the sampled check (Bonferroni over positions)
MIN_EXPECTED = 5              # chi-square rule of thumb: categories expected below 5 are pooled
TOP_LOGPROBS = 5              # top logprobs the baseline returns at every position
# Tie tolerance in logprob (nats) by the compute dtype of the engine under test. fp32: a
# one-token vs a block forward moves logits by ~1e-6 (measured on the embedded target:
# 1.1e-6 at one held-out position); bf16 keeps 8 mantissa bits, so logits of magnitude
# 10-20 carry errors of ~0.05-0.1 after a few layers; fp16 has 11 bits.
TIE_TOLERANCE = {"float32": 1e-3, "float16": 0.05, "bfloat16": 0.25}
TIE, VIOLATION, UNCLASSIFIED = "tie", "violation", "unclassified"


def tie_tolerance(*dtypes: str | None) -> float:
    """The tolerance for comparing engines of these dtypes: the loosest one's (a dtype
    not in ``TIE_TOLERANCE`` counts as bfloat16, the loosest). Default float32."""
    known = [d for d in dtypes if d]
    return max((TIE_TOLERANCE.get(str(d).replace("torch.", ""), TIE_TOLERANCE["bfloat16"])
                for d in known), default=TIE_TOLERANCE["float32"])


def classify_divergence(top: dict[int, float] | None, baseline_token: int | None,
                        strategy_token: int | None, tolerance: float,
                        eos_token_id: int | None = None) -> tuple[str, float | None]:
    """``(kind, gap)`` of one first divergence from the baseline's top logprobs there.

    top: {token id: logprob} at that position, as the baseline returned it (its best
    first or not; the best is taken as the max). baseline_token / strategy_token: the
    ids each side emitted there; None for "ended here" (EOS; counted as ``eos_token_id``
    when given). gap = best logprob - the strategy token's logprob (nats; a lower bound
    best - min(top) when the token is not in ``top``). Returns ``(TIE | VIOLATION |
    UNCLASSIFIED, gap or None)``.
    """
    if not top:
        return UNCLASSIFIED, None
    best = max(top.values())
    tok = eos_token_id if strategy_token is None else strategy_token
    if tok is None:
        return UNCLASSIFIED, None
    if tok in top:
        gap = best - top[tok]
    else:   # beyond the top-N: at least as far as the N-th best
        gap = best - min(top.values())
        if gap <= tolerance:
            return UNCLASSIFIED, None   # N near-equal candidates and the token not among them
    return (TIE if gap <= tolerance else VIOLATION), float(gap)


def first_divergence(baseline: Sequence, other: Sequence) -> int | None:
    """Index of the first element where the two sequences differ (a length mismatch
    counts at the shorter length); None when they are equal."""
    for i, (a, b) in enumerate(zip(baseline, other)):
        if a != b:
            return i
    return None if len(baseline) == len(other) else min(len(baseline), len(other))


def compare_outputs(baseline: dict[str, Sequence], outputs: dict[str, Sequence],
                    output_class: str = "", baseline_top: dict[str, list] | None = None,
                    tolerance: float | None = None, eos_token_id: int | None = None) -> dict:
    """Compare a strategy's outputs with the baseline's, request by request.

    baseline / outputs: request key (prompt id) -> token ids or text; keys
    missing on either side (failed requests) are not compared. baseline_top: request
    key -> the baseline's top logprobs per output position ([{token id: logprob}]);
    with it (and ``tolerance``) each divergence is classified (``classify_divergence``)
    and ``ties`` / ``violations`` / ``unclassified`` are counted. Returns
    {"compared", "identical", "first_divergence": [...], ...} (see module doc).
    """
    compared = identical = 0
    diverged = []
    counts = {TIE: 0, VIOLATION: 0, UNCLASSIFIED: 0}
    for key, base in baseline.items():
        if key not in outputs or base is None or outputs[key] is None:
            continue
        got = outputs[key]
        compared += 1
        pos = first_divergence(base, got)
        if pos is None:
            identical += 1
            continue
        d = {"prompt_id": key, "output_class": output_class, "position": pos,
             "baseline": base[pos] if pos < len(base) else None,
             "strategy": got[pos] if pos < len(got) else None}
        if baseline_top is not None and tolerance is not None:
            tops = baseline_top.get(key) or []
            kind, gap = classify_divergence(tops[pos] if pos < len(tops) else None,
                                            d["baseline"], d["strategy"], tolerance, eos_token_id)
            d.update(kind=kind, gap=gap)
            counts[kind] += 1
        diverged.append(d)
    out = {"compared": compared, "identical": identical, "first_divergence": diverged}
    if baseline_top is not None and tolerance is not None:
        out.update(ties=counts[TIE], violations=counts[VIOLATION],
                   unclassified=counts[UNCLASSIFIED], tolerance=tolerance)
    return out


def merge_counts(parts: list[dict]) -> dict:
    """Sum ``compared`` / ``identical`` / ``errors`` and concatenate ``first_divergence``."""
    out = {"compared": 0, "identical": 0, "errors": 0, "first_divergence": []}
    for p in parts:
        for k in ("compared", "identical", "errors", *CLASS_COUNTS):
            if k in p:
                out[k] = out.get(k, 0) + p[k]
        out["first_divergence"] += p.get("first_divergence", [])
        if p.get("tolerance") is not None:
            out["tolerance"] = p["tolerance"]
    return out


CLASS_COUNTS = ("ties", "violations", "unclassified")


def first_token_test(baseline: Sequence, other: Sequence) -> dict:
    """Chi-square test of homogeneity between two samples of tokens (Pearson 1900).

    H0: both samples come from one distribution. Categories whose pooled
    count would give an expected count below ``MIN_EXPECTED`` in either
    sample are pooled into one "other" category. Also returns the total
    variation distance of the empirical distributions, TV = 1/2 sum |p - q|.
    Returns {"n_baseline", "n", "categories", "chi2", "dof", "p_value", "tv"};
    p_value 1.0 when fewer than two categories remain.
    """
    from scipy import stats

    cb, co = Counter(baseline), Counter(other)
    nb, no = sum(cb.values()), sum(co.values())
    if nb == 0 or no == 0:
        return {"n_baseline": nb, "n": no, "categories": 0, "chi2": math.nan, "dof": 0,
                "p_value": math.nan, "tv": math.nan}
    keys = sorted(set(cb) | set(co), key=str)
    tv = 0.5 * sum(abs(cb[k] / nb - co[k] / no) for k in keys)
    small = min(nb, no) / (nb + no)
    big = [k for k in keys if (cb[k] + co[k]) * small >= MIN_EXPECTED]
    rest_b = nb - sum(cb[k] for k in big)
    rest_o = no - sum(co[k] for k in big)
    table = [[cb[k] for k in big], [co[k] for k in big]]
    if rest_b + rest_o > 0:
        table[0].append(rest_b)
        table[1].append(rest_o)
    if len(table[0]) < 2:
        return {"n_baseline": nb, "n": no, "categories": len(table[0]), "chi2": 0.0, "dof": 0,
                "p_value": 1.0, "tv": tv}
    chi2, p, dof, _ = stats.chi2_contingency(table, correction=False)
    return {"n_baseline": nb, "n": no, "categories": len(table[0]), "chi2": float(chi2),
            "dof": int(dof), "p_value": float(p), "tv": float(tv)}


def sampled_verdict(tests: list[dict], alpha: float = DEFAULT_ALPHA) -> dict:
    """Bonferroni over positions: diverges when any p-value < alpha / positions."""
    ps = [t["p_value"] for t in tests if not math.isnan(t.get("p_value", math.nan))]
    min_p = min(ps) if ps else math.nan
    level = alpha / max(len(ps), 1)
    return {"min_p_value": min_p, "alpha": alpha, "level": level,
            "diverges": bool(ps) and min_p < level}


SYNTHETIC_SKIP = ("synthetic acceptance (rejection_sample_method: synthetic): the accept "
                  "decision is forced, so its text is not the target's and is not compared")


def diverges(entry: dict) -> bool:
    """True when a strategy's consistency entry shows a divergence (greedy or sampled); never
    for a synthetic-acceptance deployment (its text is not the target's by design)."""
    if entry.get("baseline_self") or entry.get("synthetic"):
        return False
    if "violations" in entry:   # classified: only violations (and unclassified) count
        if entry["violations"] or entry.get("unclassified", 0):
            return True
    elif entry.get("compared", 0) and entry.get("identical", 0) < entry["compared"]:
        return True
    return bool((entry.get("sampled") or {}).get("diverges"))


# --- the report's view ----------------------------------------------------------
def load_consistency(run_paths: list[Path]) -> dict[str, dict]:
    """Merge ``consistency.json`` of every run directory: {strategy: entry}; counts add up."""
    merged: dict[str, dict] = {}
    for path in run_paths:
        f = Path(path) / CONSISTENCY_FILE
        if not f.is_file():
            continue
        data = json.loads(f.read_text())
        for strategy, entry in data.items():
            if not isinstance(entry, dict):
                continue
            if mn.parse_acceptance_length(strategy) is not None:   # forced acceptance: never compared
                entry = {**entry, "synthetic": True, "skipped": entry.get("skipped") or SYNTHETIC_SKIP}
            cur = merged.setdefault(strategy, {"compared": 0, "identical": 0, "errors": 0,
                                               "first_divergence": []})
            for k in ("compared", "identical", "errors"):
                cur[k] += int(entry.get(k) or 0)
            for k in CLASS_COUNTS:
                if k in entry:
                    cur[k] = cur.get(k, 0) + int(entry.get(k) or 0)
            if entry.get("tolerance") is not None:
                cur["tolerance"] = max(cur.get("tolerance", 0.0), float(entry["tolerance"]))
            cur["first_divergence"] += list(entry.get("first_divergence") or [])
            for k in ("mode", "baseline", "baseline_self", "skipped", "synthetic"):
                if entry.get(k) is not None:
                    cur[k] = entry[k]
            if entry.get("sampled"):
                cur["sampled"] = entry["sampled"]
    return merged


def consistency_table(cons: dict[str, dict]) -> pd.DataFrame:
    """One row per strategy: compared, identical, share identical, earliest divergence,
    the sampled check's min p-value and TV, and ``diverges``."""
    rows = []
    for strategy, e in cons.items():
        s = e.get("sampled") or {}
        tvs = [t.get("tv") for t in s.get("positions", []) if t.get("tv") is not None]
        first = sorted(d["position"] for d in e.get("first_divergence", []))
        rows.append({"strategy": strategy, "baseline": e.get("baseline") or "autoregressive",
                     "mode": e.get("mode"),
                     "compared": e.get("compared", 0), "identical": e.get("identical", 0),
                     "identical_share": (e["identical"] / e["compared"]) if e.get("compared") else None,
                     "ties": e.get("ties"), "violations": e.get("violations"),
                     "tie_tolerance": e.get("tolerance"),
                     "errors": e.get("errors", 0),
                     "earliest_divergence": first[0] if first else None,
                     "sampled_n": s.get("n"), "sampled_min_p_value": s.get("min_p_value"),
                     "sampled_max_tv": max(tvs) if tvs else None,
                     "diverges": diverges(e), "note": e.get("skipped") or ""})
    return pd.DataFrame(rows, dtype=object)   # object: integer counts stay integers beside None


def diverging(cons: dict[str, dict]) -> list[str]:
    """Strategies whose output diverged from the baseline, sorted."""
    return sorted(s for s, e in cons.items() if diverges(e))


def annotate_recommendation(rec: dict, bad: list[str]) -> dict:
    """Mark every recommendation naming a diverging strategy (in place; returns ``rec``)."""
    for cells in rec.values():
        if not isinstance(cells, dict):
            continue
        for top in cells.values():
            for r in [top, *((top.get("by_sampling") or {}).values() if isinstance(top, dict) else [])]:
                if not (isinstance(r, dict) and r.get("strategy") in bad):
                    continue
                r["consistency_warning"] = ("output diverges from autoregressive: "
                                            "not lossless here, do not deploy on speed alone")
    return rec
