"""Locust workers as Ray actors: each actor runs ``locust --worker`` as a subprocess.

Why a subprocess (docs/design.md, "Data flow"): importing Locust inside a Ray actor
hangs (gevent monkey-patching in a Ray worker process). And why this module runs
in its *own* process, started by the driver: the driver has imported Locust
(monkey-patched), so Ray is kept out of it entirely.

    python -m loadgen.run.ray_workers --n 4 --master-port 5557 [--address auto] [--placement spread|per-node|pack]

Starts a private local Ray instance, or connects to the cluster at ``--address``
/ RAY_ADDRESS (``auto``: the cluster this node belongs to), places
N actors with ``num_cpus`` 0.1 each, prints one ``WORKER <i> <actor_pid> <locust_pid> <node_ip>
<ray_node_id>`` line per actor and then ``READY <n> <master_host>``, and waits until
stdin closes or SIGTERM/SIGINT, then stops the workers and shuts Ray down if
it started it. While it waits it asks every actor for its pid once a second and
prints ``LOST <i>`` for one Ray reports dead and ``ROUND <unix s>`` after each round.

Placement (``--placement``): ``spread`` (default) uses Ray's SPREAD scheduling
strategy, so the actors go to different nodes as far as resources allow;
``per-node`` pins actor i to alive node i mod (number of nodes) with a hard
node affinity (N = number of nodes: one worker per node); ``pack`` is Ray's
default (fill the local node first). Each ``locust --worker`` process dies
with its actor (Linux parent-death signal), so losing a node loses the load
worker on it, as on a real cluster. Each actor's process connects back to the master at the
driver node's IP. Remote nodes need the repository importable (same path or
an installed package): this process passes ``PYTHONPATH`` for local runs only.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from configs.net import LOOPBACK, RAY_WORKER_PRIORITY_ENV, use_loopback_env
from configs.paths import PACKAGE_ROOT

LOCUSTFILE = Path(__file__).resolve().parent / "locustfile.py"


PLACEMENTS = ("spread", "per-node", "pack")
NODE_ID_ENV = "SPECLOAD_RAY_NODE_ID"   # the Ray node a Locust worker runs on (sent with its rows)


def _die_with_parent() -> None:
    """preexec_fn: SIGKILL this child when the actor process that started it dies (Linux)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):   # not Linux: the child outlives a killed actor
        pass


def scheduling_options(placement: str, index: int, alive_node_ids: list[str]) -> dict:
    """Ray ``.options()`` for worker actor ``index`` under ``placement`` (module docstring)."""
    if placement == "spread":
        return {"scheduling_strategy": "SPREAD"}
    if placement == "per-node":
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        return {"scheduling_strategy": NodeAffinitySchedulingStrategy(
            alive_node_ids[index % len(alive_node_ids)], soft=False)}
    return {}


def worker_command(master_host: str, master_port: int) -> list[str]:
    """The ``locust --worker`` command line one actor runs."""
    return [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--worker", "--master-host", master_host,
            "--master-port", str(master_port), "--loglevel", "WARNING"]


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """The command's flags (a bad one exits 2)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, required=True, help="number of Locust workers (actors)")
    ap.add_argument("--master-host", default="", help="default: this node's IP as Ray sees it")
    ap.add_argument("--master-port", type=int, required=True)
    ap.add_argument("--address", default=os.environ.get("RAY_ADDRESS", ""),
                    help="Ray cluster address (or 'auto'); empty = start a private local Ray instance")
    ap.add_argument("--num-cpus", type=float, default=0.1, help="Ray CPUs reserved per worker actor")
    ap.add_argument("--placement", choices=PLACEMENTS, default="spread",
                    help="spread (Ray SPREAD), per-node (worker i on node i mod nodes), pack")
    return ap.parse_args(argv)


def _worker_class(ray, num_cpus: float):
    """The Ray actor class (``num_cpus`` CPUs each, never restarted) owning one Locust worker."""

    @ray.remote(num_cpus=num_cpus, max_restarts=0)
    class LocustWorker:
        """Owns one ``locust --worker`` subprocess."""

        def __init__(self, cmd: list[str], extra_env: dict[str, str]) -> None:
            env = dict(os.environ)
            env.update(extra_env)
            self.node_id = ray.get_runtime_context().get_node_id()
            env[NODE_ID_ENV] = self.node_id
            self.proc = subprocess.Popen(cmd, env=env, cwd=str(PACKAGE_ROOT), preexec_fn=_die_with_parent)

        def pid(self) -> int:
            return self.proc.pid

        def facts(self) -> tuple[int, int, str, str]:
            """(this actor's process id, its ``locust --worker`` pid, node IP, Ray node id)."""
            return os.getpid(), self.proc.pid, ray.util.get_node_ip_address(), self.node_id

        def stop(self) -> int | None:
            if self.proc.poll() is None:
                self.proc.terminate()
                try:
                    self.proc.wait(10)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(5)
            return self.proc.returncode

    return LocustWorker


def _start_workers(ray, a: argparse.Namespace, master_host: str) -> list | None:
    """Place ``--n`` worker actors and print a WORKER line for each, then READY; None (after an
    ERROR line and ``ray.shutdown``) when they cannot be placed within 300 s."""
    LocustWorker = _worker_class(ray, a.num_cpus)
    extra_env = {"SPECLOAD_WORKER": "1", "PYTHONPATH": str(PACKAGE_ROOT)}
    alive = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])
    actors = [LocustWorker.options(**scheduling_options(a.placement, i, alive)).remote(
        worker_command(master_host, a.master_port), extra_env) for i in range(a.n)]
    try:
        facts = ray.get([w.facts.remote() for w in actors], timeout=300)
    except Exception as err:  # noqa: BLE001
        print(f"ERROR could not place {a.n} worker actors ({err}); the cluster may lack "
              f"{a.n * a.num_cpus:g} free CPUs", flush=True)
        ray.shutdown()
        return None
    for i, (actor_pid, locust_pid, ip, node_id) in enumerate(facts):
        print(f"WORKER {i} {actor_pid} {locust_pid} {ip} {node_id}", flush=True)
    print(f"READY {a.n} {master_host}", flush=True)
    return actors


