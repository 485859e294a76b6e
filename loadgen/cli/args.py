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


DESCRIPTION = "Run tier traffic against every strategy a target serves; write a run directory."
USAGE = "python -m loadgen (--tier T[,T] | --sweep) [options]"
# five real examples: tests/test_loadgen_help.py parses each with this parser
EXAMPLES = (
    ("the main job: local service, every tier, raced, with the report",
     "python -m loadgen --tier all --report"),
    ("show the plan (cells, routes, time) without sending a request",
     "python -m loadgen --tier all --dry-run"),
    ("two strategies, one tier, 3 repeats of 10 s cells",
     "python -m loadgen --tier low --strategies autoregressive,ngram --repeats 3 --duration 10"),
    ("your own OpenAI-compatible server (vLLM, SGLang), its key from $OPENAI_API_KEY",
     "python -m loadgen --target http://127.0.0.1:8100 --tier low --report"),
    ("concurrency sweep to the crossover, at most 16 users",
     "python -m loadgen --sweep --tier high --sweep-max-users 16"),
)
EPILOG = ("examples:\n" + "\n".join(f"  # {what}\n  {cmd}" for what, cmd in EXAMPLES)
          + "\n\nEvery flag in detail: docs/loadgen.md; the reference: docs/reference/cli.md.")


class FlagError(Exception):
    """A bad value found after parsing; ``flag`` is the option to fix."""

    def __init__(self, flag: str, message: str) -> None:
        super().__init__(f"{flag}: {message}")
        self.flag, self.message = flag, message


def _add_load_flags(ap: argparse.ArgumentParser) -> None:
    """What to load: tiers, output classes, strategies and their variants, prompts, sweep."""
    g = ap.add_argument_group("what to load")
    g.add_argument("--tier", default=None, metavar="T[,T]",
                   help="low, mid, high, a list (low,high) or all; required unless --sweep "
                        "(then the template tier, default high)")
    g.add_argument("--output", default="all", choices=OUTPUT_CLASSES + ("all",),
                   help="output classes: short or long max_tokens, or all (default)")
    g.add_argument("--strategies", default=None, metavar="A,B",
                   help="strategies to run (default: every one the target serves)")
    g.add_argument("--k", type=number_list(int, ge=1, le=64), default=None, metavar="K[,K]",
                   help="draft lengths: a deployment <strategy>-k<K> per k")
    g.add_argument("--top-k-candidates", type=number_list(int, ge=1, le=256), default=None,
                   metavar="C[,C]", help="dflash2's candidates per position: one deployment per count")
    g.add_argument("--acceptance-length", type=number_list(float, ge=1, le=65), default=None,
                   metavar="A[,A]", help="forced acceptance lengths: synthetic, never recommended")
    g.add_argument("--temperature", type=number_list(float, ge=0, le=2), default=None, metavar="T[,T]",
                   help="sampling temperatures, a cell each (default: the tier file's)")
    g.add_argument("--dataset", "--prompts", dest="dataset", default=DEFAULT_DATASET, metavar="NAME",
                   help="humaneval, docs, stdlib, mixed, FILE.jsonl or - (standard input)")
    g.add_argument("--max-prompt-chars", type=number(int, ge=1), default=None, metavar="N",
                   help="cut prompts at N characters (default: the profile's)")
    g.add_argument("--profile", default="", metavar="NAME",
                   help="tier profile (default: the tier file's default_profile)")
    g.add_argument("--tiers-file", default="", type=existing_file(), metavar="FILE",
                   help="tier definitions (default: the packaged configs/tiers.yaml)")
    g.add_argument("--sweep", action="store_true",
                   help="concurrency sweep: users grow until speedup falls below 1")
    g.add_argument("--sweep-start", type=number(int, ge=1), default=1, metavar="N",
                   help="first sweep users level (default 1)")
    g.add_argument("--sweep-factor", type=number(gt=1), default=2.0, metavar="F",
                   help="users growth per sweep level (default 2)")
    g.add_argument("--sweep-max-users", type=number(int, ge=1), default=64, metavar="N",
                   help="last sweep users level (default 64)")


