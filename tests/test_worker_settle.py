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
lr.worker_losses = []

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
