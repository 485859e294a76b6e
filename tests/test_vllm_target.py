"""specload against a real vLLM (CPU build, fp32, k = 4): what specload records per cell
equals what vLLM's own counters moved by, the report has tau and per-position acceptance,
and traffic under another served name is kept out (before the cell: by the time window)
or flagged (during the cell: vLLM's counters carry one label per engine, the first
--served-model-name, so nothing can tell it apart; the per-request stats can).

Three vLLM servers for the whole module (module fixture, warm-ups overlapped): ngram
and draft_model, each serving the target under two names, and a bf16 one for the
consistency check. Needs the vLLM venv
(tests/vllm_server.py: $SPECLOAD_VLLM_PYTHON or .venv-vllm); skipped without it unless
SPECLOAD_REQUIRE_VLLM=1. Each load run: the cpu profile's mid tier (4 users), short
outputs (32 tokens), 10 s (the checks are counter equalities, not
rates: they hold whatever the length).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pandas as pd
import pytest

from configs import metric_names as M
from tests.tiers_file import write_tiers
from tests.vllm_server import DRAFT_MODEL, FAST_START, NGRAM, REPO, VllmServer, start_servers

pytestmark = pytest.mark.slow

DURATION_S = 10
USERS = 4
PROMPTS = [json.loads(l)["prompt"] for l in (REPO / "data" / "prompts" / "heldout_eval.jsonl").read_text().splitlines()
           if l.strip()]
DRAFTS = "vllm:spec_decode_num_drafts"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"


@pytest.fixture(scope="module")
def vllm_servers(tmp_path_factory):
    """{"ngram": VllmServer, "draft_model": VllmServer, "bf16": VllmServer}: ngram and
    draft_model each also serve ``<name>-alias``; bf16 (no speculation) is for the tie-aware
    consistency check (greedy identity breaks at near-tied logits in bf16: docs/design.md).
    All three warm up at once (one start-up wait instead of two)."""
    log_dir = tmp_path_factory.mktemp("vllm")
    # FAST_START: no torch.compile warm-up, no worker process; these tests read what vLLM
    # reports, not its speed
    servers = {"ngram": VllmServer(["ngram", "ngram-alias"], NGRAM, **FAST_START),
               "draft_model": VllmServer(["draft_model", "draft_model-alias"], DRAFT_MODEL,
                                         **FAST_START),
               "bf16": VllmServer(["bf16"], None, dtype="bfloat16", **FAST_START)}
    t0 = time.monotonic()
    start_servers(list(servers.values()), log_dir)
    print(f"\nvLLM servers ready in {time.monotonic() - t0:.0f} s: "
          + ", ".join(f"{k} {s.url} pid {s.proc.pid}" for k, s in servers.items()))
    yield servers
    for s in servers.values():
        s.stop()


def run_loadgen(url: str, strategy: str, results: Path, *extra: str) -> subprocess.CompletedProcess:
    """4 users, 32-token outputs, DURATION_S, greedy; a drain long enough that no request is cancelled
    at the cell's end (a cancelled request drafted on the server but reports no stats)."""
    tiers = write_tiers(results, {"arrival": "closed", "users": USERS, "spawn_rate": USERS,
                                  "duration_s": DURATION_S, "max_tokens": 32,
                                  "slo": {"ttft_ms": 2000, "tpot_ms": 200}},
                        request_timeout_s=120, drain_timeout_s=120, profile="vllm", seed=0,
                        max_prompt_chars=1200,
                        sampling={"temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": 0})
    cmd = [sys.executable, "-m", "loadgen", "--target", url, "--strategies", strategy, "--tier", "mid",
           "--output", "short", "--tiers-file", str(tiers), "--consistency", "0",
           # no warm-up requests: these tests account for every request the server counted
           "--warmup-requests", "0", "--warmup-s", "0",
           "--results", str(results), "--run-id", "run", "--report", *extra]
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"}
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def delta(after: dict, before: dict) -> dict:
    out = {k: after[k] - before.get(k, 0.0) for k in after if k != "per_pos"}
    out["per_pos"] = [a - b for a, b in zip(after["per_pos"], before["per_pos"])]
    return out


