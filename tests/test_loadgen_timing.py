"""Load generator, pure parts: SSE parsing, per-request timing, plan, summary, writer, prompts.

These import no locust/gevent (asserted), so they are safe in any pytest process.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pyarrow.parquet as pq
import pytest

from configs import metric_names as M
from loadgen.run.cells import CellPlan, Dispenser, poisson_schedule, shuffled_prompts
from loadgen.run.datasets import DatasetError, load_dataset, truncate
from loadgen.results.summary import achieved_concurrency
from loadgen.run.timing import SSEParser, StreamRecorder, weighted_percentile
from loadgen.results.writer import RequestWriter


def _chunk(text: str, **extra) -> str:
    obj = {"id": "x", "object": "text_completion", "created": 0, "model": "m",
           "choices": [{"index": 0, "text": text, "finish_reason": None}]}
    obj.update(extra)
    return json.dumps(obj)


def _usage(n: int, **spec) -> str:
    obj = {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": n, "total_tokens": 5 + n}}
    if spec:
        obj["spec_decode"] = spec
    return json.dumps(obj)


def test_pure_modules_do_not_import_gevent():
    code = ("import sys, loadgen, loadgen.run.timing, loadgen.run.cells, loadgen.results.summary, loadgen.results.writer, "
            "loadgen.run.datasets, loadgen.run.service, loadgen.cli.main, configs.tiers; "
            "bad=[m for m in ('gevent','locust') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_sse_parser_handles_crlf_comments_multiline_and_eof():
    p = SSEParser()
    events = []
    for line in [b": keep-alive\r\n", b"data: {\"a\":\r\n", b"data: 1}\r\n", b"\r\n", b"data: [DONE]\n"]:
        events += p.feed_line(line)
    events += p.flush()
    assert events == ['{"a":\n1}', "[DONE]"]


def test_ttft_skips_empty_role_chunk_and_tpot_uses_usage():
    """Peers' bug: TTFT stamped on the empty first chunk. Output tokens only from usage."""
    rec = StreamRecorder(scheduled_ts=100.0, sent_ts=100.0)
    rec.on_data(_chunk(""), 100.010)                 # empty role chunk: not a token
    rec.on_data(_chunk("Hello"), 100.200)            # first content: TTFT = 200 ms
    rec.on_data(_chunk(" wor ld !"), 100.260)        # 3 tokens in one chunk (speculative step)
    rec.on_data(_chunk(" foo bar baz"), 100.320)
    rec.on_data(_usage(7), 100.321)
    rec.on_data("[DONE]", 100.322)
    row = rec.row(100.322, M.STATUS_OK)
    assert row[M.REQ_TTFT_MS] == pytest.approx(200.0)
    assert row[M.REQ_OUTPUT_TOKENS] == 7             # not a count of words/chunks in the text
    assert row[M.REQ_TPOT_MS] == pytest.approx((322.0 - 200.0) / 6)
    # no per-chunk token count: no per-token ITL (a chunk gap is never passed off as one);
    # the chunk gaps and the mean tokens per later chunk ((7 - 1) / 2) are reported instead
    assert row[M.REQ_ITL_P50_MS] is None and row[M.REQ_ITL_MEAN_MS] is None
    assert row[M.REQ_ITL_SOURCE] == M.ITL_SOURCE_CHUNKS
    assert row[M.REQ_CHUNK_GAP_P50_MS] == pytest.approx(60.0)
    assert row[M.REQ_TOKENS_PER_CHUNK] == pytest.approx(3.0)
    assert row[M.REQ_NUM_CHUNKS] == 3


