"""Position-by-position evaluation of the speculative strategies on one harness.

    python -m bench.acceptance [--prompts FILE.jsonl] [--strategies a,b,...]
                              [--max-tokens N] [--out FILE.json]

Rows with a ``domain`` field are grouped by it (default prompts: held-out code
and prose from ``data/prompts/heldout_eval.jsonl`` and HumanEval from
``data/prompts/humaneval.jsonl``). For every strategy and domain, greedy:

- one run at batch 1 (acceptance statistics, draft/verify step times,
  speedup_vs_ar_b1) and one with up to 16 requests in the engine at once
  (speedup_vs_ar_b16); speedups are output tokens/s over ``autoregressive``
  on the same prompts in the same process;
- acceptance_length tau (1 + accepted / drafts, docs/design.md), its per-step
  histogram, per-position acceptance (unconditional = accepted at i / drafts,
  vLLM; conditional = accepted at i / accepted at i-1, DFlash 2 / DSpark);
- per_pos_top1_cond / per_pos_top16_cond: P(target token is the drafter's
  top-1 / in its top-16 at block position i | the proposed path's first i-1
  tokens were right), from the drafter's trace checked against the output
  (greedy output is the target's own);
- greedy_identical_to_ar: the output equals autoregressive's token for token.

Variants beyond the registered strategies (same proposers, other options):
``dspark_scheduled`` (confidence scheduler on), ``dflash2_conv_only`` (selector
off), ``dflash2_selector_only`` (DFlash backbone + selector, no conv) and
``dflash_deep`` (3-layer DFlash, the "5 vs 15 layers" comparison scaled down).
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np

from actors.engine.types import SamplingParams, SpecStats
from configs import metric_names as M
from configs.jsonio import SourceError, read_text_source, write_json
from configs.paths import MODELS_DIR, PROMPTS_DIR

VARIANTS: dict[str, tuple[str, dict]] = {
    "autoregressive": ("autoregressive", {}),
    "ngram": ("ngram", {}),
    "draft_model": ("draft_model", {}),
    "dflash": ("dflash", {}),
    "dflash_deep": ("dflash", {"drafter": str(MODELS_DIR / "dflash_deep")}),
    "dflash2": ("dflash2", {}),
    "dflash2_conv_only": ("dflash2", {"use_selector": False}),
    "dflash2_selector_only": ("dflash2", {"drafter": str(MODELS_DIR / "dflash"),
                                          "use_selector": True}),
    "dspark": ("dspark", {}),
    "dspark_scheduled": ("dspark", {"scheduler": True}),
}
DEFAULT_STRATEGIES = ("autoregressive", "dflash", "dflash_deep", "dflash2", "dflash2_conv_only",
                      "dflash2_selector_only", "dspark", "dspark_scheduled")
BLOCK_FAMILY = ("dflash", "dflash2", "dspark")


def default_prompts(per_domain: int) -> list[dict]:
    rows = [json.loads(line) for line in
            (PROMPTS_DIR / "heldout_eval.jsonl").read_text().splitlines() if line]
    he = [json.loads(line) for line in
          (PROMPTS_DIR / "humaneval.jsonl").read_text().splitlines() if line]
    rows += [{"id": r.get("prompt_id", f"he-{i}"), "domain": "humaneval", "prompt": r["prompt"]}
             for i, r in enumerate(he)]
    by = defaultdict(list)
    for r in rows:
        by[r.get("domain", "all")].append(r)
    return [r for d in by for r in by[d][:per_domain]]


def _run(strategy: str, options: dict, prompts: list[list[int]], max_tokens: int, batch: int,
         k: int, trace: bool):
    from actors.engine.config import EngineConfig
    from actors.engine.llm_engine import LLMEngine, run_requests

    opts = dict(options)
    if trace and strategy in BLOCK_FAMILY:
        opts["record_trace"] = True
    steps: list[dict] = []
    eng = LLMEngine(EngineConfig(strategy=strategy, strategy_options=opts, max_num_seqs=16,
                                 num_speculative_tokens=k),
                    on_step=steps.append)
    reqs = [(f"p{i}", p, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
            for i, p in enumerate(prompts)]
    run_requests(eng, reqs[:1], batch_size=1)  # warm-up (allocations, first-call overheads)
    steps.clear()
    if getattr(eng.proposer, "trace", None) is not None:
        eng.proposer.trace.clear()
    t0 = time.perf_counter()
    res = run_requests(eng, reqs, batch_size=batch)
    wall = time.perf_counter() - t0
    if hasattr(eng.proposer, "finish_trace"):  # what the timed steps deferred (confidences)
        eng.proposer.finish_trace()
    outs = [res[f"p{i}"]["token_ids"] for i in range(len(prompts))]
    stats = SpecStats()
    for r in res.values():
        stats.merge(r["stats"])
    return eng, outs, stats, steps, sum(map(len, outs)) / wall


def _trace_metrics(trace: list[dict], prompts, outs, n_pos: int) -> dict:
    ok = np.zeros(n_pos)
    top1 = np.zeros(n_pos)
    top16 = np.zeros(n_pos)
    conf_p, conf_y = [], []
    for rec in trace:
        if rec.get("topk") is None and rec.get("logits") is not None:  # ranked now, untimed
            rec = dict(rec, topk=rec["logits"].topk(rec.get("top_k", 16), dim=-1).indices)
        rec = {k: v.tolist() if hasattr(v, "tolist") else v for k, v in rec.items()
               if k != "logits"}
        i = int(rec["request_id"][1:])
        full = prompts[i] + outs[i]
        truth = full[rec["pos"] + 1: rec["pos"] + 1 + n_pos]
        for j, t in enumerate(truth):
            ok[j] += 1
            top1[j] += rec["top1"][j] == t
            top16[j] += t in rec["topk"][j]
            if rec.get("confidence") is not None:
                conf_p.append(rec["confidence"][j])
                conf_y.append(rec["path"][j] == t)
            if rec["path"][j] != t:
                break
    r = lambda a: [round(float(v), 4) for v in a / np.maximum(ok, 1)]  # noqa: E731
    out = {"per_pos_top1_cond": r(top1), "per_pos_top16_cond": r(top16)}
    if conf_p:
        from actors.drafters.calibration import ece

        out["confidence_ece"] = round(ece(np.array(conf_p), np.array(conf_y, dtype=float)), 4)
    return out


def evaluate(strategies, rows, max_tokens: int) -> dict:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(MODELS_DIR / "target"))
    domains = defaultdict(list)
    for r in rows:
        domains[r.get("domain", "all")].append(tok(r["prompt"], add_special_tokens=False)["input_ids"])
    result: dict = {}
    ar = {}
    for name in ["autoregressive"] + [s for s in strategies if s != "autoregressive"]:
        if name not in VARIANTS:
            raise ValueError(f"unknown strategy {name!r}; expected one of {sorted(VARIANTS)}")
        strategy, options = VARIANTS[name]
        k = 7 if strategy in BLOCK_FAMILY else 4
        for dom, prompts in domains.items():
            eng, outs, st, steps, tps1 = _run(strategy, options, prompts, max_tokens, 1,
                                              k, True)
            _, outs16, _, _, tps16 = _run(strategy, options, prompts, max_tokens, 16,
                                          k, False)
            if name == "autoregressive":
                ar[dom] = (outs, tps1, tps16)
            dec = [s for s in steps if s[M.STEP_BATCH_SIZE] > 0]
            d_ms = float(np.mean([s[M.STEP_DRAFT_MS] for s in dec])) if dec else 0.0
            v_ms = float(np.mean([s[M.STEP_VERIFY_MS] for s in dec])) if dec else 0.0
            hist = Counter(s[M.STEP_ACCEPTED_TOKENS] + 1 for s in dec if s[M.STEP_DRAFT_TOKENS])
            acc = st.num_accepted_tokens_per_pos
            prev = [st.num_drafts] + acc[:-1]
            n_draft = eng.proposer.draft_params()
            m = {"acceptance_length": round(st.acceptance_length, 4),
                 "acceptance_length_hist": {str(k_): hist[k_] for k_ in sorted(hist)},
                 "per_pos_accept_uncond": [round(a / max(st.num_drafts, 1), 4) for a in acc],
                 "per_pos_accept_cond": [round(a / max(p, 1), 4) for a, p in zip(acc, prev)],
                 "num_drafts": st.num_drafts, "num_draft_tokens": st.num_draft_tokens,
                 "num_accepted_tokens": st.num_accepted_tokens,
                 "draft_params": n_draft,
                 "draft_params_pct_of_target": round(100 * n_draft / eng.model.num_params(), 2),
                 "draft_ms_per_step": round(d_ms, 3), "verify_ms_per_step": round(v_ms, 3),
                 "draft_pct_of_verify_step": round(100 * d_ms / v_ms, 2) if v_ms else 0.0,
                 "tokens_per_s_b1": round(tps1, 2), "tokens_per_s_b16": round(tps16, 2),
                 "speedup_vs_ar_b1": round(tps1 / ar[dom][1], 3),
                 "speedup_vs_ar_b16": round(tps16 / ar[dom][2], 3),
                 "greedy_identical_to_ar": outs == ar[dom][0] and outs16 == ar[dom][0],
                 "num_prompts": len(prompts)}
            trace = getattr(eng.proposer, "trace", None)
            if trace:
                m.update(_trace_metrics(trace, prompts, outs, eng.proposer.block_size - 1))
            drafter = getattr(eng.proposer, "drafter", None)
            if drafter is not None:
                m["drafter_layers"] = drafter.config.num_layers
                m["conv_params_pct_of_drafter"] = round(100 * drafter.num_params("conv")
                                                        / drafter.num_params(), 2)
            result.setdefault(name, {})[dom] = m
            print(f"  {name:22s} {dom:10s} tau {m['acceptance_length']:.3f} "
                  f"b1 x{m['speedup_vs_ar_b1']:.2f} b16 x{m['speedup_vs_ar_b16']:.2f}", flush=True)
    return result


def print_table(result: dict) -> None:
    cols = ("tau", "top1@last", "top16@last", "draft_ms", "draft%verify", "x_b1", "x_b16",
            "params%", "same")
    print(f"{'strategy':22s} {'domain':10s} " + " ".join(f"{c:>10s}" for c in cols))
    for name, doms in result.items():
        for dom, m in doms.items():
            t1 = m.get("per_pos_top1_cond", [None])[-1]
            t16 = m.get("per_pos_top16_cond", [None])[-1]
            vals = (m["acceptance_length"], t1, t16, m["draft_ms_per_step"],
                    m["draft_pct_of_verify_step"], m["speedup_vs_ar_b1"], m["speedup_vs_ar_b16"],
                    m["draft_params_pct_of_target"], m["greedy_identical_to_ar"])
            print(f"{name:22s} {dom:10s} " + " ".join(
                f"{'-' if v is None else (f'{v:.3f}' if isinstance(v, float) else str(v)):>10s}"
                for v in vals))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", default=None,
                    help="JSONL rows with prompt[, domain]; - (or /dev/stdin) reads standard input")
    ap.add_argument("--strategies", default=",".join(DEFAULT_STRATEGIES))
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--per-domain", type=int, default=16, help="prompts per domain (default set)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: a shared CPU makes OpenMP spin at 2)")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    if a.prompts:
        try:
            _, text = read_text_source(a.prompts)
            rows = [json.loads(line) for line in text.splitlines() if line.strip()]
        except (SourceError, json.JSONDecodeError) as err:
            ap.error(f"--prompts: {err}")
        if not rows or any(not isinstance(r, dict) or "prompt" not in r for r in rows):
            ap.error(f"--prompts: {a.prompts}: every row needs a 'prompt' field")
    else:
        rows = default_prompts(a.per_domain)
    import torch

    torch.set_num_threads(a.threads)  # once, for every engine this process builds
    result = evaluate([s for s in a.strategies.split(",") if s], rows, a.max_tokens)
    print_table(result)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        write_json(a.out, result)


if __name__ == "__main__":
    main()
