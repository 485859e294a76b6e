"""``python -m loadgen``: run tier traffic against every strategy and write a run directory.

The run's phases, in order: read the inputs (tier file, profile, prompts, variants: a bad
value names its flag, exit 2); discover the target (``_discover``: the local service started
or reused without ``--target``, its strategies and routes); build the plan
(``loadgen.cli.plan.build_plan``, a frozen value; ``--dry-run`` prints it and stops); open
the run directory (the plan in ``manifest.json``); drive the plan's cells (warm-up, each cell
offered and summarised, the racing rounds appended to the plan); check consistency; close
(``steps.parquet``, the final manifest); print the cell table and the answer
(``loadgen.cli.outcome``). Output: ``RESULTS_DIR/<run_id>/`` with ``requests.parquet``,
``steps.parquet`` (specload targets), ``summary.csv`` and ``manifest.json``.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from configs import metric_names as M
from configs.results_schema import SCHEMA_VERSION as RESULTS_SCHEMA_VERSION
from configs.tiers import TierConfigError, load_tiers
from loadgen.run import service
from loadgen.cli.args import (FlagError as _FlagError, check_local_strategy_names, manifest_args,
                              parse_args, resolve_warmup, tier_list)
from loadgen.cli.plan import RunPlan, build_plan, outputs_of, plan_lines
from loadgen.cli.plan import samplings as _samplings
from loadgen.cli.variants import resolve_variants as _variants
from loadgen.run.cells import CellPlan, shuffled_prompts
from configs.jsonio import STDIN
from loadgen.run.datasets import PROMPTS_FILE, DatasetError, load_dataset, write_prompts
from loadgen.run.server_metrics import ServerMetricsError
from loadgen.results.progress import Progress
from loadgen.results.summary import SUMMARY_CSV, clock, eta_seconds
from loadgen.cli.outcome import EXIT_INTERRUPTED, print_outcome
from loadgen.run.sweep import SWEEP_TIER, SweepState, sweep_cells

from loadgen.cli.target import (
    ROUTE_AUTO,
    Auth,
    choose_routes,
    discover,
    local_discovery,
    reachable,
    route_name,
    route_names,
    route_url,
    target_hint,
)

EXIT_CONFIG = 2
# one version for the run directory (manifest, request rows, step rows): configs/results_schema.py
MANIFEST_SCHEMA_VERSION = RESULTS_SCHEMA_VERSION


def _label_steps(rows: list[dict], run_id: str, cells: list[dict]) -> list[dict]:
    """Add run_id, tier, output_class, users, repeat and sampling label (by step time inside
    a cell window) to step rows."""
    for r in rows:
        r[M.REQ_RUN_ID] = run_id
        ts = r.get(M.STEP_TS)
        for c in cells:
            # a cell's "strategy" is the served model name; so is a step row's STEP_MODEL
            # (STEP_STRATEGY is the engine's id; servers older than STEP_MODEL sent only that)
            if c["strategy"] == r.get(M.STEP_MODEL, r.get(M.STEP_STRATEGY)) and ts is not None \
                    and c["t0"] <= ts <= c["t1"]:
                r[M.REQ_TIER], r[M.REQ_OUTPUT_CLASS] = c["tier"], c["output_class"]
                r[M.REQ_USERS], r[M.REQ_REPEAT] = c.get("users"), c.get("repeat", 0)
                r[M.REQ_SAMPLING] = c.get("sampling", M.GREEDY)
                break
    return rows


def _flag_error(message: str) -> None:
    """A flag's error before anything ran, as argparse writes its own: one line on stderr,
    ``python -m loadgen: error: <flag>: <what>`` (the caller exits 2)."""
    print(f"python -m loadgen: error: {message}", file=sys.stderr, flush=True)


@dataclasses.dataclass(frozen=True)
class _Inputs:
    """What a run reads before it reaches the target: the tier profile
    (``configs.tiers.Profile``), the prompts (shuffled once), the deployments of ``--k`` /
    ``--top-k-candidates`` / ``--acceptance-length`` (``_variants``) and each tier x output
    class's sampling settings (``loadgen.cli.plan.samplings``)."""

    profile: Any
    prompts: list
    variants: dict[str, dict]
    samplings: dict[tuple[str, str], list]


def _read_inputs(args: argparse.Namespace) -> _Inputs:
    """Tier file, profile, dataset, Serve config, warm-up cut (``args.warmup_s`` resolved) and
    variants, in that order. Raises _FlagError naming the flag of the first bad one (a
    KeyError's text is its repr: its message is taken)."""
    try:
        tiers = load_tiers(args.tiers_file or None)
    except TierConfigError as err:
        raise _FlagError("--tiers-file", str(err)) from None
    try:
        profile = tiers.profile(args.profile or None)
    except KeyError as err:
        raise _FlagError("--profile", str(err.args[0] if err.args else err)) from None
    max_chars = args.max_prompt_chars or profile.max_prompt_chars
    try:
        prompts = shuffled_prompts(load_dataset(args.dataset, max_chars), profile.seed)
    except DatasetError as err:
        raise _FlagError("--dataset", str(err)) from None
    if not args.target and args.local_config:   # a bad Serve config: before anything starts
        try:
            service.check_serve_config(args.local_config)
        except ValueError as err:
            raise _FlagError("--local-config", str(err)) from None
    args.warmup_s = resolve_warmup(args, profile, tier_list(args.tier or "high"), outputs_of(args))
    variants = _variants(args)   # --k / --top-k-candidates: one deployment per variant
    return _Inputs(profile, prompts, variants, _samplings(args, profile))


