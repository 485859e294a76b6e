"""``python -m analysis backtest RUN_DIR [--json FILE] [--holdout N]``: print the
prediction error table (fit below the holdout, predict it), the leave-one-level-out
table over every users level (``analysis.model.backtest.loo_backtest``) with the step
model's hold-out r², the leave-one-repeat-out summary over cells measured more than once
(``lro_backtest``), and the crossover (measured interval vs predicted)."""

from __future__ import annotations

from pathlib import Path

from analysis.model.backtest import backtest, to_json
from analysis.data.load import load_results
from configs.jsonio import write_json


def run_backtest(args, parser, print_table) -> int:
    """The CLI body; ``parser.error`` (exit 2) names RESULTS_DIR or --holdout on bad input.
    The run's warm-up is cut as the report cuts it (``analysis.report.build.prepare``), so the
    figures are the report's."""
    from analysis.report.build import prepare
    from analysis.data.load import ResultsError

    results = load_results(args.results_dir)
    try:
        results = prepare(results)[0]
    except ResultsError as exc:
        parser.error(f"RESULTS_DIR: {exc}")
    try:
        bt = backtest(results, args.holdout)
    except ValueError as exc:
        flag = "--holdout" if "holdout" in str(exc) else "RESULTS_DIR"
        parser.error(f"{flag}: {exc}")
    print_table(f"backtest: fit on users {bt['fit_levels']}, predict users {bt['holdout_users']}",
                bt["rows"], ["strategy", "output_class", "metric", "users", "predicted", "measured",
                             "abs_error"])
    print_table("step cost fit r² (whole step, fit levels)",
                [{"strategy": s, "r2": r} for s, r in bt["fit_r2"].items()], ["strategy", "r2"])
    print_table("crossover: measured interval vs predicted (model fitted below the holdout)",
                bt["crossover"], ["strategy", "output_class", "status", "lo", "hi", "point",
                                  "predicted", "levels"])
    _print_loo(bt.get("loo"), print_table)
    _print_lro(bt.get("lro"), print_table)
    mae = bt["median_abs_error"]
    print(f"median absolute error: {'-' if mae is None else f'{mae:.1%}'} over {len(bt['rows'])} "
          "predictions")
    if args.json_file:
        Path(args.json_file).parent.mkdir(parents=True, exist_ok=True)
        write_json(args.json_file, to_json(bt))
        print(f"json: {args.json_file}")
    return 0


def _print_ex_post(loo: dict, print_table) -> None:
    """The machine's speed per cell and the leave-one-level-out at each held cell's own
    measured speed (``analysis.model.machine_speed``); nothing without an engine profile."""
    post, ms = loo.get("ex_post"), loo.get("machine_speed")
    if not post or not ms:
        return
    print_table("machine speed per cell (the engine's decode steps against the profile of the "
                "same shapes; 1 = the profile's machine, 1.3 = 1.3x slower)", ms["cells"],
                ["strategy", "output_class", "users", "repeat", "speed", "steps"])
    print(f"machine speed: cells lie median {ms['median']:.1%}, worst {ms['worst']:.1%} from their "
          f"strategy's typical speed (worst: {ms['worst_cell']})")
    print_table("leave-one-level-out ex-post (each held cell predicted at its own measured "
                "machine speed)", post["summary"],
                ["strategy", "output_class", "metric", "median_abs_error", "worst_abs_error", "n"])
    for metric, o in post["overall"].items():
        print(f"leave-one-level-out ex-post {metric}: median absolute error "
              f"{o['median_abs_error']:.1%}, worst {o['worst_abs_error']:.1%} over {o['n']} predictions")
    print("step model r² on the held-out levels' steps, ex-post: " + ", ".join(
        f"{s} {r:.2f}" for s, r in post["r2_holdout"].items()))


def _print_lro(lro: dict | None, print_table) -> None:
    """The leave-one-repeat-out summary, ex-ante and ex-post; nothing without repeats."""
    if not lro:
        return
    print_table(f"leave-one-repeat-out over the {lro['held_cells']} cell repeats of cells "
                "measured more than once (the model fitted on everything else predicts the "
                "held repeat)", lro["summary"],
                ["strategy", "output_class", "metric", "median_abs_error", "worst_abs_error", "n"])
    for metric, o in lro["overall"].items():
        print(f"leave-one-repeat-out {metric}: median absolute error {o['median_abs_error']:.1%}, "
              f"worst {o['worst_abs_error']:.1%} over {o['n']} predictions")
    for metric, o in (lro.get("ex_post") or {}).get("overall", {}).items():
        print(f"leave-one-repeat-out ex-post {metric}: median absolute error "
              f"{o['median_abs_error']:.1%}, worst {o['worst_abs_error']:.1%} (at the held "
              "repeat's own machine speed)")


def _print_loo(loo: dict | None, print_table) -> None:
    """The leave-one-level-out tables, ex-ante then ex-post; nothing without it."""
    if not loo:
        return
    print_table(f"leave-one-level-out over users {loo['levels']} (step model: "
                f"{'engine profile ' + str(loo['profile']) if loo['profile'] else 'fitted on the other levels, extrapolated'})",
                loo["rows"], ["strategy", "output_class", "metric", "users", "predicted",
                              "measured", "abs_error", "repeat_spread", "model"])
    print_table("leave-one-level-out per strategy x output class", loo["summary"],
                ["strategy", "output_class", "metric", "median_abs_error", "worst_abs_error", "n"])
    print_table("step model r² on the held-out levels' steps (ceiling: what the step's "
                "own shape, B, T, prefill and context, explains at most, in sample)",
                [{"strategy": s, "r2_holdout": r, "r2_ceiling": loo["r2_ceiling"].get(s)}
                 for s, r in loo["r2_holdout"].items()],
                ["strategy", "r2_holdout", "r2_ceiling"])
    for metric, o in loo["overall"].items():
        print(f"leave-one-level-out {metric}: median absolute error {o['median_abs_error']:.1%}, "
              f"worst {o['worst_abs_error']:.1%} over {o['n']} predictions (ex-ante: at the "
              "strategy's typical machine speed)")
    _print_ex_post(loo, print_table)
