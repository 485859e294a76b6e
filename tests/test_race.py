"""Racing to a decision: the decision function on synthetic rows (analysis.decide.race), the
round plan and budget rule (loadgen.cli.race), the flags, and the loop against the fake
server (python -m loadgen --budget)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from analysis.decide import race
from analysis.decide.recommend import TIE, from_decision, headline_lines
from configs import metric_names as mn
from loadgen.run.sweep import CellSpec

REPO = Path(__file__).resolve().parent.parent


def _rows(strategy: str, tokens_per_s: float, n: int = 40, repeats: int = 1, noise: float = 0.0,
          seed: int = 0, tier: str = "low", oc: str = "short", drift=None, first_repeat: int = 0,
          good: bool = True) -> list[dict]:
    """Closed-loop rows of one user: 32-token requests back to back whose e2e is
    32 / tokens_per_s x (1 + noise x N(0, 1)) s; ``drift[r]`` scales repeat r's speed."""
    rng = np.random.default_rng(seed)
    out = []
    for r in range(first_repeat, first_repeat + repeats):
        speed = tokens_per_s * (1 + (drift[r] if drift else 0.0))
        t = 1000.0 * r + 10_000.0 * seed
        for i in range(n):
            e2e = max(0.01, 32 / speed * (1 + noise * rng.standard_normal()))
            out.append({mn.REQ_RUN_ID: "run", mn.REQ_STRATEGY: strategy, mn.REQ_TIER: tier,
                        mn.REQ_OUTPUT_CLASS: oc, mn.REQ_USERS: 1, mn.REQ_REPEAT: r,
                        mn.REQ_REQUEST_INDEX: i, mn.REQ_SCHEDULED_TS: t, mn.REQ_SENT_TS: t,
                        mn.REQ_END_TS: t + e2e, mn.REQ_E2E_MS: 1000 * e2e,
                        mn.REQ_OUTPUT_TOKENS: 32, "meets_slo": good})
            t += e2e
    return out


def _decide(rows, **kw):
    return race.decide_cell(pd.DataFrame(rows), **kw)


# --- the decision function -------------------------------------------------------------

def _cell(gp: dict, repeats: dict, sd: float = 0.0, seed: int = 0, t0: float = 0.0,
          step: float = 20.0, n: int = 20) -> list[dict]:
    """Rows of one cell whose replicates' speeds vary between cells: replicate r of strategy s
    runs at gp[s] x exp(sd x N(0, 1)) tokens/s; replicates of every strategy interleaved
    in time, ``step`` s apart (replicate index r of each strategy in turn)."""
    rng = np.random.default_rng(seed)
    rows, t = [], t0
    for r in range(max(repeats.values())):
        for s in gp:
            if r >= repeats[s]:
                continue
            speed = gp[s] * math.exp(sd * rng.standard_normal())
            rows += _rows(s, speed, n=n, first_repeat=r, seed=0)
            for x in rows[-n:]:   # move the replicate to its slot in time
                x[mn.REQ_SCHEDULED_TS] += t - 1000.0 * r
                x[mn.REQ_SENT_TS] += t - 1000.0 * r
                x[mn.REQ_END_TS] += t - 1000.0 * r
            t += step
    return rows


def test_clear_winner_with_two_replicates_each_is_decided_and_the_loser_dropped():
    d = _decide(_cell({"ngram": 100, "dflash2": 150}, {"ngram": 2, "dflash2": 2}, sd=0.03))
    assert d.status == race.DECIDED and d.leader == "dflash2" and d.contenders == ["dflash2"]
    assert d.dropped == {"ngram": 1} and d.rounds == 1
    assert d.confidence > 0.99 and d.repeats == {"ngram": 2, "dflash2": 2}
    lo, hi = d.relative_interval["ngram"]
    assert lo < -1 / 3 < hi < 0           # ngram / dflash2 - 1 = -33 %
    # 4 replicates - 2 strategies - 1 pass effect (the repeats are the passes: blocks)
    assert d.noise["df"] == 1 and 0 < d.noise["relative"] < 0.1
    assert d.goodput["dflash2"] == pytest.approx(150, rel=0.1)


