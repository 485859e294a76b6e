"""``cluster down`` then ``cluster up`` at once on the same port succeeds (issue 23).

Before, the port check bound without ``SO_REUSEADDR``: the previous service's connections
in TIME-WAIT made it refuse ``up`` ("in use by another server") for up to a minute,
although nothing listened. Real Ray, one strategy (slow, about a minute)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from configs.net import LOOPBACK, free_port

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


def _plain_bind_fails(port: int) -> bool:
    with socket.socket() as s:   # the old check: no SO_REUSEADDR
        try:
            s.bind((LOOPBACK, port))
            return False
        except OSError:
            return True


def test_up_down_up_at_once(tmp_path):
    cfg = yaml.safe_load((REPO / "configs" / "serve.yaml").read_text())
    app = cfg["applications"][0]["args"]
    app["strategies"] = [s for s in app["strategies"]
                         if s["engine"]["strategy"] == "autoregressive"][:1]
    port = free_port()
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(cfg))
    up = [sys.executable, "-m", "cluster", "up", "--config", str(path), "--port", str(port),
          "--timeout", "300"]
    down = [sys.executable, "-m", "cluster", "down", "--port", str(port)]
    try:
        first = subprocess.run(up, cwd=REPO, capture_output=True, text=True, timeout=420)
        assert first.returncode == 0, first.stderr[-2000:]
        # a client holding a keep-alive connection, as a load generator does: the server
        # closes it first at shutdown, leaving TIME-WAIT on the service's own port
        import http.client

        keep = http.client.HTTPConnection(LOOPBACK, port, timeout=30)
        keep.request("GET", "/health")
        keep.getresponse().read()
        d = subprocess.run(down, cwd=REPO, capture_output=True, text=True, timeout=180)
        keep.close()
        assert d.returncode == 0, d.stderr[-2000:]
        t_down = time.monotonic()
        time_wait = _plain_bind_fails(port)   # the case the old check refused
        second = subprocess.run(up, cwd=REPO, capture_output=True, text=True, timeout=420)
        elapsed = time.monotonic() - t_down
        assert second.returncode == 0, second.stderr[-2000:]
        assert "in use" not in second.stderr
        assert second.stdout.strip().splitlines()[-1] == f"http://{LOOPBACK}:{port}"
        print(f"\nup again {elapsed:.1f} s after down returned (a plain bind "
              f"{'failed: TIME-WAIT present' if time_wait else 'succeeded'} at that moment)")
    finally:
        subprocess.run(down, cwd=REPO, capture_output=True, text=True, timeout=180)
