"""Talking to the target outside the load itself: model list, routes, step log, memory.

Plain ``urllib`` (blocking, short calls between cells), no asyncio.
"""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

# Starting the local service and checking a Serve config belong to the bring-up layer
# (``cluster``); they are named here too for the load generator's callers.
from cluster.config_check import check_serve_config  # noqa: F401  (loadgen.cli.main)
from cluster.launch import ServiceError, start_local_service  # noqa: F401  (loadgen.cli.target)

DEFAULT_LOCAL_URL = "http://127.0.0.1:8000"


class DiscoveryUnavailable(ServiceError):
    """The target answered but has no usable ``/v1/models`` (``--strategies`` skips it).
    ``reason``: what was wrong, without the hint to pass ``--strategies``."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"{reason}; pass --strategies a,b to skip discovery")
        self.reason = reason


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


@dataclass(frozen=True)
class StepPage:
    """One answer of ``GET /specload/step_log``: ``rows`` (step rows), ``next`` (the cursor
    of the following page) and ``total`` (the strategy's rows the store ever took: its
    growth between two pages less the second page's rows is what the store evicted before
    it was fetched). ``next`` and ``total`` are None from a target that pages by ts only."""

    rows: list[dict]
    next: int | None = None
    total: int | None = None


def fetch_step_page(base_url: str, strategy: str, since_ts: float | None, after: int | None = None,
                    timeout_s: float = 30.0, headers: dict[str, str] | None = None,
                    insecure: bool = False) -> StepPage:
    """Engine step rows (metric_names STEP_*) of ``strategy``: with ``after`` (an earlier
    page's ``next``) every row the target's store took since that page, whatever its ts;
    else the rows with ts > ``since_ts`` (unix s). An empty page when the target has none.

    Only specload's server has ``/specload/step_log``; a 404 or 405, a connection error
    or an unexpected body gives an empty page (other OpenAI-compatible servers). Any other
    HTTP error (a specload service that failed to answer: 5xx, 401) raises StepLogError
    with the status and the start of the body, so a caller can say that step rows are
    missing.
    """
    q = {"strategy": strategy}
    if after is not None:
        q["after"] = str(int(after))
    elif since_ts is not None:
        q["since"] = f"{since_ts:.6f}"
    url = f"{base_url}/specload/step_log?{urllib.parse.urlencode(q)}"
    try:
        data = _get_json(url, timeout_s, headers, insecure)
    except urllib.error.HTTPError as err:
        if err.code in (404, 405):
            return StepPage([])
        body = err.read()[:300].decode("utf-8", errors="replace") if err.fp else ""
        raise StepLogError(f"GET {url} answered HTTP {err.code}: {body}") from None
    except (urllib.error.URLError, OSError, ValueError):
        return StepPage([])
    if not isinstance(data, dict):
        return StepPage([])
    rows = data.get("rows")
    count = lambda v: v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None  # noqa: E731
    return StepPage([r for r in rows if isinstance(r, dict)] if isinstance(rows, list) else [],
                    count(data.get("next")), count(data.get("total")))


def fetch_step_log(base_url: str, strategy: str, since_ts: float, timeout_s: float = 30.0,
                   headers: dict[str, str] | None = None, insecure: bool = False) -> list[dict]:
    """Engine step rows (metric_names STEP_*) with ts > ``since_ts`` (unix s); [] when the
    target has none (``fetch_step_page`` without a cursor; its errors)."""
    return fetch_step_page(base_url, strategy, since_ts, None, timeout_s, headers, insecure).rows


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
