"""Preloaded into every Ray worker of a node specload starts: Serve's gRPC servers bind the
node's own address instead of the wildcard ``[::]``.

Why this module exists: Ray 2.60 binds two Serve gRPC servers to ``[::]`` with the host
hard-coded, and no Ray option, ``gRPCOptions`` field or environment variable moves them
(ray-project/ray#64544 says so for the first):

- every replica's inter-deployment server (``serve/_private/replica.py``,
  ``add_port_to_grpc_server(self._server, "[::]:0")``; started whatever
  ``RAY_SERVE_USE_GRPC_BY_DEFAULT`` says);
- the gRPC ingress of the proxy and of direct-ingress replicas
  (``serve/_private/grpc_util.py`` ``start_grpc_server``: ``f"[::]:{port}"``; only when
  ``grpc_options`` names servicer functions, which specload's config does not).

Everything else in Ray (GCS, raylet, object manager, core workers, agents, dashboard,
client server, metrics) binds the node IP, so a single-node head on 127.0.0.1 left
exactly these listeners open on every interface. Their clients dial
``RunningReplicaInfo.node_ip`` (the replica's node address), so binding that address
keeps them reachable; on a loopback head it is 127.0.0.1.

How it gets in: Ray's own ``preload_python_modules`` setting (``RAY_preload_python_modules``
in the raylet's environment; ``configs.net.loopback_head`` sets it) makes every worker
import ``cluster.grpc_bind_preload`` before it runs a task or creates an actor; that
module calls ``install()`` (this module changes nothing when imported), which wraps ``add_insecure_port`` / ``add_secure_port`` of grpc's server
classes (sync and asyncio) so a wildcard host is replaced by the worker's node IP; any
explicit host is left as given. Nothing else changes. Without the setting (a cluster you
start yourself) nothing imports it.
"""

from __future__ import annotations

import functools

WILDCARD_HOSTS = frozenset({"", "[::]", "::", "[::0]", "0.0.0.0", "*"})
_MARK = "_specload_node_ip_bind"


def rebind(address: str, node_ip: str) -> str:
    """``address`` (gRPC ``host:port``) with a wildcard host replaced by ``node_ip``.

    >>> rebind("[::]:0", "127.0.0.1"), rebind("0.0.0.0:9000", "fd00::5"), rebind("10.0.0.1:1", "x")
    ('127.0.0.1:0', '[fd00::5]:9000', '10.0.0.1:1')
    """
    host, sep, port = address.rpartition(":")
    if not sep or host not in WILDCARD_HOSTS or not node_ip:
        return address
    return f"[{node_ip}]:{port}" if ":" in node_ip else f"{node_ip}:{port}"


def node_ip() -> str:
    """This worker's node address (what Ray advertises for it), or "" when not connected."""
    try:
        from ray._private import services

        return services.get_node_ip_address()
    except Exception:  # noqa: BLE001  (not a Ray worker: leave binds alone)
        return ""


def _wrap(method):
    if getattr(method, _MARK, False):
        return method

    @functools.wraps(method)
    def bind(self, address, *args, **kwargs):
        return method(self, rebind(address, node_ip()), *args, **kwargs)

    setattr(bind, _MARK, True)
    return bind


def install() -> None:
    """Wrap grpc's server ``add_*_port`` methods (idempotent)."""
    import grpc._server as sync_server
    from grpc.aio import _server as aio_server

    for cls in (sync_server._Server, aio_server.Server):
        for name in ("add_insecure_port", "add_secure_port"):
            setattr(cls, name, _wrap(getattr(cls, name)))


def installed() -> bool:
    """True when ``install()`` ran in this process."""
    from grpc.aio import _server as aio_server

    return getattr(aio_server.Server.add_insecure_port, _MARK, False)