def _synthetic_spec_stream(continuous: bool) -> StreamRecorder:
    """The issue's stream: first token at 1.000 s, then engine steps every 40 ms alternating
    1 and 5 tokens (10 steps, 30 tokens), one chunk per step; usage on every chunk
    (vLLM continuous_usage_stats) or only at the end."""
    rec = StreamRecorder(scheduled_ts=0.0, sent_ts=0.0)
    t, total = 1.0, 1
    rec.on_data(_chunk("a", **({"usage": {"completion_tokens": 1}} if continuous else {})), t)
    for i in range(10):
        n = 1 if i % 2 == 0 else 5
        t += 0.040
        total += n
        rec.on_data(_chunk("x" * n, **({"usage": {"completion_tokens": total}} if continuous else {})), t)
    rec.on_data(_usage(total), t + 0.0005)
    rec.on_data("[DONE]", t + 0.0005)
    return rec


def test_itl_per_token_on_a_speculative_stream_needs_per_chunk_counts():
    """Steps of 40 ms alternating 1 and 5 tokens: per token, 5 of 6 tokens arrive 8 ms
    apart and 1 of 6 after 40 ms, so p50 / p99 = 8.0 / 40.0 ms. The old fallback spread
    the 30 later tokens evenly over the 10 gaps and printed 13.3 / 13.3 ms as per-token."""
    cont = _synthetic_spec_stream(continuous=True).row(1.4005, M.STATUS_OK)
    assert cont[M.REQ_ITL_SOURCE] == M.ITL_SOURCE_TOKENS
    assert cont[M.REQ_ITL_P50_MS] == pytest.approx(8.0)
    assert cont[M.REQ_ITL_P90_MS] == pytest.approx(40.0)   # 5 + 25 tokens: the 40 ms ones are the top 1/6
    assert cont[M.REQ_ITL_P99_MS] == pytest.approx(40.0)
    assert cont[M.REQ_ITL_MEAN_MS] == pytest.approx(400.0 / 30)   # token-weighted mean = gaps / tokens
    assert cont[M.REQ_MULTI_TOKEN_CHUNKS] == 5
    end_only = _synthetic_spec_stream(continuous=False).row(1.4005, M.STATUS_OK)
    assert end_only[M.REQ_ITL_SOURCE] == M.ITL_SOURCE_CHUNKS
    assert end_only[M.REQ_ITL_P50_MS] is None and end_only[M.REQ_ITL_P99_MS] is None
    assert end_only[M.REQ_CHUNK_GAP_P50_MS] == pytest.approx(40.0)
    assert end_only[M.REQ_TOKENS_PER_CHUNK] == pytest.approx(3.0)
    assert end_only[M.REQ_MULTI_TOKEN_CHUNKS] is None
    for row in (cont, end_only):   # TPOT does not depend on the chunk counts
        assert row[M.REQ_TPOT_MS] == pytest.approx((1400.5 - 1000.0) / 30)


def test_itl_spreads_gap_over_exact_per_chunk_tokens():
    """Peers' bug: ITL per chunk when a chunk carries several tokens, or ITL including TTFT."""
    rec = StreamRecorder(scheduled_ts=0.0, sent_ts=0.0)
    rec.on_data(_chunk("a", spec_decode={"num_tokens": 1}), 1.000)   # TTFT 1 s: must not enter ITL
    rec.on_data(_chunk("bcde", spec_decode={"num_tokens": 4}), 1.040)  # 4 tokens / 40 ms -> 10 ms
    rec.on_data(_chunk("f", spec_decode={"num_tokens": 1}), 1.050)     # 1 token / 10 ms -> 10 ms
    rec.on_data(_chunk("gh", spec_decode={"num_tokens": 2}), 1.150)    # 2 tokens / 100 ms -> 50 ms
    rec.on_data(_usage(8), 1.151)
    rec.on_data("[DONE]", 1.151)
    row = rec.row(1.151, M.STATUS_OK)
    vals, wts = rec.itl_samples(8)
    assert vals == pytest.approx([10.0, 10.0, 50.0]) and wts == [4.0, 1.0, 2.0]
    # token-weighted: 5 of 7 tokens at 10 ms
    assert row[M.REQ_ITL_P50_MS] == pytest.approx(10.0)
    assert row[M.REQ_ITL_P99_MS] == pytest.approx(50.0)
    assert max(vals) < 1000.0


