"""``python -m analysis policy``: a load-adaptive policy (k per batch-size band) derived from a
run, its Serve config, and its validation against the best fixed strategy per tier."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import yaml

from analysis import cli
from analysis.data.load import load_results
from analysis.data.slo import resolve_slos
from analysis.decide import policy as pol
from analysis.campaigns.policy_validation import validate_policy
from analysis.decide import policy_validate as pv
from configs import metric_names as mn
from configs.serve_config import SPEC_SCHEDULE_KEY, ServeAppConfig, spec_schedule_k
from configs.tiers import Slo
from tests import analysis_synth as A
from tests import capacity_synth as C


def _derive(path: Path, **kw) -> dict:
    r = load_results(path)
    slos = resolve_slos(sorted(r.requests[mn.REQ_TIER].unique()), r.manifest_config)
    return pol.derive_policy(r, slos, **kw)


def test_speculation_at_low_users_off_at_high(tmp_path):
    """analysis_synth: dflash 3.0x / 2.0x (half of mid misses TTFT) / 0.6x, ngram 1.5 / 1.1 / 0.9
    at 1 / 8 / 64 users."""
    p = _derive(A.write_run(tmp_path / "run"))
    assert p["base_strategy"] == mn.DFLASH and p["name"] == "dflash-policy"
    # score = sum over level x output class of goodput / best fixed goodput:
    # dflash: low 1 + 1, mid 1/1.1 + 1/1.1 (k=0: AR = dflash's 2.0 x 0.5), high 1 + 1
    assert p["bases"][mn.DFLASH]["score"] == pytest.approx(4 + 2 / 1.1, rel=1e-6)
    assert p["bases"][mn.DFLASH]["ks"] == [7, 0, 0]
    # ngram: low 1.5/3 x 2, mid 1 x 2 (k=4), high 1 x 2 (k=0)
    assert p["bases"][mn.NGRAM]["score"] == pytest.approx(5.0, rel=1e-6)
    assert p["bases"][mn.NGRAM]["ks"] == [4, 4, 0]
    # no step labels in this run: typical batch = users; midpoints (1+8)/2, (8+64)/2
    assert [(b["lo"], b["hi"], b["k"]) for b in p["bands"]] == [(1, 4, 7), (5, 36, 0), (37, 64, 0)]
    assert p["map"] == {"1-4": 7, "5-64": 0}
    assert spec_schedule_k(((1, 4, 7), (5, 64, 0)), 1) == 7
    assert p["bands"][0]["policy"]["short"]["goodput_tok_s"] == pytest.approx(150.0, rel=1e-6)
    assert p["best_fixed"]["mid"]["short"]["strategy"] == mn.NGRAM
    assert p["candidates"][mn.NGRAM] == {"base_strategy": mn.NGRAM, "k": 4, "k_source": "base config"}
    forced = _derive(tmp_path / "run", base_strategy=mn.NGRAM, predict=False)
    assert forced["map"] == {"1-36": 4, "37-64": 0} and forced["base_choice"].startswith("given")
    # with the capacity model the ngram -> autoregressive boundary is its predicted crossing,
    # inside the measured bracket (8, 64) users
    modelled = _derive(tmp_path / "run", base_strategy=mn.NGRAM)
    hi = modelled["bands"][1]["hi"]
    assert 8 < hi < 64 and modelled["bands"][1]["boundary_source"].startswith("predicted")
    assert modelled["map"] == {f"1-{hi}": 4, f"{hi + 1}-64": 0}


def test_boundary_predicted_by_the_capacity_model(tmp_path):
    """capacity_synth: dflash (k=7, tau 3) vs autoregressive on a known step cost; the true
    tokens/s crossing solves 3 (4 + 0.05 b) = 5 + 0.05 b + 0.08 (8 b - 48): b = 20.07."""
    run = C.write_sweep_run(tmp_path / "sweep")
    p = _derive(run)
    assert float(C.true_speedup(20.0)) > 1 > float(C.true_speedup(21.0))
    assert p["map"] == {"1-20": 7, "21-32": 0}
    assert p["bands"][-2]["boundary_source"].startswith("predicted")
    assert [b["batch"] for b in p["bands"]] == [1, 2, 4, 8, 16, 32]   # median step batch_size
    assert p["bands"][0]["batch_source"].startswith("step log")
    mid = _derive(run, predict=False)
    assert mid["map"] == {"1-24": 7, "25-32": 0}
    assert all(b["boundary_source"] in ("midpoint", "last band: up to max_num_seqs")
               for b in mid["bands"])


def test_k_variants_give_one_k_per_band(tmp_path):
    """Deployments ``draft_model-k4`` / ``-k2`` (helper G's naming): k4 wins at 1 user, k2 at 8,
    autoregressive at 64."""
    k4 = A.Strat("draft_model-k4", {1: 2.0, 8: 1.2, 64: 0.7}, (0.8, 0.6, 0.4, 0.2))
    k2 = A.Strat("draft_model-k2", {1: 1.6, 8: 1.4, 64: 0.8}, (0.8, 0.6))
    p = _derive(A.write_run(tmp_path / "run", strats=(A.AR, k4, k2)), predict=False)
    assert p["base_strategy"] == mn.DRAFT_MODEL
    assert p["map"] == {"1-4": 4, "5-36": 2, "37-64": 0}
    c = p["candidates"]["draft_model-k2"]
    assert (c["base_strategy"], c["k"]) == (mn.DRAFT_MODEL, 2)
    # the name, or the run's variants columns (base_strategy, k) where the loader adds them
    assert c["k_source"] in ("deployment name", "run variants")
    entry = pol.fixed_entry("draft_model-k2", p["candidates"])
    assert entry["name"] == "draft_model-k2" and entry["engine"]["num_speculative_tokens"] == 2
    cfg = pol.emit_serve_config(p)
    e = cfg["applications"][0]["args"]["strategies"][0]
    assert e["engine"]["num_speculative_tokens"] == 4 and e["engine"][SPEC_SCHEDULE_KEY] == p["map"]


def test_emitted_serve_config_validates_and_names_the_map(tmp_path):
    run = A.write_run(tmp_path / "run")
    out = tmp_path / "policy.yaml"
    assert cli.main(["policy", str(run), "--emit-serve-config", str(out), "--json",
                     str(tmp_path / "p.json")]) == 0
    text = out.read_text()
    assert SPEC_SCHEDULE_KEY in text and "vLLM PR #32374" in text
    doc = yaml.safe_load(text)
    app = doc["applications"][0]
    args = ServeAppConfig.model_validate(app["args"])
    assert [s.name for s in args.strategies] == ["dflash-policy"]
    engine = args.strategies[0].engine
    assert engine["strategy"] == mn.DFLASH and engine[SPEC_SCHEDULE_KEY] == {"1-4": 7, "5-64": 0}
    from actors.engine.config import EngineConfig
    schedule = EngineConfig(**engine).spec_schedule()
    assert [spec_schedule_k(schedule, b) for b in (1, 4, 5, 32)] == [7, 7, 0, 0]
    saved = json.loads((tmp_path / "p.json").read_text())
    assert saved["map"] == {"1-4": 7, "5-64": 0} and saved["serve_config"] == str(out)


def test_policy_emitted_for_backend_vllm(tmp_path):
    """``--backend vllm``: the policy deploys on vLLM's engine (configs/serve-vllm.yaml's
    vllm-dflash entry) with vLLM's num_speculative_tokens_per_batch_size, the map going
    into vLLM's speculative_config as its list form; the fixed deployments of the
    validation are vLLM's too."""
    from actors.engine.config import EngineConfig
    from actors.engine.vllm_backend import vllm_engine_args
    from actors.serve.app import resolve_engine_config

    run = A.write_run(tmp_path / "run")
    out = tmp_path / "policy-vllm.yaml"
    assert cli.main(["policy", str(run), "--backend", "vllm", "--emit-serve-config",
                     str(out)]) == 0
    args = ServeAppConfig.model_validate(yaml.safe_load(out.read_text())["applications"][0]["args"])
    assert [s.name for s in args.strategies] == ["vllm-dflash-policy"]
    engine = resolve_engine_config(args.strategies[0].engine)
    assert engine["backend"] == "vllm" and engine["strategy"] == mn.DFLASH
    assert engine["draft_model"].endswith("vllm-dflash")
    spec = vllm_engine_args(EngineConfig(**engine).model_dump())["speculative_config"]
    assert spec["method"] == "dflash" and spec["num_speculative_tokens"] == 7
    assert spec[SPEC_SCHEDULE_KEY] == [[1, 4, 7], [5, 64, 0]]
    fixed = pol.fixed_entry("dflash-k3", {"dflash-k3": {"base_strategy": "dflash", "k": 3}},
                            pol.DEFAULT_VLLM_BASE_CONFIG, "vllm")
    assert fixed["name"] == "dflash-k3" and fixed["engine"]["backend"] == "vllm"
    assert fixed["engine"]["num_speculative_tokens"] == 3