def run(args: argparse.Namespace) -> int:
    """The whole run; returns the exit code. Locust is imported here (gevent already patched).

    ``--dry-run`` prints the plan and stops. Whenever the local service was started or
    reused (no ``--target``), every exit path, errors included, ends with the hint that stops it.
    """
    from rich.console import Console

    tty = sys.stdout.isatty()
    console = Console(width=None if tty else int(os.environ.get("COLUMNS") or 100))
    err = check_local_strategy_names(args)
    if err:
        _flag_error(err)
        return EXIT_CONFIG
    try:
        inputs = _read_inputs(args)
    except _FlagError as err:
        _flag_error(f"{err.flag}: {err.message}")
        return EXIT_CONFIG
    if args.dry_run:
        return _dry_run(args, console, inputs)
    local: dict[str, Any] = {"url": None}
    try:
        return _run(args, console, tty, inputs, local)
    finally:
        if not args.target:
            _say_local_service(args, console, local)


def _say_local_service(args: argparse.Namespace, console: Any, local: dict[str, Any]) -> None:
    """The hint that stops the local service (started or reused: ``local["url"]``)."""
    down = "python -m cluster down" + (f" --port {args.local_port}" if args.local_port != 8000 else "")
    if local["url"]:
        console.print(f"the local service is still up at {local['url']} (reused by the next run); "
                      f"stop it with `{down}`", highlight=False)
    else:
        console.print("if `python -m cluster up` left anything running, stop it with "
                      f"`{down}`", highlight=False)
    sys.stdout.flush()


def _dry_run(args: argparse.Namespace, console: Any, inputs: _Inputs) -> int:
    """``--dry-run``: the plan (``loadgen.cli.plan.plan_lines``) and nothing else: no load, no
    run directory. With ``--target`` the target is asked for its strategies and routes;
    without, no service is started: the strategies are the local Serve config's and the
    routes are chosen at run time."""
    try:
        discovery = discover(args, console, {"url": None})[0] if args.target else local_discovery(args)
    except service.ServiceError as err:
        console.print(f"[red]target error:[/] {err}", highlight=False, soft_wrap=True)
        return EXIT_CONFIG
    plan = build_plan(args, inputs.profile, discovery)
    for line in plan_lines(plan.to_dict()):
        console.print(line, highlight=False, markup=False, soft_wrap=True)
    console.print("dry run: no request sent, nothing written", highlight=False)
    return 0


@dataclasses.dataclass
class _RunState:
    """A run as it goes: its plan (``loadgen.cli.plan.RunPlan``, a frozen value; racing
    replaces it by an extended one) and what the phases accumulate: the routes as they are
    now (a replaced replica's listener moves them, ``_relisten``), the open writer, the
    manifest, summaries, step rows, counters."""

    args: argparse.Namespace
    console: Any
    profile: Any
    prompts: list
    plan: RunPlan
    auth: Auth
    prefixes: dict[str, str | None]   # strategy -> one-hop route path now (None: the model field)
    fallbacks: dict[str, str]   # strategy on the direct route -> its proxy route path (its listener failed)
    variants: dict[str, dict] = dataclasses.field(default_factory=dict)   # --k: served name -> settings
    samplings: dict[tuple[str, str], list] = dataclasses.field(default_factory=dict)
    run_id: str = ""
    run_dir: Path = Path()
    writer: Any = None
    manifest: dict[str, Any] = dataclasses.field(default_factory=dict)
    summaries: list = dataclasses.field(default_factory=list)
    steps: list[dict] = dataclasses.field(default_factory=list)
    cell_windows: list[dict] = dataclasses.field(default_factory=list)
    fetched: dict[str, float] = dataclasses.field(default_factory=dict)  # strategy -> newest step ts
    cursors: dict[str, int] = dataclasses.field(default_factory=dict)  # strategy -> step-log page's next
    step_totals: dict[str, int] = dataclasses.field(default_factory=dict)  # strategy -> page's total
    status: str = "finished"
    n_steps: int = 0
    cell_no: int = 0
    stop: dict[str, bool] = dataclasses.field(default_factory=lambda: {"stop": False})
    server: Any = None   # loadgen.run.server_metrics.RunServerMetrics (--server-metrics)
    race_rows: list[dict] = dataclasses.field(default_factory=list)   # request rows (racing only)
    race_cells: dict = dataclasses.field(default_factory=dict)  # decision key -> {strategy: CellSpec}
    cell_seconds: dict = dataclasses.field(default_factory=dict)  # (decision key, strategy) -> [s, ...]

    @property
    def target(self) -> str:
        return self.plan.target

    @property
    def strategies(self) -> list[str]:
        return list(self.plan.strategies)


def _start_runner(st: _RunState) -> Any:
    """The load runner (``loadgen.run.locust_runner.LoadRunner``); with ``--workers`` the
    workers' pids and nodes go to the manifest at once (fault tests kill one by pid)."""
    from loadgen.run.locust_runner import LoadRunner
    from loadgen.results.writer import write_manifest

    args = st.args
    runner = LoadRunner(args.workers, on_row=st.writer.add, should_stop=lambda: st.stop["stop"],
                        ray_address=args.ray_address, worker_placement=args.worker_placement)
    if args.workers > 0:
        st.manifest["load_workers"] = runner.worker_info
        st.manifest["worker_placement"] = args.worker_placement
        write_manifest(st.run_dir / "manifest.json", st.manifest)
    return runner


def _run(args: argparse.Namespace, console: Any, tty: bool, inputs: _Inputs, local: dict[str, Any]) -> int:
    """Phases: discover the target -> plan -> open the run directory -> drive every cell ->
    close -> print."""
    try:
        discovery, auth = discover(args, console, local)
    except service.ServiceError as err:
        console.print(f"[red]target error:[/] {err}{target_hint(args, err, inputs.variants)}",
                      highlight=False, soft_wrap=True)
        return EXIT_CONFIG
    plan = build_plan(args, inputs.profile, discovery)
    st = _RunState(args, console, inputs.profile, inputs.prompts, plan, auth, dict(discovery.prefixes),
                   dict(discovery.fallbacks), variants=dict(inputs.variants), samplings=dict(inputs.samplings))
    try:
        _open_server_metrics(st)
    except ServerMetricsError as err:
        _flag_error(f"--server-metrics: {err}")
        return EXIT_CONFIG
    _open_run(st)
    _catch_signals(st.stop)
    runner = None
    try:
        runner = _start_runner(st)
        with Progress(console, len(plan.cells), plan.cell_s, live=tty, at_most=plan.at_most) as progress:
            _drive(st, runner, progress)
        _check_consistency(st)
    except KeyboardInterrupt:
        st.status = "interrupted"
        console.print("[yellow]interrupted: stopping; finished requests are kept[/]")
    finally:
        _close_run(st, runner)
    _take_engine_profile(st)
    return _print_outcome(st)


