"""Multi-node Ray on one machine: replica placement, load workers spread over nodes, node loss.

One module-scoped cluster (``tests.multinode_cluster``): a head (Serve
controller + HTTP proxy, and the ingress + step-log store placed there by the
head-only custom resource ``specload_front``; no strategy resource) and two worker nodes that
advertise the custom resource ``specload_strategy`` (the stand-in for
``num_gpus`` on a GPU cluster). The app is ``configs/serve.yaml``'s
autoregressive and ngram entries with ``ray_actor_options.resources:
{specload_strategy: 1}`` and the fake engine (sleeps, no CPU). The head runs
with a 1 s GCS health check so a killed raylet is noticed in ~3 s.
Everything is stopped by pid; ``ray stop`` is never run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
httpx = pytest.importorskip("httpx")
pq = pytest.importorskip("pyarrow.parquet")

from configs import metric_names as mn  # noqa: E402
from configs.net import RAY_MULTI_NODE_ENV, free_port  # noqa: E402
from tests.multinode_cluster import LocalCluster  # noqa: E402
from tests.tiers_file import write_tiers  # noqa: E402

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
RESOURCE = "specload_strategy"
FRONT = "specload_front"   # only the head has it: the ingress and the step-log store live there
STRATEGIES = ("autoregressive", "ngram")
SLO = {"ttft_ms": 5000, "tpot_ms": 1000}


def _app_args() -> dict:
    """configs/serve.yaml's entries for STRATEGIES, placed by RESOURCE, on the fake engine."""
    cfg = yaml.safe_load((REPO / "configs" / "serve.yaml").read_text())
    base = cfg["applications"][0]["args"]
    strategies = []
    for e in base["strategies"]:
        if e["engine"]["strategy"] in STRATEGIES:
            e = dict(e)
            e["engine"] = {**e["engine"], "max_model_len": 4096, "step_ms": 5, "max_num_seqs": 8,
                           "max_waiting": 64}
            e["ray_actor_options"] = {"num_cpus": 0.05, "resources": {RESOURCE: 1}}
            strategies.append(e)
    return {"strategies": strategies,
            "ingress": {"ray_actor_options": {"num_cpus": 0.05, "resources": {FRONT: 0.1}}},
            "engine_factory": "tests.fake_engine:make_fake_engine"}


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env["RAY_AUTH_MODE"] = "disabled"   # the test cluster runs without token auth
    return env


@pytest.fixture(scope="module")
def cluster():
    saved = {k: os.environ.get(k) for k in ("RAY_AUTH_MODE", *RAY_MULTI_NODE_ENV)}
    os.environ["RAY_AUTH_MODE"] = "disabled"
    os.environ.update(RAY_MULTI_NODE_ENV)   # this driver and the load generators it starts
    c = LocalCluster()
    try:
        c.start_head(num_cpus=1, resources={FRONT: 1}, system_config={"health_check_period_ms": 1000,
                                                "health_check_failure_threshold": 3,
                                                "agent_register_timeout_ms": 300000})
        c.add_worker("w1", 1, {RESOURCE: 2})
        c.add_worker("w2", 1, {RESOURCE: 2})
        ray.init(address=c.address, log_to_driver=False)
        c.wait_nodes(timeout_s=240)
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
        from actors.serve.app import run_applications

        run_applications(_app_args(), name="specload", route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        _wait_ready(url, STRATEGIES, 180)
        yield c, url
    finally:
        if ray.is_initialized():   # serve.shutdown() would otherwise ray.init() somewhere
            try:
                serve.shutdown()
            except Exception:  # noqa: BLE001  (cluster half up)
                pass
            ray.shutdown()
        c.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _wait_ready(url: str, names, timeout_s: float) -> None:
    t0 = time.monotonic()
    pending = list(names)
    while pending and time.monotonic() - t0 < timeout_s:
        for n in list(pending):
            try:
                r = httpx.post(url + "/v1/completions", timeout=30, json={
                    "model": n, "prompt": "hello", "max_tokens": 2, "temperature": 0})
                if r.status_code == 200:
                    pending.remove(n)
            except httpx.HTTPError:
                pass
        time.sleep(0.5)
    assert not pending, f"not ready after {timeout_s} s: {pending}"


def _alive_actors() -> list[dict]:
    from ray._private import state

    return [a for a in state.actors().values() if a["State"] == "ALIVE"]


def _replica_nodes() -> dict[str, list[str]]:
    """strategy -> node ids of its ALIVE replicas (from the GCS actor table)."""
    out: dict[str, list[str]] = {}
    for a in _alive_actors():
        cls = a.get("ActorClassName") or ""
        for s in STRATEGIES:
            if cls.endswith(f"strategy-{s}"):
                out.setdefault(s, []).append(a["Address"]["NodeID"])
    return out


def _tiers(tmp_path: Path, users: int, duration_s: float, max_tokens: int = 24) -> Path:
    cell = {"users": users, "spawn_rate": 100, "duration_s": duration_s, "max_tokens": max_tokens,
            "slo": SLO}
    return write_tiers(tmp_path, cell, request_timeout_s=30, drain_timeout_s=10)


def _loadgen(url: str, tiers: Path, results: Path, *extra: str, timeout: float = 240
             ) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "loadgen", "--tier", "low", "--output", "short", "--target", url,
           "--tiers-file", str(tiers), "--results", str(results), *extra]
    return subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _finish(p: subprocess.Popen, timeout: float = 240) -> str:
    out, _ = p.communicate(timeout=timeout)
    assert p.returncode == 0, out[-4000:]
    return out


