"""Serving overhead: output tokens/s through HTTP + Ray Serve vs the engine directly.

    python -m actors.bench_serve [--strategy autoregressive] [--concurrency 16]
                                 [--max-tokens 128] [--json out.json]

Same prompts (held-out, ``data/prompts/heldout_eval.jsonl``), same engine
config, greedy, ``ignore_eos`` so every request emits ``max_tokens`` tokens,
``concurrency`` requests at once, one run each:

1. direct: ``AsyncLLMEngine`` in this process (torch threads as the replica).
2. served: a local Ray (``--num-cpus``) + Serve app with that one strategy on a
   free 127.0.0.1 port, the same requests as concurrent streaming HTTP calls.

The direct run is done before and after the served one and averaged (the
box may be busy). Prints tokens/s, the ratio (served / direct; 1.0 = no overhead),
and the per-request latency Serve adds (e2e and TTFT, ms, served - direct,
matched by prompt).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

from configs.jsonio import write_json
from configs.net import free_port
from configs.paths import PROMPTS_DIR

PROMPTS = PROMPTS_DIR / "heldout_eval.jsonl"


def load_prompts(n: int) -> list[str]:
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()]
    return [rows[i % len(rows)]["prompt"] for i in range(n)]


# As configs/serve.yaml: gRPC between ingress and strategy replicas, user code on
# the replica's event loop (two of Serve's throughput-mode settings).
THROUGHPUT_ENV = {"RAY_SERVE_USE_GRPC_BY_DEFAULT": "1",
                  "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}


async def run_direct(engine_cfg: dict, prompts: list[str], max_tokens: int) -> dict:
    """Concurrent requests straight into an AsyncLLMEngine; per-request e2e / TTFT in ms."""
    from actors.engine.config import EngineConfig
    from actors.engine.types import SamplingParams
    from actors.serve.app import resolve_engine_config
    from actors.serve.async_engine import AsyncLLMEngine

    eng = AsyncLLMEngine.from_config(EngineConfig(**resolve_engine_config(engine_cfg)))
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)

    async def one(i: int, prompt: str) -> dict:
        t0 = time.perf_counter()
        ttft, n = None, 0
        async for out in eng.generate(f"d{i}", prompt, params):
            if out.new_token_ids and ttft is None:
                ttft = time.perf_counter() - t0
            n += len(out.new_token_ids)
        return {"e2e_ms": (time.perf_counter() - t0) * 1e3, "ttft_ms": (ttft or 0) * 1e3,
                "tokens": n}

    try:
        await one(-1, "warm up")                      # first-call costs out of the timing
        t0 = time.perf_counter()
        reqs = await asyncio.gather(*[one(i, p) for i, p in enumerate(prompts)])
        wall = time.perf_counter() - t0
    finally:
        eng.shutdown()
    return {"wall_s": wall, "requests": reqs,
            "tokens_per_s": sum(r["tokens"] for r in reqs) / wall}


async def run_http(base: str, model: str, prompts: list[str], max_tokens: int) -> dict:
    """The same requests as concurrent streaming /v1/completions calls."""
    import httpx

    async def one(client, prompt: str) -> dict:
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        t0 = time.perf_counter()
        ttft, n = None, 0
        async with client.stream("POST", "/v1/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    n = chunk["usage"]["completion_tokens"]
                elif chunk["choices"] and chunk["choices"][0]["token_ids"] and ttft is None:
                    ttft = time.perf_counter() - t0
        return {"e2e_ms": (time.perf_counter() - t0) * 1e3, "ttft_ms": (ttft or 0) * 1e3,
                "tokens": n}

    limits = httpx.Limits(max_connections=len(prompts) + 4)
    async with httpx.AsyncClient(base_url=base, timeout=600, limits=limits) as client:
        await one(client, "warm up")
        t0 = time.perf_counter()
        reqs = await asyncio.gather(*[one(client, p) for p in prompts])
        wall = time.perf_counter() - t0
    return {"wall_s": wall, "requests": reqs,
            "tokens_per_s": sum(r["tokens"] for r in reqs) / wall}


def serve_app(engine_cfg: dict, strategy: str, num_cpus: int,
              tuned: bool = True) -> tuple[str, object]:
    import ray
    from ray import serve

    from actors.serve.app import build_app

    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    rt = {"env_vars": dict(THROUGHPUT_ENV) if tuned else {}}
    serve.run(build_app({"strategies": [{"name": strategy, "engine": engine_cfg,
                                         "ray_actor_options": {"num_cpus": 0.5,
                                                               "runtime_env": rt}}],
                         "ingress": {"ray_actor_options": {"num_cpus": 0.1,
                                                           "runtime_env": rt}}}),
              name="bench", route_prefix="/")
    return f"http://127.0.0.1:{port}", ray


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m actors.bench_serve", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--strategy", default="autoregressive")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--torch-threads", type=int, default=1)
    ap.add_argument("--num-cpus", type=int, default=2, help="CPUs of the local Ray")
    ap.add_argument("--no-serve-tuning", action="store_true",
                    help="Serve's defaults instead of configs/serve.yaml's env_vars")
    ap.add_argument("--json", type=Path, default=None, help="write the result here")
    a = ap.parse_args(argv)

    engine_cfg = {"strategy": a.strategy, "max_num_seqs": a.concurrency,
                  "torch_threads": a.torch_threads,
                  "num_speculative_tokens": 0 if a.strategy == "autoregressive"
                  else a.num_speculative_tokens}
    prompts = load_prompts(a.concurrency)
    import torch

    torch.set_num_threads(a.torch_threads)  # the direct runs share this process, as a replica would
    # direct, served, direct: the reference is the mean of the two direct runs, so
    # a drift in background load during the run biases the ratio less.
    direct = asyncio.run(run_direct(engine_cfg, prompts, a.max_tokens))
    print(f"direct (before): {direct['tokens_per_s']:.1f} output tokens/s "
          f"({direct['wall_s']:.2f} s)")
    base, ray = serve_app(engine_cfg, a.strategy, a.num_cpus, not a.no_serve_tuning)
    try:
        served = asyncio.run(run_http(base, a.strategy, prompts, a.max_tokens))
    finally:
        from ray import serve

        serve.shutdown()
        ray.shutdown()
    direct2 = asyncio.run(run_direct(engine_cfg, prompts, a.max_tokens))
    print(f"direct (after): {direct2['tokens_per_s']:.1f} output tokens/s "
          f"({direct2['wall_s']:.2f} s)")
    for d, d2 in zip(direct["requests"], direct2["requests"]):
        d["e2e_ms"] = (d["e2e_ms"] + d2["e2e_ms"]) / 2
        d["ttft_ms"] = (d["ttft_ms"] + d2["ttft_ms"]) / 2
    direct["tokens_per_s"] = (direct["tokens_per_s"] + direct2["tokens_per_s"]) / 2
    added_e2e = [s["e2e_ms"] - d["e2e_ms"] for s, d in zip(served["requests"],
                                                            direct["requests"])]
    added_ttft = [s["ttft_ms"] - d["ttft_ms"] for s, d in zip(served["requests"],
                                                              direct["requests"])]
    result = {
        "strategy": a.strategy, "concurrency": a.concurrency, "max_tokens": a.max_tokens,
        "direct_tokens_per_s": round(direct["tokens_per_s"], 2),
        "served_tokens_per_s": round(served["tokens_per_s"], 2),
        "ratio": round(served["tokens_per_s"] / direct["tokens_per_s"], 4),
        "added_e2e_ms_mean": round(statistics.mean(added_e2e), 2),
        "added_e2e_ms_p50": round(statistics.median(added_e2e), 2),
        "added_ttft_ms_mean": round(statistics.mean(added_ttft), 2),
        "direct_e2e_ms_mean": round(statistics.mean(r["e2e_ms"] for r in direct["requests"]), 2),
    }
    if a.json:
        write_json(a.json, result)
    print(f"served: {served['tokens_per_s']:.1f} output tokens/s ({served['wall_s']:.2f} s)")
    print(f"ratio served/direct: {result['ratio']:.3f}")
    print(f"added latency per request: e2e mean {result['added_e2e_ms_mean']:.1f} ms "
          f"(p50 {result['added_e2e_ms_p50']:.1f} ms), TTFT mean "
          f"{result['added_ttft_ms_mean']:.1f} ms")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