def _take_engine_profile(st: _RunState) -> None:
    """``RUN_DIR/cost_curve.json`` from the local engines (``loadgen.cli.engine_profile``);
    the manifest records it, or why not."""
    from loadgen.cli import engine_profile
    from loadgen.results.writer import write_manifest

    why_not = engine_profile.wanted(st.args, st.status)
    if why_not is None:
        rec = engine_profile.take(st.run_dir, st.strategies, st.args.local_config,
                                  lambda m: st.console.print(m, highlight=False))
        if rec["error"]:
            st.console.print(f"[yellow]warning[/] engine profile not taken: {rec['error']}; the "
                             "capacity model falls back to the run's own levels", highlight=False)
    else:
        rec = {"file": None, "strategies": [], "seconds": 0.0, "error": None, "skipped": why_not}
    st.manifest["engine_profile"] = rec
    write_manifest(st.run_dir / "manifest.json", st.manifest)


def _open_server_metrics(st: _RunState) -> None:
    """Probe the target's Prometheus page (``--server-metrics``) and start polling it; say what
    was found. Raises ServerMetricsError for an explicit URL that cannot be read."""
    from loadgen.run.server_metrics import RunServerMetrics

    args = st.args
    st.server = RunServerMetrics(args.server_metrics, st.target,
                                 {s: args.model or s for s in st.strategies},
                                 args.server_metrics_interval_s, dict(st.auth.headers), st.auth.insecure)
    st.server.open()
    f = st.server.facts
    if f.get("error") and (not args.target or any(st.prefixes.values())):
        # specload's own service: no Prometheus page on the Serve proxy; its step log has it all.
        # Not an error: `skipped` set beside the probe's `error`, the report (which reads `skipped`
        # first) and the console say "not available (not needed: ...)" alike
        f["skipped"] = "a specload service: its engine step log (/specload/step_log) is read instead"
        st.console.print(f"server metrics: not available (not needed: {f['skipped']})", highlight=False,
                         soft_wrap=True)
    elif f.get("error"):
        st.console.print(f"server metrics: not available ({f['error']}); pass --server-metrics URL to read "
                         "another page", highlight=False, soft_wrap=True)
    elif st.server.active:
        st.console.print(f"server metrics: {f['engine']} series at {f['url']} every {f['interval_s']:g} s "
                         f"(models {f['model_labels']}); not exposed: {', '.join(f['missing']) or 'none'}",
                         highlight=False, soft_wrap=True)
        for note in f.get("notes", []):
            st.console.print(f"[yellow]note[/] server metrics: {note}", highlight=False, soft_wrap=True)


def _read_once(dataset: str) -> bool:
    """True when ``--dataset`` is standard input or a pipe: it cannot be read again."""
    return dataset == STDIN or (Path(dataset).exists() and not Path(dataset).is_file())


def _open_run(st: _RunState) -> None:
    """Create the run directory, the request writer and the first manifest (the plan in it);
    print the run's one-line plan."""
    from loadgen.results.writer import RowSink, write_manifest

    args, plan = st.args, st.plan
    label = SWEEP_TIER if args.sweep else args.tier
    st.run_id = args.run_id or f"{time.strftime('%Y%m%d-%H%M%S')}-{label}-{uuid.uuid4().hex[:6]}"
    st.run_dir = Path(args.results) / st.run_id
    st.run_dir.mkdir(parents=True, exist_ok=False)
    if _read_once(args.dataset):   # stdin or a pipe: keep what was read, for the analysis
        write_prompts(st.run_dir / PROMPTS_FILE, st.prompts)
    n = len(plan.cells)
    # one time estimate: the ETA of every cell line (loadgen.results.summary.eta_seconds), before any cell
    st.console.print(f"specload run [bold]{st.run_id}[/]: {len(plan.strategies)} strategies, {n} cells"
                     f"{' at most' if plan.at_most else ''} against {plan.target} (route: "
                     f"{route_names(st.prefixes)}), ETA {clock(eta_seconds(0, n, 0.0, plan.cell_s))}"
                     + (f", then racing the undecided cells to a decision within a {clock(args.budget_s)} budget"
                        if plan.racing is not None else "")
                     + f"; results in {st.run_dir}", highlight=False)
    st.writer = RowSink(st.run_dir)
    st.manifest = _first_manifest(st)
    if args.local_config and st.variants and not args.target:   # the generated Serve config, kept
        import shutil

        shutil.copyfile(args.local_config, st.run_dir / "serve_config.yaml")
    write_manifest(st.run_dir / "manifest.json", st.manifest)


