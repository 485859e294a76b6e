"""``python -m loadgen.tools.soak``: a long mixed-strategy run that checks the service does not decay.

    python -m loadgen.tools.soak --minutes 10 [--target URL] [--strategies a,b] [--tier mid]
        [--results DIR] [--warmup-s S] [--sample-s S] [--profile cpu|gpu] [--tiers-file FILE]

Traffic: the tier's cells (default ``mid``: its users, arrival and max_tokens),
short and long outputs alternating in chunks of ``--chunk-s`` seconds, every
request going to the next strategy in turn (request i -> strategy i mod n), so
all replicas serve at once. Without ``--target`` the local service is started or
reused (``python -m cluster up``).

Checks (pass = exit 0, else 1; figures in ``<results>/<run_id>/soak.json`` and
the request rows in its ``cells/`` files):

- 0 failed requests (error, timeout, disconnected) and 0 rejected (429);
- every replica's RSS after the soak within ``--max-rss-growth`` (10 %) of its RSS
  after the warm-up (the first ``--warmup-s`` seconds: caches, allocator pools);
- step-log memory bounded: each replica's ring buffer at or below its capacity and
  its unpushed rows below ``MAX_PENDING_STEP_ROWS``;
- no file-descriptor leak: each replica's open fds after the soak at most
  ``--fd-slack`` above the count after the warm-up;
- no replica restarted (same process id throughout).

Replica RSS and fds (the replica's process and its engine process together) are
read with psutil from the process ids ``/specload/info`` reports (``pid``,
``engine_pid``), so the checks need the service on this machine (a remote ``--target``
gets the request checks only).
"""

if __name__ == "__main__":   # gevent's patching first, before anything imports sockets or threads
    from gevent import monkey

    monkey.patch_all()

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import uuid  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from configs import metric_names as M  # noqa: E402
from configs.jsonio import write_json  # noqa: E402
from configs.tiers import TierConfigError, load_tiers  # noqa: E402

MAX_PENDING_STEP_ROWS = 5000   # unpushed step rows per replica (pushed every 0.5 s; 100k is the hard cap)
MIX = "mixed"                  # the plan's strategy label (each row carries the strategy it went to)


def replica_facts(target: str) -> dict[str, dict[str, Any]]:
    """``GET /specload/info``: per served strategy {pid, step_log_rows, step_log_capacity, ...}."""
    from loadgen.run.service import specload_info

    return {k: v for k, v in specload_info(target).items() if isinstance(v, dict) and "pid" in v}


def sample(target: str) -> dict[str, dict[str, Any]]:
    """Per strategy: pid, engine_pid, RSS (MB) and open fds of the replica and its engine
    process together, step-log rows held / capacity, unpushed step rows."""
    import psutil

    out = {}
    for name, f in replica_facts(target).items():
        row = {"pid": f["pid"], "engine_pid": f.get("engine_pid", f["pid"]),
               "step_log_rows": f.get("step_log_rows"),
               "step_log_capacity": f.get("step_log_capacity"), "pending_step_rows": f.get("pending_step_rows")}
        try:   # the replica and its engine process (one process when the engine runs on a thread)
            procs = [psutil.Process(int(x)) for x in dict.fromkeys([row["pid"], row["engine_pid"]])]
            row.update(rss_mb=sum(p.memory_info().rss for p in procs) / 2**20,
                       num_fds=sum(p.num_fds() for p in procs))
        except (psutil.Error, OSError):   # not on this machine, or gone
            row.update(rss_mb=None, num_fds=None)
        out[name] = row
    return out


