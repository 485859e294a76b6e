"""Loopback ports: one helper for every server, Ray node and test that needs a free port."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from configs.paths import PACKAGE_ROOT

LOOPBACK = "127.0.0.1"


def free_ports(n: int, host: str = LOOPBACK) -> list[int]:
    """``n`` distinct TCP ports free on ``host`` now (held open together while picking).

    A port can be taken again between this call and its use; callers bind soon after.
    """
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port(host: str = LOOPBACK) -> int:
    """One TCP port free on ``host`` now."""
    return free_ports(1, host)[0]


def port_in_use(port: int, host: str = LOOPBACK) -> bool:
    """True if a server could NOT bind ``host:port`` now, asked the way that server binds.

    uvicorn, Ray Serve's proxy and Ray's own servers set ``SO_REUSEADDR``, so connections a
    previous server left in TIME-WAIT do not stop them; a bind without it fails for up to a
    minute after a run ends although nothing listens (issue 23). With it, only a real
    listener on the port (on ``host`` or on a wildcard address) makes the bind fail.
    """
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def listener_on(port: int) -> str | None:
    """Who listens on TCP ``port`` (any address): ``"pid 123 (python3) on 127.0.0.1"``,
    ``"a process of another user on 0.0.0.0"``, or None when nothing listens. For error
    messages; psutil is imported here (an extra), and without it None is returned."""
    try:
        import psutil
    except ImportError:
        return None
    try:
        conns = psutil.net_connections(kind="tcp")
    except (psutil.AccessDenied, OSError):
        return None
    for c in conns:
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port:
            where = c.laddr.ip or "*"
            if c.pid is None:
                return f"a process of another user on {where}"
            try:
                name = psutil.Process(c.pid).name()
            except psutil.Error:
                name = "?"
            return f"pid {c.pid} ({name}) on {where}"
    return None


# Ray (2.60) rewrites ``--node-ip-address 127.0.0.1`` to the address of the host's default
# route (scripts.py ``resolve_ip_for_localhost`` -> ``get_node_ip_address``), so a "loopback"
# node still records and dials the machine's own address. Ray's one switch that keeps a node
# on 127.0.0.1 is this variable, set to 0 for every process of a SINGLE-node Ray (the head,
# and every driver that connects to it: they must agree on the node's address). Ray refuses
# to start a worker node with it (multi-node on one machine cannot be loopback-only).
RAY_SINGLE_NODE_LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
RAY_MULTI_NODE_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1"}
# Ray starts its worker processes (Serve replicas, engine processes, Locust load workers) at
# nice 15 (raylet config ``worker_niceness``). On a box the load generator shares (the
# embedded default), that puts the engine behind every other process: the client's own
# work, or anything else running, starves it and the measured cell runs slow. A model
# server (vLLM, specload's engine) runs at normal priority; so do these workers. Applied
# with setdefault: a caller's own RAY_worker_niceness wins.
RAY_WORKER_PRIORITY_ENV = {"RAY_worker_niceness": "0"}

# The preload module that binds Serve's hard-coded ``[::]`` gRPC servers to the node IP
# (cluster/grpc_bind.py says why). A module name, not an import: Ray's raylet has every
# worker import it (Ray's ``preload_python_modules`` setting, env ``RAY_preload_python_modules``).
GRPC_BIND_PRELOAD = "cluster.grpc_bind_preload"
RAY_PRELOAD_ENV = "RAY_preload_python_modules"

# Every port option of ``ray start --head`` (each picked free, so a head never meets another
# Ray on the box) and the two fixed-port metrics servers Ray configures by env only
# (autoscaler/_private/constants.py AUTOSCALER_METRIC_PORT 44217, dashboard/consts.py
# DASHBOARD_METRIC_PORT 44227: two heads on one box would both want them).
RAY_HEAD_PORT_OPTIONS = ("port", "dashboard-port", "ray-client-server-port", "metrics-export-port",
                         "dashboard-agent-listen-port", "dashboard-agent-grpc-port",
                         "runtime-env-agent-port", "node-manager-port", "object-manager-port")
RAY_HEAD_PORT_ENV = ("AUTOSCALER_METRIC_PORT", "DASHBOARD_METRIC_PORT")


@dataclass(frozen=True)
class RayHead:
    """How to start a Ray head: ``ray start --head`` flags, the environment its processes
    need, and the ports picked (by option / variable name)."""

    flags: list[str]
    env: dict[str, str]
    ports: dict[str, int]

    @property
    def gcs_address(self) -> str:
        return f"{LOOPBACK}:{self.ports['port']}"

    @property
    def dashboard_url(self) -> str:
        return f"http://{LOOPBACK}:{self.ports['dashboard-port']}"


def loopback_env() -> dict[str, str]:
    """Environment of every process of a single-node, loopback-only Ray (head and the drivers
    that join it): node address 127.0.0.1 (``RAY_SINGLE_NODE_LOOPBACK_ENV``) and Serve's
    wildcard gRPC servers bound to it (``GRPC_BIND_PRELOAD``). The importable module must be
    on the workers' ``PYTHONPATH`` (``cluster.local.start_head`` puts the checkout there)."""
    return {**RAY_SINGLE_NODE_LOOPBACK_ENV, RAY_PRELOAD_ENV: GRPC_BIND_PRELOAD}


