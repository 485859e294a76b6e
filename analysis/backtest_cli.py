"""``python -m analysis backtest RUN_DIR [--json FILE] [--holdout N]``: print the
prediction error table and the crossover (measured interval vs predicted)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from analysis.backtest import backtest, to_json
from analysis.load import load_results


def write_json_atomic(path: str | Path, obj) -> None:
    """Write ``obj`` as JSON via a temporary file and ``os.replace`` (no torn file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=float))
    os.replace(tmp, path)


def run_backtest(args, parser, print_table) -> int:
    """The CLI body; ``parser.error`` (exit 2) names RESULTS_DIR or --holdout on bad input."""
    results = load_results(args.results_dir)
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
    mae = bt["median_abs_error"]
    print(f"median absolute error: {'-' if mae is None else f'{mae:.1%}'} over {len(bt['rows'])} "
          "predictions")
    if args.json_file:
        write_json_atomic(args.json_file, to_json(bt))
        print(f"json: {args.json_file}")
    return 0
