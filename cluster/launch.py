"""Starting the service from inside another command, through the layer that owns it.

The load generator's embedded default (``python -m loadgen`` with no ``--target``), its
soak tool and the validation campaigns (``analysis.campaigns``) start specload here:
each call runs ``python -m cluster up`` as a child process (this package's own command,
so its Ray and Serve state stays out of the caller) and reads the base URL from its
last stdout line.

- ``start_local_service``: start or reuse the service on a port (default 8000).
- ``deploy_private``: deploy a given Serve config on a private Ray head and a free
  loopback port, with a ``stop`` callable that runs ``python -m cluster down``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import yaml

from configs.paths import PACKAGE_ROOT


class ServiceError(RuntimeError):
    """The target could not be started or reached."""


def start_local_service(timeout_s: float = 900.0, on_line: Callable[[str], None] | None = None,
                        port: int | None = None, config: str | None = None,
                        direct_ingress: bool = True) -> str:
    """Start or reuse the embedded local service (``python -m cluster up``); returns its base URL.

    ``port`` / ``config`` / ``direct_ingress``: ``cluster up --port`` / ``--config`` /
    ``--[no-]direct-ingress`` (default 8000, the packaged ``configs/serve.yaml``, on).

    ``cluster up`` prints the base URL on its last stdout line and returns while
    the service keeps running (it reuses a running one). Its progress lines
    (stderr: Ray head started, one line per deployment as it becomes ready) go
    to ``on_line`` as they come, so a user sees the start-up instead of silence.
    Raises ServiceError with its stderr tail when it fails.
    """
    cmd = [sys.executable, "-m", "cluster", "up"]
    if port is not None:
        cmd += ["--port", str(port)]
    if config:
        cmd += ["--config", str(config)]
    cmd.append("--direct-ingress" if direct_ingress else "--no-direct-ingress")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + timeout_s
    err_lines: list[str] = []
    assert proc.stderr is not None and proc.stdout is not None
    for line in proc.stderr:   # EOF when `cluster up` exits (the service lives on in Ray)
        err_lines.append(line.rstrip())
        if on_line is not None and line.strip():
            on_line(line.rstrip())
        if time.monotonic() > deadline:
            proc.kill()
            raise ServiceError(f"`python -m cluster up` did not return within {timeout_s:g} s; "
                               "pass --target URL to use a running server")
    out = proc.stdout.read()
    proc.wait()
    lines = [ln.strip() for ln in out.splitlines() if ln.strip()]
    if proc.returncode != 0 or not lines:
        tail = "\n".join(err_lines)[-800:]
        raise ServiceError(f"`python -m cluster up` failed (exit {proc.returncode}): "
                           f"{tail.strip() or 'no output'}; pass --target URL to use a running server")
    url = lines[-1]
    if not url.startswith(("http://", "https://")):
        raise ServiceError(f"`python -m cluster up` should print the base URL last, printed {url!r}")
    return url.rstrip("/")


def _child_env() -> dict[str, str]:
    """The caller's environment with the repo on ``PYTHONPATH`` (replicas import ``actors``
    without an install) and no ``RAY_ADDRESS`` (never deploy onto somebody else's cluster)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(PACKAGE_ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
    env.pop("RAY_ADDRESS", None)
    return env


def _cluster_down(port: int, env: dict[str, str]) -> None:
    """``python -m cluster down --port PORT`` (what ``cluster up`` started there)."""
    subprocess.run([sys.executable, "-m", "cluster", "down", "--port", str(port)],
                   capture_output=True, text=True, timeout=300, env=env, cwd=PACKAGE_ROOT)


def deploy_private(config: dict, workdir: Path, attempts: int = 3) -> tuple[str, Callable[[], None]]:
    """Deploy ``config`` (a Serve config dict) on a private Ray head and a free loopback port;
    returns (base URL, stop), where ``stop()`` runs ``python -m cluster down`` on that port.

    The config is written to ``workdir/serve-<port>.yaml``. An overloaded machine can time a
    Ray head out during start-up; each attempt takes a new port. Raises RuntimeError with the
    last stderr tail after ``attempts``."""
    from configs.net import free_port

    env = _child_env()
    for attempt in range(attempts):
        port = free_port()
        path = Path(workdir) / f"serve-{port}.yaml"
        path.write_text(yaml.safe_dump(config))
        p = subprocess.run([sys.executable, "-m", "cluster", "up", "--config", str(path), "--port",
                            str(port)], capture_output=True, text=True, timeout=1200, env=env,
                           cwd=PACKAGE_ROOT)
        lines = [ln.strip() for ln in p.stdout.splitlines() if ln.strip()]
        if p.returncode == 0 and lines:
            return lines[-1], lambda port=port: _cluster_down(port, env)
        _cluster_down(port, env)
    raise RuntimeError(f"cluster up failed {attempts} times (last exit {p.returncode}): "
                       f"{p.stderr[-1500:]}")
