"""``--target`` as users paste it (issue 9 fault 5): with or without ``/v1``, with or
without a trailing slash; discovery failures name the URL; ``--strategies`` skips
discovery on a server without ``/v1/models``. A real HTTP server on a free port."""

from __future__ import annotations

import argparse
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from configs.net import free_port
from loadgen.run import service
from loadgen.cli.target import Auth, discover_strategies as _strategies

NO_AUTH = Auth({})


def _server(with_models: bool):
    paths: list[str] = []

    class H(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            paths.append(self.path)
            if with_models and self.path == "/v1/models":
                body = json.dumps({"object": "list", "data": [{"id": "ngram"},
                                                              {"id": "autoregressive"}]})
                self.send_response(200)
            else:
                body = json.dumps({"error": {"message": "not found"}})
                self.send_response(404)
            self.send_header("content-type", "application/json")
            self.end_headers()
            self.wfile.write(body.encode())

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", free_port()), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, paths


@pytest.fixture
def models_server():
    srv, paths = _server(True)
    yield f"http://127.0.0.1:{srv.server_port}", paths
    srv.shutdown()


@pytest.fixture
def bare_server():
    srv, paths = _server(False)
    yield f"http://127.0.0.1:{srv.server_port}", paths
    srv.shutdown()


def _args(strategies=""):
    return argparse.Namespace(strategies=strategies, model="")


@pytest.mark.parametrize("suffix", ["", "/", "/v1", "/v1/", "//", " "])
def test_target_with_or_without_v1(models_server, suffix):
    base, paths = models_server
    target = service.normalize_base_url(base + suffix)
    assert target == base
    assert _strategies(_args(), target, NO_AUTH) == ["autoregressive", "ngram"]  # canonical order
    assert paths == ["/v1/models"]


def test_normalize_keeps_a_gateway_prefix_and_refuses_non_urls():
    assert service.normalize_base_url("https://gw.example/openai/v1/") == \
        "https://gw.example/openai"
    for bad in ("127.0.0.1:8000", "ftp://h/v1", "http://"):
        with pytest.raises(service.ServiceError, match="--target"):
            service.normalize_base_url(bad)


def test_discovery_failure_names_the_url(bare_server):
    base, _ = bare_server
    with pytest.raises(service.ServiceError, match=f"GET {base}/v1/models -> HTTP 404"):
        _strategies(_args(), base, NO_AUTH)
    dead = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(service.ServiceError, match=f"GET {dead}/v1/models"):
        _strategies(_args("ngram"), dead, NO_AUTH)   # unreachable: fails even with --strategies


def test_strategies_skip_discovery(bare_server, models_server):
    base, paths = bare_server
    assert _strategies(_args("a, b"), base, NO_AUTH) == ["a", "b"]
    # the note names the failure without telling the user to pass the --strategies just passed
    from rich.console import Console

    console = Console(record=True, width=300)
    assert _strategies(_args("a"), base, NO_AUTH, console) == ["a"]
    note = console.export_text()
    assert f"GET {base}/v1/models -> HTTP 404; using ['a'] as given" in note, note
    assert "pass --strategies" not in note
    with pytest.raises(service.ServiceError, match="pass --strategies a,b to skip discovery"):
        _strategies(_args(), base, NO_AUTH)                 # without them: the hint
    good, _ = models_server
    with pytest.raises(service.ServiceError, match="--strategies: 'ngarm' not served"):
        _strategies(_args("ngarm"), good, NO_AUTH)   # a misspelt name is still caught when it can be


def _answering(answer) -> ThreadingHTTPServer:
    """A 127.0.0.1 server answering every GET with ``answer()``: (status, content type, body)."""

    class H(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            status, ctype, body = answer()
            self.send_response(status)
            self.send_header("content-type", ctype)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", free_port()), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


def test_direct_listeners_leave_out_autoscaling_strategies():
    """``GET /specload/routes``: a strategy marked ``autoscaling`` gets no listener for the
    load (Serve's router alone spreads load over the replicas it adds); a target that lists
    none, or no such page, gives {}."""
    listed = {"routes": {"a": "/strategies/a", "b": "/strategies/b"},
              "direct": {"a": ["http://127.0.0.1:30001"], "b": ["http://127.0.0.1:30002"],
                         "c": "not a list"},
              "autoscaling": {"a": False, "b": True}}

    srv = _answering(lambda: (200, "application/json", json.dumps(listed).encode()))
    try:
        base = f"http://127.0.0.1:{srv.server_port}"
        assert service.direct_listeners(base) == {"a": ["http://127.0.0.1:30001"]}
        listed.pop("autoscaling")                        # an older service: no marks
        assert set(service.direct_listeners(base)) == {"a", "b"}
        listed["direct"] = {}
        assert service.direct_listeners(base) == {}
    finally:
        srv.shutdown()


def test_direct_listeners_of_a_server_without_the_page(bare_server):
    base, _ = bare_server
    assert service.direct_listeners(base) == {}


def test_a_failing_step_log_is_an_error_not_an_empty_log(bare_server):
    """``fetch_step_log``: a target without the route (404) has no step log ([]), but one that
    answers it with an error (a specload service's HTTP 500) raises StepLogError, and the load
    generator says so on the console and in the manifest instead of recording "steps: 0"."""
    import types

    from rich.console import Console

    from loadgen.cli.main import _fetch_steps

    base, _ = bare_server
    assert service.fetch_step_log(base, "ngram", 0.0) == []

    srv = _answering(lambda: (500, "text/plain",
                              b"RESOURCE_EXHAUSTED: Received message larger than max"))
    try:
        url = f"http://127.0.0.1:{srv.server_port}"
        with pytest.raises(service.StepLogError, match="HTTP 500: RESOURCE_EXHAUSTED"):
            service.fetch_step_log(url, "ngram", 0.0)
        console = Console(record=True, width=300)
        st = types.SimpleNamespace(target=url, auth=NO_AUTH, console=console, manifest={},
                                   fetched={}, cursors={}, step_totals={}, steps=[])
        _fetch_steps(st, "ngram", 12.5)
    finally:
        srv.shutdown()
    assert st.steps == [] and st.manifest["step_log_errors"][0]["strategy"] == "ngram"
    assert "RESOURCE_EXHAUSTED" in st.manifest["step_log_errors"][0]["error"]
    assert "step rows of ngram since 12.500 are missing" in console.export_text()
