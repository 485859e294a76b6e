"""Which cells a lost or partial step log hits (issue 37: no silent data loss).

The load generator fetches each strategy's step rows after every cell
(``loadgen.cli.main._fetch_steps``). Rows go missing in two ways:

- a fetch fails (``step_log_errors`` in the manifest) and no later fetch of that
  strategy succeeds: the rows since that fetch's ``since`` are lost, so every cell of
  the strategy that ended after it is hit;
- rows are missing inside what was fetched: each replica numbers its steps (``seq``,
  one per engine step), so a jump in ``seq`` between two rows of one replica that both
  lie in a cell's fetched range is that many lost rows of that cell.

``step_log_losses`` returns one entry per hit cell, written to the manifest
(``step_log_loss``) and shown by the report (``analysis.decide.questions``).
"""

from __future__ import annotations

from collections import defaultdict

from configs import metric_names as M

SEQ = "seq"                  # a replica's step number (``AsyncLLMEngine._on_step``)
FETCH_SLACK_S = 1.0          # a cell's fetch starts this long before the cell


def _cell_key(c: dict) -> dict:
    return {k: c.get(k) for k in ("strategy", "tier", "output_class", "users", "repeat",
                                  "sampling")}


def step_log_losses(steps: list[dict], cells: list[dict], errors: list[dict]) -> list[dict]:
    """One entry per cell whose step rows are lost or partial: the cell's keys,
    ``rows`` (step rows held for it), ``missing_rows`` (replica step numbers skipped
    inside it; None when unknown) and ``reasons`` (text). ``cells``: the run's cell
    windows (strategy = served name, t0, t1, ...); ``errors``: the manifest's
    ``step_log_errors`` (strategy, since, error, recovered)."""
    by_strategy: dict[str, list[dict]] = defaultdict(list)
    for r in steps:
        name = r.get(M.STEP_MODEL, r.get(M.STEP_STRATEGY))
        if name is not None and r.get(M.STEP_TS) is not None:
            by_strategy[name].append(r)
    hits: dict[int, dict] = {}

    def hit(i: int, reason: str, missing: int | None = None) -> None:
        c = cells[i]
        e = hits.setdefault(i, {**_cell_key(c), "rows": _rows_in(c), "missing_rows": 0,
                                "reasons": []})
        if missing is None:
            e["missing_rows"] = None
        elif e["missing_rows"] is not None:
            e["missing_rows"] += missing
        if reason not in e["reasons"]:
            e["reasons"].append(reason)

    def _rows_in(c: dict) -> int:
        return sum(1 for r in by_strategy.get(c["strategy"], ())
                   if c["t0"] <= r[M.STEP_TS] <= c["t1"])

    for err in errors:
        if err.get("recovered"):
            continue
        for i, c in enumerate(cells):
            if c["strategy"] == err.get("strategy") and c["t1"] > float(err.get("since", 0.0)):
                hit(i, f"step_log fetch failed and was not retried: {err.get('error', '')[:200]}")
    for name, rows in by_strategy.items():
        per_replica: dict[str, list[dict]] = defaultdict(list)
        for r in rows:
            if isinstance(r.get(SEQ), int):
                per_replica[str(r.get(M.STEP_REPLICA))].append(r)
        for rs in per_replica.values():
            rs.sort(key=lambda r: r[SEQ])
            for a, b in zip(rs, rs[1:]):
                gap = b[SEQ] - a[SEQ] - 1
                if gap <= 0:
                    continue
                for i, c in enumerate(cells):
                    if c["strategy"] == name and c["t0"] - FETCH_SLACK_S <= a[M.STEP_TS] \
                            and b[M.STEP_TS] <= c["t1"] and b[M.STEP_TS] >= c["t0"]:
                        hit(i, "replica step numbers skipped (rows lost between engine and "
                            "client)", gap)
    return [hits[i] for i in sorted(hits)]
