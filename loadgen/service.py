"""Talking to the target outside the load itself: local bring-up, model list, step log.

Plain ``urllib`` (blocking, short calls between cells), no asyncio.
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

DEFAULT_LOCAL_URL = "http://127.0.0.1:8000"


class ServiceError(RuntimeError):
    """The target could not be started or reached."""


def start_local_service(timeout_s: float = 900.0) -> str:
    """Start or reuse the embedded local service (``python -m cluster up``); returns its base URL.

    ``cluster up`` prints the base URL on its last stdout line and returns while
    the service keeps running (it reuses a running one). Raises ServiceError
    with its stderr tail when it fails.
    """
    try:
        proc = subprocess.run([sys.executable, "-m", "cluster", "up"], capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise ServiceError(f"`python -m cluster up` did not return within {timeout_s:g} s; "
                           "pass --target URL to use a running server") from None
    lines = [ln.strip() for ln in proc.stdout.splitlines() if ln.strip()]
    if proc.returncode != 0 or not lines:
        raise ServiceError(f"`python -m cluster up` failed (exit {proc.returncode}): "
                           f"{proc.stderr.strip()[-800:] or 'no output'}; pass --target URL to use a running server")
    url = lines[-1]
    if not url.startswith(("http://", "https://")):
        raise ServiceError(f"`python -m cluster up` should print the base URL last, printed {url!r}")
    return url.rstrip("/")


def _get_json(url: str, timeout_s: float) -> Any:
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:  # noqa: S310 (user-given target)
        return json.loads(resp.read().decode("utf-8"))


def list_models(base_url: str, timeout_s: float = 10.0) -> list[str]:
    """Model ids from ``GET /v1/models`` (specload: one per strategy); ServiceError if unreachable."""
    try:
        data = _get_json(f"{base_url}/v1/models", timeout_s)
    except (urllib.error.URLError, OSError, ValueError) as err:
        raise ServiceError(f"GET {base_url}/v1/models failed ({err}); is the server up? "
                           "Pass --strategies a,b to skip discovery") from None
    return [str(m["id"]) for m in data.get("data", []) if isinstance(m, dict) and "id" in m]


def fetch_step_log(base_url: str, strategy: str, since_ts: float, timeout_s: float = 30.0) -> list[dict]:
    """Engine step rows (metric_names STEP_*) since ``since_ts`` (unix s); [] when the target has none.

    Only specload's server has ``/specload/step_log``; a 404, a connection error
    or an unexpected body gives [] (other OpenAI-compatible servers).
    """
    q = urllib.parse.urlencode({"strategy": strategy, "since": f"{since_ts:.6f}"})
    try:
        data = _get_json(f"{base_url}/specload/step_log?{q}", timeout_s)
    except (urllib.error.URLError, OSError, ValueError):
        return []
    rows = data.get("rows") if isinstance(data, dict) else None
    return [r for r in rows if isinstance(r, dict)] if isinstance(rows, list) else []
