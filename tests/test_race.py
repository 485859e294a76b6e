"""Racing to a decision: the decision function on synthetic rows (analysis.decide.race), the
round plan and budget rule (loadgen.cli.race), the flags, and the loop against the fake
server (python -m loadgen --budget)."""

from __future__ import annotations

import json
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

def test_clear_winner_is_decided_and_the_loser_dropped():
    d = _decide(_rows("ngram", 100, noise=0.3) + _rows("dflash2", 150, noise=0.3, seed=1))
    assert d.status == race.DECIDED and d.leader == "dflash2" and d.contenders == ["dflash2"]
    assert d.dropped == {"ngram": 0} and d.confidence >= 0.9
    assert d.goodput["dflash2"] == pytest.approx(150, rel=0.1)
    assert d.goodput["ngram"] == pytest.approx(100, rel=0.1)
    lo, hi = d.relative_interval["ngram"]
    assert lo < -1 / 3 + 0.1 and hi < 0      # ngram is ~33% behind
    assert d.repeats == {"ngram": 1, "dflash2": 1} and d.bootstrap["over"] == "requests"
    # time: both cells' wall time (40 x 0.32 s + 40 x 0.213 s)
    assert d.time_s == pytest.approx(40 * 32 / 100 + 40 * 32 / 150, rel=0.1)


def test_two_identical_strategies_are_equivalent():
    a = _rows("dflash2", 120, noise=0.05)
    b = [{**r, mn.REQ_STRATEGY: "dspark"} for r in a]     # the very same requests
    d = _decide(a + b)
    assert d.status == race.EQUIVALENT and set(d.equivalent) == {"dflash2", "dspark"}
    assert d.dropped == {} and d.confidence >= 0.9
    lo, hi = d.relative_interval[d.equivalent[1]]
    assert -0.03 < lo <= 0 <= hi < 0.03
    rec = from_decision(d)
    assert rec["status"] == race.EQUIVALENT and rec["strategy"] == d.leader and rec["tied"] == []
    assert rec["equivalent"] == d.equivalent and "equivalent" in rec["note"]


def test_noisy_close_ones_undecided_with_few_requests_then_decided_with_repeats():
    # 12% apart, 8 requests per repeat with 20% noise: one repeat cannot tell them apart
    one = _decide(_rows("ngram", 100, n=8, noise=0.6, seed=2)
                  + _rows("dflash", 112, n=8, noise=0.6, seed=3), first_pass_repeats=1)
    assert one.status == race.UNDECIDED and one.contenders == ["dflash", "ngram"]
    assert 0.5 <= one.confidence < 0.9
    assert from_decision(one)["strategy"] == TIE
    many = _decide(_rows("ngram", 100, n=8, repeats=30, noise=0.6, seed=2)
                   + _rows("dflash", 112, n=8, repeats=30, noise=0.6, seed=3), first_pass_repeats=1)
    assert many.status == race.DECIDED and many.leader == "dflash"
    assert many.bootstrap["over"] == "repeats x requests"
    assert 0 < many.decided_at_repeat < 29 and many.dropped == {"ngram": many.decided_at_repeat}
    assert many.rounds == many.decided_at_repeat + 1     # replayed round by round, then stopped


def test_close_equal_ones_become_equivalent_with_repeats():
    kw = dict(n=8, noise=0.1)
    one = _decide(_rows("ngram", 100, seed=2, **kw) + _rows("dflash", 100, seed=3, **kw),
                  first_pass_repeats=1)
    assert one.status == race.UNDECIDED
    many = _decide(_rows("ngram", 100, repeats=60, seed=2, **kw)
                   + _rows("dflash", 100, repeats=60, seed=3, **kw), first_pass_repeats=1)
    assert many.status == race.EQUIVALENT and many.decided_at_repeat is not None
    assert all(-0.03 < v < 0.03 for v in many.relative_interval[many.equivalent[1]])


def test_two_level_bootstrap_sees_drift_between_repeats():
    """Repeats drifting +-10% in speed: the request-only view of the same rows would be sure;
    resampling repeats first widens the interval, so it stays undecided."""
    drift = [0.1, -0.1, 0.1, -0.1]
    rows = (_rows("ngram", 100, repeats=4, noise=0.02, drift=drift, seed=1)
            + _rows("dflash", 104, repeats=4, noise=0.02, drift=drift[::-1], seed=2))
    two = _decide(rows)
    assert two.bootstrap["over"] == "repeats x requests" and two.status == race.UNDECIDED
    pooled = _decide([{**r, mn.REQ_REPEAT: 0} for r in rows])   # one replicate per strategy
    lo2, hi2 = two.relative_interval["ngram"]
    assert (hi2 - lo2) > 3 * (lambda iv: iv[1] - iv[0])(pooled.relative_interval.get(
        "ngram", pooled.relative_interval.get("dflash", [0, 0])))


