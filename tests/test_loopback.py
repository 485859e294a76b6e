"""A single-node ``python -m cluster up`` listens on 127.0.0.1 only (issue 23, item 2), and
comes up again at once on the port it just left (issue 23, the port check).

The audit (``tests.socket_audit``) lists every listening TCP socket, IPv4 and IPv6, of
every process of the service: the Ray head recorded in the state file, its descendants,
and any process naming its session directory. Any address but 127.0.0.1 fails the test,
named with its process and port. The self-check proves the audit does flag what it must
(a wildcard ``::`` / ``0.0.0.0`` socket, another interface's address), on sockets opened
inside a network namespace the test makes, never on this machine's interfaces.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from configs.net import (GRPC_BIND_PRELOAD, LOOPBACK, RAY_HEAD_PORT_ENV, RAY_HEAD_PORT_OPTIONS,
                         RAY_PRELOAD_ENV, RAY_SINGLE_NODE_LOOPBACK_ENV, loopback_head)
from tests.socket_audit import listeners, not_loopback, plain_ip, service_pids

REPO = Path(__file__).resolve().parent.parent

# Opens listeners on the wildcards, on the namespace host's own address and on 127.0.0.1,
# then audits its own pid with tests.socket_audit, inside the namespace it runs in.
_SELF_CHECK = r"""
import json, socket, sys, os
sys.path.insert(0, sys.argv[2])
from tests.socket_audit import listeners, not_loopback
socks = []
for family, host in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0"),
                     (socket.AF_INET, sys.argv[1]), (socket.AF_INET, "127.0.0.1")):
    s = socket.socket(family, socket.SOCK_STREAM)
    s.bind((host, 0)); s.listen(); socks.append(s)
found = listeners({os.getpid()})
print(json.dumps({"opened": [[s.getsockname()[0], s.getsockname()[1]] for s in socks],
                  "found": [[x.ip, x.port] for x in found],
                  "flagged": [[x.ip, x.port] for x in not_loopback(found)]}))
"""


def test_audit_flags_wildcards_and_other_addresses():
    """The audit really fails on a listener that is not 127.0.0.1: run in a namespace of its
    own (``tests.netns``), on sockets bound to ``::``, ``0.0.0.0`` and the namespace's own
    address, it flags exactly those three and passes the 127.0.0.1 one."""
    from tests.netns import Lab, NetnsUnavailable, check_available

    try:
        check_available()
    except NetnsUnavailable as err:
        pytest.skip(f"the self-check opens its sockets inside a network namespace: {err}")
    with Lab() as lab:
        host = lab.add_host("audit")
        r = subprocess.run(host.cmd([sys.executable, "-c", _SELF_CHECK, host.ip, str(REPO)]),
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr[-2000:]
        got = json.loads(r.stdout.strip().splitlines()[-1])
    opened = [tuple(x) for x in got["opened"]]
    assert sorted(tuple(x) for x in got["found"]) == sorted(opened), got
    assert sorted(tuple(x) for x in got["flagged"]) == sorted(opened[:3]), got
    assert ("127.0.0.1", opened[3][1]) not in {tuple(x) for x in got["flagged"]}


def test_ipv4_mapped_loopback_is_loopback_and_nothing_else_is():
    """gRPC's C core reports 127.0.0.1 listeners as ``::ffff:127.0.0.1`` (same address)."""
    assert plain_ip("::ffff:127.0.0.1") == "127.0.0.1"
    assert [plain_ip(x) for x in ("::", "::1", "0.0.0.0", "fd00::2")] == ["::", "::1", "0.0.0.0",
                                                                          "fd00::2"]


def test_loopback_head_flags_and_env():
    """The one place for a loopback head: node address and dashboard on 127.0.0.1, every
    port option and both env-only metrics ports picked distinct, Serve's gRPC preload."""
    head = loopback_head()
    flags = dict(zip(head.flags[::2], head.flags[1::2]))
    assert flags["--node-ip-address"] == LOOPBACK and flags["--dashboard-host"] == LOOPBACK
    assert all(f"--{name}" in flags for name in RAY_HEAD_PORT_OPTIONS)
    assert head.env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0"
    assert head.env[RAY_PRELOAD_ENV] == GRPC_BIND_PRELOAD
    ports = [head.ports[k] for k in RAY_HEAD_PORT_OPTIONS + RAY_HEAD_PORT_ENV]
    assert len(set(ports)) == len(ports)
    assert [head.env[k] for k in RAY_HEAD_PORT_ENV] == [str(head.ports[k]) for k in RAY_HEAD_PORT_ENV]


