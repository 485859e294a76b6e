"""specload's block drafter beside vLLM's implementation of the same method, on the same weights.

    python -m train.vllm_drafter_check [--drafter dflash] [--per-domain 8]
                                        [--max-tokens 64] [--json out.json]

The drafter is exported with ``train.export_vllm`` (into a temporary directory) and
run by vLLM 0.32's offline ``LLMEngine`` (its CPU build, in its own venv,
``$SPECLOAD_VLLM_PYTHON`` or ``.venv-vllm/bin/python``; a worker process running this
file) as ``speculative_config {"method": "dflash", "model": <export>,
"num_speculative_tokens": block_size - 1}``, and by specload's ``LLMEngine``
(strategy = the drafter's method, the same k), both fp32 on ``models/target``. Both
also run autoregressively. Prompts: the held-out code and prose prompts of
``data/prompts/heldout_eval.jsonl`` (``--per-domain`` of each), one request at a time,
greedy, ``--max-tokens`` tokens.

Per prompt: the output token ids of the four runs; greedy identity (each speculative
output equals its engine's autoregressive output and the other engine's); at a
divergence, the target's top-1 / top-2 logit gap at that position (specload's target,
on the common prefix), so a tie (gap < ``--tie-gap``) tells itself from a violation;
and the acceptance length tau = 1 + accepted / drafts (vLLM's
``mean_acceptance_length``; specload's per-request ``SpecStats``) of each engine.
Acceptance counts, not timings, so the shared box's noise does not enter.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --- the vLLM side (runs under vLLM's interpreter; imports nothing from specload) ----------
def vllm_side(model: str, spec: dict | None, prompts: list[str], max_tokens: int) -> list[dict]:
    """Per prompt: {"ids": output token ids, "drafts": n, "accepted": n} from vLLM's offline
    engine, one request at a time (counter deltas of ``vllm:spec_decode_*``)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams

    kw = {"model": model, "dtype": "float32", "max_model_len": 1024, "enforce_eager": True,
          "disable_log_stats": False}
    if spec:
        kw["speculative_config"] = spec
    llm = LLM(**kw)
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0)

    def counters() -> dict:
        out = {}
        for m in llm.get_metrics():
            if m.name in ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens",
                          "vllm:spec_decode_num_draft_tokens"):
                out[m.name] = getattr(m, "value", 0)
        return out

    res = []
    for p in prompts:
        before = counters()
        o = llm.generate([p], sp, use_tqdm=False)[0]
        after = counters()
        d = {k: after.get(k, 0) - before.get(k, 0) for k in after}
        res.append({"ids": list(o.outputs[0].token_ids),
                    "prompt_ids": list(o.prompt_token_ids),
                    "drafts": int(d.get("vllm:spec_decode_num_drafts", 0)),
                    "draft_tokens": int(d.get("vllm:spec_decode_num_draft_tokens", 0)),
                    "accepted": int(d.get("vllm:spec_decode_num_accepted_tokens", 0))})
    return res


# --- the specload side ----------------------------------------------------------------------
def specload_side(model: str, strategy: str, k: int, prompts: list[str], max_tokens: int,
                  drafter: str | None = None) -> list[dict]:
    """Per prompt: {"ids", "drafts", "accepted"} from specload's ``LLMEngine``, one at a time."""
    import torch

    from actors.engine.config import EngineConfig
    from actors.engine.llm_engine import LLMEngine
    from actors.engine.types import SamplingParams

    torch.set_num_threads(1)
    cfg = {"strategy": strategy, "model": model, "dtype": "float32", "max_num_seqs": 4,
           "num_speculative_tokens": k}
    if drafter:
        cfg["strategy_options"] = {"drafter": drafter}
    eng = LLMEngine(EngineConfig(**cfg))
    res = []
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, SamplingParams(max_tokens=max_tokens, temperature=0.0))
        ids, stats = [], None
        for _ in range(10 * max_tokens + 100):   # bounded: one token per step at worst
            for o in eng.step():
                ids += o.new_token_ids
                if o.finished:
                    stats = o.stats
            if stats is not None:
                break
        if stats is None:
            raise RuntimeError(f"specload did not finish prompt {i} in {10 * max_tokens + 100} steps")
        res.append({"ids": ids, "drafts": stats.num_drafts,
                    "draft_tokens": stats.num_draft_tokens, "accepted": stats.num_accepted_tokens})
    return res


