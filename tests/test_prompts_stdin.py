"""Prompts from standard input, as Unix tools read them (issue 23): ``-`` and
``/dev/stdin`` (a pipe, which an ``is_file()`` check used to refuse) for
``python -m loadgen --dataset/--prompts`` and ``python -m actors.generate --prompts``;
the run keeps what it read as ``prompts.jsonl``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from configs.jsonio import SourceError, read_text_source
from loadgen.run.datasets import PROMPTS_FILE, load_dataset
from loadgen.tools import fake_server
from tests.tiers_file import write_tiers

REPO = Path(__file__).resolve().parent.parent
ROWS = [{"prompt_id": f"mine-{i}", "prompt": f"def f{i}(x):\n    return x +", "max_tokens": 4}
        for i in range(3)]
TEXT = "".join(json.dumps(r) + "\n" for r in ROWS)


def test_read_text_source_kinds(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(TEXT)
    assert read_text_source(str(f)) == ("p", TEXT)
    r, w = os.pipe()   # a pipe is not a regular file: the stream read must still work
    os.write(w, TEXT.encode())
    os.close(w)
    assert read_text_source(f"/dev/fd/{r}")[1] == TEXT
    os.close(r)
    with pytest.raises(SourceError, match="is a directory"):
        read_text_source(str(tmp_path))
    with pytest.raises(SourceError, match="does not exist"):
        read_text_source(str(tmp_path / "nope.jsonl"))


def test_load_dataset_from_stdin(monkeypatch):
    import io

    monkeypatch.setattr(sys, "stdin", io.StringIO(TEXT))
    got = load_dataset("-")
    assert [p.prompt_id for p in got] == ["mine-0", "mine-1", "mine-2"]
    assert [p.max_tokens for p in got] == [4, 4, 4]


@pytest.mark.parametrize("spec", ["-", "/dev/stdin"])
def test_generate_reads_stdin(spec):
    p = subprocess.run([sys.executable, "-m", "actors.generate", "--prompts", spec,
                        "--max-tokens", "3"], input=TEXT, capture_output=True, text=True,
                       timeout=300, cwd=REPO)
    assert p.returncode == 0, p.stderr[-2000:]
    out = [json.loads(line) for line in p.stdout.splitlines()]
    assert [o["id"] for o in out] == [0, 1, 2] and all(len(o["token_ids"]) == 3 for o in out)


def test_loadgen_run_reads_stdin_and_keeps_the_prompts(tmp_path):
    tiers = write_tiers(tmp_path, {"users": 1, "spawn_rate": 10, "duration_s": 1, "max_tokens": 8,
                                   "slo": {"ttft_ms": 1000, "tpot_ms": 100}}, drain_timeout_s=2)
    with fake_server.running("--ttft-ms", "5", "--gap-ms", "2") as url:
        p = subprocess.run([sys.executable, "-m", "loadgen", "--tier", "low", "--output", "short",
                            "--target", url, "--strategies", "autoregressive", "--tiers-file",
                            str(tiers), "--results", str(tmp_path / "res"), "--run-id", "stdin",
                            "--prompts", "-", "--consistency", "0"],
                           input=TEXT, capture_output=True, text=True, timeout=180, cwd=REPO)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    run = tmp_path / "res" / "stdin"
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["dataset"] == "-" and manifest["dataset_file"] == PROMPTS_FILE
    assert manifest["num_prompts"] == 3
    kept = sorted(json.loads(line)["prompt_id"] for line in (run / PROMPTS_FILE).read_text().splitlines())
    assert kept == ["mine-0", "mine-1", "mine-2"]
    import pandas as pd

    ids = set(pd.read_parquet(run / "requests.parquet")["prompt_id"])
    assert ids and ids <= {"mine-0", "mine-1", "mine-2"}


def test_loadgen_empty_stdin_names_the_flag(tmp_path):
    p = subprocess.run([sys.executable, "-m", "loadgen", "--tier", "low", "--target",
                        "http://127.0.0.1:9", "--strategies", "autoregressive", "--dataset", "-",
                        "--results", str(tmp_path)], input="", capture_output=True, text=True,
                       timeout=120, cwd=REPO)
    assert p.returncode == 2 and "--dataset" in p.stdout + p.stderr and "no prompts" in p.stdout + p.stderr
