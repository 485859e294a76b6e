"""``python -m analysis {report,plan,backtest,policy,surface}``.

Exit codes: 0 ok; 2 usage error or missing / empty results directory (the
message names the flag or the directory); 3 (``EXIT_DEGRADED``) when
``report --baseline`` flags a degradation.
"""

from __future__ import annotations

import argparse
import math
import sys

from analysis.data import cost_curve_file
from analysis.data.load import ResultsError
from configs.cli_args import (
    existing_file,
    existing_path,
    number,
    output_dir,
    output_file,
)

EXIT_USAGE = 2


DESCRIPTION = "Read a load run's results: the report, a replica plan, a backtest, a policy, a surface."
EPILOG = """examples:
  python -m analysis report results/RUN
  python -m analysis report results/ --merge --baseline results/OLD
  python -m analysis plan results/RUN --qps 50 --tier high --emit-serve-config plan.yaml
  python -m analysis plan results/RUN --qps 20 --tier low --gpu h100 --model-shape qwen3-8b
  python -m analysis backtest results/RUN --json backtest.json
  python -m analysis policy results/RUN --emit-serve-config policy.yaml

RUN is a directory python -m loadgen wrote (results/<run id>/). Exit codes: 0 ok; 2 bad
argument or missing / empty results directory; 3 report --baseline found a degradation."""


def _add_report(sub) -> None:
    """The ``report`` subcommand's arguments."""
    r = sub.add_parser("report", help="report.md, report.html and recommendation.json",
                       description="Write report.md, report.html and recommendation.json for a run.")
    r.add_argument("results_dir", help="a run directory (or, with --merge, a parent of several)")
    r.add_argument("--out", type=output_dir(), help="output directory (default: RESULTS_DIR/report, where "
                   "`python -m loadgen --report` writes too)")
    r.add_argument("--merge", action="store_true",
                   help="pool every run found under RESULTS_DIR into one report (listed in the output)")
    r.add_argument("--baseline", type=existing_path(), help="baseline results (run dir or parent) for the degradation check")
    r.add_argument("--slo-ttft-ms", type=number(gt=0), help="TTFT SLO, ms (all tiers)")
    r.add_argument("--slo-tpot-ms", type=number(gt=0), help="TPOT SLO, ms (all tiers)")
    r.add_argument("--warmup-s", type=number(ge=0), default=None,
                   help="exclude the first seconds of every cell (each repeat) as warm-up "
                        "(default: the run's loadgen --warmup-s, else 0)")


def _add_plan_model(q) -> None:
    """``plan``: the load, the SLOs and the step-cost model (numbers are checked after parsing,
    ``_plan_errors``, so every bad argument is reported at once)."""
    g = q.add_argument_group("load and SLOs")
    g.add_argument("--qps", help="target requests/s (required)")
    g.add_argument("--tier", help="tier whose traffic is planned (required)")
    g.add_argument("--slo-ttft-ms", help="TTFT SLO, ms (default: the tier's SLO in the run manifest)")
    g.add_argument("--slo-tpot-ms", help="TPOT SLO, ms (default: the tier's SLO in the run manifest)")
    g.add_argument("--attainment", default="0.9",
                   help="share of requests that must meet the SLOs (default 0.9)")
    g = q.add_argument_group("step cost on a GPU")
    g.add_argument("--gpu", choices=["h100", "h200"], help="model the step cost on this GPU")
    g.add_argument("--model-params",
                   help="target model parameters (e.g. 8e9); needed with --gpu")
    g.add_argument("--cost-curve", type=cost_curve_file.argtype,
                   help="measured step-cost curve: a committed name (data/cost_curves/NAME.json, "
                        "e.g. qwen3-0.6b-cpu) or a file (python -m bench.device_check / bench.engine_speedup "
                        "cost-curve grid, or {\"gpu\",\"model\",\"points\"}); adds each "
                        "strategy's speedup against concurrency and its crossover per k")
    g.add_argument("--overhead-ms", default="1.0", help="per-step overhead on the GPU, ms (default 1.0)")
    g.add_argument("--max-batch", default="1024",
                   help="largest batch (concurrent requests per replica) the GPU plan considers "
                        "(default 1024)")
    g.add_argument("--model-shape", help="with --gpu: the target's shape for the KV-cache memory cap: "
                   "a name (qwen3-0.6b, qwen3-4b, qwen3-8b, llama-3.1-8b) or a config.json / HF "
                   "model dir; also gives --model-params when that is absent")
    g.add_argument("--gpu-memory-utilization", default="0.9",
                   help="share of GPU memory weights + KV cache may use (default 0.9)")
    g.add_argument("--max-num-seqs", default=None, metavar="S",
                   help="requests a replica runs at once (vLLM's max_num_seqs; default: the "
                        "Serve config's): the plan's queue, and what --validate deploys")
    g.add_argument("--max-waiting", default=None, metavar="W",
                   help="requests a replica holds waiting before it answers 429 (default: the "
                        "Serve config's): the plan's queue, and what --validate deploys")
    g.add_argument("--acceptance-length", default=None, metavar="A",
                   help="plan for a drafter of this acceptance length (tokens per verify step, the "
                        "target's own counted; 1..k+1) with the measured step costs: goodput and "
                        "replicas per speculative strategy as if it accepted A; with --validate the "
                        "forced deployment (rejection_sample_method: synthetic) is run at A and "
                        "predicted vs measured printed")


