"""Racing to a decision (``python -m loadgen --budget T``): after the first pass, spend the
rest of the budget where the answer is undecided.

Each round: decide every cell from the request rows so far (``analysis.decide.race``, the
function the report uses, on the rows the report will read; each evaluation is a look,
its time kept in the manifest so the report replays it), then repeat each undecided
cell's contending strategies (each at its next repeat index), the contenders of one cell
back to back, in the mirror of the previous pass's order (A B C, C B A, A B C: ABBA, so a
linear drift cancels in the means). The first pass runs the baseline twice per cell, at
both ends of the cell's group (A B C A: the run's own A/A, which measures the box's
cell-to-cell noise before any strategy runs twice). A strategy the leader beats at ``--confidence`` is dropped;
a cell stops once decided or equivalent. The round is not started when its estimated time
(each cell's measured seconds, scaled by how far the last round overran its estimate)
would end past the budget, counted from the run's start; at most ``MAX_ROUNDS`` rounds.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Iterator

from analysis.decide import race
from configs import metric_names as M
from analysis.decide.recommend import cell_order

MAX_ROUNDS = 50   # a bound on the loop whatever the budget


def aa_baseline(strategies: list[str]) -> str:
    """The strategy the run's A/A measures twice: autoregressive when it runs, else the first."""
    return M.AUTOREGRESSIVE if M.AUTOREGRESSIVE in strategies else strategies[0]


def first_pass(strategies: list[str], tiers: list[str], outputs: list[str], repeats: int = 1,
               samplings: dict[tuple[str, str], list[str]] | None = None,
               aa: bool = False) -> Iterator[Any]:
    """The first pass of a raced run, cell-major: per tier, output class, sampling label
    (``samplings``: (tier, output class) -> labels, as ``loadgen.run.sweep.grid_cells``) and
    repeat, every strategy back to back (a strategy-major pass runs each strategy's cells
    in one block, so a machine that speeds up or slows down between blocks favours whole
    strategies), odd repeats in the reverse order (ABBA). ``aa`` with one repeat: the
    baseline (``aa_baseline``) runs again, repeat 1, at the end of each cell's group: the
    run's A/A."""
    from loadgen.run.sweep import CellSpec

    for t in tiers:
        for oc in outputs:
            for label in (samplings or {}).get((t, oc)) or [""]:
                for k in range(repeats):
                    for s in (strategies if k % 2 == 0 else strategies[::-1]):
                        yield CellSpec(s, t, t, oc, None, k, label)
                if aa and repeats == 1 and len(strategies) > 1:
                    yield CellSpec(aa_baseline(strategies), t, t, oc, None, 1, label)


def aa_cells(strategies: list[str], repeats: int, aa: bool) -> int:
    """Extra cells per decision cell that the A/A adds to the first pass (0 or 1)."""
    return int(aa and repeats == 1 and len(strategies) > 1)


def cell_key(rows: list[dict], spec: Any) -> tuple:
    """The decision cell of a run cell (``metric_names.CellKey.decision``: tier, output class,
    sampling label; the ``race.DECISION_KEY`` columns) from its first row, else its spec."""
    return M.CellKey.of(rows[0] if rows else spec).decision()


def key_order(key: tuple) -> tuple:
    """Cells low -> high, short -> long, then the rest of the key."""
    head = cell_order((str(key[0]), str(key[1]) if len(key) > 1 else ""))
    return (*head, *(str(k) for k in key[2:]))


def label(key: tuple) -> str:
    """The manifest's name of a decision cell (``race.key_label``: greedy left out)."""
    return race.key_label(key)


def next_repeats(rows: list[dict]) -> dict[tuple, int]:
    """{(cell key, strategy): its next repeat index} from the request rows so far."""
    out: dict[tuple, int] = {}
    for r in rows:
        key = (M.CellKey.of(r).decision(), r.get(M.REQ_STRATEGY))
        out[key] = max(out.get(key, 0), int(r.get(M.REQ_REPEAT) or 0) + 1)
    return out