def test_one_replicate_each_and_no_aa_is_undecided_and_says_why():
    """Requests inside one cell run say nothing about the cell-to-cell noise: with one
    replicate per strategy even a 2x gap over 40 steady requests is not decided."""
    d = _decide(_rows("ngram", 100, noise=0.01) + _rows("dflash2", 200, noise=0.01, seed=1))
    assert d.status == race.UNDECIDED and d.noise["sd_log"] is None
    assert "did not measure its cell-to-cell noise" in d.reason
    assert "did not measure" in from_decision(d)["note"]


def test_the_aa_measures_the_noise_that_decides_a_single_replicate_far_outside_it():
    quiet = _decide(_cell({"autoregressive": 100, "ngram": 300}, {"autoregressive": 2, "ngram": 1},
                          sd=0.01))
    assert quiet.status == race.DECIDED and quiet.leader == "ngram"
    # the same 3x gap with a noisy A/A (the baseline's second run 25 % slower): not decided
    rows = _cell({"autoregressive": 100, "ngram": 300}, {"autoregressive": 2, "ngram": 1}, sd=0.0)
    for x in rows:
        if x[mn.REQ_STRATEGY] == "autoregressive" and x[mn.REQ_REPEAT] == 1:
            x[mn.REQ_OUTPUT_TOKENS] = 24
    noisy = _decide(rows)
    assert noisy.status == race.UNDECIDED and noisy.noise["relative"] > 0.1
    assert noisy.needs_repeats is not None and "replicates per contender" in noisy.reason


def test_identical_twins_are_equivalent_once_the_interval_fits_the_margin():
    d = _decide(_cell({"autoregressive": 100, "twin": 100}, {"autoregressive": 8, "twin": 8}, sd=0.005))
    assert d.status == race.EQUIVALENT and sorted(d.equivalent) == ["autoregressive", "twin"]
    assert d.bootstrap["effective_margin"] == pytest.approx(0.03)   # the noise is under 3 %
    lo, hi = d.relative_interval[d.contenders[1]]
    assert -0.03 < lo < hi < 0.03


def test_the_equivalence_margin_widens_to_the_noise():
    d = _decide(_cell({"autoregressive": 100, "twin": 100}, {"autoregressive": 12, "twin": 12}, sd=0.08,
                      seed=3))
    assert d.bootstrap["effective_margin"] == pytest.approx(d.noise["relative"])
    assert d.bootstrap["effective_margin"] > 0.03


def test_drift_between_passes_cancels_out_of_the_comparison():
    """Each racing pass is a block: a machine 40 % faster in the second pass than the first
    moves both strategies alike and does not hide a 20 % gap."""
    rows = []
    for r, speed in enumerate((1.0, 1.4, 1.0, 1.4)):
        for s, gp in (("autoregressive", 100), ("ngram", 120)):
            rows += [{**x, mn.REQ_SCHEDULED_TS: x[mn.REQ_SCHEDULED_TS] + 100 * r,
                      mn.REQ_SENT_TS: x[mn.REQ_SENT_TS] + 100 * r, mn.REQ_END_TS: x[mn.REQ_END_TS] + 100 * r}
                     for x in _rows(s, gp * speed * (1.01 if r % 2 else 0.99), n=10, first_repeat=r)]
    looks = [1100.0 * r + 500 for r in range(4)]   # replicate r runs at ~1100 r s
    d = _decide(rows, looks=looks)
    assert d.status == race.DECIDED and d.leader == "ngram"
    # without racing looks the repeats are the passes (``--repeats K --interleave``): the same
    d = _decide(rows)
    assert d.status == race.DECIDED and d.leader == "ngram" and d.noise["relative"] < 0.05
    # repeats that are not passes (ngram's numbered backwards) leave the drift in the noise
    skew = [{**x, mn.REQ_REPEAT: 3 - x[mn.REQ_REPEAT]} if x[mn.REQ_STRATEGY] == "ngram" else x for x in rows]
    d = _decide(skew)
    assert d.status == race.UNDECIDED and d.noise["relative"] > 0.1