def _ts_chunk(ids: list[int], ts: list[float]) -> str:
    return json.dumps({"choices": [{"text": "x" * len(ids), "token_ids": ids,
                                    M.TOKEN_TS_FIELD: ts}]})


def test_itl_from_token_ts_is_per_token_whatever_the_stream_interval():
    """The engine emitted steps at 10.00 (prefill token), 10.02 (3 tokens: one speculative
    step), 10.03, 10.07 (2 tokens). Streamed one chunk per step, or held into chunks of
    >= 4 tokens (stream_interval 4, arriving 5 ms after their last token), the ITL
    samples are the same per-token values; without token_ts the chunked stream would
    smear them."""
    steps = [(10.00, 1), (10.02, 3), (10.03, 1), (10.07, 2)]
    per_step = StreamRecorder(scheduled_ts=9.9)
    tid = 0
    for t, n in steps:
        per_step.on_data(_ts_chunk(list(range(tid, tid + n)), [t] * n), t + 0.005)
        tid += n
    flat = [t for t, n in steps for _ in range(n)]
    chunked = StreamRecorder(scheduled_ts=9.9)
    chunked.on_data(_ts_chunk([0], flat[:1]), 10.005)               # first token at once
    chunked.on_data(_ts_chunk([1, 2, 3, 4], flat[1:5]), 10.035)     # steps 2 and 3
    chunked.on_data(_ts_chunk([5, 6], flat[5:]), 10.075)            # last (finish)
    want = ([20.0 / 3, 10.0, 20.0], [3.0, 1.0, 2.0])
    for rec in (per_step, chunked):
        vals, wts = rec.itl_samples(7)
        assert vals == pytest.approx(want[0]) and wts == want[1]
    assert chunked.row(10.08, M.STATUS_OK)[M.REQ_TTFT_MS] == pytest.approx(105.0)
    # a chunk without token_ts: back to the per-chunk rule (gap spread over its tokens)
    legacy = StreamRecorder(scheduled_ts=9.9)
    legacy.on_data(_ts_chunk([0], flat[:1]), 10.005)
    legacy.on_data(json.dumps({"choices": [{"text": "abcd", "token_ids": [1, 2, 3, 4]}]}), 10.035)
    assert legacy.itl_samples(5)[0] == pytest.approx([7.5])


def test_token_ids_and_continuous_usage_give_per_chunk_counts():
    rec = StreamRecorder(scheduled_ts=0.0)
    rec.on_data(json.dumps({"choices": [{"text": "a", "token_ids": [1]}]}), 0.1)
    rec.on_data(json.dumps({"choices": [{"text": "bc", "token_ids": [2, 3]}]}), 0.3)
    assert rec.chunk_tokens == [1, 2]
    rec.on_data(json.dumps({"choices": [{"text": "", "token_ids": [4]}]}), 0.4)   # half a character
    rec.on_data(json.dumps({"choices": [{"text": "d", "token_ids": [5]}]}), 0.5)
    assert rec.chunk_tokens == [1, 2, 2] and len(rec.chunk_ts) == 3
    rec2 = StreamRecorder(scheduled_ts=0.0)
    rec2.on_data(json.dumps({"choices": [{"text": "a"}], "usage": {"completion_tokens": 1}}), 0.1)
    rec2.on_data(json.dumps({"choices": [{"text": "bcd"}], "usage": {"completion_tokens": 4}}), 0.3)
    assert rec2.chunk_tokens == [1, 3]


def test_spec_stats_and_error_object():
    rec = StreamRecorder(scheduled_ts=0.0)
    rec.on_data(_chunk("x"), 0.1)
    rec.on_data(_usage(1, num_drafts=2, num_draft_tokens=6, num_accepted_tokens=3,
                       num_accepted_tokens_per_pos=[2, 1, 0], acceptance_length=2.5, draft_ms=1.0,
                       verify_ms=2.0, queue_ms=0.5), 0.2)
    row = rec.row(0.2, M.STATUS_OK)
    assert row[M.NUM_ACCEPTED_TOKENS_PER_POS] == [2, 1, 0] and row[M.ACCEPTANCE_LENGTH] == 2.5
    assert row[M.REQ_TPOT_MS] is None             # one output token: TPOT undefined
    bad = StreamRecorder(scheduled_ts=0.0)
    bad.on_data(json.dumps({"error": {"message": "boom"}}), 0.1)
    assert bad.error == "boom"