def _add_plan_outputs(q) -> None:
    """``plan``: validation against a real deployment, JSON and the emitted Serve config."""
    g = q.add_argument_group("validate the plan (deploys and drives load)")
    g.add_argument("--validate", action="store_true",
                   help="deploy the planned replicas of the chosen strategy, drive Poisson arrivals at "
                        "--qps, report SLO attainment with N and N-1 replicas (analysis/campaigns/plan_validation.py)")
    g.add_argument("--strategy", default=None, help="with --validate: strategy to validate "
                   "(default: the feasible one needing the fewest replicas)")
    g.add_argument("--output", default=None, choices=("short", "long"),
                   help="with --validate: output class to validate (default: as --strategy)")
    g.add_argument("--validate-duration", default="60",
                   help="with --validate: seconds of offered load per replica count (default 60)")
    g.add_argument("--validate-warmup", default="5",
                   help="with --validate: seconds at the start left out of attainment (default 5)")
    g.add_argument("--validate-results", default=None, type=output_dir(),
                   help="with --validate: where the validation runs go (default RESULTS_DIR/validate)")
    g = q.add_argument_group("outputs")
    g.add_argument("--json", nargs="?", const="-", default=None, metavar="FILE", type=output_file(),
                   help="print the plan as JSON; with --validate, write the validation JSON to FILE")
    g.add_argument("--emit-serve-config", metavar="OUT.yaml", type=output_file(),
                   help="write a Serve config with the planned replicas and resources per strategy "
                        "(deploy: serve deploy OUT.yaml, or python -m cluster up --config OUT.yaml)")
    g.add_argument("--base-config", default=None, type=existing_file(),
                   help="Serve config the emitted one starts from (default configs/serve.yaml)")
    g.add_argument("--cluster-yaml", default=None, type=existing_file(),
                   help="cluster launcher YAML whose min/max_workers the plan is checked against "
                        "(default cluster/cluster.yaml)")


def _add_plan(sub) -> None:
    """The ``plan`` subcommand's arguments."""
    q = sub.add_parser("plan", help="replicas per strategy for a target load under SLOs",
                       description="Replicas per strategy for a target load (--qps, --tier) "
                                   "under the SLOs, from a run's measured step costs.")
    q.add_argument("results_dir", help="a run directory (or a parent of several) whose cells and "
                   "step log the plan is fitted on")
    _add_plan_model(q)
    _add_plan_outputs(q)


