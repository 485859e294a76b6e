"""``python -m loadgen`` end to end against the fake streaming server (127.0.0.1, ephemeral ports).

The fake server runs in its own process and records the true timings of every
request, so the client's measurements are checked against ground truth. The
load generator runs as a subprocess too: locust monkey-patches gevent on import
and must not do that to the pytest process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from configs import metric_names as M
from loadgen.tools import fake_server
from tests.socket_audit import run_audited
from tests.tiers_file import write_tiers

REPO = Path(__file__).resolve().parent.parent
SLO = {"ttft_ms": 1000, "tpot_ms": 100}


def _tiers(tmp_path: Path, low_short: dict, low_long: dict | None = None, **profile) -> Path:
    cell = {"users": 2, "spawn_rate": 100, "duration_s": 2, "max_tokens": 8, "slo": SLO}
    return write_tiers(tmp_path, cell, low_short=low_short, low_long=low_long, profile="test",
                       **profile)


def _cmd(url: str, tiers: Path, results: Path, *extra: str) -> list[str]:
    # no warm-up requests: these tests count the server's own record of every request
    return [sys.executable, "-m", "loadgen", "--tier", "low", "--target", url, "--tiers-file", str(tiers),
            "--results", str(results), "--strategies", "autoregressive", "--warmup-requests", "0", *extra]


def _run(cmd: list[str], timeout: float = 90) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p


def _run_dir(results: Path) -> Path:
    (d,) = list(results.iterdir())
    return d


def _truth(url: str) -> dict:
    return fake_server.get_json(f"{url}/fake/timings")


def test_closed_loop_timing_matches_server_truth(tmp_path):
    """TTFT skips the empty first chunk, TPOT/ITL per token, tokens from usage; no waves."""
    with fake_server.running("--ttft-ms", "150", "--gap-ms", "30", "--tokens-per-chunk", "3") as url:
        tiers = _tiers(tmp_path, {"users": 4, "duration_s": 3, "max_tokens": 16},
                       {"users": 4, "duration_s": 3, "max_tokens": {"dist": "uniform", "min": 4, "max": 40}})
        _run(_cmd(url, tiers, tmp_path / "res"))
        truth = _truth(url)
    d = _run_dir(tmp_path / "res")
    df = pd.read_parquet(d / "requests.parquet")
    ok = df[df[M.REQ_STATUS] == M.STATUS_OK]
    assert len(ok) == len(df) > 20
    assert (ok[M.REQ_OUTPUT_TOKENS] == ok[M.REQ_MAX_TOKENS]).all()      # from usage (text has 2x words)
    short = ok[ok[M.REQ_OUTPUT_CLASS] == "short"]
    # configured: TTFT 150 ms after an immediate empty chunk; 3 tokens / 30 ms -> 10 ms/token
    # (never below 150: stamping the empty chunk would give ~1 ms; cold connections add a little)
    assert short[M.REQ_TTFT_MS].min() >= 148 and short[M.REQ_TTFT_MS].median() < 175
    assert short[M.REQ_TPOT_MS].median() == pytest.approx(10.0, abs=2.0)
    assert short[M.REQ_ITL_P50_MS].median() == pytest.approx(10.0, abs=2.0)
    assert short[M.REQ_NUM_CHUNKS].eq(6).all()
    # against the server's own clock: client TTFT/e2e minus the server's, per request
    errs_ttft, errs_e2e = [], []
    for _, r in ok.iterrows():
        t = truth[f"autoregressive:{int(r['request_index'])}"]
        errs_ttft.append((r[M.REQ_FIRST_TOKEN_TS] - r[M.REQ_SENT_TS]) - (t["first_content_ts"] - t["recv_ts"]))
        errs_e2e.append((r[M.REQ_END_TS] - r[M.REQ_SENT_TS]) - (t["end_ts"] - t["recv_ts"]))
    assert abs(pd.Series(errs_ttft).median()) < 0.010 and abs(pd.Series(errs_e2e).median()) < 0.010
    # closed loop without waves: most requests go out within a few ms of some request ending
    longc = ok[ok[M.REQ_OUTPUT_CLASS] == "long"].sort_values(M.REQ_SENT_TS)
    ends = sorted(longc[M.REQ_END_TS])
    later = longc[longc[M.REQ_SENT_TS] > longc[M.REQ_SENT_TS].min() + 0.01]
    gaps = [min(abs(s - e) for e in ends if e <= s + 1e-3) for s in later[M.REQ_SENT_TS]]
    assert sum(g < 0.02 for g in gaps) >= 0.9 * len(gaps)
    # the run directory
    man = json.loads((d / "manifest.json").read_text())
    assert man["status"] == "finished" and man["requests"] == len(df) and man["versions"]["locust"]
    cell = man["cells"][0]
    assert cell["achieved_concurrency"] > 3.6 and not cell["warnings"], cell
    steps = pd.read_parquet(d / "steps.parquet")
    assert set(M.STEP_LOG_COLUMNS) <= set(steps.columns) and steps[M.REQ_TIER].eq("low").any()
    assert ok[M.NUM_ACCEPTED_TOKENS_PER_POS].iloc[0].tolist() == [5, 5]


@pytest.mark.parametrize("route", ["model-field", "strategy"])
def test_failures_are_rows_and_do_not_distort_ok_rows(tmp_path, route):
    """Also the route choice: --route auto takes each strategy's one-hop route when the
    target lists it (GET /specload/routes), else the model field; the manifest says which."""
    extra = ("--strategy-routes",) if route == "strategy" else ()
    with fake_server.running("--ttft-ms", "100", "--gap-ms", "20", "--fail-every", "3",
                             "--disconnect-every", "5", *extra) as url:
        tiers = _tiers(tmp_path, {"users": 3, "duration_s": 3, "max_tokens": 12})
        # no consistency requests (they take the model field): the truth is the load's only
        _run(_cmd(url, tiers, tmp_path / "res", "--output", "short", "--consistency", "0"))
        truth = _truth(url)
    path = "/strategies/autoregressive/v1/completions" if route == "strategy" else "/v1/completions"
    assert {t["path"] for t in truth.values() if t["status"] == "ok"} == {path}
    man = json.loads((_run_dir(tmp_path / "res") / "manifest.json").read_text())
    assert man["routes"] == {"autoregressive": {
        "route": route, "base_url": url + ("/strategies/autoregressive" if route == "strategy" else "")}}
    # --server-metrics auto: a target listing one-hop routes is a specload service, whose step
    # log replaces a Prometheus page (no 404 line); another server's missing page is reported
    sm = man["server_metrics"]
    assert ("specload service" in sm.get("skipped", "")) == (route == "strategy"), sm
    assert sm.get("error"), sm
    df = pd.read_parquet(_run_dir(tmp_path / "res") / "requests.parquet")
    counts = df[M.REQ_STATUS].value_counts().to_dict()
    server = pd.Series([t["status"] for t in truth.values()]).value_counts().to_dict()
    assert counts.get(M.STATUS_ERROR) == server["error"] > 0
    assert counts.get(M.STATUS_DISCONNECTED) == server["disconnected"] > 0
    assert df[df[M.REQ_STATUS] == M.STATUS_ERROR][M.REQ_ERROR].str.contains("HTTP 500").all()
    ok = df[df[M.REQ_STATUS] == M.STATUS_OK]
    assert counts[M.STATUS_OK] == server["ok"]
    assert ok[M.REQ_TTFT_MS].min() >= 98 and ok[M.REQ_TTFT_MS].median() < 130
    assert (ok[M.REQ_OUTPUT_TOKENS] == 12).all()
    assert df[df[M.REQ_STATUS] != M.STATUS_OK][M.REQ_TPOT_MS].isna().all()


def test_open_loop_stall_shows_in_latency(tmp_path):
    """Poisson arrivals; the server stalls 1 s; requests scheduled in the stall count from their slot.

    With only 3 users, a closed-loop-style measurement would show ~3 slow requests;
    counting from the scheduled time, every request scheduled in the stall is slow.
    """
    with fake_server.running("--ttft-ms", "20", "--gap-ms", "10") as url:
        tiers = _tiers(tmp_path, {"arrival": "open", "rate_rps": 25, "users": 3, "duration_s": 4,
                                  "max_tokens": 4})
        proc = subprocess.Popen(_cmd(url, tiers, tmp_path / "res", "--output", "short"), cwd=REPO,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.time() + 60
        while not _truth(url) and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)
        stall_end = fake_server.get_json(f"{url}/fake/stall?s=1.0", method="POST")["stall_until"]
        out, _ = proc.communicate(timeout=90)
        assert proc.returncode == 0, out[-3000:]
    df = pd.read_parquet(_run_dir(tmp_path / "res") / "requests.parquet")
    ok = df[df[M.REQ_STATUS] == M.STATUS_OK]
    in_stall = ok[(ok[M.REQ_SCHEDULED_TS] > stall_end - 1.0) & (ok[M.REQ_SCHEDULED_TS] < stall_end - 0.1)]
    assert len(in_stall) > 3 * 3            # more slow requests than users: no coordinated omission
    expected = (stall_end - in_stall[M.REQ_SCHEDULED_TS]) * 1000
    assert (in_stall[M.REQ_TTFT_MS] >= expected - 30).all()
    assert ((in_stall[M.REQ_SENT_TS] - in_stall[M.REQ_SCHEDULED_TS]) > 0.05).sum() > 3  # waited for a user
    calm = ok[ok[M.REQ_SCHEDULED_TS] < stall_end - 1.2]
    assert calm[M.REQ_TTFT_MS].median() < 100
    assert "send lag" in out                # the open-loop warning fired


def test_route_choice(tmp_path):
    """--route: auto takes a listed one-hop route, model-field never does, a --model override
    needs the model field; --route strategy without a listed route exits 2 naming the flag."""
    from loadgen.cli.target import choose_routes, route_name, route_url
    from loadgen.run.service import ServiceError

    listed = {"autoregressive": "/strategies/autoregressive"}
    assert choose_routes("auto", ["autoregressive", "ngram"], listed) == {
        "autoregressive": "/strategies/autoregressive", "ngram": None}
    assert choose_routes("model-field", ["autoregressive"], listed) == {"autoregressive": None}
    assert choose_routes("auto", ["autoregressive"], listed, "served-name") == {"autoregressive": None}
    assert choose_routes("strategy", ["autoregressive"], listed) == listed
    with pytest.raises(ServiceError, match="--route strategy"):
        choose_routes("strategy", ["autoregressive", "ngram"], listed)
    # direct: the replica's own listener + the strategy route, one listener per strategy
    one = {"autoregressive": ["http://127.0.0.1:30001"]}
    chosen = choose_routes("direct", ["autoregressive"], listed, direct=one)
    assert chosen == {"autoregressive": "http://127.0.0.1:30001/strategies/autoregressive"}
    assert route_url("http://127.0.0.1:8000", chosen["autoregressive"]) == chosen["autoregressive"]
    assert route_url("http://h:1", "/strategies/x") == "http://h:1/strategies/x"
    assert route_url("http://h:1", None) == "http://h:1"
    assert [route_name(p) for p in (chosen["autoregressive"], "/strategies/x", None)] == [
        "direct", "strategy", "model-field"]
    for direct, strategies, model in (
            ({}, ["autoregressive"], ""),                                   # none listed
            ({"autoregressive": one["autoregressive"] * 2}, ["autoregressive"], ""),  # 2 replicas
            (one, ["autoregressive", "ngram"], ""),                         # ngram has none
            (one, ["autoregressive"], "served-name")):                      # --model override
        with pytest.raises(ServiceError, match="--route direct"):
            choose_routes("direct", strategies, listed, model, direct)
    with fake_server.running() as url:
        tiers = _tiers(tmp_path, {})
        p = subprocess.run(_cmd(url, tiers, tmp_path / "res", "--route", "strategy"),
                           capture_output=True, text=True, timeout=90, cwd=REPO, check=False)
        d = subprocess.run(_cmd(url, tiers, tmp_path / "res_d", "--route", "direct"),
                           capture_output=True, text=True, timeout=90, cwd=REPO, check=False)
    assert p.returncode == 2 and "--route strategy" in p.stdout, p.stdout[-2000:] + p.stderr[-2000:]
    assert d.returncode == 2 and "--route direct" in d.stdout, d.stdout[-2000:] + d.stderr[-2000:]
    assert "python -m cluster up" in d.stdout and "autoscaling_config" in d.stdout
    # auto: per strategy its one listener (direct), else its proxy route, else the model field;
    # two replicas keep the proxy's route (Serve's router spreads them only there)
    both = {"autoregressive": "/strategies/autoregressive", "ngram": "/strategies/ngram"}
    assert choose_routes("auto", ["autoregressive", "ngram", "dflash"], both, direct=one) == {
        "autoregressive": "http://127.0.0.1:30001/strategies/autoregressive",
        "ngram": "/strategies/ngram", "dflash": None}
    assert choose_routes("auto", ["autoregressive"], listed,
                         direct={"autoregressive": one["autoregressive"] * 2}) == listed
    assert choose_routes("auto", ["autoregressive"], listed, "served-name", one) == {
        "autoregressive": None}


def _fake_listener(*args: str) -> tuple[subprocess.Popen, str]:
    """A fake server this test starts (and later kills by its pid): (process, base URL)."""
    proc = subprocess.Popen([sys.executable, "-m", "loadgen.tools.fake_server", *args],
                            stdout=subprocess.PIPE, text=True, cwd=REPO)
    deadline = time.time() + 30
    line = ""
    while time.time() < deadline and not line.startswith("http") and proc.poll() is None:
        line = (proc.stdout.readline() if proc.stdout else "").strip()
    assert line.startswith("http"), f"fake listener did not start (rc {proc.poll()})"
    return proc, line


def test_direct_route_falls_back_to_the_proxy_route_when_the_listener_is_gone(tmp_path):
    """--route auto against a target listing a replica listener (``direct``) loads the
    listener; when it dies mid-cell (SIGKILL of its process: the replica's port closes),
    each user whose connection fails there takes the strategy's route through the target
    for the rest of the cell; rows say which route served them, the cell's warning and the
    manifest say that it happened and where later cells go. Only requests in flight at the
    kill are lost: at most one per user (a dying process may still accept a connection it
    never answers, so a user that failed once never tries the listener again in the cell)."""
    listener, direct_url = _fake_listener("--strategy-routes", "--ttft-ms", "20", "--gap-ms", "10")
    try:
        with fake_server.running("--strategy-routes", "--ttft-ms", "20", "--gap-ms", "10",
                                 "--direct-listener", direct_url) as url:
            tiers = _tiers(tmp_path, {"users": 3, "duration_s": 5, "max_tokens": 12})
            proc = subprocess.Popen(_cmd(url, tiers, tmp_path / "res", "--output", "short",
                                         "--consistency", "0"), cwd=REPO,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            try:
                deadline = time.time() + 60
                while len(_truth(direct_url)) < 6 and time.time() < deadline:
                    time.sleep(0.05)
                on_listener = len(_truth(direct_url))
                t_kill = time.time()
                listener.kill()
                out, _ = proc.communicate(timeout=90)
            finally:
                if proc.poll() is None:
                    proc.kill()
            assert proc.returncode == 0, out[-3000:]
            truth = _truth(url)
    finally:
        if listener.poll() is None:
            listener.kill()
    assert on_listener >= 6
    run_dir = _run_dir(tmp_path / "res")
    df = pd.read_parquet(run_dir / "requests.parquet")
    # the cell says so; the listener, still listed but dead, is left for the proxy's route
    flat = " ".join(out.split())
    assert "went by the Serve proxy's route" in flat and "the next cells take the proxy's route" in flat, out
    man = json.loads((run_dir / "manifest.json").read_text())
    assert man["routes"] == {"autoregressive": {
        "route": "strategy", "base_url": url + "/strategies/autoregressive",
        "replaced_base_urls": [direct_url + "/strategies/autoregressive"],
        "fallback_requests": int(df[M.REQ_ROUTE].eq("strategy").sum())}}
    ok = df[df[M.REQ_STATUS].eq(M.STATUS_OK)]
    direct, proxied = ok[ok[M.REQ_ROUTE].eq("direct")], ok[ok[M.REQ_ROUTE].eq("strategy")]
    assert len(direct) >= on_listener - 3 and (direct[M.REQ_END_TS] <= t_kill + 0.5).all()
    assert len(proxied) >= 10 and (proxied[M.REQ_SENT_TS] >= t_kill - 0.5).all()
    # what the target served came on the strategy's own route, one per proxied row
    assert {t["path"] for t in truth.values()} == {"/strategies/autoregressive/v1/completions"}
    assert len(truth) == len(proxied)
    lost = df[~df[M.REQ_STATUS].eq(M.STATUS_OK)]
    assert len(lost) <= 3, lost[[M.REQ_STATUS, M.REQ_ERROR]]   # at most the users' requests in flight
    assert not lost[M.REQ_ERROR].str.contains("refused").any()
    assert set(df[M.REQ_ROUTE]) <= {"direct", "strategy"}
    print(f"\nFIGURES direct fallback: {len(direct)} ok on the listener, {len(lost)} lost at the "
          f"kill ({lost[M.REQ_STATUS].value_counts().to_dict()}), {len(proxied)} ok on the proxy route")


def test_direct_route_resends_refused_requests_on_the_proxy_route(tmp_path):
    """A listener that drains (stops listening at its 6th request and closes each connection
    after its response, as a replica shutting down does) loses nothing: every user's next
    request meets a refused connection, nothing was sent, so it is resent at once on the
    strategy's route through the target; its latency counts from the first send."""
    listener, direct_url = _fake_listener("--strategy-routes", "--ttft-ms", "20", "--gap-ms", "10",
                                          "--drain-after", "6")
    try:
        with fake_server.running("--strategy-routes", "--ttft-ms", "20", "--gap-ms", "10",
                                 "--direct-listener", direct_url) as url:
            tiers = _tiers(tmp_path, {"users": 3, "duration_s": 4, "max_tokens": 12})
            p = subprocess.run(_cmd(url, tiers, tmp_path / "res", "--output", "short", "--consistency", "0"),
                               capture_output=True, text=True, timeout=120, cwd=REPO, check=False)
            truth = _truth(url)
    finally:
        listener.kill()
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    df = pd.read_parquet(_run_dir(tmp_path / "res") / "requests.parquet")
    assert df[M.REQ_STATUS].eq(M.STATUS_OK).all(), df[M.REQ_STATUS].value_counts()
    direct, proxied = df[df[M.REQ_ROUTE].eq("direct")], df[df[M.REQ_ROUTE].eq("strategy")]
    # the 6th request and those in flight with it finish on the listener, one per user at most after it
    assert 6 <= len(direct) <= 6 + 2 * 3 and len(proxied) >= 10
    # no row failed, so every user that left the listener did so by a refused (resent) request
    assert len(truth) == len(proxied)
    assert "went by the Serve proxy's route" in " ".join(p.stdout.split())


@pytest.mark.parametrize("sig, name", [(signal.SIGINT, "ctrl-c"), (signal.SIGTERM, "timeout")])
def test_interrupt_leaves_readable_parquet(tmp_path, sig, name):
    with fake_server.running("--ttft-ms", "50", "--gap-ms", "50") as url:
        tiers = _tiers(tmp_path, {"users": 3, "duration_s": 120, "max_tokens": 30})
        proc = subprocess.Popen(_cmd(url, tiers, tmp_path / "res"), cwd=REPO, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        deadline = time.time() + 60
        while len(_truth(url)) < 6 and time.time() < deadline:
            time.sleep(0.1)
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, out[-3000:]
    d = _run_dir(tmp_path / "res")
    df = pd.read_parquet(d / "requests.parquet")
    assert (df[M.REQ_STATUS] == M.STATUS_OK).sum() >= 3
    assert (df[M.REQ_STATUS] == M.STATUS_CANCELLED).sum() >= 1      # in flight when stopped: kept
    assert json.loads((d / "manifest.json").read_text())["status"] == "interrupted"


@pytest.mark.slow
def test_ray_distributed_workers(tmp_path):
    """--workers 2: Locust workers as Ray actors (subprocesses), rows streamed to the master."""
    with fake_server.running("--ttft-ms", "50", "--gap-ms", "20") as url:
        tiers = _tiers(tmp_path, {"users": 4, "duration_s": 4, "max_tokens": 8})
        p, heard = run_audited(_cmd(url, tiers, tmp_path / "res", "--output", "short",
                                     "--workers", "2"), timeout=300, cwd=REPO)
        truth = _truth(url)
    # the Locust master and the private Ray behind the workers listen on 127.0.0.1 only
    assert heard and [x for x in heard if x.ip != "127.0.0.1"] == [], heard
    print(f"\nlisteners of the run (Locust master, private Ray): {len(heard)}, all on 127.0.0.1")
    df = pd.read_parquet(_run_dir(tmp_path / "res") / "requests.parquet")
    assert len(df) == len(truth) and (df[M.REQ_STATUS] == M.STATUS_OK).all(), p.stdout[-2000:]
    idx = set(df[M.REQ_REQUEST_INDEX])
    assert any(i % 2 == 0 for i in idx) and any(i % 2 == 1 for i in idx)   # both workers sent
    # the fake server's 50 ms first-token wait is in every TTFT, which ends before the request
    # (no fixed upper bound: a loaded CI box delays the workers' sends, not the server's wait)
    assert (df[M.REQ_TTFT_MS] >= 48).all() and (df[M.REQ_TTFT_MS] < df[M.REQ_E2E_MS]).all()


@pytest.mark.slow
def test_smoke_against_real_service(tmp_path):
    """End-to-end smoke against a running specload service: SPECLOAD_TEST_URL=http://host:port."""
    url = os.environ.get("SPECLOAD_TEST_URL")
    if not url:
        pytest.skip("set SPECLOAD_TEST_URL to a running specload service")
    _run([sys.executable, "-m", "loadgen", "--tier", "low", "--target", url, "--duration", "4",
          "--results", str(tmp_path / "res")], timeout=900)
    d = _run_dir(tmp_path / "res")
    df = pd.read_parquet(d / "requests.parquet")
    assert (df[M.REQ_STATUS] == M.STATUS_OK).mean() > 0.9
    assert df[M.REQ_OUTPUT_TOKENS].gt(0).all() and df[M.REQ_TTFT_MS].gt(0).all()
    assert set(df[M.REQ_STRATEGY]) >= {M.AUTOREGRESSIVE}


@pytest.mark.parametrize("interleave", [False, True])
def test_interleave_orders_cells_cell_major(tmp_path, interleave):
    """``--repeats 2``: back to back per strategy by default (A r0, A r1, B r0, B r1);
    with ``--interleave`` every strategy in turn per repeat, odd repeats mirrored (A r0, B r0,
    B r1, A r1: ABBA)."""
    with fake_server.running("--ttft-ms", "5", "--gap-ms", "2") as url:
        tiers = _tiers(tmp_path, {"users": 1, "duration_s": 1, "max_tokens": 4})
        cmd = _cmd(url, tiers, tmp_path / "res", "--output", "short", "--consistency", "0",
                   "--repeats", "2", "--budget", "0", *(("--interleave",) if interleave else ()))
        cmd[cmd.index("--strategies") + 1] = "autoregressive,ngram"
        _run(cmd)
    df = pd.read_parquet(_run_dir(tmp_path / "res") / "requests.parquet")
    first = df.groupby([M.REQ_STRATEGY, M.REQ_REPEAT])[M.REQ_SENT_TS].min().sort_values()
    order = [f"{s} r{k}" for s, k in first.index]
    want = (["autoregressive r0", "ngram r0", "ngram r1", "autoregressive r1"] if interleave
            else ["autoregressive r0", "autoregressive r1", "ngram r0", "ngram r1"])
    assert order == want
