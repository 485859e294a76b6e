"""The run plan is a value (``loadgen.cli.plan``): a pure function of the arguments, the tier
profile and the target discovery; frozen; what ``--dry-run`` prints is the manifest's
``plan``; the runner executes its cells in order and racing only appends to it. One cell
key (``metric_names.CellKey``) for the load generator, racing and the speedups.

Runs go to the fake streaming server (127.0.0.1, ephemeral port) in a subprocess, as in
tests/test_loadgen_ux.py.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from configs import metric_names as M
from configs.jsonio import loads_strict
from configs.tiers import load_tiers
from loadgen.cli.args import parse_args
from loadgen.cli.plan import Discovery, build_plan, plan_lines
from loadgen.results.summary import CellSummary, add_speedups
from loadgen.tools import fake_server
from tests.tiers_file import write_tiers

REPO = Path(__file__).resolve().parent.parent
DISCOVERY = Discovery("http://127.0.0.1:9", ("autoregressive", "ngram", "dflash"),
                      (("autoregressive", "/strategies/autoregressive"), ("ngram", None),
                       ("dflash", "http://127.0.0.1:7/strategies/dflash")),
                      (("dflash", "/strategies/dflash"),))


def _plan(argv: list[str]):
    args = parse_args(argv)
    return build_plan(args, load_tiers().profile(None), DISCOVERY), args


def test_the_plan_is_a_pure_function_of_its_inputs():
    argv = ["--tier", "low,high", "--output", "short", "--repeats", "2", "--interleave", "--budget", "0"]
    args = parse_args(argv)
    before = copy.deepcopy(vars(args))
    profile = load_tiers().profile(None)
    a, b = build_plan(args, profile, DISCOVERY), build_plan(args, profile, DISCOVERY)
    assert a == b and a.to_dict() == b.to_dict()
    assert vars(args) == before            # the arguments are read, never changed
    assert a == _plan(argv)[0]             # freshly parsed arguments: the same plan
    # cell-major (--interleave), odd repeats mirrored, users resolved from the tier file
    assert a.order == "cell-major" and a.racing is None
    assert [(c.strategy, c.tier, c.repeat) for c in a.cells[:6]] == [
        ("autoregressive", "low", 0), ("ngram", "low", 0), ("dflash", "low", 0),
        ("dflash", "low", 1), ("ngram", "low", 1), ("autoregressive", "low", 1)]
    assert {c.users for c in a.cells if c.tier == "low"} == {profile.cell("low", "short").users}
    assert [(r.strategy, r.route, r.fallback_url) for r in a.routes] == [
        ("autoregressive", "strategy", ""), ("ngram", "model-field", ""),
        ("dflash", "direct", "http://127.0.0.1:9/strategies/dflash")]
    # another input, another plan
    assert _plan(argv[:-2] + ["--budget", "10m"])[0] != a


def test_the_plan_is_frozen_and_racing_extends_it_into_a_new_value():
    plan, _ = _plan(["--tier", "low", "--budget", "5m"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.cells = ()
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.cells[0].repeat = 3
    assert plan.racing is not None and plan.racing.first_pass_cells == len(plan.cells)
    extra = [dataclasses.replace(plan.cells[0], repeat=2), dataclasses.replace(plan.cells[1], repeat=2)]
    longer = plan.extend(extra)
    assert longer.cells == plan.cells + tuple(extra) and longer.racing.rounds == (2,)
    assert plan.racing.rounds == () and len(plan.cells) == longer.racing.first_pass_cells
    assert longer.extend(extra[:1]).racing.rounds == (2, 1)


def test_a_sweep_plan_lists_every_cell_it_may_run():
    plan, _ = _plan(["--sweep", "--output", "long", "--sweep-max-users", "4", "--repeats", "2"])
    assert plan.at_most and plan.sweep_levels == (1, 2, 4)
    assert len(plan.cells) == 3 * 3 * 2        # strategies x levels x repeats
    assert [c.users for c in plan.cells[::6]] == [1, 2, 4] and plan.cells[0].strategy == "autoregressive"


def _loadgen(*argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"}
    env["COLUMNS"] = "100"
    return subprocess.run([sys.executable, "-m", "loadgen", *argv], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env=env)


def _tiers(tmp_path: Path) -> Path:
    cell = {"users": 2, "spawn_rate": 100, "duration_s": 1, "max_tokens": 8,
            "slo": {"ttft_ms": 1000, "tpot_ms": 100}}
    return write_tiers(tmp_path, cell, drain_timeout_s=1)


def test_dry_run_prints_the_manifests_plan_and_the_run_executes_it(tmp_path):
    with fake_server.running("--ttft-ms", "10", "--gap-ms", "2") as url:
        common = ["--target", url, "--tiers-file", str(_tiers(tmp_path)), "--tier", "low,mid",
                  "--output", "short", "--strategies", "autoregressive,ngram", "--repeats", "2",
                  "--budget", "0", "--consistency", "0", "--results", str(tmp_path / "res")]
        dry = _loadgen(*common, "--dry-run")
        run = _loadgen(*common)
    assert dry.returncode == 0, dry.stderr[-2000:]
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert not (tmp_path / "res").exists() or len(list((tmp_path / "res").iterdir())) == 1
    run_dir = Path(run.stdout.strip().splitlines()[-1].split("results: ", 1)[1])
    man = loads_strict((run_dir / "manifest.json").read_text())
    printed = [ln for ln in dry.stdout.splitlines() if not ln.startswith("dry run:")]
    assert printed == plan_lines(man["plan"])
    # the runner ran the plan's cells, in its order
    cells = [(c["strategy"], c["tier"], c["output_class"], c["repeat"]) for c in man["cells"]]
    assert cells == [(c["strategy"], c["tier"], c["output_class"], c["repeat"]) for c in man["plan"]["cells"]]
    assert len(cells) == 2 * 2 * 2
    # one time estimate: the header's ETA is the planned cells x planned seconds per cell
    from loadgen.results.summary import clock
    header = " ".join(run.stdout[run.stdout.index("specload run"):run.stdout.index("results in")].split())
    assert f"ETA {clock(len(cells) * man['plan']['cell_s'])}" in header and "planned" not in header


def test_racing_appends_to_the_plan_and_the_counters_follow_it(tmp_path):
    with fake_server.running("--ttft-ms", "10", "--gap-ms", "2") as url:
        run = _loadgen("--target", url, "--tiers-file", str(_tiers(tmp_path)), "--tier", "low",
                       "--output", "short", "--strategies", "autoregressive,ngram", "--budget", "25s",
                       "--consistency", "0", "--results", str(tmp_path / "res"))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    run_dir = Path(run.stdout.strip().splitlines()[-1].split("results: ", 1)[1])
    man = loads_strict((run_dir / "manifest.json").read_text())
    plan = man["plan"]
    assert len(plan["cells"]) == plan["racing"]["first_pass_cells"] + sum(plan["racing"]["rounds"])
    assert len(man["cells"]) == len(plan["cells"])
    assert len(plan["racing"]["rounds"]) == len(man["race"]["rounds"])
    # "cell i/N": i counts up by one, N is the plan's size when the cell ran: never done > planned,
    # and each growth of N was announced by a "plan: ... added" line before it
    seen = [(int(a), int(b)) for a, b in re.findall(r"^cell (\d+)/(\d+) ", run.stdout, re.M)]
    assert [i for i, _ in seen] == list(range(1, len(plan["cells"]) + 1))
    assert all(i <= n for i, n in seen) and seen[-1][1] == len(plan["cells"])
    added = [int(n) for n in re.findall(r"^plan: \d+ cell\(s\) added, \d+ of (\d+) done", run.stdout, re.M)]
    assert sorted(set(n for _, n in seen)) == sorted({plan["racing"]["first_pass_cells"], *added})
    # every cell line has a speedup figure: the baseline's pooled figure stands in for a round
    # in which it did not run (or not yet)
    assert "speedup -" not in run.stdout
    # the answer follows the cell table
    assert run.stdout.index("per strategy x cell (repeats pooled)") < run.stdout.index("answer per cell")


def test_speedup_falls_back_on_the_baselines_pooled_figure():
    def s(strategy, repeat, tps, dur):
        return CellSummary(strategy, "low", "short", "closed", 2, None, output_tokens_per_s=tps,
                           duration_s=dur, repeat=repeat)
    rows = [s("autoregressive", 0, 100.0, 10.0), s("autoregressive", 1, 200.0, 30.0),
            s("ngram", 0, 150.0, 10.0), s("ngram", 2, 175.0, 10.0)]
    add_speedups(rows)
    assert rows[2].speedup == pytest.approx(1.5)                 # its own repeat's baseline
    assert rows[3].speedup == pytest.approx(175.0 / ((1000 + 6000) / 40))   # pooled: tokens / wall
    lone = [s("ngram", 0, 150.0, 10.0)]
    add_speedups(lone)
    assert lone[0].speedup != lone[0].speedup                   # no baseline at all: NaN


def test_one_cell_key_reads_rows_summaries_and_specs():
    from loadgen.cli.race import cell_key, next_repeats
    from loadgen.run.sweep import CellSpec

    row = {M.REQ_STRATEGY: "ngram", M.REQ_TIER: "low", M.REQ_OUTPUT_CLASS: "short",
           M.REQ_SAMPLING: "t0.7", M.REQ_USERS: 4.0, M.REQ_REPEAT: 1}
    summ = CellSummary("ngram", "low", "short", "closed", 4, None)
    summ.sampling = "t0.7"
    key = M.CellKey.of(row)
    assert key == M.CellKey.of(summ) == ("ngram", "low", "short", "t0.7", 4)
    assert M.CELL_KEY == key._fields and hash(key) == hash(tuple(key))
    assert key.baseline("autoregressive").strategy == "autoregressive"
    assert cell_key([row], None) == ("low", "short", "t0.7") == key.decision()
    assert cell_key([], CellSpec("ngram", "low", "low", "short", None, 0, "t0.7")) == ("low", "short", "t0.7")
    assert next_repeats([row]) == {(("low", "short", "t0.7"), "ngram"): 2}
    # rows written before the sampling column: the decision key is what they record
    old = {k: v for k, v in row.items() if k != M.REQ_SAMPLING}
    assert M.CellKey.of(old).decision() == ("low", "short")
    assert key.label() == "ngram low/short/t0.7 u4" and M.CellKey("a", "low", "long").label() == "a low/long"