def _add_surface(sub) -> None:
    """The ``surface`` subcommand's arguments."""
    s = sub.add_parser("surface", help="speedup over forced acceptance length, k and users; the "
                       "break-even acceptance length (a run with loadgen --acceptance-length)",
                       description="Speedup over forced acceptance length, k and users, and the "
                                   "break-even acceptance length, from a run with synthetic "
                                   "deployments (python -m loadgen --acceptance-length).")
    s.add_argument("results_dir", help="a run directory with synthetic deployments (<strategy>[-k<K>]-al<A>)")
    s.add_argument("--out", type=output_dir(), default=None,
                   help="where surface.csv, break_even.csv, best_k.csv and surface.png go "
                        "(default RESULTS_DIR)")
    s.add_argument("--drafters", type=existing_path(), default=None, metavar="RUN",
                   help="another run whose real deployments (and prompt categories) are marked "
                        "against the break-even (default: this run's own)")
    s.add_argument("--confidence", type=number(gt=0.5, le=0.999), default=0.9,
                   help="central interval of the speedup and the acceptance lengths (default 0.9)")
    s.add_argument("--seed", type=number(int, ge=0), default=0, help="bootstrap seed (default 0)")


def _add_backtest(sub) -> None:
    """The ``backtest`` subcommand's arguments."""
    b = sub.add_parser("backtest", help="fit on the lower users levels, predict the highest",
                       description="Fit the step cost model on the lower users levels and "
                                   "predict the highest (or --holdout); predicted vs measured.")
    b.add_argument("results_dir", help="a run directory (or a parent of several)")
    b.add_argument("--json", dest="json_file", type=output_file(parent_must_exist=False), help="write the backtest as JSON to this file")
    b.add_argument("--holdout", type=number(int, ge=1), default=None,
                   help="users level to predict (default: the highest measured)")


def build_parser() -> argparse.ArgumentParser:
    """``python -m analysis``'s parser: one subparser per command, every argument with help."""
    p = argparse.ArgumentParser(prog="python -m analysis", description=DESCRIPTION, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND",
                           title="commands (python -m analysis COMMAND --help for its arguments)")
    _add_report(sub)
    _add_plan(sub)
    _add_surface(sub)
    _add_backtest(sub)
    from analysis.policy_cli import add_parser as add_policy_parser
    policy = add_policy_parser(sub)
    policy.description = policy.description or ("A load-adaptive speculation policy (k per "
                                                "running-batch band) from a run; --validate races "
                                                "it against each tier's best fixed strategy.")
    return p


def _print_table(title: str, rows: list[dict], columns: list[str]) -> None:
    from rich.console import Console
    from rich.table import Table

    from analysis.report.render import fmt
    table = Table(title=title)
    for c in columns:
        table.add_column(c)
    for row in rows:
        table.add_row(*(fmt(row.get(c)) for c in columns))
    Console(width=200).print(table)


def _report(args, parser) -> int:
    from pathlib import Path

    from analysis.data.load import find_run_dirs
    from analysis.decide.claims import claim_lines
    from analysis.decide.recommend import headline_lines, recommendation_rows
    from analysis.report.build import build_report, default_out_dir

    root = Path(args.results_dir)
    runs = find_run_dirs(root) if root.is_dir() else []
    if len(runs) > 1 and not args.merge:
        listed = "\n  ".join(str(r) for r in runs)
        parser.error(f"{root} holds {len(runs)} runs:\n  {listed}\npass one run directory, or "
                     "--merge to pool them all into one report")
    if len(runs) > 1:
        print(f"merging {len(runs)} runs:")
        for r in runs:
            print(f"  {r}")
    out = build_report(root, args.out or default_out_dir(root), args.baseline, args.slo_ttft_ms,
                       args.slo_tpot_ms, warmup_s=args.warmup_s)
    for flag in out.get("flags", []):
        print(f"WARNING: {flag}")
    print("recommendation per tier (highest goodput under the SLOs):")
    for line in headline_lines(out["recommendation"], (out.get("race") or {}).get("undecided_reason")):
        print(f"  {line}")
    for line in claim_lines(out.get("claims") or []):
        print(f"  {line}")
    _print_table("recommendation", recommendation_rows(out["recommendation"]),
                 ["tier", "output_class", "sampling", "users", "strategy", "k", "status",
                  "goodput_tok_s", "speedup", "runner_up", "margin", "confidence", "repeats", "time_s"])
    _print_table("crossover concurrency", out["crossover"],
                 ["strategy", "output_class", "sampling", "crossover_users", "status",
                  "predicted_crossover_users"])
    if out["degradation"] is not None:
        flagged = [r for r in out["degradation"] if r["flagged"]]
        _print_table("degradation vs baseline (flagged)", flagged,
                     ["strategy", "dataset", "tau_base", "tau_cur", "goodput_base",
                      "goodput_cur", "reason"])
        if not flagged:
            print("degradation check: nothing dropped by more than 10%")
    print(f"report: {out['paths']['html']}\nmarkdown: {out['paths']['md']}\n"
          f"recommendation: {out['paths']['json']}")
    return out["exit_code"]


