"""``python -m analysis policy RUN [--emit-serve-config OUT.yaml] [--validate] [--json FILE]``.

Derives a load-adaptive speculation policy from a run (``analysis.decide.policy``: one base
strategy, k per running batch size as vLLM's ``num_speculative_tokens_per_batch_size``, PR
#32374), prints its bands, writes the Serve config that deploys it, and with ``--validate``
runs it against the best fixed strategy at every tier of the run
(``analysis.campaigns.policy_validation``). Bad arguments exit 2 naming the flag.
"""

from __future__ import annotations

import argparse

from analysis.data.cost_curve_file import argtype as cost_curve_arg
from configs.cli_args import existing_file, number, output_dir, output_file

DEFAULT_VALIDATE_DURATION_S = 12.0


def add_parser(sub) -> argparse.ArgumentParser:
    """The ``policy`` subcommand's parser (flags checked by ``configs.cli_args`` types)."""
    p = sub.add_parser("policy", help="a load-adaptive policy: k per batch-size band, from a run")
    p.add_argument("results_dir", help="a run directory (requests + step log)")
    p.add_argument("--base-strategy", default=None,
                   help="base strategy of the policy (default: the one whose policy scores best)")
    p.add_argument("--output", default=None, choices=("short", "long"),
                   help="derive from this output class only (default: both)")
    p.add_argument("--slo-ttft-ms", type=number(gt=0), help="TTFT SLO, ms (default: the run's)")
    p.add_argument("--slo-tpot-ms", type=number(gt=0), help="TPOT SLO, ms (default: the run's)")
    p.add_argument("--boundaries", default="model", choices=("model", "midpoint"),
                   help="band boundaries between measured levels. model (default): where the "
                        "capacity model predicts the neighbours' chosen deployments cross in "
                        "tokens/s, else the midpoint; midpoint: always the midpoint of the "
                        "levels' typical running batch")
    p.add_argument("--seed", type=number(int, ge=0), default=0, help="bootstrap seed (default 0)")
    p.add_argument("--emit-serve-config", metavar="OUT.yaml", type=output_file(),
                   help="write a Serve config with one deployment, the policy "
                        "(num_speculative_tokens_per_batch_size)")
    p.add_argument("--base-config", default=None, type=existing_file(),
                   help="Serve config the emitted one starts from (default configs/serve.yaml)")
    p.add_argument("--backend", default=None, choices=("embedded", "vllm"),
                   help="engine the emitted / validated deployments run on: vllm takes the base "
                        "config's backend-vllm entry of each strategy (vllm-<strategy>; default "
                        "base config then configs/serve-vllm.yaml) and names the policy "
                        "vllm-<base>-policy; a run that served deployments on that engine gives "
                        "a policy from those only (k = 0 = its autoregressive, e.g. "
                        "vllm-autoregressive); default: every deployment, the entries as the "
                        "base config has them")
    p.add_argument("--cost-curve", type=cost_curve_arg, default=None, metavar="NAME_OR_PATH",
                   help="a measured step-cost curve (data/cost_curves/NAME.json or a file): add "
                        "each strategy's speedup against concurrency on that device and its "
                        "crossover per k, from this run's acceptance")
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="FILE", type=output_file(),
                   help="print the policy as JSON (or write it to FILE); with --validate, the "
                        "validation JSON")
    p.add_argument("--validate", action="store_true",
                   help="deploy the policy beside each tier's best fixed strategy on a private "
                        "Ray head, drive every tier of the run, compare tokens/s and SLO "
                        "attainment")
    p.add_argument("--validate-duration", type=number(gt=0), default=None,
                   help=f"with --validate: seconds per cell (default {DEFAULT_VALIDATE_DURATION_S:g})")
    p.add_argument("--validate-results", default=None, type=output_dir(),
                   help="with --validate: where the validation runs go (default "
                        "RESULTS_DIR/policy-validate)")
    return p


def _derive(args, parser, results, slos, base) -> dict:
    """``analysis.decide.policy.derive_policy`` with the CLI's arguments; a PolicyError exits 2
    naming the flag it is about (``--base-strategy``, ``--output``, ``--base-config``, else
    RESULTS_DIR). ``--backend vllm`` names the policy ``vllm-<base>-policy``."""
    from analysis.decide import policy as pol

    try:
        policy = pol.derive_policy(results, slos, base_strategy=args.base_strategy,
                                   output_class=args.output, base_config=base, seed=args.seed,
                                   predict=args.boundaries == "model", backend=args.backend)
    except pol.PolicyError as exc:
        msg = str(exc)
        flag = ("--base-strategy" if "base strategy" in msg else "--output" if "output class" in msg
                else "--backend" if "on backend" in msg
                else "--base-config" if str(base) in msg else "RESULTS_DIR")
        parser.error(f"{flag}: {msg}")
    if args.backend:
        policy["backend"] = args.backend
        if args.backend == "vllm" and not policy["name"].startswith("vllm-"):
            policy["name"] = f"vllm-{policy['name']}"
    return policy


