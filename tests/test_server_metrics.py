"""The target's own Prometheus metrics: parsing, model filter, engine kind, counter
resets, per-cell figures, the loadgen wiring against a local page, and vLLM / SGLang
per-request speculative stats.

Fixtures: ``tests/data/vllm_0.32_draft_model_metrics.txt`` is a capture of vLLM 0.32's
``/metrics`` (CPU build, ``--speculative-config draft_model``, k=4, after one request of
48 tokens: 14 drafts, 33 accepted); the SGLang and specload/Ray pages are hand-written
in those exporters' formats (no SGLang here; Ray's agent is not started by unit tests).
"""

from __future__ import annotations

import http.server
import json
import threading
from pathlib import Path

import pytest

from configs import metric_names as M
from loadgen.run import server_metrics as sm
from loadgen.run.timing import StreamRecorder, engine_spec_stats

DATA = Path(__file__).parent / "data"
VLLM = (DATA / "vllm_0.32_draft_model_metrics.txt").read_text()
SGLANG = (DATA / "sglang_metrics_handmade.txt").read_text()
SPECLOAD = (DATA / "specload_ray_metrics_handmade.txt").read_text()


def test_vllm_capture_parses_to_the_counters_vllm_printed():
    assert sm.detect_engine(VLLM) == M.ENGINE_VLLM
    values, models = sm.parse_page(VLLM, M.ENGINE_VLLM)
    assert models == {"draft_model"}
    v = {(c, p): x for (m, c, p), x in values.items()}
    assert v[(M.SRV_NUM_DRAFTS, -1)] == 14 and v[(M.SRV_NUM_DRAFT_TOKENS, -1)] == 56
    assert v[(M.SRV_NUM_ACCEPTED_TOKENS, -1)] == 33
    assert [v[(M.SRV_NUM_ACCEPTED_PER_POS, i)] for i in range(4)] == [12, 11, 5, 5]
    # iteration-tokens histogram: 1 prefill + 14 decode steps; 18 prompt + 48 emitted tokens
    assert v[(M.SRV_ENGINE_STEPS, -1)] == 15 and v[(M.SRV_STEP_TOKENS, -1)] == 66
    assert v[(M.SRV_GENERATION_TOKENS, -1)] == 48 and v[(M.SRV_PROMPT_TOKENS, -1)] == 18
    assert v[(M.SRV_REQUESTS_FINISHED, -1)] == 1          # summed over finished_reason
    assert v[(M.SRV_RUNNING, -1)] == 0 and (M.SRV_WAITING, -1) in v
    # 1 + steps + accepted = completion tokens: 1 + 14 + 33 = 48
    assert 1 + v[(M.SRV_NUM_DRAFTS, -1)] + v[(M.SRV_NUM_ACCEPTED_TOKENS, -1)] == 48


def test_prefilter_keeps_only_the_named_families():
    kept = sm.prefilter(VLLM, sm._wanted_families(M.ENGINE_VLLM))
    assert "python_gc" not in kept and "_bucket" not in kept
    # a counter's creation time and the process start stay: they reveal restarts (counter_delta)
    assert "vllm:spec_decode_num_drafts_created" in kept and "process_start_time_seconds" in kept
    assert "vllm:spec_decode_num_drafts_total" in kept
    assert "vllm:prompt_tokens_by_source" not in kept        # a longer name, not the family


def test_model_label_filters_other_models():
    values, models = sm.parse_page(SGLANG, M.ENGINE_SGLANG)
    assert sm.detect_engine(SGLANG) == M.ENGINE_SGLANG and models == {"qwen", "other"}
    assert values[("qwen", M.SRV_RUNNING, -1)] == 3 and values[("other", M.SRV_RUNNING, -1)] == 9
    assert values[("qwen", M.SRV_GENERATION_TOKENS, -1)] == 1200
    assert values[("qwen", M.SRV_ACCEPT_LENGTH, -1)] == 2.75
    fig = sm.cell_figures([sm.Snapshot(0.0, values), sm.Snapshot(1.0, {
        **values, ("qwen", M.SRV_GENERATION_TOKENS, -1): 1300.0,
        ("other", M.SRV_GENERATION_TOKENS, -1): 200000.0})], "qwen")
    assert fig[M.SRV_GENERATION_TOKENS] == 100               # the other model's traffic is not in it
    assert fig[f"{M.SRV_RUNNING}_mean"] == 3 and fig[M.ACCEPTANCE_LENGTH] is None   # no drafts counter


