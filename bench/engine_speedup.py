"""Engine benchmark: output tokens/s ratios measured side by side in one run.

    python -m bench.engine_speedup [--out bench.json] [--max-tokens 64] [--threads 1]

(The step-cost grid of real model sizes is ``python -m bench.step_cost``.)

Same held-out code prompts for every row, greedy, EOS ignored so every run
emits the same number of tokens. Ratios (not absolute times) are the result:
the machine is shared and absolute speed drifts. Keys:

- engine_ar_vs_hf_generate_b1 / _b8: engine ``autoregressive`` vs
  ``transformers`` ``generate()`` (same weights, fp32, batch 1 / left-padded batch 8)
- draft_model_vs_hf_assisted_b1: engine ``draft_model`` vs HF assisted
  generation (``assistant_model=`` the same draft)
- {strategy}_vs_engine_ar_b{1,8,32}: each strategy vs engine ``autoregressive``
- engine_ar_b64_share_of_matmul_roof: engine ``autoregressive`` at batch 64,
  tokens/s x forward FLOPs per token (``flops_per_token``), over the fp32
  matmul FLOP/s measured here (a 1024^3 GEMM, same threads)

And the trade-off table (``tradeoff`` in the output; ``--tradeoff-batches``, default 1,4,16),
per strategy and batch: ms per emitted token (the run's wall time over its output
tokens), its speedup over ``autoregressive`` at that batch, and the verify's roofline
share: the FLOPs of the tokens each decode-only step verified (``flops_per_token`` at
the step's mean context) over the steps' verify ms, divided by the matmul roof
measured in the same repetition. Where the speedup crosses 1.0 with the batch is the
trade-off speculative decoding is about.

Every ratio is the median over ``--reps`` (3) interleaved repetitions: each
repetition runs every row once, HF next to the engine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from actors.engine.config import DEFAULT_DRAFT, DEFAULT_TARGET, EngineConfig
from actors.engine.llm_engine import LLMEngine, run_requests
from actors.engine.strategies import PROPOSERS
from actors.engine.types import SamplingParams
from configs.jsonio import write_json
from configs.paths import PROMPTS_DIR

PROMPTS = PROMPTS_DIR / "heldout_eval.jsonl"


def load_prompts(n: int, domain: str = "code") -> list[str]:
    rows = [json.loads(l) for l in PROMPTS.read_text().splitlines() if l.strip()]
    ps = [r["prompt"] for r in rows if r.get("domain") == domain]
    return (ps * (n // len(ps) + 1))[:n]


def engine_tps(engine: LLMEngine, prompts: list[str], batch: int, max_tokens: int) -> dict:
    """Run ``prompts`` (greedy, ``max_tokens`` each, EOS ignored) at most ``batch`` at once.
    Returns tokens, seconds, tokens_per_s, ms_per_token (wall ms per emitted token),
    acceptance_length, and from the engine's step rows of decode-only steps: verify_flops
    (FLOPs of the verified tokens, ``flops_per_token`` at each step's mean context) and
    verify_s (their verify time, s)."""
    from configs import metric_names as M

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    reqs = [(f"b{batch}-{i}-{time.monotonic_ns()}", p, params) for i, p in enumerate(prompts)]
    rows: list[dict] = []
    keep, engine.on_step = engine.on_step, rows.append
    try:
        t = time.perf_counter()
        res = run_requests(engine, reqs, batch_size=batch)
        dt = time.perf_counter() - t
    finally:
        engine.on_step = keep
    toks = sum(len(r["token_ids"]) for r in res.values())
    acc = sum(r["stats"].num_accepted_tokens for r in res.values())
    drafts = sum(r["stats"].num_drafts for r in res.values())
    flops = secs = 0.0
    for r in rows:
        n, b = r[M.STEP_VERIFICATION_TOKENS], r[M.STEP_BATCH_SIZE]
        if r[M.STEP_PREFILL_TOKENS] or not n or not b:
            continue
        flops += n * flops_per_token(engine.model, r[M.STEP_CONTEXT_TOKENS] / b)
        secs += r[M.STEP_VERIFY_MS] / 1e3
    return {"tokens": toks, "seconds": dt, "tokens_per_s": toks / dt,
            "ms_per_token": dt * 1e3 / toks if toks else None,
            "acceptance_length": 1 + acc / drafts if drafts else 1.0,
            "verify_flops": flops, "verify_s": secs}


def hf_tps(model, tok, prompts: list[str], batch: int, max_tokens: int, assistant=None) -> dict:
    tok.padding_side = "left"
    toks, t = 0, time.perf_counter()
    for i in range(0, len(prompts), batch):
        enc = tok(prompts[i:i + batch], return_tensors="pt", padding=True)
        kw = dict(max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                  pad_token_id=tok.pad_token_id)
        if assistant is not None:
            kw["assistant_model"] = assistant
        with torch.inference_mode():
            out = model.generate(**enc, **kw)
        toks += (out.shape[1] - enc["input_ids"].shape[1]) * out.shape[0]
    dt = time.perf_counter() - t
    return {"tokens": toks, "seconds": dt, "tokens_per_s": toks / dt}


def matmul_roof(threads: int, n: int = 1024, iters: int = 8) -> dict:
    """The machine's fp32 matmul roof, measured: FLOP/s of an n x n x n GEMM
    (the best of ``iters`` calls, ``threads`` torch threads)."""
    a_ = torch.randn(n, n)
    b_ = torch.randn(n, n)
    torch.mm(a_, b_)
    best = float("inf")
    for _ in range(iters):
        t = time.perf_counter()
        torch.mm(a_, b_)
        best = min(best, time.perf_counter() - t)
    return {"flop_s": 2 * n ** 3 / best, "threads": threads}


def flops_per_token(model, ctx: float) -> float:
    """Forward FLOPs of one decoded token: 2 x every GEMM weight (projections,
    MLP, LM head) plus attention's QK^T and PV over ``ctx`` cached tokens."""
    c = model.config
    per_layer = (c.hidden_size * (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim
                 + c.num_attention_heads * c.head_dim * c.hidden_size
                 + 3 * c.hidden_size * c.intermediate_size)
    attn = 2 * c.num_attention_heads * c.head_dim * ctx
    return 2.0 * (c.num_hidden_layers * (per_layer + attn) + c.hidden_size * c.vocab_size)


def _parse(argv) -> tuple[argparse.Namespace, list[int], list[str]]:
    """Parse and check the flags; return (args, batch sizes with 1 and 8 always in, strategies
    with ``autoregressive`` first). A bad flag exits 2 through ``ap.error``."""
    ap = argparse.ArgumentParser(prog="python -m bench.engine_speedup", description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompts-b1", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads for both engines (1: what a serving replica runs)")
    ap.add_argument("--strategies", default=",".join(PROPOSERS))
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--reps", type=int, default=3, help="interleaved repetitions (median)")
    ap.add_argument("--roof-batch", type=int, default=64,
                    help="batch of the engine run compared with the fp32 matmul roof (0 = skip)")
    ap.add_argument("--tradeoff-batches", default="1,4,16",
                    help="batch sizes of the trade-off table: ms per emitted token, speedup over "
                         "autoregressive and the verify's roofline share per strategy (run too)")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    try:
        a.tradeoff = sorted({int(b) for b in a.tradeoff_batches.split(",") if b})
    except ValueError:
        ap.error(f"--tradeoff-batches: expected comma-separated integers, got {a.tradeoff_batches!r}")
    if a.tradeoff and min(a.tradeoff) < 1:
        ap.error("--tradeoff-batches: batch sizes must be >= 1")
    try:
        batches = sorted({1, 8, *(int(b) for b in a.batches.split(",") if b), *a.tradeoff})
    except ValueError:
        ap.error(f"--batches: expected comma-separated integers, got {a.batches!r}")
    if min(batches) < 1:
        ap.error("--batches: batch sizes must be >= 1")
    if a.reps < 1:
        ap.error("--reps must be >= 1")
    if a.roof_batch < 0:
        ap.error("--roof-batch must be >= 0")
    strategies = [s for s in a.strategies.split(",") if s]
    if "autoregressive" not in strategies:
        strategies.insert(0, "autoregressive")  # the baseline of every ratio
    for s in strategies:
        if s not in PROPOSERS:
            ap.error(f"--strategies: unknown strategy {s!r}; known: {sorted(PROPOSERS)}")
    return a, batches, strategies


@dataclass
class _Setup:
    """What every repetition runs on: tokenizer, HF target and draft, prompts, warm engines."""
    tok: object
    hf: object
    hf_draft: object
    p1: list[str]
    pb: dict[int, list[str]]
    engines: dict[str, LLMEngine]


def _load(a: argparse.Namespace, batches: list[int], strategies: list[str]) -> _Setup:
    """Load the HF target and draft, the prompts, and one engine per strategy; warm each up."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(DEFAULT_TARGET))
    hf = AutoModelForCausalLM.from_pretrained(str(DEFAULT_TARGET), torch_dtype=torch.float32).eval()
    hf_draft = AutoModelForCausalLM.from_pretrained(str(DEFAULT_DRAFT),
                                                    torch_dtype=torch.float32).eval()
    p1 = load_prompts(a.prompts_b1)
    pb = {b: load_prompts(max(b * 2, a.prompts_b1)) for b in batches}
    engines = {}
    for s in strategies:
        engines[s] = LLMEngine(EngineConfig(
            strategy=s, max_num_seqs=max(batches + [a.roof_batch]), max_num_batched_tokens=8192,
            draft_model=str(DEFAULT_DRAFT) if s == "draft_model" else None))
        engine_tps(engines[s], p1[:1], 1, 8)  # warm-up
    hf_tps(hf, tok, p1[:1], 1, 8)
    return _Setup(tok, hf, hf_draft, p1, pb, engines)


def _rows(a: argparse.Namespace, batches: list[int], strategies: list[str],
          st: _Setup) -> list[tuple[str, object]]:
    """The rows of one repetition, in run order: (key, a call returning that row's measurement)."""
    hf, tok, p1, pb, engines, hf_draft = st.hf, st.tok, st.p1, st.pb, st.engines, st.hf_draft
    plan = [("hf_generate_b1", lambda: hf_tps(hf, tok, p1, 1, a.max_tokens)),
            ("autoregressive_b1", lambda: engine_tps(engines["autoregressive"], p1, 1,
                                                     a.max_tokens)),
            ("hf_generate_b8", lambda: hf_tps(hf, tok, pb[8], 8, a.max_tokens)),
            ("autoregressive_b8", lambda: engine_tps(engines["autoregressive"], pb[8], 8,
                                                     a.max_tokens))]
    if "draft_model" in strategies:
        plan += [("hf_assisted_b1", lambda: hf_tps(hf, tok, p1, 1, a.max_tokens,
                                                   assistant=hf_draft)),
                 ("draft_model_b1", lambda: engine_tps(engines["draft_model"], p1, 1,
                                                       a.max_tokens))]
    for bsz in batches:
        for s in strategies:
            key = f"{s}_b{bsz}"
            if key not in dict(plan):
                plan.append((key, lambda s=s, bsz=bsz: engine_tps(
                    engines[s], p1 if bsz == 1 else pb[bsz], bsz, a.max_tokens)))
    plan.append(("matmul_roof", lambda: matmul_roof(a.threads)))
    if a.roof_batch:
        plan += [(f"autoregressive_b{a.roof_batch}", lambda: engine_tps(
                     engines["autoregressive"], load_prompts(a.roof_batch), a.roof_batch,
                     a.max_tokens))]
    return plan


def _measure(a: argparse.Namespace, batches: list[int], strategies: list[str],
             st: _Setup) -> dict[str, list[dict]]:
    """Run ``--reps`` repetitions of every row; return each row's measurements, one per rep."""
    # Every repetition runs every row once, in the same order (HF next to the engine),
    # so background load drifts hit both sides of a ratio alike; ratios are taken per
    # repetition and the median reported.
    runs: dict[str, list[dict]] = {}
    for rep in range(a.reps):
        for key, fn in _rows(a, batches, strategies, st):
            runs.setdefault(key, []).append(fn())
        print(f"repetition {rep + 1}/{a.reps} done", flush=True)
    return runs


def _summarize(a: argparse.Namespace, batches: list[int], strategies: list[str], st: _Setup,
               runs: dict[str, list[dict]]) -> tuple[dict, dict]:
    """Medians per row (``raw``) and the per-repetition ratios' medians (``ratios``)."""
    med = lambda xs: statistics.median(xs)
    raw = {k: {"tokens_per_s": med([r["tokens_per_s"] for r in v]) if "tokens_per_s" in v[0]
               else None, **{f: med([r[f] for r in v]) for f in ("acceptance_length", "flop_s")
                             if f in v[0]}, "reps": len(v)}
           for k, v in runs.items()}
    r = lambda x, y: round(med([p["tokens_per_s"] / q["tokens_per_s"]
                                for p, q in zip(runs[x], runs[y])]), 3)
    ratios = {"engine_ar_vs_hf_generate_b1": r("autoregressive_b1", "hf_generate_b1"),
              "engine_ar_vs_hf_generate_b8": r("autoregressive_b8", "hf_generate_b8")}
    if "draft_model" in strategies:
        ratios["draft_model_vs_hf_assisted_b1"] = r("draft_model_b1", "hf_assisted_b1")
    for s in strategies:
        for bsz in batches:
            ratios[f"{s}_vs_engine_ar_b{bsz}"] = r(f"{s}_b{bsz}", f"autoregressive_b{bsz}")
    if a.roof_batch:
        tok = st.tok
        fpt = flops_per_token(st.engines["autoregressive"].model,
                              ctx=statistics.mean(len(tok(p)["input_ids"]) for p in
                                                  load_prompts(a.roof_batch)) + a.max_tokens / 2)
        key = f"autoregressive_b{a.roof_batch}"
        ratios[f"engine_ar_b{a.roof_batch}_share_of_matmul_roof"] = round(med([
            e["tokens_per_s"] * fpt / m["flop_s"] for e, m in zip(runs[key],
                                                               runs["matmul_roof"])]), 4)
        raw["matmul_roof"]["flops_per_token"] = fpt
    return raw, ratios


def _tradeoff(a: argparse.Namespace, strategies: list[str], runs: dict[str, list[dict]]) -> dict:
    """The trade-off table: {strategy: {batch: {ms_per_token, speedup_vs_ar, roof_share}}},
    each the median over repetitions of that repetition's value (the speedup and the roof
    share against the autoregressive row and the matmul roof of the same repetition)."""
    med = statistics.median
    out: dict = {}
    for s in strategies:
        for b in a.tradeoff:
            mine, ar = runs[f"{s}_b{b}"], runs[f"autoregressive_b{b}"]
            shares = [e["verify_flops"] / e["verify_s"] / m["flop_s"]
                      for e, m in zip(mine, runs["matmul_roof"]) if e["verify_s"] > 0]
            out.setdefault(s, {})[b] = {
                "ms_per_token": round(med(e["ms_per_token"] for e in mine), 3),
                "speedup_vs_ar": round(med(x["ms_per_token"] / e["ms_per_token"]
                                           for e, x in zip(mine, ar)), 3),
                "roof_share": round(med(shares), 4) if shares else None}
    return out


def _print_outcome(ratios: dict, raw: dict, tradeoff: dict | None = None) -> None:
    """Print the ratios, the trade-off table and the raw rows as rich tables (the ratios
    and the trade-off as JSON without rich)."""
    try:
        from rich.console import Console
        from rich.table import Table

        t = Table(title="specload engine benchmark (output tokens/s ratios, medians of interleaved repetitions)")
        t.add_column("ratio"); t.add_column("value", justify="right")
        for k, v in ratios.items():
            t.add_row(k, f"{v:.3f}")
        t2 = Table(title="raw")
        for c in ("run", "tokens/s", "tau"):
            t2.add_column(c)
        for k, v in raw.items():
            if v.get("tokens_per_s") is None:   # the matmul roof row
                t2.add_row(k, f"{v['flop_s'] / 1e9:.1f} GFLOP/s", "")
                continue
            t2.add_row(k, f"{v['tokens_per_s']:.1f}", f"{v.get('acceptance_length', float('nan')):.2f}")
        Console().print(t)
        if tradeoff:
            bs = sorted({b for v in tradeoff.values() for b in v})
            t3 = Table(title="trade-off: ms per emitted token (speedup over autoregressive; "
                             "verify's share of the one-thread matmul roof)")
            t3.add_column("strategy")
            for b in bs:
                t3.add_column(f"batch {b}", justify="right")
            for s, v in tradeoff.items():
                t3.add_row(s, *(f"{v[b]['ms_per_token']:.2f} ms ({v[b]['speedup_vs_ar']:.2f}x; "
                                + ("-" if v[b]['roof_share'] is None
                                   else f"{100 * v[b]['roof_share']:.0f}%") + ")" for b in bs))
            Console().print(t3)
        Console().print(t2)
    except ImportError:
        print(json.dumps({"ratios": ratios, "tradeoff": tradeoff}, indent=2))


def main(argv=None) -> int:
    import sys
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["cost-curve"]:   # the old subcommand (python -m actors.bench cost-curve)
        print("cost-curve is its own benchmark now: python -m bench.step_cost "
              + " ".join(args[1:]), file=sys.stderr)
        return 2
    a, batches, strategies = _parse(argv)
    st = _load(a, batches, strategies)
    runs = _measure(a, batches, strategies, st)
    raw, ratios = _summarize(a, batches, strategies, st, runs)
    tradeoff = _tradeoff(a, strategies, runs) if a.tradeoff else {}
    result = {"ratios": ratios, "raw": raw, "tradeoff": tradeoff, "max_tokens": a.max_tokens, "threads": a.threads,
              "reps": a.reps, "note": "ratios: medians over interleaved repetitions",
              "torch": torch.__version__, "device": "cpu"}
    _print_outcome(ratios, raw, tradeoff)
    if a.out:
        write_json(a.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