def test_drops_are_sticky_when_replayed():
    """A strategy dropped after the first pass has no more repeats; replaying the finished
    run's rows keeps it dropped, and the time counts every replicate."""
    rows = (_rows("ngram", 50, noise=0.2, seed=5)
            + _rows("dflash", 100, n=8, repeats=3, noise=0.3, seed=2)
            + _rows("dspark", 100, n=8, repeats=3, noise=0.3, seed=3))
    d = _decide(rows, first_pass_repeats=1)
    assert d.dropped.get("ngram") == 0 and d.repeats == {"ngram": 1, "dflash": 3, "dspark": 3}
    assert "ngram" not in d.contenders and d.rounds == 3


def test_runner_up_margin_over_the_repeats_both_ran():
    """The box slows down after the first pass: ngram, dropped then, keeps its fast repeat-0
    mean (150 tokens/s); the leader's mean over its 4 repeats (200 then 3 x 100) is 125. The
    margin is taken over repeat 0, which both ran: 200 vs 150, +33%, not -17%."""
    rows = (_rows("dflash", 200, n=20, noise=0.02, seed=1)
            + _rows("dflash", 100, n=20, repeats=3, noise=0.02, seed=2, first_repeat=1)
            + _rows("ngram", 150, n=20, noise=0.02, seed=5))
    d = _decide(rows, first_pass_repeats=1)
    assert d.dropped == {"ngram": 0} and d.leader == "dflash"
    assert d.goodput["ngram"] > d.goodput["dflash"]
    assert d.paired["ngram"] == [pytest.approx(150, rel=0.03), pytest.approx(200, rel=0.03), 1]
    rec = from_decision(d)
    assert rec["runner_up"] == "ngram" and rec["margin"] == pytest.approx(200 / 150 - 1, rel=0.05)


def test_race_status_groups_by_cell_key_and_flags_bad_settings():
    rows = _rows("a", 100, oc="short") + _rows("b", 200, oc="short", seed=1) \
        + _rows("a", 100, oc="long", seed=2) + [
            {**r, mn.REQ_STRATEGY: "b"} for r in _rows("a", 100, oc="long", seed=2)]
    out = race.race_status(pd.DataFrame(rows))
    assert set(out) == {("low", "short"), ("low", "long")}
    assert out[("low", "short")].status == race.DECIDED
    assert out[("low", "long")].status == race.EQUIVALENT
    with pytest.raises(ValueError, match="confidence"):
        race.decide_cell(pd.DataFrame(rows), confidence=1.0)
    with pytest.raises(ValueError, match="margin"):
        race.decide_cell(pd.DataFrame(rows), margin=0)


def test_nothing_meets_the_slo():
    d = _decide(_rows("autoregressive", 100, good=False) + _rows("ngram", 150, good=False, seed=1))
    rec = from_decision(d)
    assert d.goodput == {"autoregressive": 0.0, "ngram": 0.0}
    assert rec["strategy"] == mn.AUTOREGRESSIVE and "no strategy met the SLOs" in rec["note"]


def test_headline_says_status_confidence_repeats_and_time():
    dec = _decide(_rows("ngram", 100, noise=0.3) + _rows("dflash2", 150, noise=0.3, seed=1))
    eq_rows = _rows("dflash2", 120, noise=0.05, oc="long")
    eq = _decide(eq_rows + [{**r, mn.REQ_STRATEGY: "dspark"} for r in eq_rows])
    und = _decide(_rows("ngram", 100, n=8, noise=0.6, seed=2, oc="short", tier="high")
                  + _rows("dflash", 112, n=8, noise=0.6, seed=3, oc="short", tier="high"))
    rec = {"low": {"short": {**from_decision(dec), "users": [1], "speedup": None},
                   "long": {**from_decision(eq), "users": [1], "speedup": None}},
           "high": {"short": {**from_decision(und), "users": [1], "speedup": None}}}
    for r in (rec["low"]["short"], rec["low"]["long"], rec["high"]["short"]):
        r["bootstrap"] = {"confidence": 0.9, "equivalence_margin": 0.03}
    lines = headline_lines(rec, undecided_reason="budget spent")
    assert lines[0].startswith("low / short: run dflash2; ") and "(decided, sure: confidence" in lines[0]
    assert "1 repeat, 0:" in lines[0]
    assert lines[1].startswith("low / long: run any of dflash2, dspark (equivalent within +-3%")
    assert lines[2].startswith("high / short: run any of dflash, ngram (undecided, budget spent: ")


# --- the round plan and the budget rule ---------------------------------------------------

def _spec(s, oc):
    return CellSpec(s, "low", "low", oc, None, 0)


