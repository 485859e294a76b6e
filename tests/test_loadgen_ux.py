"""What a user of ``python -m loadgen`` sees and what it writes.

- the console summary fits ``COLUMNS=100`` and never cuts a number; summary.csv
  holds every column;
- progress when stdout is not a terminal: one plain ``cell i/N`` line per cell,
  with an ETA;
- every JSON file written parses with a strict reader (``parse_constant`` raising);
- ``--api-key`` / ``--header`` reach the server and never any file or log line;
- https targets: verified by default, ``--insecure`` to skip, a self-signed
  certificate trusted through ``SSL_CERT_FILE``;
- a typo in ``--strategies`` fails before anything starts.

The load generator runs as a subprocess (locust monkey-patches gevent on import)
against the fake streaming server (127.0.0.1, ephemeral port).
"""

from __future__ import annotations

import csv
import datetime
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from configs import metric_names as M
from configs.jsonio import loads_strict
from configs.tiers import Slo
from loadgen.tools import fake_server
from loadgen.results.summary import CONSOLE_COLUMNS, SUMMARY_CSV, csv_columns, render_table, summarize_cell
from tests.tiers_file import write_tiers

REPO = Path(__file__).resolve().parent.parent
KEY = "sk-test-4f1c9e0b7d2a"
TEAM = "team-secret-93ab"


def _tiers(tmp_path: Path) -> Path:
    cell = {"users": 2, "spawn_rate": 100, "duration_s": 1, "max_tokens": 8,
            "slo": {"ttft_ms": 1000, "tpot_ms": 100}}
    return write_tiers(tmp_path, cell, drain_timeout_s=2)