def spec(resp: dict) -> dict:
    return resp["metrics"]["speculative_decoding"]


def test_ngram_cell_equals_vllm_counters_and_other_traffic_before_is_excluded(vllm_servers, tmp_path):
    srv = vllm_servers["ngram"]
    before = srv.counters()
    # other traffic under the second served name, after `before` and before the run's cell
    pre = [spec(srv.complete("ngram-alias", p)) for p in PROMPTS[:2]]
    t0 = time.monotonic()
    p = run_loadgen(srv.url, "ngram", tmp_path)
    wall = time.monotonic() - t0
    after = srv.counters()
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    run = tmp_path / "run"
    manifest = json.loads((run / "manifest.json").read_text())
    facts = manifest["server_metrics"]
    assert facts["engine"] == "vllm" and facts["model_labels"] == {"ngram": "ngram"}
    assert facts["missing"] == [] and facts["failed_scrapes"] == 0
    (cell,) = manifest["cells"]
    got = cell["server_metrics"]
    vllm = delta(after, before)
    pre_drafts = sum(x["num_spec_steps"] for x in pre)
    pre_acc = sum(x["num_accepted_draft_tokens"] for x in pre)
    # the cell's deltas = vLLM's own counters over the test's window minus the traffic before the cell
    assert got[M.SRV_NUM_DRAFTS] == vllm[DRAFTS] - pre_drafts > 0
    assert got[M.SRV_NUM_ACCEPTED_TOKENS] == vllm[ACCEPTED] - pre_acc
    assert got[M.SRV_NUM_DRAFT_TOKENS] == vllm[DRAFT_TOKENS] - sum(x["num_draft_tokens"] for x in pre)
    pre_pos = [sum(sum(x["acceptance_histogram"][i + 1:]) for x in pre) for i in range(4)]
    assert got[M.SRV_NUM_ACCEPTED_PER_POS] == [v - q for v, q in zip(vllm["per_pos"], pre_pos)]
    # and = the sum of the cell's own requests' per-request stats (nothing unattributed)
    req = pd.read_parquet(run / "requests.parquet")
    ok = req[req[M.REQ_STATUS].eq(M.STATUS_OK)]
    assert len(ok) == len(req) and (ok[M.REQ_SPEC_SOURCE] == "vllm").all()
    assert int(req[M.NUM_DRAFTS].sum()) == got[M.SRV_NUM_DRAFTS]
    assert int(req[M.NUM_ACCEPTED_TOKENS].sum()) == got[M.SRV_NUM_ACCEPTED_TOKENS]
    assert got["unattributed_drafts"] == 0 and not any("other traffic" in w for w in cell["warnings"])
    tau = 1 + got[M.SRV_NUM_ACCEPTED_TOKENS] / got[M.SRV_NUM_DRAFTS]
    assert got[M.ACCEPTANCE_LENGTH] == pytest.approx(tau) and cell[M.ACCEPTANCE_LENGTH] == pytest.approx(tau)
    assert got[f"{M.SRV_RUNNING}_max"] <= 4 and got[M.SRV_ENGINE_STEPS] > 0
    # summary.csv has the same deltas
    csv = pd.read_csv(run / "summary.csv")
    assert int(csv["server_num_drafts"].iloc[0]) == got[M.SRV_NUM_DRAFTS]
    # the time series file: the served model only, cell-labelled samples
    ts = pd.read_parquet(run / "server_metrics.parquet")
    assert set(ts["model"]) == {"ngram"} and (ts[M.REQ_TIER] == "mid").any()
    report = _check_report(run, "ngram", got)
    print(f"\nngram: drafts {got[M.SRV_NUM_DRAFTS]} accepted {got[M.SRV_NUM_ACCEPTED_TOKENS]} tau {tau:.3f} "
          f"per-pos {got[M.SRV_NUM_ACCEPTED_PER_POS]} (vLLM delta {vllm[DRAFTS]:.0f}/{vllm[ACCEPTED]:.0f}, "
          f"{pre_drafts}/{pre_acc} of them before the cell); requests {len(req)}; loadgen {wall:.0f} s; "
          f"report: {report}")


