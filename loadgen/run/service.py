"""Talking to the target outside the load itself: local bring-up, model list, step log.

Plain ``urllib`` (blocking, short calls between cells), no asyncio.
"""

from __future__ import annotations

import json
import re
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


class DiscoveryUnavailable(ServiceError):
    """The target answered but has no usable ``/v1/models`` (``--strategies`` skips it).
    ``reason``: what was wrong, without the hint to pass ``--strategies``."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"{reason}; pass --strategies a,b to skip discovery")
        self.reason = reason


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


def ssl_context(insecure: bool = False) -> ssl.SSLContext:
    """TLS context for https targets: verified by default (system CAs / ``SSL_CERT_FILE``)."""
    ctx = ssl.create_default_context()
    if insecure:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    return ctx


def normalize_base_url(url: str) -> str:
    """The server's base URL from what a user pastes: ``http://h:8000``,
    ``http://h:8000/``, ``http://h:8000/v1`` and ``http://h:8000/v1/`` all give
    ``http://h:8000`` (every path here adds ``/v1/...`` itself). A path prefix
    in front of ``/v1`` (a gateway's ``/openai/v1``) is kept. Raises
    ServiceError naming ``--target`` for a URL that is not http(s)://host."""
    raw = url.strip()
    parts = urllib.parse.urlsplit(raw)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ServiceError(f"--target: expected a base URL such as http://127.0.0.1:8000 "
                           f"(with or without /v1), got {url!r}")
    path = parts.path.rstrip("/")
    if path.endswith("/v1"):
        path = path[:-len("/v1")]
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, path, "", "")).rstrip("/")


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
    """Model ids from ``GET /v1/models`` (specload: one per strategy).

    Every failure names the URL. Unreachable, or a 401 / 403 (which names
    ``--api-key``): ServiceError. The server answered without a model list
    (another HTTP error, not JSON): DiscoveryUnavailable, which
    ``--strategies a,b`` skips.
    """
    url = f"{base_url}/v1/models"
    try:
        data = _get_json(url, timeout_s, headers, insecure)
    except urllib.error.HTTPError as err:
        if err.code in (401, 403):
            raise ServiceError(f"GET {url} answered HTTP {err.code}; pass --api-key KEY (or "
                               "set OPENAI_API_KEY) or --header 'Authorization: ...'") from None
        raise DiscoveryUnavailable(f"model discovery failed: GET {url} -> HTTP {err.code}") from None
    except (urllib.error.URLError, OSError) as err:
        raise ServiceError(f"model discovery failed: GET {url} -> {err}; is the server up "
                           "at that URL?") from None
    except ValueError as err:
        raise DiscoveryUnavailable(f"model discovery failed: GET {url} is not JSON ({err})") from None
    if not isinstance(data, dict):
        raise DiscoveryUnavailable(f"model discovery failed: GET {url} did not return an "
                                   "OpenAI model list")
    return [str(m["id"]) for m in data.get("data", []) if isinstance(m, dict) and "id" in m]