def _run_dir(results: Path) -> Path:
    (d,) = list(results.iterdir())
    return d


def test_replicas_on_resource_nodes_head_keeps_proxy_and_controller(cluster):
    c, url = cluster
    with_resource = {n.node_id for n in c.nodes if n.resources.get(RESOURCE)}
    head = c.node("head").node_id
    placed = _replica_nodes()
    assert sorted(placed) == sorted(STRATEGIES)
    for strategy, nodes in placed.items():
        assert len(nodes) == 1 and nodes[0] in with_resource, (strategy, nodes, with_resource)
    names = {a.get("ActorClassName"): a["Address"]["NodeID"] for a in _alive_actors()}
    assert names["ServeController"] == head
    proxies = [a["Address"]["NodeID"] for a in _alive_actors() if a.get("ActorClassName") == "ProxyActor"]
    assert proxies == [head]                           # proxy_location: HeadOnly
    # the ingress's custom resource keeps it and the step-log store on the head
    assert _deployment_nodes("openai-ingress") == {head} == _deployment_nodes("step-log-store")
    print("placement:", {s: [c.node_name(n) for n in ns] for s, ns in placed.items()})


def test_load_workers_spread_over_nodes(cluster, tmp_path):
    c, url = cluster
    tiers = _tiers(tmp_path, users=6, duration_s=4)
    p = _loadgen(url, tiers, tmp_path / "multi", "--strategies", "autoregressive", "--workers", "3",
                 "--ray-address", c.address)
    _finish(p)
    multi = _run_dir(tmp_path / "multi")
    man = json.loads((multi / "manifest.json").read_text())
    assert man["worker_placement"] == "spread" and len(man["load_workers"]) == 3
    nodes = {w["ray_node_id"] for w in man["load_workers"]}
    assert nodes == {n.node_id for n in c.nodes}                      # one worker on every node
    (cell,) = man["cells"]
    assert len(cell["workers"]) == 3
    assert {x["ray_node_id"] for x in cell["workers"]} == nodes
    assert sum(x["users_max"] for x in cell["workers"]) == 6         # achieved users, per worker
    assert all(x["users_max"] == 2 and x["rows"] > 0 and x["cpu_percent_max"] >= 0 and not x["lost"]
               for x in cell["workers"])
    assert man["worker_losses"] == []
    # same shape as the in-process run at the same users
    p = _loadgen(url, tiers, tmp_path / "single", "--strategies", "autoregressive")
    _finish(p)
    single = _run_dir(tmp_path / "single")
    a, b = pq.read_table(multi / "requests.parquet"), pq.read_table(single / "requests.parquet")
    assert a.schema == b.schema
    for t in (a, b):
        df = t.to_pandas()
        ok = df[df[mn.REQ_STATUS] == mn.STATUS_OK]
        assert len(ok) > 10 and ok[[mn.REQ_E2E_MS, mn.REQ_OUTPUT_TOKENS]].notna().all().all()
        assert ok[mn.REQ_TTFT_MS].notna().mean() > 0.9   # (a fake-engine EOS first: no content chunk)
    s_man = json.loads((single / "manifest.json").read_text())
    assert set(s_man["cells"][0]) == set(cell)                        # same summary fields


def _deployment_nodes(name: str) -> set[str]:
    return {a["Address"]["NodeID"] for a in _alive_actors()
            if (a.get("ActorClassName") or "").endswith(name)}