def _first_manifest(st: _RunState) -> dict[str, Any]:
    """``manifest.json`` as the run opens: the plan, the target and routes, arguments,
    profile, dataset, SLOs, sampling and output-length settings, variants, environment."""
    from loadgen.results.writer import environment_info

    args, profile, plan = st.args, st.profile, st.plan
    tiers, outputs = list(plan.tiers), list(plan.outputs)
    manifest = {
        "run_id": st.run_id, "started_ts": time.time(), "finished_ts": None, "status": "running",
        "target": plan.target, "strategies": list(plan.strategies), "tiers": tiers, "outputs": outputs,
        "plan": plan.to_dict(),
        # the HTTP route each strategy was measured on: its own (one hop) or the model field
        "routes": {s: {"route": route_name(p),
                       "base_url": route_url(plan.target, p)} for s, p in st.prefixes.items()},
        "args": manifest_args(args), "profile_name": args.profile or "default", "profile": profile.model_dump(),
        "dataset": args.dataset, "num_prompts": len(st.prompts), "cells": [],
        "dataset_file": PROMPTS_FILE if _read_once(args.dataset) else None,
        # the analysis reads per-tier SLOs from config.slo (analysis/data/slo.py)
        "config": {"slo": {t: profile.cell(t, outputs[0]).slo.model_dump() for t in tiers}},
        "schema_version": MANIFEST_SCHEMA_VERSION, "repeats": args.repeats,
        "writer_pid": st.writer.pid, "driver_pid": os.getpid(), "load_workers": [], "worker_losses": [],
        "retry": {"max_retries": args.retry, "backoff_s": args.retry_backoff_s},
        "server_metrics": dict(st.server.facts) if st.server is not None else {},
        # the sampling settings of each tier x output class (each label its own cell) and the
        # output-length settings sent (ignore_eos, min_tokens)
        "samplings": {f"{t}/{oc}": [dict(x.model_dump(), label=x.name) for x in _cell_samplings(st, t, oc)]
                      for t in tiers for oc in outputs},
        "output_lengths": {f"{t}/{oc}": {"max_tokens": profile.cell(t, oc).max_tokens.model_dump(),
                                         "ignore_eos": profile.cell(t, oc).ignore_eos,
                                         "min_tokens": profile.cell(t, oc).min_tokens}
                           for t in tiers for oc in outputs},
        # --k / --top-k-candidates: every deployment's base strategy, k, candidates and engine
        "variants": st.variants,
        **environment_info()}
    if args.sweep:
        manifest["config"]["slo"][SWEEP_TIER] = profile.cell(tiers[0], outputs[0]).slo.model_dump()
        manifest["sweep"] = {"template_tier": tiers[0], "levels": list(plan.sweep_levels),
                             "factor": args.sweep_factor, "stopped": {}}
    return manifest


def _catch_signals(stop: dict[str, bool]) -> None:
    """Ctrl-C / SIGTERM set a flag that the driver loop turns into KeyboardInterrupt: under gevent
    a raw KeyboardInterrupt can land in a user greenlet and never reach this frame. A second
    Ctrl-C exits at once (the writer process still finishes the request files)."""
    def _on_signal(*_: Any) -> None:
        if stop["stop"]:
            os._exit(EXIT_INTERRUPTED)
        stop["stop"] = True

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)


def _drive(st: _RunState, runner: Any, progress: "Progress") -> None:
    """Run the plan's cells in order (a sweep decides its next cell from the last results:
    ``loadgen.run.sweep.sweep_cells``, a prefix of each level of the plan), then race
    (``--budget``); around them each strategy's replica memory report (peaks reset first:
    this run's only)."""
    plan = st.plan
    _memory_reports(st, reset_peak=True)
    _warm_strategies(st)
    sweep = SweepState() if plan.at_most else None
    order = (sweep_cells(list(plan.strategies), list(plan.outputs), plan.tiers[0], list(plan.sweep_levels),
                         sweep, plan.repeats) if sweep is not None else plan.cells)
    for spec in order:
        s, cell_t0 = _run_cell(st, spec, runner, progress)
        if sweep is not None:
            sweep.record(spec.strategy, spec.output_class, s.users, s.output_tokens_per_s,
                         s.n_ok / s.n_requests if s.n_requests else 0.0)
        _record_cell(st, s, sweep)
        # per cell: the replica's step ring buffer holds minutes, not a whole run
        _fetch_steps(st, spec.strategy, _fetch_since(st, spec.strategy, cell_t0))
    if plan.racing is not None:
        _race(st, runner, progress)
    _fetch_tail(st)
    _memory_reports(st, reset_peak=False)


def _fetch_tail(st: _RunState, quiet_polls: int = 2, max_polls: int = 10) -> None:
    """The rows of the run's last steps, which reach the store up to ``STEP_FLUSH_S`` (plus a
    push) after the last cell ended: every strategy is fetched once the store has had two
    flush periods, then again each flush period until ``quiet_polls`` fetches in a row bring
    nothing new (at most ``max_polls``). Before round 29 one fetch right after the last cell
    lost its last steps (CI stop 53: dflash2's last 3-s cell, 16 % of its prompt tokens)."""
    from configs.serve_config import STEP_FLUSH_S

    if not st.cell_windows:
        return
    wait = max(st.cell_windows[-1]["t1"] + 2 * STEP_FLUSH_S - time.time(), 0.0)
    quiet = 0
    for _ in range(max_polls):
        time.sleep(wait)
        before = len(st.steps)
        for strategy in st.strategies:
            _fetch_steps(st, strategy, st.fetched.get(strategy, st.manifest["started_ts"]))
        quiet = quiet + 1 if len(st.steps) == before else 0
        if quiet >= quiet_polls:
            return
        wait = STEP_FLUSH_S


def _memory_reports(st: _RunState, reset_peak: bool) -> None:
    """Each strategy's replica memory report (``service.fetch_memory``): with ``reset_peak``
    the peaks are reset (the run's start); else the report (weights, KV cache, process
    memory; specload targets only) goes to the manifest's ``memory``."""
    for strategy in st.strategies:
        report = service.fetch_memory(st.target, strategy, reset_peak=reset_peak, headers=st.auth.headers,
                                      insecure=st.auth.insecure)
        if report and not reset_peak:
            st.manifest.setdefault("memory", {})[strategy] = report