def test_round_plan_interleaves_contenders_and_rotates():
    from loadgen.cli.race import round_plan

    cells = {("low", "short"): {s: _spec(s, "short") for s in ("ngram", "dflash", "dspark")},
             ("low", "long"): {s: _spec(s, "long") for s in ("ngram", "dflash", "dspark")}}
    dec = {("low", "short"): race.Decision(race.UNDECIDED, "dspark", ["dspark", "dflash"], [], {"ngram": 0},
                                           0.8, {}, {}, {}, {}, {}, {}, 0.0, 1, None),
           ("low", "long"): race.Decision(race.UNDECIDED, "ngram", ["ngram", "dflash", "dspark"], [], {},
                                          0.7, {}, {}, {}, {}, {}, {}, 0.0, 1, None)}
    order = [("low", "short"), ("low", "long")]
    got = [[(k[1], s.strategy, s.repeat) for k, s in round_plan(order, dec, cells, 1 + i, i)]
           for i in range(3)]
    assert got[0] == [("short", "dflash", 1), ("short", "dspark", 1),
                      ("long", "ngram", 1), ("long", "dflash", 1), ("long", "dspark", 1)]
    assert got[1] == [("short", "dspark", 2), ("short", "dflash", 2),
                      ("long", "dflash", 2), ("long", "dspark", 2), ("long", "ngram", 2)]
    assert [x[1] for x in got[2][:2]] == ["dflash", "dspark"]


def test_first_pass_is_cell_major():
    from loadgen.cli.race import first_pass

    got = [(c.tier, c.output_class, c.repeat, c.strategy)
           for c in first_pass(["a", "b"], ["low", "high"], ["short", "long"], 1)]
    assert got[:4] == [("low", "short", 0, "a"), ("low", "short", 0, "b"),
                       ("low", "long", 0, "a"), ("low", "long", 0, "b")]
    assert len(got) == 8 and got[-1] == ("high", "long", 0, "b")


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
    assert racer.stopped.startswith("budget") and "budget spent" in said[-1]
    entry = racer.manifest_entry()
    assert entry["rounds"][0]["planned_s"] == 60.0 and entry["rounds"][0]["started_s"] == 30.0
    assert entry["decisions"]["low/short"]["status"] == race.UNDECIDED


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
    df = pd.read_parquet(run / "requests.parquet")
    assert set(df[mn.REQ_REPEAT]) == {0}
    assert "low/short: decided dflash (confidence 100%, 1 repeat" in out


def test_race_repeats_contenders_interleaved_drops_the_loser_and_keeps_the_budget(tmp_path):
    """ngram (12x slower) is dropped after the first pass; dflash and dspark run at one
    speed with random delays, and at confidence 0.999 stay undecided, so the race repeats
    them, in turn, until the next round does not fit in the budget. The report and the
    console give the same decision."""
    from loadgen.tools import fake_server

    budget = 24.0
    with fake_server.running("--ttft-ms", "10", "--gap-ms", "5", "--jitter-ms", "30",
                             "--model-gap-ms", "ngram=400") as url:
        out, run = _loadgen(url, tmp_path, "--strategies", "ngram,dflash,dspark",
                            "--budget", f"{budget:g}s", "--confidence", "0.999", "--report")
    man = json.loads((run / "manifest.json").read_text())
    r = man["race"]
    assert r["budget_s"] == budget and r["confidence"] == 0.999 and r["stopped"].startswith("budget")
    assert len(r["rounds"]) >= 1
    for i, rnd in enumerate(r["rounds"]):
        assert rnd["repeat"] == i + 1
        assert rnd["started_s"] + rnd["planned_s"] <= budget          # the rule that started it
        names = [c["strategy"] for c in rnd["cells"]]
        assert names == (["dflash", "dspark"] if i % 2 == 0 else ["dspark", "dflash"])
    df = pd.read_parquet(run / "requests.parquet")
    # the first pass is cell-major too: one cell here, the strategies in their given order
    first = df[df[mn.REQ_REPEAT].eq(0)].groupby(mn.REQ_STRATEGY)[mn.REQ_SCHEDULED_TS].min()
    assert list(first.sort_values().index) == ["ngram", "dflash", "dspark"]
    reps = df.groupby(mn.REQ_STRATEGY)[mn.REQ_REPEAT].agg(lambda s: sorted(set(s)))
    assert reps["ngram"] == [0]
    assert reps["dflash"] == reps["dspark"] == list(range(len(r["rounds"]) + 1))
    # in time: every dflash/dspark pair of a round back to back, rounds one after another
    spans = df.groupby([mn.REQ_REPEAT, mn.REQ_STRATEGY])[mn.REQ_SCHEDULED_TS].min().unstack()
    assert (spans.loc[1:, ["dflash", "dspark"]].min(axis=1).diff().dropna() > 0).all()
    d = r["decisions"]["low/short"]
    assert d["status"] == race.UNDECIDED and d["dropped"] == {"ngram": 0}
    assert sorted(d["contenders"]) == ["dflash", "dspark"]
    assert "low/short: undecided between" in out and "[budget spent]" in out
    rec = json.loads((run / "report" / "recommendation.json").read_text())
    low = rec["low"]["short"]
    assert rec["schema_version"] == 3 and low["status"] == d["status"]
    assert low["confidence"] == pytest.approx(d["confidence"]) and low["strategy"] == TIE
    assert low["repeats"] == len(r["rounds"]) + 1 and low["time_s"] == pytest.approx(d["time_s"])
    assert low["dropped"] == {"ngram": 0}
    assert "budget spent" in (run / "report" / "report.md").read_text()
