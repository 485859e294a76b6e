"""Fault injection on real processes: what a user sees and what is lost.

Each fault of README "Faults" is made real here: a strategy replica's process
killed by pid mid run, a load-generator worker (Ray actor) killed by pid, open-
loop overload at 3x the measured capacity, ``kill -9`` of the load generator
(and of its writer) mid cell, and a 1-minute soak. The service is the real one
(``python -m cluster up`` on a private Ray head, the tiny engine on
``models/target``), shut down in the fixture's ``finally``. Every request loop
is bounded in count and time.

The first tests are fast checks of the pieces the slow ones rely on (outage
window, degraded recommendation, retry delay).
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import psutil
import pytest

from analysis.data import faults
from configs import metric_names as M
from loadgen.run.cells import parse_retry_after, retry_delay_s
from tests.serve_fixtures import cluster_up, process_running
from tests.tiers_file import write_tiers

REPO = Path(__file__).resolve().parent.parent


# ----------------------------------------------------------------- fast checks
def _row(strategy, status, end, first=None, tokens=8, tier="low", oc="short"):
    return {M.REQ_RUN_ID: "r", M.REQ_STRATEGY: strategy, M.REQ_TIER: tier, M.REQ_OUTPUT_CLASS: oc,
            M.REQ_USERS: 2, M.REQ_STATUS: status, M.REQ_SCHEDULED_TS: end - 1.0, M.REQ_END_TS: end,
            M.REQ_FIRST_TOKEN_TS: first, M.REQ_OUTPUT_TOKENS: tokens if status == "ok" else None,
            M.REQ_RETRIES: 0}


def test_a_timeout_opens_the_outage_at_its_last_sign_of_life():
    """A partitioned node: requests in flight time out a full timeout after the cut (115),
    their first tokens came at ~105: the window opens there, not at 115."""
    rows = [_row("ngram", "ok", 100.0 + i, 99.5 + i) for i in range(5)]
    rows += [_row("ngram", "timeout", 115.0, first=105.1), _row("ngram", "timeout", 115.2)]
    rows += [_row("ngram", "ok", 121.0, 120.0)]
    out = faults.outages(pd.DataFrame(rows)).set_index(M.REQ_STRATEGY)
    # the second timeout had no token: its send time (scheduled 114.2 here) is later
    assert out.loc["ngram", "outage_start_ts"] == pytest.approx(105.1)
    assert out.loc["ngram", "outage_end_ts"] == 120.0 and out.loc["ngram", "recovered"]


def test_outage_window_timeline_and_degraded_note():
    rows = [_row("ngram", "ok", 100.0 + i, 99.5 + i) for i in range(5)]           # 100..104 ok
    rows += [_row("ngram", "disconnected", 105.2), _row("ngram", "disconnected", 105.3)]  # replica died
    rows += [_row("ngram", "ok", 113.0 + i, 112.0 + i) for i in range(3)]          # back: token at 112.0
    rows += [_row("autoregressive", "ok", 100.0 + i, 99.6 + i) for i in range(8)]
    rows += [_row("autoregressive", "rejected", 101.5)]                           # 429: not a failure
    df = pd.DataFrame(rows)
    out = faults.outages(df).set_index(M.REQ_STRATEGY)
    assert out.loc["ngram", "n_failed"] == 2 and out.loc["ngram", "failed_by_status"] == "disconnected: 2"
    assert out.loc["ngram", "outage_start_ts"] == 105.2 and out.loc["ngram", "outage_end_ts"] == 112.0
    assert out.loc["ngram", "outage_s"] == pytest.approx(6.8) and out.loc["ngram", "recovered"]
    assert out.loc["autoregressive", "n_failed"] == 0 and out.loc["autoregressive", "n_rejected"] == 1
    assert math.isnan(out.loc["autoregressive", "outage_s"])
    tl = faults.timeline(df)
    ng = tl[tl[M.REQ_STRATEGY].eq("ngram")].set_index("t_s")
    t_fail = math.floor(105.2 - tl.attrs["t0"])
    assert ng.loc[t_fail, "n_failed"] == 2 and ng.loc[t_fail, "error_rate"] == 1.0
    assert ng.loc[t_fail + 2, "n_ended"] == 0 and ng.loc[t_fail + 2, "output_tokens_per_s"] == 0  # the gap
    rec = {"low": {"short": {"strategy": "autoregressive", "note": ""}}, "mid": {"short": {"note": ""}}}
    faults.annotate_degraded(rec, faults.outages(df))
    assert rec["low"]["short"]["degraded"] and "degraded run" in rec["low"]["short"]["note"]
    assert rec["low"]["short"]["degraded_strategies"]["ngram"]["failed"] == 2
    assert rec["mid"]["short"]["degraded"] is False


def test_retry_delay_honours_retry_after():
    assert retry_delay_s(1, None, 0.5) == 0.5 and retry_delay_s(3, None, 0.5) == 2.0
    assert retry_delay_s(1, 3.0, 0.5) == 3.0            # never sooner than Retry-After
    assert retry_delay_s(10, None, 0.5, cap_s=5.0) == 5.0
    assert parse_retry_after("2") == 2.0 and parse_retry_after(None) is None
    assert parse_retry_after("soon") is None


# ----------------------------------------------------------------- the real service
TIGHT = "tight"   # autoregressive with 2 batch slots and 2 waiting: overloads at once


def _get(url: str, timeout: float = 30.0):
    import httpx

    return httpx.get(url, timeout=timeout)


def _info(url: str) -> dict:
    return _get(f"{url}/specload/info").json()


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    """``python -m cluster up`` on a private Ray head: autoregressive, ngram (8 slots) and TIGHT;
    ``cluster down`` in ``finally`` whatever happens."""
    base = {"model": "models/target", "torch_threads": 1, "max_num_seqs": 8, "max_waiting": 64}
    # every engine in its own process ("auto" keeps it on a thread on a 2-core box): the
    # faults below cover the replica / engine-process pair
    strategies = [
        {"engine": {"strategy": "autoregressive", "num_speculative_tokens": 0, **base},
         "ray_actor_options": {"num_cpus": 0.2}, "engine_process": True},
        {"engine": {"strategy": "ngram", "num_speculative_tokens": 4, **base},
         "ray_actor_options": {"num_cpus": 0.2}, "engine_process": True},
        {"name": TIGHT, "engine": {"strategy": "autoregressive", "num_speculative_tokens": 0,
                                   **base, "max_num_seqs": 2, "max_waiting": 2},
         "ray_actor_options": {"num_cpus": 0.1}, "engine_process": True},
    ]
    with cluster_up(tmp_path_factory.mktemp("svc"), strategies) as url:
        yield url


def _tiers(tmp: Path, cell: dict, drain_s: float = 8, timeout_s: float = 60) -> Path:
    base = {"arrival": "closed", "users": 2, "spawn_rate": 100, "duration_s": 10, "max_tokens": 12,
            "slo": {"ttft_ms": 5000, "tpot_ms": 1000}}
    return write_tiers(tmp, {**base, **cell}, request_timeout_s=timeout_s, drain_timeout_s=drain_s,
                       profile="faults", max_prompt_chars=300, seed=0,
                       sampling={"temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": 0})


def _loadgen(url: str, tiers: Path, results: Path, strategies: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "loadgen", "--tier", "low", "--output", "short", "--target", url,
            "--tiers-file", str(tiers), "--results", str(results), "--strategies", strategies,
            # every request counts here (the outage starts at the kill): no warm-up requests or cut
            "--warmup-requests", "0", "--warmup-s", "0", *extra]


def _run_dir(results: Path) -> Path:
    (d,) = [p for p in results.iterdir() if p.is_dir()]
    return d


def _run_dir_once_made(results: Path) -> Path | None:
    """The run directory, or None while the load generator has not made it yet."""
    dirs = [p for p in results.iterdir() if p.is_dir()] if results.is_dir() else []
    return dirs[0] if len(dirs) == 1 else None


def _wait(cond, timeout_s: float, what: str, every_s: float = 0.2):
    """Poll ``cond()`` until truthy (returned) or ``timeout_s`` (AssertionError naming ``what``)."""
    end = time.time() + timeout_s
    while time.time() < end:
        v = cond()
        if v:
            return v
        time.sleep(every_s)
    raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")


def _cell_rows(run_dir: Path, name_part: str) -> int:
    files = [p for p in (run_dir / "cells").glob("*.parquet") if name_part in p.name] \
        if (run_dir / "cells").is_dir() else []
    return sum(pq.ParquetFile(p).metadata.num_rows for p in files)


def _manifest(run_dir: Path) -> dict:
    """The run's manifest.json, {} until it is first written."""
    try:
        return json.loads((run_dir / "manifest.json").read_text())
    except (OSError, ValueError):
        return {}


