"""One streamed completion over geventhttpclient (gevent-native; no asyncio in the gevent loop).

The body is read line by line to the very end of the stream (``readline``
returns as soon as a line is buffered, so each chunk is stamped when it
arrives); the response time never stops at the headers. Every outcome is a
row: ``ok``, ``error`` (HTTP status or an error object in the stream), ``replica_lost``
(the error code says the replica serving it died),
``timeout`` (whole-request client timeout; a refused connection is an ``error`` row
marked under ``REFUSED_KEY``; every failure of the connection itself, refused or
not, under ``CONNECTION_LOST_KEY``), ``disconnected`` (stream closed
before ``[DONE]``/finish), ``rejected`` (HTTP 429: the server shed the request;
its ``Retry-After`` is returned under ``RETRY_AFTER_KEY`` for the retry policy)
or ``cancelled`` (the cell was stopped mid-request).
"""

from __future__ import annotations

import json
import time
from typing import Any, Callable
from urllib.parse import urlsplit

import gevent
from geventhttpclient import HTTPClient

from configs import metric_names as M
from loadgen.run.service import ssl_context
from loadgen.run.cells import parse_retry_after
from loadgen.run.timing import SSEParser, StreamRecorder

COMPLETIONS_PATH = "/v1/completions"
RETRY_AFTER_KEY = "_retry_after_s"   # in a rejected row's fields: the server's Retry-After, seconds (None: absent)
REFUSED_KEY = "_refused"   # in an error row's fields: True when the connection was refused (nothing sent)
CONNECTION_LOST_KEY = "_connection_lost"   # in a row's fields: True when the connection failed (refused,
#   reset, closed before or during the response): the server behind it may be gone


def make_http_client(base_url: str, timeout_s: float, headers: dict[str, str] | None = None,
                     insecure: bool = False) -> HTTPClient:
    """One keep-alive connection (a Locust user has exactly one request in flight).

    ``headers`` (``--header``, ``Authorization`` from ``--api-key``) go with every
    request. ``https://`` targets verify the server certificate against the
    system CA store (or ``SSL_CERT_FILE``) unless ``insecure``.
    """
    u = urlsplit(base_url)
    kw: dict[str, Any] = {}
    if u.scheme == "https":
        # our context (system CAs / SSL_CERT_FILE, like the urllib preflight calls); geventhttpclient
        # re-applies check_hostname = not insecure, so insecure goes to it as well
        kw.update(ssl_context_factory=lambda **_: ssl_context(insecure), insecure=insecure)
    return HTTPClient.from_url(f"{u.scheme}://{u.netloc}", concurrency=1, connection_timeout=min(timeout_s, 30.0),
                               network_timeout=timeout_s,
                               headers={"Accept": "text/event-stream", **(headers or {})}, **kw)


def path_prefix(base_url: str) -> str:
    """Path part of the base URL (``http://h/prefix`` -> ``/prefix``), no trailing slash."""
    return urlsplit(base_url).path.rstrip("/")


def stream_completion(http: HTTPClient, path: str, body: dict[str, Any], scheduled_ts: float | None,
                      timeout_s: float, on_cancel: Callable[[dict[str, Any]], None] | None = None,
                      ) -> tuple[dict[str, Any], bool]:
    """Send one streaming completion; returns (timing row fields, connection_ok).

    ``scheduled_ts`` (unix s) is the open-loop slot; None means "now" (closed
    loop). If the calling greenlet is killed (cell stopped), ``on_cancel`` gets a
    ``cancelled`` row before GreenletExit propagates. ``connection_ok`` is
    False when the caller should drop and recreate ``http``.
    """
    sent = time.time()
    rec = StreamRecorder(scheduled_ts=scheduled_ts if scheduled_ts is not None else sent, sent_ts=sent)
    payload = json.dumps(body)
    timer = gevent.Timeout(timeout_s)
    timer.start()
    resp = None
    try:
        resp = http.post(path, body=payload, headers={"Content-Type": "application/json"})
        if resp.status_code != 200:
            return _http_error_row(rec, resp), True
        return _read_stream(rec, resp)
    except gevent.Timeout as t:
        if t is not timer:
            raise
        return rec.row(time.time(), M.STATUS_TIMEOUT, f"no complete response within {timeout_s:g} s"), False
    except gevent.GreenletExit:
        if on_cancel is not None:
            on_cancel(rec.row(time.time(), M.STATUS_CANCELLED, "cell stopped while in flight"))
        raise
    except Exception as err:  # connection refused/reset, closed mid-stream, ...
        return _connection_failure_row(rec, err, refused=isinstance(err, ConnectionRefusedError)
                                       and resp is None), False
    finally:
        timer.cancel()