def round_plan(undecided: list[tuple], decisions: dict, cells: dict, nexts: dict[tuple, int],
               forward: bool) -> list[tuple[tuple, Any]]:
    """[(cell key, CellSpec)] of one round: cells in ``undecided`` order, each cell's
    contenders back to back in the first pass's order (``forward``) or its reverse, each at
    its next repeat index (``nexts``: ``next_repeats``)."""
    plan = []
    for key in undecided:
        live = set(decisions[key].contenders)
        names = [s for s in cells.get(key, {}) if s in live]
        for s in (names if forward else names[::-1]):
            plan.append((key, dataclasses.replace(cells[key][s], repeat=nexts.get((key, s), 0))))
    return plan


class Racer:
    """The racing loop's state: settings, the rounds run and why it stopped."""

    def __init__(self, budget_s: float, confidence: float, margin: float, first_pass_repeats: int,
                 started_ts: float, run_id: str, manifest_config: dict, warmup_s: float = 0.0,
                 max_rounds: int = MAX_ROUNDS, clock: Callable[[], float] = time.time) -> None:
        self.budget_s, self.confidence, self.margin = budget_s, confidence, margin
        self.first_pass_repeats, self.started_ts, self.run_id = first_pass_repeats, started_ts, run_id
        self.manifest_config, self.warmup_s = manifest_config, warmup_s
        self.max_rounds, self.clock = max_rounds, clock
        self.history: list[dict] = []
        self.looks: list[float] = []     # unix s of every evaluation (the report replays them)
        self.stopped = "running"
        self.decisions: dict[tuple, race.Decision] = {}
        self.noise: dict = {}

    def look(self, rows: list[dict]) -> dict[tuple, race.Decision]:
        """A new look: its time recorded, then ``decide``."""
        self.looks.append(self.clock())
        return self.decide(rows)

    def decide(self, rows: list[dict]) -> dict[tuple, race.Decision]:
        """``race.race_status`` over the rows so far, normalised and flagged as the report does,
        replaying the looks taken."""
        from analysis.data.load import requests_frame

        rows = [r for r in rows   # forced acceptance (--acceptance-length) never races
                if M.parse_acceptance_length(str(r.get(M.REQ_STRATEGY))) is None]
        if not rows:
            return {}
        flagged = race.flag_requests(requests_frame(rows, self.run_id), self.manifest_config,
                                     self.warmup_s)
        self.decisions = race.race_status(flagged, self.confidence, self.margin, self.looks or None)
        self.noise = race.pooled_noise(race.cell_replicates(flagged), sorted(self.looks) or None, None,
                                       aa_baseline(sorted(flagged[M.REQ_STRATEGY].unique()))).to_dict()
        return self.decisions

    def rounds(self, rows: list[dict], cells: dict, seconds: dict,
               say: Callable[[str], None]) -> Iterator[list[tuple[tuple, Any]]]:
        """Yield each round's plan; ``rows`` and ``seconds`` (``(key, strategy) -> [s]``)
        grow as the caller runs it. Sets ``stopped`` to the reason it ended."""
        overrun = 1.0
        for k in range(self.max_rounds):
            if self.history:   # how long the last round took against its estimate
                last = self.history[-1]
                last["ended_s"] = self.clock() - self.started_ts
                took = last["ended_s"] - last["started_s"]
                overrun = max(1.0, took / last["planned_s"]) if last["planned_s"] > 0 else 1.0
            decisions = self.look(rows)
            if k == 0:
                say(noise_line(self.noise))
            undecided = sorted((key for key, d in decisions.items()
                                if d.status == race.UNDECIDED and key in cells), key=key_order)
            if not undecided:
                self.stopped = "decided: every cell is decided or equivalent"
                say(f"race: every cell decided or equivalent after {k} round(s)")
                return
            forward = (self.first_pass_repeats + k) % 2 == 0
            plan = round_plan(undecided, decisions, cells, next_repeats(rows), forward)
            planned = overrun * sum(_mean(seconds.get((key, spec.strategy), [])) for key, spec in plan)
            elapsed = self.clock() - self.started_ts
            left = self.budget_s - elapsed
            if planned > left:
                self.stopped = (f"budget: round {k + 1} needs ~{planned:.0f} s, {max(left, 0):.0f} s of "
                                f"the {self.budget_s:.0f} s budget left")
                say(f"race: stopping, {len(undecided)} cell(s) undecided (budget spent: round {k + 1} "
                    f"needs ~{planned:.0f} s, {max(left, 0):.0f} s left)")
                return
            say(f"race round {k + 1} ({'forward' if forward else 'mirrored'}): {len(undecided)} undecided cell(s), "
                f"{len(plan)} cell runs, ~{planned:.0f} s of {left:.0f} s left: "
                + "; ".join(f"{label(key)} {' vs '.join(decisions[key].contenders)}" for key in undecided))
            self.history.append({"round": k + 1, "forward": forward, "planned_s": planned,
                                 "started_s": elapsed, "ended_s": None,
                                 "cells": [{"cell": label(key), "strategy": spec.strategy}
                                           for key, spec in plan]})
            yield plan
        self.stopped = f"max rounds: {self.max_rounds}"

    def final_lines(self, rows: list[dict]) -> list[str]:
        """Per cell, the decision on every row (``race.status_line``), after a header."""
        if self.history and self.history[-1]["ended_s"] is None:
            # the last round ran without a look after it (max rounds, or interrupted)
            self.history[-1]["ended_s"] = self.clock() - self.started_ts
            decisions = self.look(rows)
        else:
            decisions = self.decide(rows)
        lines = [f"race to a decision ({len(self.history)} round(s); {self.stopped}):"]
        budget = self.stopped.startswith("budget")
        for key in sorted(decisions, key=key_order):
            line = race.status_line(key, decisions[key])
            if decisions[key].status == race.UNDECIDED:
                line += " [budget spent]" if budget else f" [{self.stopped.split(':')[0]}]"
            lines.append("  " + line)
        return lines

    def manifest_entry(self) -> dict:
        """``manifest.json`` ``race``: settings, rounds, stop reason, decisions per cell."""
        return {"budget_s": self.budget_s, "confidence": self.confidence,
                "equivalence_margin": self.margin, "first_pass_repeats": self.first_pass_repeats,
                "warmup_s": self.warmup_s, "looks": list(self.looks), "noise": dict(self.noise),
                "rounds": self.history, "stopped": self.stopped,
                "decisions": {label(k): {"status": d.status, "leader": d.leader,
                                         "contenders": d.contenders, "equivalent": d.equivalent,
                                         "dropped": d.dropped, "confidence": d.confidence,
                                         "repeats": d.repeats, "looks": d.rounds,
                                         "noise": d.noise, "needs_repeats": d.needs_repeats,
                                         "reason": d.reason, "time_s": d.time_s}
                              for k, d in sorted(self.decisions.items(), key=lambda kv: key_order(kv[0]))}}


def noise_line(noise: dict) -> str:
    """The console line of the run's measured noise (``race.Noise.to_dict``)."""
    if not noise or noise.get("relative") is None:
        return ("noise: not measured yet (no strategy ran twice in a cell): no cell can be decided "
                "before the first racing round")
    aa = noise.get("aa") or {}
    aa_txt = (f"; A/A (the baseline twice per cell): "
              + ", ".join(f"{k} {100 * v:+.0f}%" for k, v in aa.items())) if aa else ""
    return (f"noise: one cell run's goodput varies +-{100 * noise['relative']:.1f}% between cells "
            f"(pooled over {noise['groups']} strategy-cells, df {noise['df']}){aa_txt}; "
            f"a cell is decided only when its gap stands clear of this")


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0
