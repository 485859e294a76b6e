"""Test hosts as Linux network namespaces: one namespace per host, joined by a bridge.

The multi-node tests run each Ray node on its own "host": a network namespace with one
interface (``eth0``, one end of a veth pair whose other end is plugged into a bridge in
the root namespace) and one address the test assigns itself from 198.18.0.0/15 (RFC 2544
benchmarking range: never routed, not this machine's network; the /24 is picked so that
no address or route of the root namespace overlaps it). The bridge gets ``.1`` of that
/24, so the test process (root namespace) reaches every host by its address and nothing
dials the machine's own interface address. Hosts get no default route: nothing inside
can leave the bridge.

A partition of a host is its bridge-side veth set down for a while (the host's ``eth0``
loses carrier: packets both ways are dropped, no RST, as when a switch port dies).

Everything is named ``sl<tag>...`` with a random tag per ``Lab`` (several test runs, and
other users of the machine, never meet) and removed in ``close()``, which the tests call
in ``finally``; it also kills any process still running inside the namespaces (by pid,
from ``ip netns pids``: only what this lab's hosts run).
"""

from __future__ import annotations

import ipaddress
import json
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field

RANGE = ipaddress.ip_network("198.18.0.0/15")


class NetnsUnavailable(RuntimeError):
    """This machine cannot make network namespaces here (not root, no ``ip``, no kernel
    support); the message says which and is the tests' skip reason."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def _taken_networks() -> list[ipaddress.IPv4Network]:
    """Every IPv4 network the root namespace has an address or a route in."""
    nets = []
    for a in json.loads(_ip("-j", "addr").stdout or "[]"):
        for info in a.get("addr_info", []):
            if info.get("family") == "inet":
                nets.append(ipaddress.ip_network(f"{info['local']}/{info['prefixlen']}", strict=False))
    for r in json.loads(_ip("-j", "route").stdout or "[]"):
        dst = r.get("dst", "")
        if dst and dst != "default":
            nets.append(ipaddress.ip_network(dst if "/" in dst else f"{dst}/32", strict=False))
    return nets


def check_available() -> None:
    """Raise NetnsUnavailable (with the reason) unless namespaces and veths can be made."""
    if os.geteuid() != 0:
        raise NetnsUnavailable("network namespaces need root (CI runs the tests as root)")
    if shutil.which("ip") is None:
        raise NetnsUnavailable("the `ip` command (iproute2) is not installed")
    name = f"slchk{secrets.token_hex(3)}"
    r = _ip("netns", "add", name, check=False)
    if r.returncode != 0:
        raise NetnsUnavailable(f"`ip netns add` failed: {r.stderr.strip()}")
    try:
        r = _ip("link", "add", f"{name}a", "type", "veth", "peer", "name", f"{name}b", check=False)
        if r.returncode != 0:
            raise NetnsUnavailable(f"cannot create a veth pair: {r.stderr.strip()}")
        _ip("link", "del", f"{name}a", check=False)
    finally:
        _ip("netns", "del", name, check=False)


def reachable(ip: str, port: int = 9, timeout_s: float = 1.0) -> bool:
    """True when ``ip`` answers a TCP connect (accepted or refused) within ``timeout_s``."""
    try:
        with socket.create_connection((ip, port), timeout=timeout_s):
            return True
    except ConnectionRefusedError:
        return True
    except OSError:
        return False


@dataclass
class Host:
    """One namespace: its name, its address, and the bridge-side end of its veth."""

    name: str
    netns: str
    ip: str
    veth: str        # in the root namespace, plugged into the bridge

    def cmd(self, argv: list[str]) -> list[str]:
        """``argv`` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.netns, *argv]

    def pids(self) -> list[int]:
        """Pids of every process whose network namespace is this host's."""
        r = _ip("netns", "pids", self.netns, check=False)
        return [int(x) for x in r.stdout.split()] if r.returncode == 0 else []