def _warm_strategies(st: _RunState) -> None:
    """Warm every strategy before its first measured cell (``loadgen.cli.warmup``, the plan's
    ``warmup_requests`` each, on its route now); the seconds each took and any failure go to
    the manifest (``warmup``)."""
    from loadgen.cli.warmup import warm_strategies

    n, plan = st.plan.warmup_requests, st.plan
    st.manifest["warmup"] = {"requests_per_strategy": n, "cut_s": plan.warmup_s, "seconds": {},
                             "failed": {}}
    if n <= 0 or not st.prompts:
        return
    st.manifest["warmup"].update(warm_strategies(
        {s: route_url(plan.target, st.prefixes.get(s)) for s in plan.strategies},
        {s: st.args.model or s for s in plan.strategies}, [p.text for p in st.prompts], n, st.auth,
        float(st.profile.request_timeout_s), lambda m: st.console.print(m, highlight=False)))
    st.console.print(f"warmed {len(plan.strategies)} strategies ({n} requests each, "
                     f"{sum(st.manifest['warmup']['seconds'].values()):.1f} s, not measured); "
                     f"each cell's first {plan.warmup_s:g} s is cut as warm-up", highlight=False)


def _race(st: _RunState, runner: Any, progress: "Progress") -> None:
    """Racing to a decision (``--budget``): after the first pass, rounds of repeats of the
    undecided cells' contending strategies (``loadgen.cli.race``), each cell's contenders
    run back to back in a rotating order, until every cell is decided or equivalent, or the
    next round would end past the budget (wall time since the run started). Each round
    extends the plan (``RunPlan.extend``; the counters read done / planned). The decisions
    go to the manifest (``race``) and the console."""
    from loadgen.cli import race as race_mod
    from loadgen.results.writer import write_manifest

    args = st.args
    racer = race_mod.Racer(budget_s=args.budget_s, confidence=args.confidence,
                           margin=args.equivalence_margin, first_pass_repeats=args.repeats,
                           started_ts=st.manifest["started_ts"], run_id=st.run_id,
                           manifest_config=st.manifest["config"], warmup_s=st.plan.warmup_s)
    st.manifest["race"] = racer.manifest_entry()
    say = lambda m: st.console.print(m, highlight=False, markup=False, soft_wrap=True)  # noqa: E731
    try:
        for round_cells in racer.rounds(st.race_rows, st.race_cells, st.cell_seconds, say):
            _extend_plan(st, progress, [spec for _, spec in round_cells], say)
            for _, spec in round_cells:
                s, cell_t0 = _run_cell(st, spec, runner, progress)
                _record_cell(st, s, None)
                _fetch_steps(st, spec.strategy, _fetch_since(st, spec.strategy, cell_t0))
    finally:
        if racer.stopped == "running":   # Ctrl-C or an error inside a round
            racer.stopped = "interrupted"
        st.manifest["race"] = racer.manifest_entry()
        write_manifest(st.run_dir / "manifest.json", st.manifest)
    for line in racer.final_lines(st.race_rows):
        say(line)
    st.manifest["race"] = racer.manifest_entry()
    write_manifest(st.run_dir / "manifest.json", st.manifest)


def _extend_plan(st: _RunState, progress: "Progress", cells: list, say: Any) -> None:
    """A racing round's cells appended to the plan (a new value, in the manifest's ``plan``);
    the progress total follows, and the console says so before the round's first cell line."""
    st.plan = st.plan.extend(cells)
    st.manifest["plan"] = st.plan.to_dict()
    progress.total = len(st.plan.cells)
    say(f"plan: {len(cells)} cell(s) added, {progress.finished} of {progress.total} done")


def _check_consistency(st: _RunState) -> None:
    """Output consistency vs the baseline (``loadgen.cli.consistency``): consistency.json and a
    manifest summary. Skipped with --model (one name for every strategy) or after Ctrl-C;
    a failure is a warning, never a lost run."""
    from analysis.data.consistency import tie_tolerance
    from loadgen.cli.consistency import run_checks

    args = st.args
    if args.model or st.stop["stop"]:
        return
    try:
        st.manifest["consistency"] = run_checks(
            st.target, st.strategies, [[p.prompt_id, p.text, p.max_tokens] for p in st.prompts],
            st.profile, st.plan.tiers[0], list(st.plan.outputs), st.run_dir, args.consistency,
            args.consistency_sampled, args.consistency_baseline,
            say=lambda m: st.console.print(m, highlight=False),
            headers=st.auth.headers, insecure=st.auth.insecure,
            tolerance=(args.consistency_tie_tolerance if args.consistency_tie_tolerance is not None
                       else tie_tolerance(args.consistency_dtype)),
            baseline_url=(service.normalize_base_url(args.consistency_baseline_target)
                          if args.consistency_baseline_target else None))
    except Exception as err:  # noqa: BLE001  (a failed check must not lose the run)
        st.manifest["consistency"] = {"skipped": f"failed: {err!r}"}
        st.console.print(f"[yellow]warning[/] consistency check failed: {err!r}")


def _reset_prefix_cache(st: _RunState, strategy: str) -> None:
    """Before each cell (``--reset-prefix-cache``, default on): the target forgets its prefix
    cache (``loadgen.run.prefix_cache``), so no cell reuses the prompts an earlier one cached.
    Counts per strategy go to the manifest (``prefix_cache``); a target without the route is
    asked once and named in one warning."""
    from loadgen.run.prefix_cache import reset_prefix_cache

    rec = st.manifest.setdefault("prefix_cache", {"reset_before_each_cell": bool(
        st.args.reset_prefix_cache), "by_strategy": {}})
    if not st.args.reset_prefix_cache:
        return
    mine = rec["by_strategy"].setdefault(strategy, {"reset": 0, "busy": 0, "unsupported": 0,
                                                    "failed": 0, "detail": ""})
    if mine["unsupported"]:
        return
    r = reset_prefix_cache(route_url(st.target, st.prefixes.get(strategy)), st.args.model or strategy,
                           st.auth.headers, st.auth.insecure)
    mine[r.status] += 1
    if r.detail and not mine["detail"]:
        mine["detail"] = r.detail
        st.console.print(f"[yellow]warning[/] {strategy}: prefix cache not reset before the cell "
                         f"({r.status}: {r.detail}); later cells may reuse cached prompts",
                         highlight=False)


