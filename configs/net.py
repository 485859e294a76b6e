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


# Ray (2.60) rewrites ``--node-ip-address 127.0.0.1`` to the address of the host's default
# route (scripts.py ``resolve_ip_for_localhost`` -> ``get_node_ip_address``), so a "loopback"
# node still records and dials the machine's own address. Ray's one switch that keeps a node
# on 127.0.0.1 is this variable, set to 0 for every process of a SINGLE-node Ray (the head,
# and every driver that connects to it: they must agree on the node's address). Ray refuses
# to start a worker node with it (multi-node on one machine cannot be loopback-only).
RAY_SINGLE_NODE_LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
RAY_MULTI_NODE_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1"}