def _wait_load(url: str, strategy: str, since: float, timeout_s: float = 180) -> None:
    """Until the strategy's step log shows batches after ``since`` (the load has started)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        try:
            rows = httpx.get(url + "/specload/step_log", params={"strategy": strategy, "since": since},
                             timeout=10).json()["rows"]
            if sum(r.get(mn.STEP_BATCH_SIZE, 0) > 0 for r in rows) >= 5:
                return
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(0.5)
    raise AssertionError(f"no load reached {strategy} within {timeout_s} s")


def test_node_loss_mid_run(cluster, tmp_path):
    """Kill the raylet of a worker node that hosts a strategy replica and a Locust worker."""
    c, url = cluster
    placed = _replica_nodes()
    front = _deployment_nodes("openai-ingress") | _deployment_nodes("step-log-store")
    # the victim hosts a strategy replica but not the HTTP ingress (whose loss fails every strategy)
    choice = [(s, ns[0]) for s, ns in sorted(placed.items()) if ns[0] not in front]
    assert choice, f"every strategy replica shares a node with the ingress: {placed}, {front}"
    strategy, victim_id = choice[0]
    victim = c.node_name(victim_id)
    survivor = next(n for n in c.nodes if n.name not in ("head", victim))
    tiers = _tiers(tmp_path, users=6, duration_s=30)
    t_start = time.time()
    # the model-field route: the ingress sees the replica's death and says replica_lost (on a
    # strategy's own route the proxy just cuts the stream: disconnected, tests/test_faults.py)
    p = _loadgen(url, tiers, tmp_path / "res", "--strategies", strategy, "--workers", "3",
                 "--worker-placement", "per-node", "--ray-address", c.address,
                 "--route", "model-field")
    try:
        _wait_load(url, strategy, t_start)
        time.sleep(2.0)
        kill_ts = time.time()
        c.kill_raylet(victim)
        # Serve replaces the replica on the node that still has the resource
        t0 = time.monotonic()
        while _replica_nodes().get(strategy) != [survivor.node_id] and time.monotonic() - t0 < 120:
            time.sleep(1.0)
        moved_ts = time.time()
        assert _replica_nodes().get(strategy) == [survivor.node_id], _replica_nodes()
        _finish(p, timeout=300)
    finally:
        if p.poll() is None:
            p.kill()
    run = _run_dir(tmp_path / "res")
    df = pq.read_table(run / "requests.parquet").to_pandas()
    man = json.loads((run / "manifest.json").read_text())
    by = df[mn.REQ_STATUS].value_counts().to_dict()
    lost_replica = df[df[mn.REQ_STATUS] == mn.STATUS_REPLICA_LOST]
    # the run finished; the replica Serve started again on the survivor answers
    assert man["status"] == "finished"
    ok = df[df[mn.REQ_STATUS] == mn.STATUS_OK]
    assert (ok[mn.REQ_END_TS] < kill_ts).sum() > 0
    _wait_ready(url, [strategy], 180)
    assert _replica_nodes().get(strategy) == [survivor.node_id]
    # requests lost to the node: their own status, all ending after the kill
    assert len(lost_replica) > 0, by
    assert (lost_replica[mn.REQ_END_TS] >= kill_ts - 0.5).all()
    # requests sent while no replica was up wait in Serve's queue for the new one, or time out
    assert set(by) <= {mn.STATUS_OK, mn.STATUS_REPLICA_LOST, mn.STATUS_TIMEOUT, mn.STATUS_CANCELLED}, by
    timeouts = df[df[mn.REQ_STATUS] == mn.STATUS_TIMEOUT]
    assert (timeouts[mn.REQ_SENT_TS] >= kill_ts - 0.5).all()
    # only the load worker on the lost node was lost (with its in-flight requests)
    (lost,) = man["worker_losses"]
    (cell,) = man["cells"]
    by_index = {w["worker_index"]: w for w in cell["workers"]}
    assert by_index[lost["worker_index"]]["ray_node_id"] == victim_id and by_index[lost["worker_index"]]["lost"]
    alive = [w for w in cell["workers"] if not w["lost"]]
    assert len(alive) == 2 and all(w["ray_node_id"] != victim_id for w in alive)
    # the report shows the window of lost requests
    from analysis.report.build import build_report

    rep = build_report(run, tmp_path / "report")
    md = Path(rep["paths"]["md"]).read_text()
    assert "## Faults and outages" in md
    section = md.split("## Faults and outages", 1)[1].split("\n## ", 1)[0]
    assert strategy in section, section
    after_ok = ok[ok[mn.REQ_SENT_TS] > kill_ts]
    print(f"node loss: killed {victim} raylet at +{kill_ts - t_start:.1f} s; replica ALIVE on "
          f"{survivor.name} after {moved_ts - kill_ts:.1f} s; statuses {by}; replica_lost window "
          f"{lost_replica[mn.REQ_END_TS].min() - kill_ts:.1f}..{lost_replica[mn.REQ_END_TS].max() - kill_ts:.1f} s "
          f"after the kill; load worker lost with {lost['in_flight_at_last_report']} in flight, detected "
          f"{lost['lost_ts'] - kill_ts:.1f} s after the kill; ok after the kill: {len(after_ok)}")