def _number(errors: list[str], args, name: str, kind=float, positive: bool = True,
            upper: float | None = None):
    """Convert ``args.<name>`` in place; append a message naming the flag when it is bad."""
    flag = "--" + name.replace("_", "-")
    text = getattr(args, name)
    if text is None:
        return
    try:
        value = kind(float(text)) if kind is int and float(text).is_integer() else kind(text)
    except (TypeError, ValueError, OverflowError):
        errors.append(f"{flag} expects {'an integer' if kind is int else 'a number'}, got {text!r}")
        return
    if not math.isfinite(value):
        errors.append(f"{flag} must be a finite number, got {text!r}")
    elif positive and not value > 0:
        errors.append(f"{flag} must be > 0, got {text!r}")
    elif upper is not None and value > upper:
        errors.append(f"{flag} must be <= {upper:g}, got {text!r}")
    setattr(args, name, value)


def _plan_errors(args) -> list[str]:
    """Every argument error of ``plan`` at once (argparse alone stops at the first)."""
    errors: list[str] = []
    for name in ("qps", "tier"):
        if getattr(args, name) is None:
            errors.append(f"--{name} is required")
    for name in ("qps", "slo_ttft_ms", "slo_tpot_ms", "model_params", "attainment",
                 "validate_duration"):
        _number(errors, args, name, upper=1.0 if name == "attainment" else None)
    _number(errors, args, "gpu_memory_utilization", upper=1.0)
    _number(errors, args, "overhead_ms", positive=False)
    _number(errors, args, "validate_warmup", positive=False)
    _number(errors, args, "max_batch", kind=int)
    _number(errors, args, "max_num_seqs", kind=int)
    _number(errors, args, "max_waiting", kind=int, positive=False)
    if isinstance(args.max_waiting, int) and args.max_waiting < 0:
        errors.append(f"--max-waiting must be >= 0, got {args.max_waiting}")
    _number(errors, args, "acceptance_length")
    if isinstance(args.acceptance_length, float) and args.acceptance_length < 1:
        errors.append(f"--acceptance-length must be >= 1 (the target's own token counts), got "
                      f"{args.acceptance_length:g}")
    if args.gpu and args.model_params is None and args.cost_curve is None and args.model_shape is None:
        errors.append("--gpu needs --model-params (target parameters, e.g. 8e9), --model-shape "
                      "or --cost-curve")
    if args.model_shape is not None and not args.gpu:
        errors.append("--model-shape only applies with --gpu (the GPU whose memory holds the KV cache)")
    if args.model_params is not None and not args.gpu:
        errors.append("--model-params only applies with --gpu")
    return errors