def _add_target_flags(ap: argparse.ArgumentParser) -> None:
    """Against what: the target URL or the local service, the route, load workers, metrics."""
    g = ap.add_argument_group("against what target")
    g.add_argument("--target", default="", metavar="URL",
                   help="an OpenAI-compatible server (default: the local service)")
    g.add_argument("--local-port", type=port(), default=8000, metavar="PORT",
                   help="without --target: the local service's port (default 8000)")
    g.add_argument("--local-config", default="", type=existing_file(), metavar="FILE",
                   help="without --target: its Serve config (default configs/serve.yaml)")
    g.add_argument("--model", default="", metavar="NAME",
                   help="'model' field of every request (default: the strategy's name)")
    g.add_argument("--route", default=ROUTE_AUTO,
                   choices=(ROUTE_AUTO, ROUTE_STRATEGY, ROUTE_MODEL_FIELD, ROUTE_DIRECT),
                   help="HTTP route of each strategy's load (docs/loadgen.md); default auto: "
                        "direct, else strategy, else model-field")
    g.add_argument("--workers", type=number(int, ge=0), default=0, metavar="N",
                   help="Locust workers as Ray actors (default 0: in this process)")
    g.add_argument("--worker-placement", default="spread", choices=("spread", "per-node", "pack"),
                   help="with --workers: their placement on the Ray nodes")
    g.add_argument("--ray-address", default="", metavar="ADDR",
                   help="with --workers: Ray cluster (default $RAY_ADDRESS)")
    g.add_argument("--server-metrics", default="auto", type=server_metrics_arg, metavar="auto|URL|off",
                   help="the target's Prometheus page, read during each cell")
    g.add_argument("--server-metrics-interval-s", type=number(ge=MIN_INTERVAL_S, le=MAX_INTERVAL_S),
                   default=DEFAULT_INTERVAL_S, metavar="S",
                   help=f"seconds between scrapes ({MIN_INTERVAL_S:g} to {MAX_INTERVAL_S:g}; "
                        f"default {DEFAULT_INTERVAL_S:g})")


def _add_time_flags(ap: argparse.ArgumentParser) -> None:
    """How long: cell duration, repeats, warm-up, order, racing to a decision."""
    g = ap.add_argument_group("how long, racing")
    g.add_argument("--duration", type=number(gt=0), default=None, metavar="S",
                   help="seconds per cell (default: the tier file's duration_s)")
    g.add_argument("--repeats", type=number(int, ge=1), default=1, metavar="K",
                   help="run each cell K times (request column repeat; default 1)")
    g.add_argument("--interleave", action="store_true",
                   help="cell-major order, odd repeats mirrored (ABBA)")
    g.add_argument("--budget", type=duration_s(allow=(BUDGET_AUTO,)), default=BUDGET_AUTO, metavar="T",
                   help="race to a decision within T (15m, 900s; 0 = off; default auto: "
                        f"{DEFAULT_BUDGET_S / 60:g}m for --tier all on the packaged tiers, else off)")
    g.add_argument("--confidence", type=number(gt=0.5, le=0.999), default=DEFAULT_CONFIDENCE, metavar="C",
                   help=f"racing: confidence to drop a strategy (default {DEFAULT_CONFIDENCE:g})")
    g.add_argument("--equivalence-margin", type=number(gt=0, le=0.5), default=DEFAULT_MARGIN,
                   metavar="F", help=f"racing: within +-F of the leader is equivalent (default {DEFAULT_MARGIN:g})")
    g.add_argument("--aa", action=argparse.BooleanOptionalAction, default=None,
                   help="the baseline twice per cell: the noise (default: when racing)")
    g.add_argument("--warmup-s", type=number(ge=0), default=None, metavar="S",
                   help=f"seconds cut from each cell's start (default 10%%, <= {WARMUP_CAP_S:g} s)")
    g.add_argument("--warmup-requests", type=number(int, ge=0), default=4, metavar="N",
                   help="unmeasured requests per strategy first (default 4)")
    g.add_argument("--reset-prefix-cache", action=argparse.BooleanOptionalAction, default=True,
                   help="POST /reset_prefix_cache before each cell: no cell reuses the prompts "
                        "an earlier one cached (vLLM: needs VLLM_SERVER_DEV_MODE=1; default on)")