def _rss_mb(pid: int) -> float:
    import psutil

    return psutil.Process(pid).memory_info().rss / 2**20


@pytest.mark.slow
def test_replicas_and_engine_processes_run_at_normal_priority(service):
    """Ray starts its workers 15 nice levels below their starter; the service's replicas and
    their engine processes run at the starter's own priority, like a model server
    (configs.net.RAY_WORKER_PRIORITY_ENV), or anything else on a shared box (the load
    generator itself) starves the engine mid cell."""
    info = _info(service)
    mine = os.nice(0)   # Ray's increment is relative: the service inherits this process's nice
    for strategy in ("autoregressive", "ngram", TIGHT):
        assert psutil.Process(info[strategy]["pid"]).nice() == mine, strategy
        assert psutil.Process(info[strategy]["engine_pid"]).nice() == mine, strategy


def test_reset_prefix_cache_reaches_engine_processes(service):
    """The engine-process path of ``POST /reset_prefix_cache`` (a ``call`` applied between
    steps in the child): every strategy here runs its engine in its own process."""
    r = _get_post(f"{service}/reset_prefix_cache")
    assert r.status_code == 200, r.text
    assert r.json() == {"success": True, "strategies": {"autoregressive": True, "ngram": True, TIGHT: True}}
    for strategy in ("autoregressive", "ngram"):
        r = _get_post(f"{service}/strategies/{strategy}/reset_prefix_cache")
        assert r.status_code == 200 and r.json() == {"success": True}, (strategy, r.text)


