"""``python -m analysis --help`` and each subcommand's help document every argument
(issue 39, item 5): no argument without help, one-line descriptions, the positional
RESULTS_DIR of ``plan`` described, the examples of the epilog use real flags."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from analysis.cli import build_parser

REPO = Path(__file__).resolve().parent.parent


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


SUBS = _subparsers(build_parser())


def test_every_subcommand_is_listed():
    assert set(SUBS) == {"report", "plan", "surface", "backtest", "policy"}


@pytest.mark.parametrize("name", sorted(SUBS))
def test_every_argument_has_help(name):
    missing = [a.dest for a in SUBS[name]._actions
               if not isinstance(a, argparse._HelpAction) and not (a.help or "").strip()]
    assert missing == [], f"python -m analysis {name}: arguments without help: {missing}"


@pytest.mark.parametrize("name", sorted(SUBS))
def test_descriptions_are_one_line(name):
    sub = SUBS[name]
    assert sub.description and "\n" not in sub.description, (name, sub.description)
    top = build_parser()
    listed = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    helps = {c.dest: c.help for c in listed._choices_actions}
    assert helps[name] and "\n" not in helps[name], (name, helps[name])


def test_top_description_is_plain_one_line():
    d = build_parser().description
    assert "\n" not in d and "``" not in d, d


def test_plan_help_describes_its_results_dir():
    env = {**os.environ, "COLUMNS": "100", "PYTHONPATH": str(REPO)}
    p = subprocess.run([sys.executable, "-m", "analysis", "plan", "--help"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    positional = p.stdout.split("positional arguments:")[1].split("options:")[0]
    assert re.search(r"results_dir\s+a run directory", positional), positional


def test_epilog_examples_use_known_flags():
    """Every ``--flag`` of the epilog's examples is one its subcommand's parser knows."""
    top = build_parser()
    lines = [ln.strip() for ln in top.epilog.splitlines() if ln.strip().startswith("python -m analysis")]
    assert len(lines) >= 5, lines
    checked = 0
    for line in lines:
        name = line.split()[3]
        known = {o for a in SUBS[name]._actions for o in a.option_strings}
        used = re.findall(r"(?<!\S)--[a-z][\w-]*", line)
        assert set(used) <= known, (line, sorted(set(used) - known))
        checked += len(used)
    assert checked >= 8, checked
