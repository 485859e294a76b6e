"""Warm every strategy before its first measured cell (``python -m loadgen
--warmup-requests N``): N short greedy completions on the strategy's own route, half one at a
time, half at once, not recorded as requests (a replica's first requests pay for lazy
initialisation: compiled kernels, allocator growth, connection set-up)."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from loadgen.cli.target import Auth
from loadgen.run import service

WARMUP_MAX_TOKENS = 32   # tokens per warm-up completion


def _complete(url: str, body: dict, auth: Auth, timeout_s: float) -> None:
    """One streamed completion at ``url`` (the load's own path), read to its end. Raises
    urllib.error.URLError / OSError / ValueError."""
    req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={**auth.headers, "Content-Type": "application/json"},
                                 method="POST")
    ctx = service.ssl_context(auth.insecure) if url.startswith("https://") else None
    with urllib.request.urlopen(req, timeout=timeout_s, context=ctx) as resp:  # noqa: S310
        resp.read()


def warm_strategies(urls: dict[str, str], models: dict[str, str], texts: list[str], n: int,
                    auth: Auth, timeout_s: float, say: Callable[[str], None]) -> dict[str, Any]:
    """Warm each strategy (``urls``: strategy -> base URL of its route; ``models``: the
    ``model`` field sent) with ``n`` completions of ``texts`` in turn. Returns the manifest's
    ``warmup`` entries {"seconds": {strategy: s}, "failed": {strategy: error}}; a failure is a
    warning through ``say``, never an exception."""
    out: dict[str, Any] = {"seconds": {}, "failed": {}}

    def one(strategy: str, i: int) -> None:
        body = {"model": models[strategy], "prompt": texts[i % len(texts)],
                "max_tokens": WARMUP_MAX_TOKENS, "temperature": 0.0, "stream": True}
        _complete(urls[strategy], body, auth, timeout_s)

    for strategy in urls:
        t0 = time.monotonic()
        try:
            for i in range((n + 1) // 2):
                one(strategy, i)
            with ThreadPoolExecutor(max_workers=max(1, n // 2)) as pool:
                list(pool.map(lambda i: one(strategy, i), range((n + 1) // 2, n)))
        except (urllib.error.URLError, OSError, ValueError) as err:
            out["failed"][strategy] = str(err)[:300]
            say(f"[yellow]warning[/] warm-up of {strategy} failed: {err}")
        out["seconds"][strategy] = round(time.monotonic() - t0, 3)
    return out
