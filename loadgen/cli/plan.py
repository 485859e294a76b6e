"""The run plan as a value: what ``python -m loadgen`` will do, decided before any load.

``build_plan(args, profile, discovery)`` is a pure function of the parsed arguments
(``loadgen.cli.args``), the tier file's profile (``configs.tiers.Profile``) and the target
discovery (``loadgen.cli.target.Discovery``: the strategies and routes found, passed in, never
fetched here).
It returns a frozen ``RunPlan``: the cells in their order, each strategy's route, the
per-cell time, the warm-up, the repeats and the racing settings. The run writes it to
``manifest.json`` (``plan``), ``--dry-run`` prints it (``plan_lines``), the runner
(``loadgen.cli.main``) executes its cells, and the racing loop (``loadgen.cli.race``)
extends it: each round's cells appended, a new value (``RunPlan.extend``).

A sweep (``--sweep``) stops early from its own results: its plan lists every cell it may
run (``at_most``), the run a prefix of each level's cells (``loadgen.run.sweep``).
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from configs import metric_names as M
from configs.tiers import OUTPUT_CLASSES, TIER_NAMES
from loadgen.cli.args import resolve_warmup, tier_list
from loadgen.cli.target import Discovery, route_name, route_url
from loadgen.run.sweep import SWEEP_TIER, CellSpec, grid_cells, sweep_levels

ORDER_STRATEGY_MAJOR = "strategy-major"   # each strategy's cells in one block (the default)
ORDER_CELL_MAJOR = "cell-major"           # per cell every strategy in turn (--interleave, racing, --aa)
ORDER_SWEEP = "sweep"                     # users levels, stopping at the crossover (--sweep)
ROUTE_UNRESOLVED = "unresolved"           # --dry-run without --target: chosen once the service is up


@dataclasses.dataclass(frozen=True)
class PlannedRoute:
    """The HTTP route one strategy's load takes: ``route`` (direct | strategy | model-field,
    or ``unresolved`` before the local service is up), its base URL, and on the direct
    route the Serve proxy's route it falls back to."""

    strategy: str
    route: str
    base_url: str
    fallback_url: str = ""


@dataclasses.dataclass(frozen=True)
class RacingPlan:
    """Racing to a decision (``--budget``): its settings, the first pass's cell count and
    the cells each round appended (``rounds``, grown by ``RunPlan.extend``)."""

    budget_s: float
    confidence: float
    equivalence_margin: float
    aa: bool
    first_pass_cells: int
    rounds: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """What a run does, in order. ``cells``: every cell run (``CellSpec``: strategy, tier,
    template tier, output class, users, repeat, sampling label), users and sampling label
    resolved; ``cell_s``: planned seconds per cell (mean offered duration + half the drain
    timeout, the ETA's estimate until cells have finished); ``warmup_s``: seconds cut at the
    start of every cell; ``warmup_requests``: unmeasured requests per strategy first;
    ``reset_prefix_cache``: the target's prefix cache is reset before every cell."""

    target: str
    strategies: tuple[str, ...]
    tiers: tuple[str, ...]
    outputs: tuple[str, ...]
    order: str
    cells: tuple[CellSpec, ...]
    routes: tuple[PlannedRoute, ...]
    repeats: int
    cell_s: float
    warmup_s: float
    warmup_requests: int
    reset_prefix_cache: bool = True
    sweep_levels: tuple[int, ...] = ()
    racing: RacingPlan | None = None

    @property
    def at_most(self) -> bool:
        """The cell count is an upper bound (a sweep stops early)."""
        return self.order == ORDER_SWEEP

    def planned_s(self) -> float:
        """Seconds the planned cells take at ``cell_s`` each."""
        return len(self.cells) * self.cell_s

    def route(self, strategy: str) -> PlannedRoute:
        """The planned route of ``strategy``; KeyError for a strategy not in the plan."""
        for r in self.routes:
            if r.strategy == strategy:
                return r
        raise KeyError(strategy)

    def extend(self, cells: list[CellSpec] | tuple[CellSpec, ...]) -> "RunPlan":
        """A new plan with ``cells`` appended (a racing round); the round is counted in
        ``racing.rounds``."""
        racing = (dataclasses.replace(self.racing, rounds=self.racing.rounds + (len(cells),))
                  if self.racing is not None else None)
        return dataclasses.replace(self, cells=self.cells + tuple(cells), racing=racing)

    def to_dict(self) -> dict[str, Any]:
        """The manifest's ``plan`` (JSON-safe): cells as dicts, routes by strategy."""
        d = dataclasses.asdict(self)
        d["routes"] = {r.strategy: {k: v for k, v in dataclasses.asdict(r).items() if k != "strategy"}
                       for r in self.routes}
        d["at_most"] = self.at_most
        return d


