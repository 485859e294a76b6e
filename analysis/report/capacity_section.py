"""The report's capacity-model section: step cost fit per strategy (r², residuals),
the backtest (fit on lower users levels, predict the highest) and the measured
crossover interval beside the predicted one. Every part is optional: a run with
no step log or a single users level gets an explanation instead of a table."""

from __future__ import annotations

import numpy as np

from analysis.model import backtest as bt_mod
from analysis.report import capacity_plots
from analysis.model import stepcost
from analysis.data.load import Results


def _clean(rows: list[dict]) -> list[dict]:
    return [{k: (None if isinstance(v, float) and np.isnan(v) else v) for k, v in r.items()}
            for r in rows]


STEP_MODEL_TEXT = (
    "step_model profiled: the engine profile (decode forward over batch rows x tokens "
    "per row x context, the drafter and prefill apart) interpolated, one scale per part "
    "fitted on the run's steps (verify_scale: the decode part's). step_model fitted: "
    "fitted per replica configuration on the whole step log, prefill and decode "
    "separated: verify_ms = floor + row_ms*B + token_ms*max(0, T - knee) + "
    "attn_ms*T*ctx/1000 (T = tokens the padded decode forward computes, ctx = KV "
    "tokens per row); prefill (step - draft - verify on steps with prefill) as a hinge "
    "in prompt tokens; draft_ms linear in B. r2_step = the whole step predicted from "
    "its own B, T, ctx and prefill tokens against the measured step_ms. r2_*_cpu: the same "
    "model on the engine thread's CPU time (cpu_ms), i.e. without waits for a core; "
    "cpu_share = CPU ms / wall ms (below 1: the replica waited on other processes).")
LOO_SUMMARY_TEXT = (
    "Per strategy x output class x metric: median and worst absolute error over the "
    "held-out levels; r2_holdout: the whole step predicted on the steps of each held-out "
    "level by the model fitted without them; r2_ceiling: what the step's own shape "
    "explains at most (every step predicted by the mean of its group of equal B and T, "
    "prefill tokens and context per row in log2 bins, in sample): the rest is "
    "step-to-step noise (on a shared CPU, waits for a core) no model of the step's "
    "shape can see.")


def _step_models(results: Results, out: dict) -> dict:
    """Step cost models per strategy: the engine profile beside the run calibrated on its
    step log (``analysis.model.profiled``), else fitted on the run's own levels
    (``analysis.model.stepcost``); says which in ``out["notes"]``."""
    from analysis.model import profiled

    profile, path = profiled.find_profile(results)
    if profile is not None:
        models = profiled.fit_step_models(bt_mod.steps_with_users(results.steps, results.requests),
                                          profile, results)
        out["notes"].append(f"step cost: engine profile {path} (the main job takes it "
                            "after its cells; python -m actors.profile), calibrated on this run's "
                            "step log")
    else:
        models = stepcost.fit_step_models(results.steps)
        if models:
            out["notes"].append("step cost: no engine profile beside the run (RUN_DIR/cost_curve.json, "
                                "python -m actors.profile on the engine's machine): fitted on the run's own users "
                                "levels; predictions beyond its batches are EXTRAPOLATED")
    return models


def _loo_tables(loo: dict) -> list[tuple[str, str, list[dict]]]:
    """The leave-one-level-out backtest's two tables (per level; summary with hold-out r²)."""
    ov = "; ".join(f"{m}: median {o['median_abs_error']:.1%}, worst {o['worst_abs_error']:.1%}"
                   for m, o in loo["overall"].items())
    return [(
        "Backtest, leave one users level out (every level)",
        f"Per users level of {loo['levels']}: the model fitted on the other levels "
        f"({'engine profile calibrated on their steps' if loo['profile'] else 'step cost fitted on their steps, extrapolated'}) "
        f"predicts it. {ov}. repeat_spread: half the range over the cell's repeats over "
        "their mean (the run's own noise on that figure).", _clean(loo["rows"])), (
        "Backtest summary (leave one level out) and the step model's hold-out r²",
        LOO_SUMMARY_TEXT,
        _clean([{**r, "r2_holdout": loo["r2_holdout"].get(r["strategy"]),
                 "r2_ceiling": loo.get("r2_ceiling", {}).get(r["strategy"])}
                for r in loo["summary"]]))]


