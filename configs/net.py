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