def _plan_slos(args) -> None:
    """Fill --slo-ttft-ms / --slo-tpot-ms from the run manifest's SLO for --tier; say so."""
    import json
    from pathlib import Path

    from analysis.data.load import MANIFEST_FILE, find_run_dirs
    from analysis.data.slo import resolve_slos

    root = Path(args.results_dir)
    config: dict = {}
    for d in (find_run_dirs(root) if root.is_dir() else []):
        if (d / MANIFEST_FILE).is_file():
            config = json.loads((d / MANIFEST_FILE).read_text()).get("config") or {}
            if config.get("slo"):
                break
    slo = resolve_slos([args.tier], config, args.slo_ttft_ms, args.slo_tpot_ms)[args.tier]
    where = {"manifest": "from the run manifest", "default": "defaults (the manifest names none)",
             "flags": "from --slo-ttft-ms / --slo-tpot-ms"}.get(
        slo.source, f"{slo.source.replace('flags+', 'flag + ')}")
    if not args.json:
        print(f"SLO for tier {args.tier}: TTFT <= {slo.ttft_ms:g} ms, TPOT <= {slo.tpot_ms:g} ms "
              f"({where}; --slo-ttft-ms / --slo-tpot-ms override)")
    args.slo_ttft_ms, args.slo_tpot_ms, args.slo_source = slo.ttft_ms, slo.tpot_ms, slo.source


def _plan(args, parser) -> int:
    from analysis.decide.plan import plan
    errors = _plan_errors(args)
    if errors:
        parser.error("\n  ".join([f"{len(errors)} argument error(s):"] + errors))
    from analysis.data.load import check_results_dir
    check_results_dir(args.results_dir)   # a missing / empty RESULTS_DIR before any other line
    _plan_slos(args)
    try:
        out = plan(args.results_dir, args.qps, args.tier, args.slo_ttft_ms, args.slo_tpot_ms,
                   gpu=args.gpu, model_params=args.model_params, cost_curve=args.cost_curve,
                   attainment=args.attainment, overhead_ms=args.overhead_ms,
                   max_batch=args.max_batch, model_shape=args.model_shape,
                   gpu_memory_utilization=args.gpu_memory_utilization, slo_source=args.slo_source,
                   acceptance_length=args.acceptance_length, engine_limits=_limits(args))
    except ValueError as exc:
        if isinstance(exc, ResultsError):
            raise
        msg = str(exc)
        parser.error(f"--model-shape: {msg}" if "shape" in msg or "config" in msg else
                     f"--tier: {msg}" if "tier" in msg else msg)
    if args.validate:
        return _validate(args, out, parser)
    if args.json:
        from configs.jsonio import dumps
        if args.emit_serve_config:
            out["serve_config"] = _emit(args, out, parser)
        print(dumps(out, indent=2))
        return 0
    _print_plan(args, out)
    if args.emit_serve_config:
        _emit(args, out, parser)
    return 0


def _print_plan(args, out: dict) -> None:
    """The plan on the console: assumptions, the answer, the model's table, memory, the GPU
    plan and the crossover against concurrency (each where the plan has it)."""
    print("assumptions:")
    for a in out["assumptions"]:
        print(f"  - {a}")
    _print_table(f"answer for tier {args.tier} at {args.qps:g} req/s (per output class; "
                 "alternatives in the plan below)", out.get("answer") or [],
                 ["output_class", "strategy", "replicas", "predicted_attainment", "basis",
                  "step_model", "alternatives"])
    _print_table(f"plan (step cost model + queue): {args.qps:g} req/s, tier {args.tier}",
                 out["model"],
                 ["rank", "strategy", "output_class", "basis", "step_model",
                  "measured_goodput_tok_s", "measured_decision"]
                 + (["acceptance_length", "measured_acceptance_length"] if args.acceptance_length else [])
                 + ["capacity_rps", "saturation_rps", "replicas", "goodput_tok_s",
                    "predicted_attainment", "predicted_attainment_minus_one", "mean_in_system",
                    "measured_users_max", "tpot_ms", "ttft_ms_p50", "note"])
    if out.get("memory"):
        _print_table("KV-cache memory per replica", out["memory"],
                     ["strategy", "output_class", "context_tokens", "weight_bytes",
                      "kv_bytes_per_seq", "draft_weight_ratio", "draft_kv_ratio", "max_seqs"])
    if out["gpu_plan"] is not None:
        _print_table("GPU plan", out["gpu_plan"],
                     ["strategy", "output_class", "tau", "v", "users", "max_seqs_memory", "limit",
                      "tpot_ms", "ttft_ms", "capacity_rps", "tokens_per_s", "replicas", "note"])
    if out.get("crossover") is not None:
        from analysis.decide.crossover import format_rows
        print("speedup vs autoregressive against concurrency N on the curve's device "
              "(crossover: the first N below 1x after it wins):")
        for line in format_rows(out["crossover"]):
            print(line)