def watch_actors(ray, actors: list, stop: threading.Event, every_s: float = 1.0,
                 call_timeout_s: float = 10.0) -> None:
    """Until ``stop``: ask each live actor its pid once per round; print ``LOST <i>`` for an actor Ray
    reports dead (``ActorDiedError``: process killed, node gone; never restarted) and ``ROUND <t>`` after
    each round (``t``: unix s the round began). A slow answer (``GetTimeoutError``) or a transient
    ``ActorUnavailableError`` is not a death. The master (``LoadRunner``) uses both lines: a lost
    actor is a lost Locust worker, recorded without waiting for Locust's missed heartbeats."""
    from ray.exceptions import ActorDiedError, ActorUnavailableError, GetTimeoutError

    lost: set[int] = set()
    while not stop.is_set():
        t0 = time.time()
        for i, w in enumerate(actors):
            if i in lost or stop.is_set():
                continue
            try:
                ray.get(w.pid.remote(), timeout=call_timeout_s)
            except (GetTimeoutError, ActorUnavailableError):
                continue
            except ActorDiedError:
                lost.add(i)
                if not _say(f"LOST {i}"):
                    return
            except Exception:  # noqa: BLE001  (Ray shutting down under us: stop watching)
                return
        if not _say(f"ROUND {t0:.3f}"):
            return
        stop.wait(every_s)


def _say(line: str) -> bool:
    """One line to the master; False once it has gone (its end of the pipe closed)."""
    try:
        print(line, flush=True)
        return True
    except (OSError, ValueError):
        return False


def _wait_and_stop(ray, actors: list) -> None:
    """Block until SIGTERM, SIGINT or EOF on stdin, watching the actors (``watch_actors``); then stop
    every worker (30 s each, best effort)."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    watcher = threading.Thread(target=watch_actors, args=(ray, actors, stop), daemon=True)
    watcher.start()
    stop.wait()
    watcher.join(timeout=15)
    for w in actors:   # one by one: a dead actor (a lost worker) must not skip the others
        try:
            ray.get(w.stop.remote(), timeout=30)
        except Exception:  # noqa: BLE001  (best effort: actors die with the job anyway)
            pass


def main(argv: list[str] | None = None) -> int:
    a = _parse(argv)
    if not a.address:   # a private single-node Ray: every listener on 127.0.0.1 (docs/network.md)
        use_loopback_env()   # before Ray is imported: it reads the switch at import
        a.master_host = a.master_host or LOOPBACK

    for k, v in RAY_WORKER_PRIORITY_ENV.items():   # load workers at normal priority (configs.net)
        os.environ.setdefault(k, v)
    import ray  # only here: never in a process that imported locust

    started = not ray.is_initialized()
    # "local" rather than None: None silently joins whatever cluster /tmp/ray last recorded,
    # which may be stale (seen here: a dead GCS from another process made ray.init hang).
    ray.init(address=a.address or "local", include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(PACKAGE_ROOT)}} if not a.address else None)
    master_host = a.master_host or ray.util.get_node_ip_address()
    actors = _start_workers(ray, a, master_host)
    if actors is None:
        return 1
    _wait_and_stop(ray, actors)
    if started:
        ray.shutdown()
    return 0

if __name__ == "__main__":
    sys.exit(main())
