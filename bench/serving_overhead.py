"""Serving overhead: output tokens/s through HTTP + Ray Serve vs the engine directly.

    python -m bench.serving_overhead [--strategy autoregressive] [--concurrency 4,16]
                                 [--max-tokens 128] [--reps 3] [--waves 5]
                                 [--stream-intervals 1]
                                 [--stream-intervals-ms 20]
                                 [--json out.json]

Same prompts (held-out, ``data/prompts/heldout_eval.jsonl``), same engine
config, greedy, ``ignore_eos`` so every request emits ``max_tokens`` tokens,
``concurrency`` streaming requests at once (a wave), ``--waves`` waves per measurement
(tokens/s over all of them), each way's waves interleaved with the others'. Four ways, side by side and
interleaved (each repetition runs every way at every concurrency, in an order
rotated per repetition, before the next repetition starts), medians of ``--reps``:

1. ``direct``: an ``AsyncLLMEngine`` in this process (torch threads as the replica).
2. ``strategy_route`` (one hop): ``POST /strategies/<name>/v1/completions``, answered
   by the strategy replica itself (the layout ``python -m cluster up`` deploys,
   ``actors.serve.app.run_applications``).
3. ``model_field``: ``POST /v1/completions`` with ``model``, through the OpenAI
   ingress (a second Ray hop per chunk), to the same replica.
4. ``direct_ingress``: the strategy route on the replica's own HTTP listener (Ray Serve's
   direct ingress, ``configs.serve_config.DIRECT_INGRESS_ENV``: no Serve proxy in the
   path; on in ``python -m cluster up`` by default, the route ``python -m loadgen`` takes);
   off with ``--no-direct-ingress``.

The strategy route runs with the deployment's default chunking (a chunk per
``DEFAULT_STREAM_INTERVAL_MS`` window, Ray Serve LLM's stream batching);
``--stream-intervals 1,4`` (default 1: one chunk per engine step, as vLLM streams)
and ``--stream-intervals-ms 20`` also measure those request fields on it. Per
repetition, a served run's ratio is its tokens/s over the direct run's of the same
repetition; the TTFT the service adds is served - direct, matched by prompt. Prints
and writes (``--json``): ``route`` and ``ratio`` (served / direct on the load
generator's default route, ``python -m loadgen --route auto``: the replica's own listener
when direct ingress is measured, as ``cluster up`` serves by default, else the strategy
route; the deployment's default chunking; the lowest over the concurrencies),
``ratio_strategy_route`` (same, through the Serve proxy), ``ratio_model_field`` (same,
model-field route), ``ratio_direct_ingress`` (same, direct ingress),
``ttft_added_ms_p50`` (default route, the highest over the concurrencies) and, per
concurrency and way, tokens/s, ratio, TTFT and e2e added (p50, ms) and chunks per
request.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

from configs.cli_args import number, output_file
from configs.jsonio import write_json
from configs.metric_names import STRATEGIES
from configs.net import free_port, use_loopback_env
from configs.paths import PROMPTS_DIR

PROMPTS = PROMPTS_DIR / "heldout_eval.jsonl"


def load_prompts(n: int) -> list[str]:
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()]
    return [rows[i % len(rows)]["prompt"] for i in range(n)]




def make_direct_engine(engine_cfg: dict):
    """The in-process reference engine (``AsyncLLMEngine``), built once per run."""
    from actors.engine.config import EngineConfig
    from actors.serve.app import resolve_engine_config
    from actors.serve.async_engine import AsyncLLMEngine

    return AsyncLLMEngine.from_config(EngineConfig(**resolve_engine_config(engine_cfg)))


def _timed(reqs: list[dict], wall: float) -> dict:
    return {"wall_s": wall, "requests": reqs,
            "tokens_per_s": sum(r["tokens"] for r in reqs) / wall}


async def run_direct(eng, prompts: list[str], max_tokens: int, tag: str) -> dict:
    """Concurrent requests straight into ``eng``; per request e2e / TTFT (ms), tokens,
    chunks (engine outputs that carried tokens)."""
    from actors.engine.types import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)

    async def one(i: int, prompt: str) -> dict:
        t0 = time.perf_counter()
        ttft, n, chunks = None, 0, 0
        async for out in eng.generate(f"{tag}-{i}", prompt, params):
            if out.new_token_ids and ttft is None:
                ttft = time.perf_counter() - t0
            chunks += bool(out.new_token_ids)
            n += len(out.new_token_ids)
        return {"e2e_ms": (time.perf_counter() - t0) * 1e3, "ttft_ms": (ttft or 0) * 1e3,
                "tokens": n, "chunks": chunks}

    await one(-1, "warm up")                      # first-call costs out of the timing
    t0 = time.perf_counter()
    reqs = await asyncio.gather(*[one(i, p) for i, p in enumerate(prompts)])
    return _timed(reqs, time.perf_counter() - t0)


async def stream_one(client, path: str, body: dict) -> dict:
    """One streaming completions call (``body`` as sent, ``stream`` on, usage asked for):
    e2e and TTFT (to the first chunk with text or token ids; ms), completion tokens
    (the server's ``usage``), content chunks."""
    body = dict(body, stream=True, stream_options={"include_usage": True})
    t0 = time.perf_counter()
    ttft, n, chunks = None, 0, 0
    async with client.stream("POST", path, json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                n = chunk["usage"]["completion_tokens"]
            elif chunk["choices"] and (chunk["choices"][0].get("token_ids")
                                       or chunk["choices"][0].get("text")):
                chunks += 1
                if ttft is None:
                    ttft = time.perf_counter() - t0
    return {"e2e_ms": (time.perf_counter() - t0) * 1e3, "ttft_ms": (ttft or 0) * 1e3,
            "tokens": n, "chunks": chunks}


async def run_http(base: str, model: str, prompts: list[str], max_tokens: int,
                   path: str = "/v1/completions", stream_interval: int | None = None,
                   stream_interval_ms: float | None = None) -> dict:
    """The same requests as concurrent streaming completions calls to ``base + path``
    (``stream_interval`` / ``stream_interval_ms``: the body fields, when not None)."""
    import httpx

    async def one(client, prompt: str) -> dict:
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True}
        if stream_interval is not None:
            body["stream_interval"] = stream_interval
        if stream_interval_ms is not None:
            body["stream_interval_ms"] = stream_interval_ms
        return await stream_one(client, path, body)

    limits = httpx.Limits(max_connections=len(prompts) + 4)
    async with httpx.AsyncClient(base_url=base, timeout=600, limits=limits) as client:
        await one(client, "warm up")
        t0 = time.perf_counter()
        reqs = await asyncio.gather(*[one(client, p) for p in prompts])
        return _timed(reqs, time.perf_counter() - t0)


def serve_app(engine_cfg: dict, strategy: str, num_cpus: int,
              tuned: bool = True, engine_process: bool | str = "auto",
              direct_ingress: bool = False) -> tuple[str, object]:
    """A local Ray + Serve with ``strategy`` in the one-hop layout (its own application
    at ``/strategies/<name>`` and the model-field ingress at ``/``); ``engine_process``
    as the strategy entry's; ``direct_ingress``: with Serve's direct ingress (as ``cluster
    up --direct-ingress``); returns (base URL, the ray module)."""
    import ray
    from ray import serve

    from actors.serve.app import run_applications
    from configs.serve_config import DIRECT_INGRESS_ENV, PROXY_ENV, REPLICA_ENV

    if tuned:   # as `python -m cluster up`: the local Ray (and its Serve proxy) inherit it
        for k, v in PROXY_ENV.items():
            os.environ.setdefault(k, v)
    if direct_ingress:   # Serve's controller and replicas read it from the local Ray's env
        os.environ.update(DIRECT_INGRESS_ENV)
    for attempt in range(3):  # Ray gives a raylet 30 s to register; an overloaded box may not
        try:
            ray.init(address="local", num_cpus=num_cpus, include_dashboard=False,
                     log_to_driver=False)
            break
        except Exception as exc:  # only the start-up timeout is retried
            ray.shutdown()
            if "timed out during startup" not in str(exc) or attempt == 2:
                raise
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    rt = {"env_vars": dict(REPLICA_ENV) if tuned else {}}
    run_applications({"strategies": [{"name": strategy, "engine": engine_cfg,
                                      "engine_process": engine_process,
                                      "ray_actor_options": {"num_cpus": 0.5, "runtime_env": rt}}],
                      "ingress": {"ray_actor_options": {"num_cpus": 0.1, "runtime_env": rt}}},
                     name="bench", route_prefix="/")
    return f"http://127.0.0.1:{port}", ray


def _median(xs: list[float]) -> float:
    return round(statistics.median(xs), 3) if xs else float("nan")


DIRECT, MODEL_FIELD, STRATEGY_ROUTE = "direct", "model_field", "strategy_route"
DIRECT_INGRESS = "direct_ingress"   # the strategy route on the replica's own listener


def summarize(runs: dict[tuple[int, str], list[dict]], concs: list[int],
              ways: list[str]) -> dict[str, dict]:
    """Per concurrency (str) and served way: medians over the repetitions of tokens/s, of
    the ratio to the same repetition's direct run, of TTFT / e2e added (served - direct,
    ms, matched by prompt) and of chunks per request; and the direct tokens/s."""
    per_c: dict[str, dict] = {}
    for c in concs:
        direct = runs[(c, DIRECT)]
        out: dict = {"direct_tokens_per_s": _median([r["tokens_per_s"] for r in direct])}
        for way in ways:
            if way == DIRECT:
                continue
            served = runs[(c, way)]
            pairs = list(zip(served, direct))
            out[way] = {
                "tokens_per_s": _median([s["tokens_per_s"] for s in served]),
                "ratio": _median([s["tokens_per_s"] / d["tokens_per_s"] for s, d in pairs]),
                "ttft_added_ms_p50": _median([sr["ttft_ms"] - dr["ttft_ms"] for s, d in pairs
                                              for sr, dr in zip(s["requests"], d["requests"])]),
                "e2e_added_ms_p50": _median([sr["e2e_ms"] - dr["e2e_ms"] for s, d in pairs
                                             for sr, dr in zip(s["requests"], d["requests"])]),
                "chunks_per_request": _median([r["chunks"] for s in served
                                               for r in s["requests"]])}
        per_c[str(c)] = out
    return per_c


def _build_parser() -> argparse.ArgumentParser:
    """The command's parser (flags and help exactly as ``--help`` shows them)."""
    ap = argparse.ArgumentParser(prog="python -m bench.serving_overhead", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--strategy", default="autoregressive")
    ap.add_argument("--concurrency", default="4,16",
                    help="comma-separated concurrent requests (4 = the mid tier's users)")
    ap.add_argument("--max-tokens", type=number(int, ge=1), default=128)
    ap.add_argument("--reps", type=number(int, ge=1), default=3, help="interleaved repetitions (median)")
    ap.add_argument("--waves", type=number(int, ge=1), default=5,
                    help="waves of --concurrency requests per measurement, interleaved "
                         "wave by wave with the other ways' (one wave of 4 x 64 tokens "
                         "lasts ~0.3 s here: too short to time alone on a shared box)")
    ap.add_argument("--settle-s", type=number(float, ge=0), default=0.25,
                    help="idle seconds before each wave: the work a wave leaves behind "
                         "(the replica's step-row flush, Serve's logs and metrics) does not "
                         "land on the next wave, which may be another way's")
    ap.add_argument("--stream-intervals", default="1",
                    help="stream_interval values measured on the strategy route as request "
                         "fields (1: one chunk per engine step, vLLM's streaming)")
    ap.add_argument("--stream-intervals-ms", default="",
                    help="stream_interval_ms values measured on the strategy route as request "
                         "fields (a chunk per window)")
    ap.add_argument("--num-speculative-tokens", type=number(int, ge=0), default=4)
    ap.add_argument("--torch-threads", type=number(int, ge=1), default=1)
    ap.add_argument("--num-cpus", type=number(int, ge=1), default=2, help="CPUs of the local Ray")
    ap.add_argument("--engine-process", choices=("auto", "true", "false"), default="auto",
                    help="the served replica's engine in its own process (true), on a "
                         "thread (false), or by the cores (auto; the deployments' default)")
    ap.add_argument("--no-serve-tuning", action="store_true",
                    help="Serve's defaults instead of configs/serve.yaml's env_vars and "
                         "cluster up's proxy environment (configs.serve_config.PROXY_ENV)")
    ap.add_argument("--no-direct-ingress", action="store_true",
                    help="leave out the direct_ingress way (Serve's direct ingress off)")
    ap.add_argument("--enforce-eager", action="store_true",
                    help="no torch.compile of the engine's forward (the engine's default "
                         "when not set here: this bench compiles, as vLLM does)")
    ap.add_argument("--json", type=output_file(), default=None, help="write the result here")
    return ap


def _parse(argv: list[str] | None) -> tuple[argparse.Namespace, list[int], list[int],
                                            list[float]]:
    """Parse and check the flags; return (args, concurrencies, stream intervals, windows (ms)).
    A bad list or unknown strategy exits 2 through ``ap.error``."""
    ap = _build_parser()
    a = ap.parse_args(argv)
    try:
        concs = [int(c) for c in a.concurrency.split(",") if c.strip()]
    except ValueError:
        ap.error(f"--concurrency: expected comma-separated integers, got {a.concurrency!r}")
    try:
        intervals = [int(c) for c in a.stream_intervals.split(",") if c.strip()]
    except ValueError:
        ap.error(f"--stream-intervals: expected comma-separated integers, got "
                 f"{a.stream_intervals!r}")
    try:
        windows = [float(c) for c in a.stream_intervals_ms.split(",") if c.strip()]
    except ValueError:
        ap.error(f"--stream-intervals-ms: expected comma-separated numbers, got "
                 f"{a.stream_intervals_ms!r}")
    if windows and not all(0 < w <= 60_000 for w in windows):
        ap.error("--stream-intervals-ms: give values in (0, 60000]")
    if not concs or min(concs) < 1:
        ap.error("--concurrency: give values >= 1")
    if intervals and min(intervals) < 1:
        ap.error("--stream-intervals: give values >= 1")
    if a.strategy not in STRATEGIES:
        ap.error(f"argument --strategy: unknown strategy {a.strategy!r}; expected one of "
                 f"{', '.join(STRATEGIES)}")
    return a, concs, intervals, windows


def _run_way(way: str, eng, base: str, own: str, a: argparse.Namespace, prompts: list[str],
             tag: str, listener: str = "") -> dict:
    """One measurement of one way (direct engine, strategy route at an interval, model field,
    the strategy route on the replica's own ``listener``)."""
    if way == DIRECT:
        return asyncio.run(run_direct(eng, prompts, a.max_tokens, tag))
    if way == DIRECT_INGRESS:
        return asyncio.run(run_http(listener, a.strategy, prompts, a.max_tokens, own))
    if way == MODEL_FIELD:
        return asyncio.run(run_http(base, a.strategy, prompts, a.max_tokens))
    si = int(way.rsplit("_si", 1)[1]) if "_si" in way else None
    ms = float(way.rsplit("_ms", 1)[1]) if "_ms" in way else None
    return asyncio.run(run_http(base, a.strategy, prompts, a.max_tokens, own, si, ms))


def _measure(a: argparse.Namespace, concs: list[int], ways: list[str],
             engine_cfg: dict) -> dict[tuple[int, str], list[dict]]:
    """Start the direct engine and the local Serve app, run ``--reps`` interleaved repetitions
    of every way at every concurrency, shut both down; return the runs by (users, way).

    A repetition's measurement of a way is ``--waves`` waves, interleaved with the other
    ways' wave by wave (the order rotated per wave), so that the box's drift over seconds
    falls on every way alike; its tokens/s is over all its waves. Each wave starts after
    ``--settle-s`` idle seconds."""
    import torch

    from actors.serve.app import strategy_route

    torch.set_num_threads(a.torch_threads)  # the direct runs share this process, as a replica would
    own = strategy_route(a.strategy) + "/v1/completions"
    runs: dict[tuple[int, str], list[dict]] = {}
    eng = make_direct_engine(engine_cfg)
    engine_process = {"auto": "auto", "true": True, "false": False}[a.engine_process]
    base, ray = serve_app(engine_cfg, a.strategy, a.num_cpus, not a.no_serve_tuning,
                          engine_process, DIRECT_INGRESS in ways)
    listener = ""
    try:
        if DIRECT_INGRESS in ways:
            from actors.serve.openai_api import direct_ingress_urls

            urls = asyncio.run(direct_ingress_urls({a.strategy: strategy_route(a.strategy)}))
            if len(urls.get(a.strategy, [])) != 1:
                raise SystemExit(f"bench.serving_overhead: Serve's direct ingress listed {urls or 'nothing'} "
                                 f"for {a.strategy}; run with --no-direct-ingress")
            listener = urls[a.strategy][0]
        for rep in range(a.reps):
            for c in concs:
                prompts = load_prompts(c)
                waves: dict[str, list[dict]] = {way: [] for way in ways}
                for w in range(a.waves):
                    k = (rep * a.waves + w) % len(ways)
                    for way in ways[k:] + ways[:k]:           # no way always first
                        time.sleep(a.settle_s)   # each wave from an idle service
                        waves[way].append(_run_way(way, eng, base, own, a, prompts,
                                                   f"r{rep}c{c}w{w}", listener))
                for way in ways:
                    res = _timed([r for wave in waves[way] for r in wave["requests"]],
                                 sum(wave["wall_s"] for wave in waves[way]))
                    runs.setdefault((c, way), []).append(res)
                    print(f"rep {rep + 1}/{a.reps} users {c:>3} {way:<20} "
                          f"{res['tokens_per_s']:8.1f} output tokens/s", flush=True)
    finally:
        from ray import serve

        eng.shutdown()
        serve.shutdown()
        ray.shutdown()
    return runs


def _result(a: argparse.Namespace, concs: list[int], per_c: dict) -> dict:
    """The result document: per way, the worst concurrency's ratio and TTFT added (ms); the
    headline (``ratio``, ``ttft_added_ms_p50``, ``route``) is the load generator's default
    route: the replica's own listener (direct ingress, on in ``cluster up`` by default)
    when measured, else the strategy route through the Serve proxy."""
    ways = {"": STRATEGY_ROUTE, "_strategy_route": STRATEGY_ROUTE, "_model_field": MODEL_FIELD,
            "_direct_ingress": DIRECT_INGRESS}
    if DIRECT_INGRESS in per_c[str(concs[0])]:
        ways[""] = DIRECT_INGRESS
    else:
        del ways["_direct_ingress"]
    out: dict = {
        "strategy": a.strategy, "max_tokens": a.max_tokens, "reps": a.reps, "waves": a.waves,
        "settle_s": a.settle_s, "engine_process": a.engine_process, "concurrency": concs,
        "route": "direct" if ways[""] == DIRECT_INGRESS else "strategy"}
    for suffix, way in ways.items():
        out[f"ratio{suffix}"] = min(per_c[str(c)][way]["ratio"] for c in concs)
        out[f"ttft_added_ms_p50{suffix}"] = max(per_c[str(c)][way]["ttft_added_ms_p50"]
                                                for c in concs)
    out["by_concurrency"] = per_c
    out["note"] = ("medians of interleaved repetitions; ratio / ttft_added_ms_p50: the worst "
                   "concurrency on the load generator's default route (route: direct = the "
                   "replica's own listener, Serve's direct ingress, no proxy; strategy = the "
                   "strategy route through the Serve proxy) with the deployment's default "
                   "chunking (configs.serve_config.DEFAULT_STREAM_INTERVAL_MS); "
                   "*_strategy_route / *_model_field / *_direct_ingress: each way's own; "
                   "strategy_route_si1: one chunk per engine step")
    return out


def _print_outcome(result: dict, per_c: dict, concs: list[int], ways: list[str]) -> None:
    """Print per concurrency and way tokens/s, ratio, TTFT/e2e added (ms); then the summary."""
    for c in concs:
        o = per_c[str(c)]
        print(f"users {c}: direct {o['direct_tokens_per_s']:.1f} output tokens/s")
        for way in ways[1:]:
            w = o[way]
            print(f"  {way:<20} {w['tokens_per_s']:8.1f} tok/s  ratio {w['ratio']:.3f}  "
                  f"TTFT added p50 {w['ttft_added_ms_p50']:.1f} ms  e2e added p50 "
                  f"{w['e2e_added_ms_p50']:.1f} ms  chunks/request {w['chunks_per_request']:.0f}")
    print(f"ratio served/direct, worst concurrency, the load generator's default route "
          f"({result['route']}): {result['ratio']:.3f}, TTFT added p50 "
          f"{result['ttft_added_ms_p50']:.1f} ms; strategy route through the Serve proxy "
          f"{result['ratio_strategy_route']:.3f}, model-field route "
          f"{result['ratio_model_field']:.3f}")
    print(json.dumps({k: result[k] for k in ("route", "ratio", "ttft_added_ms_p50",
                                             "ratio_strategy_route", "ratio_model_field",
                                             "ratio_direct_ingress") if k in result}))


def main(argv: list[str] | None = None) -> int:
    a, concs, intervals, windows = _parse(argv)
    use_loopback_env()   # its private Ray on 127.0.0.1 only (before anything imports Ray)
    engine_cfg = {"strategy": a.strategy, "max_num_seqs": max(concs),
                  "torch_threads": a.torch_threads, "enforce_eager": a.enforce_eager,
                  "num_speculative_tokens": 0 if a.strategy == "autoregressive"
                  else a.num_speculative_tokens}
    ways = ([DIRECT, STRATEGY_ROUTE, MODEL_FIELD] + ([] if a.no_direct_ingress else [DIRECT_INGRESS])
            + [f"{STRATEGY_ROUTE}_si{i}" for i in sorted(set(intervals))]
            + [f"{STRATEGY_ROUTE}_ms{w:g}" for w in sorted(set(windows))])
    runs = _measure(a, concs, ways, engine_cfg)
    per_c = summarize(runs, concs, ways)
    result = _result(a, concs, per_c)
    if a.json:
        write_json(a.json, result)
    _print_outcome(result, per_c, concs, ways)
    return 0

if __name__ == "__main__":
    sys.exit(main())
