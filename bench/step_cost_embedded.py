"""The embedded target's step-cost curve and the drafters' step costs, measured on the
real checkpoints (bfloat16 values: the packed-weight fast paths run, unlike
``bench.step_cost``'s random weights):

    python -m bench.step_cost_embedded [--context 256] [--passes 3] [--repeats 7] [--out F.json]

A point is one ``ModelRunner.run`` of ``batch`` rows x ``tokens_per_row`` tokens (all
logits, as a verify step asks), each row attending ``--context`` cached tokens; its value
is the median over ``--passes`` interleaved passes of the per-pass median of
``--repeats`` timed calls (the machine is shared: ratios measured side by side in one
process, never absolute times, are the result). Printed: the engine thread's CPU ms per
step (``time.thread_time``: no waits for a core; wall ms beside), CPU ms per token,
the ratio to the 1-token step of the same batch, the roof share (forward FLOPs of the
step, ``bench.engine_speedup.flops_per_token``, over the one-thread fp32 matmul FLOP/s measured
in the same run, ``bench.engine_speedup.matmul_roof``), the forward path that ran
(``ModelRunner.last_path``), and, with ``--strategies``, the engine's step-log table at
batch 1 (verify ms, draft ms, draft ms over the autoregressive step, ms per emitted
token and its ratio to autoregressive).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

B1_TOKENS = (1, 2, 3, 4, 5, 6, 8, 9, 12, 13, 16, 17, 20, 24, 32, 33, 48, 64, 96, 128, 192, 256)
B16_TOKENS = (1, 2, 3, 4, 5, 6, 8, 9, 12, 16)


def _time(fn, repeats: int) -> tuple[float, float]:
    """(median wall ms, median CPU ms of this thread) of ``repeats`` calls of ``fn`` after
    one untimed call. On a shared, loaded machine the CPU time is the cost without the
    waits for a core (the curve's ratios use it; the wall times are kept beside)."""
    fn()
    ts, cs = [], []
    for _ in range(repeats):
        t, c = time.perf_counter(), time.thread_time()
        fn()
        cs.append((time.thread_time() - c) * 1e3)
        ts.append((time.perf_counter() - t) * 1e3)
    return statistics.median(ts), statistics.median(cs)


def main(argv: list[str] | None = None) -> int:
    from configs.jsonio import write_json

    ap = argparse.ArgumentParser(prog="python -m bench.step_cost_embedded", description=__doc__.split("\n")[0])
    ap.add_argument("--context", type=int, default=256, help="cached tokens per row (default 256)")
    ap.add_argument("--passes", type=int, default=3, help="interleaved passes (median)")
    ap.add_argument("--repeats", type=int, default=7, help="timed calls per point and pass")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batches", default="1,16", help="batch sizes (1 and 16: their token grids)")
    ap.add_argument("--strategies", default="", help="also the engine's step-log table at "
                    "batch 1 for these strategies (comma-separated; autoregressive added)")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens per request (--strategies)")
    ap.add_argument("--prompts", type=int, default=4, help="requests per pass (--strategies)")
    ap.add_argument("--no-curve", action="store_true", help="skip the step-cost curve")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    if a.passes < 1 or a.repeats < 1 or a.context < 1:
        ap.error("--passes, --repeats and --context must be >= 1")
    torch.set_num_threads(a.threads)
    out = {} if a.no_curve else _curve(a)
    table = _strategy_table(a) if a.strategies else {}
    out.update(passes=a.passes, threads=a.threads, strategies=table, torch=torch.__version__)
    if a.out:
        write_json(a.out, out)
    return 0


def _curve(a) -> dict:
    """The step-cost curve (module docstring); printed, and returned as a dict."""
    from bench.engine_speedup import flops_per_token, matmul_roof
    from actors.engine.config import DEFAULT_TARGET
    from actors.engine.model import CausalLM
    from actors.engine.runner import ModelRunner, RowInput

    model = CausalLM.from_pretrained(DEFAULT_TARGET)
    batches = [int(b) for b in a.batches.split(",") if b]
    grid = [(b, q) for b in batches for q in (B1_TOKENS if b == 1 else B16_TOKENS)
            if a.context + q <= model.config.max_position_embeddings]
    runner = ModelRunner(model, num_slots=max(batches), max_len=a.context + max(q for _, q in grid))
    runs: dict[tuple[int, int], list[float]] = {}
    walls: dict[tuple[int, int], list[float]] = {}
    paths: dict[tuple[int, int], str] = {}
    roofs = []
    for p in range(a.passes):
        roofs.append(matmul_roof(a.threads)["flop_s"])
        for b, q in grid:
            rows = [RowInput(slot=i, start=a.context,
                             token_ids=[(7 * i + j) % 97 + 1 for j in range(q)]) for i in range(b)]
            wall, cpu = _time(lambda: runner.run(rows), a.repeats)
            runs.setdefault((b, q), []).append(cpu)
            walls.setdefault((b, q), []).append(wall)
            paths[(b, q)] = getattr(runner, "last_path", "?")
        print(f"pass {p + 1}/{a.passes} done", file=sys.stderr, flush=True)
    roof = statistics.median(roofs)
    fpt = flops_per_token(model, a.context)
    points = []
    print(f"one-thread fp32 matmul roof {roof / 1e9:.1f} GFLOP/s; {fpt / 1e6:.2f} MFLOP/token "
          f"at context {a.context}")
    print("CPU ms of the engine thread (wall ms beside); ratios per pass, then the median")
    print(f"{'batch':>5} {'tok/row':>7} {'tokens':>6} {'cpu ms':>8} {'wall ms':>8} {'ms/tok':>7} "
          f"{'x 1-tok':>7} {'roof %':>6}  path")
    for b, q in grid:
        ms = statistics.median(runs[(b, q)])
        per_pass = [x / y for x, y in zip(runs[(b, q)], runs.get((b, 1), runs[(b, q)]))]
        share = b * q * fpt / (ms / 1e3) / roof
        pt = {"batch_size": b, "tokens_per_row": q, "tokens": b * q, "step_cpu_ms": ms,
              "ms_per_token": ms / (b * q), "ratio_to_1_token": statistics.median(per_pass),
              "roof_share": share, "path": paths[(b, q)], "passes_cpu_ms": runs[(b, q)],
              "wall_ms": statistics.median(walls[(b, q)]), "passes_wall_ms": walls[(b, q)]}
        points.append(pt)
        print(f"{b:>5} {q:>7} {b * q:>6} {ms:>8.3f} {pt['wall_ms']:>8.3f} {ms / (b * q):>7.3f} "
              f"{pt['ratio_to_1_token']:>7.2f} {100 * share:>6.1f}  {pt['path']}")
    return {"context": a.context, "repeats": a.repeats, "roof_flop_s": roof,
            "flops_per_token": fpt, "points": points}


def _strategy_table(a) -> dict:
    """The engine's step log at batch 1, per strategy (``--strategies``): decode-only
    steps (no prompt tokens) of ``--max-tokens``-token greedy requests on the held-out code
    prompts, ``--passes`` interleaved passes; per strategy the medians of verify ms, draft
    ms, tokens verified and emitted per step, ms per emitted token (step ms over emitted
    tokens) and its ratio to ``autoregressive`` (per pass, then the median)."""
    from bench.engine_speedup import load_prompts
    from actors.engine.config import DEFAULT_DRAFT, EngineConfig
    from actors.engine.llm_engine import LLMEngine, run_requests
    from actors.engine.types import SamplingParams

    names = [s for s in a.strategies.split(",") if s]
    if "autoregressive" not in names:
        names.insert(0, "autoregressive")
    prompts = load_prompts(a.prompts)
    engines, logs = {}, {}
    for s in names:
        log: list[dict] = []
        engines[s] = LLMEngine(EngineConfig(strategy=s, max_num_seqs=4,
                                            draft_model=str(DEFAULT_DRAFT) if s == "draft_model"
                                            else None), on_step=log.append)
        logs[s] = log
        run_requests(engines[s], [("w", prompts[0], SamplingParams(max_tokens=8, ignore_eos=True))])
    per = _strategy_passes(a, names, engines, logs, prompts)
    return _strategy_summary(a, names, per)


def _pass_row(rows: list[dict]) -> dict:
    """One pass's figures of a strategy from its decode-only batch-1 step rows: medians of
    tokens verified, verify / draft / CPU ms; per emitted token ms and CPU ms."""
    from configs import metric_names as M

    med = lambda k: statistics.median(r[k] for r in rows)
    emitted = sum(r[M.STEP_EMITTED_TOKENS] for r in rows)
    return {"verified": med(M.STEP_VERIFICATION_TOKENS), "verify_ms": med(M.STEP_VERIFY_MS),
            "verify_cpu_ms": med(M.STEP_VERIFY_CPU_MS), "cpu_ms": med(M.STEP_CPU_MS),
            "cpu_ms_per_token": sum(r[M.STEP_CPU_MS] for r in rows) / emitted,
            "draft_ms": med(M.STEP_DRAFT_MS), "emitted": emitted / len(rows),
            "ms_per_token": sum(r[M.STEP_MS] for r in rows) / emitted,
            "paths": sorted({str(r.get("forward_path")) for r in rows})}


def _strategy_passes(a, names: list[str], engines: dict, logs: dict,
                     prompts: list[str]) -> dict[str, list[dict]]:
    """``--passes`` interleaved passes over every strategy: {strategy: [``_pass_row``]}."""
    from actors.engine.llm_engine import run_requests
    from actors.engine.types import SamplingParams
    from configs import metric_names as M

    per: dict[str, list[dict]] = {s: [] for s in names}
    params = SamplingParams(max_tokens=a.max_tokens, ignore_eos=True)
    for p in range(a.passes):
        for s in names:
            logs[s].clear()
            run_requests(engines[s], [(f"{s}-{p}-{i}", q, params) for i, q in enumerate(prompts)])
            per[s].append(_pass_row([r for r in logs[s] if not r[M.STEP_PREFILL_TOKENS]
                                     and r[M.STEP_BATCH_SIZE] == 1]))
        print(f"strategy pass {p + 1}/{a.passes} done", file=sys.stderr, flush=True)
    return per


def _strategy_summary(a, names: list[str], per: dict[str, list[dict]]) -> dict:
    """Medians over passes per strategy and the ratios to ``autoregressive`` (per pass, then
    the median); prints the table and returns {strategy: figures}."""
    out = {}
    print(f"step log, batch 1, decode-only steps, {a.max_tokens} tokens x {a.prompts} prompts, "
          f"medians of {a.passes} passes")
    print(f"{'strategy':<15} {'verified':>8} {'verify ms':>9} {'draft ms':>8} {'draft/AR':>8} "
          f"{'emit/step':>9} {'ms/token':>8} {'vs AR':>6} {'cpu ms/tok':>10} {'vs AR cpu':>9}  paths")
    for s in names:
        v = per[s]
        m = lambda k: statistics.median(x[k] for x in v)
        vs_ar = statistics.median(y["ms_per_token"] / x["ms_per_token"]
                                  for x, y in zip(v, per["autoregressive"]))
        d_ar = statistics.median(x["draft_ms"] / y["verify_ms"]
                                 for x, y in zip(v, per["autoregressive"]))
        vs_ar_cpu = statistics.median(y["cpu_ms_per_token"] / x["cpu_ms_per_token"]
                                      for x, y in zip(v, per["autoregressive"]))
        out[s] = {k: m(k) for k in ("verified", "verify_ms", "draft_ms", "emitted", "ms_per_token",
                                    "verify_cpu_ms", "cpu_ms", "cpu_ms_per_token")}
        out[s].update(vs_ar=vs_ar, vs_ar_cpu=vs_ar_cpu, draft_over_ar_step=d_ar, paths=v[-1]["paths"], passes=v)
        print(f"{s:<15} {m('verified'):>8.0f} {m('verify_ms'):>9.2f} {m('draft_ms'):>8.2f} "
              f"{d_ar:>8.2f} {m('emitted'):>9.2f} {m('ms_per_token'):>8.2f} {vs_ar:>6.2f} "
              f"{m('cpu_ms_per_token'):>10.2f} {vs_ar_cpu:>9.2f}  "
              f"{','.join(v[-1]['paths'])}")
    return out


if __name__ == "__main__":
    raise SystemExit(main())