def top2_gap(model: str, prompt_ids: list[int], prefix: list[int]) -> float:
    """The target's top-1 minus top-2 logit after ``prompt_ids + prefix`` (fp32, specload's
    model code; one full forward, no cache)."""
    import torch

    from actors.engine.model import CausalLM

    if model not in _TARGET:
        _TARGET[model] = CausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with torch.no_grad():
        out = _TARGET[model](torch.tensor([prompt_ids + prefix]))
    top = out.logits[0, -1].float().topk(2).values
    return float(top[0] - top[1])


_TARGET: dict = {}


def first_diff(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def tau(r: dict) -> float | None:
    return round(1 + r["accepted"] / r["drafts"], 3) if r["drafts"] else None


def load_heldout(per_domain: int) -> list[dict]:
    rows = [json.loads(line) for line in open(os.path.join(REPO, "data", "prompts",
                                                             "heldout_eval.jsonl"))]
    out = []
    for dom in ("code", "prose"):
        out += [r for r in rows if r["domain"] == dom][:per_domain]
    return out


def run_vllm_worker(python: str, model: str, spec: dict | None, prompts: list[str],
                    max_tokens: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        inp = os.path.join(tmp, "in.json")
        outp = os.path.join(tmp, "out.json")
        with open(inp, "w") as f:
            json.dump({"model": model, "spec": spec, "prompts": prompts,
                       "max_tokens": max_tokens}, f)
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        from actors.engine.vllm_backend import VLLM_ENV
        env.update(VLLM_ENV)
        r = subprocess.run([python, os.path.abspath(__file__), "--vllm-worker", inp, outp],
                           env=env, timeout=900, stdin=subprocess.DEVNULL,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if r.returncode != 0:
            raise VllmRefused(vllm_error(r.stderr))
        with open(outp) as f:
            return json.load(f)


class VllmRefused(RuntimeError):
    """vLLM's worker failed; the message is vLLM's own error line."""


def vllm_error(stderr: str) -> str:
    """The line that says why vLLM stopped (its last ``...Error:`` line), else the tail."""
    lines = [l.strip() for l in stderr.splitlines() if l.strip()]
    errs = [l for l in lines if "Error" in l.split(":")[0] or l.startswith("Value error")]
    return " | ".join(errs[-2:]) if errs else " | ".join(lines[-3:])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m train.vllm_drafter_check",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--drafter", default="dflash", help="models/<name> or a drafter dir")
    ap.add_argument("--per-domain", type=int, default=8, help="held-out prompts per domain")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--tie-gap", type=float, default=1e-4,
                    help="a divergence where the target's top-2 logit gap is below this is a tie")
    ap.add_argument("--json", default=None, help="write the per-prompt results here")
    ap.add_argument("--vllm-worker", nargs=2, metavar=("IN", "OUT"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.vllm_worker:
        with open(a.vllm_worker[0]) as f:
            job = json.load(f)
        res = vllm_side(job["model"], job["spec"], job["prompts"], job["max_tokens"])
        with open(a.vllm_worker[1], "w") as f:
            json.dump(res, f)
        return 0

    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    from cluster.vllm_server import TARGET, find_vllm_python
    from train.export_vllm import export

    python = find_vllm_python()
    rows = load_heldout(a.per_domain)
    prompts = [r["prompt"] for r in rows]
    with tempfile.TemporaryDirectory() as tmp:
        dst = export(a.drafter, os.path.join(tmp, "drafter"))
        meta = json.load(open(os.path.join(dst, "specload_export.json")))
        k = meta["num_speculative_tokens"]
        spec = {"method": meta["vllm_method"], "model": str(dst), "num_speculative_tokens": k}
        try:
            v_sd = run_vllm_worker(python, str(TARGET), spec, prompts, a.max_tokens)
        except VllmRefused as err:   # e.g. dspark on the CPU build: Model Runner V2 only
            s_sd = specload_side(str(TARGET), meta["method"], k, prompts, a.max_tokens,
                                 drafter=meta["source"])
            print(json.dumps({"drafter": a.drafter, "vllm_method": meta["vllm_method"],
                              "vllm": "refused", "error": str(err),
                              "specload_tau": [tau(r) for r in s_sd]}, indent=1))
            return 1
        v_ar = run_vllm_worker(python, str(TARGET), None, prompts, a.max_tokens)
    s_ar = specload_side(str(TARGET), "autoregressive", 0, prompts, a.max_tokens)
    s_sd = specload_side(str(TARGET), meta["method"], k, prompts, a.max_tokens,
                         drafter=meta["source"])
    per = compare_outputs(str(TARGET), rows, v_ar, v_sd, s_ar, s_sd, a.tie_gap)
    summary = summarise(rows, per, s_sd, v_sd)
    for r in per:
        print(json.dumps(r))
    print(json.dumps({"drafter": a.drafter, "k": k, "max_tokens": a.max_tokens,
                      "summary": summary}, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"per_prompt": per, "summary": summary, "drafter": a.drafter, "k": k,
                       "max_tokens": a.max_tokens}, f, indent=1)
    return 0


PAIRS = ("vllm_sd=vllm_ar", "specload_sd=specload_ar", "vllm_ar=specload_ar",
         "vllm_sd=specload_sd")


def compare_outputs(target: str, rows: list[dict], v_ar: list[dict], v_sd: list[dict],
                    s_ar: list[dict], s_sd: list[dict], tie_gap: float) -> list[dict]:
    """Per prompt: tau of both engines' speculative runs and, for each pair of ``PAIRS``,
    "same", "length a vs b", or "tie|DIFF at j (gap g)": the first differing token j and
    the target's top-2 logit gap there (below ``tie_gap``: a numerical tie)."""
    per = []
    for i, row in enumerate(rows):
        pid = v_ar[i]["prompt_ids"]
        rec = {"id": row["id"], "domain": row["domain"],
               "tau_specload": tau(s_sd[i]), "tau_vllm": tau(v_sd[i])}
        outs = {"vllm_sd": v_sd[i]["ids"], "vllm_ar": v_ar[i]["ids"],
                "specload_sd": s_sd[i]["ids"], "specload_ar": s_ar[i]["ids"]}
        for name in PAIRS:
            x, y = (outs[side] for side in name.split("="))
            j = first_diff(x, y)
            if j is None:
                rec[name] = "same"
            elif j >= min(len(x), len(y)):
                rec[name] = f"length {len(x)} vs {len(y)}"
            else:
                gap = top2_gap(target, pid, x[:j])
                rec[name] = f"{'tie' if gap < tie_gap else 'DIFF'} at {j} (gap {gap:.2e})"
        per.append(rec)
    return per


def summarise(rows: list[dict], per: list[dict], s_sd: list[dict], v_sd: list[dict]) -> dict:
    """Per domain: prompts, mean tau of each engine, same / tie / diff counts per pair,
    and tau pooled over all tokens (ratio of sums) of each engine."""
    summary = {}
    for dom in ("code", "prose"):
        rs = [r for r in per if r["domain"] == dom]
        ts = [r["tau_specload"] for r in rs if r["tau_specload"]]
        tv = [r["tau_vllm"] for r in rs if r["tau_vllm"]]
        summary[dom] = {"prompts": len(rs),
                        "tau_specload_mean": round(sum(ts) / len(ts), 3) if ts else None,
                        "tau_vllm_mean": round(sum(tv) / len(tv), 3) if tv else None}
        for name in PAIRS:
            summary[dom][name] = {
                "same": sum(r[name] == "same" for r in rs),
                "tie": sum(r[name].startswith("tie") for r in rs),
                "diff": sum(r[name].startswith(("DIFF", "length")) for r in rs)}
    # pooled tau over all tokens of a domain (ratio of sums), both engines
    for dom in ("code", "prose"):
        idx = [i for i, r in enumerate(rows) if r["domain"] == dom]
        for side, res in (("specload", s_sd), ("vllm", v_sd)):
            d = sum(res[i]["drafts"] for i in idx)
            acc = sum(res[i]["accepted"] for i in idx)
            summary[dom][f"tau_{side}_pooled"] = round(1 + acc / d, 3) if d else None
    return summary


if __name__ == "__main__":
    sys.exit(main())