def _ex_post_tables(loo: dict) -> list[tuple[str, str, list[dict]]]:
    """The machine's speed per cell and the leave-one-level-out ex-post summary
    (``analysis.model.machine_speed``); none without an engine profile."""
    post, ms = loo.get("ex_post"), loo.get("machine_speed")
    if not post or not ms:
        return []
    ov = "; ".join(f"{m}: median {o['median_abs_error']:.1%}, worst {o['worst_abs_error']:.1%}"
                   for m, o in post["overall"].items())
    return [(
        "Machine speed per cell",
        "The engine's decode-only steps in each cell against the engine profile of the same "
        "shapes (median of measured / profiled CPU ms): 1 = the machine as the profile saw it, "
        f"1.3 = 1.3x slower. Cells lie median {ms['median']:.1%}, worst {ms['worst']:.1%} from "
        f"their strategy's typical speed (worst: {ms['worst_cell']}). The model is calibrated at "
        "speed 1 and predicts at the strategy's typical speed (ex-ante, the figures above and "
        "the plan); this drift is what no forecast of this machine sees.",
        _clean(ms["cells"])), (
        "Backtest, leave one users level out, ex-post",
        "The same backtest with each held level predicted at its own measured machine speed: "
        f"the model's error with the machine's drift taken out. {ov}.",
        _clean([{**r, "r2_holdout": post["r2_holdout"].get(r["strategy"])}
                for r in post["summary"]]))]


def capacity_section(results: Results) -> dict:
    """{"tables": [(title, text, rows)], "step_models", "backtest" (or None),
    "notes": [str]}."""
    out: dict = {"tables": [], "step_models": {}, "backtest": None, "notes": []}
    models = out["step_models"] = _step_models(results, out)
    if models:
        out["tables"].append(("Step cost model (per strategy)", STEP_MODEL_TEXT,
                              _clean(stepcost.fit_table(models, results.steps).to_dict("records"))))
    try:
        bt = bt_mod.backtest(results)
    except ValueError as exc:
        out["notes"].append(f"backtest skipped: {exc}")
        return out
    out["backtest"] = bt
    out["tables"].append((
        "Backtest (fit on lower users levels, predict the highest)",
        f"Fit on users {bt['fit_levels']}, predicted users {bt['holdout_users']}; "
        f"median absolute error {bt['median_abs_error']:.1%}" if bt["median_abs_error"] is not None
        else "no prediction could be compared", bt["rows"]))
    if bt.get("loo"):
        out["tables"].extend(_loo_tables(bt["loo"]))
        out["tables"].extend(_ex_post_tables(bt["loo"]))
    lro = bt.get("lro")
    if lro and lro["summary"]:
        ov = "; ".join(f"{m}: median {o['median_abs_error']:.1%}, worst {o['worst_abs_error']:.1%}"
                       for m, o in lro["overall"].items())
        out["tables"].append((
            "Backtest, leave one repeat out (cells measured more than once)",
            f"Each repeat of a cell the run measured more than once (the racing repeats) is held "
            f"out and predicted by the model fitted on everything else: a new measurement at a "
            f"load the run measured. {ov}. At a measured load the model's error is the cells' own "
            "repeat-to-repeat noise: read it as the floor under the other backtests here.",
            _clean(lro["summary"])))
    out["tables"].append((
        "Crossover: measured interval vs predicted",
        "Measured: the users bracket [lo, hi] where the mean speedup first drops below 1 "
        "(point = log-linear interpolation). Predicted: where the backtest model (fitted on "
        "the levels below the highest) crosses 1.", _clean(bt["crossover"])))
    return out


def capacity_figures(section: dict) -> dict[str, bytes | None]:
    """{"step_residuals", "backtest_speedup_<class>"} PNG bytes (absent parts skipped)."""
    figs: dict[str, bytes | None] = {}
    if section.get("step_models"):
        figs["step_residuals"] = capacity_plots.residual_plot(section["step_models"])
    bt = section.get("backtest")
    if bt is not None:
        for oc in sorted(bt["cells"]["output_class"].unique()):
            figs[f"backtest_speedup_{oc}"] = capacity_plots.backtest_speedup(bt, oc)
    return figs
