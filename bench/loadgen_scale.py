"""Scale limits of the load generator and of the results pipeline (numbers for docs/scale.md).

    python -m bench.loadgen_scale load [--users 16,64,256] [--workers 0,2] [--duration 10]
    python -m bench.loadgen_scale rows [--rows 100000,1000000] [--report]

``load``: starts ``loadgen.tools.fake_server`` (its own process; TTFT 5 ms, a chunk
every 5 ms, 8 tokens, so the server is never the limit) and runs ``python -m
loadgen`` closed loop at each users level, in-process (``--workers 0``) and
with N Locust workers (Ray actors on a private local Ray), printing achieved
requests/s, output tokens/s, achieved users and the CPU% of the busiest
load-generator process. Where requests/s stops growing with users, one
process is saturated.

``rows``: synthetic runs of N request rows (3 strategies x 3 tiers x 2 output
classes x 3 users levels, realistic values) written through the real
``RequestWriter`` in 2000-row groups (rows/s, file size), N/10 step rows
through ``write_steps``, and with ``--report`` the full ``analysis report``
on them (wall time, peak RSS). Not unit tests: figures depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from configs import metric_names as M

STRATEGIES = (M.AUTOREGRESSIVE, "ngram", "dflash")
TIERS = {"low": 1, "mid": 8, "high": 64}


def synth_rows(n: int, run_id: str, start: int = 0, total: int | None = None, seed: int = 0) -> list[dict]:
    """Request rows ``start .. start+n`` of a ``total``-row run: plausible values (1% errors),
    spread over cells and over one hour."""
    rng = np.random.default_rng(seed + start)
    total = total or n
    t0 = time.time() - 3600
    rows = []
    cells = [(s, t, oc) for s in STRATEGIES for t in TIERS for oc in ("short", "long")]
    for i in range(start, start + n):
        s, t, oc = cells[i % len(cells)]
        users = TIERS[t]
        out = 32 if oc == "short" else 128
        ttft = float(rng.gamma(4, 20)) + users
        tpot = float(rng.gamma(4, 5)) + users * 0.2
        e2e = ttft + (out - 1) * tpot
        sched = t0 + i * 3600.0 / total
        k = 0 if s == M.AUTOREGRESSIVE else 4
        drafts = out // 3 if k else 0
        acc = [int(drafts * p) for p in (0.8, 0.6, 0.4, 0.2)] if k else []
        ok = rng.random() > 0.01
        rows.append({
            M.REQ_RUN_ID: run_id, M.REQ_STRATEGY: s, M.REQ_TIER: t, M.REQ_OUTPUT_CLASS: oc,
            M.REQ_DATASET: "humaneval", M.REQ_PROMPT_ID: f"p{i % 164}", M.REQ_USERS: users,
            M.REQ_ARRIVAL: "closed", M.REQ_RATE_RPS: None, M.REQ_REQUEST_INDEX: i, M.REQ_MAX_TOKENS: out,
            M.REQ_SCHEDULED_TS: sched, M.REQ_SENT_TS: sched, M.REQ_FIRST_TOKEN_TS: sched + ttft / 1e3,
            M.REQ_END_TS: sched + e2e / 1e3, M.REQ_TTFT_MS: ttft, M.REQ_TPOT_MS: tpot,
            M.REQ_ITL_P50_MS: tpot, M.REQ_ITL_P99_MS: tpot * 3, M.REQ_E2E_MS: e2e,
            M.REQ_OUTPUT_TOKENS: out, M.REQ_PROMPT_TOKENS: 200, M.REQ_NUM_CHUNKS: out,
            M.REQ_FINISH_REASON: "length", M.REQ_STATUS: M.STATUS_OK if ok else M.STATUS_ERROR,
            M.REQ_ERROR: None if ok else "HTTP 500: synthetic", M.NUM_DRAFTS: drafts,
            M.NUM_DRAFT_TOKENS: drafts * k, M.NUM_ACCEPTED_TOKENS: sum(acc),
            M.NUM_ACCEPTED_TOKENS_PER_POS: acc, M.ACCEPTANCE_LENGTH: 1 + sum(acc) / drafts if drafts else 1.0,
            M.DRAFT_MS: 0.3 * drafts, M.VERIFY_MS: 1.0 * drafts, M.QUEUE_MS: 1.0, M.REQ_REPEAT: 0})
    return rows


def synth_steps(n: int, run_id: str, seed: int = 1) -> list[dict]:
    """``n`` engine step rows (a hinge step cost in batch tokens), labelled like a loadgen run."""
    rng = np.random.default_rng(seed)
    t0 = time.time() - 3600
    cells = [(s, t, oc) for s in STRATEGIES for t in TIERS for oc in ("short", "long")]
    rows = []
    for i in range(n):
        s, t, oc = cells[i % len(cells)]
        batch = int(rng.integers(1, TIERS[t] + 1))
        k = 0 if s == M.AUTOREGRESSIVE else 4
        verif = batch * (k + 1)
        emitted = batch * (1 + (2 if k else 0))
        step = max(5.0, 1.0 + 0.05 * verif) + float(rng.normal(0, 0.2))
        rows.append({M.STEP_TS: t0 + i * 3600.0 / n, M.STEP_STRATEGY: s, M.STEP_MODEL: s, M.STEP_REPLICA: "0",
                     M.STEP_BATCH_SIZE: batch, M.STEP_PREFILL_TOKENS: 0, M.STEP_VERIFICATION_TOKENS: verif,
                     M.STEP_DRAFT_TOKENS: batch * k, M.STEP_ACCEPTED_TOKENS: emitted - batch,
                     M.STEP_EMITTED_TOKENS: emitted, M.STEP_PREFILL_EMITTED_TOKENS: 0, M.STEP_MS: step,
                     M.STEP_DRAFT_MS: 0.3 if k else 0.0, M.STEP_VERIFY_MS: step - (0.3 if k else 0.0),
                     M.STEP_QUEUE_DEPTH: 0, M.REQ_RUN_ID: run_id, M.REQ_TIER: t, M.REQ_OUTPUT_CLASS: oc,
                     M.REQ_USERS: TIERS[t]})
    return rows


def bench_rows(n: int, report: bool, root: Path) -> dict:
    """Write a synthetic n-row run; optionally time the analysis report on it."""
    from loadgen.results.writer import RequestWriter, write_manifest, write_steps

    run = root / f"synth-{n}"
    run.mkdir(parents=True, exist_ok=True)
    w = RequestWriter(run / "requests.parquet")
    write_s = 0.0
    for start in range(0, n, 2000):   # generated in chunks (memory), timed only while written
        rows = synth_rows(min(2000, n - start), run.name, start, n)
        t = time.perf_counter()
        for r in rows:
            w.add(r)
        w.flush()
        write_s += time.perf_counter() - t
    t = time.perf_counter()
    w.close()
    write_s += time.perf_counter() - t
    steps = synth_steps(max(n // 10, 1), run.name)
    t = time.perf_counter()
    write_steps(run / "steps.parquet", steps)
    steps_s = time.perf_counter() - t
    slo = {"ttft_ms": 2000.0, "tpot_ms": 100.0}
    write_manifest(run / "manifest.json", {"run_id": run.name, "status": "finished", "started_ts": time.time(),
                                           "config": {"slo": {t: slo for t in TIERS}}})
    out = {"rows": n, "write_s": round(write_s, 2), "rows_per_s": round(n / write_s),
           "requests_mb": round((run / "requests.parquet").stat().st_size / 2**20, 1),
           "step_rows": len(steps), "steps_write_s": round(steps_s, 2),
           "step_rows_per_s": round(len(steps) / steps_s),
           "steps_mb": round((run / "steps.parquet").stat().st_size / 2**20, 1)}
    del steps
    if report:
        t = time.perf_counter()
        p = subprocess.run([sys.executable, "-c", (
            "import resource, sys; from analysis.report.build import build_report; "
            f"build_report({str(run)!r}, {str(run / 'report')!r}); "
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)")],
            capture_output=True, text=True)
        out["report_s"] = round(time.perf_counter() - t, 1)
        out["report_ok"] = p.returncode == 0
        out["report_peak_rss_mb"] = (round(int(p.stdout.strip().splitlines()[-1]) / 1024)
                                     if p.returncode == 0 else p.stderr[-500:])
    return out


def bench_load(users: int, workers: int, duration: float, root: Path, url: str) -> dict:
    """One closed-loop cell against the fake server; achieved figures from the run's manifest."""
    from bench.loadgen_timing import tiers_file

    d = root / f"u{users}-w{workers}"
    d.mkdir(parents=True, exist_ok=True)
    tiers = tiers_file(d, users, duration, 8)
    t = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "loadgen", "--tier", "low", "--output", "short", "--target", url,
                        "--tiers-file", str(tiers), "--results", str(d / "res"), "--strategies",
                        M.AUTOREGRESSIVE, "--workers", str(workers)], capture_output=True, text=True)
    wall = time.perf_counter() - t
    if p.returncode != 0:
        return {"users": users, "workers": workers, "error": (p.stdout + p.stderr)[-800:]}
    (run,) = list((d / "res").iterdir())
    man = json.loads((run / "manifest.json").read_text())
    (cell,) = man["cells"]
    import pandas as pd

    req = pd.read_parquet(run / "requests.parquet")
    ok = req[req[M.REQ_STATUS] == M.STATUS_OK]
    span = float(ok[M.REQ_END_TS].max() - ok[M.REQ_SCHEDULED_TS].min()) if len(ok) else float("nan")
    row = {"users": users, "workers": workers, "wall_s": round(wall, 1), "n_ok": len(ok),
           "requests_per_s": round(len(ok) / span, 1) if len(ok) else 0.0}
    for k in ("n_requests", "output_tokens_per_s", "achieved_concurrency", "cpu_mean_percent",
              "cpu_max_percent", "ttft_ms_p50", "ttft_ms_p99"):
        if k in cell:
            row[k] = round(cell[k], 1) if isinstance(cell[k], float) else cell[k]
    if cell.get("workers"):
        row["worker_cpu_mean_percent"] = [w["cpu_percent_mean"] for w in cell["workers"]]
        row["worker_users"] = [w["users_max"] for w in cell["workers"]]
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    lo = sub.add_parser("load")
    lo.add_argument("--users", default="16,64,256")
    lo.add_argument("--workers", default="0,2")
    lo.add_argument("--duration", type=float, default=10.0)
    ro = sub.add_parser("rows")
    ro.add_argument("--rows", default="100000,1000000")
    ro.add_argument("--report", action="store_true")
    ap.add_argument("--out", default="", help="directory for the runs (default: a temp dir)")
    a = ap.parse_args(argv)
    root = Path(a.out or tempfile.mkdtemp(prefix="specload-scale-"))
    if a.cmd == "rows":
        for n in (int(float(x)) for x in a.rows.split(",")):
            print(json.dumps(bench_rows(n, a.report, root)), flush=True)
        return 0
    from loadgen.tools import fake_server

    with fake_server.running("--ttft-ms", "5", "--gap-ms", "5", "--tokens-per-chunk", "1") as url:
        for users in (int(x) for x in a.users.split(",")):
            for workers in (int(x) for x in a.workers.split(",")):
                print(json.dumps(bench_load(users, workers, a.duration, root, url)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
