"""specload next to a real vLLM: same model, prompts, arrival pattern and client.

    python -m bench.vs_vllm [--mode engine|served|both] [--quick]
                                   [--strategies autoregressive,ngram,draft_model]
                                   [--concurrency 1,4,16] [--duration-s 10] [--reps 3]
                                   [--max-tokens 32] [--vllm-threads 1] [--json out.json]

The load generator's closed-loop cell (``configs/tiers.yaml``, ``short``): N users,
each with one request in flight, each finished request replaced at once by the next
prompt (the load generator's ``mixed`` corpus: held-out HumanEval, Python docs and
stdlib prompts, cut to 1200 characters), greedy, 32-token outputs (EOS may end one
sooner, as in the cells). Two ways, each for specload and for vLLM 0.32 (its CPU
build, in its own venv: ``$SPECLOAD_VLLM_PYTHON`` or ``.venv-vllm/bin/python``), the
same fp32 target (``models/target``), ngram (k 4, n-gram 2..4) and draft_model (k 4,
``models/draft``) as in ``cluster/vllm_server.py``:

- ``engine``: the engine alone, no HTTP: specload's ``LLMEngine`` and vLLM's offline
  ``LLMEngine``, each in a worker process of its own (``bench/closed_loop_worker.py``);
  tells engine losses from serving losses.
- ``served``: the whole stack over HTTP with this module's client (streamed
  ``/v1/completions``, ``bench.serving_overhead.stream_one``): specload's Ray Serve
  (``python -m cluster up``'s layout) on the load generator's default route, the
  strategy route on its replica's own listener (Serve's direct ingress; ``--route
  strategy``: through the Serve proxy), and vLLM's OpenAI server.

Per strategy x concurrency: output tokens/s, TTFT p50 and TPOT p50 (ms; TPOT = (e2e
- TTFT) / (tokens - 1)) of each side and the ratios specload / vLLM (tokens/s:
higher is better for specload; TTFT and TPOT: lower is), medians of ``--reps``
repetitions interleaved (each repetition runs every side at every concurrency, the
side order rotated per repetition). ``--quick``: 3 s cells, 2 repetitions. One
torch thread per engine (``--vllm-threads`` for vLLM's, ``OMP_NUM_THREADS``); a
2-core box is noisy: read the ratios, not the absolute figures.
``--baseline-repo DIR`` adds the engine of another checkout (say, main) as a third
side in the ``engine`` mode (before / after a change, same run).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from configs.cli_args import number, output_file
from configs.jsonio import write_json
from configs.paths import PROMPTS_DIR

REPO = Path(__file__).resolve().parent.parent
TARGET = REPO / "models" / "target"
DRAFT = REPO / "models" / "draft"
WORKER = Path(__file__).resolve().parent / "closed_loop_worker.py"
STRATEGIES = ("autoregressive", "ngram", "draft_model")
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
         "prompt_lookup_min": 2}
MAX_PROMPT_CHARS = 1200          # the cpu profile's max_prompt_chars
CORPUS = ("humaneval", "docs", "stdlib")
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1"}


def _truncate(text: str, max_chars: int) -> str:
    """As ``loadgen.run.datasets.truncate`` (this layer may not import the load generator)."""
    if len(text) <= max_chars:
        return text
    cut = text[:max_chars]
    nl = cut.rfind("\n")
    return cut[: nl + 1] if nl >= max_chars // 2 else cut


def load_prompts(max_chars: int = MAX_PROMPT_CHARS) -> list[str]:
    """The load generator's ``mixed`` dataset: the three committed prompt files
    interleaved round-robin, each prompt cut to ``max_chars``."""
    parts = [[json.loads(x)["prompt"] for x in (PROMPTS_DIR / f"{n}.jsonl").read_text(
        encoding="utf-8").splitlines() if x.strip()] for n in CORPUS]
    out = []
    for i in range(max(len(p) for p in parts)):
        out.extend(_truncate(p[i], max_chars) for p in parts if i < len(p))
    return out


def vllm_python() -> str | None:
    """The vLLM venv's interpreter, or None without one (``cluster.vllm_server``)."""
    from cluster.vllm_server import find_vllm_python

    try:
        return find_vllm_python()
    except FileNotFoundError:
        return None