def _vllm_run(path: Path) -> Path:
    """A run with the embedded autoregressive (fast) beside vLLM's autoregressive and two
    vLLM ngram variants (slower engine, speculation that pays at 1 and 8 users), and the
    Serve config it deployed (``serve_config.yaml``: which engine served each name)."""
    v_ar = A.Strat("vllm-autoregressive", {1: 0.5, 8: 0.5, 64: 0.5})
    k4 = A.Strat("vllm-ngram-k4", {1: 0.8, 8: 0.6, 64: 0.4}, (0.7, 0.5, 0.3, 0.1))
    k2 = A.Strat("vllm-ngram-k2", {1: 0.7, 8: 0.65, 64: 0.45}, (0.7, 0.5))
    run = A.write_run(path, strats=(A.AR, v_ar, k4, k2), aa=False)
    eng = lambda name, strategy, backend, k: {"name": name, "engine": {
        "strategy": strategy, "model": "models/target", "num_speculative_tokens": k,
        **({"backend": backend} if backend else {})}}
    (run / pol.RUN_SERVE_CONFIG).write_text(yaml.safe_dump({"applications": [{
        "import_path": pol.APP_IMPORT_PATH, "args": {"strategies": [
            eng(mn.AUTOREGRESSIVE, mn.AUTOREGRESSIVE, None, 0),
            eng("vllm-autoregressive", mn.AUTOREGRESSIVE, "vllm", 0),
            eng("vllm-ngram-k4", mn.NGRAM, "vllm", 4),
            eng("vllm-ngram-k2", mn.NGRAM, "vllm", 2)]}}]}))
    return run