def _check_report(run: Path, strategy: str, got: dict) -> None:
    """tau, per-position acceptance and wasted tokens as the report computes them."""
    from analysis.data.load import load_results
    from analysis.report.build import analyse

    a = analyse(load_results(run))
    cell = a.cells[a.cells[M.REQ_STRATEGY].eq(strategy)].iloc[0]
    tau = 1 + got[M.SRV_NUM_ACCEPTED_TOKENS] / got[M.SRV_NUM_DRAFTS]
    assert cell[M.ACCEPTANCE_LENGTH] == pytest.approx(tau)
    pos = a.positions[a.positions[M.REQ_STRATEGY].eq(strategy)]
    assert list(pos["uncond"]) == pytest.approx([x / got[M.SRV_NUM_DRAFTS] for x in got[M.SRV_NUM_ACCEPTED_PER_POS]])
    cap = a.capacity[a.capacity[M.STEP_STRATEGY].eq(strategy)].iloc[0]
    assert cap["source"] == "server /metrics"
    srv_tables = {t[0]: t[2] for t in a.server["tables"]}
    (row,) = srv_tables["Server metrics per cell"]
    assert row["wasted_tokens"] == got[M.SRV_NUM_DRAFT_TOKENS] - got[M.SRV_NUM_ACCEPTED_TOKENS]
    md = (run / "report" / "report.md").read_text()
    assert "## Server metrics per cell" in md and "## Per-position acceptance" in md
    return (f"tau {cell[M.ACCEPTANCE_LENGTH]:.3f}, uncond {[round(x, 3) for x in pos['uncond']]}, "
            f"cond {[round(x, 3) for x in pos['cond']]}, wasted tokens {row['wasted_tokens']} "
            f"(share {row['wasted_share']:.3f} of {row['verification_tokens_total']} verification tokens), "
            f"steps {row['steps']}, step_ms {row['step_ms']:.1f}, running {row['batch_size_mean']:.2f}")


def test_draft_model_other_traffic_during_the_cell_is_flagged(vllm_servers, tmp_path):
    srv = vllm_servers["draft_model"]
    before = srv.counters()
    during: list[dict] = []
    stop = threading.Event()

    def other_traffic() -> None:   # 2 requests under the alias while the cell runs, bounded
        deadline = time.monotonic() + 120
        while not stop.is_set() and time.monotonic() < deadline:
            if srv.counters()[DRAFTS] > before[DRAFTS]:        # the run's load has reached the engine
                break
            time.sleep(0.2)
        time.sleep(2.0)
        if stop.is_set():
            return

        def one(prompt: str) -> None:
            t0 = time.time()
            out = srv.complete("draft_model-alias", prompt, max_tokens=16)
            during.append({**spec(out), "t0": t0, "t1": time.time()})

        both = [threading.Thread(target=one, args=(p,)) for p in PROMPTS[10:12]]
        for t in both:
            t.start()
        for t in both:
            t.join(timeout=120)

    th = threading.Thread(target=other_traffic, daemon=True)
    th.start()
    p = run_loadgen(srv.url, "draft_model", tmp_path)
    stop.set()
    th.join(timeout=130)
    after = srv.counters()
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert len(during) == 2
    run = tmp_path / "run"
    (cell,) = json.loads((run / "manifest.json").read_text())["cells"]
    got = cell["server_metrics"]
    vllm = delta(after, before)
    other = sum(x["num_spec_steps"] for x in during)
    assert all(got["t0"] < x["t0"] and x["t1"] < got["t1"] for x in during), (got["t0"], got["t1"], during)
    # the counters cannot tell the alias apart: the cell's delta has it, the requests do not
    assert got[M.SRV_NUM_DRAFTS] == vllm[DRAFTS]
    assert got[M.SRV_NUM_ACCEPTED_TOKENS] == vllm[ACCEPTED]
    assert got["unattributed_drafts"] == other > 0
    assert got["unattributed_accepted_tokens"] == sum(x["num_accepted_draft_tokens"] for x in during)
    req = pd.read_parquet(run / "requests.parquet")
    assert int(req[M.NUM_DRAFTS].sum()) == got[M.SRV_NUM_DRAFTS] - other
    assert any("other traffic" in w for w in cell["warnings"])
    # draft_model drafts every decode step: k = 4 tokens a draft
    assert got[M.SRV_NUM_DRAFT_TOKENS] == 4 * got[M.SRV_NUM_DRAFTS]
    md = (run / "report" / "report.md").read_text()
    assert "other traffic reached the engine" in md
    own_acc = int(req[M.NUM_ACCEPTED_TOKENS].sum())
    print(f"\ndraft_model: drafts {got[M.SRV_NUM_DRAFTS]} accepted {got[M.SRV_NUM_ACCEPTED_TOKENS]} "
          f"draft tokens {got[M.SRV_NUM_DRAFT_TOKENS]} tau {got[M.ACCEPTANCE_LENGTH]:.3f} per-pos "
          f"{got[M.SRV_NUM_ACCEPTED_PER_POS]} (= vLLM delta {vllm[DRAFTS]:.0f}/{vllm[ACCEPTED]:.0f}); alias during "
          f"the cell: {other} drafts / {got['unattributed_accepted_tokens']} accepted (flagged); the cell's own "
          f"requests: {len(req)}, {got[M.SRV_NUM_DRAFTS] - other} drafts / {own_acc} accepted, tau "
          f"{1 + own_acc / (got[M.SRV_NUM_DRAFTS] - other):.3f}")


