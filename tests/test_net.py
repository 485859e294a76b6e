"""``configs.net.port_in_use``: the one "is this port taken" answer, asked as the server binds.

Issue 23: a check that bound without ``SO_REUSEADDR`` refused ``cluster up`` for up to a
minute after ``cluster down`` (the old service's connections in TIME-WAIT), although
nothing listened and the real server (uvicorn / Ray Serve set ``SO_REUSEADDR``) would
bind fine.
"""

from __future__ import annotations

import os
import socket

from configs.net import LOOPBACK, listener_on, port_in_use


def _time_wait_port() -> int:
    """A port with a connection in TIME-WAIT on it and no listener: the server side
    closes first (the active close), as a server ending its keep-alive connections does."""
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((LOOPBACK, 0))
    srv.listen()
    port = srv.getsockname()[1]
    cli = socket.create_connection((LOOPBACK, port))
    conn, _ = srv.accept()
    conn.close()          # server closes first -> its end goes to TIME-WAIT
    cli.recv(1)           # the client sees EOF
    cli.close()
    srv.close()
    return port


def test_time_wait_is_not_in_use():
    port = _time_wait_port()
    with socket.socket() as plain:   # what the old check did: this bind fails
        try:
            plain.bind((LOOPBACK, port))
            old_check_refused = False
        except OSError:
            old_check_refused = True
    assert old_check_refused, "the kernel left no TIME-WAIT: the case is not reproduced"
    assert not port_in_use(port)
    assert listener_on(port) is None


def test_a_real_listener_is_in_use_and_named():
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        s.listen()
        port = s.getsockname()[1]
        assert port_in_use(port)
        who = listener_on(port)
        assert who is not None and f"pid {os.getpid()}" in who and LOOPBACK in who
    assert not port_in_use(port)

