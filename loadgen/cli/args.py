"""``python -m loadgen``'s command line: the parser, the checks that name a flag (exit 2),
and the arguments as the manifest records them (credentials redacted)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from configs import metric_names as M
from configs.cli_args import (duration_s, existing_file, number, number_list, output_dir,
                              path_component, port)
from configs.tiers import OUTPUT_CLASSES, TIER_NAMES
from analysis.data.consistency import TIE_TOLERANCE
from loadgen.cli.consistency import DEFAULT_SAMPLES
from loadgen.run.datasets import DEFAULT_DATASET
from loadgen.run.server_metrics import DEFAULT_INTERVAL_S, MAX_INTERVAL_S, MIN_INTERVAL_S, server_metrics_arg
from loadgen.run.sweep import sweep_levels
from loadgen.cli.target import (ROUTE_AUTO, ROUTE_DIRECT, ROUTE_MODEL_FIELD, ROUTE_STRATEGY,
                                parse_header)


BUDGET_AUTO = "auto"
# the main job's racing budget on the 2-core CPU box: its first pass (36 cells x ~12 s, more
# on a busy box) plus about as long again racing the undecided cells
DEFAULT_BUDGET_S = 16 * 60.0
DEFAULT_CONFIDENCE = 0.9     # analysis.decide.race.DEFAULT_CONFIDENCE
DEFAULT_MARGIN = 0.03        # analysis.decide.race.DEFAULT_MARGIN
WARMUP_SHARE, WARMUP_CAP_S = 0.1, 2.0   # default warm-up cut: 10% of the shortest cell, <= 2 s


def _add_cell_flags(ap: argparse.ArgumentParser) -> None:
    """Flags choosing the cells: tier, repeats, sweep, output class."""
    ap.add_argument("--tier", default=None, metavar="{low,mid,high,all}[,...]",
                    help="tier(s) to run: one, a comma-separated list (low,high) or all (required "
                         "unless --sweep; with --sweep: the one template tier whose duration, "
                         "max_tokens and SLOs the sweep cells use, default high)")
    ap.add_argument("--repeats", type=number(int, ge=1), default=1,
                    help="run each cell K times back to back (request column `repeat`, 0-based)")
    ap.add_argument("--interleave", action="store_true",
                    help="cell-major order: per tier, output class and repeat, every strategy in "
                         "turn, odd repeats mirrored (A r0, B r0, B r1, A r1: ABBA), so drift on a "
                         "shared box hits every strategy alike; for side-by-side runs with --repeats "
                         "(a raced run, --budget, always runs its first pass this way)")
    ap.add_argument("--budget", type=duration_s(allow=(BUDGET_AUTO,)), default=BUDGET_AUTO,
                    metavar="T",
                    help="racing to a decision: wall time for the whole run (first pass included), "
                         "e.g. 15m, 900s, 1h; after the first pass, repeat the contending strategies' "
                         "cells (interleaved) until each cell is decided or equivalent, or the next "
                         "round does not fit. 0 = off; default auto = "
                         f"{DEFAULT_BUDGET_S / 60:g}m for the main job (--tier all on the packaged "
                         "tiers file), else off")
    ap.add_argument("--confidence", type=number(gt=0.5, le=0.999), default=DEFAULT_CONFIDENCE,
                    help="racing: a strategy is dropped when the leader beats it in this share of "
                         "bootstrap replicates, and equivalence is judged on this central interval "
                         f"(default {DEFAULT_CONFIDENCE:g})")
    ap.add_argument("--aa", action=argparse.BooleanOptionalAction, default=None,
                    help="the run's A/A: the baseline (autoregressive) runs twice in every cell of "
                         "the first pass, at both ends of the cell's strategies, to measure this "
                         "box's cell-to-cell noise, which the decisions use (default: on when "
                         "racing, --budget; --no-aa: off)")
    ap.add_argument("--equivalence-margin", type=number(gt=0, le=0.5), default=DEFAULT_MARGIN,
                    metavar="FRACTION",
                    help="racing: contenders whose relative goodput difference to the leader lies "
                         "inside +-FRACTION (at --confidence) are equivalent: run any of them "
                         f"(default {DEFAULT_MARGIN:g} = {100 * DEFAULT_MARGIN:.0f}%%)")
    ap.add_argument("--sweep", action="store_true",
                    help="concurrency sweep: users grow geometrically per strategy until its speedup "
                         "vs autoregressive falls below 1 or it saturates (tier label `sweep`)")
    ap.add_argument("--sweep-start", type=number(int, ge=1), default=1, help="first sweep users level (default 1)")
    ap.add_argument("--sweep-factor", type=number(gt=1), default=2.0, help="users growth per level (default 2)")
    ap.add_argument("--sweep-max-users", type=number(int, ge=1), default=64, help="last sweep users level (default 64)")
    ap.add_argument("--output", default="all", choices=OUTPUT_CLASSES + ("all",))


def _add_target_flags(ap: argparse.ArgumentParser) -> None:
    """Flags naming the target: strategies, URL or local service, route, workers."""
    ap.add_argument("--strategies", default=None,
                    help="comma-separated; default: the target's /v1/models")
    ap.add_argument("--k", type=number_list(int, ge=1, le=64), default=None, metavar="K[,K...]",
                    help="draft lengths (num_speculative_tokens) to measure: every speculative strategy "
                         "runs once per k as its own deployment <strategy>-k<K> (local service: "
                         "deployed from the Serve config; --target: those names must be served). A "
                         "block drafter refuses k above its trained block_size - 1")
    ap.add_argument("--top-k-candidates", type=number_list(int, ge=1, le=256), default=None,
                    metavar="C[,C...]",
                    help="dflash2's candidates per position (strategy_options.top_k) to measure: one "
                         "deployment per count, <strategy>[-k<K>]-c<C>")
    ap.add_argument("--acceptance-length", type=number_list(float, ge=1, le=65), default=None,
                    metavar="A[,A...]",
                    help="forced acceptance lengths (tokens per verify step, the target's own token "
                         "counted; vLLM's synthetic_acceptance_length, in [1, k+1]): every speculative "
                         "strategy runs once per (k, A) as its own deployment <strategy>[-k<K>]-al<A> "
                         "beside autoregressive, drafter and verify real, only the accept decision set. "
                         "Synthetic: its text is not the target's, never recommended, no consistency "
                         "check; `python -m analysis surface RUN` reads the speedup surface")
    ap.add_argument("--temperature", type=number_list(float, ge=0, le=2), default=None,
                    metavar="T[,T...]",
                    help="sampling settings to run, overriding the tier file's (0 = greedy): each "
                         "temperature is its own cell (label greedy / t0.7), request seeds from the "
                         "profile's sampling seed")
    ap.add_argument("--target", default="", help="base URL of an OpenAI-compatible server; "
                                                 "default: start/reuse the local service")
    ap.add_argument("--local-port", type=port(), default=8000,
                    help="without --target: port of the local service to start or reuse (default 8000)")
    ap.add_argument("--local-config", default="", type=existing_file(),
                    help="without --target: Serve config the local service deploys "
                         "(default: the packaged configs/serve.yaml)")
    ap.add_argument("--model", default="", help="'model' field sent with every request (default: the strategy)")
    ap.add_argument("--route", default=ROUTE_AUTO,
                    choices=(ROUTE_AUTO, ROUTE_STRATEGY, ROUTE_MODEL_FIELD, ROUTE_DIRECT),
                    help="HTTP route of the load: direct = the strategy's one-hop route on its "
                         "replica's own listener, no Serve proxy in the path (Ray Serve's direct "
                         "ingress, on in `python -m cluster up` by default); strategy = each "
                         "strategy's own one-hop route through the Serve proxy "
                         "(<target>/strategies/<name>/v1/...; the strategy replica answers it without "
                         "a second Ray hop); model-field = <target>/v1/... with the model field "
                         "(through the ingress); auto (default) = per strategy direct when the target "
                         "lists one replica listener for it that answers from here (GET "
                         "/specload/routes), a user moving to its proxy route when the listener "
                         "refuses or drops its connection (a replaced replica), else strategy when listed, else "
                         "model-field. manifest.json routes records the choice per strategy, the "
                         "request rows' route column the route each request was answered on")
    ap.add_argument("--duration", type=number(gt=0), default=None, help="override every cell's duration_s, seconds")
    ap.add_argument("--workers", type=number(int, ge=0), default=0, help="Locust workers as Ray actors; 0 = in-process")
    ap.add_argument("--worker-placement", default="spread", choices=("spread", "per-node", "pack"),
                    help="with --workers: Ray SPREAD over the nodes (default), per-node (worker i on "
                         "node i mod nodes: --workers = number of nodes gives one per node), or pack")
    ap.add_argument("--ray-address", default="", help="with --workers: Ray cluster to place the workers on "
                    "('auto', host:port; default $RAY_ADDRESS, else a private local Ray instance)")


def _add_input_flags(ap: argparse.ArgumentParser) -> None:
    """Flags choosing the inputs and outputs: profile, dataset, results, run id."""
    ap.add_argument("--profile", default="", help="tier profile (default: the tier file's default_profile)")
    ap.add_argument("--dataset", "--prompts", dest="dataset", default=DEFAULT_DATASET,
                    help="humaneval|docs|stdlib|mixed, FILE.jsonl, or - for JSON lines on standard "
                         "input (kept as prompts.jsonl in the run directory)")
    ap.add_argument("--max-prompt-chars", type=number(int, ge=1), default=None, help="override the profile's prompt cut")
    ap.add_argument("--results", default="results", type=output_dir(), help="results directory (a run_id folder goes inside)")
    ap.add_argument("--tiers-file", default="", type=existing_file(), help="default configs/tiers.yaml")
    ap.add_argument("--run-id", default="", type=path_component(), help="default: <date>-<time>-<tier>-<random>")


def _add_http_flags(ap: argparse.ArgumentParser) -> None:
    """Flags of every HTTP request: credentials, headers, TLS, 429 retries."""
    ap.add_argument("--api-key", default=None,
                    help="sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY); never written "
                         "to the manifest or logs")
    ap.add_argument("--header", action="append", default=[], metavar="'K: V'",
                    help="extra HTTP header on every request, repeatable ('X-Team: a' or 'X-Team:a'); "
                         "values are never written to the manifest or logs")
    ap.add_argument("--insecure", action="store_true",
                    help="https targets: skip TLS certificate verification (off by default)")
    ap.add_argument("--retry", type=number(int, ge=0), default=0, metavar="N",
                    help="re-send a request answered 429 up to N times (exponential backoff from "
                         "--retry-backoff-s, never sooner than Retry-After); the row's `retries` column "
                         "counts re-sends; default 0: a 429 is recorded as `rejected` at once")
    ap.add_argument("--retry-backoff-s", type=number(ge=0), default=0.5, help="first retry delay, seconds (doubles)")


def _add_after_flags(ap: argparse.ArgumentParser) -> None:
    """Flags of what follows the cells: consistency checks, warm-up cut, report."""
    ap.add_argument("--consistency", type=number(int, ge=0), default=DEFAULT_SAMPLES, metavar="N",
                    help="after the cells, send N greedy requests (the run's first N prompts) to every "
                         "strategy and compare each output token by token with the baseline's; "
                         f"writes consistency.json (default {DEFAULT_SAMPLES}; 0 = off)")
    ap.add_argument("--consistency-sampled", type=number(int, ge=0), default=0, metavar="N",
                    help="also compare each strategy's first-token distributions with the baseline's "
                         "over N seeded sampled requests (chi-square; default 0 = off)")
    ap.add_argument("--consistency-baseline", default=M.AUTOREGRESSIVE,
                    help="strategy the consistency checks compare with (default autoregressive)")
    ap.add_argument("--consistency-baseline-target", default="", metavar="URL",
                    help="serve the baseline from this server instead of --target (e.g. "
                         "specload's fp32 engine as the baseline of a vLLM bf16 target)")
    ap.add_argument("--consistency-dtype", default="float32", choices=sorted(TIE_TOLERANCE),
                    help="compute dtype of the engines compared: sets the tolerance under "
                         "which a first divergence is a numerical tie, not a violation "
                         f"({', '.join(f'{k} {v:g}' for k, v in sorted(TIE_TOLERANCE.items()))} "
                         "nats of the baseline's logprob)")
    ap.add_argument("--consistency-tie-tolerance", type=number(float, ge=0), default=None,
                    metavar="NATS", help="the tie tolerance itself (overrides --consistency-dtype)")
    ap.add_argument("--warmup-s", type=number(ge=0), default=None,
                    help="seconds at the start of every cell excluded as warm-up by the racing "
                         "decisions and the report (stored in manifest.json; default: 10%% of the "
                         f"shortest cell, at most {WARMUP_CAP_S:g} s; 0 = keep everything)")
    ap.add_argument("--warmup-requests", type=number(int, ge=0), default=4, metavar="N",
                    help="before the first cell, warm each strategy with N unmeasured greedy "
                         "requests, half one at a time, half at once (default 4; 0 = off)")
    ap.add_argument("--reset-prefix-cache", action=argparse.BooleanOptionalAction, default=True,
                    help="POST /reset_prefix_cache before each cell: no cell reuses the prompts "
                         "an earlier one cached (vLLM: needs VLLM_SERVER_DEV_MODE=1; default on)")
    ap.add_argument("--server-metrics", default="auto", type=server_metrics_arg, metavar="auto|URL|off",
                    help="read the target's own Prometheus metrics while each cell runs (vLLM, SGLang, "
                         "specload's names: configs/metric_names.py): auto (default) = <target>/metrics "
                         "when it answers, URL = that page (it must answer), off = none. Per-cell "
                         "deltas go to manifest.json and summary.csv (server_*), the time series to "
                         "server_metrics.parquet")
    ap.add_argument("--server-metrics-interval-s", type=number(ge=MIN_INTERVAL_S, le=MAX_INTERVAL_S),
                    default=DEFAULT_INTERVAL_S,
                    help=f"seconds between scrapes ({MIN_INTERVAL_S:g} to {MAX_INTERVAL_S:g}, i.e. 1 to 4 Hz; "
                         f"default {DEFAULT_INTERVAL_S:g}); each cell also gets a scrape at its start and end")
    ap.add_argument("--report", action="store_true",
                    help="after the run, write the analysis report (python -m analysis report) "
                         "into the run directory and print the recommendation table")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m loadgen", description=__doc__.split("\n\n")[0])
    _add_cell_flags(ap)
    _add_target_flags(ap)
    _add_input_flags(ap)
    _add_http_flags(ap)
    _add_after_flags(ap)
    return ap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and check the command line; a bad value exits 2 with a message naming its flag."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.model and args.route in (ROUTE_DIRECT, ROUTE_STRATEGY):   # before any service starts
        parser.error(f"--route {args.route} and --model do not combine: a --model override names "
                     "the model on the model-field route (<target>/v1/...); drop --model or use "
                     "--route auto")
    if args.tier is None and not args.sweep:
        parser.error("--tier is required (low, mid, high or all), unless --sweep is given")
    if args.tier is not None:
        try:
            tier_list(args.tier)
        except ValueError as err:
            parser.error(str(err))
    if args.sweep:
        args.tier = args.tier or "high"
        if args.tier not in TIER_NAMES:
            parser.error("--tier with --sweep names one template tier (low, mid or high), "
                         f"not {args.tier!r}")
        try:
            sweep_levels(args.sweep_start, args.sweep_factor, args.sweep_max_users)
        except ValueError as err:
            parser.error(f"--sweep-start/--sweep-factor/--sweep-max-users: {err}")
    if args.strategies is not None:   # given: not empty, no name twice (a cell measured twice)
        names = [x.strip() for x in args.strategies.split(",")]
        if not any(names) or "" in names[:-1]:
            parser.error(f"--strategies: expected comma-separated strategy names, got "
                         f"{args.strategies!r} (omit the flag for every strategy the target serves)")
        names = [n for n in names if n]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            parser.error(f"--strategies: {', '.join(dup)} named twice; each strategy runs once per cell")
    else:
        args.strategies = ""
    if args.sweep and args.budget not in (BUDGET_AUTO, 0.0):
        parser.error("--budget: racing repeats the tier grid's cells; it does not combine with --sweep "
                     "(pass --budget 0 or drop --sweep)")
    args.budget_s = resolve_budget(args)
    if args.aa is None:
        args.aa = args.budget_s > 0 and not args.sweep
    # numbers, ports and paths are checked by their argparse types (configs.cli_args)
    if args.run_id and (Path(args.results) / args.run_id).exists():
        parser.error(f"--run-id: the run directory {Path(args.results) / args.run_id} exists already; "
                     "pick another --run-id (a run never overwrites another)")
    for h in args.header:
        try:
            parse_header(h)
        except ValueError as err:
            parser.error(str(err))
    return args


def tier_list(text: str) -> list[str]:
    """``--tier`` -> tier names in canonical order: ``all``, one name or ``low,high``.
    Raises ValueError naming ``--tier`` for an unknown name."""
    names = [t.strip() for t in str(text).split(",") if t.strip()]
    if "all" in names:
        return list(TIER_NAMES)
    bad = [t for t in names if t not in TIER_NAMES]
    if bad or not names:
        raise ValueError(f"--tier: {bad or text!r} not a tier; expected low, mid, high, all or a "
                         "comma-separated list such as low,high")
    return [t for t in TIER_NAMES if t in names]


def resolve_warmup(args: argparse.Namespace, profile: Any, tiers: list[str], outputs: list[str]) -> float:
    """The warm-up cut in seconds: ``--warmup-s`` as given, else WARMUP_SHARE of the shortest
    cell the run offers (``--duration`` or the tier file's), at most WARMUP_CAP_S."""
    if args.warmup_s is not None:
        return float(args.warmup_s)
    durations = [args.duration or profile.cell(t, oc).duration_s for t in tiers for oc in outputs]
    return round(min(WARMUP_CAP_S, WARMUP_SHARE * min(durations)), 3) if durations else 0.0


def resolve_budget(args: argparse.Namespace) -> float:
    """The racing budget in seconds (0 = no racing): ``--budget`` as given, or for ``auto``
    ``DEFAULT_BUDGET_S`` on the main job (``--tier all``, the packaged tiers file, no
    ``--sweep``) and 0 otherwise."""
    if args.budget != BUDGET_AUTO:
        return float(args.budget)
    main_job = args.tier == "all" and not args.sweep and not args.tiers_file
    return DEFAULT_BUDGET_S if main_job else 0.0


def check_local_strategy_names(args: argparse.Namespace) -> str | None:
    """Without ``--target``: every ``--strategies`` name must be one the local service deploys.

    Checked before anything starts, so a typo costs no service start-up. Returns
    the error message, or None.
    """
    if args.target or not args.strategies:
        return None
    from configs.serve_config import configured_strategy_names

    known = configured_strategy_names(args.local_config or None)
    asked = [s.strip() for s in args.strategies.split(",") if s.strip()]
    unknown = [s for s in asked if s not in known]
    if unknown:
        return (f"--strategies: {', '.join(map(repr, unknown))} not deployed by the local service "
                f"(configs/serve.yaml deploys {', '.join(known)})")
    return None


def manifest_args(args: argparse.Namespace) -> dict[str, Any]:
    """The CLI arguments as recorded in the manifest: credentials never in clear."""
    out = dict(vars(args))
    out["api_key"] = "<redacted>" if args.api_key else None
    out["header"] = [f"{k}: <redacted>" for k, _ in (parse_header(h) for h in args.header or [])]
    return out