def _print_policy(policy: dict, print_table) -> None:
    """The policy's map, its base strategy (with every base's score), notes and bands."""
    from analysis.decide import policy as pol

    b = policy["bases"][policy["base_strategy"]]
    print(f"policy: {policy['name']} = {policy['base_strategy']} with "
          f"num_speculative_tokens_per_batch_size {policy['map']}")
    print(f"base strategy: {policy['base_strategy']} ({policy['base_choice']}; score "
          + ", ".join(f"{s} {v['score']:.3f}" for s, v in policy["bases"].items())
          + f"; k per band {b['ks']})")
    for note in policy["notes"]:
        print(f"note: {note}")
    print_table("policy bands (goodput and k measured at each band's tier; boundaries "
                "midpoint or predicted)", pol.policy_rows(policy),
                ["batch", "k", "measured_as", "tiers", "users", "typical_batch",
                 "goodput_tok_s", "best_fixed", "upper_bound"])


def _add_crossover(args, policy: dict, results, quiet: bool) -> None:
    """``--cost-curve``: each strategy's speedup against concurrency on that device and its
    crossover per k (``policy["crossover"]``), printed unless ``quiet``."""
    from analysis.decide import crossover
    from analysis.decide.plan import load_curve

    ccurve, meta, path = load_curve(args.cost_curve)
    policy["crossover"] = {"curve": str(path), "assumption": crossover.describe(path, meta, ccurve),
                           "rows": crossover.crossover_rows(ccurve, results)}
    if not quiet:
        print(f"speedup vs autoregressive against concurrency N ({policy['crossover']['assumption']}):")
        for line in crossover.format_rows(policy["crossover"]["rows"]):
            print(line)


def _emit(args, parser, policy: dict, base, quiet: bool) -> None:
    """``--emit-serve-config``: write the Serve config deploying the policy; an error exits 2
    naming the flag."""
    from analysis.decide import policy as pol

    try:
        cfg = pol.emit_serve_config(policy, base)
    except (pol.PolicyError, ValueError, OSError) as exc:
        parser.error(f"--emit-serve-config: {exc}")
    path = pol.write_serve_config(cfg, args.emit_serve_config, policy)
    policy["serve_config"] = str(path)
    if not quiet:
        print(f"serve config: {path} (serve deploy {path} | python -m cluster up --config {path})")


def run_policy(args, parser, print_table) -> int:
    """The CLI body: derive, print, emit, validate. ``parser.error`` (exit 2) names the flag."""
    from analysis.data.load import load_results
    from analysis.data.slo import resolve_slos
    from analysis.decide import policy as pol
    from configs import metric_names as mn
    from configs.jsonio import dumps, write_json

    if not args.validate:
        for flag, value in (("--validate-duration", args.validate_duration),
                            ("--validate-results", args.validate_results)):
            if value is not None:
                parser.error(f"{flag} only applies with --validate")
    results = load_results(args.results_dir)
    tiers = sorted(results.requests[mn.REQ_TIER].unique())
    slos = resolve_slos(tiers, results.manifest_config, args.slo_ttft_ms, args.slo_tpot_ms)
    base = args.base_config or (pol.DEFAULT_VLLM_BASE_CONFIG if args.backend == "vllm"
                                else pol.DEFAULT_BASE_CONFIG)
    policy = _derive(args, parser, results, slos, base)
    quiet = args.json == "-"
    if not quiet:
        _print_policy(policy, print_table)
    if args.cost_curve:
        _add_crossover(args, policy, results, quiet)
    if args.emit_serve_config:
        _emit(args, parser, policy, base, quiet)
    if args.validate:
        return _validate(args, parser, policy, results, slos, base, print_table)
    if args.json:
        if args.json == "-":
            print(dumps(policy, indent=2))
        else:
            write_json(args.json, policy)
            print(f"json: {args.json}")
    return 0


def _validate(args, parser, policy, results, slos, base, print_table) -> int:
    from pathlib import Path

    from analysis.campaigns.policy_validation import validate_policy
    from analysis.decide import policy_validate as pv
    from analysis.decide.policy import PolicyError
    from configs.jsonio import dumps, write_json

    manifest = next((r.manifest for r in results.runs if r.manifest.get("profile")), None)
    out_dir = Path(args.validate_results or Path(args.results_dir) / "policy-validate")
    try:
        pv.level_plan(policy)
    except PolicyError as exc:
        parser.error(f"--validate: {exc}")
    res = validate_policy(policy, manifest, slos, out_dir,
                             duration_s=args.validate_duration or DEFAULT_VALIDATE_DURATION_S,
                             output=args.output or "all", base_config=base)
    res["derived"] = {"bands": [{k: b[k] for k in ("lo", "hi", "k", "strategy", "tiers", "users",
                                                     "batch", "boundary_source")}
                                for b in policy["bands"]], "bases": policy["bases"]}
    print_table(f"policy {policy['name']} {policy['map']} vs the best fixed strategy per tier "
                f"({res['duration_s']:g} s per cell)", pv.table_rows(res),
                ["tier", "output_class", "users", "band_k", "policy_tok_s", "policy_slo",
                 "policy_k_steps", "best_fixed", "fixed_tok_s", "fixed_slo", "tokens_ratio"])
    for where, err in res["errors"].items():
        print(f"no figure for {where}: {err[-300:]}")
    if args.json and args.json != "-":
        write_json(args.json, res)
        print(f"json: {args.json}")
    elif args.json == "-":
        print(dumps(res, indent=2))
    return 0 if res["rows"] else 1