_GRPC_BIND = r"""
import json, os, sys
sys.path.insert(0, sys.argv[1])
import grpc
from cluster.grpc_bind import install, installed, rebind
from tests.socket_audit import listeners
assert rebind("[::]:0", "127.0.0.1") == "127.0.0.1:0" and rebind("1.2.3.4:5", "x") == "1.2.3.4:5"
assert not installed()
install(); install()
server = grpc.aio.server()
port = server.add_insecure_port("[::]:0")
print(json.dumps({"installed": installed(), "port": port,
                  "found": [[x.ip, x.port] for x in listeners({os.getpid()})]}))
"""


def test_grpc_bind_moves_a_wildcard_grpc_server_to_the_node_ip():
    """``cluster.grpc_bind.install`` (what Ray preloads into the head's workers) turns
    ``add_insecure_port("[::]:0")``, as Serve's replica calls it, into a 127.0.0.1 bind on a
    loopback node; importing the module alone changes nothing. In a child process: the
    wrap is process-wide."""
    env = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "PATH": "/usr/bin:/bin"}
    r = subprocess.run([sys.executable, "-c", _GRPC_BIND, str(REPO)], capture_output=True,
                       text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["installed"] and got["port"] > 0
    assert got["found"] == [["127.0.0.1", got["port"]]], got


_PRELOAD_FROM_ELSEWHERE = r"""
import json, os, sys, subprocess
sys.path.insert(0, sys.argv[1])
from configs.net import GRPC_BIND_PRELOAD, use_loopback_env
use_loopback_env()
# a worker of the private Ray: another directory, the interpreter's own path only
r = subprocess.run([sys.executable, "-c", f"import {GRPC_BIND_PRELOAD}"], cwd="/",
                   capture_output=True, text=True, env=dict(os.environ))
print(json.dumps({"pythonpath": os.environ["PYTHONPATH"], "rc": r.returncode, "err": r.stderr[-500:]}))
"""


def test_the_private_rays_workers_import_the_grpc_preload_from_the_checkout():
    """``use_loopback_env`` (a private Ray's entry point: bench.serving_overhead) puts the
    checkout first on PYTHONPATH, so a worker started elsewhere imports the preload that
    binds Serve's ``[::]`` gRPC servers to 127.0.0.1 even where the interpreter's own
    specload points at another directory, or at none (stop 51's suite: an editable install
    of a removed checkout left a replica listening on ``::``); a PYTHONPATH already set is
    kept after it."""
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": "/nonexistent/elsewhere"}
    r = subprocess.run([sys.executable, "-I", "-c", _PRELOAD_FROM_ELSEWHERE, str(REPO)],
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["pythonpath"].split(os.pathsep) == [str(REPO), "/nonexistent/elsewhere"]
    assert got["rc"] == 0, got["err"]


def _small_strategies() -> list[dict]:
    return [{"engine": {"strategy": "autoregressive", "model": "models/target", "max_num_seqs": 4,
                        "max_waiting": 8, "num_speculative_tokens": 0, "torch_threads": 1},
             "num_replicas": 1, "ray_actor_options": {"num_cpus": 0.2}}]


def _get(url: str) -> dict:
    import urllib.request

    with urllib.request.urlopen(url, timeout=30) as r:  # noqa: S310 (loopback, this test's service)
        return json.loads(r.read())


def _completion(url: str) -> dict:
    """A greedy 4-token, non-streamed completion at ``url``."""
    import urllib.request

    body = json.dumps({"model": "autoregressive", "prompt": "def add(a, b):", "max_tokens": 4,
                       "temperature": 0, "ignore_eos": True}).encode()
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:  # noqa: S310 (loopback, this test's service)
        return json.loads(r.read())


def _plain_bind_fails(port: int) -> bool:
    """True when a bind without ``SO_REUSEADDR`` (the old port check) fails on ``port``."""
    import socket

    with socket.socket() as s:
        try:
            s.bind((LOOPBACK, port))
            return False
        except OSError:
            return True


@pytest.mark.slow
def test_cluster_up_listens_on_loopback_only_and_comes_up_again_at_once(tmp_path):
    """A real ``cluster up`` (one strategy): every listener of every process of the service
    is on 127.0.0.1: Ray's GCS, raylet, object manager, dashboard and its agents, metrics
    export, client server, autoscaler monitor, Serve controller, proxy and each replica
    (gRPC included).

    The first start is a plain ``cluster up`` (Ray Serve's direct ingress is on by
    default): the replica's own HTTP listener is on 127.0.0.1 too, ``GET /specload/routes``
    lists it, it answers a completion with no Serve proxy in the path, and ``python -m
    loadgen`` (its default route) measures it (rows, step rows, the route in the manifest
    and in every row).

    Then ``cluster down`` and at once ``cluster up`` again on the same port (issue 23): the
    old port check bound without ``SO_REUSEADDR``, so the previous service's connections in
    TIME-WAIT made it refuse ``up`` ("in use by another server") for up to a minute,
    although nothing listened. That second start is ``--no-direct-ingress``: no direct
    listener listed. One service start serves the checks of each."""
    pytest.importorskip("ray")
    pytest.importorskip("psutil")
    import http.client

    import yaml

    from cluster.local import state_file
    from configs.net import free_port

    cfg = yaml.safe_load((REPO / "configs" / "serve.yaml").read_text())
    cfg["applications"][0]["args"]["strategies"] = _small_strategies()
    port = free_port()
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(cfg))
    up = [sys.executable, "-m", "cluster", "up", "--config", str(path), "--port", str(port),
          "--timeout", "300"]
    down = [sys.executable, "-m", "cluster", "down", "--port", str(port)]
    base = f"http://{LOOPBACK}:{port}"
    try:
        first = subprocess.run(up, cwd=REPO, capture_output=True,
                               text=True, timeout=420)
        assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
        assert first.stdout.strip().splitlines()[-1] == base
        state = json.loads(state_file(port).read_text())
        assert state["started_ray"], state
        # up again with the other setting: reused as it is, and it says so
        again = subprocess.run(up + ["--no-direct-ingress"], cwd=REPO, capture_output=True,
                               text=True, timeout=120)
        assert again.returncode == 0 and "reusing the service" in again.stderr, again.stderr[-2000:]
        assert "direct ingress on" in again.stderr and "cluster down` first" in again.stderr
        found = listeners(service_pids(state["ray_pid"]))
        direct = _get(base + "/specload/routes")["direct"]
        direct_answer = _completion(direct["autoregressive"][0]
                                    + "/strategies/autoregressive/v1/completions")
        run = subprocess.run(
            [sys.executable, "-m", "loadgen", "--target", base,
             "--strategies", "autoregressive", "--tier", "low", "--output", "short",
             "--duration", "2", "--results", str(tmp_path / "results")],
            cwd=REPO, capture_output=True, text=True, timeout=300)
        # a client holding a keep-alive connection, as a load generator does: the server
        # closes it first at shutdown, leaving TIME-WAIT on the service's own port
        keep = http.client.HTTPConnection(LOOPBACK, port, timeout=30)
        keep.request("GET", "/health")
        keep.getresponse().read()
        d = subprocess.run(down, cwd=REPO, capture_output=True, text=True, timeout=180)
        keep.close()
        assert d.returncode == 0, d.stderr[-2000:]
        t_down = time.monotonic()
        time_wait = _plain_bind_fails(port)   # the case the old check refused
        second = subprocess.run(up + ["--no-direct-ingress"], cwd=REPO, capture_output=True,
                                text=True, timeout=420)
        elapsed = time.monotonic() - t_down
        second_direct = (_get(base + "/specload/routes")["direct"]
                         if second.returncode == 0 else None)
    finally:
        subprocess.run(down, cwd=REPO, capture_output=True, text=True, timeout=180)

    bad = not_loopback(found)
    kinds = {k: [x for x in found if k in x.name] for k in (
        "gcs_server", "raylet", "dashboard", "DashboardAgent", "RuntimeEnvAgent", "client.server",
        "autoscaler", "ServeController", "ProxyActor", "ServeReplica")}
    print(f"cluster up listeners: {len(found)} total, {len(bad)} not on {LOOPBACK}")
    for x in found:
        print("  ", x)
    assert not bad, (f"expected every listener of the service on {LOOPBACK}; these are not: "
                     + "; ".join(map(str, bad)) + ". Fix: configs.net.loopback_head (the flags and "
                     "env cluster.local.start_head uses); docs/network.md lists each listener")
    missing = [k for k, v in kinds.items() if not v]
    assert not missing, f"the audit found no listener of {missing}: is it auditing the service? {found}"
    assert any(x.port == port and "ProxyActor" in x.name for x in found)   # the HTTP port itself
    # each replica: its core worker and its inter-deployment gRPC server (the one Ray binds
    # to [::], moved by the preload)
    replicas = {x.pid for x in kinds["ServeReplica"]}
    assert all(sum(x.pid == pid for x in found) >= 2 for pid in replicas), kinds["ServeReplica"]

    # direct ingress: one listener for the one strategy, a replica's, on loopback, answering
    assert list(direct) == ["autoregressive"] and len(direct["autoregressive"]) == 1, direct
    d_port = int(direct["autoregressive"][0].rsplit(":", 1)[1])
    assert direct["autoregressive"][0] == f"http://{LOOPBACK}:{d_port}"
    assert any(x.port == d_port and "ServeReplica" in x.name for x in found), found
    assert direct_answer["usage"]["completion_tokens"] == 4, direct_answer
    assert direct_answer["model"] == "autoregressive"
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    [run_dir] = list((tmp_path / "results").iterdir())
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["routes"] == {"autoregressive": {
        "route": "direct", "base_url": direct["autoregressive"][0] + "/strategies/autoregressive"}}
    import pyarrow.parquet as pq

    rows = pq.read_table(run_dir / "requests.parquet").to_pylist()
    assert rows and all(r["status"] == "ok" and r["route"] == "direct" for r in rows), rows[:3]
    assert pq.read_table(run_dir / "steps.parquet").num_rows > 0

    # up again at once after down
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-2000:]
    assert "in use" not in second.stderr
    assert second_direct == {}, second_direct   # --no-direct-ingress
    assert second.stdout.strip().splitlines()[-1] == f"http://{LOOPBACK}:{port}"
    print(f"up again {elapsed:.1f} s after down returned (a plain bind "
          f"{'failed: TIME-WAIT present' if time_wait else 'succeeded'} at that moment)")


