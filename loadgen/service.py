"""Talking to the target outside the load itself: local bring-up, model list, step log.

Plain ``urllib`` (blocking, short calls between cells), no asyncio.
"""

from __future__ import annotations

import json
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Callable

DEFAULT_LOCAL_URL = "http://127.0.0.1:8000"


class ServiceError(RuntimeError):
    """The target could not be started or reached."""


def start_local_service(timeout_s: float = 900.0, on_line: Callable[[str], None] | None = None,
                        port: int | None = None, config: str | None = None) -> str:
    """Start or reuse the embedded local service (``python -m cluster up``); returns its base URL.

    ``port`` / ``config``: ``cluster up --port`` / ``--config`` (default 8000 and
    the packaged ``configs/serve.yaml``).

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


def ssl_context(insecure: bool = False) -> ssl.SSLContext:
    """TLS context for https targets: verified by default (system CAs / ``SSL_CERT_FILE``)."""
    ctx = ssl.create_default_context()
    if insecure:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    return ctx


def _get_json(url: str, timeout_s: float, headers: dict[str, str] | None = None,
              insecure: bool = False) -> Any:
    req = urllib.request.Request(url, headers=dict(headers or {}))
    ctx = None
    if url.startswith("https://"):
        ctx = ssl_context(insecure)
    with urllib.request.urlopen(req, timeout=timeout_s, context=ctx) as resp:  # noqa: S310 (user-given target)
        return json.loads(resp.read().decode("utf-8"))


def list_models(base_url: str, timeout_s: float = 10.0, headers: dict[str, str] | None = None,
                insecure: bool = False) -> list[str]:
    """Model ids from ``GET /v1/models`` (specload: one per strategy); ServiceError if unreachable.

    A 401 / 403 names ``--api-key`` (the server wants a key, or another one).
    """
    try:
        data = _get_json(f"{base_url}/v1/models", timeout_s, headers, insecure)
    except urllib.error.HTTPError as err:
        hint = ("; pass --api-key KEY (or set OPENAI_API_KEY) or --header 'Authorization: ...'"
                if err.code in (401, 403) else "")
        raise ServiceError(f"GET {base_url}/v1/models answered HTTP {err.code}{hint}") from None
    except (urllib.error.URLError, OSError, ValueError) as err:
        raise ServiceError(f"GET {base_url}/v1/models failed ({err}); is the server up? "
                           "Pass --strategies a,b to skip discovery") from None
    return [str(m["id"]) for m in data.get("data", []) if isinstance(m, dict) and "id" in m]


def fetch_step_log(base_url: str, strategy: str, since_ts: float, timeout_s: float = 30.0,
                   headers: dict[str, str] | None = None, insecure: bool = False) -> list[dict]:
    """Engine step rows (metric_names STEP_*) since ``since_ts`` (unix s); [] when the target has none.

    Only specload's server has ``/specload/step_log``; a 404, a connection error
    or an unexpected body gives [] (other OpenAI-compatible servers).
    """
    q = urllib.parse.urlencode({"strategy": strategy, "since": f"{since_ts:.6f}"})
    try:
        data = _get_json(f"{base_url}/specload/step_log?{q}", timeout_s, headers, insecure)
    except (urllib.error.URLError, OSError, ValueError):
        return []
    rows = data.get("rows") if isinstance(data, dict) else None
    return [r for r in rows if isinstance(r, dict)] if isinstance(rows, list) else []
