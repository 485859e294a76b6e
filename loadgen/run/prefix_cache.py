"""Forget the target's prefix cache before a cell (vLLM's ``POST /reset_prefix_cache``).

Every cell of a run sends the same shuffled prompts from the start, and a server with
prefix caching (vLLM's default; specload's engine for the strategies that can use it)
keeps them: without a reset, a strategy's first cell prefills every prompt and its later
cells (repeats, other tiers, the A/A's second baseline) find them cached, so the first
cell ran up to 2x slower in TTFT than its repeats and the A/A measured the cache, not the
noise. A reset before each cell gives every replicate the same cold start.

vLLM serves the route only with ``VLLM_SERVER_DEV_MODE=1`` (404 otherwise); specload's
service serves it on the ingress (``?model=<strategy>``) and on each strategy's own route.
"""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass

RESET_PATH = "/reset_prefix_cache"
RESET_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class ResetResult:
    """One reset: ``status`` is ``reset`` (the server said success), ``busy`` (success
    false: vLLM refuses while blocks are held), ``unsupported`` (404 / 405: the route is
    not served) or ``failed`` (another HTTP status, or no answer); ``detail`` says why."""

    status: str
    detail: str = ""


def reset_prefix_cache(base_url: str, model: str, headers: dict[str, str] | None = None,
                       insecure: bool = False, timeout_s: float = RESET_TIMEOUT_S) -> ResetResult:
    """POST ``{base_url}/reset_prefix_cache?model=<model>`` and classify the answer (the
    ``model`` query parameter picks the strategy on specload's ingress; vLLM and a strategy's
    own route ignore it). Never raises for an HTTP or network problem: the cell still runs.
    urllib, not httpx: the load generator's process is gevent-patched (Locust), like the
    warm-up requests'."""
    url = f"{base_url.rstrip('/')}{RESET_PATH}?{urllib.parse.urlencode({'model': model})}"
    req = urllib.request.Request(url, data=b"", headers=dict(headers or {}), method="POST")
    ctx = None
    if url.startswith("https://") and insecure:
        ctx = ssl.create_default_context()
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    try:
        with urllib.request.urlopen(req, timeout=timeout_s, context=ctx) as resp:  # noqa: S310
            body = resp.read()
    except urllib.error.HTTPError as err:
        if err.code in (404, 405):
            return ResetResult("unsupported", f"HTTP {err.code} on {RESET_PATH} (vLLM serves it "
                                              "only with VLLM_SERVER_DEV_MODE=1)")
        return ResetResult("failed", f"HTTP {err.code}: {err.read()[:200]!r}")
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return ResetResult("failed", f"{type(exc).__name__}: {exc}"[:300])
    try:
        ok = bool(json.loads(body or b"{}").get("success", True))
    except (ValueError, AttributeError):   # 200 without a JSON object (an older vLLM): done
        ok = True
    return ResetResult("reset" if ok else "busy", "" if ok else "the server held blocks (success false)")
