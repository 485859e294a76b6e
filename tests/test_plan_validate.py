"""``analysis plan --validate``: choice, attainment arithmetic, generated configs, the
N / N-1 verdict, and one pass through the real load generator against the fake server."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from analysis.campaigns.plan_validation import validate_plan
from analysis.decide import validate as va
from configs import metric_names as mn
from configs.serve_config import ServeAppConfig
from configs.tiers import Slo, load_tiers

SLO = Slo(ttft_ms=1000.0, tpot_ms=100.0, source="flags")


def _rows(n: int, good_share: float, t0: float = 1000.0, spacing: float = 0.1,
          rate: float | None = None) -> pd.DataFrame:
    n_good = int(round(n * good_share))
    return pd.DataFrame({
        mn.REQ_TIER: "high", mn.REQ_SCHEDULED_TS: t0 + spacing * np.arange(n),
        mn.REQ_RATE_RPS: rate if rate is not None else 1.0 / spacing,
        mn.REQ_STATUS: [mn.STATUS_OK] * (n - 2) + [mn.STATUS_TIMEOUT, mn.STATUS_ERROR],
        mn.REQ_TTFT_MS: [100.0] * n_good + [5000.0] * (n - n_good),
        mn.REQ_TPOT_MS: 10.0, mn.REQ_OUTPUT_TOKENS: 30})


def test_choose_fewest_replicas_then_capacity():
    rows = [{"strategy": "a", "output_class": "long", "replicas": 3, "capacity_rps": 1.0},
            {"strategy": "b", "output_class": "long", "replicas": 2, "capacity_rps": 1.5},
            {"strategy": "c", "output_class": "long", "replicas": 2, "capacity_rps": 1.8},
            {"strategy": "d", "output_class": "long", "replicas": None, "capacity_rps": None,
             "note": "SLO attainment < 90% at every level"}]
    assert va.choose(rows) == va.Choice("c", "long", 2, 1.8)
    assert va.choose(rows, strategy="a").replicas == 3
    with pytest.raises(ValueError, match="no feasible"):
        va.choose(rows, strategy="d")


def test_attainment_counts_failures_and_drops_warmup():
    df = _rows(100, 0.9)   # rows 0..89 within the SLOs; 90..99 miss TTFT (two also failed)
    att, n = va.attainment(df, SLO, warmup_s=0.0)
    assert (att, n) == (0.9, 100)
    att, n = va.attainment(df, SLO, warmup_s=5.0)  # rows scheduled before t0 + 5 s dropped
    assert n == 50 and att == pytest.approx(40 / 50)
    assert math.isnan(va.attainment(df.iloc[0:0], SLO)[0])


def test_generated_serve_config_and_tier_file_validate(tmp_path):
    cfg = va.serve_config(mn.AUTOREGRESSIVE, 2)
    args = ServeAppConfig.model_validate(cfg["applications"][0]["args"])
    assert [s.name for s in args.strategies] == [mn.AUTOREGRESSIVE]
    assert args.strategies[0].num_replicas == 2 and args.strategies[0].engine["torch_threads"] == 1
    with pytest.raises(ValueError):
        va.serve_config("nope", 1)
    # the limits a plan was made for (plan --max-num-seqs / --max-waiting) are what it deploys
    small = va.serve_config(mn.AUTOREGRESSIVE, 2, engine={"max_num_seqs": 2, "max_waiting": 0})
    eng = ServeAppConfig.model_validate(small["applications"][0]["args"]).strategies[0].engine
    assert eng["max_num_seqs"] == 2 and eng["max_waiting"] == 0
    f = tmp_path / "t.yaml"
    f.write_text(yaml.safe_dump(va.tiers_file("high", "long", 3.5, 30, SLO,
                                              {"dist": "uniform", "min": 96, "max": 128})))
    cell = load_tiers(f).profile("validate").cell("high", "long")
    assert cell.arrival == "open" and cell.rate_rps == 3.5 and cell.duration_s == 30
    assert cell.slo.ttft_ms == 1000 and cell.max_tokens.max == 128


def test_max_tokens_from_the_run_and_sweep_template():
    man = {"profile": {"tiers": {"high": {"long": {"max_tokens": {"dist": "fixed", "value": 77}}}}},
           "sweep": {"template_tier": "high"}}
    assert va.run_max_tokens(man, "high", "long") == {"dist": "fixed", "value": 77}
    assert va.run_max_tokens(man, "sweep", "long") == {"dist": "fixed", "value": 77}
    assert va.load_tier("sweep", {}) == "high" and va.load_tier("mid") == "mid"
    shipped = va.run_max_tokens(None, "low", "short")
    assert shipped["dist"] == "fixed" and shipped["value"] >= 1


def test_validate_verdict_with_n_and_n_minus_one(tmp_path):
    share = {2: 0.95, 1: 0.40}
    deployed = []

    def deploy(strategy, n):
        deployed.append((strategy, n))
        return f"http://fake/{n}", lambda: None

    def drive(url, run_id):   # 200 requests at 2 req/s over 100 s: qps x duration exactly
        n = int(url.rsplit("/", 1)[1])
        d = tmp_path / run_id
        d.mkdir()   # a fresh run id each time: an existing directory would raise here
        _rows(200, share[n], spacing=0.5).to_parquet(d / "requests.parquet")
        return d

    res = validate_plan(va.Choice(mn.AUTOREGRESSIVE, "long", 2, 1.0), 2.0, "high", SLO, 0.9,
                           32, tmp_path / "out", duration_s=100, warmup_s=0.0, deploy=deploy,
                           drive=drive, log=lambda m: None)
    assert deployed == [(mn.AUTOREGRESSIVE, 2), (mn.AUTOREGRESSIVE, 1)]
    assert {"strategy", "replicas", "qps", "attainment", "attainment_minus_one", "slo_target"} <= set(res)
    assert res["attainment"] == pytest.approx(0.95) and res["attainment_minus_one"] == pytest.approx(0.40)
    assert res["holds"] and res["tight"] and res["replicas"] == 2 and res["qps"] == 2.0
    assert res["arrivals"]["2"]["expected"] == 200.0 and res["arrivals"]["2"]["ok"]
    assert res["runs"]["2"] != res["runs"]["1"]
    assert res["cpu_share"] == {"2": None, "1": None}   # no step log written by this drive
    steps = pd.DataFrame({mn.STEP_MS: [10.0, 30.0, 5.0], mn.STEP_CPU_MS: [4.0, 6.0, None]})
    (tmp_path / "sd").mkdir()
    steps.to_parquet(tmp_path / "sd" / "steps.parquet")
    assert va.cpu_share(tmp_path / "sd") == pytest.approx(10.0 / 40.0)
    # a one-replica plan: N - 1 = 0 replicas serve nothing
    share[1] = 0.97
    res = validate_plan(va.Choice(mn.AUTOREGRESSIVE, "long", 1, 2.0), 2.0, "high", SLO, 0.9,
                           32, tmp_path / "out1", duration_s=100, warmup_s=0.0, deploy=deploy,
                           drive=lambda url, rid: drive(url, rid + "-b"), log=lambda m: None)
    assert res["attainment_minus_one"] == 0.0 and res["requests_minus_one"] == 0 and res["holds"]
    # a count that cannot be deployed keeps the other's figure and says why

    def flaky(strategy, n):
        if n == 1:
            raise RuntimeError("ray head timed out")
        return deploy(strategy, n)
    share[2] = 0.95
    res = validate_plan(va.Choice(mn.AUTOREGRESSIVE, "long", 2, 1.0), 2.0, "high", SLO, 0.9,
                           32, tmp_path / "out2", duration_s=100, warmup_s=0.0, deploy=flaky,
                           drive=lambda url, rid: drive(url, rid + "-c"), log=lambda m: None)
    assert res["attainment"] == pytest.approx(0.95) and res["holds"]
    assert res["attainment_minus_one"] is None and res["tight"] is None
    assert "timed out" in res["errors"]["1"]


def test_arrivals_are_qps_times_duration_and_a_stale_run_is_refused(tmp_path):
    """The open-loop schedule the load generator uses holds ~qps x duration arrivals; a
    validation that read another run's requests (once: 246 requests at 6.5 and at 9 req/s)
    or a load generator that stopped early gets no figure."""
    from loadgen.run.cells import poisson_schedule
    for qps, dur in ((1.3, 60.0), (6.5, 45.0), (9.0, 45.0), (40.0, 30.0)):
        counts = [len(poisson_schedule(qps, dur, seed)) for seed in range(20)]
        mean = qps * dur
        assert abs(np.mean(counts) - mean) < 3 * math.sqrt(mean / len(counts)) + 1
        assert all(va.arrivals_check(c, qps, dur)["ok"] for c in counts)
        sched = poisson_schedule(qps, dur, 0)
        assert 0 < sched[0] and sched[-1] < dur and sched[-1] > 0.8 * dur  # the whole duration
    chk = va.arrivals_check(246, 9.0, 45.0)
    assert chk["expected"] == 405.0 and chk["sigma"] == pytest.approx(20.125, abs=1e-3)
    assert not chk["ok"] and va.arrivals_check(246, 6.5, 45.0)["ok"]
    with pytest.raises(ValueError):
        va.arrivals_check(10, 0.0, 45.0)
    # a run driven at another rate (a stale directory) and a short run are refused
    with pytest.raises(RuntimeError, match="not this validation's run"):
        va.check_run(_rows(292, 1.0, spacing=1 / 6.5), 9.0, 45.0)
    with pytest.raises(RuntimeError, match="expects 405"):
        va.check_run(_rows(246, 1.0, spacing=45 / 246, rate=9.0), 9.0, 45.0)
    assert va.check_run(_rows(400, 1.0, spacing=45 / 400, rate=9.0), 9.0, 45.0)["ok"]
    assert va.run_id_for("ar", 2) != va.run_id_for("ar", 2)

    def deploy(strategy, n):
        return "http://fake", lambda: None

    stale = tmp_path / "stale"
    stale.mkdir()
    _rows(292, 1.0, spacing=1 / 6.5).to_parquet(stale / "requests.parquet")
    res = validate_plan(va.Choice(mn.AUTOREGRESSIVE, "long", 2, 1.0), 9.0, "high", SLO, 0.9,
                           32, tmp_path / "out", duration_s=45, warmup_s=0.0, deploy=deploy,
                           drive=lambda url, rid: stale, log=lambda m: None)
    assert res["attainment"] is None and res["holds"] is None
    assert "not this validation's run" in res["errors"]["2"]


@pytest.mark.slow
def test_validate_drives_open_loop_load_through_loadgen(tmp_path):
    from loadgen.tools import fake_server
    with fake_server.running("--ttft-ms", "20", "--gap-ms", "5", "--tokens-per-chunk", "2") as url:
        res = validate_plan(va.Choice(mn.AUTOREGRESSIVE, "short", 2, 5.0), 8.0, "low", SLO, 0.9,
                               8, tmp_path / "out", duration_s=2.0, warmup_s=0.0,
                               deploy=lambda s, n: (url, lambda: None), log=lambda m: None)
    # the fake server has no capacity limit: both counts meet the SLO
    assert res["attainment"] == 1.0 and res["attainment_minus_one"] == 1.0
    assert res["holds"] and not res["tight"]
    assert 6 <= res["requests"] <= 30   # Poisson at 8/s for 2 s
    assert res["arrivals"]["2"]["ok"] and res["arrivals"]["1"]["ok"]
    df = pd.read_parquet(Path(res["runs"]["2"]) / "requests.parquet")
    assert set(df[mn.REQ_ARRIVAL]) == {"open"} and df[mn.REQ_RATE_RPS].eq(8.0).all()