def _limits(args) -> dict:
    """The per-replica engine limits set by flags: {"max_num_seqs", "max_waiting"} (set ones)."""
    return {k: getattr(args, k) for k in ("max_num_seqs", "max_waiting")
            if getattr(args, k, None) is not None}


def _validate(args, out: dict, parser) -> int:
    """--validate: run the plan with N and N-1 replicas; print and (--json FILE) write it."""
    from pathlib import Path

    from analysis.campaigns.plan_validation import validate_plan
    from analysis.decide import validate as va
    from analysis.data.load import load_results
    from configs.jsonio import dumps, write_json
    from configs.tiers import Slo
    try:
        choice = va.choose(out["model"], args.strategy, args.output)
    except ValueError as exc:
        parser.error(f"--validate/--strategy: {exc}")
    results = load_results(args.results_dir)
    manifest = next((r.manifest for r in results.runs if r.manifest.get("profile")), None)
    res = validate_plan(
        choice, args.qps, args.tier, Slo(ttft_ms=args.slo_ttft_ms, tpot_ms=args.slo_tpot_ms,
                                         source=args.slo_source),
        args.attainment, va.run_max_tokens(manifest, args.tier, choice.output_class),
        Path(args.validate_results or Path(args.results_dir) / "validate"),
        duration_s=args.validate_duration, warmup_s=args.validate_warmup,
        acceptance_length=args.acceptance_length, engine_overrides=_limits(args))
    row = next(r for r in out["model"] if r["strategy"] == choice.strategy
               and r["output_class"] == choice.output_class)
    res["predicted"] = {"attainment": row["predicted_attainment"],
                        "attainment_minus_one": row["predicted_attainment_minus_one"],
                        "capacity_rps": row["capacity_rps"], "extrapolated": row["extrapolated"],
                        "goodput_tok_s": row.get("goodput_tok_s"),
                        "acceptance_length": row.get("acceptance_length")}
    def pct(v):
        return "not measured (deploy failed)" if v is None else f"{v:.1%}"
    verdict = {True: "HOLDS", False: "FAILS", None: "UNKNOWN"}[res["holds"]]
    tight = {True: "fails as it should", False: "still meets the target: the plan over-provisions",
             None: "no figure"}[res["tight"]]
    print(f"plan {verdict}: {res['strategy']} x {res['replicas']} at {res['qps']:g} req/s: SLO "
          f"attainment {pct(res['attainment'])} (target {res['slo_target']:.0%}); with "
          f"{res['replicas'] - 1}: {pct(res['attainment_minus_one'])} ({tight})")
    got = (res.get("goodput_tok_s") or {}).get(str(res["replicas"]))
    al = (res.get("measured_acceptance_length") or {}).get(str(res["replicas"]))
    pred = res["predicted"]
    print(f"predicted vs measured at {res['replicas']} replica(s): goodput "
          f"{_fmt(pred.get('goodput_tok_s'))} vs {_fmt(got)} tok/s; SLO attainment "
          f"{pct(pred['attainment'])} vs {pct(res['attainment'])}"
          + (f"; acceptance length set {args.acceptance_length:g}, measured {_fmt(al)}"
             if args.acceptance_length else ""))
    if args.json and args.json != "-":
        write_json(args.json, res)
        print(f"json: {args.json}")
    elif args.json == "-":
        print(dumps(res, indent=2))
    return 0


def _fmt(v) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.3g}"