def _p50(xs: list[float]) -> float:
    xs = [x for x in xs if x == x]
    return round(statistics.median(xs), 2) if xs else float("nan")


# ------------------------------------------------------------------ engine mode
class Worker:
    """One ``closed_loop_worker.py`` process (its engine loaded once), JSON lines both ways."""

    def __init__(self, side: str, python: str, engine: str, strategy: str, prompts_file: str,
                 threads: int, repo: Path | None = None, log_dir: str = ".",
                 prefix_caching: bool = True, enforce_eager: bool = False):
        cmd = [python, str(WORKER),
               "--engine", engine, "--strategy", strategy, "--model", str(TARGET),
               "--prompts", prompts_file, "--torch-threads", str(threads)]
        if strategy == "draft_model":
            cmd += ["--draft-model", str(DRAFT)]
        if not prefix_caching:
            cmd.append("--no-prefix-caching")
        if enforce_eager:
            cmd.append("--enforce-eager")
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        env["OMP_NUM_THREADS"] = str(threads)
        if engine == "vllm":
            env.update(VLLM_ENV)
        else:
            env["PYTHONPATH"] = str(repo or REPO)
            if repo is not None:
                env["SPECLOAD_BENCH_REPO"] = str(repo)
        self.side = side
        self.log = open(Path(log_dir) / f"worker-{side}-{strategy}.log", "wb")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, env=env, cwd=str(repo or REPO),
                                     start_new_session=True)
        self.ready = self._read()

    def _read(self) -> dict:
        """The next JSON object line of the worker (vLLM logs to stdout too)."""
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"{self.side} worker exited ({self.proc.wait()}); "
                                   f"see {self.log.name}")
            line = line.decode(errors="replace").strip()
            if line.startswith("{"):
                try:
                    return json.loads(line)
                except json.JSONDecodeError:
                    continue

    def run(self, cmd: dict) -> dict:
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(30)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()


def engine_mode(a: argparse.Namespace, strategy: str, prompts_file: str, log_dir: str
                ) -> dict[tuple[int, str], list[dict]]:
    """Reps x concurrencies x sides of one strategy, engines alone."""
    vpy = vllm_python()
    sides = [("specload", sys.executable, "specload", None)]
    if a.baseline_repo:
        sides.append(("baseline", sys.executable, "specload", Path(a.baseline_repo).resolve()))
    if vpy and not a.no_vllm:
        sides.append(("vllm", vpy, "vllm", None))
    workers = []
    try:
        for side, py, eng, repo in sides:
            print(f"[engine] {strategy}: starting {side} worker", flush=True)
            workers.append(Worker(side, py, eng, strategy, prompts_file,
                                  a.vllm_threads if eng == "vllm" else a.torch_threads,
                                  repo, log_dir, not a.no_prefix_caching, a.enforce_eager))
        return _interleave(a, strategy, "engine", {
            w.side: (lambda users, tag, w=w: w.run({"users": users, "duration_s": a.duration_s,
                                                     "max_tokens": a.max_tokens, "tag": tag}))
            for w in workers})
    finally:
        for w in workers:
            w.close()


def _interleave(a: argparse.Namespace, strategy: str, mode: str, sides: dict
                ) -> dict[tuple[int, str], list[dict]]:
    runs: dict[tuple[int, str], list[dict]] = {}
    names = list(sides)
    for rep in range(a.reps):
        order = names[rep % len(names):] + names[:rep % len(names)]
        for c in a.concs:
            for side in order:
                res = sides[side](c, f"{strategy}-r{rep}-c{c}")
                runs.setdefault((c, side), []).append(res)
                print(f"[{mode}] {strategy:<14} rep {rep + 1}/{a.reps} users {c:>3} "
                      f"{side:<9} {res['tokens_per_s']:8.1f} tok/s  TTFT p50 "
                      f"{res['ttft_ms_p50']:7.1f} ms  TPOT p50 {res['tpot_ms_p50']:6.2f} ms"
                      + (f"  {res['errors']} failed requests ({res['first_error']})"
                         if res.get("errors") else ""), flush=True)
    return runs