def _http_error_row(rec: StreamRecorder, resp: Any) -> dict[str, Any]:
    """The row of a non-200 answer: ``rejected`` for HTTP 429 (its Retry-After under
    ``RETRY_AFTER_KEY``), ``replica_lost`` when the error code says so, else ``error``."""
    body = resp.read()[:ERROR_BODY_MAX]
    text = body[:300].decode("utf-8", errors="replace")
    if resp.status_code == 429:
        row = rec.row(time.time(), M.STATUS_REJECTED, f"HTTP 429: {text}")
        row[RETRY_AFTER_KEY] = parse_retry_after(resp.get("retry-after"))
        return row
    lost = error_code(body) == M.ERROR_CODE_REPLICA_LOST
    return rec.row(time.time(), M.STATUS_REPLICA_LOST if lost else M.STATUS_ERROR,
                   f"HTTP {resp.status_code}: {text}")


# an error answer's body read for its code (an OpenAI-style error object; the message, kept
# in the row, is cut to its first 300 characters)
ERROR_BODY_MAX = 1 << 16


def error_code(body: bytes) -> str | None:
    """``error.code`` of an OpenAI-style error body (``{"error": {"code": ...}}``), wherever
    it sits in the object and however long the message before it is; None when the body
    is not such an object."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    err = obj.get("error") if isinstance(obj, dict) else None
    code = err.get("code") if isinstance(err, dict) else None
    return code if isinstance(code, str) else None


def _read_stream(rec: StreamRecorder, resp: Any) -> tuple[dict[str, Any], bool]:
    """Read the SSE body line by line to its end (each chunk stamped as it arrives); the row
    (``ok``, ``error`` / ``replica_lost`` from an error object, ``disconnected`` before
    ``[DONE]``) and whether the connection can be reused."""
    parser = SSEParser()
    while True:
        line = resp.readline(b"\n")
        now = time.time()
        if not line:
            for data in parser.flush():
                rec.on_data(data, now)
            break
        for data in parser.feed_line(line):
            rec.on_data(data, now)
        if rec.done or rec.error:
            break
    end = time.time()
    if rec.error:
        lost = rec.error_code == M.ERROR_CODE_REPLICA_LOST
        return rec.row(end, M.STATUS_REPLICA_LOST if lost else M.STATUS_ERROR), False
    if not rec.complete:
        return rec.row(end, M.STATUS_DISCONNECTED, "stream ended before [DONE] or finish_reason"), False
    resp.read()  # the chunked terminator, so the connection can be reused
    return rec.row(end, M.STATUS_OK), True


def _connection_failure_row(rec: StreamRecorder, err: Exception, refused: bool) -> dict[str, Any]:
    """The row of a failed connection (refused, reset, closed mid-stream): ``disconnected``
    once a chunk arrived, else ``error``; marked under ``CONNECTION_LOST_KEY``, and under
    ``REFUSED_KEY`` when nothing was sent (safe to send it elsewhere)."""
    status = M.STATUS_DISCONNECTED if rec.chunk_ts else M.STATUS_ERROR
    row = rec.row(time.time(), status, f"{type(err).__name__}: {err}"[:500])
    row[CONNECTION_LOST_KEY] = True
    if refused:
        row[REFUSED_KEY] = True
    return row