def test_open_loop_ttft_counts_from_scheduled_time():
    """Coordinated omission: a request sent late counts its wait."""
    rec = StreamRecorder(scheduled_ts=10.0, sent_ts=10.5)
    rec.on_data(_chunk("a"), 10.6)
    rec.on_data(_usage(1), 10.6)
    assert rec.row(10.6, M.STATUS_OK)[M.REQ_TTFT_MS] == pytest.approx(600.0)


def test_weighted_percentile():
    assert weighted_percentile([1, 2, 3], [1, 1, 1], 50) == 2
    assert weighted_percentile([1, 100], [99, 1], 50) == 1
    assert weighted_percentile([1, 100], [99, 1], 100) == 100
    assert math.isnan(weighted_percentile([], [], 50))


def test_achieved_concurrency_is_time_weighted():
    rows = [{M.REQ_SENT_TS: 0.0, M.REQ_END_TS: 10.0}, {M.REQ_SENT_TS: 5.0, M.REQ_END_TS: 15.0},
            {M.REQ_SENT_TS: None, M.REQ_END_TS: 3.0}]
    assert achieved_concurrency(rows, 0.0, 10.0) == pytest.approx(1.5)


def _plan(**kw) -> CellPlan:
    base = dict(run_id="r", strategy="s", model="s", tier="low", output_class="short", dataset="d",
                base_url="http://127.0.0.1:1", arrival="closed", users=2, rate_rps=None, start_ts=0.0,
                deadline_ts=1e18, prompts=[["p0", "zero", None], ["p1", "one", 7], ["p2", "two", None]],
                max_tokens={"dist": "uniform", "min": 10, "max": 50}, seed=3,
                sampling={"temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": 100, "stop": None})
    base.update(kw)
    return CellPlan(**base)


def test_plan_is_identical_for_every_strategy_and_split_across_workers():
    a = [Dispenser(_plan(strategy="x", model="x")).next(0.0) for _ in range(1)]
    da, db = Dispenser(_plan(strategy="x", model="x")), Dispenser(_plan(strategy="y", model="y"))
    ja = [da.next(0.0) for _ in range(6)]
    jb = [db.next(0.0) for _ in range(6)]
    assert [(j.prompt_id, j.body["max_tokens"], j.body["seed"]) for j in ja] == \
           [(j.prompt_id, j.body["max_tokens"], j.body["seed"]) for j in jb]
    assert a[0].prompt_id == "p0" and ja[1].body["max_tokens"] == 7       # dataset max_tokens wins
    assert ja[0].body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    w0, w1 = Dispenser(_plan(), 0, 2), Dispenser(_plan(), 1, 2)
    assert [w0.next(0.0).index for _ in range(3)] == [0, 2, 4]
    assert [w1.next(0.0).index for _ in range(3)] == [1, 3, 5]
    assert Dispenser(_plan(deadline_ts=5.0)).next(6.0) is None


def test_poisson_schedule_rate_and_determinism():
    s = poisson_schedule(50.0, 20.0, seed=3)   # _plan's seed
    assert s == poisson_schedule(50.0, 20.0, seed=3) != poisson_schedule(50.0, 20.0, seed=4)
    assert 900 < len(s) < 1100 and all(0 <= t < 20 for t in s)
    d = Dispenser(_plan(arrival="open", rate_rps=50.0, start_ts=1000.0, deadline_ts=1020.0))
    j = d.next()
    assert j.scheduled_ts == pytest.approx(1000.0 + s[0])


