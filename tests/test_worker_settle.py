"""LoadRunner._settle_losses: a worker that dies just before the run closes is still recorded.

The CI failure it guards against: a Locust worker killed less than two heartbeats before
``close()`` still had ``heartbeat == HEARTBEAT_LIVENESS - 1``, the old check took that for
alive and returned at once, and the manifest lost the loss. Locust is imported in a child
process (its gevent monkey-patching must not reach the test process).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

SCRIPT = r'''
import json, time, gevent
from types import SimpleNamespace
from locust.runners import HEARTBEAT_LIVENESS
from loadgen.run.locust_runner import LoadRunner

class Clients(dict):
    pass

alive = SimpleNamespace(id="alive", state="running", heartbeat=HEARTBEAT_LIVENESS)
dead = SimpleNamespace(id="dead", state="running", heartbeat=HEARTBEAT_LIVENESS - 1)  # died 1 beat ago
runner = SimpleNamespace(clients=Clients(alive=alive, dead=dead), worker_indexes={"alive": 0, "dead": 1})
lr = object.__new__(LoadRunner)
lr.n_workers, lr.runner, lr._cell_id = 2, runner, "c0"
lr._lost, lr._last_beat, lr._worker_inflight, lr._rows_by_worker = set(), {}, {1: (0.0, 3)}, {1: 5}
lr.worker_losses, lr.worker_info, lr._actors_lost, lr._client_by_pid = [], [], set(), {}
lr._helper_round_ts = None   # no Ray helper lines: Locust's heartbeats alone

def master():   # what locust's heartbeat greenlets do: beats from "alive", "dead" goes missing
    t0 = time.time()
    while time.time() - t0 < 10:
        gevent.sleep(1.0)
        lr._on_heartbeat("alive", time.time())
        dead.heartbeat -= 1
        if dead.heartbeat < 0:
            dead.state = "missing"

g = gevent.spawn(master)
t0 = time.time()
lr._settle_losses(max_wait_s=8.0)
took = time.time() - t0
g.kill()
print(json.dumps({"took": took, "losses": lr.worker_losses}))
'''


def test_worker_dead_one_beat_before_close_is_recorded():
    p = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    (loss,) = out["losses"]
    assert loss["worker_index"] == 1 and loss["client_id"] == "dead"
    assert loss["in_flight_at_last_report"] == 3 and loss["rows_delivered"] == 5
    assert loss["live_workers"] == 1
    assert out["took"] < 8.0      # returned when the dead one was marked missing, not at the bound


RAY_SCRIPT = r'''
import io, json, time, gevent
from types import SimpleNamespace
from locust.runners import HEARTBEAT_LIVENESS
from loadgen.run.locust_runner import LoadRunner

class Clients(dict):
    pass

alive = SimpleNamespace(id="alive", state="running", heartbeat=HEARTBEAT_LIVENESS)
dead = SimpleNamespace(id="dead", state="running", heartbeat=HEARTBEAT_LIVENESS)   # Locust never notices
runner = SimpleNamespace(clients=Clients(alive=alive, dead=dead), worker_indexes={"alive": 0, "dead": 1})
lr = object.__new__(LoadRunner)
lr.n_workers, lr.runner, lr._cell_id = 2, runner, "c0"
lr._lost, lr._last_beat, lr._worker_inflight, lr._rows_by_worker = set(), {}, {0: (0.0, 1), 1: (0.0, 2)}, {1: 7}
lr.worker_losses, lr.worker_info, lr._actors_lost, lr._client_by_pid = [], [], set(), {}
lr._helper_round_ts, lr._helper_ready = None, False
# the helper's lines as loadgen.run.ray_workers prints them; the rows messages gave pid -> client id
lr._client_by_pid = {1001: "alive", 1002: "dead"}
t_start = time.time()

def helper_lines():   # two rounds before close, then the dead actor's LOST, then a fresh round
    yield "WORKER 0 900 1001 127.0.0.1 n0\n"
    yield "WORKER 1 901 1002 127.0.0.1 n0\n"
    yield "READY 2 127.0.0.1\n"
    gevent.sleep(0.5)
    yield "LOST 1\n"
    yield f"ROUND {time.time():.3f}\n"

lr._helper = SimpleNamespace(stdout=helper_lines())
g = gevent.spawn(lr._read_helper)

def beats():
    while True:
        gevent.sleep(0.3)
        lr._on_heartbeat("alive", time.time())
        lr._on_heartbeat("dead", time.time())   # even a worker that still beats is lost once Ray says so

b = gevent.spawn(beats)
t0 = time.time()
lr._settle_losses(max_wait_s=8.0)
took = time.time() - t0
b.kill(); g.kill()
print(json.dumps({"took": took, "losses": lr.worker_losses, "live": lr._live_indices()}))
'''


def test_actor_reported_dead_by_ray_is_recorded_before_locust_notices():
    """The helper's ``LOST <i>`` (Ray: ActorDiedError) makes the worker lost at once, whatever
    Locust's heartbeat state; the settle waits for a helper round newer than its own start."""
    p = subprocess.run([sys.executable, "-c", RAY_SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    (loss,) = out["losses"]
    assert loss["worker_index"] == 1 and loss["client_id"] == "dead" and loss["detected_by"] == "ray"
    assert loss["in_flight_at_last_report"] == 2 and loss["rows_delivered"] == 7
    assert loss["live_workers"] == 1 and out["live"] == [0]
    assert out["took"] < 4.0      # Ray's word, not Locust's ~4 s of missed beats


def test_actor_reported_dead_is_recorded_even_once_locust_dropped_its_client():
    """Locust may drop a worker from ``runner.clients`` (a late ``quit``/``client_stopped``, or
    its missing-for-60-s purge) before anyone checked it: Ray's ``LOST <i>`` still records it."""
    script = RAY_SCRIPT.replace('    yield "LOST 1\\n"', '    runner.clients.pop("dead")\n    yield "LOST 1\\n"')
    assert script != RAY_SCRIPT
    p = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    (loss,) = out["losses"]
    assert loss["worker_index"] == 1 and loss["client_id"] == "dead" and loss["detected_by"] == "ray"
    assert loss["rows_delivered"] == 7 and loss["live_workers"] == 1 and out["live"] == [0]