def test_backend_vllm_policy_is_vllm_against_vllm(tmp_path):
    """On a run that served both engines, ``--backend vllm`` derives from the vLLM
    deployments only: k = 0 is vLLM's autoregressive (not the faster embedded engine, which
    would turn speculation off everywhere), the best fixed choice is a vLLM one, and the
    emitted policy and its validation's fixed deployments run on vLLM."""
    run = _vllm_run(tmp_path / "run")
    every = _derive(run, predict=False)
    assert every["map"] == {"1-64": 0}          # the embedded autoregressive beats every vLLM one
    p = _derive(run, predict=False, backend="vllm")
    assert p["base_strategy"] == "vllm-ngram" and p["name"] == "vllm-ngram-policy"
    assert p["map"] == {"1-4": 4, "5-36": 2, "37-64": 0}
    assert [b["strategy"] for b in p["bands"]] == ["vllm-ngram-k4", "vllm-ngram-k2",
                                                   "vllm-autoregressive"]
    assert mn.AUTOREGRESSIVE not in p["candidates"]
    assert p["best_fixed"]["high"]["short"]["strategy"] == "vllm-autoregressive"
    assert any("k = 0 is vllm-autoregressive" in n for n in p["notes"])
    p["backend"] = "vllm"
    e = pol.policy_entry(p, pol.DEFAULT_VLLM_BASE_CONFIG)
    assert e["engine"]["backend"] == "vllm" and e["engine"][SPEC_SCHEDULE_KEY] == p["map"]
    fixed = pol.fixed_entry("vllm-ngram-k2", p["candidates"], pol.DEFAULT_VLLM_BASE_CONFIG, "vllm")
    assert fixed["engine"]["backend"] == "vllm" and fixed["engine"]["num_speculative_tokens"] == 2
    # a run without deployments on that backend keeps every deployment (measured on the
    # embedded engine, deployed on vLLM with the same map)
    assert _derive(A.write_run(tmp_path / "emb"), predict=False, backend="vllm")["map"] == {
        "1-4": 7, "5-64": 0}


def test_backend_without_its_autoregressive_is_refused(tmp_path, capsys):
    run = _vllm_run(tmp_path / "run")
    doc = yaml.safe_load((run / pol.RUN_SERVE_CONFIG).read_text())
    doc["applications"][0]["args"]["strategies"][1]["engine"]["backend"] = "embedded"
    (run / pol.RUN_SERVE_CONFIG).write_text(yaml.safe_dump(doc))
    with pytest.raises(pol.PolicyError, match="no autoregressive deployment on backend vllm"):
        _derive(run, backend="vllm")
    with pytest.raises(SystemExit) as e:
        cli.main(["policy", str(run), "--backend", "vllm"])
    assert e.value.code == 2 and "--backend: the run has no autoregressive" in capsys.readouterr().err


