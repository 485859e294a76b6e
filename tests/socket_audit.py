"""Which TCP sockets a service's processes listen on, and which of those are not loopback.

Used by ``tests/test_loopback.py`` on a real ``python -m cluster up``: the service is
the Ray head process recorded in the state file, all its descendants, and any process
whose command line names the head's session directory (a Ray worker re-parented after
its parent exited still belongs to the service). Listeners come from
``psutil.net_connections(kind="inet")`` (IPv4 and IPv6), which reads ``/proc/net/*`` of
the CALLER's network namespace: a process in another namespace is audited by running
this module inside that namespace (``python -m tests.socket_audit PID ...``, as the
self-check does).
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass

import psutil

LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class Listener:
    """One listening TCP socket: who holds it and where."""

    pid: int
    name: str      # process name plus the start of its command line (what it is)
    ip: str
    port: int

    def __str__(self) -> str:
        return f"pid {self.pid} ({self.name}) listens on {self.ip or '*'}:{self.port}"


def _describe(pid: int) -> str:
    try:
        p = psutil.Process(pid)
        cmd = p.cmdline()
    except psutil.Error:
        return "?"
    # ray workers rename themselves ("ray::ServeReplica:..."), so cmdline[0] is the best label
    head = " ".join(cmd[:3]) if cmd else p.name()
    return head if len(head) <= 120 else head[:117] + "..."


def session_dir_of(pids: set[int]) -> str | None:
    """The Ray session directory named on the command line of one of ``pids`` (the raylet
    and the GCS server take ``--session_dir=`` / ``--session-dir=``), or None."""
    for pid in sorted(pids):
        try:
            cmd = psutil.Process(pid).cmdline()
        except psutil.Error:
            continue
        for i, arg in enumerate(cmd):
            for flag in ("--session_dir", "--session-dir"):
                if arg.startswith(flag + "="):
                    return arg.split("=", 1)[1]
                if arg == flag and i + 1 < len(cmd):
                    return cmd[i + 1]
    return None


def service_pids(root_pid: int) -> set[int]:
    """``root_pid``, its descendants, and every process whose command line names the
    session directory one of those was started with."""
    try:
        root = psutil.Process(root_pid)
        pids = {root_pid} | {p.pid for p in root.children(recursive=True)}
    except psutil.NoSuchProcess:
        raise AssertionError(f"the Ray head (pid {root_pid}) is not running: nothing to audit; "
                             "expected the pid from the cluster state file of a live service")
    session = session_dir_of(pids)
    if session:
        for p in psutil.process_iter(["pid", "cmdline"]):
            try:
                if any(session in a for a in (p.info["cmdline"] or [])):
                    pids.add(p.info["pid"])
            except psutil.Error:
                continue
    return pids


def plain_ip(ip: str) -> str:
    """``ip`` with an IPv4-mapped IPv6 address written as the IPv4 address it is.

    gRPC's C core listens on an AF_INET6 socket even for "127.0.0.1:port"; the kernel then
    reports ``::ffff:127.0.0.1``, which accepts connections to 127.0.0.1 only (the same
    address). ``::`` and ``::1`` stay as they are: they are other addresses."""
    return ip[len("::ffff:"):] if ip.lower().startswith("::ffff:") and "." in ip else ip


def listeners(pids: set[int]) -> list[Listener]:
    """Every listening TCP socket (IPv4 and IPv6) held by one of ``pids``, in this
    process's network namespace, sorted by port (IPv4-mapped addresses as IPv4)."""
    out = {Listener(c.pid, _describe(c.pid), plain_ip(c.laddr.ip), c.laddr.port)
           for c in psutil.net_connections(kind="inet")
           if c.status == psutil.CONN_LISTEN and c.pid in pids and c.laddr}
    return sorted(out, key=lambda x: (x.port, x.pid, x.ip))


def not_loopback(found: list[Listener], allowed: str = LOOPBACK) -> list[Listener]:
    """The listeners not bound to ``allowed`` exactly: a wildcard (``0.0.0.0``, ``::``),
    another interface's address, even ``::1`` (a service told to stay on 127.0.0.1)."""
    return [x for x in found if x.ip != allowed]


def run_audited(cmd: list[str], timeout: float, cwd=None) -> tuple["subprocess.CompletedProcess", set]:
    """Run ``cmd`` (exit 0 asserted), sampling every 0.5 s the listening sockets of its
    process tree: returns the result and every listener seen. The command runs without
    the loopback switch tests/conftest.py sets for the whole suite
    (``configs.net.RAY_SINGLE_NODE_LOOPBACK_ENV``), as a user's shell would: whatever it
    starts must set it itself."""
    import os
    import subprocess
    import time

    from configs.net import RAY_SINGLE_NODE_LOOPBACK_ENV

    heard: set = set()
    env = {k: v for k, v in os.environ.items() if k not in RAY_SINGLE_NODE_LOOPBACK_ENV}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=cwd, env=env)
    deadline = time.time() + timeout
    try:
        while proc.poll() is None and time.time() < deadline:
            try:
                tree = {proc.pid} | {c.pid for c in psutil.Process(proc.pid).children(recursive=True)}
            except psutil.NoSuchProcess:
                break
            heard |= set(listeners(tree))
            time.sleep(0.5)
        out, err = proc.communicate(timeout=max(1.0, deadline - time.time()))
    finally:
        if proc.poll() is None:
            proc.kill()
    p = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    assert p.returncode == 0, out[-3000:] + err[-3000:]
    return p, heard


def main(argv: list[str]) -> int:
    """``python -m tests.socket_audit PID ...``: print the listeners of those pids (and
    their descendants) as JSON lines, in the caller's network namespace."""
    pids: set[int] = set()
    for a in argv:
        pids |= service_pids(int(a))
    for x in listeners(pids):
        print(json.dumps(asdict(x)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
