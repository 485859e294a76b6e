"""Build the committed held-out prompt file used by the engine tests and evaluation.

    python -m train.heldout_prompts --out data/prompts/heldout_eval.jsonl

Rows ``{"id", "domain": "code"|"prose", "prompt", "category"}`` (category = domain, the
load generator's traffic class) cut from the held-out split
only (``corpus.sources.is_heldout``): code prompts start at a ``def`` line and
stop mid-body; prose prompts are the start of a documentation paragraph.
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

from corpus.sources import code_files, is_heldout, prose_files, read_text


def build(n_per_domain: int = 24, seed: int = 0, max_chars: int = 360) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    code = [(r, p) for r, p in code_files() if is_heldout(r)]
    cands = []
    for rel, p in code:
        text = read_text(p)
        for m in re.finditer(r"^(    )?def \w+\(.*$", text, flags=re.M):
            cands.append(text[m.start():m.start() + max_chars])
    for i, c in enumerate(rng.sample(cands, n_per_domain)):
        rows.append({"id": f"code-{i}", "domain": "code", "prompt": c[:rng.randint(120, max_chars)],
                     "category": "code"})
    paras = []
    for rel, p in prose_files():
        if is_heldout(rel):
            for para in read_text(p).split("\n\n"):
                para = para.strip()
                if len(para) > 200 and para[0].isalpha():
                    paras.append(para)
    for i, c in enumerate(rng.sample(paras, n_per_domain)):
        rows.append({"id": f"prose-{i}", "domain": "prose", "prompt": c[:rng.randint(120, max_chars)],
                     "category": "prose"})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("data/prompts/heldout_eval.jsonl"))
    ap.add_argument("--n", type=int, default=24)
    a = ap.parse_args()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text("".join(json.dumps(r) + "\n" for r in build(a.n)))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