def _add_results_flags(ap: argparse.ArgumentParser) -> None:
    """Where results go, and the checks and report that follow the cells."""
    g = ap.add_argument_group("where results go, checks after the cells")
    g.add_argument("--results", default="results", type=output_dir(), metavar="DIR",
                   help="results directory, a folder per run (default results)")
    g.add_argument("--run-id", default="", type=path_component(), metavar="ID",
                   help="the run's folder name (default <date>-<time>-<tier>-<random>)")
    g.add_argument("--report", action="store_true",
                   help="write the report into the run, print the recommendation")
    g.add_argument("--engine-profile", default="auto", choices=("auto", "off"),
                   help="after the cells, time the local engines' step cost into "
                        "RUN/cost_curve.json for the capacity model (auto: with the local "
                        "service; about 8 s per embedded strategy, 1-4 min per vLLM one)")
    g.add_argument("--dry-run", action="store_true",
                   help="print the plan (cells, routes, ETA); send and write nothing")
    g.add_argument("--consistency", type=number(int, ge=0), default=DEFAULT_SAMPLES, metavar="N",
                   help=f"greedy outputs compared with the baseline's (default {DEFAULT_SAMPLES})")
    g.add_argument("--consistency-sampled", type=number(int, ge=0), default=0, metavar="N",
                   help="also compare first-token distributions over N sampled requests")
    g.add_argument("--consistency-baseline", default=M.AUTOREGRESSIVE, metavar="NAME",
                   help="strategy the checks compare with (default autoregressive)")
    g.add_argument("--consistency-baseline-target", default="", metavar="URL",
                   help="serve that baseline from this server instead of --target")
    g.add_argument("--consistency-dtype", default="float32", choices=sorted(TIE_TOLERANCE), metavar="DTYPE",
                   help=f"{', '.join(sorted(TIE_TOLERANCE))}: the tie tolerance (default float32)")
    g.add_argument("--consistency-tie-tolerance", type=number(float, ge=0), default=None,
                   metavar="NATS", help="the tie tolerance itself (overrides --consistency-dtype)")


def _add_http_flags(ap: argparse.ArgumentParser) -> None:
    """Credentials and the HTTP settings of every request: key, headers, TLS, 429 retries."""
    g = ap.add_argument_group("credentials, HTTP")
    g.add_argument("--api-key", default=None, metavar="KEY",
                   help="bearer token (default $OPENAI_API_KEY); never written")
    g.add_argument("--header", action="append", default=[], metavar="'K: V'",
                   help="extra HTTP header, repeatable; values never written")
    g.add_argument("--insecure", action="store_true",
                   help="https: skip certificate verification")
    g.add_argument("--retry", type=number(int, ge=0), default=0, metavar="N",
                   help="re-send a request answered 429 up to N times (default 0)")
    g.add_argument("--retry-backoff-s", type=number(ge=0), default=0.5, metavar="S",
                   help="first retry delay, doubling (default 0.5)")


def build_parser() -> argparse.ArgumentParser:
    """The parser: five argument groups and an epilog of examples (``EXAMPLES``)."""
    ap = argparse.ArgumentParser(
        prog="python -m loadgen", usage=USAGE, description=DESCRIPTION, epilog=EPILOG,
        formatter_class=lambda prog: argparse.RawDescriptionHelpFormatter(prog, max_help_position=34))
    _add_load_flags(ap)
    _add_target_flags(ap)
    _add_time_flags(ap)
    _add_results_flags(ap)
    _add_http_flags(ap)
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

