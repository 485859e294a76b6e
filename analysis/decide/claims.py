"""Claims check: did the source evaluations' conditional claim hold on this deployment?

The claim (docs/design.md "Strategies"; the DFlash 2 and DSpark evaluations): the
parallel drafter with path selection (``dflash2``) wins at low concurrency with long
outputs, and the confidence-scheduled hybrid (``dspark``) wins at high concurrency.

Per claim and per matching cell of the recommendation (``analysis.decide.recommend``,
whose status comes from ``analysis.decide.race``), the verdict is

- ``held``: the cell is decided and the claimed strategy won;
- ``did not hold``: another strategy won (decided), the cell is equivalent (no single
  winner; the claimed strategy is in the equivalent set or not), or the claimed strategy was
  dropped (the leader beat it at the run's confidence) while the cell stayed undecided;
- ``undecided``: the claimed strategy still contends in an undecided cell;
- ``not measured``: the cell or the claimed strategy is absent from the run.

A claim's overall verdict: ``not measured`` when every cell is, ``held`` when every
measured cell held, ``did not hold`` when any did, else ``undecided``.
"""

from __future__ import annotations

from configs import metric_names as mn

HELD, NOT_HELD, UNDECIDED, NOT_MEASURED = "held", "did not hold", "undecided", "not measured"
CLAIMS = (
    {"id": "dflash2-low-long", "strategy": mn.DFLASH2, "tier": "low", "output_class": "long",
     "claim": "the parallel drafter with path selection (dflash2) wins at low concurrency "
              "with long outputs"},
    {"id": "dspark-high", "strategy": mn.DSPARK, "tier": "high", "output_class": None,
     "claim": "the confidence-scheduled hybrid (dspark) wins at high concurrency"},
)


def _pct(frac) -> str:
    return "-" if frac is None else f"{100 * frac:+.1f}%"


def _vs_leader(claimed: str, r: dict) -> float | None:
    """The claimed strategy's goodput relative to the leader's, over the repeats both ran
    (``paired``), else over each one's own; 0 for the leader itself."""
    gp, leader = r.get("goodput_by_strategy") or {}, r.get("leader")
    if claimed == leader:
        return 0.0
    p = (r.get("paired") or {}).get(claimed)
    if p and p.get("leader_goodput"):
        return (p["goodput"] - p["leader_goodput"]) / p["leader_goodput"]
    return (gp[claimed] - gp[leader]) / gp[leader] if leader and gp.get(leader) and claimed in gp else None


def _cell_verdict(claimed: str, r: dict) -> tuple[str, str]:
    """(verdict, what the run shows) for one cell's recommendation ``r``."""
    gp = r.get("goodput_by_strategy") or {}
    if claimed not in gp:
        return NOT_MEASURED, f"{claimed} not in this run"
    leader, status = r.get("leader"), r.get("status")
    conf = r.get("confidence")
    conf_s = "-" if conf is None else f"{100 * conf:.0f}%"
    rel = _vs_leader(claimed, r)
    reps = r.get("repeats")
    effort = f", {reps} repeat{'s' if reps != 1 else ''}" if reps is not None else ""
    if status == "decided" or (status is None and r.get("strategy") not in (None, "tie")):
        if leader == claimed:
            return HELD, (f"{claimed} won: {_pct(r.get('margin'))} goodput over {r.get('runner_up')} "
                          f"(confidence {conf_s}{effort})")
        return NOT_HELD, (f"{leader} won instead: {_pct(r.get('margin'))} over {r.get('runner_up')}; "
                          f"{claimed} {_pct(rel)} vs {leader} (confidence {conf_s}{effort})")
    if status == "equivalent":
        inside = claimed in (r.get("equivalent") or [])
        return NOT_HELD, (f"no single winner: {', '.join(r.get('equivalent') or [])} equivalent "
                          f"(confidence {conf_s}{effort}); {claimed} "
                          + ("among them" if inside else f"{_pct(rel)} vs {leader}, dropped"))
    if claimed in (r.get("dropped") or {}) or claimed not in (r.get("tied") or [claimed]):
        return NOT_HELD, (f"{claimed} dropped: {_pct(rel)} vs the leader {leader}; the cell stayed "
                          f"undecided between {', '.join(r.get('tied') or [])}{effort}")
    return UNDECIDED, (f"undecided between {', '.join(r.get('tied') or [])}: {leader} leads by "
                       f"{_pct(r.get('margin'))}, {claimed} {_pct(rel)} (confidence {conf_s}{effort})")


def claims_check(rec: dict) -> list[dict]:
    """One row per claim and matching cell: {"claim_id", "claim", "tier", "output_class",
    "verdict", "shows", "winner", "margin", "claimed_vs_winner" (relative goodput, fraction),
    "status", "confidence"}, then one summary row per claim (``output_class`` "all", its
    overall verdict). ``rec`` is ``{tier: {output_class: recommendation}}``."""
    rows = []
    for c in CLAIMS:
        cells = [(oc, r) for oc, r in (rec.get(c["tier"]) or {}).items()
                 if c["output_class"] in (None, oc)]
        cell_rows = []
        for oc, r in cells:
            verdict, shows = _cell_verdict(c["strategy"], r)
            gp = r.get("goodput_by_strategy") or {}
            leader = r.get("leader")
            cell_rows.append({
                "claim_id": c["id"], "claim": c["claim"], "tier": c["tier"], "output_class": oc,
                "verdict": verdict, "shows": shows, "winner": leader if r.get("status") == "decided" else None,
                "leader": leader, "margin": r.get("margin"),
                "claimed_vs_winner": _vs_leader(c["strategy"], r) if c["strategy"] in gp else None,
                "status": r.get("status"), "confidence": r.get("confidence")})
        verdicts = [x["verdict"] for x in cell_rows if x["verdict"] != NOT_MEASURED]
        overall = (NOT_MEASURED if not verdicts else HELD if all(v == HELD for v in verdicts)
                   else NOT_HELD if NOT_HELD in verdicts else UNDECIDED)
        where = f"{c['tier']}" + (f" / {c['output_class']}" if c["output_class"] else "")
        if not cell_rows:
            cell_rows.append({"claim_id": c["id"], "claim": c["claim"], "tier": c["tier"],
                              "output_class": c["output_class"] or "all", "verdict": NOT_MEASURED,
                              "shows": f"the run has no {where} cell"})
        rows += cell_rows
        if len(cell_rows) > 1:
            rows.append({"claim_id": c["id"], "claim": c["claim"], "tier": c["tier"],
                         "output_class": "all", "verdict": overall,
                         "shows": "; ".join(f"{x['output_class']}: {x['verdict']}" for x in cell_rows)})
    return rows


def claim_lines(rows: list[dict]) -> list[str]:
    """One sentence per claim: its overall verdict and what the run shows."""
    out = []
    for c in CLAIMS:
        mine = [r for r in rows if r["claim_id"] == c["id"]]
        if not mine:
            continue
        summary = next((r for r in mine if r["output_class"] == "all" and len(mine) > 1), None)
        cells = [r for r in mine if r is not summary]
        verdict = summary["verdict"] if summary else cells[0]["verdict"]
        detail = "; ".join(f"{r['tier']}/{r['output_class']}: {r['shows']}" for r in cells)
        out.append(f"claim \"{c['claim']}\": {verdict.upper()} on this deployment ({detail})")
    return out