def test_writer_is_readable_after_each_flush_and_close(tmp_path):
    path = tmp_path / "requests.parquet"
    w = RequestWriter(path, flush_rows=2)
    w.add({M.REQ_STRATEGY: "a", M.REQ_STATUS: M.STATUS_OK, M.REQ_TTFT_MS: 1.5, M.NUM_ACCEPTED_TOKENS_PER_POS: [1, 2]})
    w.add({M.REQ_STRATEGY: "a", M.REQ_STATUS: M.STATUS_ERROR, M.REQ_TTFT_MS: float("nan"), "unknown": 1})
    w.maybe_flush()
    w.close()
    w.close()
    t = pq.read_table(path).to_pylist()
    assert len(t) == 2 and t[0][M.NUM_ACCEPTED_TOKENS_PER_POS] == [1, 2] and t[1][M.REQ_TTFT_MS] is None


def test_datasets_are_held_out_and_truncated():
    from corpus.sources import is_heldout

    for name in ("humaneval", "docs", "stdlib"):
        rows = load_dataset(name, max_chars=300)
        assert len(rows) >= 100 and all(len(p.text) <= 300 for p in rows)
        if name != "humaneval":
            for p in rows:
                rel = p.prompt_id.split("/", 1)[1].rsplit("#" if name == "docs" else ":", 1)[0]
                assert is_heldout(rel), p.prompt_id
    mixed = load_dataset("mixed")
    assert [p.prompt_id.split("/")[0] for p in mixed[:3]] == ["humaneval", "docs", "stdlib"]
    assert shuffled_prompts(mixed, 0) == shuffled_prompts(mixed, 0) != mixed
    assert truncate("ab\ncd\nef", 6) == "ab\ncd\n"


def test_user_jsonl_and_errors(tmp_path):
    f = tmp_path / "mine.jsonl"
    f.write_text('{"prompt": "hi", "max_tokens": 5}\n\n{"prompt": "yo", "prompt_id": "x"}\n')
    rows = load_dataset(str(f))
    assert [(p.prompt_id, p.text, p.max_tokens) for p in rows] == [("mine/0", "hi", 5), ("x", "yo", None)]
    f.write_text('{"text": "no prompt key"}\n')
    with pytest.raises(DatasetError, match="string 'prompt'"):
        load_dataset(str(f))
    with pytest.raises(DatasetError, match="unknown dataset"):
        load_dataset("nope")


def test_local_service_bring_up_is_stubbable(monkeypatch):
    """`python -m cluster up` prints the URL last; failures name the command and the way out.
    The load generator reaches it through the bring-up layer (``cluster.launch``)."""
    import cluster.launch as launch
    import loadgen.run.service as svc

    assert svc.start_local_service is launch.start_local_service   # loadgen's name for it

    import io

    calls = []

    def fake_popen(out, rc=0):
        class Proc:
            def __init__(self, cmd, **_):
                calls.append(cmd)
                self.stdout, self.stderr = io.StringIO(out), io.StringIO("[cluster] boom\n")
                self.returncode = rc

            def wait(self):
                return self.returncode

        return Proc

    monkeypatch.setattr(launch.subprocess, "Popen", fake_popen("starting...\nhttp://127.0.0.1:8000/\n"))
    assert launch.start_local_service() == "http://127.0.0.1:8000"
    launch.start_local_service(port=8123, config="my.yaml", direct_ingress=False)
    # direct ingress on unless asked off (the load generator's default route loads it)
    assert calls[0][-3:] == ["cluster", "up", "--direct-ingress"]
    assert calls[1][-5:] == ["--port", "8123", "--config", "my.yaml", "--no-direct-ingress"]
    monkeypatch.setattr(launch.subprocess, "Popen", fake_popen("", rc=1))
    with pytest.raises(svc.ServiceError, match="--target"):
        launch.start_local_service()
    assert svc.fetch_step_log("http://127.0.0.1:9", "x", 0.0, timeout_s=2) == []   # nothing listening