def _get_post(url: str, timeout: float = 30.0):
    import httpx

    return httpx.post(url, timeout=timeout)


def test_overload_sheds_with_429_and_retry_after(service, tmp_path):
    """Open loop at 3x the measured capacity of a 2-slot replica: 429 + Retry-After, `rejected`
    rows apart from errors, retries counted, the replica neither crashes nor grows."""
    import httpx

    pid = _info(service)[TIGHT]["pid"]
    body = {"model": TIGHT, "prompt": "def add(a, b):", "max_tokens": 12, "temperature": 0}
    # capacity: 2 slots / e2e of one request (median of 3 sequential ones), requests/s
    e2e = []
    for _ in range(3):
        t = time.time()
        r = httpx.post(f"{service}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        e2e.append(time.time() - t)
    capacity = 2 / sorted(e2e)[1]
    rss0 = _rss_mb(pid)
    # one burst straight at the API: more than slots + waiting at once
    from concurrent.futures import ThreadPoolExecutor

    # long requests (~1 s each), so none finishes while the burst is still arriving
    burst = {**body, "max_tokens": 200, "ignore_eos": True}
    with ThreadPoolExecutor(12) as ex:
        res = list(ex.map(lambda _: httpx.post(f"{service}/v1/completions", json=burst, timeout=120),
                          range(12)))
    shed = [r for r in res if r.status_code == 429]
    assert shed and all(r.status_code in (200, 429) for r in res), [r.status_code for r in res]
    assert shed[0].headers["retry-after"] == "1" and shed[0].json()["error"]["code"] == "queue_full"
    # the load generator at 3x capacity, retrying a 429 once
    tiers = _tiers(tmp_path, {"arrival": "open", "rate_rps": round(3 * capacity, 2), "users": 64,
                              "spawn_rate": 1000, "duration_s": 8})
    p = subprocess.run(_loadgen(service, tiers, tmp_path / "res", TIGHT, "--retry", "1",
                                "--retry-backoff-s", "0.2"), cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    df = pd.read_parquet(_run_dir(tmp_path / "res") / "requests.parquet")
    by = df[M.REQ_STATUS].value_counts().to_dict()
    assert by.get(M.STATUS_REJECTED, 0) > 0 and by.get(M.STATUS_OK, 0) > 0, by
    assert not df[M.REQ_STATUS].isin(M.FAILURE_STATUSES).any(), by     # shed, never failed
    rej = df[df[M.REQ_STATUS].eq(M.STATUS_REJECTED)]
    assert rej[M.REQ_ERROR].str.startswith("HTTP 429").all()
    retried = df[df[M.REQ_RETRIES] > 0]
    assert len(retried) > 0 and set(df[M.REQ_RETRIES].unique()) <= {0, 1}
    # a retry waited for Retry-After (1 s) before its re-send: sent_ts is the last send
    assert ((retried[M.REQ_SENT_TS] - retried[M.REQ_SCHEDULED_TS]) >= 0.99).all()
    # never crashed, memory bounded: same process, healthy, RSS within 10% (+20 MB)
    info = _info(service)[TIGHT]
    rss1 = _rss_mb(pid)
    assert info["pid"] == pid and _get(f"{service}/health").status_code == 200
    assert rss1 <= rss0 * 1.10 + 20, (rss0, rss1)
    print(f"\nFIGURES overload: capacity {capacity:.2f} req/s, offered {3 * capacity:.2f} req/s, "
          f"statuses {by}, retried {len(retried)} (ok after retry "
          f"{int(retried[M.REQ_STATUS].eq(M.STATUS_OK).sum())}), burst 429s {len(shed)}/12, "
          f"replica RSS {rss0:.0f} -> {rss1:.0f} MB")


@pytest.mark.slow
def test_kill9_of_the_load_generator_keeps_rows_up_to_the_last_second(service, tmp_path):
    """kill -9 of the driver and of its writer process mid cell: the cell file is readable and
    holds every row up to ~1 s before the kill."""
    tiers = _tiers(tmp_path, {"users": 4, "duration_s": 60, "max_tokens": 4})
    results = tmp_path / "res"
    proc = subprocess.Popen(_loadgen(service, tiers, results, "autoregressive"), cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        run_dir = _wait(lambda: _run_dir_once_made(results), 120, "run dir")
        _wait(lambda: _cell_rows(run_dir, "autoregressive") >= 20, 120, "20 rows in the cell file")
        time.sleep(3.0)
        writer_pid = _wait(lambda: _manifest(run_dir).get("writer_pid"), 30, "the manifest")
        t_kill = time.time()
        os.kill(proc.pid, signal.SIGKILL)
        os.kill(writer_pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    (cell,) = list((run_dir / "cells").glob("*.parquet"))
    df = pq.read_table(cell).to_pandas()                      # readable after the kill
    ok = df[df[M.REQ_STATUS].eq(M.STATUS_OK)]
    gap = t_kill - df[M.REQ_END_TS].max()
    rate = len(ok) / (ok[M.REQ_END_TS].max() - ok[M.REQ_SCHEDULED_TS].min())
    assert len(ok) >= 20 and gap <= 2.0, (len(ok), gap)
    from analysis.data.load import load_results

    assert len(load_results(run_dir).requests) == len(df)    # the analysis reads the killed run
    print(f"\nFIGURES kill -9: {len(df)} rows kept, newest row {gap:.2f} s before the kill, "
          f"~{gap * rate:.1f} rows lost at {rate:.1f} rows/s")


@pytest.mark.slow
def test_replica_killed_mid_run_is_replaced_and_shown(service, tmp_path):
    """SIGKILL of the ngram replica's process in the middle of its cell: Serve starts a new one,
    the run finishes, the lost requests are rows with their own status, the report shows the
    outage window and says the recommendation rests on a degraded run."""
    old_pid = _info(service)["ngram"]["pid"]
    old_engine_pid = _info(service)["ngram"]["engine_pid"]
    assert old_engine_pid != old_pid and psutil.Process(old_engine_pid).ppid() == old_pid
    # 4 users x 32 tokens: requests in the replica nearly all the time, and the kill waits
    # until the replica says one is running (a kill between requests loses none: Serve's
    # router holds new ones until the replacement is up, so no row would fail)
    tiers = _tiers(tmp_path, {"users": 4, "duration_s": 30, "max_tokens": 32})
    results = tmp_path / "res"
    proc = subprocess.Popen(_loadgen(service, tiers, results, "ngram,autoregressive", "--report"), cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        run_dir = _wait(lambda: _run_dir_once_made(results), 120, "run dir")
        _wait(lambda: _cell_rows(run_dir, "-ngram-") >= 4, 120, "4 ngram rows")
        _wait(lambda: _info(service)["ngram"]["num_running"] >= 1, 30, "an ngram request running",
              every_s=0.01)
        t_kill = time.time()
        os.kill(old_pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-4000:]
    # the killed replica's engine process went with it (its socket closed)
    _wait(lambda: not process_running(old_engine_pid), 10, "the killed replica's engine process to exit")
    new_pid = _wait(lambda: _info(service)["ngram"]["pid"] != old_pid and _info(service)["ngram"]["pid"],
                    120, "a new ngram replica")
    df = pd.read_parquet(run_dir / "requests.parquet")
    ng = df[df[M.REQ_STRATEGY].eq("ngram")]
    failed = ng[ng[M.REQ_STATUS].isin(M.FAILURE_STATUSES)]
    assert len(failed) >= 1 and (failed[M.REQ_END_TS] >= t_kill - 0.5).all(), ng[M.REQ_STATUS].value_counts()
    assert failed[M.REQ_ERROR].notna().all()
    back = ng[ng[M.REQ_STATUS].eq(M.STATUS_OK) & (ng[M.REQ_FIRST_TOKEN_TS] > t_kill)]
    assert len(back) >= 1, "no ngram request served by the new replica within the cell"
    # the default route: the replica's own listener (Serve's direct ingress) until the kill;
    # the killed replica's port refuses, so the users resend on the proxy's route, whose
    # router holds them until the replacement is up (unless it came back on the same port)
    before = ng[ng[M.REQ_STATUS].eq(M.STATUS_OK) & (ng[M.REQ_END_TS] < t_kill)]
    assert len(before) >= 4 and before[M.REQ_ROUTE].eq("direct").all(), before[M.REQ_ROUTE].value_counts()
    assert set(ng[M.REQ_ROUTE]) <= {"direct", "strategy"}
    assert len(failed) <= 4, failed[[M.REQ_STATUS, M.REQ_ERROR]]   # at most the 4 users' in flight
    ar = df[df[M.REQ_STRATEGY].eq("autoregressive")]
    assert ar[M.REQ_STATUS].eq(M.STATUS_OK).all()             # the other strategy never noticed
    rec = json.loads((run_dir / "report" / "recommendation.json").read_text())
    cell = rec["low"]["short"]
    assert cell["degraded"] and "degraded run" in cell["note"] and "ngram" in cell["degraded_strategies"]
    outage_s = cell["degraded_strategies"]["ngram"]["outage_s"]
    assert 0 < outage_s < 120
    md = (run_dir / "report" / "report.md").read_text()
    assert "## Faults and outages" in md and ("disconnected" in md or "error" in md)
    html = (run_dir / "report" / "report.html").read_text()
    assert 'id="fig-timeline"' in html
    print(f"\nFIGURES replica kill: pid {old_pid} -> {new_pid}; {len(failed)} request(s) lost "
          f"({failed[M.REQ_STATUS].value_counts().to_dict()}), outage {outage_s:.1f} s, "
          f"{len(back)} ok after the replacement ({back[M.REQ_ROUTE].value_counts().to_dict()}), "
          f"{len(ng)} ngram rows")


@pytest.mark.slow
def test_load_worker_killed_mid_run(service, tmp_path):
    """SIGKILL of one Locust worker's Ray actor process mid cell: its locust process follows it,
    the cell finishes on the other worker, the rows it had sent are kept, the manifest records
    the loss (and the requests it had in flight)."""
    import psutil

    # 14 s: the kill comes after 10 rows (a few seconds in); the loss is recorded within
    # ~4 s of it (Ray at once, else missed heartbeats) and the other worker goes on after
    tiers = _tiers(tmp_path, {"users": 4, "duration_s": 14, "max_tokens": 8})
    results = tmp_path / "res"
    # the workers' own private local Ray (as `--workers` without --ray-address does for a user)
    proc = subprocess.Popen(_loadgen(service, tiers, results, "autoregressive", "--workers", "2"), cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        run_dir = _wait(lambda: _run_dir_once_made(results), 120, "run dir")
        workers = _wait(lambda: _manifest(run_dir).get("load_workers") or proc.poll() is not None,
                        400, "load workers in the manifest", every_s=0.5)
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        _wait(lambda: _cell_rows(run_dir, "autoregressive") >= 10, 120, "10 rows")
        victim = workers[1]
        t_kill = time.time()
        os.kill(victim["actor_pid"], signal.SIGKILL)
        _wait(lambda: not psutil.pid_exists(victim["locust_pid"])
              or psutil.Process(victim["locust_pid"]).status() == psutil.STATUS_ZOMBIE, 10,
              "the killed actor's locust worker to exit")
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-4000:]
    man = json.loads((run_dir / "manifest.json").read_text())
    windows = [{k: v for k, v in c.items() if k.endswith("_ts") or k.endswith("_s")} for c in man.get("cells", [])]
    assert len(man["worker_losses"]) == 1, (f"killed at {t_kill:.2f}; cell windows {windows}; "
                                            f"finished {man.get('finished_ts')}\n{out[-4000:]}")
    (loss,) = man["worker_losses"]
    assert loss["lost_ts"] >= t_kill and loss["live_workers"] == 1
    df = pd.read_parquet(run_dir / "requests.parquet")
    rank = loss["worker_index"]             # both alive at the cell start: rank = worker index
    dead = df[df[M.REQ_REQUEST_INDEX] % 2 == rank]
    live = df[df[M.REQ_REQUEST_INDEX] % 2 != rank]
    assert len(dead) == loss["rows_delivered"] > 0                  # what it sent is kept
    assert (dead[M.REQ_END_TS] <= t_kill + 0.5).all()
    assert (live[M.REQ_END_TS] > loss["lost_ts"]).any()             # the other worker went on
    assert df[M.REQ_STATUS].eq(M.STATUS_OK).all()
    print(f"\nFIGURES worker kill: {len(dead)} rows of the dead worker kept, "
          f"{loss['in_flight_at_last_report']} in-flight request(s) lost, detected by {loss['detected_by']} "
          f"{loss['lost_ts'] - t_kill:.1f} s after the kill; {len(live)} rows from the live worker")


@pytest.mark.slow
def test_soak_one_minute(service, tmp_path):
    """``python -m loadgen.tools.soak --minutes 1``: mixed strategies at the mid tier, no errors, RSS
    within 10% after warm-up, step log bounded, no fd leak, no restart."""
    tiers = _tiers(tmp_path, {"users": 4, "duration_s": 10, "max_tokens": 16})
    p = subprocess.run([sys.executable, "-m", "loadgen.tools.soak", "--minutes", "1", "--target", service,
                        "--strategies", "autoregressive,ngram", "--tiers-file", str(tiers), "--results",
                        str(tmp_path / "soak"), "--warmup-s", "15", "--chunk-s", "20", "--sample-s", "5"],
                       cwd=REPO, capture_output=True, text=True, timeout=400)
    (d,) = list((tmp_path / "soak").iterdir())
    verdict = json.loads((d / "soak.json").read_text())
    assert p.returncode == 0, (verdict["problems"], p.stdout[-3000:], p.stderr[-3000:])
    assert verdict["passed"] and verdict["failed"] == 0 and verdict["by_status"].get("ok", 0) > 10
    assert set(verdict["replicas"]) >= {"autoregressive", "ngram"}
    rows = pd.concat([pd.read_parquet(f) for f in sorted((d / "cells").glob("*.parquet"))])
    assert set(rows[M.REQ_STRATEGY]) == {"autoregressive", "ngram"}     # mixed traffic
    for name in ("autoregressive", "ngram"):
        r = verdict["replicas"][name]
        assert r["rss_growth"] < 0.10 and r["fd_growth"] <= 8 and r["step_log_rows"] <= r["step_log_capacity"]
    print("\nFIGURES soak 1 min: " + "; ".join(
        f"{n}: RSS {r['rss_mb_before']:.0f} -> {r['rss_mb_after']:.0f} MB ({r['rss_growth']:+.1%}), fds "
        f"{r['fds_before']} -> {r['fds_after']}, step log {r['step_log_rows']}/{r['step_log_capacity']}"
        for n, r in verdict["replicas"].items()) + f"; {verdict['requests']} requests {verdict['by_status']}")


@pytest.mark.slow
def test_engine_process_killed_is_503_then_replaced(service):
    """SIGKILL of one strategy's engine process (by the pid ``/specload/info`` gives): its
    requests get 503 ``engine_unavailable`` at once (over HTTP, through live Ray), ``/health``
    names it, the other strategies serve on, and Serve replaces the replica (its health check
    fails) so the strategy serves again."""
    import httpx

    before = _info(service)[TIGHT]
    os.kill(before["engine_pid"], signal.SIGKILL)
    _wait(lambda: not process_running(before["engine_pid"]), 10, "the engine process to exit")
    body = {"model": TIGHT, "prompt": "def f(x):", "max_tokens": 4, "temperature": 0}
    r = _wait(lambda: (x := httpx.post(f"{service}/v1/completions", json=body, timeout=30))
              .status_code == 503 and x, 10, "a 503 from the dead engine")
    assert r.json()["error"]["code"] == "engine_unavailable", r.text
    health = _get(f"{service}/health")
    assert health.status_code in (200, 503)   # 200 once Serve already replaced it
    if health.status_code == 503:
        assert TIGHT in health.json()["error"]["message"]
    ok = httpx.post(f"{service}/v1/completions", json={**body, "model": "autoregressive"}, timeout=60)
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"
    t0 = time.time()
    after = _wait(lambda: (i := _info(service).get(TIGHT)) and i["pid"] != before["pid"] and i,
                  120, "Serve to replace the replica")
    back = _wait(lambda: (x := httpx.post(f"{service}/v1/completions", json=body, timeout=60))
                 .status_code == 200 and x, 60, "the replaced replica to serve")
    assert back.json()["usage"]["completion_tokens"] == 4
    assert after["engine_pid"] != before["engine_pid"] and process_running(after["engine_pid"])
    print(f"\nFIGURES engine process kill: 503 engine_unavailable at once; replica pid "
          f"{before['pid']} -> {after['pid']} within {time.time() - t0:.1f} s, serving again")
