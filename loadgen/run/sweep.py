"""Cell orders for a run: the tier grid (strategy-major, as always) or a
concurrency sweep that grows users geometrically until it finds the crossover.

Sweep (``python -m loadgen --sweep``): for users = start, start*factor, ... up
to max_users, run ``autoregressive`` at that level, then every strategy still
active. A strategy stops after the first level where its speedup vs
autoregressive (same level, output class and repeat) falls below 1
(``below_1``: the crossover is then bracketed by this level and the previous
one), where the service saturated (``saturated``: neither its tokens/s nor
autoregressive's grew by ``SATURATION_GAIN`` over the previous level, so the
speedup can no longer move; a strategy that saturates while autoregressive
still grows keeps going, since that is how the crossover is reached), or where
fewer than half its requests succeeded (``failing``). The sweep ends
when no strategy is active. Cells carry tier ``sweep`` and their users level;
every other setting (duration, max_tokens, SLOs) comes from the template tier, and
so does the sampling: the template cell's first sampling setting only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterator

from configs import metric_names as M

SWEEP_TIER = "sweep"
SATURATION_GAIN = 0.05      # < 5% more tokens/s than the previous level: saturated
MIN_OK_SHARE = 0.5


def sweep_levels(start: int, factor: float, max_users: int) -> list[int]:
    """Geometric users levels start, start*factor, ... <= max_users (distinct ints).

    Raises ValueError when start < 1, factor <= 1 or max_users < start."""
    if start < 1 or not factor > 1 or max_users < start:
        raise ValueError(f"sweep needs start >= 1, factor > 1, max_users >= start; got "
                         f"start={start}, factor={factor}, max_users={max_users}")
    out, u = [], float(start)
    while u <= max_users + 1e-9:
        n = int(round(u))
        if not out or n > out[-1]:
            out.append(n)
        u *= factor
    return out


@dataclass(frozen=True)
class CellSpec:
    """One cell to run: strategy, tier label, template tier, output class, users, repeat."""

    strategy: str
    tier: str
    template_tier: str
    output_class: str
    users: int | None       # None: the template cell's own users
    repeat: int = 0
    sampling: str = ""      # sampling label (configs.tiers.Sampling.name); "": the cell's first


@dataclass
class SweepState:
    """Per (strategy, output class): active or why it stopped, and the last tokens/s."""

    stopped: dict[tuple[str, str], str] = field(default_factory=dict)
    last_tps: dict[tuple[str, str], float] = field(default_factory=dict)
    tps: dict[tuple[str, str, int], list[float]] = field(default_factory=dict)
    ok_share: dict[tuple[str, str, int], list[float]] = field(default_factory=dict)
    prev_ar: dict[str, float] = field(default_factory=dict)   # output class -> AR tokens/s, previous level

    def record(self, strategy: str, output_class: str, users: int, tokens_per_s: float,
               ok_share: float) -> None:
        self.tps.setdefault((strategy, output_class, users), []).append(tokens_per_s)
        self.ok_share.setdefault((strategy, output_class, users), []).append(ok_share)

    def _mean(self, d: dict, key) -> float:
        vals = [v for v in d.get(key, []) if v is not None and not math.isnan(v)]
        return sum(vals) / len(vals) if vals else math.nan

    def decide(self, strategy: str, output_class: str, users: int) -> str | None:
        """After a level's cells: the stop reason for ``strategy`` (None: keep going)."""
        key = (strategy, output_class)
        tps = self._mean(self.tps, (strategy, output_class, users))
        ok = self._mean(self.ok_share, (strategy, output_class, users))
        reason = None
        if not ok >= MIN_OK_SHARE:
            reason = "failing"
        elif strategy != M.AUTOREGRESSIVE:
            ar = self._mean(self.tps, (M.AUTOREGRESSIVE, output_class, users))
            if ar > 0 and tps / ar < 1.0:
                reason = "below_1"
        if reason is None and self._flat(key, tps):
            ar_key = (M.AUTOREGRESSIVE, output_class)
            ar_flat = strategy == M.AUTOREGRESSIVE or self._flat(
                ar_key, self._mean(self.tps, (M.AUTOREGRESSIVE, output_class, users)))
            if ar_flat:
                reason = "saturated"
        self.last_tps[key] = tps
        if reason is not None:
            self.stopped[key] = reason
        return reason

    def _flat(self, key: tuple[str, str], tps: float) -> bool:
        """tokens/s at this level grew by < SATURATION_GAIN over the previous level's."""
        prev = self.last_tps.get(key) if key[0] != M.AUTOREGRESSIVE else self.prev_ar.get(key[1])
        return prev is not None and not tps > (1 + SATURATION_GAIN) * prev

    def next_level(self, output_class: str, users: int) -> None:
        """Remember autoregressive's tokens/s at ``users`` as the previous level's."""
        self.prev_ar[output_class] = self._mean(self.tps, (M.AUTOREGRESSIVE, output_class, users))

    def active(self, strategy: str, output_class: str) -> bool:
        return (strategy, output_class) not in self.stopped


def grid_cells(strategies: list[str], tiers: list[str], outputs: list[str],
               repeats: int = 1, samplings: dict[tuple[str, str], list[str]] | None = None
               ) -> Iterator[CellSpec]:
    """The tier grid: strategy-major, then tier, output class, sampling label, repeat
    (repeats back to back). ``samplings``: (tier, output class) -> its sampling labels
    (None or a missing key: one cell, the cell's first setting)."""
    for s in strategies:
        for t in tiers:
            for oc in outputs:
                for label in (samplings or {}).get((t, oc)) or [""]:
                    for k in range(repeats):
                        yield CellSpec(s, t, t, oc, None, k, label)


def sweep_cells(strategies: list[str], outputs: list[str], template_tier: str, levels: list[int],
                state: SweepState, repeats: int = 1) -> Iterator[CellSpec]:
    """The sweep's cells, lazily: it reads ``state`` (filled by the caller after each
    cell with ``record``) to drop strategies that crossed or saturated.
    ``autoregressive`` runs at a level while any other strategy is active there."""
    others = [s for s in strategies if s != M.AUTOREGRESSIVE]
    for oc in outputs:
        for users in levels:
            live = [s for s in others if state.active(s, oc)]
            if others and not live:
                break
            if not others and not state.active(M.AUTOREGRESSIVE, oc):
                break
            for s in [M.AUTOREGRESSIVE] + live:
                for k in range(repeats):
                    yield CellSpec(s, SWEEP_TIER, template_tier, oc, users, k)
            # autoregressive is the reference: it keeps running while others are live
            for s in live:
                state.decide(s, oc, users)
            if not others:
                state.decide(M.AUTOREGRESSIVE, oc, users)
            state.next_level(oc, users)
