"""The load generator's client classifies an HTTP error answer by its OpenAI-style error
code wherever it sits in the body: a 503 whose ``error.code`` is ``replica_lost`` is a
lost replica, however long the message before the code (a multi-node fault run had one
filed as ``error``: the code came after the first 300 characters the client read)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from configs import metric_names as M
from loadgen.run.client import error_code, make_http_client, stream_completion


def _body(code: str | None, message_len: int) -> bytes:
    return json.dumps({"error": {"message": "replica lost: " + "x" * message_len,
                                 "type": "server_error", "param": None, "code": code}}).encode()


@pytest.mark.parametrize("message_len", [10, 400, 5000])
def test_error_code_is_read_from_the_whole_body(message_len):
    assert error_code(_body(M.ERROR_CODE_REPLICA_LOST, message_len)) == M.ERROR_CODE_REPLICA_LOST
    assert error_code(_body(None, message_len)) is None
    assert error_code(b"<html>502 Bad Gateway</html>") is None
    assert error_code(b'{"error": "a string"}') is None


def test_a_long_503_replica_lost_answer_is_filed_as_replica_lost():
    """A real HTTP server on loopback answers 503 with the code after 400 characters of
    message, then 500 without a code: the rows are ``replica_lost`` and ``error``."""
    answers = [(503, _body(M.ERROR_CODE_REPLICA_LOST, 400)), (500, _body(None, 400))]

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            status, body = answers.pop(0)
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    try:
        http = make_http_client(f"http://127.0.0.1:{server.server_address[1]}", 10.0)
        body = {"model": "m", "prompt": "p", "max_tokens": 1, "stream": True}
        row, _ = stream_completion(http, "/v1/completions", body, None, 10.0)
        assert row[M.REQ_STATUS] == M.STATUS_REPLICA_LOST, row
        http = make_http_client(f"http://127.0.0.1:{server.server_address[1]}", 10.0)
        row, _ = stream_completion(http, "/v1/completions", body, None, 10.0)
        assert row[M.REQ_STATUS] == M.STATUS_ERROR, row
        assert row[M.REQ_ERROR].startswith("HTTP 500: ")
    finally:
        server.shutdown()
        server.server_close()