def test_aa_races_are_decided_at_most_one_minus_c_of_the_time():
    """The calibration of the whole rule (looks, spending, pooled noise): simulated A/A races of
    seven cells each, cell noise 10 % and a drifting machine, raced for up to 5 rounds."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("aa_sim", REPO / "tests" / "aa_sim.py")
    sim = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sim)
    cells = [d for seed in range(12) for d in sim.simulate(seed).values()]
    share = sum(d.status == race.DECIDED for d in cells) / len(cells)
    assert len(cells) == 84 and share <= 0.12
    gap = [d for seed in range(6) for d in sim.simulate(100 + seed, mu={"autoregressive": 0.0,
                                                                         "twin": 0.4}).values()]
    assert sum(d.status == race.DECIDED and d.leader == "twin" for d in gap) >= 0.8 * len(gap)
    assert not any(d.status == race.DECIDED and d.leader != "twin" for d in gap)


def test_drops_are_sticky_when_replayed():
    """Dropped at the first look, a strategy stays dropped even when later passes (where it
    did not run) would not separate it."""
    rows = _cell({"autoregressive": 100, "ngram": 300}, {"autoregressive": 2, "ngram": 1}, sd=0.01)
    rows += [{**x, mn.REQ_SCHEDULED_TS: x[mn.REQ_SCHEDULED_TS] + 500, mn.REQ_SENT_TS: x[mn.REQ_SENT_TS] + 500,
              mn.REQ_END_TS: x[mn.REQ_END_TS] + 500, mn.REQ_REPEAT: 1}
             for x in _rows("ngram", 310, n=20)]
    d = _decide(rows, looks=[100.0, 600.0])
    assert d.status == race.DECIDED and d.dropped == {"autoregressive": 1} and d.decided_at_repeat == 1


def test_race_status_pools_the_noise_over_cells_and_flags_bad_settings():
    """The A/A of one cell measures the noise that decides another cell with one replicate each."""
    short = _cell({"autoregressive": 100, "ngram": 300}, {"autoregressive": 2, "ngram": 1}, sd=0.01)
    long_ = _cell({"autoregressive": 100, "ngram": 300}, {"autoregressive": 1, "ngram": 1}, sd=0.01, seed=4)
    for x in long_:
        x[mn.REQ_OUTPUT_CLASS] = "long"
    out = race.race_status(pd.DataFrame(short + long_))
    assert set(out) == {("low", "short"), ("low", "long")}
    assert out[("low", "long")].status == race.DECIDED and out[("low", "long")].noise["source"] == "run"
    assert race.decide_cell(pd.DataFrame(long_)).status == race.UNDECIDED   # alone: no noise
    with pytest.raises(ValueError, match="confidence"):
        race.decide_cell(pd.DataFrame(short), confidence=1.0)
    with pytest.raises(ValueError, match="margin"):
        race.decide_cell(pd.DataFrame(short), margin=0)


def test_nothing_meets_the_slo():
    d = _decide(_rows("autoregressive", 100, good=False) + _rows("ngram", 150, good=False, seed=1))
    rec = from_decision(d)
    assert d.goodput == {"autoregressive": 0.0, "ngram": 0.0}
    assert rec["strategy"] == mn.AUTOREGRESSIVE and "no strategy met the SLOs" in rec["note"]


def test_headline_says_status_confidence_repeats_looks_noise_and_time():
    dec = _decide(_cell({"ngram": 100, "dflash2": 150}, {"ngram": 2, "dflash2": 2}, sd=0.03))
    eq = _decide(_cell({"dflash2": 100, "dspark": 100}, {"dflash2": 8, "dspark": 8}, sd=0.005))
    und = _decide(_rows("ngram", 100, n=8) + _rows("dflash", 112, n=8, seed=3))
    rec = {"low": {"short": {**from_decision(dec), "users": [1], "speedup": None},
                   "long": {**from_decision(eq), "users": [1], "speedup": None}},
           "high": {"short": {**from_decision(und), "users": [1], "speedup": None}}}
    lines = headline_lines(rec, undecided_reason="budget spent")
    assert lines[0].startswith("low / short: run dflash2; ") and "(decided, sure: confidence" in lines[0]
    assert "2 repeats, 1 look, noise +-" in lines[0]
    assert lines[1].startswith("low / long: run any of ") and "(equivalent within +-3%" in lines[1]
    assert {"dflash2", "dspark"} <= set(lines[1].split("(")[0].replace(",", " ").split())
    assert lines[2].startswith("high / short: run any of dflash, ngram (undecided, budget spent: ")
    assert "noise unmeasured" in lines[2]


# --- the round plan and the budget rule ---------------------------------------------------

def _spec(s, oc):
    return CellSpec(s, "low", "low", oc, None, 0)


def test_round_plan_mirrors_the_order_and_takes_each_strategys_next_repeat():
    from loadgen.cli.race import next_repeats, round_plan

    cells = {("low", "short"): {s: _spec(s, "short") for s in ("ngram", "dflash", "dspark")},
             ("low", "long"): {s: _spec(s, "long") for s in ("ngram", "dflash", "dspark")}}
    dec = {("low", "short"): race.Decision(race.UNDECIDED, "dspark", ["dspark", "dflash"], [], {"ngram": 1},
                                           0.8, {}, {}, {}, {}, {}, {}, 0.0, 1, None),
           ("low", "long"): race.Decision(race.UNDECIDED, "ngram", ["ngram", "dflash", "dspark"], [], {},
                                          0.7, {}, {}, {}, {}, {}, {}, 0.0, 1, None)}
    order = [("low", "short"), ("low", "long")]
    rows = [{mn.REQ_TIER: "low", mn.REQ_OUTPUT_CLASS: oc, mn.REQ_STRATEGY: s, mn.REQ_REPEAT: r}
            for oc in ("short", "long") for s in ("ngram", "dflash", "dspark") for r in range(1)]
    rows.append({mn.REQ_TIER: "low", mn.REQ_OUTPUT_CLASS: "long", mn.REQ_STRATEGY: "ngram", mn.REQ_REPEAT: 1})
    nexts = next_repeats(rows)
    back = [(k[1], s.strategy, s.repeat) for k, s in round_plan(order, dec, cells, nexts, forward=False)]
    assert back == [("short", "dspark", 1), ("short", "dflash", 1),
                    ("long", "dspark", 1), ("long", "dflash", 1), ("long", "ngram", 2)]
    fwd = [(k[1], s.strategy) for k, s in round_plan(order, dec, cells, nexts, forward=True)]
    assert fwd == [("short", "dflash"), ("short", "dspark"),
                   ("long", "ngram"), ("long", "dflash"), ("long", "dspark")]


def test_first_pass_is_cell_major_mirrored_with_the_aa_at_the_end():
    from loadgen.cli.race import aa_cells, first_pass

    got = [(c.tier, c.output_class, c.repeat, c.strategy)
           for c in first_pass(["a", "b"], ["low", "high"], ["short", "long"], 1)]
    assert got[:4] == [("low", "short", 0, "a"), ("low", "short", 0, "b"),
                       ("low", "long", 0, "a"), ("low", "long", 0, "b")]
    assert len(got) == 8 and got[-1] == ("high", "long", 0, "b")
    aa = [(c.repeat, c.strategy) for c in first_pass(["x", "autoregressive", "b"], ["low"], ["short"], 1,
                                                      aa=True)]
    assert aa == [(0, "x"), (0, "autoregressive"), (0, "b"), (1, "autoregressive")]
    two = [(c.repeat, c.strategy) for c in first_pass(["a", "b", "c"], ["low"], ["short"], 2, aa=True)]
    assert two == [(0, "a"), (0, "b"), (0, "c"), (1, "c"), (1, "b"), (1, "a")]   # ABBA: no extra
    assert (aa_cells(["a", "b"], 1, True), aa_cells(["a", "b"], 2, True), aa_cells(["a"], 1, True)) == (1, 0, 0)


def test_racer_stops_when_the_next_round_does_not_fit():
    from loadgen.cli.race import Racer

    now = {"t": 0.0}
    racer = Racer(budget_s=100.0, confidence=0.9, margin=0.03, first_pass_repeats=1, started_ts=0.0,
                  run_id="run", manifest_config={"slo": {"low": {"ttft_ms": 1e9, "tpot_ms": 1e9}}},
                  clock=lambda: now["t"])
    rows = _rows("ngram", 100, n=8, noise=0.6, seed=2) + _rows("dflash", 112, n=8, noise=0.6, seed=3)
    for r in rows:
        r.update({mn.REQ_STATUS: mn.STATUS_OK, mn.REQ_TTFT_MS: 1.0, mn.REQ_TPOT_MS: 1.0})
        r.pop("meets_slo")
    cells = {("low", "short"): {"ngram": _spec("ngram", "short"), "dflash": _spec("dflash", "short")}}
    seconds = {(("low", "short"), "ngram"): [30.0], (("low", "short"), "dflash"): [30.0]}
    said = []
    now["t"] = 30.0
    plans = []
    for plan in racer.rounds(rows, cells, seconds, said.append):
        plans.append(plan)
        now["t"] += 60.0     # the round took as planned: 2 x 30 s
    # after the first pass at 30 s: round 1 (60 s) fits in the 70 s left; round 2 would end at 150
    assert len(plans) == 1 and [s.repeat for _, s in plans[0]] == [1, 1]
    assert [s.strategy for _, s in plans[0]] == ["dflash", "ngram"]     # the mirror of the first pass
    assert racer.stopped.startswith("budget") and "budget spent" in said[-1]
    entry = racer.manifest_entry()
    assert entry["rounds"][0]["planned_s"] == 60.0 and entry["rounds"][0]["started_s"] == 30.0
    assert entry["decisions"]["low/short"]["status"] == race.UNDECIDED
    assert entry["looks"] == [30.0, 90.0] and said[0].startswith("noise: not measured yet")


# --- the flags -------------------------------------------------------------------------

@pytest.mark.parametrize("argv, flag", [
    (["--budget", "15x"], "--budget"), (["--budget=-1m"], "--budget"), (["--budget", "nan"], "--budget"),
    (["--confidence", "0.5"], "--confidence"), (["--confidence", "1"], "--confidence"),
    (["--equivalence-margin", "0"], "--equivalence-margin"),
    (["--equivalence-margin", "inf"], "--equivalence-margin"),
])
def test_bad_race_flags_exit_2_naming_the_flag(argv, flag, capsys):
    from loadgen.cli.args import parse_args

    with pytest.raises(SystemExit) as e:
        parse_args(["--tier", "low", *argv])
    assert e.value.code == 2 and flag in capsys.readouterr().err


def test_budget_values():
    from loadgen.cli.args import DEFAULT_BUDGET_S, parse_args

    assert parse_args(["--tier", "all"]).budget_s == DEFAULT_BUDGET_S      # the main job
    assert parse_args(["--tier", "low"]).budget_s == 0.0
    assert parse_args(["--tier", "low", "--budget", "15m"]).budget_s == 900.0
    assert parse_args(["--tier", "low", "--budget", "900s"]).budget_s == 900.0
    assert parse_args(["--tier", "low", "--budget", "1.5h"]).budget_s == 5400.0
    assert parse_args(["--tier", "all", "--budget", "0"]).budget_s == 0.0
    with pytest.raises(SystemExit):
        parse_args(["--sweep", "--budget", "5m"])


# --- the loop against the fake server ----------------------------------------------------

def _tiers(tmp_path: Path, duration_s: float = 1) -> Path:
    from tests.tiers_file import write_tiers

    cell = {"users": 2, "spawn_rate": 100, "duration_s": duration_s, "max_tokens": 8,
            "slo": {"ttft_ms": 5000, "tpot_ms": 1000}}
    return write_tiers(tmp_path, cell, drain_timeout_s=2)


def _loadgen(url: str, tmp_path: Path, *extra: str, timeout: float = 240) -> tuple[str, Path]:
    p = subprocess.run([sys.executable, "-m", "loadgen", "--tier", "low", "--output", "short",
                        "--target", url, "--tiers-file", str(_tiers(tmp_path)),
                        "--results", str(tmp_path / "res"), "--consistency", "0", *extra],
                       capture_output=True, text=True, timeout=timeout, cwd=REPO,
                       env={**__import__("os").environ, "COLUMNS": "120"})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p.stdout, Path(p.stdout.strip().splitlines()[-1].split("results: ", 1)[1])


def test_race_stops_at_once_when_the_first_pass_decides(tmp_path):
    from loadgen.tools import fake_server

    with fake_server.running("--ttft-ms", "10", "--gap-ms", "5", "--model-gap-ms", "ngram=60") as url:
        out, run = _loadgen(url, tmp_path, "--strategies", "ngram,dflash", "--budget", "5m")
    man = json.loads((run / "manifest.json").read_text())
    assert man["race"]["rounds"] == [] and man["race"]["stopped"].startswith("decided")
    assert man["race"]["decisions"]["low/short"]["status"] == race.DECIDED
    assert man["race"]["decisions"]["low/short"]["leader"] == "dflash"
    assert len(man["race"]["looks"]) == 1 and man["race"]["noise"]["df"] == 1
    df = pd.read_parquet(run / "requests.parquet")
    # the first pass: ngram, dflash, then ngram again (the A/A: no autoregressive here)
    first = df.groupby([mn.REQ_STRATEGY, mn.REQ_REPEAT])[mn.REQ_SCHEDULED_TS].min().sort_values()
    assert list(first.index) == [("ngram", 0), ("dflash", 0), ("ngram", 1)]
    assert "low/short: decided dflash (confidence" in out and "noise: one cell run's goodput varies" in out
    assert man["warmup"]["requests_per_strategy"] == 4 and set(man["warmup"]["seconds"]) == {"ngram", "dflash"}


def test_race_repeats_contenders_mirrored_drops_the_loser_and_keeps_the_budget(tmp_path):
    """ngram (12x slower) is dropped once the noise allows; dflash and dspark run at one speed
    with random delays, so the race repeats them, the order mirrored every round, until they
    are equivalent or the next round does not fit in the budget. The report and the console
    give the same decision."""
    from loadgen.tools import fake_server

    budget = 40.0   # the first pass (4 cell runs with the A/A, the warm-up) leaves rounds to run
    with fake_server.running("--ttft-ms", "10", "--gap-ms", "5", "--jitter-ms", "30",
                             "--model-gap-ms", "ngram=400") as url:
        out, run = _loadgen(url, tmp_path, "--strategies", "ngram,dflash,dspark",
                            "--budget", f"{budget:g}s", "--report")
    man = json.loads((run / "manifest.json").read_text())
    r = man["race"]
    assert r["budget_s"] == budget and r["confidence"] == 0.9
    assert len(r["rounds"]) >= 1 and len(r["looks"]) == len(r["rounds"]) + 1
    for i, rnd in enumerate(r["rounds"]):
        assert rnd["forward"] == (i % 2 == 1)                          # mirrored, then forward, ...
        assert rnd["started_s"] + rnd["planned_s"] <= budget          # the rule that started it
        names = [c["strategy"] for c in rnd["cells"] if c["strategy"] != "ngram"]
        assert names == (["dspark", "dflash"] if i % 2 == 0 else ["dflash", "dspark"])
    df = pd.read_parquet(run / "requests.parquet")
    first = df.groupby([mn.REQ_STRATEGY, mn.REQ_REPEAT])[mn.REQ_SCHEDULED_TS].min().sort_values()
    assert list(first.index[:4]) == [("ngram", 0), ("dflash", 0), ("dspark", 0), ("ngram", 1)]
    reps = df.groupby(mn.REQ_STRATEGY)[mn.REQ_REPEAT].agg(lambda s: sorted(set(s)))
    assert reps["dflash"] == reps["dspark"] == list(range(len(r["rounds"]) + 1))
    d = r["decisions"]["low/short"]
    assert "ngram" in d["dropped"] and "ngram" not in d["contenders"]
    assert sorted(d["contenders"]) == ["dflash", "dspark"] and d["looks"] == len(r["looks"])
    assert d["status"] in (race.UNDECIDED, race.EQUIVALENT)
    if d["status"] == race.UNDECIDED:
        assert r["stopped"].startswith("budget") and "[budget spent]" in out
    rec = json.loads((run / "report" / "recommendation.json").read_text())
    low = rec["low"]["short"]
    assert rec["schema_version"] == 4 and low["status"] == d["status"]
    assert low["confidence"] == pytest.approx(d["confidence"])
    assert low["repeats"] == len(r["rounds"]) + 1 and low["time_s"] == pytest.approx(d["time_s"])
    assert low["dropped"] == d["dropped"] and low["noise"]["df"] == d["noise"]["df"]


def test_an_aa_race_is_not_decided(tmp_path):
    """The same fake deployment under two names, raced for 20 s with random delays: at
    confidence 0.99 neither twin is dropped (the rule decides an A/A at most 1 % of the time
    over all its looks); the run measured its own noise (the A/A) and says so."""
    from loadgen.tools import fake_server

    with fake_server.running("--ttft-ms", "10", "--gap-ms", "5", "--jitter-ms", "20",
                             "--models", "autoregressive,twin") as url:
        out, run = _loadgen(url, tmp_path, "--strategies", "autoregressive,twin", "--budget", "20s",
                            "--confidence", "0.99")
    r = json.loads((run / "manifest.json").read_text())["race"]
    d = r["decisions"]["low/short"]
    assert d["status"] in (race.UNDECIDED, race.EQUIVALENT) and d["dropped"] == {}
    assert r["noise"]["df"] >= 1 and "low/short" in r["noise"]["aa"]
    assert d["repeats"]["autoregressive"] >= 2 and "noise: one cell run's goodput varies" in out


def test_the_margin_is_the_fitted_lead_and_never_contradicts_the_leader():
    """The A/A's two baseline replicates bracket the first pass (150 then 100: drift inside
    the pass); the raw paired means (the baseline's last replicate per pass) put ngram ahead
    ((120 + 128) / 2 = 124 vs (100 + 130) / 2 = 115), the fit over every replicate the
    baseline. The margin shown is the fit's lead, so the line never reads "autoregressive
    leads by -7%"."""
    from analysis.decide.recommend import from_decision

    def rep(g, repeat):
        return race.Replicate(np.array([g]), 1.0, 1, repeat)

    reps = {mn.AUTOREGRESSIVE: [rep(150, 0), rep(100, 0), rep(130, 1)],
            mn.NGRAM: [rep(120, 0), rep(128, 1)]}
    d = race.decide_replicates(reps, looks=None)
    assert d.leader == mn.AUTOREGRESSIVE
    r = from_decision(d)
    # least squares of ln(goodput) on [autoregressive, ngram, pass 1] (pass 0 the reference;
    # no looks: the repeats are the passes)
    x = np.array([[1, 0, 0], [1, 0, 0], [1, 0, 1], [0, 1, 0], [0, 1, 1]], dtype=float)
    beta = np.linalg.lstsq(x, np.log([150, 100, 130, 120, 128]), rcond=None)[0]
    expected = math.expm1(beta[0] - beta[1])
    assert r["margin"] == pytest.approx(expected, rel=1e-9) and r["margin"] > 0
    assert d.paired[mn.NGRAM][0] > d.paired[mn.NGRAM][1]   # the raw means alone disagree