def _loadgen(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"}
    e.update(COLUMNS="100", **(env or {}))
    return subprocess.run([sys.executable, "-m", "loadgen", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env=e)


def test_run_output_json_and_secrets(tmp_path):
    """One run, 2 strategies x 3 tiers, stdout a pipe (not a TTY), key + header required."""
    with fake_server.running("--ttft-ms", "20", "--gap-ms", "5", "--api-key", KEY) as url:
        p = _loadgen("--tier", "all", "--output", "short", "--target", url, "--tiers-file",
                     str(_tiers(tmp_path)), "--results", str(tmp_path / "res"), "--strategies",
                     "autoregressive,ngram", "--report", "--api-key", KEY, "--header", f"X-Team: {TEAM}")
        auth = fake_server.get_json(f"{url}/fake/auth")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    # the key and the header were sent on every call (model list, completions, step log)
    assert auth["accepted"] > 20 and auth["rejected"] == 0
    assert auth["x_headers"]["X-Team"] == TEAM
    out = p.stdout
    run_dir = Path(out.strip().splitlines()[-1].split("results: ", 1)[1])

    # non-TTY progress: one plain line per finished cell, in order, with an ETA but the last
    lines = [ln for ln in out.splitlines() if re.match(r"cell \d+/6 ", ln)]
    assert [int(re.match(r"cell (\d+)/", ln).group(1)) for ln in lines] == [1, 2, 3, 4, 5, 6]
    assert all("ETA " in ln for ln in lines[:-1]) and "ETA" not in lines[-1]
    assert lines[0].startswith("cell 1/6 autoregressive low/short: ok ")
    assert "\x1b[" not in out  # no terminal control codes in a log

    # the console table: the report's cell table (repeats pooled, warm-up cut), fits 100
    # columns, no ellipsis, every number whole
    from analysis.data.load import load_results
    from analysis.report.build import prepare
    from loadgen.results.summary import CELL_COLUMNS

    rows = list(csv.DictReader((run_dir / SUMMARY_CSV).open()))
    assert list(rows[0]) == csv_columns() and len(rows) == 6
    cells = prepare(load_results(run_dir))[-1]
    table = out[out.index("per strategy x cell (repeats pooled)"):out.index("Columns: ")]
    assert max(len(ln) for ln in table.splitlines()) <= 100 and "…" not in out
    for r in cells.to_dict("records"):
        line = next(ln for ln in table.splitlines()
                    if ln.split()[:3] == [r["strategy"], r["tier"], r["output_class"]])
        assert f"{r['output_tokens_per_s']:.1f}" in line.split()
        assert f"{r['ttft_ms_p50']:.0f}" in line.split()
    # every shown column is explained
    legend = out[out.index("Columns: "):]
    for name, _, _ in CELL_COLUMNS[3:]:
        if f" {name} " in table.splitlines()[1] + " ":
            assert f"{name}: " in legend

    # strict JSON for every JSON file the run wrote (manifest, recommendation)
    written = sorted(run_dir.rglob("*.json"))
    assert {f.relative_to(run_dir).as_posix() for f in written} >= {"manifest.json",
                                                                     "report/recommendation.json"}
    for f in written:
        loads_strict(f.read_text())
    # the same names in the manifest, summary.csv and the report's per-cell table
    man = loads_strict((run_dir / "manifest.json").read_text())
    assert {M.CELL_OUTPUT_TOKENS_PER_S, M.CELL_TTFT_MS_P50, M.CELL_N_OK} <= set(man["cells"][0])
    assert "output_tok_s" not in man["cells"][0]
    # one definition per figure: the console / summary.csv numbers are the report's
    from analysis.data import metrics
    from analysis.data.load import load_results
    from analysis.data.slo import resolve_slos

    res = load_results(run_dir)
    flagged = metrics.with_slo_flags(res.requests, resolve_slos(["low", "mid", "high"], res.manifest_config))
    report_cells = metrics.cell_table(flagged).set_index(["strategy", "tier"])
    for r in rows:
        rc = report_cells.loc[(r["strategy"], r["tier"])]
        for name in (M.CELL_OUTPUT_TOKENS_PER_S, M.CELL_SLO_ATTAINMENT, M.CELL_TTFT_MS_P50, M.ACCEPTANCE_LENGTH,
                     M.CELL_SPEEDUP):
            assert float(r[name]) == pytest.approx(float(rc[name]), rel=1e-4), (name, r["strategy"], r["tier"])
    # credentials: in no file written, in no log line; the manifest says they were redacted
    for f in run_dir.rglob("*"):
        if f.is_file():
            data = f.read_bytes()
            assert KEY.encode() not in data and TEAM.encode() not in data, f
    assert KEY not in out + p.stderr and TEAM not in out + p.stderr
    assert man["args"]["api_key"] == "<redacted>" and man["args"]["header"] == ["X-Team: <redacted>"]
    # headline: the answer first, low / mid / high
    head = [ln.strip() for ln in out.splitlines() if re.match(r"\s+(low|mid|high) / short: ", ln)]
    assert [h.split()[0] for h in head] == ["low", "mid", "high"]
    assert all(" run " in h and "confidence" in h for h in head)


def test_missing_key_names_the_flag(tmp_path):
    with fake_server.running("--api-key", KEY) as url:
        p = _loadgen("--tier", "low", "--target", url, "--tiers-file", str(_tiers(tmp_path)),
                     "--results", str(tmp_path / "res"))
    assert p.returncode == 2
    assert "HTTP 401" in p.stdout and "--api-key" in p.stdout


def test_unknown_strategy_fails_before_starting_anything(tmp_path):
    """No --target: the names are checked against configs/serve.yaml before `cluster up`."""
    p = _loadgen("--tier", "low", "--strategies", "autoregressive,ngramm", "--results",
                 str(tmp_path / "res"), timeout=60)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "python -m loadgen: error: --strategies: 'ngramm' not deployed" in p.stderr
    assert "cluster up" not in p.stderr and "starting or reusing" not in p.stdout
    assert "cluster down" not in p.stdout   # nothing was started, so nothing to stop
    assert not (tmp_path / "res").exists()


def _self_signed(tmp_path: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 (SAN IP) and its key, PEM files."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    c, k = tmp_path / "cert.pem", tmp_path / "key.pem"
    c.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    k.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption()))
    return c, k


def test_https_target_verified_by_default(tmp_path):
    pytest.importorskip("cryptography")
    cert, key = _self_signed(tmp_path)
    tiers = str(_tiers(tmp_path))
    common = ("--tier", "low", "--output", "short", "--tiers-file", tiers, "--strategies", "ngram")
    with fake_server.running("--ttft-ms", "10", "--gap-ms", "5", "--tls-cert", str(cert),
                             "--tls-key", str(key)) as url:
        assert url.startswith("https://")
        refused = _loadgen(*common, "--target", url, "--results", str(tmp_path / "a"))
        insecure = _loadgen(*common, "--target", url, "--results", str(tmp_path / "b"), "--insecure")
        trusted = _loadgen(*common, "--target", url, "--results", str(tmp_path / "c"),
                           env={"SSL_CERT_FILE": str(cert)})
    # an unknown self-signed certificate is refused unless asked otherwise
    assert refused.returncode == 2 and "CERTIFICATE_VERIFY_FAILED" in refused.stdout
    for p in (insecure, trusted):
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
        assert re.search(r"cell 1/1 ngram low/short: ok (\d+)/\1,", p.stdout), p.stdout


def test_tau_one_definition():
    """tau = 1.00 when the server reports zero drafts; undefined (NaN -> null) without stats."""
    def rows(**extra):
        return [{M.REQ_STATUS: M.STATUS_OK, M.REQ_SENT_TS: 0.0, M.REQ_END_TS: 1.0, M.REQ_OUTPUT_TOKENS: 4,
                 M.REQ_TTFT_MS: 10.0, M.REQ_TPOT_MS: 5.0, **extra}]
    kw = dict(strategy="autoregressive", tier="low", output_class="short", arrival="closed", users=1,
              rate_rps=None, slo=Slo(ttft_ms=100, tpot_ms=100), window=(0.0, 1.0), cpu_samples=[])
    ar = summarize_cell(rows(**{M.NUM_DRAFTS: 0, M.NUM_ACCEPTED_TOKENS: 0}), **kw)
    assert ar.acceptance_length == 1.0
    other = summarize_cell(rows(), **kw)
    assert math.isnan(other.acceptance_length)
    table, _ = render_table([ar, other], 100)
    assert table.columns[[c.header for c in table.columns].index("tau")]._cells == ["1.00", "-"]