def _vllm_greedy(url: str, model: str, prompts: list[dict], max_tokens: int) -> dict[str, list[int]]:
    """Greedy token ids from a vLLM server (``return_token_ids``), one request per prompt."""
    out = {}
    for p in prompts:
        body = {"model": model, "prompt": p["prompt"], "max_tokens": max_tokens,
                "temperature": 0, "return_token_ids": True}
        req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:   # noqa: S310 (loopback)
            out[p["id"]] = json.loads(r.read())["choices"][0]["token_ids"]
    return out


def test_consistency_ties_vllm_fp32_and_bf16_against_specload(vllm_servers,
                                                              make_engine, heldout_prompts):
    """specload's fp32 autoregressive engine is the baseline (its own top-5 logprobs at each
    position); vLLM fp32 (ngram, draft_model speculation) and vLLM bf16 (no speculation)
    on the same 12 held-out prompts x 48 greedy tokens: every first divergence is a tie
    within the dtype's tolerance, none a violation."""
    from actors.engine.llm_engine import run_requests
    from actors.engine.types import SamplingParams
    from analysis.data import consistency as c

    prompts = heldout_prompts[:6] + heldout_prompts[24:30]
    eng = make_engine("autoregressive", max_num_seqs=12)
    ref = run_requests(eng, [(p["id"], p["prompt"], SamplingParams(max_tokens=48, logprobs=5))
                             for p in prompts], batch_size=len(prompts))
    base = {k: r["token_ids"] for k, r in ref.items()}
    tops = {k: [{t: v for t, _, _, v in e.top} | {e.token_id: e.logprob} for e in r["logprobs"]]
            for k, r in ref.items()}
    cases = {"vllm fp32 ngram": (vllm_servers["ngram"].url, "ngram", "float32"),
             "vllm fp32 draft_model": (vllm_servers["draft_model"].url, "draft_model", "float32"),
             "vllm bf16": (vllm_servers["bf16"].url, "bf16", "bfloat16")}
    table = {}
    for name, (url, model, dtype) in cases.items():
        got = _vllm_greedy(url, model, prompts, 48)
        e = c.compare_outputs(base, got, "short", baseline_top=tops, tolerance=c.tie_tolerance(dtype))
        table[name] = {k: e[k] for k in ("compared", "identical", "ties", "violations", "unclassified")}
        table[name]["gaps"] = [round(d["gap"], 6) for d in e["first_divergence"] if d.get("gap") is not None]
        assert e["compared"] == 12
    print("\nconsistency vs specload fp32 autoregressive:", json.dumps(table, indent=1))
    for name, row in table.items():
        assert row["violations"] == 0 and row["unclassified"] == 0, (name, row)
        assert row["identical"] + row["ties"] == 12, (name, row)