def use_loopback_env() -> None:
    """Put ``loopback_env()`` into this process's environment (a variable already set
    stays), so that the private single-node Ray it starts (``ray.init(address="local")``)
    and its workers listen on 127.0.0.1 only. Call it before ``import ray``: Ray reads
    ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` when it is imported (set later, Ray's node address
    is the host's own and its GCS, raylet and agents bind it or every interface).

    A checkout (a folder with ``pyproject.toml``) goes first on ``PYTHONPATH`` too, as
    ``cluster.local.start_head`` puts it for a head: the workers inherit it and import the
    preload module from it whatever the interpreter's own install points at (a specload
    installed from another directory, or not at all, had left Serve's gRPC servers on
    ``[::]``)."""
    for k, v in loopback_env().items():
        os.environ.setdefault(k, v)
    if (PACKAGE_ROOT / "pyproject.toml").is_file():  # installed: site-packages is on it already
        os.environ["PYTHONPATH"] = checkout_first(os.environ.get("PYTHONPATH"))


def checkout_first(pythonpath: str | None) -> str:
    """``pythonpath`` with this checkout (``configs.paths.PACKAGE_ROOT``) first, once: what
    a Ray head's and a private Ray's workers import specload (and the gRPC bind preload)
    from."""
    root = str(PACKAGE_ROOT)
    rest = [p for p in (pythonpath or "").split(os.pathsep) if p and p != root]
    return os.pathsep.join([root, *rest])


def loopback_head(ports: dict[str, int] | None = None) -> RayHead:
    """Flags and environment for a single-node Ray head whose every listener is on 127.0.0.1.

    The one place that says how (docs/network.md has the table):
    - ``--node-ip-address 127.0.0.1`` with ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` (else Ray
      swaps in the host's own address): GCS, raylet, object manager, core workers, the
      dashboard agent (HTTP, gRPC, metrics export), runtime-env agent, client server, the
      autoscaler monitor's and dashboard's metrics servers all bind the node IP;
    - ``--dashboard-host 127.0.0.1`` (Ray's default, said explicitly);
    - ``RAY_preload_python_modules=cluster.grpc_bind_preload``: Serve's replica and gRPC-ingress
      servers, hard-coded to ``[::]``, bind the node IP too;
    - every port picked free on 127.0.0.1 (``ports`` overrides by name).
    The Serve HTTP proxy binds ``http_options.host`` of the deploy config (127.0.0.1 in
    ``configs/serve.yaml``)."""
    names = RAY_HEAD_PORT_OPTIONS + RAY_HEAD_PORT_ENV
    picked = dict(zip(names, free_ports(len(names))))
    picked.update(ports or {})
    flags = ["--node-ip-address", LOOPBACK, "--dashboard-host", LOOPBACK]
    for name in RAY_HEAD_PORT_OPTIONS:
        flags += [f"--{name}", str(picked[name])]
    env = {**loopback_env(), **{k: str(picked[k]) for k in RAY_HEAD_PORT_ENV}}
    return RayHead(flags, env, picked)
