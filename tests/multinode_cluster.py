"""A real multi-node Ray cluster of separate test hosts: one network namespace per node.

Each node is its own ``ray start --block`` process (a new session) inside its own
namespace (``tests.netns``: a veth into a bridge, an address the test assigned from
198.18.0.0/15), started with ``--node-ip-address`` = that address, its own
``--resources`` and a private ``--temp-dir``. Nodes talk to each other over the bridge
only; the test process reaches the head (GCS, dashboard, Serve's HTTP proxy) at the
head's address. Nothing dials the machine's own interface address.

Without a Ray driver in the root namespace (a driver needs a raylet on its own host), the
test reads the cluster through the head's dashboard (``ray.util.state`` with
``address=``) and deploys Serve through its REST API, as ``python -m cluster up`` does;
drivers (the load generator) run inside the head's namespace (``Host.cmd``).

Stopping a node: SIGTERM to that node's ``ray start`` process only (Ray's handler stops
the processes of that node), never ``ray stop``; ``close()`` then kills whatever still
runs in the lab's namespaces (by pid) and deletes them. ``kill_raylet`` simulates losing a
node (SIGKILL to its raylet); ``partition`` / ``heal`` cut a node's host off the bridge.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from configs.net import RAY_MULTI_NODE_ENV, RAY_PRELOAD_ENV, free_ports
from tests.netns import Host, Lab

REPO = Path(__file__).resolve().parent.parent
_HEAD_PORTS = ("port", "ray-client-server-port", "metrics-export-port", "dashboard-agent-listen-port",
               "dashboard-agent-grpc-port", "runtime-env-agent-port", "node-manager-port",
               "object-manager-port", "dashboard-port")
_WORKER_PORTS = ("metrics-export-port", "dashboard-agent-listen-port", "dashboard-agent-grpc-port",
                 "runtime-env-agent-port", "node-manager-port", "object-manager-port")


@dataclass
class Node:
    """One ``ray start --block`` process, the host it runs on and what it advertises."""

    name: str
    host: Host
    proc: subprocess.Popen
    resources: dict[str, float]
    log: Path
    node_id: str = ""

    def raylet_pid(self) -> int | None:
        """Pid of this node's raylet (a child of the ``ray start`` process), or None."""
        try:
            kids = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return None
        for p in kids:
            try:
                if p.name().startswith("raylet") or "raylet" in " ".join(p.cmdline()[:1]):
                    return p.pid
            except psutil.Error:
                continue
        return None