@dataclass
class Lab:
    """A bridge and the hosts plugged into it (see the module docstring)."""

    tag: str = field(default_factory=lambda: secrets.token_hex(3))
    subnet: ipaddress.IPv4Network | None = None
    hosts: dict[str, Host] = field(default_factory=dict)
    _links: list[str] = field(default_factory=list)

    @property
    def bridge(self) -> str:
        return f"sl{self.tag}br"

    @property
    def gateway(self) -> str:
        """The bridge's address: the root namespace (the test process) on the lab network."""
        return str(self.subnet.network_address + 1)

    def open(self) -> Lab:
        check_available()
        taken = _taken_networks()
        choices = list(RANGE.subnets(new_prefix=24))
        random.shuffle(choices)
        self.subnet = next((n for n in choices if not any(n.overlaps(t) for t in taken)), None)
        if self.subnet is None:
            raise NetnsUnavailable("no free /24 left in 198.18.0.0/15 on this machine")
        self._links.append(self.bridge)
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
        except subprocess.CalledProcessError as err:
            self.close()
            raise NetnsUnavailable(f"cannot set up the lab bridge {self.bridge}: "
                                   f"{(err.stderr or '').strip()}") from None
        return self

    def add_host(self, name: str) -> Host:
        """A new namespace on the bridge, with the next free address (``.10`` up)."""
        i = len(self.hosts)
        netns = f"sl{self.tag}-{name}"
        veth, peer = f"sl{self.tag}v{i}", f"sl{self.tag}p{i}"
        ip = str(self.subnet.network_address + 10 + i)
        _ip("netns", "add", netns)
        host = Host(name, netns, ip, veth)
        self.hosts[name] = host   # from here on close() removes it
        self._links.append(veth)
        _ip("link", "add", veth, "type", "veth", "peer", "name", peer)
        _ip("link", "set", peer, "netns", netns)
        _ip("link", "set", veth, "master", self.bridge)
        _ip("link", "set", veth, "up")
        inside = ["-n", netns]
        _ip(*inside, "link", "set", "lo", "up")
        _ip(*inside, "link", "set", peer, "name", "eth0")
        _ip(*inside, "addr", "add", f"{ip}/24", "dev", "eth0")
        _ip(*inside, "link", "set", "eth0", "up")
        self._wait_reachable(host)
        return host

    def _wait_reachable(self, host: Host, timeout_s: float = 10) -> None:
        """Until the host answers over the bridge: a TCP connect to a closed port comes back
        refused (the host's kernel answered) instead of timing out."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if reachable(host.ip):
                return
            time.sleep(0.2)
        raise RuntimeError(f"host {host.name} ({host.ip}) is not reachable over {self.bridge} "
                           f"after {timeout_s:.0f} s; expected its kernel to refuse a TCP connect")

    def partition(self, name: str) -> float:
        """Cut host ``name`` off the bridge (its veth down); returns the time it happened."""
        _ip("link", "set", self.hosts[name].veth, "down")
        return time.time()

    def heal(self, name: str) -> float:
        """Plug host ``name`` back in; returns the time it happened."""
        _ip("link", "set", self.hosts[name].veth, "up")
        return time.time()

    def close(self) -> None:
        """Kill what still runs in the lab's namespaces, delete them, the veths, the bridge."""
        for host in self.hosts.values():
            for sig in (signal.SIGTERM, signal.SIGKILL):
                pids = host.pids()
                for pid in pids:
                    try:
                        os.kill(pid, sig)
                    except ProcessLookupError:
                        pass
                if pids and sig == signal.SIGTERM:
                    time.sleep(1.0)
        for host in self.hosts.values():
            _ip("netns", "del", host.netns, check=False)
        for link in reversed(self._links):
            _ip("link", "del", link, check=False)
        self.hosts.clear()
        self._links.clear()

    def __enter__(self) -> Lab:
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()
