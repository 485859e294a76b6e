"""Per-token ITL where the server gives per-chunk counts, labelled chunk ITL where it does not;
latency distributions (mean / p50 / p90 / p99) and the TPOT bimodality flag; stream batching
(multi-token chunks with speculation off) flagged as a server artefact (docs/metrics.md)."""

from __future__ import annotations

import csv
import json
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest

from analysis.data.distribution import bimodality, bimodality_coefficient, describe
from configs import metric_names as M
from configs.tiers import Slo
from loadgen.results.summary import summarize_cell
from loadgen.tools import fake_server
from tests.tiers_file import write_tiers

REPO = Path(__file__).resolve().parent.parent
KW = dict(tier="low", output_class="short", arrival="closed", users=1, rate_rps=None,
          slo=Slo(ttft_ms=1000, tpot_ms=100), window=(0.0, 10.0), cpu_samples=[])


def _row(tpot: float = 5.0, **extra) -> dict:
    return {M.REQ_STATUS: M.STATUS_OK, M.REQ_SENT_TS: 0.0, M.REQ_SCHEDULED_TS: 0.0, M.REQ_END_TS: 1.0,
            M.REQ_OUTPUT_TOKENS: 31, M.REQ_TTFT_MS: 20.0, M.REQ_TPOT_MS: tpot, M.REQ_NUM_CHUNKS: 11,
            **extra}


def test_bimodality_coefficient_and_two_modes():
    rng = random.Random(1)
    two = [rng.gauss(5.0, 0.3) for _ in range(60)] + [rng.gauss(10.9, 0.4) for _ in range(40)]
    one = [rng.gauss(8.0, 1.0) for _ in range(100)]
    b2, b1 = bimodality(two), bimodality(one)
    assert b2["bimodal"] and b2["bc"] > 5 / 9
    assert b2["low_mode"] == pytest.approx(5.0, abs=0.2) and b2["high_mode"] == pytest.approx(10.9, abs=0.25)
    assert b2["low_share"] == pytest.approx(0.6)
    assert not b1["bimodal"] and b1["bc"] < 5 / 9
    # a normal sample's coefficient is near 1/3 (skew 0, excess kurtosis 0), two equal spikes' is 1
    assert bimodality_coefficient([0.0] * 500 + [1.0] * 500) == pytest.approx(1.0, abs=0.01)
    d = describe([1.0, 2.0, 3.0, 4.0, None, math.nan])
    assert d["mean"] == 2.5 and d["p50"] == 2.5 and d["p90"] == pytest.approx(3.7)


def test_cell_reports_mean_p90_and_flags_bimodal_tpot():
    rng = random.Random(2)
    tpots = [rng.gauss(5.0, 0.2) for _ in range(30)] + [rng.gauss(11.0, 0.3) for _ in range(20)]
    rows = [_row(t, **{M.REQ_ITL_SOURCE: M.ITL_SOURCE_TOKENS, M.REQ_ITL_P50_MS: 4.0, M.REQ_ITL_P90_MS: 9.0,
                       M.REQ_ITL_P99_MS: 20.0, M.REQ_ITL_MEAN_MS: t, M.REQ_TOKENS_PER_CHUNK: 3.0,
                       M.REQ_MULTI_TOKEN_CHUNKS: 5, M.REQ_CHUNK_GAP_P50_MS: 12.0}) for t in tpots]
    s = summarize_cell(rows, strategy="ngram", **KW)
    assert s.tpot_ms_mean == pytest.approx(sum(tpots) / len(tpots))
    assert s.itl_kind == "per_token" and s.itl_ms_p50 == 4.0 and s.itl_ms_p90 == 9.0 and s.itl_ms_p99 == 20.0
    assert s.itl_ms_mean == pytest.approx(sum(tpots) / len(tpots))   # every row weighs 30 tokens
    assert s.tpot_mode_low_ms == pytest.approx(5.0, abs=0.2) and s.tpot_mode_high_ms == pytest.approx(11.0, abs=0.3)
    assert any("TPOT is bimodal" in w for w in s.warnings)
    assert not any("speculation off" in w for w in s.warnings)       # ngram: multi-token chunks expected
    one = summarize_cell([_row(5.0 + 0.01 * i) for i in range(50)], strategy="ngram", **KW)
    assert math.isnan(one.tpot_mode_low_ms) and not any("bimodal" in w for w in one.warnings)