@pytest.mark.parametrize("extra, flag", [
    (["--base-strategy", "nope"], "--base-strategy"),
    (["--output", "medium"], "--output"),
    (["--validate-duration", "5"], "--validate-duration"),
    (["--validate", "--validate-duration", "0"], "--validate-duration"),
    (["--validate-duration", "nan", "--validate"], "--validate-duration"),
    (["--emit-serve-config", "/nonexistent-dir/p.yaml"], "--emit-serve-config"),
    (["--base-config", "/nonexistent.yaml"], "--base-config"),
    (["--boundaries", "spline"], "--boundaries"),
    (["--seed", "-1"], "--seed"),
    (["--slo-ttft-ms", "0"], "--slo-ttft-ms"),
    (["--validate-results", "/etc/hostname/x"], "--validate-results"),
])
def test_bad_flags_exit_2_naming_the_flag(tmp_path, capsys, extra, flag):
    run = A.write_run(tmp_path / "run")
    with pytest.raises(SystemExit) as exc:
        cli.main(["policy", str(run), *extra])
    assert exc.value.code == 2
    assert flag in capsys.readouterr().err


def test_run_without_baseline_or_speculation_exits_2(tmp_path, capsys):
    run = A.write_run(tmp_path / "no-ar", strats=(A.DFLASH, A.NGRAM))
    with pytest.raises(SystemExit) as exc:
        cli.main(["policy", str(run)])
    assert exc.value.code == 2 and "RESULTS_DIR" in capsys.readouterr().err
    only_ar = A.write_run(tmp_path / "only-ar", strats=(A.AR,))
    with pytest.raises(SystemExit):
        cli.main(["policy", str(only_ar)])
    assert "no speculative strategy" in capsys.readouterr().err
    assert cli.main(["policy", str(tmp_path / "missing")]) == 2


def test_validation_compares_policy_and_best_fixed_per_tier(tmp_path):
    """Fake deploy / drive: each tier's load run is a synthetic run where the policy makes
    1.5x the autoregressive tokens/s and a quarter of its requests miss the TTFT SLO."""
    p = _derive(A.write_run(tmp_path / "run"))
    calls, stopped = [], []

    def deploy(cfg):
        names = [e["name"] for e in cfg["applications"][0]["args"]["strategies"]]
        calls.append(("deploy", names))
        return "http://127.0.0.1:1", lambda: stopped.append(True)

    def drive(url, tier, strategies, run_id):
        calls.append((tier, strategies))
        strats = [A.Strat(s, {u: 1.5 for u in A.TIERS.values()}, ttft_violation={tier: 0.25})
                  if s == p["name"] else A.Strat(s, {u: 1.0 for u in A.TIERS.values()})
                  for s in strategies]
        return A.write_run(tmp_path / "v" / run_id, run_id=run_id, strats=strats,
                           tiers={tier: A.TIERS[tier]})

    slos = {t: Slo(**v) for t, v in A.SLO.items()}
    res = validate_policy(p, None, slos, tmp_path / "out", duration_s=3.0, deploy=deploy,
                             drive=drive, log=lambda m: None)
    assert calls[0] == ("deploy", ["dflash-policy", "dflash", "ngram", "autoregressive"])
    assert calls[1:] == [("low", ["dflash-policy", "dflash"]), ("mid", ["ngram", "dflash-policy"]),
                         ("high", ["dflash-policy", "autoregressive"])]
    assert stopped == [True] and not res["errors"]
    assert len(res["rows"]) == 6
    for row in res["rows"]:
        assert row["tokens_ratio"] == pytest.approx(1.5, rel=1e-6)
        assert row["policy"]["slo_attainment"] == pytest.approx(0.75)
        assert row["best_fixed"]["slo_attainment"] == 1.0
        ar = A.AR_TOKENS_PER_S[row["users"]]
        assert row["best_fixed"]["tokens_per_s"] == pytest.approx(ar, rel=1e-6)
        assert row["goodput_ratio"] == pytest.approx(1.5 * 0.75, rel=1e-6)
    low = next(r for r in res["rows"] if r["tier"] == "low")
    assert low["band"] == "1-4" and low["k"] == 7 and low["best_fixed"]["strategy"] == mn.DFLASH
    # beside it, what the measurement run said: dflash 3.0x autoregressive at 1 user
    before = low["measurement_run"]
    assert before["policy_as"] == mn.DFLASH and before["best_fixed"] == mn.DFLASH
    assert before["policy_tokens_per_s"] == pytest.approx(150.0, rel=1e-6)
    served = yaml.safe_load(Path(res["serve_config"]).read_text())
    ServeAppConfig.model_validate(served["applications"][0]["args"])


