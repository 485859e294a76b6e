"""One engine, no HTTP, under the load generator's closed-loop arrival pattern.

    python bench/closed_loop_worker.py --engine specload|vllm --strategy autoregressive
                                       --prompts FILE.jsonl --model DIR [--draft-model DIR]

A worker process: it loads one engine once (specload's ``LLMEngine`` in this process,
or vLLM's offline ``LLMEngine`` when run with vLLM's interpreter), then reads one JSON
command per line on stdin, ``{"users": N, "duration_s": S, "max_tokens": 32, "tag": T}``,
and answers one JSON line on stdout per command: N users, each with one request in
flight, each finished request replaced at once by the next prompt (the loadgen's
closed-loop cell, greedy, real prompts, no ``ignore_eos``), for ``duration_s`` seconds
after a short warm-up; output tokens/s over the window and TTFT / TPOT p50 (ms) of the
requests that started and finished inside it. ``bench.vs_vllm`` drives it.

It imports nothing from specload at module level (vLLM's venv does not have it); the
specload adapter puts the repository on ``sys.path`` itself.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

# the checkout whose engine runs: this one, or $SPECLOAD_BENCH_REPO (another checkout, e.g.
# main, for a before / after comparison in one run)
REPO = os.environ.get("SPECLOAD_BENCH_REPO") or os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
         "prompt_lookup_min": 2}


class SpecloadAdapter:
    """specload's ``LLMEngine`` in this process (one torch thread, as a replica)."""

    def __init__(self, strategy: str, model: str, draft_model: str | None, threads: int,
                 prefix_caching: bool = True, enforce_eager: bool = False):
        if REPO not in sys.path:
            sys.path.insert(0, REPO)
        import torch

        from actors.engine.config import EngineConfig
        from actors.engine.llm_engine import LLMEngine
        from actors.engine.types import SamplingParams

        torch.set_num_threads(threads)
        cfg = {"strategy": strategy, "model": model, "max_num_seqs": 64, "max_waiting": 1024,
               "num_speculative_tokens": 0 if strategy == "autoregressive" else 4}
        if draft_model:
            cfg["draft_model"] = draft_model
        if "enable_prefix_caching" in EngineConfig.model_fields:   # (an older checkout: none)
            cfg["enable_prefix_caching"] = prefix_caching
        if "enforce_eager" in EngineConfig.model_fields:           # (an older checkout: eager)
            cfg["enforce_eager"] = enforce_eager
        self.engine = LLMEngine(EngineConfig(**cfg))
        self._params = SamplingParams
        self.threads = torch.get_num_threads()

    def add(self, rid: str, prompt: str, max_tokens: int) -> None:
        self.engine.add_request(rid, prompt, self._params(max_tokens=max_tokens, temperature=0.0))

    def step(self) -> list[tuple[str, int, bool]]:
        return [(o.request_id, len(o.new_token_ids), o.finished) for o in self.engine.step()]

    def abort(self, rid: str) -> None:
        self.engine.abort_request(rid)


class VllmAdapter:
    """vLLM's offline ``LLMEngine`` (its V1 engine core in this process)."""

    def __init__(self, strategy: str, model: str, draft_model: str | None, threads: int,
                 prefix_caching: bool = True, enforce_eager: bool = False):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import EngineArgs, LLMEngine, SamplingParams

        spec = None
        if strategy == "ngram":
            spec = dict(NGRAM)
        elif strategy == "draft_model":
            spec = {"method": "draft_model", "model": draft_model, "num_speculative_tokens": 4}
        kw = {"model": model, "dtype": "float32", "max_model_len": 1024,
              "enable_prefix_caching": prefix_caching, "enforce_eager": enforce_eager}
        if spec is not None:
            kw["speculative_config"] = spec
        self.engine = LLMEngine.from_engine_args(EngineArgs(**kw))
        self._params = SamplingParams
        self._sent: dict[str, int] = {}
        import torch
        self.threads = torch.get_num_threads()

    def add(self, rid: str, prompt: str, max_tokens: int) -> None:
        self._sent[rid] = 0
        self.engine.add_request(rid, prompt, self._params(max_tokens=max_tokens, temperature=0.0))

    def step(self) -> list[tuple[str, int, bool]]:
        out = []
        for o in self.engine.step():
            n = len(o.outputs[0].token_ids) if o.outputs else 0
            new = n - self._sent.get(o.request_id, 0)
            self._sent[o.request_id] = n
            if o.finished:
                self._sent.pop(o.request_id, None)
            out.append((o.request_id, new, o.finished))
        return out

    def abort(self, rid: str) -> None:
        self._sent.pop(rid, None)
        self.engine.abort_request([rid])


