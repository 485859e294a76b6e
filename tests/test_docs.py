"""The docs cannot rot: their commands are checked against the code, or run.

- Every ``python -m MODULE [SUB]`` line of a fenced shell block in README.md and docs/*.md
  names a module of this project whose parser knows every ``--flag`` the line uses.
- A block that follows the line ``<!-- runnable -->`` is run as it stands and must exit 0.
- docs/reference/cli.md is what ``docs/gen_cli_reference.py`` writes from the parsers now.
- Every relative link in the docs points at a file that exists.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
OURS = ("actors", "analysis", "cluster", "configs", "loadgen", "train")
FENCE = re.compile(r"^```(bash|sh|shell|console)?[^\n]*\n(.*?)^```", re.S | re.M)
RUNNABLE = "<!-- runnable -->"


def shell_blocks(page: Path) -> list[tuple[int, str, bool]]:
    """(line number, text with continuations joined, runnable?) of each shell fence."""
    text = page.read_text()
    out = []
    for m in FENCE.finditer(text):
        if m.group(1) is None and "python -m" not in m.group(2):
            continue   # a plain fence of output, not commands
        before = text[:m.start()].rstrip().splitlines()
        runnable = bool(before) and before[-1].strip() == RUNNABLE
        out.append((text[:m.start()].count("\n") + 1, m.group(2).replace("\\\n", " "), runnable))
    return out


def commands(block: str) -> list[tuple[str, list[str]]]:
    """(module, argument tokens) of every ``python -m <our module>`` in a block."""
    out = []
    for m in re.finditer(r"python -m ([A-Za-z_][\w.]*)((?:[^\n&|;)'\"#`]|\|(?=[\w-]))*)", block):
        module = m.group(1)
        if module.split(".")[0] in OURS:
            toks = [t.strip("[]") for t in m.group(2).split()]
            out.append((module, [t for t in toks if t]))
    return out


@functools.lru_cache(maxsize=None)
def help_of(module: str, sub: str | None) -> str:
    env = {**os.environ, "COLUMNS": "100", "PYTHONPATH": str(REPO)}
    argv = [sys.executable, "-m", module, *([sub] if sub else []), "--help"]
    p = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    return p.stdout if p.returncode == 0 else ""


def flags_known(module: str, toks: list[str]) -> tuple[str, list[str]]:
    """The help text used and the ``--flags`` of ``toks`` it does not list."""
    first = next((t for t in toks if not t.startswith("-")), None) if toks and \
        not toks[0].startswith("-") else None
    sub = first.split("|")[0] if first else None
    text = (help_of(module, sub) if sub else "") or help_of(module, None)
    assert text, f"python -m {module} --help failed: not a command of this project?"
    flags = {t.split("=")[0] for t in toks if re.fullmatch(r"--[a-z][\w-]*(=.*)?", t)}
    return text, sorted(f for f in flags if not re.search(rf"(^|[\s\[,]){re.escape(f)}\b", text))


def _cases():
    for page in PAGES:
        for line, block, _ in shell_blocks(page):
            for module, toks in commands(block):
                yield pytest.param(module, toks, id=f"{page.relative_to(REPO)}:{line}:{module}")


CASES = list(_cases())


def test_the_docs_have_commands_to_check():
    """The extraction itself works: the README's main job and the analysis page's plan."""
    ids = [c.id for c in CASES]
    assert any(i.startswith("README.md") and i.endswith(":loadgen") for i in ids), ids
    assert any(i.startswith("docs/analysis.md") and i.endswith(":analysis") for i in ids), ids
    assert len(CASES) >= 30, len(CASES)


@pytest.mark.parametrize("module, toks", CASES)
def test_documented_flags_exist(module, toks):
    _, unknown = flags_known(module, toks)
    assert unknown == [], f"python -m {module}: the docs use flags its parser does not know"


def test_the_flag_check_can_fail():
    """A flag no parser has is caught (the check is not vacuous)."""
    _, unknown = flags_known("loadgen", ["--tier", "low", "--no-such-flag"])
    assert unknown == ["--no-such-flag"]


RUN_CASES = [pytest.param(block, id=f"{p.relative_to(REPO)}:{line}")
             for p in PAGES for line, block, runnable in shell_blocks(p) if runnable]


def test_some_blocks_are_runnable():
    assert len(RUN_CASES) >= 2, RUN_CASES


@pytest.mark.parametrize("block", RUN_CASES)
def test_runnable_blocks_run(block, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "SPECLOAD_HOME": str(REPO)}
    p = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]


def test_cli_reference_is_current():
    p = subprocess.run([sys.executable, str(REPO / "docs" / "gen_cli_reference.py"), "--check"],
                       cwd=REPO, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr


LINK = re.compile(r"\]\(([^)#\s]+)(#[^)]*)?\)")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(page):
    missing = [m.group(1) for m in LINK.finditer(page.read_text())
               if "://" not in m.group(1) and not (page.parent / m.group(1)).exists()]
    assert missing == []


def test_screenshot_script_draws_a_report(tmp_path):
    """``docs/screenshot.py`` (the README's picture) draws a real HTML report to a PNG."""
    import shutil

    if shutil.which("chromium") is None:
        pytest.skip("chromium absent: apt-get install -y chromium (.ci/run installs it)")
    from tests.analysis_synth import write_run

    run = tmp_path / "run"
    write_run(run)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-m", "analysis", "report", str(run)], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    out = tmp_path / "shot.png"
    s = subprocess.run([sys.executable, str(REPO / "docs" / "screenshot.py"), str(run), "--out",
                        str(out), "--width", "800", "--height", "600"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=300)
    assert s.returncode == 0, s.stderr[-2000:]
    png = out.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert int.from_bytes(png[16:20], "big") == 800 and int.from_bytes(png[20:24], "big") == 600
    bad = subprocess.run([sys.executable, str(REPO / "docs" / "screenshot.py"), str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "run_dir" in bad.stderr
