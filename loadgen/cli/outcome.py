"""What ``python -m loadgen`` prints after the run: one compact table per strategy x cell
(repeats pooled, with their count: the report's own numbers), then the answer (the
recommendation per cell, or with ``--report`` the report's headline), failures and paths."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from loadgen.results.summary import SUMMARY_CSV, clock

EXIT_INTERRUPTED = 130
EXIT_NO_SUCCESS = 1  # every cell failed (all requests errored)


def print_outcome(console: Any, run_dir: Path, summaries: list, totals: dict[str, Any],
                  report: bool, interrupted: bool) -> int:
    """The cell table and the answer, the totals (``totals``: requests, steps, wall_s),
    cells without a successful request, the report (``report``: ``--report``) and the
    results path. Returns the exit code: 130 interrupted, 1 when every cell failed, else 0."""
    from loadgen.results.summary import legend, render_table

    empty = [f"{s.strategy}/{s.tier}/{s.output_class}" for s in summaries if not s.n_ok]
    prepared = _print_cells(console, run_dir) if summaries else None
    if summaries and prepared is None:   # per cell run when the cell table cannot be built
        table, shown = render_table(summaries, max_width=console.width)
        console.print(table)
        console.print(f"Columns: {legend(shown)} Every column, p99s included: {run_dir / SUMMARY_CSV}",
                      highlight=False)
    console.print(f"requests: {totals['requests']}, steps: {totals['steps']}, "
                  f"wall time {clock(totals['wall_s'])}", highlight=False)
    if empty:
        console.print(f"[red]no successful request[/] in {', '.join(empty)}; see the `error` "
                      f"column of {run_dir / 'requests.parquet'}", highlight=False)
    answer = totals["requests"] and len(empty) < len(summaries)
    if report and answer:
        print_report(run_dir, console)
    elif answer and prepared is not None:
        _print_answer(console, prepared)
    print(f"results: {run_dir}", flush=True)
    if interrupted:
        return EXIT_INTERRUPTED
    return EXIT_NO_SUCCESS if summaries and len(empty) == len(summaries) else 0


def _print_cells(console: Any, run_dir: Path) -> tuple | None:
    """The run's cell table (repeats pooled with their count, warm-up cut: the report's own
    numbers, ``analysis.report.build.prepare``). Returns prepare's tuple, or None when the
    table cannot be built (no request written)."""
    from analysis.data.load import ResultsError, load_results
    from analysis.report.build import prepare
    from loadgen.results.summary import cell_legend, render_cell_table

    try:
        prepared = prepare(load_results(run_dir))
    except (ResultsError, ValueError, KeyError) as err:
        console.print(f"[yellow]note[/] no cell table: {err}", highlight=False)
        return None
    table, shown = render_cell_table(prepared[-1], max_width=console.width)
    console.print(table)
    console.print(f"Columns: {cell_legend(shown)} Per cell run, p99s included: "
                  f"{run_dir / SUMMARY_CSV}", highlight=False, soft_wrap=True)
    return prepared


def _print_answer(console: Any, prepared: tuple) -> None:
    """The answer after the table, without ``--report``: the report's recommendation per
    cell (``analysis.decide.recommend``, a raced run's looks replayed), one line each."""
    from analysis.decide.recommend import headline_lines, recommend_by_sampling
    from analysis.report.build import race_settings

    results, _, _, slos, flagged, _, cells = prepared
    settings = race_settings(results)
    try:
        rec = recommend_by_sampling(flagged, cells, slos, confidence=settings["confidence"],
                                    margin=settings["equivalence_margin"], looks=settings["looks"])
    except (ValueError, KeyError) as err:   # never lose the run's other output over the answer
        console.print(f"[yellow]note[/] no answer: {err!r}", highlight=False)
        return
    console.print("answer per cell (highest goodput under the SLOs; --report writes the full report):",
                  highlight=False)
    for line in headline_lines(rec, settings.get("undecided_reason")):
        console.print(f"  {line}", highlight=False, markup=False, soft_wrap=True)


def print_report(run_dir: Path, console: Any) -> None:
    """Write the analysis report into the run's report folder; print the headline and its paths."""
    from analysis.decide.claims import claim_lines
    from analysis.decide.recommend import headline_lines
    from analysis.report.build import build_report, default_out_dir

    out = build_report(run_dir, default_out_dir(run_dir))
    console.print("recommendation per tier (highest goodput under the SLOs), "
                  f"{out.get('scope') or 'on this deployment only'}:", highlight=False, soft_wrap=True)
    for line in headline_lines(out["recommendation"], (out.get("race") or {}).get("undecided_reason")):
        console.print(f"  {line}", highlight=False, markup=False, soft_wrap=True)   # one line each
    for line in claim_lines(out.get("claims") or []):
        console.print(f"  {line}", highlight=False, markup=False, soft_wrap=True)
    for name, path in out["paths"].items():
        console.print(f"{name}: {path}", highlight=False)