def _run_cell(st: _RunState, spec: Any, runner: Any, progress: "Progress") -> tuple[Any, float]:
    """Offer one cell's load and summarise it; returns (CellSummary, cell start unix s)."""
    from loadgen.results.summary import add_speedups

    cell = st.profile.cell(spec.template_tier, spec.output_class)
    _reset_prefix_cache(st, spec.strategy)
    plan = _cell_plan(st, spec, cell)
    key = M.CellKey(spec.strategy, spec.tier, spec.output_class, plan.sampling_label,
                    plan.users if st.args.sweep else None)
    rep = f" r{spec.repeat}" if st.args.repeats > 1 or spec.repeat else ""
    progress.new_cell(key.label() + rep, plan)
    cell_run, cell_t0, server = _offer(st, spec, plan, cell, runner, progress)
    s = _summarize(st, spec, plan, cell, cell_run, server)
    _worker_warnings(s, runner, plan.cell_id)
    if plan.route == M.ROUTE_DIRECT:
        moved = sum(1 for r in cell_run.rows if r.get(M.REQ_ROUTE) == M.ROUTE_STRATEGY)
        if moved:
            s.warnings.append(f"{moved} request(s) went by the Serve proxy's route: the replica's own listener "
                              "refused or dropped connections (replaced or gone)"
                              f"{_relisten(st, spec.strategy, moved)}")
    st.summaries.append(s)
    add_speedups(st.summaries)
    progress.done(s)
    samp = "" if plan.sampling_label == M.GREEDY else f"/{plan.sampling_label}"
    for w in s.warnings:
        st.console.print(f"[yellow]warning[/] {spec.strategy}/{spec.tier}/{spec.output_class}{samp}: {w}",
                         highlight=False)
    return s, cell_t0


def _cell_plan(st: _RunState, spec: Any, cell: Any) -> CellPlan:
    """The ``CellPlan`` the load processes run for ``spec``: its route now, its sampling
    setting, users, start and deadline (a second ahead with Ray workers), prompts, credentials."""
    args, profile, strategy = st.args, st.profile, spec.strategy
    options = _cell_samplings(st, spec.template_tier, spec.output_class)
    sampling = next((x for x in options if x.name == spec.sampling), options[0])
    users = spec.users if spec.users is not None else cell.users
    t0 = time.time() + (0.2 if args.workers <= 0 else 1.0)
    return CellPlan(
        run_id=st.run_id, strategy=strategy, model=args.model or strategy, tier=spec.tier,
        output_class=spec.output_class, dataset=args.dataset,
        base_url=route_url(st.target, st.prefixes.get(strategy)), route=route_name(st.prefixes.get(strategy)),
        fallback_url=route_url(st.target, st.fallbacks[strategy]) if strategy in st.fallbacks else "",
        arrival=cell.arrival, users=users, rate_rps=cell.rate_rps, start_ts=t0,
        deadline_ts=t0 + (args.duration if args.duration else cell.duration_s),
        prompts=[[p.prompt_id, p.text, p.max_tokens] for p in st.prompts],
        categories={p.prompt_id: p.category for p in st.prompts if p.category},
        max_tokens=cell.max_tokens.model_dump(), seed=profile.seed,
        sampling=sampling.model_dump(), extra_body=dict(profile.extra_body),
        sampling_label=sampling.name, ignore_eos=cell.ignore_eos, min_tokens=cell.min_tokens,
        request_timeout_s=profile.request_timeout_s, repeat=spec.repeat,
        cell_id=f"{strategy}/{spec.tier}/{spec.output_class}/{sampling.name}/{users}/{spec.repeat}/"
                f"{uuid.uuid4().hex[:6]}",
        headers=st.auth.headers, insecure=st.auth.insecure,
        max_retries=args.retry, retry_backoff_s=args.retry_backoff_s)


def _offer(st: _RunState, spec: Any, plan: CellPlan, cell: Any, runner: Any,
           progress: "Progress") -> tuple[Any, float, dict | None]:
    """Run the cell: its rows go to the writer process as they complete
    (cells/NNN-...parquet, a row group a second; no Arrow conversion in this gevent loop, which
    would delay in-flight chunks' timestamps); the server's scrapes around it, its window, and
    for racing its rows and seconds under its decision key. Returns (CellRun, start unix s,
    the server's figures or None)."""
    strategy, label = spec.strategy, plan.sampling_label
    cell_t0 = st.server.begin_cell() if st.server is not None else time.time()
    st.cell_no += 1
    st.writer.start_cell(f"{st.cell_no:03d}-{strategy}-{spec.tier}-{spec.output_class}"
                         f"{'' if label == M.GREEDY else '-' + label}-u{plan.users}-r{spec.repeat}")
    try:
        cell_run = runner.run_cell(plan, cell.spawn_rate, st.profile.drain_timeout_s, progress.tick)
    finally:
        st.writer.end_cell()
        _record_losses(st, runner)
    server = st.server.end_cell(strategy, cell_t0, cell_run.rows) if st.server is not None else None
    st.cell_windows.append({"strategy": strategy, "tier": spec.tier, "output_class": spec.output_class,
                            "users": plan.users, "repeat": spec.repeat, "sampling": label,
                            "t0": cell_t0, "t1": time.time()})
    if st.plan.racing is not None:   # racing decides on these rows (loadgen.cli.race)
        from loadgen.cli.race import cell_key

        st.race_rows.extend(cell_run.rows)
        key = cell_key(cell_run.rows, spec)
        st.race_cells.setdefault(key, {}).setdefault(strategy, spec)
        st.cell_seconds.setdefault((key, strategy), []).append(time.time() - cell_t0)
    return cell_run, cell_t0, server


