"""A real multi-node Ray cluster on this one machine: a head plus worker nodes.

Each node is its own ``ray start --block`` process (a new session), with
``--node-ip-address 127.0.0.1``, every port from ``configs.net.free_ports``,
its own ``--resources`` and a private ``--temp-dir`` (so it never meets
another Ray cluster on the machine). Stopping a node sends SIGTERM to that
``ray start`` process only (Ray's handler stops the processes of that node),
never ``ray stop``. ``kill_raylet`` simulates losing a node: SIGKILL to that
node's raylet, found by pid among the ``ray start`` process's children.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from configs.net import LOOPBACK, RAY_MULTI_NODE_ENV, free_ports

REPO = Path(__file__).resolve().parent.parent
_HEAD_PORTS = ("port", "ray-client-server-port", "metrics-export-port", "dashboard-agent-listen-port",
               "dashboard-agent-grpc-port", "runtime-env-agent-port", "node-manager-port",
               "object-manager-port", "dashboard-port")
_WORKER_PORTS = ("metrics-export-port", "dashboard-agent-listen-port", "dashboard-agent-grpc-port",
                 "runtime-env-agent-port", "node-manager-port", "object-manager-port")


@dataclass
class Node:
    """One ``ray start --block`` process and what it advertises."""

    name: str
    proc: subprocess.Popen
    resources: dict[str, float]
    log: Path
    node_manager_port: int
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


@dataclass
class LocalCluster:
    """Head + workers on 127.0.0.1; ``address`` is the GCS ``host:port``."""

    address: str = ""
    temp_dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="specload-mn-")))
    nodes: list[Node] = field(default_factory=list)
    _used: set[int] = field(default_factory=set)

    def _ports(self, n: int) -> list[int]:
        """``n`` free ports none of this cluster's nodes was given before (a port picked
        for a node that has not bound it yet can come back from the OS)."""
        for _ in range(50):
            ports = free_ports(n)
            if not self._used.intersection(ports):
                self._used.update(ports)
                return ports
        raise RuntimeError("could not pick distinct free ports")

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
        env.setdefault("RAY_DISABLE_USAGE_STATS", "1")
        # Loopback-only test cluster: no token auth, even when ~/.ray/auth_token exists (Ray
        # would then require it from every client; RAY_AUTH_MODE wins over the file).
        env["RAY_AUTH_MODE"] = "disabled"
        # Several nodes: Ray refuses worker nodes under the single-node loopback switch, so
        # its nodes record the host's own address (configs.net.RAY_SINGLE_NODE_LOOPBACK_ENV).
        env.update(RAY_MULTI_NODE_ENV)
        # Start-up waits (Ray's defaults, 60 s and 30 s, are too short on a loaded shared box:
        # seen here at load average 40 on 2 cores, the raylet aborted waiting for its agent).
        env.setdefault("RAY_raylet_start_wait_time_s", "300")
        env.setdefault("RAY_agent_register_timeout_ms", "300000")   # raylet waits for its agents
        return env

    def _start(self, name: str, args: list[str], resources: dict[str, float], nm_port: int) -> Node:
        log = self.temp_dir / f"{name}.log"
        cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", "--block", "--node-ip-address",
               LOOPBACK, "--disable-usage-stats", "--resources", json.dumps(resources), *args]
        with open(log, "ab") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=self._env(),
                                    stdin=subprocess.DEVNULL, start_new_session=True, cwd=str(REPO))
        node = Node(name, proc, resources, log, nm_port)
        self.nodes.append(node)
        return node

    def start_head(self, num_cpus: float = 1, resources: dict[str, float] | None = None,
                   system_config: dict | None = None, timeout_s: float = 180.0, attempts: int = 5) -> Node:
        """Start the head and wait until it says it runs (a worker started earlier times out).

        ``system_config``: Ray internal settings for the whole cluster (e.g. a faster GCS
        health check, ``{"health_check_period_ms": 1000, "health_check_failure_threshold": 3}``)."""
        for _ in range(attempts):   # a raylet can abort at start-up on a loaded box (add_worker)
            node = self._try_head(num_cpus, resources, system_config, timeout_s)
            if node is not None:
                return node
        raise RuntimeError(f"the Ray head's raylet aborted at start-up {attempts} times; see {self.temp_dir}")

    def _try_head(self, num_cpus, resources, system_config, timeout_s) -> Node | None:
        ports = dict(zip(_HEAD_PORTS, self._ports(len(_HEAD_PORTS))))
        args = ["--head", "--num-cpus", str(num_cpus), "--include-dashboard", "false",
                "--temp-dir", str(self.temp_dir / "ray")]
        for k, v in ports.items():
            args += [f"--{k}", str(v)]
        if system_config:
            args += ["--system-config", json.dumps(system_config)]
        node = self._start("head", args, resources or {}, ports["node-manager-port"])
        if not self._wait_started(node, timeout_s):
            self._stop_node(node)
            shutil.rmtree(self.temp_dir / "ray", ignore_errors=True)
            return None
        # Ray turns 127.0.0.1 into this machine's own address: read it back from the log.
        text = node.log.read_text(errors="replace")
        host = LOOPBACK
        for line in text.splitlines():
            if "ray start --address=" in line:
                host = line.split("--address=")[1].strip("'\" \x1b[22m").rsplit(":", 1)[0]
        self.address = f"{host}:{ports['port']}"
        return node

    def _raylet_aborted(self, node: Node) -> bool:
        """True when this node's raylet hit a fatal check (its log has a ``Check failed``)."""
        base = self.temp_dir / ("ray" if node.name == "head" else f"ray-{node.name}")
        for f in base.glob("session_*/logs/raylet.out"):
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
                raise RuntimeError(f"Ray node {node.name} did not start within {timeout_s:.0f} s:\n"
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
        self.nodes.remove(node)

    def add_worker(self, name: str, num_cpus: float, resources: dict[str, float],
                   timeout_s: float = 180.0, attempts: int = 5) -> Node:
        """Start a worker node and wait until it runs.

        On a loaded box a raylet can abort at start-up: Ray 2.60's raylet waits a fixed
        ~15 s for its dashboard agent's port file and the agent's imports can take longer
        (seen here at load average 45 on 2 cores). Such a node is stopped and started
        again, up to ``attempts`` times; nodes are started one at a time for the same reason.
        """
        for attempt in range(1, attempts + 1):
            node = self._start_worker(name, num_cpus, resources)
            if self._wait_started(node, timeout_s):
                return node
            self._stop_node(node)
            shutil.rmtree(self.temp_dir / f"ray-{name}", ignore_errors=True)
        raise RuntimeError(f"worker node {name}: raylet aborted at start-up {attempts} times "
                           f"(dashboard agent too slow); see {self.temp_dir}")

    def _start_worker(self, name: str, num_cpus: float, resources: dict[str, float]) -> Node:
        ports = dict(zip(_WORKER_PORTS, self._ports(len(_WORKER_PORTS))))
        # Own temp dir per node: nodes sharing one pick socket names (raylet.1, ...) that
        # collide when two start at once ("bind: Address already in use").
        args = ["--address", self.address, "--num-cpus", str(num_cpus),
                "--temp-dir", str(self.temp_dir / f"ray-{name}")]
        for k, v in ports.items():
            args += [f"--{k}", str(v)]
        return self._start(name, args, resources, ports["node-manager-port"])

    def wait_nodes(self, timeout_s: float = 180.0) -> None:
        """Until Ray lists every started node alive; fills each Node.node_id (by node manager port)."""
        import ray

        t0 = time.monotonic()
        while True:
            for n in self.nodes:
                if n.proc.poll() is not None:
                    raise RuntimeError(f"ray node {n.name} exited ({n.proc.returncode}):\n"
                                       f"{n.log.read_text()[-3000:]}")
            alive = {x["NodeManagerPort"]: x["NodeID"] for x in ray.nodes() if x["Alive"]}
            for n in self.nodes:
                n.node_id = alive.get(n.node_manager_port, "")
            if all(n.node_id for n in self.nodes):
                return
            if time.monotonic() - t0 > timeout_s:
                raise RuntimeError(f"only {len(alive)}/{len(self.nodes)} Ray nodes alive after "
                                   f"{timeout_s:.0f} s")
            time.sleep(1.0)

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

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """SIGTERM each node's own ``ray start`` process (workers first), then SIGKILL its session."""
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
