"""Tier file schema: the shipped file validates; bad files get errors naming the key path."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import yaml

from configs.tiers import DEFAULT_TIERS_FILE, TierConfigError, load_tiers, parse_tiers


def _data() -> dict:
    return yaml.safe_load(DEFAULT_TIERS_FILE.read_text())


def test_shipped_tiers_validate_and_cpu_is_default():
    t = load_tiers()
    assert t.default_profile == "cpu"
    cpu, gpu = t.profile(), t.profile("gpu")
    assert cpu.cell("low", "short").users == 1 and cpu.cell("high", "long").users == 16
    assert 128 <= gpu.cell("high", "short").users <= 256
    assert 1024 <= gpu.cell("low", "long").max_tokens.upper <= 2048
    # cpu `--tier all`: 36 cells (6 strategies) of duration + drain fit in ~12 minutes
    cells = [cpu.cell(ti, oc) for ti in ("low", "mid", "high") for oc in ("short", "long")]
    assert 6 * sum(c.duration_s + cpu.drain_timeout_s for c in cells) <= 12 * 60


def test_unknown_key_names_its_path():
    d = _data()
    d["profiles"]["cpu"]["tiers"]["low"]["short"]["userz"] = 3
    with pytest.raises(TierConfigError) as e:
        parse_tiers(d, "x.yaml")
    assert "profiles.cpu.tiers.low.short.userz" in str(e.value) and "x.yaml" in str(e.value)


@pytest.mark.parametrize("mutate, expect", [
    (lambda c: c.update(arrival="open"), "rate_rps"),
    (lambda c: c.update(rate_rps=3.0), "only for arrival 'open'"),
    (lambda c: c.update(max_tokens={"dist": "uniform", "min": 9, "max": 3}), "min (9) > max (3)"),
    (lambda c: c.update(users=0), "profiles.cpu.tiers.mid.long.users"),
    (lambda c: c["slo"].update(ttft=5), "profiles.cpu.tiers.mid.long.slo.ttft"),
])
def test_bad_cells(mutate, expect):
    d = copy.deepcopy(_data())
    mutate(d["profiles"]["cpu"]["tiers"]["mid"]["long"])
    with pytest.raises(TierConfigError, match=expect.replace("(", r"\(").replace(")", r"\)")):
        parse_tiers(d)


def test_missing_tier_and_bad_default():
    d = _data()
    del d["profiles"]["gpu"]["tiers"]["high"]
    with pytest.raises(TierConfigError, match="profiles.gpu.tiers.high"):
        parse_tiers(d)
    d = _data()
    d["default_profile"] = "tpu"
    with pytest.raises(TierConfigError, match="tpu"):
        parse_tiers(d)


def test_cli_reports_bad_tier_file(tmp_path):
    d = _data()
    d["profiles"]["cpu"]["tiers"]["high"]["long"]["duraton_s"] = 1
    f = tmp_path / "bad.yaml"
    f.write_text(yaml.safe_dump(d))
    p = subprocess.run([sys.executable, "-m", "loadgen", "--tier", "low", "--tiers-file", str(f),
                        "--target", "http://127.0.0.1:9"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert "profiles.cpu.tiers.high.long.duraton_s" in p.stdout + p.stderr


def _loadgen(*args, timeout=120):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "loadgen", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_cli_rejects_bad_duration_and_workers():
    r = _loadgen("--tier", "low", "--duration", "-1", "--target", "http://127.0.0.1:9")
    assert r.returncode == 2 and "--duration" in r.stderr
    r = _loadgen("--tier", "low", "--workers", "-2", "--target", "http://127.0.0.1:9")
    assert r.returncode == 2 and "--workers" in r.stderr


def test_unreachable_target_fails_fast_with_a_message(tmp_path):
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = _loadgen("--tier", "low", "--target", f"http://127.0.0.1:{port}", "--results",
                 str(tmp_path))
    assert r.returncode == 2
    assert "v1/models" in r.stdout and "is the server up" in r.stdout
    assert not any(tmp_path.iterdir())  # nothing was sent, no empty run directory