# ------------------------------------------------------------------ served mode
async def closed_loop_http(base: str, path: str, model: str, prompts: list[str], users: int,
                           duration_s: float, max_tokens: int, warmup_s: float = 1.0,
                           extra_body: dict | None = None) -> dict:
    """N streaming users against ``base + path`` (``bench.serving_overhead.stream_one``), each
    request replaced at once; the window after ``warmup_s`` is counted (tokens of the
    requests that finished in it, over its length; TTFT / TPOT of those requests).
    ``extra_body``: more request fields (e.g. ``{"stream_interval": 1}``)."""
    import httpx

    from bench.serving_overhead import stream_one

    nxt = iter(range(10 ** 9))
    t_begin = time.perf_counter()
    w0, w1 = t_begin + warmup_s, t_begin + warmup_s + duration_s
    done: list[dict] = []
    errors: list[str] = []

    async def user(client) -> None:
        while time.perf_counter() < w1:
            i = next(nxt)
            t0 = time.perf_counter()
            try:
                r = await stream_one(client, path, {"model": model,
                                                    "prompt": prompts[i % len(prompts)],
                                                    "max_tokens": max_tokens, "temperature": 0,
                                                    **(extra_body or {})})
            except (httpx.HTTPError, ValueError) as exc:   # this request only: counted
                errors.append(f"{type(exc).__name__}: {exc}"[:200])
                await asyncio.sleep(0.05)      # a dead server: no tight loop till the end
                continue
            if t0 >= w0 and time.perf_counter() <= w1:
                done.append(r)

    limits = httpx.Limits(max_connections=users + 4)
    async with httpx.AsyncClient(base_url=base, timeout=600, limits=limits) as client:
        await stream_one(client, path, {"model": model, "prompt": "warm up", "max_tokens": 4,
                                        "temperature": 0})
        t_begin = time.perf_counter()
        w0, w1 = t_begin + warmup_s, t_begin + warmup_s + duration_s
        await asyncio.gather(*[user(client) for _ in range(users)])
    return {"users": users, "tokens_per_s": round(sum(r["tokens"] for r in done) / duration_s, 1),
            "ttft_ms_p50": _p50([r["ttft_ms"] for r in done]),
            "tpot_ms_p50": _p50([(r["e2e_ms"] - r["ttft_ms"]) / (r["tokens"] - 1)
                                 for r in done if r["tokens"] > 1]),
            "requests": len(done), "errors": len(errors),
            **({"first_error": errors[0]} if errors else {})}


def _vllm_server(strategy: str, threads: int, log_dir: str, prefix_caching: bool = True,
                 enforce_eager: bool = False):
    """A vLLM OpenAI server for ``strategy`` (``cluster.vllm_server``)."""
    from cluster.vllm_server import DRAFT_MODEL, NGRAM as T_NGRAM, VllmServer

    spec = {"ngram": T_NGRAM, "draft_model": DRAFT_MODEL}.get(strategy)
    os.environ["OMP_NUM_THREADS"] = str(threads)      # the server inherits it
    srv = VllmServer([strategy], spec,
                     extra=([] if prefix_caching else ["--no-enable-prefix-caching"])
                     + (["--enforce-eager"] if enforce_eager else []))
    srv.launch(vllm_python(), Path(log_dir))
    return srv


def served_mode(a: argparse.Namespace, strategy: str, prompts: list[str], log_dir: str
                ) -> dict[tuple[int, str], list[dict]]:
    """specload's strategy route (local Ray Serve) and a vLLM server, both up at once."""
    from bench.serving_overhead import serve_app
    from actors.serve.app import strategy_route

    srv = None
    if vllm_python() and not a.no_vllm:
        srv = _vllm_server(strategy, a.vllm_threads, log_dir,        # warms up meanwhile
                           not a.no_prefix_caching, a.enforce_eager)
    engine_cfg = {"strategy": strategy, "max_num_seqs": 32, "max_waiting": 256,
                  "torch_threads": a.torch_threads,
                  "enable_prefix_caching": not a.no_prefix_caching,
                  "enforce_eager": a.enforce_eager,
                  "num_speculative_tokens": 0 if strategy == "autoregressive" else 4}
    if strategy == "draft_model":
        engine_cfg["draft_model"] = "models/draft"
    print(f"[served] {strategy}: starting Ray Serve (and vLLM)", flush=True)
    base, ray = serve_app(engine_cfg, strategy, 2, direct_ingress=a.route == "direct")
    try:
        own = strategy_route(strategy)
        if a.route == "direct":   # the load generator's default: the replica's own listener
            from actors.serve.openai_api import direct_ingress_urls

            urls = asyncio.run(direct_ingress_urls({strategy: own}))
            if len(urls.get(strategy, [])) != 1:
                raise SystemExit(f"bench.vs_vllm: Serve's direct ingress listed {urls or 'nothing'}"
                                 f" for {strategy}; run with --route strategy")
            base = urls[strategy][0]
        extra = {"stream_interval": 1} if a.per_step_chunks else None
        sides = {"specload": lambda users, tag: asyncio.run(closed_loop_http(
            base, own + "/v1/completions", strategy, prompts, users,
            a.duration_s, a.max_tokens, extra_body=extra))}
        if srv is not None:
            srv.wait_ready()
            sides["vllm"] = lambda users, tag: asyncio.run(closed_loop_http(
                srv.url, "/v1/completions", strategy, prompts, users, a.duration_s,
                a.max_tokens))
        return _interleave(a, strategy, "served", sides)
    finally:
        from ray import serve

        serve.shutdown()
        ray.shutdown()
        if srv is not None:
            srv.stop()