def test_every_private_ray_sets_the_loopback_switch_before_importing_ray():
    """The kind of the bug ``--workers`` and bench_serve had: a module that starts a
    private Ray (``ray.init``), or calls one that does (``serve_app``), puts the loopback
    switch into its environment (``configs.net.use_loopback_env``) in its entry point, and
    nothing it imports at module level imports Ray first (Ray reads the switch then)."""
    import ast

    def starts_ray(call: ast.Call) -> bool:
        f = call.func
        return ((isinstance(f, ast.Attribute) and f.attr == "init"
                 and isinstance(f.value, ast.Name) and f.value.id == "ray")
                or (isinstance(f, ast.Name) and f.id == "serve_app"))

    sources = {path: path.read_text() for d in ("actors", "loadgen", "analysis", "cluster",
                                                "configs", "bench")
               for path in (REPO / d).rglob("*.py")}
    starters = [path for path, text in sources.items()
                if any(isinstance(n, ast.Call) and starts_ray(n)
                       for n in ast.walk(ast.parse(text)))]
    names = sorted(str(p.relative_to(REPO)) for p in starters)
    assert names == ["bench/serving_overhead.py", "bench/vs_vllm.py",
                     "loadgen/run/ray_workers.py"], names   # a new one: give it the switch too
    for path in starters:
        assert "use_loopback_env()" in sources[path], path
    code = ("import sys, bench.serving_overhead, bench.vs_vllm, loadgen.run.ray_workers; "
            "print('ray' in sys.modules)")
    env = {k: v for k, v in os.environ.items() if k not in RAY_SINGLE_NODE_LOOPBACK_ENV}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=120, check=True).stdout.strip()
    assert out == "False"


def test_bench_serve_private_ray_listens_on_loopback_only():
    """``python -m bench.serving_overhead`` (its own Ray, Serve, proxy, replica with direct
    ingress), run without the suite's loopback switch: every listener of its process tree
    is on 127.0.0.1 (before the fix: GCS, raylet and agents on every interface and on the
    host's address)."""
    pytest.importorskip("ray")
    from tests.socket_audit import run_audited

    p, heard = run_audited([sys.executable, "-m", "bench.serving_overhead", "--concurrency", "1",
                            "--max-tokens", "4", "--reps", "1", "--waves", "1",
                            "--stream-intervals", "", "--enforce-eager"], timeout=400, cwd=REPO)
    kinds = {x.name.split()[0] for x in heard}
    print(f"bench_serve listeners: {len(heard)} ({sorted(kinds)})")
    assert [x for x in heard if x.ip != LOOPBACK] == [], sorted(map(str, heard))
    assert any("gcs_server" in x.name for x in heard), heard   # it audited the Ray itself
    assert "direct_ingress" in p.stdout, p.stdout[-2000:]