def planned_routes(discovery: Discovery) -> tuple[PlannedRoute, ...]:
    """One ``PlannedRoute`` per discovered strategy, in strategy order."""
    if not discovery.resolved:
        return tuple(PlannedRoute(s, ROUTE_UNRESOLVED, discovery.target) for s in discovery.strategies)
    prefixes, fallbacks = dict(discovery.prefixes), dict(discovery.fallbacks)
    return tuple(PlannedRoute(s, route_name(prefixes.get(s)), route_url(discovery.target, prefixes.get(s)),
                              route_url(discovery.target, fallbacks[s]) if s in fallbacks else "")
                 for s in discovery.strategies)


def samplings(args: argparse.Namespace, profile: Any) -> dict[tuple[str, str], list]:
    """(tier, output class) -> its sampling settings (``configs.tiers.Sampling``), each its own
    cell: ``--temperature T,...`` (the profile's sampling with each temperature) for every
    cell, else the tier file's (``Profile.samplings_for``)."""
    if args.temperature:
        base = profile.sampling
        lst = [base.model_copy(update={"temperature": float(t), "label": None}) for t in args.temperature]
        return {(t, oc): lst for t in TIER_NAMES for oc in OUTPUT_CLASSES}
    return {(t, oc): profile.samplings_for(t, oc) for t in TIER_NAMES for oc in OUTPUT_CLASSES}


def outputs_of(args: argparse.Namespace) -> list[str]:
    """``--output``: the output classes run."""
    return list(OUTPUT_CLASSES) if args.output == "all" else [args.output]


def _labels(args: argparse.Namespace, profile: Any) -> dict[tuple[str, str], list[str]]:
    """(tier, output class) -> sampling labels run; a sweep runs the first only."""
    return {k: [x.name for x in v][:1 if args.sweep else None] for k, v in samplings(args, profile).items()}


def _sweep_cells(strategies: tuple[str, ...], outputs: list[str], template: str, levels: list[int],
                 repeats: int, labels: dict) -> list[CellSpec]:
    """Every cell a sweep may run (``loadgen.run.sweep.sweep_cells`` with no strategy
    stopping): per output class and users level, autoregressive then the others."""
    order = [M.AUTOREGRESSIVE] + [s for s in strategies if s != M.AUTOREGRESSIVE]
    return [CellSpec(s, SWEEP_TIER, template, oc, users, k, (labels.get((template, oc)) or [""])[0])
            for oc in outputs for users in levels for s in order for k in range(repeats)]


def _grid_order(args: argparse.Namespace, strategies: list[str], tiers: list[str], outputs: list[str],
                labels: dict, profile: Any) -> tuple[str, list[CellSpec]]:
    """The tier grid's cells (users resolved): strategy-major, or cell-major for racing's
    first pass, ``--interleave`` and ``--aa`` (``loadgen.cli.race.first_pass``)."""
    from loadgen.cli.race import first_pass

    if args.budget_s > 0 or args.interleave or args.aa:
        order, cells = ORDER_CELL_MAJOR, list(first_pass(strategies, tiers, outputs, args.repeats,
                                                         labels, aa=args.aa))
    else:
        order, cells = ORDER_STRATEGY_MAJOR, list(grid_cells(strategies, tiers, outputs, args.repeats, labels))
    return order, [dataclasses.replace(c, users=profile.cell(c.tier, c.output_class).users) for c in cells]