# ------------------------------------------------------------------ summary
def summarize(runs: dict[tuple[int, str], list[dict]], concs: list[int]) -> dict:
    """Per concurrency: each side's medians; specload / vLLM ratios (medians of the
    per-repetition ratios) when both sides ran; specload / baseline likewise."""
    out: dict = {}
    for c in concs:
        row: dict = {}
        for (cc, side), rs in runs.items():
            if cc == c:
                row[side] = {k: _p50([r[k] for r in rs])
                             for k in ("tokens_per_s", "ttft_ms_p50", "tpot_ms_p50")}
        for other in ("vllm", "baseline"):
            if (c, other) in runs and (c, "specload") in runs:
                pairs = list(zip(runs[(c, "specload")], runs[(c, other)]))
                row[f"vs_{other}"] = {k: _p50([s[k] / o[k] for s, o in pairs if o[k]])
                                      for k in ("tokens_per_s", "ttft_ms_p50", "tpot_ms_p50")}
        out[str(c)] = row
    return out


def print_table(result: dict) -> None:
    for mode, per_s in result["results"].items():
        print(f"\n== {mode}: specload vs vLLM (medians of {result['reps']}; ratio = "
              "specload / vLLM) ==")
        print(f"{'strategy':<15}{'users':>5} {'tok/s spec':>11} {'vLLM':>8} {'ratio':>6}  "
              f"{'TTFT spec':>9} {'vLLM':>7} {'ratio':>6}  {'TPOT spec':>9} {'vLLM':>6} "
              f"{'ratio':>6}")
        for strategy, per_c in per_s.items():
            for c, row in per_c.items():
                s, v, r = row.get("specload", {}), row.get("vllm", {}), row.get("vs_vllm", {})
                f = (lambda d, k, w, p=1: f"{d[k]:{w}.{p}f}" if k in d else " " * (w - 1) + "-")
                print(f"{strategy:<15}{c:>5} {f(s, 'tokens_per_s', 11)} {f(v, 'tokens_per_s', 8)} "
                      f"{f(r, 'tokens_per_s', 6, 2)}  {f(s, 'ttft_ms_p50', 9)} "
                      f"{f(v, 'ttft_ms_p50', 7)} {f(r, 'ttft_ms_p50', 6, 2)}  "
                      f"{f(s, 'tpot_ms_p50', 9, 2)} {f(v, 'tpot_ms_p50', 6, 2)} "
                      f"{f(r, 'tpot_ms_p50', 6, 2)}")
                if "vs_baseline" in row:
                    b = row["vs_baseline"]
                    print(f"{'':<15}{'':>5} specload / baseline: tok/s "
                          f"{b['tokens_per_s']:.2f}, TTFT {b['ttft_ms_p50']:.2f}, TPOT "
                          f"{b['tpot_ms_p50']:.2f} (baseline {row['baseline']['tokens_per_s']:.1f} tok/s)")


