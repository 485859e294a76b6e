"""``python -m loadgen``: run tier traffic against every strategy and write a run directory.

    python -m loadgen --tier low|mid|high|all [--output short|long|all] [--strategies a,b] [--repeats K]
    python -m loadgen --sweep [--tier TEMPLATE] [--sweep-max-users N] [--sweep-factor F] ...
        [--target URL] [--model NAME] [--duration SECONDS] [--workers N] [--profile cpu|gpu]
        [--dataset NAME|FILE.jsonl] [--results DIR] [--tiers-file FILE]

Without ``--target`` the embedded local service is started or reused
(``python -m cluster up``). Strategies default to the target's ``/v1/models``.
Each strategy runs every selected cell in turn (strategy-major order), with the
same prompts, max_tokens and seeds. Output: ``RESULTS_DIR/<run_id>/`` with
``requests.parquet``, ``steps.parquet`` (specload targets) and ``manifest.json``.
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
from configs.tiers import OUTPUT_CLASSES, TIER_NAMES, TierConfigError, load_tiers
from loadgen import service
from loadgen.cells import CellPlan, shuffled_prompts
from loadgen.sweep import SWEEP_TIER, SweepState, grid_cells, sweep_cells, sweep_levels
from loadgen.datasets import DEFAULT_DATASET, DatasetError, load_dataset
from loadgen.summary import SUMMARY_CSV, clock

EXIT_CONFIG = 2
EXIT_INTERRUPTED = 130
EXIT_NO_SUCCESS = 1  # every cell failed (all requests errored)
# one version for the run directory (manifest, request rows, step rows): configs/results_schema.py
MANIFEST_SCHEMA_VERSION = RESULTS_SCHEMA_VERSION


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m loadgen", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tier", default=None, choices=TIER_NAMES + ("all",),
                    help="tier(s) to run (required unless --sweep; with --sweep: the template tier "
                         "whose duration, max_tokens and SLOs the sweep cells use, default high)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="run each cell K times back to back (request column `repeat`, 0-based)")
    ap.add_argument("--sweep", action="store_true",
                    help="concurrency sweep: users grow geometrically per strategy until its speedup "
                         "vs autoregressive falls below 1 or it saturates (tier label `sweep`)")
    ap.add_argument("--sweep-start", type=int, default=1, help="first sweep users level (default 1)")
    ap.add_argument("--sweep-factor", type=float, default=2.0, help="users growth per level (default 2)")
    ap.add_argument("--sweep-max-users", type=int, default=64, help="last sweep users level (default 64)")
    ap.add_argument("--output", default="all", choices=OUTPUT_CLASSES + ("all",))
    ap.add_argument("--strategies", default="", help="comma-separated; default: the target's /v1/models")
    ap.add_argument("--target", default="", help="base URL of an OpenAI-compatible server; "
                                                 "default: start/reuse the local service")
    ap.add_argument("--model", default="", help="'model' field sent with every request (default: the strategy)")
    ap.add_argument("--duration", type=float, default=None, help="override every cell's duration_s, seconds")
    ap.add_argument("--workers", type=int, default=0, help="Locust workers as Ray actors; 0 = in-process")
    ap.add_argument("--ray-address", default="", help="with --workers: Ray cluster to place the workers on "
                    "('auto', host:port; default $RAY_ADDRESS, else a private local Ray instance)")
    ap.add_argument("--profile", default="", help="tier profile (default: the tier file's default_profile)")
    ap.add_argument("--dataset", default=DEFAULT_DATASET, help="humaneval|docs|stdlib|mixed or FILE.jsonl")
    ap.add_argument("--max-prompt-chars", type=int, default=None, help="override the profile's prompt cut")
    ap.add_argument("--results", default="results", help="results directory (a run_id folder goes inside)")
    ap.add_argument("--tiers-file", default="", help="default configs/tiers.yaml")
    ap.add_argument("--run-id", default="", help="default: <date>-<time>-<tier>-<random>")
    ap.add_argument("--api-key", default=None,
                    help="sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY); never written "
                         "to the manifest or logs")
    ap.add_argument("--header", action="append", default=[], metavar="'K: V'",
                    help="extra HTTP header on every request, repeatable ('X-Team: a' or 'X-Team:a'); "
                         "values are never written to the manifest or logs")
    ap.add_argument("--insecure", action="store_true",
                    help="https targets: skip TLS certificate verification (off by default)")
    ap.add_argument("--report", action="store_true",
                    help="after the run, write the analysis report (python -m analysis report) "
                         "into the run directory and print the recommendation table")
    return ap


def parse_header(text: str) -> tuple[str, str]:
    """``'K: V'`` or ``'K:V'`` -> (K, V); ValueError naming ``--header`` when malformed."""
    name, sep, value = text.partition(":")
    if not sep or not name.strip() or any(c.isspace() for c in name.strip()):
        raise ValueError(f"--header expects 'Name: value', got {text.split(':')[0]!r}...")
    return name.strip(), value.strip()


@dataclasses.dataclass(frozen=True)
class Auth:
    """Credentials and TLS choice for every call to the target (load, model list, step log)."""

    headers: dict[str, str]
    insecure: bool = False

    def __repr__(self) -> str:  # never print credentials, even in a traceback
        return f"Auth(headers=<{len(self.headers)} redacted>, insecure={self.insecure})"


def _auth(args: argparse.Namespace) -> Auth:
    """Headers from ``--header`` and ``--api-key`` / ``$OPENAI_API_KEY`` (Authorization: Bearer)."""
    headers = dict(parse_header(h) for h in args.header or [])
    key = args.api_key or os.environ.get("OPENAI_API_KEY")
    if key and not any(k.lower() == "authorization" for k in headers):
        headers["Authorization"] = f"Bearer {key}"
    return Auth(headers, bool(args.insecure))


def _strategies(args: argparse.Namespace, target: str, auth: Auth) -> list[str]:
    # Preflight: an unreachable target or an unknown model fails here with a clear
    # message instead of thousands of refused requests.
    models = service.list_models(target, headers=auth.headers, insecure=auth.insecure)
    asked = ([s.strip() for s in args.strategies.split(",") if s.strip()] if args.strategies
             else [args.model] if args.model else [])
    unknown = [s for s in asked if models and s not in models and not args.model]
    if args.model and models and args.model not in models:
        unknown = [args.model]
    if unknown:
        flag = "--model" if args.model else "--strategies"
        raise service.ServiceError(f"{flag}: {', '.join(map(repr, unknown))} not served by "
                                   f"{target}; it serves {models}")
    if asked:
        return asked
    if not models:
        raise service.ServiceError(f"{target}/v1/models lists no models; pass --strategies")
    known = [s for s in M.STRATEGIES if s in models]  # canonical order, baseline first
    return known + [m for m in models if m not in known]


class _Progress:
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

    def __enter__(self) -> "_Progress":
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
        from loadgen.summary import cell_line, eta_seconds

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


def _label_steps(rows: list[dict], run_id: str, cells: list[dict]) -> list[dict]:
    """Add run_id, tier, output_class, users and repeat (by step time inside a cell window)
    to step rows."""
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
                break
    return rows


def _check_names_before_start(args: argparse.Namespace) -> str | None:
    """Without ``--target``: every ``--strategies`` name must be one the local service deploys.

    Checked before anything starts, so a typo costs no service start-up. Returns
    the error message, or None.
    """
    if args.target or not args.strategies:
        return None
    from configs.serve_config import configured_strategy_names

    known = configured_strategy_names()
    asked = [s.strip() for s in args.strategies.split(",") if s.strip()]
    unknown = [s for s in asked if s not in known]
    if unknown:
        return (f"--strategies: {', '.join(map(repr, unknown))} not deployed by the local service "
                f"(configs/serve.yaml deploys {', '.join(known)})")
    return None


def _manifest_args(args: argparse.Namespace) -> dict[str, Any]:
    """The CLI arguments as recorded in the manifest: credentials never in clear."""
    out = dict(vars(args))
    out["api_key"] = "<redacted>" if args.api_key else None
    out["header"] = [f"{k}: <redacted>" for k, _ in (parse_header(h) for h in args.header or [])]
    return out


def run(args: argparse.Namespace) -> int:
    """The whole run; returns the exit code. Locust is imported here (gevent already patched).

    Whenever the local service was started or reused (no ``--target``), every exit
    path, errors included, ends with the hint that stops it.
    """
    from rich.console import Console

    tty = sys.stdout.isatty()
    console = Console(width=None if tty else int(os.environ.get("COLUMNS") or 100))
    err = _check_names_before_start(args)
    if err:
        console.print(f"[red]argument error:[/] {err}", highlight=False)
        return EXIT_CONFIG
    try:
        profile = load_tiers(args.tiers_file or None).profile(args.profile or None)
        max_chars = args.max_prompt_chars or profile.max_prompt_chars
        prompts = shuffled_prompts(load_dataset(args.dataset, max_chars), profile.seed)
    except (TierConfigError, DatasetError, KeyError) as err:
        console.print(f"[red]config error:[/] {err}", markup=True, highlight=False)
        return EXIT_CONFIG
    local: dict[str, Any] = {"url": None}
    try:
        return _run(args, console, tty, profile, prompts, local)
    finally:
        if not args.target:
            if local["url"]:
                console.print(f"the local service is still up at {local['url']} (reused by the next run); "
                              "stop it with `python -m cluster down`", highlight=False)
            else:
                console.print("if `python -m cluster up` left anything running, stop it with "
                              "`python -m cluster down`", highlight=False)
            sys.stdout.flush()


def _run(args: argparse.Namespace, console: Any, tty: bool, profile: Any, prompts: list,
         local: dict[str, Any]) -> int:
    tiers = list(TIER_NAMES) if args.tier == "all" else [args.tier]
    outputs = list(OUTPUT_CLASSES) if args.output == "all" else [args.output]
    levels: list[int] = []
    if args.sweep:
        levels = sweep_levels(args.sweep_start, args.sweep_factor, args.sweep_max_users)
    auth = _auth(args)
    try:
        if args.target:
            target = args.target.rstrip("/")
        else:
            console.print("starting or reusing the local service (python -m cluster up) ...", highlight=False)
            target = service.start_local_service(
                on_line=lambda line: console.print(line, highlight=False, markup=False, soft_wrap=True))
            local["url"] = target
        strategies = _strategies(args, target, auth)
        if args.sweep and M.AUTOREGRESSIVE not in strategies:
            strategies = [M.AUTOREGRESSIVE] + strategies   # the sweep's speedup reference
    except service.ServiceError as err:
        console.print(f"[red]target error:[/] {err}", highlight=False)
        return EXIT_CONFIG

    from loadgen.locust_runner import LoadRunner
    from loadgen.summary import add_speedups, legend, render_table, summarize_cell, write_csv
    from loadgen.writer import RequestWriter, environment_info, write_manifest, write_steps

    label = SWEEP_TIER if args.sweep else args.tier
    run_id = args.run_id or f"{time.strftime('%Y%m%d-%H%M%S')}-{label}-{uuid.uuid4().hex[:6]}"
    run_dir = Path(args.results) / run_id
    run_dir.mkdir(parents=True, exist_ok=False)
    # cells to run (a sweep stops early: its count is an upper bound) and the planned time per cell:
    # offered load + half the drain timeout (the ETA uses it until cells have finished)
    if args.sweep:
        n_cells = len(strategies) * len(outputs) * len(levels) * args.repeats
        durations = [args.duration or profile.cell(tiers[0], oc).duration_s for oc in outputs]
    else:
        n_cells = len(strategies) * len(tiers) * len(outputs) * args.repeats
        durations = [args.duration or profile.cell(t, oc).duration_s for t in tiers for oc in outputs]
    planned_cell_s = sum(durations) / len(durations) + 0.5 * profile.drain_timeout_s
    console.print(f"specload run [bold]{run_id}[/]: {len(strategies)} strategies, {n_cells} cells"
                  f"{' at most' if args.sweep else ''} against {target}, about "
                  f"{clock(n_cells * planned_cell_s)} planned; results in {run_dir}", highlight=False)
    writer = RequestWriter(run_dir / "requests.parquet")
    manifest: dict[str, Any] = {
        "run_id": run_id, "started_ts": time.time(), "finished_ts": None, "status": "running",
        "target": target, "strategies": strategies, "tiers": tiers, "outputs": outputs,
        "args": _manifest_args(args), "profile_name": args.profile or "default", "profile": profile.model_dump(),
        "dataset": args.dataset, "num_prompts": len(prompts), "cells": [],
        # the analysis reads per-tier SLOs from config.slo (analysis/slo.py)
        "config": {"slo": {t: profile.cell(t, outputs[0]).slo.model_dump() for t in tiers}},
        "schema_version": MANIFEST_SCHEMA_VERSION, "repeats": args.repeats,
        **environment_info()}
    if args.sweep:
        manifest["config"]["slo"][SWEEP_TIER] = profile.cell(tiers[0], outputs[0]).slo.model_dump()
        manifest["sweep"] = {"template_tier": tiers[0], "levels": levels, "factor": args.sweep_factor,
                             "stopped": {}}
    write_manifest(run_dir / "manifest.json", manifest)

    # Ctrl-C / SIGTERM set a flag that the driver loop turns into KeyboardInterrupt: under gevent
    # a raw KeyboardInterrupt can land in a user greenlet and never reach this frame. A second
    # Ctrl-C exits at once (the Parquet footer is then lost).
    stop_flag = {"stop": False}

    def _on_signal(*_: Any) -> None:
        if stop_flag["stop"]:
            os._exit(EXIT_INTERRUPTED)
        stop_flag["stop"] = True

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    summaries = []
    fetched: dict[str, float] = {}   # strategy -> newest step ts fetched
    run_t0 = time.time()
    steps: list[dict] = []
    cell_windows: list[dict] = []
    runner = None
    status = "finished"
    try:
        runner = LoadRunner(args.workers, on_row=writer.add, should_stop=lambda: stop_flag["stop"],
                            ray_address=args.ray_address)
        lead_s = 0.2 if args.workers <= 0 else 1.0
        with _Progress(console, n_cells, planned_cell_s, live=tty, at_most=bool(args.sweep)) as progress:
            def tick(now: float, r: Any) -> None:
                # no Parquet flush while load is offered: converting thousands of rows blocks the
                # gevent loop for 100+ ms and would delay every in-flight chunk's timestamp
                progress.tick(now, r)

            if args.sweep:
                state = SweepState()
                order = sweep_cells(strategies, outputs, tiers[0], levels, state, args.repeats)
            else:
                state, order = None, grid_cells(strategies, tiers, outputs, args.repeats)
            for spec in order:
                strategy, tier, oc = spec.strategy, spec.tier, spec.output_class
                cell = profile.cell(spec.template_tier, oc)
                users = spec.users if spec.users is not None else cell.users
                duration = args.duration if args.duration else cell.duration_s
                t0 = time.time() + lead_s
                plan = CellPlan(
                    run_id=run_id, strategy=strategy, model=args.model or strategy, tier=tier,
                    output_class=oc, dataset=args.dataset, base_url=target, arrival=cell.arrival,
                    users=users, rate_rps=cell.rate_rps, start_ts=t0, deadline_ts=t0 + duration,
                    prompts=[[p.prompt_id, p.text, p.max_tokens] for p in prompts],
                    max_tokens=cell.max_tokens.model_dump(), seed=profile.seed,
                    sampling=profile.sampling.model_dump(), extra_body=dict(profile.extra_body),
                    request_timeout_s=profile.request_timeout_s, repeat=spec.repeat,
                    cell_id=f"{strategy}/{tier}/{oc}/{users}/{spec.repeat}/{uuid.uuid4().hex[:6]}",
                    headers=auth.headers, insecure=auth.insecure)
                rep = f" r{spec.repeat}" if args.repeats > 1 else ""
                sweep_users = f" u{users}" if args.sweep else ""
                progress.new_cell(f"{strategy} {tier}/{oc}{sweep_users}{rep}", plan)
                cell_t0 = time.time()
                cell_run = runner.run_cell(plan, cell.spawn_rate, profile.drain_timeout_s, tick)
                writer.flush()
                cell_windows.append({"strategy": strategy, "tier": tier, "output_class": oc,
                                     "users": users, "repeat": spec.repeat,
                                     "t0": cell_t0, "t1": time.time()})
                s = summarize_cell(cell_run.rows, strategy=strategy, tier=tier, output_class=oc,
                                   arrival=cell.arrival, users=users, rate_rps=cell.rate_rps,
                                   slo=cell.slo, window=cell_run.window, cpu_samples=cell_run.cpu_samples)
                s.repeat = spec.repeat
                s.duration_s = time.time() - cell_t0
                summaries.append(s)
                add_speedups(summaries)
                progress.done(s)
                if state is not None:
                    state.record(strategy, oc, users, s.output_tokens_per_s,
                                 s.n_ok / s.n_requests if s.n_requests else 0.0)
                for w in s.warnings:
                    console.print(f"[yellow]warning[/] {strategy}/{tier}/{oc}: {w}", highlight=False)
                manifest["cells"] = [dataclasses.asdict(x) for x in summaries]
                if state is not None:
                    manifest["sweep"]["stopped"] = {f"{k[0]}/{k[1]}": v for k, v in state.stopped.items()}
                write_manifest(run_dir / "manifest.json", manifest)
                write_csv(run_dir / SUMMARY_CSV, summaries)
                # per cell: the replica's step ring buffer holds minutes, not a whole run
                since = max(cell_t0 - 1.0, fetched.get(strategy, 0.0))
                new_rows = service.fetch_step_log(target, strategy, since, headers=auth.headers,
                                                  insecure=auth.insecure)
                if new_rows:
                    fetched[strategy] = max(r.get(M.STEP_TS, 0.0) for r in new_rows)
                steps.extend(new_rows)
            for strategy in strategies:  # rows pushed after the last fetch (flush lag)
                steps.extend(service.fetch_step_log(target, strategy, fetched.get(strategy, run_t0),
                                                    headers=auth.headers, insecure=auth.insecure))
    except KeyboardInterrupt:
        status = "interrupted"
        console.print("[yellow]interrupted: stopping; finished requests are kept[/]")
    finally:
        if runner is not None:
            runner.close()
        writer.close()
        n_steps = 0
        try:
            n_steps = write_steps(run_dir / "steps.parquet", _label_steps(steps, run_id, cell_windows))
        except Exception as err:  # noqa: BLE001  (step rows of an unexpected shape must not lose the run)
            console.print(f"[yellow]warning[/] could not write steps.parquet: {err}")
        add_speedups(summaries)
        manifest.update(status=status, finished_ts=time.time(), requests=writer.rows_written, steps=n_steps,
                        cells=[dataclasses.asdict(x) for x in summaries])
        write_manifest(run_dir / "manifest.json", manifest)
        write_csv(run_dir / SUMMARY_CSV, summaries)
    if summaries:
        table, shown = render_table(summaries, max_width=console.width)
        console.print(table)
        console.print(f"Columns: {legend(shown)} Every column, p99s included: {run_dir / SUMMARY_CSV}",
                      highlight=False)
    console.print(f"requests: {writer.rows_written}, steps: {n_steps}, "
                  f"wall time {clock(time.time() - manifest['started_ts'])}", highlight=False)
    empty = [f"{s.strategy}/{s.tier}/{s.output_class}" for s in summaries if not s.n_ok]
    if empty:
        console.print(f"[red]no successful request[/] in {', '.join(empty)}; see the `error` "
                      f"column of {run_dir / 'requests.parquet'}", highlight=False)
    if args.report and writer.rows_written and len(empty) < len(summaries):
        _report(run_dir, console)
    print(f"results: {run_dir}", flush=True)
    if status == "interrupted":
        return EXIT_INTERRUPTED
    return EXIT_NO_SUCCESS if summaries and len(empty) == len(summaries) else 0


def _report(run_dir: Path, console: Any) -> None:
    """Write the analysis report into the run's report folder; print the headline and its paths."""
    from analysis.recommend import headline_lines
    from analysis.report import build_report, default_out_dir

    out = build_report(run_dir, default_out_dir(run_dir))
    console.print("recommendation per tier (highest goodput under the SLOs):", highlight=False)
    for line in headline_lines(out["recommendation"]):
        console.print(f"  {line}", highlight=False, markup=False)
    for name, path in out["paths"].items():
        console.print(f"{name}: {path}", highlight=False)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.tier is None and not args.sweep:
        parser.error("--tier is required (low, mid, high or all), unless --sweep is given")
    if args.sweep:
        args.tier = args.tier or "high"
        if args.tier == "all":
            parser.error("--tier with --sweep names one template tier (low, mid or high), not all")
        try:
            sweep_levels(args.sweep_start, args.sweep_factor, args.sweep_max_users)
        except ValueError as err:
            parser.error(f"--sweep-start/--sweep-factor/--sweep-max-users: {err}")
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.duration is not None and not args.duration > 0:
        parser.error(f"--duration must be > 0 seconds, got {args.duration}")
    if args.workers < 0:
        parser.error(f"--workers must be >= 0 (0 = in-process), got {args.workers}")
    for h in args.header:
        try:
            parse_header(h)
        except ValueError as err:
            parser.error(str(err))
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