def build_plan(args: argparse.Namespace, profile: Any, discovery: Discovery) -> RunPlan:
    """The run plan: a pure function of the parsed arguments, the tier profile and the
    discovery (no I/O, ``args`` not changed; equal inputs give equal plans)."""
    tiers, outputs = tier_list(args.tier), outputs_of(args)
    labels, strategies = _labels(args, profile), list(discovery.strategies)
    if args.sweep:
        levels = sweep_levels(args.sweep_start, args.sweep_factor, args.sweep_max_users)
        order, cells = ORDER_SWEEP, _sweep_cells(discovery.strategies, outputs, tiers[0], levels,
                                                 args.repeats, labels)
        durations = [args.duration or profile.cell(tiers[0], oc).duration_s for oc in outputs]
    else:
        levels = []
        order, cells = _grid_order(args, strategies, tiers, outputs, labels, profile)
        durations = [args.duration or profile.cell(t, oc).duration_s for t in tiers for oc in outputs]
    racing = (RacingPlan(float(args.budget_s), float(args.confidence), float(args.equivalence_margin),
                         bool(args.aa), len(cells)) if args.budget_s > 0 and not args.sweep else None)
    return RunPlan(
        target=discovery.target, strategies=tuple(strategies), tiers=tuple(tiers), outputs=tuple(outputs),
        order=order, cells=tuple(cells), routes=planned_routes(discovery), repeats=int(args.repeats),
        cell_s=sum(durations) / len(durations) + 0.5 * profile.drain_timeout_s,
        warmup_s=resolve_warmup(args, profile, tiers, outputs),
        warmup_requests=int(args.warmup_requests),
        reset_prefix_cache=bool(getattr(args, "reset_prefix_cache", True)), sweep_levels=tuple(levels), racing=racing)


def plan_lines(plan: dict[str, Any]) -> list[str]:
    """``--dry-run``'s text of a plan (``RunPlan.to_dict``, so the manifest's ``plan``
    prints the same): a header, the routes, then one line per cell."""
    from loadgen.results.summary import clock

    cells, racing = plan["cells"], plan.get("racing")
    n = len(cells)
    head = (f"plan: {len(plan['strategies'])} strategies, {n} cells{' at most' if plan['at_most'] else ''} "
            f"({plan['order']}), {plan['cell_s']:.0f} s per cell, ETA {clock(n * plan['cell_s'])}; "
            f"warm-up: {plan['warmup_requests']} requests per strategy, first {plan['warmup_s']:g} s "
            "of each cell cut" + ("; prefix cache reset before each cell"
                                  if plan.get("reset_prefix_cache", True) else ""))
    lines = [head]
    if racing:
        lines.append(f"racing: within {clock(racing['budget_s'])} (first pass included), confidence "
                     f"{racing['confidence']:g}, equivalence margin {racing['equivalence_margin']:g}, "
                     f"A/A {'on' if racing['aa'] else 'off'}; rounds so far: {list(racing['rounds'])}")
    if plan.get("sweep_levels"):
        lines.append(f"sweep users levels: {list(plan['sweep_levels'])}")
    lines.append(f"target: {plan['target']}")
    if all(r["route"] == ROUTE_UNRESOLVED for r in plan["routes"].values()):
        lines.append("  routes: chosen once the local service is up (--route)")
    else:
        for s, r in plan["routes"].items():
            lines.append(f"  route {s}: {r['route']} {r['base_url']}"
                         + (f" (falls back to {r['fallback_url']})" if r.get("fallback_url") else ""))
    width = len(str(n))
    for i, c in enumerate(cells, 1):
        key = M.CellKey.of(c)
        lines.append(f"  {i:>{width}}. {key.label()} r{c['repeat']}")
    return lines
