"""``python -m loadgen``: run tier traffic against every strategy and write a run directory.

    python -m loadgen --tier low|mid|high|all [--output short|long|all] [--strategies a,b] [--repeats K]
    python -m loadgen --sweep [--tier TEMPLATE] [--sweep-max-users N] [--sweep-factor F] ...
        [--target URL] [--route auto|direct|strategy|model-field] [--model NAME] [--duration SECONDS]
        [--workers N] [--profile cpu|gpu]
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
from loadgen.run import service
from loadgen.cli.args import check_local_strategy_names, manifest_args, parse_args, tier_list
from loadgen.run.cells import CellPlan, shuffled_prompts
from configs.jsonio import STDIN
from loadgen.run.datasets import PROMPTS_FILE, DatasetError, load_dataset, write_prompts
from loadgen.run.server_metrics import ServerMetricsError
from loadgen.results.progress import Progress
from loadgen.results.summary import SUMMARY_CSV, clock
from loadgen.run.sweep import SWEEP_TIER, SweepState, grid_cells, sweep_cells, sweep_levels

WARMUP_MAX_TOKENS = 32   # tokens per warm-up completion (--warmup-requests)
from loadgen.cli.target import (
    ROUTE_AUTO,
    ROUTE_DIRECT,
    ROUTE_MODEL_FIELD,
    Auth,
    choose_routes,
    connect,
    route_name,
    route_names,
    route_url,
)

EXIT_CONFIG = 2
EXIT_INTERRUPTED = 130
EXIT_NO_SUCCESS = 1  # every cell failed (all requests errored)
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






class _FlagError(Exception):
    """A bad value found after parsing; ``flag`` is the option to fix."""

    def __init__(self, flag: str, message: str) -> None:
        super().__init__(f"{flag}: {message}")
        self.flag, self.message = flag, message


def _variants(args: argparse.Namespace) -> dict[str, dict]:
    """``--k`` / ``--top-k-candidates``: served name -> {"base_strategy", "strategy", "k",
    "top_k_candidates", "engine"} of every deployment to drive ({} without those flags).

    Without ``--target`` the local service's Serve config (``--local-config``, default
    ``configs/serve.yaml``) is rewritten with the variants (``configs.serve_config.variant_config``:
    one deployment per strategy x k x candidates, autoregressive kept as the baseline), saved
    to a temp file that ``args.local_config`` then names. With ``--target`` the variants of
    the ``--strategies`` names must already be served there. ``args.strategies`` becomes the
    variant names (``args.base_strategies`` keeps what was asked). Raises _FlagError naming
    the flag (a k over a block drafter's block size names ``--k``)."""
    als = getattr(args, "acceptance_length", None)
    if not (args.k or args.top_k_candidates or als):
        return {}
    import hashlib
    import tempfile

    import yaml

    from configs.paths import CONFIGS_DIR
    from configs.serve_config import VariantError, variant_config

    asked = [x.strip() for x in args.strategies.split(",") if x.strip()]
    flag = "--k" if args.k else "--top-k-candidates" if args.top_k_candidates else "--acceptance-length"
    if args.target:
        if not asked:
            raise _FlagError(flag, "with --target, name the strategies (--strategies a,b): their "
                                   "variants (<strategy>-k<K>) must be served there")
        variants: dict[str, dict] = {}
        for name in asked:
            parsed = M.parse_variant_name(name)
            strategy = parsed[0] if parsed else name
            if strategy == M.AUTOREGRESSIVE:
                variants[name] = {"base_strategy": name, "strategy": strategy, "k": 0,
                                  "top_k_candidates": None, "synthetic_acceptance_length": None,
                                  "synthetic": False, "engine": None}
                continue
            cands = (args.top_k_candidates if args.top_k_candidates and strategy in M.CANDIDATE_STRATEGIES
                     else [None])
            over = [k for k in (args.k or []) if als and max(als) > k + 1]
            if over:
                raise _FlagError("--acceptance-length", f"{max(als):g} above k + 1 for k = {over}; a "
                                 "step of k drafts emits at most k + 1 tokens")
            for k in args.k or [None]:
                for c in cands:
                    for a in als or [None]:
                        variants[M.variant_name(name, k, c, a)] = {
                            "base_strategy": name, "strategy": strategy, "k": k,
                            "top_k_candidates": c, "synthetic_acceptance_length": a,
                            "synthetic": a is not None, "engine": None}
        if als and not any(v["synthetic"] for v in variants.values()):
            raise _FlagError("--acceptance-length", "no selected strategy speculates (autoregressive "
                             "has no accept decision to force); add a speculative one to --strategies")
    else:
        base = Path(args.local_config or CONFIGS_DIR / "serve.yaml")
        try:
            cfg, variants = variant_config(yaml.safe_load(base.read_text()), asked, args.k,
                                           args.top_k_candidates, als)
        except VariantError as err:
            bad, _, msg = str(err).partition(": ")
            raise _FlagError(bad, msg) from None
        text = (f"# generated by python -m loadgen from {base} with --k {args.k} "
                f"--top-k-candidates {args.top_k_candidates} --acceptance-length {als}\n"
                + yaml.safe_dump(cfg, sort_keys=False))
        path = Path(tempfile.gettempdir()) / (
            f"specload-variants-{os.getuid()}-{hashlib.sha256(text.encode()).hexdigest()[:12]}.yaml")
        path.write_text(text)
        try:
            service.check_serve_config(path)
        except ValueError as err:
            if als and ("rejection_sample_method" in str(err) or "synthetic_acceptance" in str(err)):
                flag = "--acceptance-length"   # the forced acceptance is what the engine refused
            raise _FlagError(flag, f"the variants' Serve config does not validate: {err}") from None
        args.local_config = str(path)
    args.base_strategies = args.strategies
    args.strategies = ",".join(variants)
    return variants


def _samplings(args: argparse.Namespace, profile: Any) -> dict[tuple[str, str], list]:
    """(tier, output class) -> its sampling settings (``configs.tiers.Sampling``), each its own
    cell: ``--temperature T,...`` (the profile's sampling with each temperature) for every
    cell, else the tier file's (``Profile.samplings_for``)."""
    if args.temperature:
        base = profile.sampling
        lst = [base.model_copy(update={"temperature": float(t), "label": None}) for t in args.temperature]
        return {(t, oc): lst for t in TIER_NAMES for oc in OUTPUT_CLASSES}
    return {(t, oc): profile.samplings_for(t, oc) for t in TIER_NAMES for oc in OUTPUT_CLASSES}


def _flag_error(message: str) -> None:
    """A flag's error before anything ran, as argparse writes its own: one line on stderr,
    ``python -m loadgen: error: <flag>: <what>`` (the caller exits 2)."""
    print(f"python -m loadgen: error: {message}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    """The whole run; returns the exit code. Locust is imported here (gevent already patched).

    Whenever the local service was started or reused (no ``--target``), every exit
    path, errors included, ends with the hint that stops it.
    """
    from rich.console import Console

    tty = sys.stdout.isatty()
    console = Console(width=None if tty else int(os.environ.get("COLUMNS") or 100))
    err = check_local_strategy_names(args)
    if err:
        _flag_error(err)
        return EXIT_CONFIG
    try:   # each failure names its flag (a KeyError's text is its repr: take the message)
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
        from loadgen.cli.args import resolve_warmup

        args.warmup_s = resolve_warmup(args, profile, tier_list(args.tier or "high"),
                                       list(OUTPUT_CLASSES) if args.output == "all" else [args.output])
        variants = _variants(args)   # --k / --top-k-candidates: one deployment per variant
        samplings = _samplings(args, profile)
    except _FlagError as err:
        _flag_error(f"{err.flag}: {err.message}")
        return EXIT_CONFIG
    local: dict[str, Any] = {"url": None}
    try:
        return _run(args, console, tty, profile, prompts, local, variants, samplings)
    finally:
        if not args.target:
            down = "python -m cluster down" + (f" --port {args.local_port}" if args.local_port != 8000 else "")
            if local["url"]:
                console.print(f"the local service is still up at {local['url']} (reused by the next run); "
                              f"stop it with `{down}`", highlight=False)
            else:
                console.print("if `python -m cluster up` left anything running, stop it with "
                              f"`{down}`", highlight=False)
            sys.stdout.flush()


@dataclasses.dataclass
class _RunState:
    """Everything one run accumulates, shared by its phases."""

    args: argparse.Namespace
    console: Any
    profile: Any
    prompts: list
    target: str
    strategies: list[str]
    auth: Auth
    prefixes: dict[str, str | None]   # strategy -> one-hop route path (None: the model field)
    fallbacks: dict[str, str]   # strategy on the direct route -> its proxy route path (its listener failed)
    tiers: list[str]
    outputs: list[str]
    levels: list[int]
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
    status: str = "finished"
    n_steps: int = 0
    cell_no: int = 0
    stop: dict[str, bool] = dataclasses.field(default_factory=lambda: {"stop": False})
    server: Any = None   # loadgen.run.server_metrics.RunServerMetrics (--server-metrics)
    race_rows: list[dict] = dataclasses.field(default_factory=list)   # request rows (racing only)
    race_cells: dict = dataclasses.field(default_factory=dict)  # cell key -> {strategy: CellSpec}
    cell_seconds: dict = dataclasses.field(default_factory=dict)  # (cell key, strategy) -> [s, ...]


def _run(args: argparse.Namespace, console: Any, tty: bool, profile: Any, prompts: list,
         local: dict[str, Any], variants: dict[str, dict] | None = None,
         samplings: dict[tuple[str, str], list] | None = None) -> int:
    """Phases: connect -> open the run directory -> drive every cell -> close -> print."""
    try:
        target, strategies, auth = connect(args, console, local)
        routes = ({} if args.route == ROUTE_MODEL_FIELD else
                  service.strategy_routes(target, headers=auth.headers, insecure=auth.insecure))
        direct = (service.direct_listeners(target, headers=auth.headers, insecure=auth.insecure)
                  if args.route == ROUTE_DIRECT or (args.route == ROUTE_AUTO and routes
                                                    and not args.model) else None)
        prefixes = choose_routes(args.route, strategies, routes, args.model, direct)
        dead = [s for s, p in prefixes.items() if not _reachable(p, auth)]
        if dead and args.route == ROUTE_DIRECT:
            raise service.ServiceError(
                f"--route direct: the replica listener of {dead} does not answer from here "
                f"({', '.join(prefixes[s] + '/health' for s in dead)}); use --route strategy")
        if dead:
            console.print(f"the replica listeners of {dead} do not answer from here: their load "
                          "takes the Serve proxy's route", highlight=False)
            prefixes.update({s: routes[s] for s in dead})
    except service.ServiceError as err:
        hint = ""
        if args.route == ROUTE_DIRECT and not args.target and "--route direct" in str(err):
            hint = ("; a running local service was reused: stop it with `python -m cluster down` "
                    "or pick another --local-port")
        if variants and "not served" in str(err):
            hint = ("; --k/--top-k-candidates: the variants are not deployed there" +
                    ("" if args.target else " (a running local service was reused: stop it with "
                     "`python -m cluster down` or pick another --local-port)"))
        console.print(f"[red]target error:[/] {err}{hint}", highlight=False, soft_wrap=True)
        return EXIT_CONFIG
    st = _RunState(args, console, profile, prompts, target, strategies, auth, prefixes,
                   fallbacks={s: routes[s] for s, p in prefixes.items()
                              if route_name(p) == ROUTE_DIRECT},
                   tiers=tier_list(args.tier),
                   outputs=list(OUTPUT_CLASSES) if args.output == "all" else [args.output],
                   levels=sweep_levels(args.sweep_start, args.sweep_factor, args.sweep_max_users)
                   if args.sweep else [], variants=dict(variants or {}),
                   samplings=dict(samplings or {}))
    try:
        _open_server_metrics(st)
    except ServerMetricsError as err:
        _flag_error(f"--server-metrics: {err}")
        return EXIT_CONFIG
    n_cells, planned_cell_s = _open_run(st)
    _catch_signals(st.stop)
    runner = None
    try:
        from loadgen.run.locust_runner import LoadRunner

        runner = LoadRunner(args.workers, on_row=st.writer.add, should_stop=lambda: st.stop["stop"],
                            ray_address=args.ray_address, worker_placement=args.worker_placement)
        if args.workers > 0:   # pids and nodes of the load workers (fault tests kill one by pid)
            from loadgen.results.writer import write_manifest

            st.manifest["load_workers"] = runner.worker_info
            st.manifest["worker_placement"] = args.worker_placement
            write_manifest(st.run_dir / "manifest.json", st.manifest)
        with Progress(console, n_cells, planned_cell_s, live=tty, at_most=bool(args.sweep)) as progress:
            _drive(st, runner, progress)
        _check_consistency(st)
    except KeyboardInterrupt:
        st.status = "interrupted"
        console.print("[yellow]interrupted: stopping; finished requests are kept[/]")
    finally:
        _close_run(st, runner)
    return _print_outcome(st)




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
        # specload's own service: no Prometheus page on the Serve proxy; its step log has it all
        f["skipped"] = "a specload service: its engine step log (/specload/step_log) is read instead"
        st.console.print(f"server metrics: not needed ({f['skipped']})", highlight=False, soft_wrap=True)
    elif f.get("error"):
        st.console.print(f"server metrics: none ({f['error']}); pass --server-metrics URL to read "
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


def _open_run(st: _RunState) -> tuple[int, float]:
    """Create the run directory, the request writer and the first manifest; print the plan.
    Returns (cells planned, planned seconds per cell)."""
    from loadgen.results.writer import RowSink, environment_info, write_manifest

    args, profile, tiers, outputs = st.args, st.profile, st.tiers, st.outputs
    label = SWEEP_TIER if args.sweep else args.tier
    st.run_id = args.run_id or f"{time.strftime('%Y%m%d-%H%M%S')}-{label}-{uuid.uuid4().hex[:6]}"
    st.run_dir = Path(args.results) / st.run_id
    st.run_dir.mkdir(parents=True, exist_ok=False)
    if _read_once(args.dataset):   # stdin or a pipe: keep what was read, for the analysis
        write_prompts(st.run_dir / PROMPTS_FILE, st.prompts)
    # cells to run (a sweep stops early: its count is an upper bound) and the planned time per cell:
    # offered load + half the drain timeout (the ETA uses it until cells have finished)
    if args.sweep:
        n_cells = len(st.strategies) * len(outputs) * len(st.levels) * args.repeats
        durations = [args.duration or profile.cell(tiers[0], oc).duration_s for oc in outputs]
    else:
        from loadgen.cli.race import aa_cells

        n_cells = (len(st.strategies) * args.repeats + aa_cells(st.strategies, args.repeats, args.aa)) * sum(
            len(st.samplings.get((t, oc)) or [None]) for t in tiers for oc in outputs)
        durations = [args.duration or profile.cell(t, oc).duration_s for t in tiers for oc in outputs]
    planned_cell_s = sum(durations) / len(durations) + 0.5 * profile.drain_timeout_s
    st.console.print(f"specload run [bold]{st.run_id}[/]: {len(st.strategies)} strategies, {n_cells} cells"
                     f"{' at most' if args.sweep else ''} against {st.target} (route: {route_names(st.prefixes)}), about "
                     f"{clock(n_cells * planned_cell_s)} planned"
                     + (f", then racing the undecided cells to a decision within a {clock(args.budget_s)} budget"
                        if args.budget_s > 0 and not args.sweep else "")
                     + f"; results in {st.run_dir}", highlight=False)
    st.writer = RowSink(st.run_dir)
    st.manifest = {
        "run_id": st.run_id, "started_ts": time.time(), "finished_ts": None, "status": "running",
        "target": st.target, "strategies": st.strategies, "tiers": tiers, "outputs": outputs,
        # the HTTP route each strategy was measured on: its own (one hop) or the model field
        "routes": {s: {"route": route_name(p),
                       "base_url": route_url(st.target, p)} for s, p in st.prefixes.items()},
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
    if args.local_config and st.variants and not args.target:   # the generated Serve config, kept
        import shutil

        shutil.copyfile(args.local_config, st.run_dir / "serve_config.yaml")
    if args.sweep:
        st.manifest["config"]["slo"][SWEEP_TIER] = profile.cell(tiers[0], outputs[0]).slo.model_dump()
        st.manifest["sweep"] = {"template_tier": tiers[0], "levels": st.levels, "factor": args.sweep_factor,
                                "stopped": {}}
    write_manifest(st.run_dir / "manifest.json", st.manifest)
    return n_cells, planned_cell_s


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
    """Run every cell in order (a sweep decides its next cell from the last results); then
    each strategy's replica memory report (peaks reset first: this run's only)."""
    for strategy in st.strategies:
        service.fetch_memory(st.target, strategy, reset_peak=True, headers=st.auth.headers,
                             insecure=st.auth.insecure)
    _warm_strategies(st)
    if st.args.sweep:
        sweep = SweepState()
        order = sweep_cells(st.strategies, st.outputs, st.tiers[0], st.levels, sweep, st.args.repeats)
    else:
        labels = {k: [x.name for x in v] for k, v in st.samplings.items()}
        sweep, order = None, grid_cells(st.strategies, st.tiers, st.outputs, st.args.repeats, labels)
        if st.args.budget_s > 0 or st.args.interleave or st.args.aa:
            # cell-major (racing's first pass, or --interleave): drift hits a cell's strategies alike
            from loadgen.cli.race import first_pass

            order = first_pass(st.strategies, st.tiers, st.outputs, st.args.repeats, labels,
                               aa=st.args.aa)
    for spec in order:
        s, cell_t0 = _run_cell(st, spec, runner, progress)
        if sweep is not None:
            sweep.record(spec.strategy, spec.output_class, s.users, s.output_tokens_per_s,
                         s.n_ok / s.n_requests if s.n_requests else 0.0)
        _record_cell(st, s, sweep)
        # per cell: the replica's step ring buffer holds minutes, not a whole run
        _fetch_steps(st, spec.strategy, max(cell_t0 - 1.0, st.fetched.get(spec.strategy, 0.0)))
    if st.args.budget_s > 0 and sweep is None:
        _race(st, runner, progress)
    for strategy in st.strategies:  # rows pushed after the last fetch (flush lag)
        _fetch_steps(st, strategy, st.fetched.get(strategy, st.manifest["started_ts"]))
        report = service.fetch_memory(st.target, strategy, headers=st.auth.headers,
                                      insecure=st.auth.insecure)
        if report:  # weights, KV cache, process memory (specload targets only)
            st.manifest.setdefault("memory", {})[strategy] = report


def _warm_strategies(st: _RunState) -> None:
    """Warm every strategy before its first measured cell (``--warmup-requests`` N): N short
    greedy completions on its own route, half one at a time, half at once, not recorded as
    requests. The seconds each took go to the manifest (``warmup``); a failure is a warning."""
    import json
    import urllib.error
    import urllib.request
    from concurrent.futures import ThreadPoolExecutor

    n = st.args.warmup_requests
    st.manifest["warmup"] = {"requests_per_strategy": n, "cut_s": st.args.warmup_s, "seconds": {},
                             "failed": {}}
    if n <= 0 or not st.prompts:
        return
    timeout = float(st.profile.request_timeout_s)

    def one(strategy: str, i: int) -> None:
        """One streamed completion (the load's own path), read to its end."""
        url = route_url(st.target, st.prefixes.get(strategy))
        body = {"model": st.args.model or strategy, "prompt": st.prompts[i % len(st.prompts)].text,
                "max_tokens": WARMUP_MAX_TOKENS, "temperature": 0.0, "stream": True}
        req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                     headers={**st.auth.headers, "Content-Type": "application/json"},
                                     method="POST")
        ctx = service.ssl_context(st.auth.insecure) if url.startswith("https://") else None
        with urllib.request.urlopen(req, timeout=timeout, context=ctx) as resp:  # noqa: S310
            resp.read()

    for strategy in st.strategies:
        t0 = time.monotonic()
        try:
            for i in range((n + 1) // 2):
                one(strategy, i)
            with ThreadPoolExecutor(max_workers=max(1, n // 2)) as pool:
                list(pool.map(lambda i: one(strategy, i), range((n + 1) // 2, n)))
        except (urllib.error.URLError, OSError, ValueError) as err:
            st.manifest["warmup"]["failed"][strategy] = str(err)[:300]
            st.console.print(f"[yellow]warning[/] warm-up of {strategy} failed: {err}", highlight=False)
        st.manifest["warmup"]["seconds"][strategy] = round(time.monotonic() - t0, 3)
    st.console.print(f"warmed {len(st.strategies)} strategies ({n} requests each, "
                     f"{sum(st.manifest['warmup']['seconds'].values()):.1f} s, not measured); "
                     f"each cell's first {st.args.warmup_s:g} s is cut as warm-up", highlight=False)


def _race(st: _RunState, runner: Any, progress: "Progress") -> None:
    """Racing to a decision (``--budget``): after the first pass, rounds of repeats of the
    undecided cells' contending strategies (``loadgen.cli.race``), each cell's contenders
    run back to back in a rotating order, until every cell is decided or equivalent, or the
    next round would end past the budget (wall time since the run started). The decisions
    go to the manifest (``race``) and the console."""
    from loadgen.cli import race as race_mod
    from loadgen.results.writer import write_manifest

    args = st.args
    racer = race_mod.Racer(budget_s=args.budget_s, confidence=args.confidence,
                           margin=args.equivalence_margin, first_pass_repeats=args.repeats,
                           started_ts=st.manifest["started_ts"], run_id=st.run_id,
                           manifest_config=st.manifest["config"], warmup_s=args.warmup_s)
    st.manifest["race"] = racer.manifest_entry()
    say = lambda m: st.console.print(m, highlight=False, markup=False, soft_wrap=True)  # noqa: E731
    try:
        for plan in racer.rounds(st.race_rows, st.race_cells, st.cell_seconds, say):
            progress.total += len(plan)
            for key, spec in plan:
                s, cell_t0 = _run_cell(st, spec, runner, progress)
                _record_cell(st, s, None)
                _fetch_steps(st, spec.strategy, max(cell_t0 - 1.0, st.fetched.get(spec.strategy, 0.0)))
    finally:
        if racer.stopped == "running":   # Ctrl-C or an error inside a round
            racer.stopped = "interrupted"
        st.manifest["race"] = racer.manifest_entry()
        write_manifest(st.run_dir / "manifest.json", st.manifest)
    for line in racer.final_lines(st.race_rows):
        say(line)
    st.manifest["race"] = racer.manifest_entry()
    write_manifest(st.run_dir / "manifest.json", st.manifest)


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
            st.profile, st.tiers[0], st.outputs, st.run_dir, args.consistency,
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
    from loadgen.results.summary import add_speedups, summarize_cell

    args, profile = st.args, st.profile
    strategy, tier, oc = spec.strategy, spec.tier, spec.output_class
    cell = profile.cell(spec.template_tier, oc)
    _reset_prefix_cache(st, strategy)
    options = _cell_samplings(st, spec.template_tier, oc)
    sampling = next((x for x in options if x.name == spec.sampling), options[0])
    label = sampling.name
    users = spec.users if spec.users is not None else cell.users
    duration = args.duration if args.duration else cell.duration_s
    t0 = time.time() + (0.2 if args.workers <= 0 else 1.0)
    plan = CellPlan(
        run_id=st.run_id, strategy=strategy, model=args.model or strategy, tier=tier,
        output_class=oc, dataset=args.dataset, base_url=route_url(st.target, st.prefixes.get(strategy)),
        route=route_name(st.prefixes.get(strategy)),
        fallback_url=route_url(st.target, st.fallbacks[strategy]) if strategy in st.fallbacks else "",
        arrival=cell.arrival,
        users=users, rate_rps=cell.rate_rps, start_ts=t0, deadline_ts=t0 + duration,
        prompts=[[p.prompt_id, p.text, p.max_tokens] for p in st.prompts],
        categories={p.prompt_id: p.category for p in st.prompts if p.category},
        max_tokens=cell.max_tokens.model_dump(), seed=profile.seed,
        sampling=sampling.model_dump(), extra_body=dict(profile.extra_body),
        sampling_label=label, ignore_eos=cell.ignore_eos, min_tokens=cell.min_tokens,
        request_timeout_s=profile.request_timeout_s, repeat=spec.repeat,
        cell_id=f"{strategy}/{tier}/{oc}/{label}/{users}/{spec.repeat}/{uuid.uuid4().hex[:6]}",
        headers=st.auth.headers, insecure=st.auth.insecure,
        max_retries=args.retry, retry_backoff_s=args.retry_backoff_s)
    rep = f" r{spec.repeat}" if args.repeats > 1 or spec.repeat else ""
    sweep_users = f" u{users}" if args.sweep else ""
    samp = "" if label == M.GREEDY else f"/{label}"
    progress.new_cell(f"{strategy} {tier}/{oc}{samp}{sweep_users}{rep}", plan)
    cell_t0 = st.server.begin_cell() if st.server is not None else time.time()
    # rows go to the writer process as they complete (cells/NNN-...parquet, a row group a second);
    # no Arrow conversion in this gevent loop, which would delay in-flight chunks' timestamps
    st.cell_no += 1
    st.writer.start_cell(f"{st.cell_no:03d}-{strategy}-{tier}-{oc}{'' if label == M.GREEDY else '-' + label}"
                         f"-u{users}-r{spec.repeat}")
    try:
        cell_run = runner.run_cell(plan, cell.spawn_rate, profile.drain_timeout_s, progress.tick)
    finally:
        st.writer.end_cell()
        _record_losses(st, runner)
    server = st.server.end_cell(strategy, cell_t0, cell_run.rows) if st.server is not None else None
    st.cell_windows.append({"strategy": strategy, "tier": tier, "output_class": oc, "users": users,
                            "repeat": spec.repeat, "sampling": label, "t0": cell_t0, "t1": time.time()})
    if args.budget_s > 0 and not args.sweep:   # racing decides on these rows (loadgen.cli.race)
        from loadgen.cli.race import cell_key

        st.race_rows.extend(cell_run.rows)
        key = cell_key(cell_run.rows, spec)
        st.race_cells.setdefault(key, {}).setdefault(strategy, spec)
        st.cell_seconds.setdefault((key, strategy), []).append(time.time() - cell_t0)
    s = summarize_cell(cell_run.rows, strategy=strategy, tier=tier, output_class=oc,
                       arrival=cell.arrival, users=users, rate_rps=cell.rate_rps,
                       slo=cell.slo, window=cell_run.window, cpu_samples=cell_run.cpu_samples)
    s.repeat = spec.repeat
    s.sampling = label
    forced = (st.variants.get(strategy) or {}).get("synthetic_acceptance_length")
    if forced is not None:
        s.synthetic_acceptance_length = float(forced)
    if server is not None:
        s.server_metrics = server
        if server.get("unattributed_drafts") and not server.get("requests_without_stats"):
            s.warnings.append(f"the server counted {server['unattributed_drafts']} drafts more than this "
                              "cell's requests report: other traffic reached the engine during the cell "
                              "(its counters cannot tell it apart)")
        elif server.get("unattributed_drafts"):
            s.warnings.append(f"the server counted {server['unattributed_drafts']} drafts more than this "
                              f"cell's requests report; {server['requests_without_stats']} request(s) ended "
                              "without stats (cancelled at the cell's end or failed) and drafted too, so "
                              "other traffic cannot be told from them")
        if server.get("counter_resets"):
            s.warnings.append(f"{server['counter_resets']} server counter reset(s) during the cell (a "
                              "restart?): counted from 0 after each")
    for loss in runner.worker_losses:
        if loss["cell_id"] == plan.cell_id:
            s.warnings.append(f"load worker {loss['worker_index']} lost: its {loss['in_flight_at_last_report']} "
                              f"in-flight request(s) have no row ({loss['rows_delivered']} rows it sent are "
                              "kept); the cell finished on the other workers")
    s.workers = cell_run.workers   # per Locust worker: node, CPU %, achieved users, rows
    if plan.route == M.ROUTE_DIRECT:
        moved = sum(1 for r in cell_run.rows if r.get(M.REQ_ROUTE) == M.ROUTE_STRATEGY)
        if moved:
            s.warnings.append(f"{moved} request(s) went by the Serve proxy's route: the replica's own listener "
                              "refused or dropped connections (replaced or gone)"
                              f"{_relisten(st, strategy, moved)}")
    st.summaries.append(s)
    add_speedups(st.summaries)
    progress.done(s)
    for w in s.warnings:
        st.console.print(f"[yellow]warning[/] {strategy}/{tier}/{oc}{samp}: {w}", highlight=False)
    return s, cell_t0


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
    if not _reachable(new, st.auth):
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


def _reachable(prefix: str | None, auth: Auth) -> bool:
    """A route prefix the load can take from here: any but a replica listener that does not
    answer ``/health`` (one on another node's loopback, or behind a firewall)."""
    return route_name(prefix) != ROUTE_DIRECT or service.answers(
        f"{prefix}/health", headers=auth.headers, insecure=auth.insecure)


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


def _fetch_steps(st: _RunState, strategy: str, since: float) -> None:
    """Append the target's step rows of ``strategy`` (served name) newer than ``since``. A
    step log that fails to answer is a warning and a manifest entry (``step_log_errors``),
    never a lost run."""
    try:
        rows = service.fetch_step_log(st.target, strategy, since, headers=st.auth.headers,
                                      insecure=st.auth.insecure)
    except service.StepLogError as err:
        st.console.print(f"[yellow]warning[/] step rows of {strategy} since {since:.3f} are "
                         f"missing: {err}", highlight=False, soft_wrap=True)
        st.manifest.setdefault("step_log_errors", []).append(
            {"strategy": strategy, "since": since, "error": str(err)[:500], "recovered": False})
        return
    for e in st.manifest.get("step_log_errors", []):   # this fetch covered a failed one's range
        if e.get("strategy") == strategy and since <= e.get("since", 0.0):
            e["recovered"] = True
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
    """The summary table, failures, the optional report and the results path; the exit code."""
    from loadgen.results.summary import legend, render_table

    console, summaries = st.console, st.summaries
    if summaries and not _print_cells(st):   # per cell run when the cell table cannot be built
        table, shown = render_table(summaries, max_width=console.width)
        console.print(table)
        console.print(f"Columns: {legend(shown)} Every column, p99s included: {st.run_dir / SUMMARY_CSV}",
                      highlight=False)
    console.print(f"requests: {st.writer.rows_written}, steps: {st.n_steps}, "
                  f"wall time {clock(time.time() - st.manifest['started_ts'])}", highlight=False)
    empty = [f"{s.strategy}/{s.tier}/{s.output_class}" for s in summaries if not s.n_ok]
    if empty:
        console.print(f"[red]no successful request[/] in {', '.join(empty)}; see the `error` "
                      f"column of {st.run_dir / 'requests.parquet'}", highlight=False)
    if st.args.report and st.writer.rows_written and len(empty) < len(summaries):
        _report(st.run_dir, console)
    print(f"results: {st.run_dir}", flush=True)
    if st.status == "interrupted":
        return EXIT_INTERRUPTED
    return EXIT_NO_SUCCESS if summaries and len(empty) == len(summaries) else 0


def _print_cells(st: _RunState) -> bool:
    """The run's cell table (repeats pooled, warm-up cut: the report's own numbers,
    ``analysis.report.build.prepare``); False when it cannot be built (no request written)."""
    from analysis.data.load import ResultsError, load_results
    from analysis.report.build import prepare
    from loadgen.results.summary import cell_legend, render_cell_table

    try:
        cells = prepare(load_results(st.run_dir))[-1]
    except (ResultsError, ValueError, KeyError) as err:
        st.console.print(f"[yellow]note[/] no cell table: {err}", highlight=False)
        return False
    table, shown = render_cell_table(cells, max_width=st.console.width)
    st.console.print(table)
    st.console.print(f"Columns: {cell_legend(shown)} Per cell run, p99s included: "
                     f"{st.run_dir / SUMMARY_CSV}", highlight=False, soft_wrap=True)
    return True


def _report(run_dir: Path, console: Any) -> None:
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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return run(args)

if __name__ == "__main__":
    sys.exit(main())