def judge(rows: list[dict], before: dict, after: dict, max_rss_growth: float, fd_slack: int) -> dict[str, Any]:
    """The soak verdict from its rows and the replica samples after warm-up (``before``) and at the end."""
    statuses: dict[str, int] = {}
    for r in rows:
        statuses[r[M.REQ_STATUS]] = statuses.get(r[M.REQ_STATUS], 0) + 1
    failed = sum(statuses.get(s, 0) for s in M.FAILURE_STATUSES)
    problems = []
    if failed:
        problems.append(f"{failed} failed request(s): {statuses}")
    if statuses.get(M.STATUS_REJECTED):
        problems.append(f"{statuses[M.STATUS_REJECTED]} rejected (429) request(s)")
    if not statuses.get(M.STATUS_OK):
        problems.append("no successful request")
    replicas = {}
    for name, b in before.items():
        a = after.get(name, {})
        rep: dict[str, Any] = {"pid_before": b.get("pid"), "pid_after": a.get("pid"),
                               "rss_mb_before": b.get("rss_mb"), "rss_mb_after": a.get("rss_mb"),
                               "fds_before": b.get("num_fds"), "fds_after": a.get("num_fds"),
                               "step_log_rows": a.get("step_log_rows"),
                               "step_log_capacity": a.get("step_log_capacity"),
                               "pending_step_rows": a.get("pending_step_rows")}
        if a.get("pid") != b.get("pid"):
            problems.append(f"{name}: replica restarted (pid {b.get('pid')} -> {a.get('pid')})")
        elif a.get("engine_pid") != b.get("engine_pid"):
            problems.append(f"{name}: engine process restarted (pid {b.get('engine_pid')} -> "
                            f"{a.get('engine_pid')})")
        if b.get("rss_mb") and a.get("rss_mb") is not None:
            rep["rss_growth"] = a["rss_mb"] / b["rss_mb"] - 1.0
            if rep["rss_growth"] > max_rss_growth:
                problems.append(f"{name}: RSS grew {rep['rss_growth']:.1%} after warm-up "
                                f"({b['rss_mb']:.0f} -> {a['rss_mb']:.0f} MB; limit {max_rss_growth:.0%})")
        if b.get("num_fds") is not None and a.get("num_fds") is not None:
            rep["fd_growth"] = a["num_fds"] - b["num_fds"]
            if rep["fd_growth"] > fd_slack:
                problems.append(f"{name}: open fds {b['num_fds']} -> {a['num_fds']} (leak; slack {fd_slack})")
        cap, held = a.get("step_log_capacity"), a.get("step_log_rows")
        if cap is not None and held is not None and held > cap:
            problems.append(f"{name}: step log holds {held} rows > capacity {cap}")
        if (a.get("pending_step_rows") or 0) > MAX_PENDING_STEP_ROWS:
            problems.append(f"{name}: {a['pending_step_rows']} step rows not pushed (> {MAX_PENDING_STEP_ROWS})")
        replicas[name] = rep
    return {"passed": not problems, "problems": problems, "requests": len(rows), "by_status": statuses,
            "failed": failed, "replicas": replicas}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m loadgen.tools.soak", description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, required=True, help="soak length, minutes (warm-up included)")
    ap.add_argument("--target", default="", help="base URL (default: start/reuse the local service)")
    ap.add_argument("--strategies", default="", help="comma-separated (default: the target's /v1/models)")
    ap.add_argument("--tier", default="mid", help="tier whose cells set users, arrival and max_tokens")
    ap.add_argument("--profile", default="")
    ap.add_argument("--tiers-file", default="")
    ap.add_argument("--results", default="results")
    ap.add_argument("--warmup-s", type=float, default=None,
                    help="seconds before the 'before' sample (default: 20%% of the soak, at least 10 s)")
    ap.add_argument("--chunk-s", type=float, default=30.0, help="seconds per cell (outputs alternate)")
    ap.add_argument("--sample-s", type=float, default=10.0, help="replica sampling period, seconds")
    ap.add_argument("--max-rss-growth", type=float, default=0.10, help="allowed RSS growth after warm-up")
    ap.add_argument("--fd-slack", type=int, default=8, help="allowed growth of a replica's open fds")
    return ap


class _Soak:
    """One soak's state: where it writes, what it has seen, and when it started (epoch s)."""

    def __init__(self, run_id: str, run_dir: Path, writer: Any, target: str,
                 strategies: list[str]) -> None:
        self.run_id, self.run_dir, self.writer = run_id, run_dir, writer
        self.target, self.strategies = target, strategies
        self.rows: list[dict] = []
        self.samples: list[dict] = [{"t_s": 0.0, "replicas": sample(target)}]
        self.state: dict[str, Any] = {"before": None, "last": 0.0}
        self.t_start = time.time()


def _parse(argv: list[str] | None) -> tuple[argparse.Namespace, float, float]:
    """Parse and check the flags; return (args, soak seconds, warm-up seconds). Exits 2 on a bad one."""
    ap = build_parser()
    a = ap.parse_args(argv)
    if not a.minutes > 0:
        ap.error(f"--minutes must be > 0, got {a.minutes}")
    total_s = a.minutes * 60.0
    warmup_s = a.warmup_s if a.warmup_s is not None else max(10.0, 0.2 * total_s)
    if not 0 <= warmup_s < total_s:
        ap.error(f"--warmup-s must be in [0, {total_s:g}) seconds, got {warmup_s:g}")
    return a, total_s, warmup_s


def _open_soak(a: argparse.Namespace, warmup_s: float, service: Any, profile: Any) -> tuple[_Soak, list]:
    """Resolve the target (starting the local service without ``--target``) and strategies, load
    the prompts, create the run directory and its row sink; print the soak's header line."""
    from loadgen.run.cells import shuffled_prompts
    from loadgen.run.datasets import DEFAULT_DATASET, load_dataset
    from loadgen.results.writer import RowSink

    target = (a.target or service.start_local_service()).rstrip("/")
    strategies = ([s.strip() for s in a.strategies.split(",") if s.strip()] if a.strategies
                  else service.list_models(target))
    prompts = shuffled_prompts(load_dataset(DEFAULT_DATASET, profile.max_prompt_chars), profile.seed)
    run_id = f"{time.strftime('%Y%m%d-%H%M%S')}-soak-{uuid.uuid4().hex[:6]}"
    run_dir = Path(a.results) / run_id
    run_dir.mkdir(parents=True)
    s = _Soak(run_id, run_dir, RowSink(run_dir), target, strategies)
    print(f"soak {run_id}: {a.minutes:g} min of mixed {','.join(strategies)} at tier {a.tier} against "
          f"{target}; warm-up {warmup_s:g} s; results in {run_dir}", flush=True)
    return s, prompts


