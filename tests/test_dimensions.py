"""Draft length / candidates as deployment variants and sampling settings as cells (issue 22,
items 2 and 3): config validation naming the key or flag, the variants' Serve config (names,
engine settings), cells per sampling label end to end against the fake server, and the
report's k / temperature tables and per-sampling recommendation on synthetic runs with
known answers (tests/analysis_synth.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

from analysis.data.load import load_results
from analysis.data import metrics
from analysis.report.dimensions import k_table, temperature_table
from configs import metric_names as M
from configs.paths import CONFIGS_DIR
from configs.serve_config import VariantError, drafter_max_k, variant_config
from configs.tiers import Sampling, TierConfigError, load_tiers, parse_tiers
from loadgen.results.summary import CellSummary, add_speedups
from loadgen.run.cells import CellPlan, Dispenser
from loadgen.run.sweep import grid_cells
from tests import analysis_synth as syn
from tests.tiers_file import write_tiers

REPO = Path(__file__).resolve().parent.parent
SLO = {"ttft_ms": 1000, "tpot_ms": 100}


# --- tier file: samplings, output lengths ---------------------------------------------------
def _doc(**low_short) -> dict:
    cell = {"users": 1, "spawn_rate": 1, "duration_s": 1, "max_tokens": 32, "slo": SLO}
    tiers = {t: {"short": dict(cell), "long": dict(cell)} for t in ("low", "mid", "high")}
    tiers["low"]["short"].update(low_short)
    return {"default_profile": "t", "profiles": {"t": {"tiers": tiers}}}


def test_sampling_labels_and_precedence():
    assert Sampling().name == "greedy"
    assert Sampling(temperature=0.7, seed=1).name == "t0.7"
    assert Sampling(temperature=1.0, top_p=0.9, top_k=50).name == "t1-p0.9-k50"
    assert Sampling(temperature=0.7, label="warm").name == "warm"
    doc = _doc(samplings=[{"temperature": 0}, {"temperature": 0.7, "seed": 1}])
    doc["profiles"]["t"]["tiers"]["mid"]["samplings"] = [{"temperature": 1.0}]
    doc["profiles"]["t"]["samplings"] = [{"temperature": 0.5}, {"temperature": 0.0}]
    p = parse_tiers(doc).profile()
    assert [s.name for s in p.samplings_for("low", "short")] == ["greedy", "t0.7"]   # cell
    assert [s.name for s in p.samplings_for("mid", "long")] == ["t1"]                # tier
    assert [s.name for s in p.samplings_for("high", "short")] == ["t0.5", "greedy"]  # profile
    assert p.samplings_for("low", "short")[1].seed == 1
    del doc["profiles"]["t"]["samplings"]
    assert [s.name for s in parse_tiers(doc).profile().samplings_for("high", "short")] == ["greedy"]


@pytest.mark.parametrize("low_short, where, what", [
    ({"samplings": [{"temperature": 0.7}, {"temperature": 0.7, "seed": 3}]},
     "profiles.t.tiers.low.short", "labels must be unique, ['t0.7'] repeat"),
    ({"samplings": [{"temperature": 2.5}]}, "profiles.t.tiers.low.short.samplings.0.temperature",
     "less than or equal to 2"),
    ({"samplings": [{"temprature": 0.7}]}, "profiles.t.tiers.low.short.samplings.0.temprature",
     "Extra inputs are not permitted"),
    ({"samplings": []}, "profiles.t.tiers.low.short", "at least one setting"),
    ({"min_tokens": 40}, "profiles.t.tiers.low.short", "min_tokens (40) exceeds the smallest max_tokens draw (32)"),
    ({"ignore_eos": "sometimes"}, "profiles.t.tiers.low.short.ignore_eos", "valid boolean"),
])
def test_tier_file_errors_name_the_key(low_short, where, what):
    with pytest.raises(TierConfigError) as err:
        parse_tiers(_doc(**low_short))
    line = next(ln for ln in str(err.value).splitlines() if ln.strip().startswith(where + ":"))
    assert what in line


def test_packaged_profiles_include_sampled_traffic():
    tiers = load_tiers()
    cpu, gpu = tiers.profile("cpu"), tiers.profile("gpu")
    cells = [(t, oc) for t in ("low", "mid", "high") for oc in ("short", "long")]
    # cpu: one cell sampled (the main job: 6 strategies x 7 = 42 cells); gpu: every cell x 3
    assert {c: [s.name for s in cpu.samplings_for(*c)] for c in cells if len(cpu.samplings_for(*c)) > 1} \
        == {("low", "short"): ["greedy", "t0.7"]}
    assert sum(len(cpu.samplings_for(*c)) for c in cells) == 7
    assert all([s.name for s in gpu.samplings_for(*c)] == ["greedy", "t0.7", "t1"] for c in cells)
    assert all(gpu.cell(t, "long").ignore_eos and not gpu.cell(t, "short").ignore_eos
               for t in ("low", "mid", "high"))


# --- variants: one deployment per (strategy, k, candidates) ---------------------------------
def _serve_cfg() -> dict:
    return yaml.safe_load((CONFIGS_DIR / "serve.yaml").read_text())


def test_variant_config_names_and_engine_settings(tmp_path):
    cfg, variants = variant_config(_serve_cfg(), ["autoregressive", "draft_model", "ngram", "dflash2"],
                                   [2, 4, 7], [4, 16])
    entries = {e["name"]: e for e in cfg["applications"][0]["args"]["strategies"]}
    assert list(entries) == ["autoregressive", "draft_model-k2", "draft_model-k4", "draft_model-k7",
                             "ngram-k2", "ngram-k4", "ngram-k7",
                             "dflash2-k2-c4", "dflash2-k2-c16", "dflash2-k4-c4", "dflash2-k4-c16",
                             "dflash2-k7-c4", "dflash2-k7-c16"]
    assert list(variants) == list(entries)
    e = entries["dflash2-k4-c16"]["engine"]
    assert (e["strategy"], e["num_speculative_tokens"], e["strategy_options"], e["draft_model"]) == \
        ("dflash2", 4, {"top_k": 16}, "models/dflash2")
    assert entries["ngram-k7"]["engine"]["num_speculative_tokens"] == 7
    assert "strategy_options" not in entries["ngram-k7"]["engine"]
    assert entries["autoregressive"]["engine"]["num_speculative_tokens"] == 0
    # the replica CPUs of one strategy are shared by its variants (0.3 in serve.yaml)
    assert entries["autoregressive"]["ray_actor_options"]["num_cpus"] == 0.3
    assert entries["ngram-k2"]["ray_actor_options"]["num_cpus"] == 0.1
    assert entries["dflash2-k2-c4"]["ray_actor_options"]["num_cpus"] == 0.05
    assert variants["dflash2-k7-c4"] | {"engine": None} == {
        "base_strategy": "dflash2", "strategy": "dflash2", "k": 7, "top_k_candidates": 4, "engine": None,
        "synthetic_acceptance_length": None, "synthetic": False}
    # the whole config validates the way `cluster up` does (EngineConfig + strategy_options)
    from cluster.config_check import check_serve_config

    path = tmp_path / "v.yaml"
    path.write_text(yaml.safe_dump(cfg))
    check_serve_config(path)


def test_variant_config_without_strategies_varies_every_speculative_one():
    cfg, variants = variant_config(_serve_cfg(), None, [3], None)
    assert list(variants) == ["autoregressive"] + [f"{s}-k3" for s in M.SPECULATIVE_STRATEGIES]


def test_k_variant_drops_a_per_batch_size_schedule():
    cfg = _serve_cfg()
    ngram = next(e for e in cfg["applications"][0]["args"]["strategies"] if e["engine"]["strategy"] == "ngram")
    ngram["engine"]["num_speculative_tokens_per_batch_size"] = {"1-8": 4, "9-32": 1}
    out, _ = variant_config(cfg, ["ngram"], [2], None)
    entry = next(e for e in out["applications"][0]["args"]["strategies"] if e["name"] == "ngram-k2")
    assert entry["engine"]["num_speculative_tokens"] == 2
    assert "num_speculative_tokens_per_batch_size" not in entry["engine"]


@pytest.mark.parametrize("strategies, ks, cands, flag, what", [
    (["dflash2"], [4, 8], None, "--k", "[8] too large for dflash2: its drafter (models/dflash2) was "
                                       "trained with block_size 8, so it drafts at most 7 tokens"),
    (["dspark"], [9], None, "--k", "too large for dspark"),
    (["ngram"], [0], None, "--k", "must be 1..64"),
    (["ngram"], [65], None, "--k", "must be 1..64"),
    (["ngram", "draft_model"], [2], [4], "--top-k-candidates", "only dflash2 does"),
    (["dflash2"], None, [0], "--top-k-candidates", "must be 1..256"),
    (["nonesuch"], [2], None, "--strategies", "['nonesuch'] not in the Serve config"),
])
def test_variant_errors_name_the_flag(strategies, ks, cands, flag, what):
    with pytest.raises(VariantError) as err:
        variant_config(_serve_cfg(), strategies, ks, cands)
    assert str(err.value).startswith(flag + ":") and what in str(err.value)


def test_drafter_max_k_reads_the_trained_block_size(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"block_size": 4}))
    assert drafter_max_k({"strategy": "dflash", "draft_model": str(tmp_path)})[0] == 3
    assert drafter_max_k({"strategy": "dflash2", "strategy_options": {"drafter": str(tmp_path)}})[0] == 3
    assert drafter_max_k({"strategy": "dflash2"})[0] == 7           # models/dflash2: block 8
    assert drafter_max_k({"strategy": "ngram"}) is None


@pytest.mark.parametrize("argv, what", [
    (["--strategies", "autoregressive,dflash2", "--k", "4,9"], "--k: [9] too large for dflash2"),
    (["--k", "0"], "argument --k: must be an integer >= 1 and <= 64, got '0'"),
    (["--k", "2,x"], "argument --k: expects an integer >= 1 and <= 64, got 'x'"),
    (["--tier", "low,bogus"], "--tier: ['bogus'] not a tier"),
    (["--temperature", "0,3"], "argument --temperature: must be a number >= 0 and <= 2, got '3'"),
])
def test_cli_refuses_bad_dimension_flags_before_starting_anything(tmp_path, argv, what):
    argv = ["--tier", "low"] + argv if "--tier" not in argv else argv
    p = subprocess.run([sys.executable, "-m", "loadgen", *argv, "--results", str(tmp_path),
                        "--local-port", "1"], capture_output=True, text=True, timeout=120, cwd=REPO)
    out = " ".join((p.stdout + p.stderr).split())
    assert p.returncode == 2, out
    assert what in out
    assert "starting or reusing the local service" not in out


# --- load generator: cells per sampling label -----------------------------------------------
def test_grid_has_one_cell_per_sampling_label():
    cells = list(grid_cells(["autoregressive", "ngram-k2"], ["low", "high"], ["short"], 1,
                            {("low", "short"): ["greedy", "t0.7", "t1"]}))
    assert [(c.strategy, c.tier, c.sampling) for c in cells] == [
        ("autoregressive", "low", "greedy"), ("autoregressive", "low", "t0.7"),
        ("autoregressive", "low", "t1"), ("autoregressive", "high", ""),
        ("ngram-k2", "low", "greedy"), ("ngram-k2", "low", "t0.7"), ("ngram-k2", "low", "t1"),
        ("ngram-k2", "high", "")]


def test_speedup_compares_the_same_sampling_label():
    def s(strategy, label, tps):
        x = CellSummary(strategy, "low", "short", "closed", 1, None, output_tokens_per_s=tps)
        x.sampling = label
        return x
    rows = [s("autoregressive", "greedy", 100.0), s("autoregressive", "t0.7", 50.0),
            s("ngram", "greedy", 150.0), s("ngram", "t0.7", 100.0)]
    add_speedups(rows)
    assert [r.speedup for r in rows] == [1.0, 1.0, 1.5, 2.0]


def test_request_body_carries_sampling_and_output_lengths():
    plan = CellPlan(run_id="r", strategy="ngram", model="ngram", tier="low", output_class="long",
                    dataset="d", base_url="http://x", arrival="closed", users=1, rate_rps=None,
                    start_ts=0.0, deadline_ts=1e12, prompts=[["p0", "hi", None]],
                    max_tokens={"dist": "fixed", "value": 32}, seed=0,
                    sampling=Sampling(temperature=0.7, seed=5).model_dump(), sampling_label="t0.7",
                    ignore_eos=True, min_tokens=40)
    body = Dispenser(plan).job(3, None).body
    assert (body["temperature"], body["seed"], body["ignore_eos"], body["min_tokens"],
            body["max_tokens"]) == (0.7, 8, True, 32, 32)   # min_tokens capped at max_tokens
    plan.ignore_eos, plan.min_tokens = False, None
    body = Dispenser(plan).job(0, None).body
    assert "ignore_eos" not in body and "min_tokens" not in body


def test_run_against_fake_server_cells_per_sampling_and_variants(tmp_path):
    """--k with --target drives the served variants; each sampling label is its own cell,
    rows / steps / manifest carry it; the bodies carried ignore_eos and min_tokens."""
    from loadgen.tools import fake_server

    cell = {"users": 1, "spawn_rate": 100, "duration_s": 1, "max_tokens": 8, "slo": SLO}
    tiers = write_tiers(tmp_path, cell, low_long={"max_tokens": 16, "ignore_eos": True, "min_tokens": 12},
                        profile="test", samplings=[{"temperature": 0.0}, {"temperature": 0.7, "seed": 1}])
    models = "autoregressive,ngram-k2,ngram-k4"
    with fake_server.running("--ttft-ms", "10", "--gap-ms", "5", "--models", models) as url:
        p = subprocess.run([sys.executable, "-m", "loadgen", "--tier", "low", "--target", url,
                            "--tiers-file", str(tiers), "--results", str(tmp_path / "res"),
                            "--strategies", "autoregressive,ngram", "--k", "2,4",
                            "--consistency", "0"], capture_output=True, text=True, timeout=180, cwd=REPO)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        truth = fake_server.get_json(f"{url}/fake/timings")
    (run,) = list((tmp_path / "res").iterdir())
    man = json.loads((run / "manifest.json").read_text())
    got = sorted((c["strategy"], c["output_class"], c["sampling"]) for c in man["cells"])
    assert got == sorted((s, oc, lab) for s in models.split(",") for oc in ("short", "long")
                         for lab in ("greedy", "t0.7"))
    from configs.results_schema import SCHEMA_VERSION

    assert man["schema_version"] == SCHEMA_VERSION
    assert {k: v["k"] for k, v in man["variants"].items()} == {"autoregressive": 0, "ngram-k2": 2, "ngram-k4": 4}
    # the fake server has no /reset_prefix_cache (like vLLM outside dev mode): asked once per
    # deployment, recorded, named in one warning each; the cells ran
    resets = man["prefix_cache"]["by_strategy"]
    assert {s: (r["unsupported"], r["reset"]) for s, r in resets.items()} == {
        m: (1, 0) for m in models.split(",")}
    assert p.stdout.count("prefix cache not reset before the cell") == 3
    assert [s["label"] for s in man["samplings"]["low/short"]] == ["greedy", "t0.7"]
    assert man["output_lengths"]["low/long"] | {"max_tokens": None} == {
        "max_tokens": None, "ignore_eos": True, "min_tokens": 12}
    req = pd.read_parquet(run / "requests.parquet")
    by = req.groupby([M.REQ_OUTPUT_CLASS, M.REQ_SAMPLING])
    assert by[M.REQ_TEMPERATURE].unique().map(list).to_dict() == {
        ("long", "greedy"): [0.0], ("long", "t0.7"): [0.7], ("short", "greedy"): [0.0], ("short", "t0.7"): [0.7]}
    assert by[M.REQ_IGNORE_EOS].unique().map(list).to_dict()[("long", "t0.7")] == [1]
    assert set(req.loc[req[M.REQ_OUTPUT_CLASS].eq("long"), M.REQ_MIN_TOKENS]) == {12}
    assert req.loc[req[M.REQ_OUTPUT_CLASS].eq("short"), M.REQ_MIN_TOKENS].isna().all()
    sent = [t["sent"] for t in truth.values() if t.get("status") == "ok"]
    assert {(s["ignore_eos"], s["min_tokens"]) for s in sent} == {(None, None), (True, 12)}
    assert {s["temperature"] for s in sent} == {0.0, 0.7}
    steps = pd.read_parquet(run / "steps.parquet")
    assert set(steps[M.REQ_SAMPLING].dropna()) == {"greedy", "t0.7"}
    # the analysis: base strategy and k per deployment, one cell per sampling label
    res = load_results(run)
    cells = metrics.cell_table(metrics.with_slo_flags(res.requests, {"low": _slo()}))
    assert len(cells) == 12 and cells.groupby(M.REQ_SAMPLING).size().to_dict() == {"greedy": 6, "t0.7": 6}
    kt = k_table(cells)
    assert sorted(set(zip(kt["base_strategy"], kt["k"]))) == [("ngram", 2), ("ngram", 4)]


def _slo():
    from configs.tiers import Slo

    return Slo(**SLO)


# --- analysis: k curve, temperature, recommendation on synthetic runs -----------------------
NG2 = syn.Strat("ngram-k2", {1: 1.4, 8: 1.2, 64: 1.0}, (0.7, 0.5), draft_ms=0.2)
NG4 = syn.Strat("ngram-k4", {1: 1.6, 8: 1.3, 64: 0.9}, (0.7, 0.5, 0.3, 0.1), draft_ms=0.2)
NG7 = syn.Strat("ngram-k7", {1: 1.65, 8: 1.25, 64: 0.7}, (0.7, 0.5, 0.3, 0.1, 0.1, 0.0, 0.0), draft_ms=0.2)


def _cells(path):
    res = load_results(path)
    from analysis.data.slo import resolve_slos

    slos = resolve_slos(sorted(res.requests[M.REQ_TIER].unique()), res.manifest_config, None, None)
    return metrics.cell_table(metrics.with_slo_flags(res.requests, slos))


def test_k_table_is_the_diminishing_returns_curve(tmp_path):
    run = syn.write_run(tmp_path / "run", strats=(syn.AR, NG2, NG4, NG7))
    kt = k_table(_cells(run))
    low = kt[kt[M.REQ_TIER].eq("low") & kt[M.REQ_OUTPUT_CLASS].eq("short")]
    assert list(low["k"]) == [2, 4, 7] and set(low["base_strategy"]) == {"ngram"}
    assert list(low["strategy"]) == ["ngram-k2", "ngram-k4", "ngram-k7"]
    assert low["speedup"].tolist() == pytest.approx([1.4, 1.6, 1.65])
    assert low["gain_vs_prev_k"].tolist()[1:] == pytest.approx([0.2, 0.05])
    assert low["best_k"].tolist() == [False, False, True]
    assert low[M.ACCEPTANCE_LENGTH].tolist() == pytest.approx([syn.synth_tau(s) for s in (NG2, NG4, NG7)])
    high = kt[kt[M.REQ_TIER].eq("high") & kt[M.REQ_OUTPUT_CLASS].eq("long")]
    assert high["speedup"].tolist() == pytest.approx([1.0, 0.9, 0.7])
    assert high["best_k"].tolist() == [True, False, False]
    assert list(kt[M.REQ_TIER].unique()) == ["low", "mid", "high"]


def test_report_recommends_strategy_and_k(tmp_path):
    from analysis.report.build import build_report

    run = syn.write_run(tmp_path / "run", strats=(syn.AR, NG2, NG4, NG7))
    out = build_report(run, tmp_path / "out")
    saved = json.loads((tmp_path / "out" / "recommendation.json").read_text())
    rows = {(r["tier"], r["output_class"]): r for r in saved["rows"]}
    assert rows[("low", "short")] | {"goodput": 0, "confidence": 0, "margin": 0, "speedup": 0} == {
        "tier": "low", "output_class": "short", "strategy": "ngram-k7", "leader": "ngram-k7",
        "tied": [], "base_strategy": "ngram", "k": 7, "top_k_candidates": None, "sampling": "greedy",
        "temperature": 0.0, "goodput": 0, "speedup": 0, "runner_up": "ngram-k4", "margin": 0,
        "confidence": 0, "users": [1]}
    assert rows[("mid", "short")]["strategy"] == "ngram-k4" and rows[("mid", "short")]["k"] == 4
    assert rows[("high", "long")]["strategy"] == "autoregressive" and rows[("high", "long")]["k"] == 0
    md = Path(out["paths"]["md"]).read_text()
    assert "## Speedup and acceptance vs draft length k" in md
    assert "| low | short | greedy | ngram | 7 | ngram-k7 | 1 | 1.65 |" in md
    assert "| low | short | 1 | ngram-k7 | ngram | 7 |" in md     # recommendation table
    html = Path(out["paths"]["html"]).read_text()
    assert "Speedup and acceptance length vs draft length k" in html


SAMPLINGS = {"greedy": (0.0, 1.0), "t0.7": (0.7, 0.6), "t1": (1.0, 0.3)}


def test_temperature_table_and_recommendation_per_sampling(tmp_path):
    from analysis.decide.recommend import headline_lines, recommendation_rows
    from analysis.report.build import build_report

    run = syn.write_run(tmp_path / "run", samplings=SAMPLINGS)
    cells = _cells(run)
    # each sampling label is its own cell: 3 strategies x 3 tiers x 2 outputs per label
    assert cells.groupby(M.REQ_SAMPLING).size().to_dict() == {"greedy": 18, "t0.7": 18, "t1": 18}
    tt = temperature_table(cells)
    d = tt[tt[M.REQ_STRATEGY].eq(M.DFLASH) & tt[M.REQ_TIER].eq("low") & tt[M.REQ_OUTPUT_CLASS].eq("short")]
    assert list(d[M.REQ_SAMPLING]) == ["greedy", "t0.7", "t1"]
    assert list(d[M.REQ_TEMPERATURE]) == [0.0, 0.7, 1.0]
    want_tau = [syn.synth_tau(syn.DFLASH, s) for _, s in SAMPLINGS.values()]
    assert d[M.ACCEPTANCE_LENGTH].tolist() == pytest.approx(want_tau)
    assert d["tau_vs_first"].tolist() == pytest.approx([t / want_tau[0] for t in want_tau])
    assert d["speedup"].tolist() == pytest.approx([3.0, 1 + 0.6 * 2.0, 1 + 0.3 * 2.0])
    out = build_report(run, tmp_path / "out")
    rec = out["recommendation"]
    assert rec["low"]["short"]["sampling"] == "greedy" and rec["low"]["short"]["strategy"] == M.DFLASH
    assert set(rec["low"]["short"]["by_sampling"]) == {"t0.7", "t1"}
    assert rec["low"]["short"]["by_sampling"]["t1"]["strategy"] == M.DFLASH
    assert rec["low"]["short"]["by_sampling"]["t1"]["temperature"] == 1.0
    # high tier: dflash 0.6x greedy, 1 + 0.3 * (0.6 - 1) = 0.88x at t1: the baseline wins
    assert rec["high"]["long"]["by_sampling"]["t1"]["strategy"] == M.AUTOREGRESSIVE
    rows = recommendation_rows(rec)
    assert len(rows) == 3 * 2 * 3 and {r["sampling"] for r in rows} == set(SAMPLINGS)
    assert "low / short / t0.7: run dflash" in "\n".join(headline_lines(rec))
    md = Path(out["paths"]["md"]).read_text()
    assert "## Acceptance and speedup vs temperature" in md


def test_runs_before_schema_4_load_with_their_profile_sampling(tmp_path):
    dflash = syn.Strat(M.DFLASH, {1: 2.0, 8: 1.5, 64: 0.9}, (0.5, 0.5))
    run = syn.write_run(tmp_path / "a", strats=(syn.AR, dflash, NG2), manifest_extra={
        "profile": {"sampling": {"temperature": 0.7, "seed": 0}},
        "memory": {M.DFLASH: {"num_speculative_tokens": 7}}})
    req = load_results(run).requests
    assert set(req[M.REQ_SAMPLING]) == {"t0.7"} and set(req[M.REQ_TEMPERATURE]) == {0.7}
    got = req.groupby(M.REQ_STRATEGY)[["base_strategy", "k"]].first().to_dict("index")
    assert got == {"autoregressive": {"base_strategy": "autoregressive", "k": 0},
                   "dflash": {"base_strategy": "dflash", "k": 7},
                   "ngram-k2": {"base_strategy": "ngram", "k": 2}}
    run = syn.write_run(tmp_path / "b", strats=(syn.AR,))
    assert set(load_results(run).requests[M.REQ_SAMPLING]) == {"greedy"}


def test_tier_lists_and_temperature_override():
    from loadgen.cli.args import parse_args, tier_list
    from loadgen.cli.main import _samplings

    assert tier_list("high,low") == ["low", "high"] and tier_list("all") == ["low", "mid", "high"]
    args = parse_args(["--tier", "low,high", "--temperature", "0,0.7,1", "--k", "2,4,4"])
    assert args.k == [2, 4] and args.temperature == [0.0, 0.7, 1.0]
    profile = load_tiers().profile("cpu")
    got = _samplings(args, profile)
    assert [s.name for s in got[("high", "long")]] == ["greedy", "t0.7", "t1"]
    assert {s.seed for s in got[("low", "short")]} == {profile.sampling.seed}
    args = parse_args(["--tier", "low"])
    assert [s.name for s in _samplings(args, profile)[("low", "short")]] == ["greedy", "t0.7"]