def _summarize(st: _RunState, spec: Any, plan: CellPlan, cell: Any, cell_run: Any,
               server: dict | None) -> Any:
    """The cell's ``CellSummary`` (``loadgen.results.summary.summarize_cell``) with its
    repeat, sampling label, forced acceptance length, per-worker stats and the server's figures."""
    from loadgen.results.summary import summarize_cell

    s = summarize_cell(cell_run.rows, strategy=spec.strategy, tier=spec.tier, output_class=spec.output_class,
                       arrival=cell.arrival, users=plan.users, rate_rps=cell.rate_rps,
                       slo=cell.slo, window=cell_run.window, cpu_samples=cell_run.cpu_samples)
    s.repeat = spec.repeat
    s.sampling = plan.sampling_label
    forced = (st.variants.get(spec.strategy) or {}).get("synthetic_acceptance_length")
    if forced is not None:
        s.synthetic_acceptance_length = float(forced)
    if server is not None:
        s.server_metrics = server
        s.warnings.extend(_server_warnings(server))
    s.workers = cell_run.workers   # per Locust worker: node, CPU %, achieved users, rows
    return s


def _server_warnings(server: dict) -> list[str]:
    """Warnings from the server's counters over a cell: drafts no request of the cell reports
    (other traffic), counter resets (a restart)."""
    out = []
    if server.get("unattributed_drafts") and not server.get("requests_without_stats"):
        out.append(f"the server counted {server['unattributed_drafts']} drafts more than this "
                   "cell's requests report: other traffic reached the engine during the cell "
                   "(its counters cannot tell it apart)")
    elif server.get("unattributed_drafts"):
        out.append(f"the server counted {server['unattributed_drafts']} drafts more than this "
                   f"cell's requests report; {server['requests_without_stats']} request(s) ended "
                   "without stats (cancelled at the cell's end or failed) and drafted too, so "
                   "other traffic cannot be told from them")
    if server.get("counter_resets"):
        out.append(f"{server['counter_resets']} server counter reset(s) during the cell (a "
                   "restart?): counted from 0 after each")
    return out


def _worker_warnings(s: Any, runner: Any, cell_id: str) -> None:
    """A warning per load worker lost during the cell ``cell_id``."""
    for loss in runner.worker_losses:
        if loss["cell_id"] == cell_id:
            s.warnings.append(f"load worker {loss['worker_index']} lost: its {loss['in_flight_at_last_report']} "
                              f"in-flight request(s) have no row ({loss['rows_delivered']} rows it sent are "
                              "kept); the cell finished on the other workers")


def _relisten(st: _RunState, strategy: str, moved: int) -> str:
    """After a cell in which ``strategy``'s listener failed (its users moved to the proxy's
    route, ``moved`` requests went there): read the target's
    listeners again and send the next cells to the strategy's new listener (a replaced
    replica listens on a new port), or to the proxy's route when it has none that answers
    from here. The manifest's route entry follows (``fallback_requests``: requests that went
    by the proxy's route so far, ``replaced_base_urls``: the listeners left; on disk with the cell's record).
    Returns the clause for the warning."""
    old, proxy = st.prefixes[strategy], st.fallbacks[strategy]
    listed = service.direct_listeners(st.target, headers=st.auth.headers, insecure=st.auth.insecure)
    new = choose_routes(ROUTE_AUTO, [strategy], {strategy: proxy}, direct=listed)[strategy]
    if not reachable(new, st.auth):
        new = proxy
    entry = st.manifest.setdefault("routes", {}).setdefault(strategy, {})
    if new != old:
        entry.setdefault("replaced_base_urls", []).append(route_url(st.target, old))
    st.prefixes[strategy] = new
    if route_name(new) != M.ROUTE_DIRECT:
        st.fallbacks.pop(strategy, None)
    entry.update(route=route_name(new), base_url=route_url(st.target, new),
                 fallback_requests=entry.get("fallback_requests", 0) + moved)
    if new == old:
        return "; its listener answers again, the next cells keep it"
    if route_name(new) == M.ROUTE_DIRECT:
        return f"; the next cells take its new listener {route_url(st.target, new)}"
    return "; it lists no listener that answers from here: the next cells take the proxy's route"


def _cell_samplings(st: _RunState, tier: str, oc: str) -> list:
    """The sampling settings of one (template) tier x output class; a sweep uses the first only."""
    options = st.samplings.get((tier, oc)) or st.profile.samplings_for(tier, oc)
    return options[:1] if st.args.sweep else options


def _record_cell(st: _RunState, s: Any, sweep: SweepState | None) -> None:
    """After each cell: manifest and summary.csv on disk, so a crash keeps what finished."""
    from loadgen.results.summary import write_csv
    from loadgen.results.writer import write_manifest

    st.manifest["cells"] = [dataclasses.asdict(x) for x in st.summaries]
    if sweep is not None:
        st.manifest["sweep"]["stopped"] = {f"{k[0]}/{k[1]}": v for k, v in sweep.stopped.items()}
    write_manifest(st.run_dir / "manifest.json", st.manifest)
    write_csv(st.run_dir / SUMMARY_CSV, st.summaries)


def _record_losses(st: _RunState, runner: Any) -> None:
    """Load workers lost so far (``LoadRunner.worker_losses``) into the manifest, at once."""
    from loadgen.results.writer import write_manifest

    losses = list(getattr(runner, "worker_losses", []))
    if losses != st.manifest.get("worker_losses"):
        st.manifest["worker_losses"] = losses
        write_manifest(st.run_dir / "manifest.json", st.manifest)


def _fetch_since(st: _RunState, strategy: str, cell_t0: float) -> float:
    """Where the fetch after a cell of ``strategy`` starts on a target without step-log
    cursors (its pages carry no ``next``): the newest step row already fetched for it, else
    a second before the cell. A replica pushes its rows every ``STEP_FLUSH_S``, so the rows
    of a cell's last steps can reach the store after the cell's own fetch; starting the next
    fetch at the next cell's start (as before round 28) skipped them, and nothing said so
    (round 28's suite: the last 4 requests of a 3-s cell, 18 % of its prompt tokens, had no
    step rows). On specload's own service the cursor (``_fetch_steps``) replaces it."""
    return st.fetched[strategy] if strategy in st.fetched else cell_t0 - 1.0