def test_validation_keeps_going_when_a_tier_fails(tmp_path):
    p = _derive(A.write_run(tmp_path / "run"))
    stopped = []

    def drive(url, tier, strategies, run_id):
        if tier == "mid":
            raise RuntimeError("loadgen failed (exit 1)")
        strats = [A.Strat(s, {u: 1.0 for u in A.TIERS.values()}) for s in strategies]
        return A.write_run(tmp_path / "v" / run_id, run_id=run_id, strats=strats,
                           tiers={tier: A.TIERS[tier]})

    res = validate_policy(p, None, {t: Slo(**v) for t, v in A.SLO.items()}, tmp_path / "o",
                             deploy=lambda cfg: ("http://127.0.0.1:1", lambda: stopped.append(1)),
                             drive=drive, log=lambda m: None)
    assert stopped == [1] and "loadgen failed" in res["errors"]["mid"]
    assert {r["tier"] for r in res["rows"]} == {"low", "high"}


def test_profile_replayed_from_the_manifest(tmp_path):
    doc, name = pv.tiers_file({"profile": _tiny_profile(), "profile_name": "cpu"})
    assert name == pv.PROFILE_NAME and doc["profiles"][name]["tiers"]["mid"]["short"]["users"] == 2
    assert pv.tiers_file({"profile": {"bogus": 1}, "profile_name": "cpu"}) == (None, "cpu")


def _tiny_profile() -> dict:
    def cell(users):
        return {"arrival": "closed", "users": users, "spawn_rate": users, "duration_s": 3,
                "max_tokens": 8, "slo": {"ttft_ms": 20000, "tpot_ms": 5000}}
    return {"description": "policy test", "request_timeout_s": 60, "drain_timeout_s": 5,
            "max_prompt_chars": 400, "seed": 0,
            "sampling": {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": 0},
            "tiers": {t: {"short": cell(u), "long": cell(u)}
                      for t, u in (("low", 1), ("mid", 2), ("high", 4))}}


@pytest.mark.slow
def test_validation_on_the_local_service_switches_k_by_batch(tmp_path):
    """A real local service (python -m cluster up on a private Ray head): ngram wins at 1 user
    only (synthetic curves), so the policy speculates at batch 1 and not from batch 2; the
    step log of the validation run shows the engine took k from the running batch."""
    ng = A.Strat(mn.NGRAM, {1: 1.5, 2: 0.9, 4: 0.8}, (0.7, 0.5, 0.3))
    ar = A.Strat(mn.AUTOREGRESSIVE, {1: 1.0, 2: 1.0, 4: 1.0})
    tiers = {"low": 1, "mid": 2, "high": 4}
    run = A.write_run(tmp_path / "run", strats=(ar, ng), tiers=tiers,
                      ar_tps={1: 50.0, 2: 90.0, 4: 160.0})
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["profile"] = _tiny_profile()
    (run / "manifest.json").write_text(json.dumps(manifest))
    p = _derive(run)
    assert p["map"] == {"1-1": 4, "2-32": 0}
    slos = {t: Slo(ttft_ms=20000, tpot_ms=5000) for t in tiers}
    res = validate_policy(p, manifest, slos, tmp_path / "val", duration_s=3.0, output="short",
                             log=lambda m: None)
    assert not res["errors"], res["errors"]
    rows = {r["tier"]: r for r in res["rows"]}
    assert set(rows) == {"low", "mid", "high"}
    assert rows["low"]["best_fixed"]["strategy"] == mn.NGRAM
    assert rows["high"]["best_fixed"]["strategy"] == mn.AUTOREGRESSIVE
    for r in rows.values():
        assert r["policy"]["tokens_per_s"] > 0 and r["best_fixed"]["tokens_per_s"] > 0
        assert 0.0 <= r["policy"]["slo_attainment"] <= 1.0
    # batch 1 -> k = 4 on (nearly) every decode step; 4 users -> mostly k = 0
    assert rows["low"]["policy"]["k_share"].get("4", 0) >= 0.9
    assert rows["high"]["policy"]["k_share"].get("0", 0) >= 0.5
    st = pd.read_parquet(Path(res["runs"]["high"]) / "steps.parquet")
    st = st[st[mn.STEP_MODEL].eq(p["name"]) & st[mn.STEP_BATCH_SIZE].ge(2)]
    assert len(st) and st[mn.STEP_NUM_SPEC_TOKENS].eq(0).mean() >= 0.95