def _p50(xs: list[float]) -> float:
    return round(statistics.median(xs), 2) if xs else float("nan")


def closed_loop(eng, prompts: list[str], users: int, duration_s: float, max_tokens: int,
                tag: str, warmup_s: float = 1.0) -> dict:
    """N users for ``warmup_s + duration_s``; counts the window after the warm-up."""
    nxt = [0]
    live: dict[str, dict] = {}

    def submit() -> None:
        i = nxt[0]
        nxt[0] += 1
        rid = f"{tag}-{i}"
        eng.add(rid, prompts[i % len(prompts)], max_tokens)
        live[rid] = {"t0": time.perf_counter(), "first": None, "n": 0}

    for _ in range(users):
        submit()
    t_begin = time.perf_counter()
    w0, w1 = t_begin + warmup_s, t_begin + warmup_s + duration_s
    tokens, ttft, tpot, done, steps = 0, [], [], 0, 0
    while True:
        outs = eng.step()
        now = time.perf_counter()
        if w0 <= now:
            steps += 1
        for rid, n, fin in outs:
            r = live.get(rid)
            if r is None:
                continue
            if n and r["first"] is None:
                r["first"] = now
            r["n"] += n
            if w0 <= now <= w1:
                tokens += n
            if fin:
                del live[rid]
                if r["t0"] >= w0 and now <= w1 and r["first"] is not None:
                    done += 1
                    ttft.append((r["first"] - r["t0"]) * 1e3)
                    if r["n"] > 1:
                        tpot.append((now - r["first"]) * 1e3 / (r["n"] - 1))
                if now < w1:
                    submit()
        if now >= w1:
            break
    for rid in list(live):
        eng.abort(rid)
    return {"users": users, "tokens_per_s": round(tokens / duration_s, 1),
            "ttft_ms_p50": _p50(ttft), "tpot_ms_p50": _p50(tpot), "requests": done,
            "steps_per_s": round(steps / duration_s, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench/closed_loop_worker.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", choices=("specload", "vllm"), required=True)
    ap.add_argument("--strategy", default="autoregressive")
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft-model", default=None)
    ap.add_argument("--prompts", required=True, help="JSON lines with a 'prompt' each")
    ap.add_argument("--torch-threads", type=int, default=1)
    ap.add_argument("--no-prefix-caching", action="store_true",
                    help="enable_prefix_caching=False (vLLM's default and this bench's: on)")
    ap.add_argument("--enforce-eager", action="store_true",
                    help="no torch.compile (vLLM's enforce_eager; this bench's default, as "
                         "vLLM's: compiled)")
    ap.add_argument("--once", default=None,
                    help="run this one JSON command and exit (instead of reading stdin)")
    a = ap.parse_args(argv)
    prompts = [json.loads(x)["prompt"] for x in open(a.prompts, encoding="utf-8") if x.strip()]
    cls = SpecloadAdapter if a.engine == "specload" else VllmAdapter
    eng = cls(a.strategy, a.model, a.draft_model, a.torch_threads, not a.no_prefix_caching,
              a.enforce_eager)
    closed_loop(eng, prompts, 2, 0.5, 8, "warm", warmup_s=0.0)    # first-call costs
    real_stdout = sys.stdout
    print(json.dumps({"ready": True, "threads": eng.threads}), file=real_stdout, flush=True)
    lines = [a.once] if a.once else sys.stdin
    for line in lines:
        if not line.strip():
            continue
        cmd = json.loads(line)
        res = closed_loop(eng, prompts, int(cmd["users"]), float(cmd["duration_s"]),
                          int(cmd.get("max_tokens", 32)), str(cmd.get("tag", "c")),
                          float(cmd.get("warmup_s", 1.0)))
        print(json.dumps(res), file=real_stdout, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
