"""Offline generation through the engine: one JSON line per prompt on stdout.

    python -m actors.generate --strategy ngram --prompts data/prompts/heldout_code.jsonl \\
        --max-tokens 64 --batch-size 8

Input rows: ``{"id": ..., "prompt": "..."}`` (other fields ignored). Output
rows: id, token_ids (completion ids), text, finish_reason, num_drafts,
num_draft_tokens, num_accepted_tokens, num_accepted_tokens_per_pos,
acceptance_length. Bad flags exit 2 with a message naming the flag.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from actors.engine.config import DEFAULT_DRAFT, DEFAULT_TARGET
from configs.jsonio import SourceError, read_text_source


def read_prompts(path: str, parser: argparse.ArgumentParser) -> list[dict]:
    """Rows of a JSONL source (a file, ``-`` for stdin, ``/dev/stdin`` or a pipe);
    errors name the flag and the line."""
    try:
        _, text = read_text_source(str(path))
    except SourceError as err:
        parser.error(f"--prompts: {err}")
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            parser.error(f"--prompts: {path}:{n} is not JSON ({e})")
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            parser.error(f"--prompts: {path}:{n} needs a string field 'prompt'")
        rows.append({"id": row.get("id", n - 1), "prompt": row["prompt"]})
    if not rows:
        parser.error(f"--prompts: {path} holds no prompts")
    return rows


def build_parser() -> argparse.ArgumentParser:
    from actors.engine.strategies import PROPOSERS

    ap = argparse.ArgumentParser(prog="python -m actors.generate", description=__doc__.split("\n")[0])
    ap.add_argument("--strategy", default="autoregressive", choices=sorted(PROPOSERS))
    ap.add_argument("--prompts", required=True,
                    help="JSONL with id, prompt; - (or /dev/stdin) reads standard input")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--seed", type=int, default=None, help="per-request seed = seed + row index")
    ap.add_argument("--batch-size", type=int, default=1, help="requests in the engine at once")
    ap.add_argument("--num-speculative-tokens", type=int, default=None)
    ap.add_argument("--model", default=str(DEFAULT_TARGET))
    ap.add_argument("--draft", default=str(DEFAULT_DRAFT))
    ap.add_argument("--threads", type=int, default=None)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    a = ap.parse_args(argv)
    from actors.engine.config import EngineConfig
    from actors.engine.llm_engine import LLMEngine, run_requests
    from actors.engine.errors import InvalidRequest
    from actors.engine.types import SamplingParams

    if a.batch_size < 1:
        ap.error("--batch-size must be >= 1")
    if a.num_speculative_tokens is not None and not 0 <= a.num_speculative_tokens <= 64:
        ap.error(f"--num-speculative-tokens must be in 0..64, got {a.num_speculative_tokens}")
    if not Path(a.model, "config.json").is_file():
        ap.error(f"--model: {a.model} is not a model directory (no config.json)")
    rows = read_prompts(a.prompts, ap)
    params = []
    for i in range(len(rows)):
        try:
            params.append(SamplingParams(
                max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                seed=None if a.seed is None else a.seed + i))
        except InvalidRequest as e:   # names the field: --max-tokens, --top-p, ...
            ap.error(f"--{(e.param or 'max_tokens').replace('_', '-')}: {e}")
    kw = {}
    if a.num_speculative_tokens is not None:
        kw["num_speculative_tokens"] = a.num_speculative_tokens
    cfg = EngineConfig(strategy=a.strategy, model=a.model,
                       draft_model=a.draft if a.strategy == "draft_model" else None,
                       max_num_seqs=max(a.batch_size, 1), **kw)
    if a.threads:
        import torch

        torch.set_num_threads(a.threads)  # the process's setting, not the engine's
    engine = LLMEngine(cfg)
    reqs = []
    for r, p in zip(rows, params):
        reqs.append((str(r["id"]), r["prompt"], p))
    try:
        results = run_requests(engine, reqs, batch_size=a.batch_size)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for r in rows:
        res = results[str(r["id"])]
        st = res["stats"].to_dict()
        print(json.dumps({"id": r["id"], "token_ids": res["token_ids"], "text": res["text"],
                          "finish_reason": res["finish_reason"],
                          **{k: st[k] for k in ("num_drafts", "num_draft_tokens",
                                                "num_accepted_tokens",
                                                "num_accepted_tokens_per_pos",
                                                "acceptance_length")}}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
