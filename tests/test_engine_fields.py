"""Peer engines' fields as a kind: every per-request spec-stats spelling SGLang and vLLM have
shipped, and counter resets by drop / ``_created`` / ``process_start_time_seconds``, as one
table per concern over fixtures per engine and version."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from configs import metric_names as M
from configs.tiers import Slo
from loadgen.results.summary import summarize_cell
from loadgen.run import server_metrics as sm
from loadgen.run.timing import StreamRecorder

DATA = Path(__file__).resolve().parent / "data"
COMPLETION_TOKENS = 200

# (engine, version, the final stream chunk's stats object, num_drafts, accepted, drafted)
# The SGLang request: 188 verifications, 940 drafted, 11 accepted, 200 tokens:
# tau = 1 + 11 / 188 = 1.0585; SGLang's own accept length = 200 / 188 = 1.0638.
SPEC_FIXTURES = [
    ("sglang", "<=0.5.10", {"meta_info": {"spec_verify_ct": 188, "spec_accept_token_num": 11,
                                          "spec_draft_token_num": 940, "completion_tokens": 200}}, 188, 11, 940),
    ("sglang", "0.5.11", {"meta_info": {"spec_verify_ct": 188, "spec_proposed_drafts": 940,
                                        "spec_accepted_drafts": 11, "completion_tokens": 200}}, 188, 11, 940),
    ("sglang", "later", {"meta_info": {"spec_verify_ct": 188, "spec_num_proposed_drafts": 940,
                                       "spec_num_correct_drafts": 11}}, 188, 11, 940),
    ("sglang", "choice meta_info", {"choices": [{"index": 0, "text": "", "meta_info": {
        "spec_verify_ct": 188, "spec_num_correct_drafts": 11}}]}, 188, 11, None),
    ("vllm", "0.32 summary", {"metrics": {"speculative_decoding": {
        "num_spec_steps": 188, "num_draft_tokens": 940, "num_accepted_draft_tokens": 11,
        "num_spec_tokens": 5, "mean_acceptance_length": 1 + 11 / 188}}}, 188, 11, 940),
    ("specload", "spec_decode", {"spec_decode": {"num_drafts": 188, "num_draft_tokens": 940,
                                                 "num_accepted_tokens": 11}}, 188, 11, 940),
]


def _row(final: dict) -> dict:
    rec = StreamRecorder(scheduled_ts=0.0, sent_ts=0.0)
    rec.on_data(json.dumps({"choices": [{"index": 0, "text": "a"}]}), 0.1)
    rec.on_data(json.dumps({"choices": [{"index": 0, "text": "b" * 199}]}), 0.5)
    rec.on_data(json.dumps({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": COMPLETION_TOKENS},
                            **final}), 0.5)
    rec.on_data("[DONE]", 0.5)
    return rec.row(0.5, M.STATUS_OK)


def _cell(rows: list[dict]):
    return summarize_cell(rows, strategy="eagle", tier="low", output_class="short", arrival="closed", users=1,
                          rate_rps=None, slo=Slo(ttft_ms=1000, tpot_ms=100), window=(0.0, 1.0),
                          cpu_samples=[])


@pytest.mark.parametrize("engine,version,final,drafts,accepted,drafted", SPEC_FIXTURES,
                         ids=[f"{e}-{v}" for e, v, *_ in SPEC_FIXTURES])
def test_every_spec_stats_spelling_gives_the_pooled_tau(engine, version, final, drafts, accepted, drafted):
    row = _row(final)
    assert row[M.REQ_SPEC_SOURCE] == engine
    assert (row[M.NUM_DRAFTS], row[M.NUM_ACCEPTED_TOKENS], row[M.NUM_DRAFT_TOKENS]) == (drafts, accepted, drafted)
    assert _cell([row]).acceptance_length == pytest.approx(1 + 11 / 188)          # 1.0585, never 1.0
    if engine == "sglang":   # SGLang's own accept length, labelled apart
        assert row[M.REQ_ENGINE_ACCEPT_LENGTH] == pytest.approx(COMPLETION_TOKENS / 188)   # 1.0638
    else:
        assert row[M.REQ_ENGINE_ACCEPT_LENGTH] is None


def test_a_verify_count_without_an_accepted_count_is_not_reported():
    row = _row({"meta_info": {"spec_verify_ct": 188, "spec_some_future_name": 11}})
    assert row[M.NUM_DRAFTS] == 188 and row[M.NUM_ACCEPTED_TOKENS] is None
    cell = _cell([row])
    assert math.isnan(cell.acceptance_length)
    assert any(w.startswith("tau not reported") for w in cell.warnings), cell.warnings


# (case, counter samples, their _created times, process start times, delta, resets)
RESET_FIXTURES = [
    ("steady", [1000, 1100, 1200], None, None, 200, 0),
    ("drop (Prometheus rule)", [1000, 300, 500], None, None, 500, 1),
    ("passed old value, newer _created", [1000, 1200], [10.0, 20.0], None, 1200, 1),
    ("passed old value, same _created", [1000, 1200], [10.0, 10.0], None, 200, 0),
    ("passed old value, newer process start", [1000, 1200], None, [5.0, 15.0], 1200, 1),
    ("failed scrape between", [1000, None, 1200], [10.0, None, 20.0], None, 1200, 1),
    ("no _created on the page", [1000, 1200], [None, None], [None, None], 200, 0),
]


@pytest.mark.parametrize("case,values,created,starts,delta,resets", RESET_FIXTURES,
                         ids=[c[0] for c in RESET_FIXTURES])
def test_counter_resets_by_drop_created_or_start_time(case, values, created, starts, delta, resets):
    assert sm.counter_delta(values, created, starts) == (delta, resets)


def _restarted_page(page: str, drafts_before: float, drafts_after: float, bump_s: float, which: str) -> str:
    """The vLLM 0.32 page with its drafts counter set to ``drafts_after`` (was
    ``drafts_before``) and the drafts ``_created`` or the process start moved ``bump_s`` later."""
    out = []
    for line in page.splitlines():
        if line.startswith("vllm:spec_decode_num_drafts_total{"):
            assert float(line.rsplit(" ", 1)[1]) == drafts_before
            line = line.rsplit(" ", 1)[0] + f" {drafts_after}"
        elif which == "created" and line.startswith("vllm:spec_decode_num_drafts_created{"):
            name, v = line.rsplit(" ", 1)
            line = f"{name} {float(v) + bump_s!r}"
        elif which == "start" and line.startswith("process_start_time_seconds "):
            name, v = line.rsplit(" ", 1)
            line = f"{name} {float(v) + bump_s!r}"
        out.append(line)
    return "\n".join(out) + "\n"


@pytest.mark.parametrize("which", ["created", "start"])
def test_vllm_page_restart_seen_by_created_or_start_time(which):
    """vLLM 0.32's real page (drafts 14): a restart that passes 14 before the next scrape
    (20 drafts since) is an increment of 20 and one reset, not 6."""
    page = (DATA / "vllm_0.32_draft_model_metrics.txt").read_text()
    after = _restarted_page(page, 14.0, 20.0, 60.0, which)
    snaps = [sm.Snapshot(0.0, sm.parse_page(page, M.ENGINE_VLLM)[0]),
             sm.Snapshot(1.0, sm.parse_page(after, M.ENGINE_VLLM)[0])]
    fig = sm.cell_figures(snaps, "draft_model")
    assert fig[M.SRV_NUM_DRAFTS] == 20
    # a newer process start restarts every counter of the page; a newer _created only its own
    assert fig["counter_resets"] == (1 if which == "created" else
                                     sum(1 for k in snaps[1].values if k[0] == "draft_model"
                                         and k[1] in M.SRV_COUNTERS))
    same = sm.cell_figures([snaps[0], sm.Snapshot(1.0, sm.parse_page(
        _restarted_page(page, 14.0, 20.0, 0.0, which), M.ENGINE_VLLM)[0])], "draft_model")
    assert same[M.SRV_NUM_DRAFTS] == 6 and same["counter_resets"] == 0


def _specload_page(requests: int, tokens: int) -> str:
    """specload's service page (Ray's export of actors/serve/deployments.py) with the request
    and generated-token counters, two replicas of ngram."""
    lines = ["# TYPE ray_specload_request_success counter",
             "# TYPE ray_specload_generation_tokens counter"]
    for rep, share in (("r1", 0.75), ("r2", 0.25)):
        lines.append(f'ray_specload_request_success_total{{replica="{rep}",strategy="ngram"}} {requests * share}')
        lines.append(f'ray_specload_generation_tokens_total{{replica="{rep}",strategy="ngram"}} {tokens * share}')
    return "\n".join(lines) + "\n"


def test_specload_service_counters_reconcile_requests_with_the_rows():
    """The requests and generated tokens the service saw over a cell against the client's ok
    rows: 8 requests of 32 tokens sent, the server finished 10 (2 from other traffic)."""
    snaps = [sm.Snapshot(0.0, sm.parse_page(_specload_page(100, 3200), M.ENGINE_SPECLOAD)[0]),
             sm.Snapshot(1.0, sm.parse_page(_specload_page(110, 3520), M.ENGINE_SPECLOAD)[0])]
    fig = sm.cell_figures(snaps, "ngram")
    assert fig[M.SRV_REQUESTS_FINISHED] == 10 and fig[M.SRV_GENERATION_TOKENS] == 320
    rows = [{M.REQ_STATUS: M.STATUS_OK, M.REQ_OUTPUT_TOKENS: 32} for _ in range(8)]
    att = sm.attribution(fig, rows + [{M.REQ_STATUS: M.STATUS_TIMEOUT, M.REQ_OUTPUT_TOKENS: None}])
    assert att == {"client_requests_ok": 8, "unattributed_requests": 2, "unattributed_generation_tokens": 64}
    assert sm.detect_engine(_specload_page(1, 1)) == M.ENGINE_SPECLOAD


def test_a_new_label_series_is_not_a_restart():
    """vLLM's finished-requests counter is summed over ``finished_reason``: the first
    ``stop`` mid-cell creates a series with a newer ``_created``; that is no restart (the
    oldest creation time of the summed series did not move)."""
    def page(length: float, stop: float | None) -> str:
        lines = ["# TYPE vllm:request_success counter",
                 f'vllm:request_success_total{{finished_reason="length",model_name="m"}} {length}',
                 f'vllm:request_success_created{{finished_reason="length",model_name="m"}} 100.0']
        if stop is not None:
            lines += [f'vllm:request_success_total{{finished_reason="stop",model_name="m"}} {stop}',
                      f'vllm:request_success_created{{finished_reason="stop",model_name="m"}} 500.0']
        return "\n".join(lines) + "\n"

    snaps = [sm.Snapshot(0.0, sm.parse_page(page(10, None), M.ENGINE_VLLM)[0]),
             sm.Snapshot(1.0, sm.parse_page(page(14, 3), M.ENGINE_VLLM)[0])]
    fig = sm.cell_figures(snaps, "m")
    assert fig[M.SRV_REQUESTS_FINISHED] == 7 and fig["counter_resets"] == 0
