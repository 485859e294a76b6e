"""Console progress of a load run: one plain line per finished cell, a live bar in a terminal."""

from __future__ import annotations

import sys
import time
from typing import Any

from loadgen.run.cells import CellPlan
from loadgen.results.summary import clock


class Progress:
    """What the user sees while the run goes.

    One plain line per finished cell (``cell i/N ...`` with elapsed time and an
    ETA), printed as it finishes, so a log file or CI shows progress as it
    happens. In a terminal, a live bar for the running cell only sits below those
    lines (it never scrolls out of a 24-row screen, and a finished cell never
    keeps a stale "in flight" count). Refreshed from the driver loop (no refresh
    thread under gevent).
    """

    def __init__(self, console: Any, total_cells: int, planned_cell_s: float, live: bool,
                 at_most: bool = False) -> None:
        self.console = console
        self.total = total_cells
        self.at_most = at_most      # --sweep: total is an upper bound (the sweep may stop early)
        self.planned_cell_s = planned_cell_s
        self.live = live
        self.t0 = time.time()
        self.finished = 0
        self.p = None
        if live:
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            self.p = Progress(TextColumn("{task.description}"), BarColumn(bar_width=20), TimeElapsedColumn(),
                              TextColumn("{task.fields[stats]}"), console=console, auto_refresh=False,
                              transient=True)
        self.task = None
        self.plan: CellPlan | None = None
        self._last = 0.0

    def __enter__(self) -> "Progress":
        if self.p is not None:
            self.p.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.p is not None:
            self.p.stop()

    def _total(self) -> str:
        return f"{self.total} max" if self.at_most else str(self.total)

    def _eta(self, now: float) -> float:
        per_cell = (now - self.t0) / self.finished if self.finished else self.planned_cell_s
        left_in_cell = max(0.0, self.plan.deadline_ts - now) if self.plan is not None else 0.0
        return left_in_cell + max(0, self.total - self.finished - 1) * per_cell

    def new_cell(self, label: str, plan: CellPlan) -> None:
        self.plan = plan
        if self.p is not None:
            self.task = self.p.add_task(f"cell {self.finished + 1}/{self._total()} {label}",
                                        total=plan.deadline_ts - plan.start_ts, stats="")

    def tick(self, now: float, runner: Any) -> None:
        if self.p is None or self.task is None or self.plan is None or now - self._last < 0.5:
            return
        self._last = now
        ok = runner.cell_ok
        self.p.update(self.task, completed=min(max(0.0, now - self.plan.start_ts),
                                               self.plan.deadline_ts - self.plan.start_ts),
                      stats=f"ok {ok} | failed {runner.cell_rows - ok} | in flight {runner.in_flight()}"
                            f" | ETA {clock(self._eta(now))}")
        self.p.refresh()

    def done(self, summary: Any) -> None:
        """The cell finished: drop its live bar, print its one line."""
        from loadgen.results.summary import cell_line, eta_seconds

        self.finished += 1
        if self.p is not None and self.task is not None:
            self.p.remove_task(self.task)
            self.task = None
        elapsed = time.time() - self.t0
        line = cell_line(self.finished, self.total, summary, elapsed,
                         eta_seconds(self.finished, self.total, elapsed, self.planned_cell_s),
                         at_most=self.at_most)
        self.console.print(line, highlight=False, markup=False, soft_wrap=True)
        if self.p is not None:
            self.p.refresh()
        sys.stdout.flush()
