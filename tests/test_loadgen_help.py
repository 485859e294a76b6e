"""``python -m loadgen --help`` a user can read: argument groups, every flag with help, a
one-line description without markup, an epilog of real examples that the parser takes, and
two screens at 100 columns."""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from loadgen.cli.args import DESCRIPTION, EXAMPLES, build_parser, parse_args

REPO = Path(__file__).resolve().parent.parent
GROUPS = ["what to load", "against what target", "how long, racing",
          "where results go, checks after the cells", "credentials, HTTP"]


def _help() -> str:
    env = {**os.environ, "COLUMNS": "100", "PYTHONPATH": str(REPO)}
    p = subprocess.run([sys.executable, "-m", "loadgen", "--help"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return p.stdout


def test_every_flag_is_in_a_group_with_help():
    ap = build_parser()
    groups = {g.title: g for g in ap._action_groups}
    assert [t for t in groups if t in GROUPS] == GROUPS
    grouped = [a for t in GROUPS for a in groups[t]._group_actions]
    flags = [a for a in ap._actions if not isinstance(a, argparse._HelpAction)]
    assert sorted(id(a) for a in grouped) == sorted(id(a) for a in flags)   # none left ungrouped
    bare = [a.option_strings[0] for a in flags if not (a.help or "").strip()]
    assert bare == []
    assert "--output" in {s for a in flags for s in a.option_strings}


def test_the_help_fits_two_screens_and_reads_plainly():
    text = _help()
    lines = text.splitlines()
    assert len(lines) <= 100, len(lines)
    assert max(len(ln) for ln in lines) <= 100
    assert "``" not in text and "\n" not in DESCRIPTION and len(DESCRIPTION) <= 100
    for title in GROUPS:
        assert f"\n{title}:\n" in text
    route = text[text.index("--route"):text.index("--workers")]
    assert len(route.splitlines()) <= 4   # details live in docs/loadgen.md
    assert text.count("\n  python -m loadgen ") == len(EXAMPLES) == 5


@pytest.mark.parametrize("example", [cmd for _, cmd in EXAMPLES])
def test_the_examples_parse_with_the_real_parser(example, tmp_path, monkeypatch):
    argv = shlex.split(example)
    assert argv[:3] == ["python", "-m", "loadgen"]
    monkeypatch.chdir(tmp_path)                  # --results' default folder is made here, if at all
    args = parse_args(argv[3:])
    assert args.tier or args.sweep


def test_every_example_of_the_epilog_is_in_the_help():
    text = _help()
    for what, cmd in EXAMPLES:
        assert f"  # {what}\n  {cmd}\n" in text


def test_the_dry_run_example_runs(tmp_path):
    """The epilog's --dry-run example as a user runs it: no service started, the plan printed."""
    cmd = next(c for _, c in EXAMPLES if "--dry-run" in c)
    env = {**os.environ, "COLUMNS": "100", "PYTHONPATH": str(REPO)}
    p = subprocess.run([sys.executable, *shlex.split(cmd)[1:], "--results", str(tmp_path / "res")],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.startswith("plan: ") and "dry run: no request sent, nothing written" in p.stdout
    assert not (tmp_path / "res").exists()