def test_cell_without_per_chunk_counts_is_chunk_itl_and_batching_is_flagged():
    rows = [_row(5.0, **{M.REQ_ITL_SOURCE: M.ITL_SOURCE_CHUNKS, M.REQ_TOKENS_PER_CHUNK: 5.0,
                         M.REQ_CHUNK_GAP_P50_MS: 50.0}) for _ in range(10)]
    s = summarize_cell(rows, strategy="autoregressive", **KW)
    assert s.itl_kind == "chunk" and math.isnan(s.itl_ms_p50) and math.isnan(s.itl_ms_p99)
    assert s.tokens_per_chunk == 5.0 and s.chunk_gap_ms_p50 == 50.0
    assert any(w.startswith("chunk ITL, 5.0 tokens per chunk on average") for w in s.warnings), s.warnings
    assert any("speculation off" in w and "server artefact" in w for w in s.warnings), s.warnings


def test_pooled_tau_not_reported_when_accepted_count_is_missing():
    rows = [_row(**{M.NUM_DRAFTS: 188, M.REQ_SPEC_SOURCE: M.ENGINE_SGLANG})]
    s = summarize_cell(rows, strategy="eagle", **KW)
    assert math.isnan(s.acceptance_length)
    assert any(w.startswith("tau not reported") and "sglang" in w for w in s.warnings)


def _loadgen(url: str, tmp: Path, name: str) -> tuple[dict, dict, list[dict]]:
    tiers = write_tiers(tmp, {"users": 2, "spawn_rate": 100, "duration_s": 2, "max_tokens": 31,
                              "slo": {"ttft_ms": 1000, "tpot_ms": 100}})
    res = tmp / name
    p = subprocess.run([sys.executable, "-m", "loadgen", "--tier", "low", "--output", "short",
                        "--target", url, "--tiers-file", str(tiers), "--results", str(res),
                        "--strategies", "autoregressive"],
                       capture_output=True, text=True, timeout=120, cwd=REPO)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    (d,) = list(res.iterdir())
    cell = json.loads((d / "manifest.json").read_text())["cells"][0]
    with open(d / "summary.csv") as f:
        (summary,) = list(csv.DictReader(f))
    import pandas as pd
    rows = pd.read_parquet(d / "requests.parquet").to_dict("records")
    return cell, summary, rows


def test_ray_serve_style_50ms_stream_batching(tmp_path):
    """A server that coalesces the engine's 10 ms steps (one token each) into one chunk per
    50 ms: with continuous usage the ITL is per token (~10 ms, gap / n); without it the cell
    says chunk ITL with ~5 tokens per chunk and gives no per-token ITL; both flag the
    multi-token chunks of an autoregressive strategy as stream batching."""
    args = ("--ttft-ms", "20", "--gap-ms", "10", "--tokens-per-chunk", "1", "--batch-interval-ms", "50")
    with fake_server.running(*args) as url:
        cell, summary, rows = _loadgen(url, tmp_path, "cont")
    assert {r[M.REQ_ITL_SOURCE] for r in rows} == {M.ITL_SOURCE_TOKENS}
    assert cell["itl_kind"] == "per_token" and summary["itl_kind"] == "per_token"
    assert cell["itl_ms_mean"] == pytest.approx(cell["tpot_ms_mean"], rel=0.15)   # per token, not per chunk
    assert 9.0 <= cell["itl_ms_p50"] <= 14.0 and cell["tokens_per_chunk"] > 3.5
    assert any("speculation off" in w for w in cell["warnings"]), cell["warnings"]
    with fake_server.running(*args, "--no-continuous-usage") as url:
        cell, summary, rows = _loadgen(url, tmp_path, "end")
    assert {r[M.REQ_ITL_SOURCE] for r in rows} == {M.ITL_SOURCE_CHUNKS}
    assert cell["itl_kind"] == "chunk" and cell["itl_ms_p50"] is None and summary["itl_ms_p50"] == ""
    assert 45.0 <= cell["chunk_gap_ms_p50"] <= 65.0 and cell["tokens_per_chunk"] > 3.5
    assert any(w.startswith("chunk ITL,") for w in cell["warnings"]), cell["warnings"]
    assert any("speculation off" in w for w in cell["warnings"]), cell["warnings"]