def test_specload_ray_page_sums_replicas_and_ignores_the_deprecated_gauge():
    assert sm.detect_engine(SPECLOAD) == M.ENGINE_SPECLOAD
    values, models = sm.parse_page(SPECLOAD, M.ENGINE_SPECLOAD)
    assert models >= {"ngram", "dflash"}
    assert values[("ngram", M.SRV_NUM_DRAFTS, -1)] == 40       # r1 + r2, the gauge copy not added
    assert values[("ngram", M.SRV_NUM_ACCEPTED_TOKENS, -1)] == 60
    assert values[("ngram", M.SRV_NUM_ACCEPTED_PER_POS, 1)] == 20
    assert values[("ngram", M.SRV_ENGINE_STEPS, -1)] == 50 and values[("ngram", M.SRV_STEP_MS, -1)] == 400
    assert values[("ngram", M.SRV_WAITING, -1)] == 2


def test_unknown_page_detects_no_engine():
    assert sm.detect_engine("# TYPE foo counter\nfoo_total 1\n") is None


@pytest.mark.parametrize("values,delta,resets", [
    ([10, 12, 15], 5, 0),
    ([10, 12, 3, 7], 2 + 3 + 4, 1),          # restart: 3 counts from 0, then +4
    ([10, None, 14], 4, 0),                  # a failed scrape is skipped
    ([5, 0, 0, 2], 2, 1),
    ([7], 0, 0),
])
def test_counter_delta_handles_resets(values, delta, resets):
    assert sm.counter_delta(values) == (delta, resets)


def test_cell_figures_with_a_restart_and_a_series_created_mid_cell():
    key = ("m", M.SRV_NUM_DRAFTS, -1)
    acc = ("m", M.SRV_NUM_ACCEPTED_TOKENS, -1)
    pos0 = ("m", M.SRV_NUM_ACCEPTED_PER_POS, 0)
    snaps = [sm.Snapshot(0.0, {key: 100.0}), sm.Snapshot(0.5, {key: 110.0, acc: 20.0, pos0: 12.0}),
             sm.Snapshot(1.0, {}, ok=False), sm.Snapshot(1.5, {key: 4.0, acc: 6.0, pos0: 5.0})]
    fig = sm.cell_figures(snaps, "m")
    assert fig[M.SRV_NUM_DRAFTS] == 14 and fig["counter_resets"] == 3      # 3 series went down
    assert fig[M.SRV_NUM_ACCEPTED_TOKENS] == 20 + 6                        # created at 0.5: from 0
    assert fig[M.SRV_NUM_ACCEPTED_PER_POS] == [17]
    assert fig["samples"] == 3 and fig["failed_scrapes"] == 1
    assert fig[M.ACCEPTANCE_LENGTH] == pytest.approx(1 + 26 / 14)


def test_resolve_model_aliases_and_absent_models():
    assert sm.resolve_model("a", {"a", "b"}) == ("a", None)
    label, note = sm.resolve_model("alias2", {"tgt"})
    assert label == "tgt" and "alias" in note
    label, note = sm.resolve_model("x", {"a", "b"})
    assert label is None and "no series" in note