def _drive(a: argparse.Namespace, s: _Soak, profile: Any, prompts: list, total_s: float,
           warmup_s: float) -> None:
    """Run alternating short/long mixed cells of ``--chunk-s`` seconds until the soak's time is
    up, sampling the replicas every ``--sample-s`` seconds (and once after the warm-up)."""
    from loadgen.run.cells import CellPlan
    from loadgen.run.datasets import DEFAULT_DATASET
    from loadgen.run.locust_runner import LoadRunner

    def tick(now: float, runner: Any) -> None:
        if now - s.state["last"] >= a.sample_s:
            s.state["last"] = now
            s.samples.append({"t_s": now - s.t_start, "replicas": sample(s.target)})
        if s.state["before"] is None and now - s.t_start >= warmup_s:
            s.state["before"] = sample(s.target)

    def on_row(row: dict) -> None:
        s.rows.append(row)
        s.writer.add(row)

    runner = LoadRunner(0, on_row=on_row)
    k = 0
    try:
        while (left := total_s - (time.time() - s.t_start)) > 1.0:
            oc = ("short", "long")[k % 2]
            cell = profile.cell(a.tier, oc)
            t0 = time.time() + 0.2
            dur = min(a.chunk_s, left)
            plan = CellPlan(run_id=s.run_id, strategy=MIX, model=MIX, tier=a.tier, output_class=oc,
                            dataset=DEFAULT_DATASET, base_url=s.target, arrival=cell.arrival, users=cell.users,
                            rate_rps=cell.rate_rps, start_ts=t0, deadline_ts=t0 + dur,
                            prompts=[[p.prompt_id, p.text, p.max_tokens] for p in prompts],
                            max_tokens=cell.max_tokens.model_dump(), seed=profile.seed + k,
                            sampling=profile.sampling.model_dump(), extra_body=dict(profile.extra_body),
                            request_timeout_s=profile.request_timeout_s, cell_id=f"soak/{k}",
                            mix=list(s.strategies))
            s.writer.start_cell(f"{k + 1:03d}-{MIX}-{a.tier}-{oc}")
            try:
                runner.run_cell(plan, cell.spawn_rate, profile.drain_timeout_s, tick)
            finally:
                s.writer.end_cell()
            k += 1
    finally:
        runner.close()
        s.writer.close()


def _close_soak(a: argparse.Namespace, s: _Soak, warmup_s: float) -> int:
    """Take the last sample, judge the soak, write ``soak.json`` and print the verdict;
    return the exit code (0 passed, 1 not)."""
    after = sample(s.target)
    s.samples.append({"t_s": time.time() - s.t_start, "replicas": after})
    before = s.state["before"] or s.samples[0]["replicas"]
    verdict = judge(s.rows, before, after, a.max_rss_growth, a.fd_slack)
    verdict.update(run_id=s.run_id, target=s.target, strategies=s.strategies, tier=a.tier,
                   minutes=a.minutes, warmup_s=warmup_s, wall_s=time.time() - s.t_start,
                   initial=s.samples[0]["replicas"], samples=s.samples)
    write_json(s.run_dir / "soak.json", verdict)
    print(json.dumps({k: verdict[k] for k in ("passed", "requests", "by_status", "problems")}), flush=True)
    for name, r in verdict["replicas"].items():
        print(f"  {name}: RSS {r['rss_mb_before']} -> {r['rss_mb_after']} MB, fds {r['fds_before']} -> "
              f"{r['fds_after']}, step log {r['step_log_rows']}/{r['step_log_capacity']} rows", flush=True)
    print(f"soak: {s.run_dir / 'soak.json'}", flush=True)
    return 0 if verdict["passed"] else 1


def main(argv: list[str] | None = None) -> int:
    a, total_s, warmup_s = _parse(argv)
    # imported here, in this order, as before the phases were split (locust after gevent's patching)
    from loadgen.run import service
    from loadgen.run.cells import CellPlan, shuffled_prompts  # noqa: F401
    from loadgen.run.datasets import DEFAULT_DATASET, load_dataset  # noqa: F401
    from loadgen.run.locust_runner import LoadRunner  # noqa: F401
    from loadgen.results.writer import RowSink  # noqa: F401

    try:
        profile = load_tiers(a.tiers_file or None).profile(a.profile or None)
        profile.cell(a.tier, "short")
    except (TierConfigError, KeyError) as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    s, prompts = _open_soak(a, warmup_s, service, profile)
    _drive(a, s, profile, prompts, total_s, warmup_s)
    return _close_soak(a, s, warmup_s)

if __name__ == "__main__":
    sys.exit(main())