def _routes_page(base_url: str, timeout_s: float, headers: dict[str, str] | None,
                 insecure: bool) -> dict:
    """``GET /specload/routes``; {} when the target has none or does not answer (another
    OpenAI-compatible server)."""
    try:
        data = _get_json(f"{base_url}/specload/routes", timeout_s, headers, insecure)
    except (urllib.error.URLError, OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _listed(page: dict, key: str) -> dict:
    """One mapping of the routes page ({} when absent or not a mapping)."""
    listed = page.get(key)
    return listed if isinstance(listed, dict) else {}


def strategy_routes(base_url: str, timeout_s: float = 10.0, headers: dict[str, str] | None = None,
                    insecure: bool = False) -> dict[str, str]:
    """Strategy -> path of its own one-hop route relative to ``base_url``
    (``GET /specload/routes``: ``/strategies/<name>``, whose ``/v1/completions`` the
    strategy replica serves itself). {} when the target lists none (another
    OpenAI-compatible server, or a specload service deployed as one application)."""
    routes = _listed(_routes_page(base_url, timeout_s, headers, insecure), "routes")
    return {str(k): v for k, v in routes.items() if isinstance(v, str) and v.startswith("/")}


def direct_listeners(base_url: str, timeout_s: float = 10.0,
                     headers: dict[str, str] | None = None,
                     insecure: bool = False) -> dict[str, list[str]]:
    """Strategy -> base URLs of its replicas' own HTTP listeners (``GET /specload/routes``'s
    ``direct``: Ray Serve's direct ingress, on in ``python -m cluster up`` by default; the
    strategy's one-hop route is under each). A strategy the target marks ``autoscaling``
    is left out: Serve may add replicas, and only its router (the proxy's routes) spreads
    load over them. {} when the target lists none."""
    page = _routes_page(base_url, timeout_s, headers, insecure)
    listed, scaled = _listed(page, "direct"), _listed(page, "autoscaling")
    return {str(k): [u for u in v if isinstance(u, str) and u.startswith(("http://", "https://"))]
            for k, v in listed.items() if isinstance(v, list) and scaled.get(k) is not True}


def answers(url: str, timeout_s: float = 5.0, headers: dict[str, str] | None = None,
            insecure: bool = False) -> bool:
    """``GET url`` answers HTTP 200 within ``timeout_s``."""
    try:
        _get_json(url, timeout_s, headers, insecure)
        return True
    except (urllib.error.URLError, OSError, ValueError):
        return False


class StepLogError(ServiceError):
    """A target with a step log answered its query with an error (the rows are lost)."""


def fetch_step_log(base_url: str, strategy: str, since_ts: float, timeout_s: float = 30.0,
                   headers: dict[str, str] | None = None, insecure: bool = False) -> list[dict]:
    """Engine step rows (metric_names STEP_*) since ``since_ts`` (unix s); [] when the target has none.

    Only specload's server has ``/specload/step_log``; a 404 or 405, a connection error
    or an unexpected body gives [] (other OpenAI-compatible servers). Any other HTTP
    error (a specload service that failed to answer: 5xx, 401) raises StepLogError with
    the status and the start of the body, so a caller can say that step rows are missing.
    """
    q = urllib.parse.urlencode({"strategy": strategy, "since": f"{since_ts:.6f}"})
    url = f"{base_url}/specload/step_log?{q}"
    try:
        data = _get_json(url, timeout_s, headers, insecure)
    except urllib.error.HTTPError as err:
        if err.code in (404, 405):
            return []
        body = err.read()[:300].decode("utf-8", errors="replace") if err.fp else ""
        raise StepLogError(f"GET {url} answered HTTP {err.code}: {body}") from None
    except (urllib.error.URLError, OSError, ValueError):
        return []
    rows = data.get("rows") if isinstance(data, dict) else None
    return [r for r in rows if isinstance(r, dict)] if isinstance(rows, list) else []


def fetch_memory(base_url: str, strategy: str, reset_peak: bool = False, timeout_s: float = 30.0,
                 headers: dict[str, str] | None = None, insecure: bool = False) -> dict:
    """One replica's memory report for ``strategy`` (``GET /specload/memory``: weight, KV-cache
    and process bytes); with ``reset_peak`` (``POST /specload/memory/reset_peak``) the replica
    restarts its peak counters after answering. {} when the target has no such route
    (other OpenAI-compatible servers) or does not answer."""
    q = urllib.parse.urlencode({"strategy": strategy})
    url = f"{base_url}/specload/memory{'/reset_peak' if reset_peak else ''}?{q}"
    try:
        if reset_peak:
            req = urllib.request.Request(url, data=b"", headers=dict(headers or {}), method="POST")
            ctx = ssl_context(insecure) if url.startswith("https://") else None
            with urllib.request.urlopen(req, timeout=timeout_s, context=ctx) as resp:  # noqa: S310
                data = json.loads(resp.read().decode("utf-8"))
        else:
            data = _get_json(url, timeout_s, headers, insecure)
    except (urllib.error.URLError, OSError, ValueError):
        return {}
    rep = data.get(strategy) if isinstance(data, dict) else None
    return rep if isinstance(rep, dict) else {}


def specload_info(base_url: str, timeout_s: float = 30.0, headers: dict[str, str] | None = None) -> dict:
    """``GET /specload/info`` of a specload target: per served strategy its live facts (pid,
    max_model_len, waiting, running, step-log rows / capacity); {} for other servers."""
    try:
        data = _get_json(f"{base_url}/specload/info", timeout_s, headers)
    except (urllib.error.URLError, OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _first_error(err: Any) -> str:
    """``loc: msg`` of a pydantic ValidationError's first error (and how many more)."""
    errors = err.errors()
    if not errors:
        return str(err)
    e = errors[0]
    loc = ".".join(str(x) for x in e.get("loc", ())) or "<root>"
    more = f" (and {len(errors) - 1} more error(s))" if len(errors) > 1 else ""
    # a nested ValidationError (strategy_options) arrives as multi-line text: keep one line
    lines = [ln.strip() for ln in str(e.get("msg")).splitlines()
             if ln.strip() and not ln.strip().startswith("For further information")]
    msg = re.sub(r"\s*\[type=[^\]]*\]", "", " ".join(lines))
    return f"{loc}: {msg}{more}"


def check_serve_config(path: str | Any) -> dict:
    """Read and validate a Serve config the way the deployment will, before anything starts.

    Checks: the file is readable YAML with ``applications``; every
    ``actors.serve.app:build_app`` application's ``args`` against
    ``configs.serve_config.ServeAppConfig``; and, with the real engine factory, every
    strategy's ``engine`` section against ``actors.engine.config.EngineConfig`` (which
    also validates ``strategy_options`` against the strategy's own options model).
    Returns the parsed config (a dict). Raises ValueError naming the file, the
    application / strategy and the first pydantic error.
    """
    from pathlib import Path

    import yaml
    from pydantic import ValidationError

    from actors.engine.config import EngineConfig
    from actors.serve.app import APP_IMPORT_PATH, resolve_engine_config
    from configs.serve_config import DEFAULT_ENGINE_FACTORY, ServeAppConfig

    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{p} is a directory, not a Serve config file")
    try:
        cfg = yaml.safe_load(p.read_text())
    except OSError as err:
        raise ValueError(f"cannot read {p}: {err.strerror or err}") from None
    except yaml.YAMLError as err:
        raise ValueError(f"{p} is not valid YAML: {str(err).splitlines()[0]}") from None
    if not isinstance(cfg, dict) or not isinstance(cfg.get("applications"), list):
        raise ValueError(f"{p}: expected a Serve config with an 'applications' list, got "
                         f"{type(cfg).__name__}")
    for i, app in enumerate(cfg["applications"]):
        if not isinstance(app, dict):
            raise ValueError(f"{p}: applications[{i}] is not a mapping")
        if app.get("import_path") != APP_IMPORT_PATH:
            continue
        where = f"{p}: application {app.get('name', i)!r}"
        try:
            args = ServeAppConfig.model_validate(app.get("args") or {})
        except ValidationError as err:
            raise ValueError(f"{where}: args.{_first_error(err)}") from None
        if args.engine_factory != DEFAULT_ENGINE_FACTORY:
            continue
        for entry in args.strategies:
            try:
                EngineConfig(**resolve_engine_config(entry.engine))
            except ValidationError as err:
                raise ValueError(f"{where}: strategy {entry.name!r} engine.{_first_error(err)}") from None
    return cfg