def test_vllm_per_request_stats_map_to_specload_names():
    chunk = {"choices": [], "usage": {"prompt_tokens": 44, "completion_tokens": 32},
             "metrics": {"speculative_decoding": {
                 "mean_acceptance_length": 1.4, "draft_acceptance_rate": 0.1,
                 "acceptance_histogram": [3, 2, 0, 0, 0], "num_spec_steps": 5,
                 "num_accepted_draft_tokens": 2, "num_draft_tokens": 20, "num_spec_tokens": 4}}}
    out = engine_spec_stats(chunk)
    assert out[M.REQ_SPEC_SOURCE] == "vllm" and out[M.NUM_DRAFTS] == 5 and out[M.NUM_DRAFT_TOKENS] == 20
    assert out[M.NUM_ACCEPTED_TOKENS] == 2 and out[M.REQ_NUM_SPEC_TOKENS] == 4
    assert out[M.NUM_ACCEPTED_TOKENS_PER_POS] == [2, 0, 0, 0]               # steps accepting > i
    assert out[M.REQ_ACCEPTANCE_HISTOGRAM] == [3, 2, 0, 0, 0] and out[M.ACCEPTANCE_LENGTH] == 1.4
    hist = engine_spec_stats({"metrics": {"speculative_decoding": {"acceptance_histogram": [5, 4, 2, 0, 6]}}})
    assert hist[M.NUM_ACCEPTED_TOKENS_PER_POS] == [12, 8, 6, 6]


def test_stream_recorder_rows_carry_vllm_stats_from_the_usage_chunk():
    rec = StreamRecorder(scheduled_ts=0.0, sent_ts=0.0)
    rec.on_data(json.dumps({"choices": [{"index": 0, "text": "a", "finish_reason": None}]}), 0.1)
    rec.on_data(json.dumps({"choices": [{"index": 0, "text": "b", "finish_reason": "length"}]}), 0.2)
    rec.on_data(json.dumps({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2},
                            "metrics": {"speculative_decoding": {
                                "num_spec_steps": 1, "num_accepted_draft_tokens": 0, "num_draft_tokens": 4,
                                "num_spec_tokens": 4, "mean_acceptance_length": 1.0,
                                "acceptance_histogram": [1, 0, 0, 0, 0]}}}), 0.2)
    rec.on_data("[DONE]", 0.3)
    row = rec.row(0.3, M.STATUS_OK)
    assert row[M.REQ_SPEC_SOURCE] == "vllm" and row[M.NUM_DRAFTS] == 1
    assert row[M.NUM_ACCEPTED_TOKENS_PER_POS] == [0, 0, 0, 0] and row[M.REQ_NUM_SPEC_TOKENS] == 4


def test_sglang_and_specload_per_request_stats():
    out = engine_spec_stats({"meta_info": {"spec_verify_ct": 10, "spec_accept_token_num": 17,
                                           "spec_draft_token_num": 40}})
    assert out == {M.REQ_SPEC_SOURCE: "sglang", M.NUM_DRAFTS: 10, M.NUM_ACCEPTED_TOKENS: 17,
                   M.NUM_DRAFT_TOKENS: 40}
    own = engine_spec_stats({M.SPEC_DECODE_FIELD: {M.NUM_DRAFTS: 3, M.NUM_ACCEPTED_TOKENS: 5,
                                                   M.NUM_ACCEPTED_TOKENS_PER_POS: [3, 2]}})
    assert own[M.REQ_SPEC_SOURCE] == "specload" and own[M.NUM_DRAFTS] == 3
    assert own.get(M.DEGRADED_REASON) is None   # not said: unknown, not "not degraded"
    deg = engine_spec_stats({M.SPEC_DECODE_FIELD: {M.NUM_DRAFTS: 2, M.DEGRADED_REASON: "invalid_draft"}})
    assert deg[M.DEGRADED_REASON] == "invalid_draft"
    assert engine_spec_stats({M.SPEC_DECODE_FIELD: {"num_tokens": 2}}) == {}   # per-chunk count only
    assert engine_spec_stats({"choices": []}) == {}


class _Page(http.server.BaseHTTPRequestHandler):
    """Serves ``self.server.pages[i]`` on the i-th GET (the last one after that)."""

    def do_GET(self):  # noqa: N802
        srv = self.server
        text = srv.pages[min(srv.hits, len(srv.pages) - 1)]
        srv.hits += 1
        body = text.encode()
        self.send_response(200 if self.path == "/metrics" else 404)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass


@pytest.fixture()
def page_server():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Page)
    srv.pages, srv.hits = [VLLM], 0
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def test_run_server_metrics_probe_cells_and_rows(page_server):
    url = f"http://127.0.0.1:{page_server.server_address[1]}"
    later = VLLM.replace('vllm:spec_decode_num_drafts_total{engine="0",model_name="draft_model"} 14.0',
                         'vllm:spec_decode_num_drafts_total{engine="0",model_name="draft_model"} 20.0')
    assert later != VLLM
    run = sm.RunServerMetrics("auto", url, {"draft_model": "draft_model", "alias": "alias"}, interval_s=0.25)
    run.open()
    try:
        assert run.active and run.facts["engine"] == "vllm" and run.facts["missing"] == []
        assert run.labels == {"draft_model": "draft_model", "alias": "draft_model"}
        assert any("alias" in n for n in run.facts["notes"])
        t0 = run.begin_cell()
        page_server.pages = [later]
        fig = run.end_cell("draft_model", t0, rows=[{M.NUM_DRAFTS: 5, M.NUM_ACCEPTED_TOKENS: 0}])
    finally:
        run.close()
    seen = [(round(x.ts - t0, 3), x.values.get(("draft_model", M.SRV_NUM_DRAFTS, -1)))
            for x in run.poller.snapshots]
    assert fig[M.SRV_NUM_DRAFTS] == 6 and fig["unattributed_drafts"] == 1, seen
    rows = run.rows("r", [{"strategy": "draft_model", "tier": "low", "output_class": "short", "users": 1,
                           "t0": t0, "t1": t0 + 1e6}])
    assert rows and {r["metric"] for r in rows} >= {M.SRV_NUM_DRAFTS, M.SRV_RUNNING}
    assert all(r["model"] == "draft_model" for r in rows) and rows[-1]["tier"] == "low"
    assert run.facts["samples"] >= 3 and run.facts["failed_scrapes"] == 0


def test_auto_without_a_page_turns_off_and_a_url_must_answer(page_server):
    url = f"http://127.0.0.1:{page_server.server_address[1]}"
    off = sm.RunServerMetrics("auto", url + "/nothing", {"m": "m"})
    off.open()
    assert not off.active and "HTTP 404" in off.facts["error"]
    with pytest.raises(sm.ServerMetricsError, match="HTTP 404"):
        sm.RunServerMetrics(url + "/nothing/metrics", url, {"m": "m"}).open()
    assert sm.metrics_url("auto", "http://h:1") == "http://h:1/metrics"
    assert sm.metrics_url("off", "http://h:1") is None


def test_server_metrics_flag_values():
    import argparse

    assert sm.server_metrics_arg("auto") == "auto" and sm.server_metrics_arg("off") == "off"
    assert sm.server_metrics_arg("http://127.0.0.1:9/metrics").startswith("http://")
    with pytest.raises(argparse.ArgumentTypeError, match="auto, off or an http"):
        sm.server_metrics_arg("ftp://x")


def test_vllm_venv_absent_skips_or_fails_under_require(monkeypatch, tmp_path):
    from tests import vllm_server

    monkeypatch.setenv(vllm_server.ENV_PYTHON, str(tmp_path / "no-such-python"))
    monkeypatch.delenv(vllm_server.ENV_REQUIRE, raising=False)
    with pytest.raises(pytest.skip.Exception, match="no vLLM venv"):
        vllm_server.vllm_python()
    monkeypatch.setenv(vllm_server.ENV_REQUIRE, "1")
    with pytest.raises(pytest.fail.Exception, match="SPECLOAD_REQUIRE_VLLM=1"):
        vllm_server.vllm_python()
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv(vllm_server.ENV_PYTHON, str(fake))
    assert vllm_server.vllm_python() == str(fake)