def cluster_env() -> dict[str, str]:
    """Environment of every process of the test cluster (nodes and the drivers in the
    head's namespace)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env.setdefault("RAY_DISABLE_USAGE_STATS", "1")
    # No token auth, even when ~/.ray/auth_token exists (Ray would then require it from
    # every client; RAY_AUTH_MODE wins over the file).
    env["RAY_AUTH_MODE"] = "disabled"
    # Several nodes: each records the address its host was given (--node-ip-address); the
    # single-node loopback switch (configs.net.RAY_SINGLE_NODE_LOOPBACK_ENV) would refuse them.
    env.update(RAY_MULTI_NODE_ENV)
    env.pop(RAY_PRELOAD_ENV, None)   # a loopback head's preload: not for these nodes
    # Start-up waits (Ray's defaults, 60 s and 30 s, are too short on a loaded shared box:
    # seen here at load average 40 on 2 cores, the raylet aborted waiting for its agent).
    env.setdefault("RAY_raylet_start_wait_time_s", "300")
    env.setdefault("RAY_agent_register_timeout_ms", "300000")   # raylet waits for its agents
    return env


@dataclass
class NetnsCluster:
    """Head + workers, each on its own namespace host of ``lab``; ``address`` is the GCS
    ``host:port``, ``dashboard`` the head's dashboard URL."""

    lab: Lab
    address: str = ""
    dashboard: str = ""
    temp_dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="specload-mn-")))
    nodes: list[Node] = field(default_factory=list)
    _starts: int = 0

    def _start(self, name: str, args: list[str], resources: dict[str, float]) -> Node:
        host = self.lab.hosts.get(name) or self.lab.add_host(name)
        self._starts += 1
        log = self.temp_dir / f"{name}-{self._starts}.log"
        cmd = host.cmd([sys.executable, "-m", "ray.scripts.scripts", "start", "--block",
                        "--node-ip-address", host.ip, "--disable-usage-stats",
                        "--resources", json.dumps(resources), *args])
        with open(log, "ab") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=cluster_env(),
                                    stdin=subprocess.DEVNULL, start_new_session=True, cwd=str(REPO))
        node = Node(name, host, proc, resources, log)
        self.nodes.append(node)
        return node

    def start_head(self, num_cpus: float = 1, resources: dict[str, float] | None = None,
                   system_config: dict | None = None, timeout_s: float = 240.0,
                   attempts: int = 4) -> Node:
        """Start the head (with its dashboard on the head's address) and wait until it runs.

        ``system_config``: Ray internal settings for the whole cluster (e.g. a faster GCS
        health check, ``{"health_check_period_ms": 1000, "health_check_failure_threshold": 3}``)."""
        for _ in range(attempts):   # a raylet can abort at start-up on a loaded box
            ports = dict(zip(_HEAD_PORTS, free_ports(len(_HEAD_PORTS))))
            host = self.lab.hosts.get("head") or self.lab.add_host("head")
            args = ["--head", "--num-cpus", str(num_cpus), "--include-dashboard", "true",
                    "--dashboard-host", host.ip,   # the test reads the cluster through it
                    "--temp-dir", str(self.temp_dir / f"ray-head-{self._starts + 1}")]
            for k, v in ports.items():
                args += [f"--{k}", str(v)]
            if system_config:
                args += ["--system-config", json.dumps(system_config)]
            node = self._start("head", args, resources or {})
            if self._wait_started(node, timeout_s):
                self.address = f"{node.host.ip}:{ports['port']}"
                self.dashboard = f"http://{node.host.ip}:{ports['dashboard-port']}"
                return node
            self._stop_node(node)
        raise RuntimeError(f"the Ray head's raylet aborted at start-up {attempts} times; see {self.temp_dir}")

    def add_worker(self, name: str, num_cpus: float, resources: dict[str, float],
                   timeout_s: float = 240.0, attempts: int = 4) -> Node:
        """Start a worker node on host ``name`` (made on first use; a replacement node reuses
        the host of a lost one) and wait until it runs; a raylet that aborts at start-up
        (its dashboard agent too slow on a loaded box) is stopped and started again."""
        for _ in range(attempts):
            ports = dict(zip(_WORKER_PORTS, free_ports(len(_WORKER_PORTS))))
            args = ["--address", self.address, "--num-cpus", str(num_cpus),
                    "--temp-dir", str(self.temp_dir / f"ray-{name}-{self._starts + 1}")]
            for k, v in ports.items():
                args += [f"--{k}", str(v)]
            node = self._start(name, args, resources)
            if self._wait_started(node, timeout_s):
                return node
            self._stop_node(node)
        raise RuntimeError(f"worker node {name}: raylet aborted at start-up {attempts} times; "
                           f"see {self.temp_dir}")

    def _raylet_aborted(self, node: Node) -> bool:
        """True when this node's raylet hit a fatal check (its log has a ``Check failed``)."""
        for f in self.temp_dir.glob(f"ray-{node.name}-{self._starts}/session_*/logs/raylet.out"):
            try:
                if "Check failed" in f.read_text(errors="replace"):
                    return True
            except OSError:
                continue
        return False

    def _wait_started(self, node: Node, timeout_s: float) -> bool:
        """True once the node says it runs; False if its raylet aborted; raises on timeout."""
        t0 = time.monotonic()
        while "Ray runtime started" not in node.log.read_text(errors="replace"):
            if self._raylet_aborted(node):
                return False
            if node.proc.poll() is not None or time.monotonic() - t0 > timeout_s:
                raise RuntimeError(f"Ray node {node.name} did not start within {timeout_s:.0f} s "
                                   f"(exit {node.proc.poll()}):\n"
                                   f"{node.log.read_text(errors='replace')[-3000:]}")
            time.sleep(0.5)
        return True

    def _stop_node(self, node: Node) -> None:
        if node.proc.poll() is None:
            node.proc.send_signal(signal.SIGTERM)
            try:
                node.proc.wait(20)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(node.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if node in self.nodes:
            self.nodes.remove(node)

    def state_nodes(self) -> list:
        """Ray's node table (``ray.util.state.list_nodes``), read through the head's dashboard."""
        from ray.util.state import list_nodes

        return list_nodes(address=self.dashboard, limit=1000, timeout=30)

    def alive_actors(self) -> list:
        """ALIVE actors (``ray.util.state.list_actors``, through the dashboard)."""
        from ray.util.state import list_actors

        return list_actors(address=self.dashboard, filters=[("state", "=", "ALIVE")],
                           limit=10000, timeout=30, detail=True)

    def wait_nodes(self, timeout_s: float = 240.0) -> None:
        """Until Ray lists every running node alive; fills each ``Node.node_id`` (the ALIVE
        node on that node's address: every host has its own)."""
        t0 = time.monotonic()
        alive: dict[str, str] = {}
        while True:
            for n in self.nodes:
                if n.proc.poll() is not None:
                    raise RuntimeError(f"ray node {n.name} exited ({n.proc.returncode}):\n"
                                       f"{n.log.read_text(errors='replace')[-3000:]}")
            try:
                alive = {x.node_ip: x.node_id for x in self.state_nodes() if x.state == "ALIVE"}
            except Exception:  # noqa: BLE001  (dashboard still starting)
                alive = {}
            for n in self.nodes:
                n.node_id = alive.get(n.host.ip, "")
            if all(n.node_id for n in self.nodes):
                return
            if time.monotonic() - t0 > timeout_s:
                raise RuntimeError(f"only {len(alive)}/{len(self.nodes)} Ray nodes alive after "
                                   f"{timeout_s:.0f} s (alive: {alive})")
            time.sleep(1.0)

    def node_state(self, node_id: str) -> str:
        """``ALIVE`` / ``DEAD`` (or ``?`` when Ray does not list it)."""
        return next((x.state for x in self.state_nodes() if x.node_id == node_id), "?")

    def node(self, name: str) -> Node:
        return next(n for n in self.nodes if n.name == name)

    def node_name(self, node_id: str) -> str:
        """``head`` / worker name of a Ray node id ("?" if not one of ours)."""
        return next((n.name for n in self.nodes if n.node_id == node_id), "?")

    def kill_raylet(self, name: str) -> int:
        """SIGKILL the raylet of node ``name`` (node loss); returns the pid killed."""
        pid = self.node(name).raylet_pid()
        if pid is None:
            raise RuntimeError(f"no raylet found under node {name}")
        os.kill(pid, signal.SIGKILL)
        return pid

    def forget(self, node: Node) -> None:
        """Stop what is left of a lost node (its ``ray start`` session) and drop it."""
        self._stop_node(node)

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """SIGTERM each node's own ``ray start`` process (workers first), SIGKILL its session,
        then delete the lab (which kills anything still running in its namespaces)."""
        try:
            for n in reversed(self.nodes):
                if n.proc.poll() is None:
                    n.proc.send_signal(signal.SIGTERM)
            t0 = time.monotonic()
            for n in reversed(self.nodes):
                try:
                    n.proc.wait(max(1.0, timeout_s - (time.monotonic() - t0)))
                except subprocess.TimeoutExpired:
                    pass
                try:   # anything left in that node's own session (it holds only what it started)
                    os.killpg(n.proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        finally:
            self.lab.close()   # the logs stay in temp_dir