def _emit(args, out: dict, parser) -> dict:
    """Write --emit-serve-config; returns {"path", "replicas", "cluster_fit"}."""
    from analysis.decide import serve_plan as sp
    base = args.base_config or sp.DEFAULT_BASE_CONFIG
    cluster_yaml = args.cluster_yaml or sp.DEFAULT_CLUSTER_YAML
    try:
        cfg = sp.emit_serve_config(out, base)
        fit = sp.cluster_fit(cfg, cluster_yaml)
    except (sp.ServePlanError, OSError) as exc:
        parser.error(f"--emit-serve-config: {exc}")
    path = sp.write_serve_config(cfg, args.emit_serve_config, out, fit)
    if not args.json:
        print(f"serve config: {path} (serve deploy {path} | python -m cluster up --config {path})")
        for row in fit:
            print(f"  node type {row['node_type']}: {row['nodes_needed']} nodes needed, bounds "
                  f"{row['min_workers']}..{row['max_workers']}"
                  + ("" if row["fits"] else f" -- DOES NOT FIT: raise max_workers in {cluster_yaml}"))
    return {"path": str(path), "replicas": sp.planned_replicas(out), "cluster_fit": fit}


def _surface(args, parser) -> int:
    """``python -m analysis surface RUN``: print the surface, break-even and best k; write
    them as CSV and the plot as PNG."""
    from pathlib import Path

    from analysis.data.load import load_results
    from analysis.decide import surface as sf
    from analysis.report.render import records
    from analysis.report.surface_section import surface_figure

    results = load_results(args.results_dir)
    drafters = load_results(args.drafters) if args.drafters else None
    t = sf.analyse_surface(results, confidence=args.confidence, seed=args.seed, drafters=drafters)
    if t["surface"].empty:
        parser.error(f"{args.results_dir}: no synthetic deployments (<strategy>[-k<K>]-al<A>); "
                     "measure them with python -m loadgen ... --acceptance-length A[,A...]")
    out = Path(args.out or args.results_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"surface": out / sf.SURFACE_FILE, "break_even": out / sf.BREAK_EVEN_FILE,
             "best_k": out / sf.BEST_K_FILE}
    for name, path in paths.items():
        t[name].to_csv(path, index=False)
    over = ", ".join(sorted(t["surface"]["interval_over"].unique()))
    _print_table(f"speedup vs autoregressive ({args.confidence:.0%} interval over {over})",
                 records(t["surface"]), ["base_strategy", "output_class", "sampling", "users", "k",
                                         sf.A, sf.A_MEASURED, "speedup", "speedup_lo", "speedup_hi",
                                         "interval_over", "n_requests"])
    _print_table("break-even acceptance length (speedup 1.0, linear interpolation)",
                 records(t["break_even"]), ["base_strategy", "output_class", "sampling", "users",
                                            "k", "break_even_acceptance_length", "break_even_lo",
                                            "break_even_hi", "verdict"])
    _print_table("best k per users and acceptance length", records(t["best_k"]),
                 ["base_strategy", "output_class", "sampling", "users", sf.A, "best_k", "speedup",
                  "ks_measured"])
    if not t["stand"].empty:
        _print_table("where each drafter stands (gap = measured - break-even)", records(t["stand"]),
                     ["strategy", "output_class", "sampling", "users", "k", "acceptance_length",
                      "speedup", "break_even_acceptance_length", "gap"])
    if not t["categories"].empty:
        _print_table(f"acceptance length per category ({args.confidence:.0%} interval over requests)",
                     records(t["categories"]), ["strategy", "k", "sampling", "category",
                                                "n_requests", "acceptance_length",
                                                "acceptance_length_lo", "acceptance_length_hi"])
    png = surface_figure(t)
    if png:
        (out / "surface.png").write_bytes(png)
        paths["plot"] = out / "surface.png"
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    """The subcommand's own parser (its errors then read ``python -m analysis NAME: error``)."""
    for action in parser._subparsers._group_actions:   # noqa: SLF001  (argparse keeps them here)
        if name in getattr(action, "choices", {}):
            return action.choices[name]
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "report":
            return _report(args, parser)
        if args.command == "backtest":
            from analysis.backtest_cli import run_backtest
            return run_backtest(args, parser, _print_table)
        if args.command == "surface":
            return _surface(args, _subparser(parser, "surface"))
        if args.command == "policy":
            from analysis.policy_cli import run_policy
            return run_policy(args, _subparser(parser, "policy"), _print_table)
        return _plan(args, parser)
    except ResultsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