def _fetch_steps(st: _RunState, strategy: str, since: float) -> None:
    """Append the target's step rows of ``strategy`` (served name): the first fetch takes
    the rows newer than ``since``, each later one every row the store took since the last
    page (its ``next``: by arrival, so a replica's late push of older steps is not
    skipped; a store that restarted answers an old cursor with every row it holds). Rows
    the store evicted before they were fetched (the growth of the page's ``total`` less its
    rows), or a step log that fails to answer, are a warning and a manifest entry
    (``step_log_errors``), never a lost run."""
    after = st.cursors.get(strategy)
    try:
        page = service.fetch_step_page(st.target, strategy, since, after, headers=st.auth.headers,
                                       insecure=st.auth.insecure)
    except service.StepLogError as err:
        st.console.print(f"[yellow]warning[/] step rows of {strategy} since {since:.3f} are "
                         f"missing: {err}", highlight=False, soft_wrap=True)
        st.manifest.setdefault("step_log_errors", []).append(
            {"strategy": strategy, "since": since, "error": str(err)[:500], "recovered": False})
        return
    for e in st.manifest.get("step_log_errors", []):   # this fetch covered a failed one's range
        if e.get("strategy") == strategy and (after is not None or since <= e.get("since", 0.0)):
            e["recovered"] = True
    held = st.step_totals.get(strategy)
    evicted = (page.total - held - len(page.rows)
               if after is not None and held is not None and page.total is not None else 0)
    if evicted > 0:
        st.console.print(f"[yellow]warning[/] {evicted} step rows of {strategy} left the "
                         f"service's step log (its capacity) before they were fetched",
                         highlight=False, soft_wrap=True)
        st.manifest.setdefault("step_log_errors", []).append(
            {"strategy": strategy, "since": st.fetched.get(strategy, since), "recovered": False,
             "error": f"{evicted} rows evicted from the step-log store before they were fetched"})
    if page.next is not None:
        st.cursors[strategy] = page.next
    if page.total is not None:
        st.step_totals[strategy] = page.total
    rows = page.rows
    if rows:
        st.fetched[strategy] = max(st.fetched.get(strategy, 0.0),
                                   max(r.get(M.STEP_TS, 0.0) for r in rows))
    st.steps.extend(rows)


def _record_step_loss(st: _RunState) -> None:
    """The cells a lost or partial step log hits (``loadgen.results.step_loss``): in the
    manifest (``step_log_loss``) and on the console, named cell by cell."""
    from loadgen.results.step_loss import step_log_losses

    lost = step_log_losses(st.steps, st.cell_windows, st.manifest.get("step_log_errors", []))
    st.manifest["step_log_loss"] = lost
    for e in lost:
        missing = "unknown" if e["missing_rows"] is None else e["missing_rows"]
        st.console.print(f"[yellow]warning[/] step log of {e['strategy']}/{e['tier']}/"
                         f"{e['output_class']} users {e['users']} repeat {e['repeat']} is partial: "
                         f"{e['rows']} rows kept, {missing} missing ({'; '.join(e['reasons'])})",
                         highlight=False, soft_wrap=True)


def _close_run(st: _RunState, runner: Any) -> None:
    """Stop the load runner, close requests.parquet, write steps.parquet and the final manifest."""
    from loadgen.results.summary import add_speedups, write_csv
    from loadgen.results.writer import write_manifest, write_steps

    if runner is not None:
        runner.close()
    st.writer.close()
    _write_server_metrics(st)
    try:
        st.n_steps = write_steps(st.run_dir / "steps.parquet",
                                 _label_steps(st.steps, st.run_id, st.cell_windows))
    except Exception as err:  # noqa: BLE001  (step rows of an unexpected shape must not lose the run)
        st.console.print(f"[yellow]warning[/] could not write steps.parquet: {err}")
    add_speedups(st.summaries)
    _record_step_loss(st)
    st.manifest.update(status=st.status, finished_ts=time.time(), requests=st.writer.rows_written,
                       steps=st.n_steps, cells=[dataclasses.asdict(x) for x in st.summaries],
                       worker_losses=list(getattr(runner, "worker_losses", [])))
    write_manifest(st.run_dir / "manifest.json", st.manifest)
    write_csv(st.run_dir / SUMMARY_CSV, st.summaries)


def _write_server_metrics(st: _RunState) -> None:
    """Stop polling; server_metrics.parquet and the manifest's server_metrics facts."""
    from loadgen.results.writer import SERVER_METRICS_FILE, write_server_metrics

    if st.server is None:
        return
    st.server.close()
    try:
        n = write_server_metrics(st.run_dir / SERVER_METRICS_FILE, st.server.rows(st.run_id, st.cell_windows))
        st.server.facts["rows"] = n
        st.server.facts["file"] = SERVER_METRICS_FILE if n else None
    except Exception as err:  # noqa: BLE001  (a bad sample must not lose the run)
        st.console.print(f"[yellow]warning[/] could not write {SERVER_METRICS_FILE}: {err}")
    st.manifest["server_metrics"] = dict(st.server.facts)


def _print_outcome(st: _RunState) -> int:
    """After the run: the cell table, the answer, failures, the report (``--report``) and the
    results path (``loadgen.cli.outcome.print_outcome``); returns the exit code."""
    totals = {"requests": st.writer.rows_written, "steps": st.n_steps,
              "wall_s": time.time() - st.manifest["started_ts"]}
    return print_outcome(st.console, st.run_dir, st.summaries, totals, st.args.report,
                         st.status == "interrupted")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return run(args)

if __name__ == "__main__":
    sys.exit(main())
