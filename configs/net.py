"""Loopback ports: one helper for every server, Ray node and test that needs a free port."""

from __future__ import annotations

import socket

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