def _build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.vs_vllm", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=("engine", "served", "both"), default="both")
    ap.add_argument("--strategies", default=",".join(STRATEGIES),
                    help=f"comma-separated, of {', '.join(STRATEGIES)}")
    ap.add_argument("--concurrency", default="1,4,16", help="comma-separated users per cell")
    ap.add_argument("--duration-s", type=number(float, gt=0), default=10.0,
                    help="counted seconds per cell (after a 1 s warm-up)")
    ap.add_argument("--reps", type=number(int, ge=1), default=3, help="interleaved repetitions")
    ap.add_argument("--max-tokens", type=number(int, ge=1), default=32)
    ap.add_argument("--quick", action="store_true", help="3 s cells, 2 repetitions")
    ap.add_argument("--torch-threads", type=number(int, ge=1), default=1)
    ap.add_argument("--vllm-threads", type=number(int, ge=1), default=1,
                    help="vLLM's OMP / torch threads (its CPU build uses every core otherwise)")
    ap.add_argument("--no-prefix-caching", action="store_true",
                    help="both engines without prefix caching (vLLM's default, and this "
                         "bench's, is on: the cells repeat prompts, as the load generator's do)")
    ap.add_argument("--enforce-eager", action="store_true",
                    help="both engines without torch.compile (vLLM's enforce_eager; the "
                         "default, vLLM's, is compiled: ~1 min of compiling per engine)")
    ap.add_argument("--no-vllm", action="store_true", help="specload only (no vLLM venv needed)")
    ap.add_argument("--route", choices=("direct", "strategy"), default="direct",
                    help="served mode: specload's strategy route on its replica's own listener "
                         "(Serve's direct ingress; python -m loadgen's default route) or "
                         "through the Serve proxy")
    ap.add_argument("--per-step-chunks", action="store_true",
                    help="served: specload streams one chunk per engine step, as vLLM does "
                         "(request field stream_interval: 1), instead of its default 50 ms "
                         "window")
    ap.add_argument("--baseline-repo", default=None,
                    help="engine mode: also run the engine of this checkout (e.g. main)")
    ap.add_argument("--json", type=output_file(), default=None, help="write the result here")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = _build_parser()
    a = ap.parse_args(argv)
    try:
        a.concs = [int(c) for c in a.concurrency.split(",") if c.strip()]
    except ValueError:
        ap.error(f"--concurrency: expected comma-separated integers, got {a.concurrency!r}")
    if not a.concs or min(a.concs) < 1:
        ap.error("--concurrency: give values >= 1")
    strategies = [s.strip() for s in a.strategies.split(",") if s.strip()]
    bad = [s for s in strategies if s not in STRATEGIES]
    if bad or not strategies:
        ap.error(f"--strategies: expected some of {', '.join(STRATEGIES)}, got {a.strategies!r}")
    if a.quick:
        a.duration_s, a.reps = min(a.duration_s, 3.0), min(a.reps, 2)
    if vllm_python() is None and not a.no_vllm:
        print("no vLLM venv (.venv-vllm/bin/python or $SPECLOAD_VLLM_PYTHON): specload only",
              file=sys.stderr)
    prompts = load_prompts()
    modes = ["engine", "served"] if a.mode == "both" else [a.mode]
    from configs.net import use_loopback_env

    use_loopback_env()   # the served mode's private Ray on 127.0.0.1 only (before Ray is imported)
    result: dict = {"reps": a.reps, "duration_s": a.duration_s, "max_tokens": a.max_tokens,
                    "concurrency": a.concs, "load_avg_start": os.getloadavg(),
                    "specload_route": a.route,
                    "specload_chunks": "per engine step" if a.per_step_chunks
                    else "the deployment's default (50 ms window)", "results": {}}
    with tempfile.TemporaryDirectory(prefix="bench-vs-vllm-") as tmp:
        pf = str(Path(tmp) / "prompts.jsonl")
        Path(pf).write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
        for mode in modes:
            per_s = {}
            for strategy in strategies:
                runs = (engine_mode(a, strategy, pf, tmp) if mode == "engine"
                        else served_mode(a, strategy, prompts, tmp))
                per_s[strategy] = summarize(runs, a.concs)
            result["results"][mode] = per_s
    result["load_avg_end"] = os.getloadavg()
    print_table(result)
    print(f"\nload average at start / end: {result['load_avg_start'][0]:.2f} / "
          f"{result['load_avg_end'][0]:.2f}")
    if a.json:
        write_json(a.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