def test_report_cell_table_reads_the_same_as_the_summary():
    """analysis.data.metrics (the report) and loadgen.results.summary (console, summary.csv)
    give a cell the same distribution figures, ITL kind and TPOT modes."""
    import pandas as pd

    from analysis.data.metrics import cell_table, with_slo_flags

    rng = random.Random(3)
    tpots = [rng.gauss(5.0, 0.2) for _ in range(30)] + [rng.gauss(11.0, 0.3) for _ in range(20)]
    rows = [_row(t, **{M.REQ_ITL_SOURCE: M.ITL_SOURCE_TOKENS, M.REQ_ITL_P50_MS: t * 0.8, M.REQ_ITL_P90_MS: t * 2,
                       M.REQ_ITL_P99_MS: t * 4, M.REQ_ITL_MEAN_MS: t, M.REQ_TOKENS_PER_CHUNK: 3.0,
                       M.REQ_CHUNK_GAP_P50_MS: 3 * t, M.REQ_TTFT_MS: 20.0 + i})
            for i, t in enumerate(tpots)]
    s = summarize_cell(rows, strategy="ngram", **KW)
    df = pd.DataFrame([{**r, M.REQ_RUN_ID: "r", M.REQ_STRATEGY: "ngram", M.REQ_TIER: "low",
                        M.REQ_OUTPUT_CLASS: "short", M.REQ_USERS: 1, M.NUM_DRAFTS: None,
                        M.NUM_ACCEPTED_TOKENS: None, M.REQ_E2E_MS: 100.0, M.REQ_PROMPT_TOKENS: 5,
                        M.DEGRADED_REASON: None, M.NUM_ACCEPTED_TOKENS_PER_POS: None} for r in rows])
    (cell,) = cell_table(with_slo_flags(df, {"low": KW["slo"]})).to_dict("records")
    for key in ("ttft_ms_mean", "ttft_ms_p50", "ttft_ms_p90", "ttft_ms_p99", "tpot_ms_mean", "tpot_ms_p50",
                "tpot_ms_p90", "tpot_ms_p99", "itl_ms_mean", "itl_ms_p50", "itl_ms_p90", "itl_ms_p99",
                "tokens_per_chunk", "chunk_gap_ms_p50", "tpot_mode_low_ms", "tpot_mode_high_ms"):
        assert cell[key] == pytest.approx(getattr(s, key)), key
    assert cell["itl_kind"] == s.itl_kind == "per_token" and not math.isnan(s.tpot_mode_low_ms)


def test_two_tight_groups_close_together_are_one_mode():
    """Two tight groups 0.3 ms apart (10.5 vs 10.8 ms, seen on the fake server) pass Ashman's D
    but are one mode to a reader: not flagged; the same groups 5 vs 11 ms are flagged."""
    from analysis.data.distribution import bimodality

    close = [10.5 + 0.001 * (i % 3) for i in range(34)] + [10.8 + 0.001 * (i % 3) for i in range(6)]
    far = [5.0 + 0.01 * (i % 3) for i in range(20)] + [11.0 + 0.01 * (i % 3) for i in range(20)]
    assert bimodality(close)["ashman_d"] > 2 and not bimodality(close)["bimodal"]
    got = bimodality(far)
    assert got["bimodal"] and round(got["low_mode"], 1) == 5.0 and round(got["high_mode"], 1) == 11.0
