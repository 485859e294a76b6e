"""Offline text corpus for the embedded models: CPython stdlib source + Python docs.

Files are split into train / held-out by a hash of their relative path, so the
split is stable across machines and never mixes one file into both sides.

Sources (docs/design.md, "Real data, offline"):
- code: the running interpreter's ``lib/python3.X`` (``sysconfig`` stdlib),
  minus ``site-packages`` and the test suites (very repetitive).
- prose: the Python documentation sources installed by Debian's
  ``python3.11-doc`` under ``/usr/share/doc/python3.11/html/_sources``.

Run ``python -m corpus.sources --out data/corpus`` to write
``{code,prose}.{train,heldout}.txt``; documents are separated by the EOS text.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sysconfig
from pathlib import Path

EOS_TEXT = "<|endoftext|>"
DOCS_DIR = Path("/usr/share/doc/python3.11/html/_sources")
HELDOUT_PERCENT = 5
_SKIP_PARTS = {"site-packages", "test", "tests", "idle_test", "__pycache__"}


def is_heldout(rel_path: str) -> bool:
    """True when ``rel_path`` falls in the held-out split (5% of files by md5)."""
    h = int(hashlib.md5(rel_path.encode()).hexdigest()[:8], 16)
    return h % 100 < HELDOUT_PERCENT


def code_files() -> list[tuple[str, Path]]:
    """(relative path, path) of stdlib ``.py`` files, sorted; raises if none found."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root).as_posix()
        if _SKIP_PARTS & set(p.relative_to(root).parts[:-1]) or rel.startswith("test_"):
            continue
        out.append((rel, p))
    if not out:
        raise FileNotFoundError(f"no stdlib .py files under {root}")
    return out


def prose_files(docs_dir: Path = DOCS_DIR) -> list[tuple[str, Path]]:
    """(relative path, path) of the docs' ``.rst.txt`` sources.

    Raises FileNotFoundError naming the Debian package when the docs are missing.
    """
    if not docs_dir.is_dir():
        raise FileNotFoundError(
            f"{docs_dir} not found: install the Python docs with "
            "`apt-get install python3.11-doc`")
    return [(p.relative_to(docs_dir).as_posix(), p) for p in sorted(docs_dir.rglob("*.txt"))]


def read_text(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def write_corpus(out_dir: Path) -> dict[str, int]:
    """Write the four split files; returns characters per split file."""
    out_dir.mkdir(parents=True, exist_ok=True)
    sizes = {}
    for domain, files in (("code", code_files()), ("prose", prose_files())):
        parts = {"train": [], "heldout": []}
        for rel, p in files:
            parts["heldout" if is_heldout(rel) else "train"].append(read_text(p))
        for split, docs in parts.items():
            text = EOS_TEXT.join(docs)
            dest = out_dir / f"{domain}.{split}.txt"
            tmp = dest.with_suffix(".tmp")
            tmp.write_text(text, encoding="utf-8")
            os.replace(tmp, dest)
            sizes[dest.name] = len(text)
    return sizes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("data/corpus"))
    args = ap.parse_args()
    for name, n in write_corpus(args.out).items():
        print(f"{name}: {n:,} chars")


if __name__ == "__main__":
    main()
