"""The target's own Prometheus metrics during the run (``--server-metrics``).

specload measures its own engine from the inside (the step log); a real engine
(vLLM, SGLang) is read from what it publishes on ``/metrics``. This module
fetches that page (urllib), parses it with ``prometheus_client``'s text parser,
keeps the series named in ``configs.metric_names.SERVER_METRIC_NAMES`` for the
served model(s) only, and turns the samples of one cell into per-cell figures:

- counters (drafts, draft / accepted tokens, accepted per position, prompt and
  generation tokens, engine steps, ...): delta over the cell = the sum of the
  positive increments between consecutive samples; a counter that went DOWN
  (the server restarted) counts from 0 again, so its new value is the
  increment (``counter_delta``) and the reset is counted, never subtracted;
- gauges (running batch, queue, KV cache use): mean and max over the samples.

The poll runs on an operating-system thread, not a greenlet: the load
generator's gevent loop stamps stream chunks, and a parse (a few ms for
vLLM's ~600 lines; lines of unused families are dropped before parsing) must
not stall it. Every fetch is bounded in time (``SCRAPE_TIMEOUT_S``) and size
(``MAX_BYTES``), the sample count in memory is bounded (``MAX_SNAPSHOTS``).

Cell boundaries are bracketed by scrapes of their own (``mark``), so a cell's
delta covers its own traffic exactly, with nothing before or after it; other
traffic to the same engine DURING the cell is in the delta (vLLM labels its
series with the first ``--served-model-name`` only, whatever alias a request
used), which is why the analysis compares the deltas with the per-request
statistics when both exist.
"""

from __future__ import annotations

import math
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from configs import metric_names as M

DEFAULT_INTERVAL_S = 0.5
MIN_INTERVAL_S, MAX_INTERVAL_S = 0.25, 1.0    # 1 to 4 Hz
SCRAPE_TIMEOUT_S = 2.0                        # one fetch of /metrics, seconds
MAX_BYTES = 8 << 20                           # a larger page is refused
MAX_SNAPSHOTS = 100_000                       # 7 h at 4 Hz; the time series stops growing past it
SETTLE_MAX_S = 2.0                            # end of a cell: wait at most this for counters to settle
SETTLE_GAP_S = 0.25
METRICS_PATH = "/metrics"
NO_POSITION = -1                              # position of a series that has none
CREATED_SUFFIX = "@created"                   # canonical metric + this: the series' ``_created`` time (unix s)
PROCESS_START = "process_start_time_seconds"  # the process collector's start time (unix s): newer = restarted

Key = tuple[str, str, int]                    # (model label value, canonical metric, position)


class ServerMetricsError(RuntimeError):
    """The metrics endpoint could not be read or held none of the known series."""


@dataclass
class Snapshot:
    """One scrape: unix time (s, taken when the response arrived) and the kept values."""

    ts: float
    values: dict[Key, float]
    ok: bool = True


def _wanted_families(engine: str | None) -> dict[str, list[tuple[str, str]]]:
    """family name (``_total`` stripped) -> [(canonical metric, selector)] for ``engine``
    (every engine when None)."""
    out: dict[str, list[tuple[str, str]]] = {}
    engines = [engine] if engine else list(M.SERVER_METRIC_NAMES)
    for e in engines:
        for canon, (family, sel) in M.SERVER_METRIC_NAMES[e].items():
            out.setdefault(_base(family), []).append((canon, sel))
    return out


def _base(name: str) -> str:
    return name[:-len("_total")] if name.endswith("_total") else name


def _line_family(line: str) -> str:
    """The metric name a line of the text format is about (``# HELP/TYPE name ...`` or a sample)."""
    if line.startswith("#"):
        parts = line.split(None, 3)
        return parts[2] if len(parts) >= 3 else ""
    return line.split("{", 1)[0].split(None, 1)[0] if line.strip() else ""


def prefilter(text: str, families) -> str:
    """Only the lines of ``families`` (and their suffixed samples), bucket lines dropped.

    Not a parser: it cuts the page to what will be parsed, so the parse costs less than
    1 ms instead of ~6 ms for vLLM's whole page. A name matches a family when it is the
    family or the family plus ``_total`` / ``_count`` / ``_sum`` / ``_created``; the process
    collector's ``process_start_time_seconds`` is kept too (counter resets)."""
    keep = []
    fams = set(families)
    for line in text.splitlines():
        name = _line_family(line)
        if not name or name.endswith("_bucket"):
            continue
        if name == PROCESS_START:
            keep.append(line)
            continue
        for suffix in ("", "_total", "_count", "_sum", "_created"):
            if suffix and not name.endswith(suffix):
                continue
            stem = name[:len(name) - len(suffix)] if suffix else name
            if stem in fams or _base(stem) in fams:
                keep.append(line)
                break
    return "\n".join(keep) + "\n"


def detect_engine(text: str) -> str | None:
    """The engine kind whose names the page exposes most (``metric_names.ENGINE_KINDS``);
    None when it exposes none of them."""
    seen = {_base(_line_family(l)) for l in text.splitlines()}
    seen |= {n[:-len(s)] for n in seen for s in ("_count", "_sum") if n.endswith(s)}
    best, score = None, 0
    for engine, table in M.SERVER_METRIC_NAMES.items():
        n = sum(1 for fam, _ in table.values() if _base(fam) in seen)
        if n > score:
            best, score = engine, n
    return best


def parse_page(text: str, engine: str, model_label: str | None = None) -> tuple[dict[Key, float], set[str]]:
    """Parse one ``/metrics`` page with ``prometheus_client.parser.text_string_to_metric_families``.

    Returns ({(model, canonical metric, position): value}, model label values seen).
    Samples are summed over every label but the model label and ``position`` (vLLM's
    ``engine`` index, ``finished_reason``; specload's replica tags). A series without
    the model label is kept under the model ``""``. Raises ValueError on text the
    parser rejects."""
    from prometheus_client.parser import text_string_to_metric_families

    label = model_label or M.SERVER_MODEL_LABEL.get(engine, "model_name")
    wanted = _wanted_families(engine)
    values: dict[Key, float] = {}
    models: set[str] = set()
    start: float | None = None
    for fam in text_string_to_metric_families(prefilter(text, wanted)):
        if fam.name == PROCESS_START:
            starts = [float(x.value) for x in fam.samples if x.name == PROCESS_START]
            # several processes: the oldest (a process added later is not a restart of the rest)
            start = min(starts) if starts else None
            continue
        # a counter's creation time (``_created``: newer = it restarted), in the counter's family
        # (OpenMetrics) or a gauge family of its own (vLLM's text page)
        stem = fam.name[:-len("_created")] if fam.name.endswith("_created") else _base(fam.name)
        for canon, sel in wanted.get(stem, ()):
            if sel != "counter":
                continue
            for smp in fam.samples:
                if smp.name == stem + "_created" and not math.isnan(float(smp.value)):
                    pos = smp.labels.get(M.SRV_POSITION_LABEL)
                    key = (smp.labels.get(label, ""), canon + CREATED_SUFFIX,
                           int(pos) if pos is not None and pos.isdigit() else NO_POSITION)
                    # the oldest of the series summed into the key: a label value seen for
                    # the first time (a first ``finished_reason="stop"``) is a new series,
                    # not a restart; a restart recreates them all, so the oldest moves too
                    values[key] = min(values.get(key, math.inf), float(smp.value))
        if fam.name.endswith("_created"):
            continue
        for canon, sel in wanted.get(_base(fam.name), ()):
            if sel == "counter" and fam.type not in ("counter", "unknown"):
                continue   # Ray also exports a counter as a deprecated gauge of the same name
            if sel == "gauge" and fam.type not in ("gauge", "unknown"):
                continue
            for s in fam.samples:
                if not _selected(s.name, fam.name, sel):
                    continue
                v = float(s.value)
                if math.isnan(v):
                    continue
                model = s.labels.get(label, "")
                models.add(model)
                pos = s.labels.get(M.SRV_POSITION_LABEL)
                key = (model, canon, int(pos) if pos is not None and pos.isdigit() else NO_POSITION)
                values[key] = values.get(key, 0.0) + v
    if start is not None:
        for m in models:
            values[(m, PROCESS_START, NO_POSITION)] = start
    return values, models


def _selected(sample: str, family: str, sel: str) -> bool:
    if sel == "counter":
        return sample in (family + "_total", _base(family) + "_total", family)
    if sel == "gauge":
        return sample == family
    if sel == "hist_count":
        return sample == family + "_count"
    if sel == "hist_sum":
        return sample == family + "_sum"
    raise ValueError(f"unknown selector {sel!r}")


def resolve_model(requested: str, seen: set[str]) -> tuple[str | None, str | None]:
    """Which model label value holds ``requested``'s series: (label value or None, note).

    The name itself when the page labels series with it; else the only model on the
    page (vLLM labels every alias with its first served name; the note says so); None
    when several other models are on the page."""
    if requested in seen:
        return requested, None
    named = sorted(m for m in seen if m)
    if len(named) == 1:
        return named[0], (f"the server labels its series {named[0]!r}, not {requested!r} (one engine "
                          f"serving several names: its counters include every alias)")
    if not named and "" in seen:
        return "", "the server's series carry no model label: every model's traffic is in them"
    return None, f"no series labelled {requested!r} on the page (models there: {named})"


def counter_delta(values: list[float], created: list[float | None] | None = None,
                  starts: list[float | None] | None = None) -> tuple[float, int]:
    """(sum of the increments, resets) over one counter's samples in time order.

    A reset (the server restarted; the counter counts from 0 again, so the new value
    itself is the increment) is seen three ways: the sample is below its predecessor
    (Prometheus' own rule, ``rate()`` / ``increase()``); or its ``_created`` time
    (``created[i]``) is newer than the predecessor's; or the process start time
    (``process_start_time_seconds``, ``starts[i]``) is. The last two catch a counter that
    restarted and passed its old value between two scrapes (1000 -> 1200 with a newer
    ``_created`` is an increment of 1200, not 200). ``None`` samples (a failed scrape) are
    skipped; a missing creation / start time never signals a reset."""
    total, resets, prev, prev_i = 0.0, 0, None, None
    for i, v in enumerate(values):
        if v is None:
            continue
        if prev is not None:
            restarted = v < prev
            for marks in (created, starts):
                if marks is not None and marks[i] is not None and marks[prev_i] is not None \
                        and marks[i] > marks[prev_i]:
                    restarted = True
            if restarted:
                resets += 1
                total += v
            else:
                total += v - prev
        prev, prev_i = v, i
    return total, resets


def cell_figures(snapshots: list[Snapshot], model: str, k_max: int | None = None) -> dict[str, Any]:
    """Per-cell figures of ``model`` from the cell's snapshots (bracketing ones included).

    Counters: delta (``counter_delta``; a series first seen after a successful scrape
    counts from 0, it was created then). Per-position counts: the list
    ``num_accepted_tokens_per_pos`` (index = 0-based draft position). Gauges:
    ``<name>_mean`` / ``<name>_max``. Also ``samples``, ``failed_scrapes``,
    ``counter_resets``, ``window_s`` and ``acceptance_length`` (1 + accepted / drafts,
    None without drafts counted). A metric the server never exposed is absent."""
    ok = sorted((s for s in snapshots if s.ok), key=lambda s: s.ts)
    out: dict[str, Any] = {"samples": len(ok), "failed_scrapes": len(snapshots) - len(ok),
                           "counter_resets": 0,
                           "window_s": (ok[-1].ts - ok[0].ts) if len(ok) >= 2 else 0.0}
    keys = sorted({k for s in ok for k in s.values if k[0] == model})
    per_pos: dict[int, float] = {}
    for key in keys:
        _, canon, pos = key
        if canon in M.SRV_COUNTERS:
            series = []
            for i, s in enumerate(ok):
                v = s.values.get(key)
                if v is None and any(key in p.values for p in ok[i:]) and not any(
                        key in p.values for p in ok[:i]):
                    v = 0.0   # not yet created at this scrape: it starts from 0
                series.append(v)
            created = [s.values.get((key[0], canon + CREATED_SUFFIX, pos)) for s in ok]
            starts = [s.values.get((key[0], PROCESS_START, NO_POSITION)) for s in ok]
            delta, resets = counter_delta(series, created, starts)
            out["counter_resets"] += resets
            if canon == M.SRV_NUM_ACCEPTED_PER_POS:
                per_pos[pos] = delta
            else:
                out[canon] = delta
        elif canon in M.SRV_GAUGES:
            vals = [s.values[key] for s in ok if key in s.values]
            if vals:
                out[f"{canon}_mean"] = sum(vals) / len(vals)
                out[f"{canon}_max"] = max(vals)
    if per_pos:
        width = max(per_pos) + 1
        out[M.SRV_NUM_ACCEPTED_PER_POS] = [per_pos.get(i, 0.0) for i in range(width)]
    for k, v in list(out.items()):   # integral counts as ints (JSON, CSV)
        if isinstance(v, float) and v.is_integer() and k in M.SRV_COUNTERS:
            out[k] = int(v)
        elif isinstance(v, list):
            out[k] = [int(x) if float(x).is_integer() else x for x in v]
    drafts = out.get(M.SRV_NUM_DRAFTS)
    out[M.ACCEPTANCE_LENGTH] = (M.acceptance_length(int(drafts), int(out.get(M.SRV_NUM_ACCEPTED_TOKENS, 0)))
                                if drafts else None)
    return out


def _start_os_thread(fn) -> None:
    """Run ``fn`` on a real OS thread, also when gevent has patched ``threading`` (its
    Thread would then be a greenlet of the loop it must stay off)."""
    monkey = sys.modules.get("gevent.monkey")
    if monkey is not None and monkey.is_module_patched("threading"):
        monkey.get_original("_thread", "start_new_thread")(fn, ())
    else:
        threading.Thread(target=fn, name="specload-server-metrics", daemon=True).start()


@dataclass
class Poller:
    """Scrapes ``url`` every ``interval_s`` on an OS thread while started; ``mark`` scrapes now.

    ``engine`` and ``models`` (served name -> model label value) come from ``probe``.
    ``snapshots`` is the run's time series (bounded by ``MAX_SNAPSHOTS``)."""

    url: str
    interval_s: float = DEFAULT_INTERVAL_S
    headers: dict[str, str] = field(default_factory=dict)
    insecure: bool = False
    timeout_s: float = SCRAPE_TIMEOUT_S
    engine: str | None = None
    labels: set[str] = field(default_factory=set)   # model label values to keep (empty: all)
    snapshots: list[Snapshot] = field(default_factory=list)
    failed: int = 0
    last_error: str | None = None
    truncated: bool = False
    _running: bool = False
    _done: bool = True

    def fetch(self) -> str:
        """The page's text. Raises ServerMetricsError (HTTP status, timeout, size, connection).

        urllib, as the load generator's other preflight calls (``loadgen.run.service``):
        httpx cannot be imported in the gevent-patched load-generator process where trio is
        installed (httpcore imports trio, which needs the ``select.epoll`` gevent removes)."""
        import urllib.error
        import urllib.request

        from loadgen.run.service import ssl_context

        req = urllib.request.Request(self.url, headers={"Accept": "text/plain", **self.headers})
        ctx = ssl_context(self.insecure) if self.url.startswith("https") else None
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s, context=ctx) as resp:  # noqa: S310
                body = resp.read(MAX_BYTES + 1)
        except urllib.error.HTTPError as err:
            raise ServerMetricsError(f"GET {self.url}: HTTP {err.code}") from None
        except (urllib.error.URLError, OSError, ValueError) as err:
            raise ServerMetricsError(f"GET {self.url}: {type(err).__name__}: {err}") from None
        if len(body) > MAX_BYTES:
            raise ServerMetricsError(f"GET {self.url}: page larger than {MAX_BYTES} bytes")
        return body.decode("utf-8", errors="replace")

    def probe(self) -> str:
        """First fetch: detect the engine kind (unless given). Raises ServerMetricsError when
        the page cannot be read or holds none of the known series."""
        text = self.fetch()
        if self.engine is None:
            self.engine = detect_engine(text)
        if self.engine is None:
            raise ServerMetricsError(f"{self.url} exposes none of the series specload knows "
                                     f"(vLLM, SGLang, specload: configs/metric_names.py)")
        values, models = parse_page(text, self.engine)
        self._seen = models
        return text

    def seen_models(self) -> set[str]:
        return set(getattr(self, "_seen", set()))

    def mark(self) -> Snapshot:
        """Scrape now (on the calling thread); the snapshot joins the time series."""
        try:
            values, models = parse_page(self.fetch(), self.engine or "")
            self._seen = self.seen_models() | models
            if self.labels:
                values = {k: v for k, v in values.items() if k[0] in self.labels}
            snap = Snapshot(time.time(), values)
        except (ServerMetricsError, ValueError) as err:
            self.failed += 1
            self.last_error = str(err)[:300]
            snap = Snapshot(time.time(), {}, ok=False)
        if len(self.snapshots) < MAX_SNAPSHOTS:
            self.snapshots.append(snap)
        else:
            self.truncated = True
        return snap

    def settle(self, max_s: float = SETTLE_MAX_S) -> Snapshot:
        """End of a cell: scrape until two scrapes ``SETTLE_GAP_S`` apart agree on every
        counter (the server updates them just after the last response), at most ``max_s``."""
        deadline = time.monotonic() + max_s
        last = self.mark()
        while time.monotonic() < deadline:
            time.sleep(SETTLE_GAP_S)
            snap = self.mark()
            if snap.ok and last.ok and _counters(snap) == _counters(last):
                return snap
            last = snap
        return last

    def start(self) -> None:
        """Poll on an OS thread until ``stop``."""
        if self._running:
            return
        self._running, self._done = True, False

        def loop() -> None:
            try:
                while self._running:
                    t = time.monotonic()
                    self.mark()
                    while self._running and time.monotonic() - t < self.interval_s:
                        time.sleep(min(0.05, self.interval_s))
            finally:
                self._done = True

        _start_os_thread(loop)

    def stop(self, timeout_s: float = SCRAPE_TIMEOUT_S + 1.0) -> None:
        """Stop polling; waits up to ``timeout_s`` for the thread's last scrape."""
        self._running = False
        deadline = time.monotonic() + timeout_s
        while not self._done and time.monotonic() < deadline:
            time.sleep(0.02)

    def window(self, t0: float, t1: float) -> list[Snapshot]:
        """Snapshots with t0 <= ts <= t1."""
        return [s for s in self.snapshots if t0 <= s.ts <= t1]


def _counters(s: Snapshot) -> dict[Key, float]:
    return {k: v for k, v in s.values.items() if k[1] in M.SRV_COUNTERS}


# --- the run's side: flag, URL, probe, per-cell figures, rows for the Parquet file -----
MODE_AUTO, MODE_OFF = "auto", "off"


def server_metrics_arg(text: str) -> str:
    """argparse type of ``--server-metrics``: ``auto``, ``off`` or an http(s) URL."""
    import argparse
    from urllib.parse import urlsplit

    t = text.strip()
    if t in (MODE_AUTO, MODE_OFF):
        return t
    u = urlsplit(t)
    if u.scheme in ("http", "https") and u.netloc:
        return t
    raise argparse.ArgumentTypeError(f"expected auto, off or an http(s):// URL of a Prometheus page, got {text!r}")


def metrics_url(mode: str, target: str) -> str | None:
    """The page to scrape: ``<target>/metrics`` for auto (the target's base URL, /v1 already
    stripped), the URL itself, or None for off."""
    if mode == MODE_OFF:
        return None
    if mode == MODE_AUTO:
        return target.rstrip("/") + METRICS_PATH
    return mode


def attribution(figures: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Server deltas against what the cell's own requests reported (per-request stats).

    Returns {"requests_num_drafts", "requests_num_accepted_tokens", "requests_without_stats",
    "unattributed_drafts", "unattributed_accepted_tokens"}: the server's counts minus the
    requests' (nonzero means other traffic reached the engine during the cell, or requests
    that ended without stats, cancelled at the cell's end or failed, had drafted); those
    keys are absent when the rows carry no per-request stats or the server no drafts
    counter. With the server's finished-request counter: {"client_requests_ok",
    "unattributed_requests", "unattributed_generation_tokens"} (server minus the ok rows)."""
    out: dict[str, Any] = {}
    if figures.get(M.SRV_REQUESTS_FINISHED) is not None:
        # requests the server saw finish vs the cell's rows (other traffic, or requests the
        # client gave up on that the server still finished, make the difference)
        ok = [r for r in rows if r.get(M.REQ_STATUS) == M.STATUS_OK]
        out["client_requests_ok"] = len(ok)
        out["unattributed_requests"] = int(figures[M.SRV_REQUESTS_FINISHED]) - len(ok)
        if figures.get(M.SRV_GENERATION_TOKENS) is not None:
            out["unattributed_generation_tokens"] = int(figures[M.SRV_GENERATION_TOKENS]) - sum(
                int(r.get(M.REQ_OUTPUT_TOKENS) or 0) for r in ok)
    with_stats = [r for r in rows if r.get(M.NUM_DRAFTS) is not None]
    if not with_stats or figures.get(M.SRV_NUM_DRAFTS) is None:
        return out
    d = sum(int(r[M.NUM_DRAFTS]) for r in with_stats)
    a = sum(int(r.get(M.NUM_ACCEPTED_TOKENS) or 0) for r in with_stats)
    out |= {"requests_num_drafts": d, "requests_num_accepted_tokens": a,
           # cancelled / failed requests drafted on the server but report no stats
           "requests_without_stats": len(rows) - len(with_stats),
           "unattributed_drafts": int(figures[M.SRV_NUM_DRAFTS]) - d}
    if figures.get(M.SRV_NUM_ACCEPTED_TOKENS) is not None:
        out["unattributed_accepted_tokens"] = int(figures[M.SRV_NUM_ACCEPTED_TOKENS]) - a
    return out


@dataclass
class RunServerMetrics:
    """A run's server metrics: probe at the start, a scrape at each cell's start and end,
    polling in between, per-cell figures, and the time series as rows.

    ``models``: served name -> the ``model`` field the load sends (``--model`` or the name).
    ``facts`` is what the manifest records (``server_metrics``): mode, url, engine,
    interval_s, model_labels, notes, published (canonical names the engine kind has),
    exposed (those the page carried at the probe), missing, samples, failed_scrapes, error."""

    mode: str
    target: str
    models: dict[str, str]
    interval_s: float = DEFAULT_INTERVAL_S
    headers: dict[str, str] = field(default_factory=dict)
    insecure: bool = False
    poller: Poller | None = None
    facts: dict[str, Any] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)   # served name -> model label value

    def open(self) -> None:
        """Probe the page. With ``auto`` a page that does not answer (or holds no known series)
        turns scraping off and the facts say why; with a URL it raises ServerMetricsError."""
        url = metrics_url(self.mode, self.target)
        self.facts = {"mode": self.mode, "url": url, "interval_s": self.interval_s}
        if url is None:
            return
        poller = Poller(url, self.interval_s, dict(self.headers), self.insecure)
        try:
            text = poller.probe()
        except ServerMetricsError as err:
            if self.mode != MODE_AUTO:
                raise
            self.facts["error"] = str(err)
            return
        self.facts["engine"] = poller.engine
        seen = poller.seen_models()
        notes = []
        for served, sent in self.models.items():
            label, note = resolve_model(sent, seen)
            if label is not None:
                self.labels[served] = label
            if note:
                notes.append(f"{served}: {note}")
        poller.labels = set(self.labels.values())
        values, _ = parse_page(text, poller.engine)
        exposed = sorted({k[1] for k in values if k[0] in poller.labels})
        published = sorted(M.SERVER_METRIC_NAMES[poller.engine])
        self.facts.update(model_labels=dict(self.labels), notes=notes, published=published,
                          exposed=exposed, missing=[m for m in published if m not in exposed],
                          not_published=[m for m in M.SRV_COUNTERS + M.SRV_GAUGES if m not in published])
        self.poller = poller
        poller.start()

    @property
    def active(self) -> bool:
        return self.poller is not None

    def begin_cell(self) -> float:
        """The scrape that opens a cell; returns its time (unix s), or now when inactive."""
        return self.poller.mark().ts if self.poller else time.time()

    def end_cell(self, served: str, t0: float, rows: list[dict[str, Any]] | None = None) -> dict[str, Any] | None:
        """The scrapes that close a cell (until the counters settle) and the cell's figures for
        ``served`` (``cell_figures`` + ``attribution``); None when inactive or the model has no
        series on the page."""
        if not self.poller:
            return None
        end = self.poller.settle()
        label = self.labels.get(served)
        if label is None:
            return None
        figures = cell_figures(self.poller.window(t0, end.ts), label)
        figures.update(model_label=label, t0=t0, t1=end.ts)   # the bracketing scrapes, unix s
        figures.update(attribution(figures, rows or []))
        return figures

    def close(self) -> None:
        if self.poller:
            self.poller.stop()
            self.facts.update(samples=len(self.poller.snapshots), failed_scrapes=self.poller.failed,
                              last_error=self.poller.last_error, truncated=self.poller.truncated)

    def rows(self, run_id: str, cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """server_metrics.parquet rows (configs.results_schema.SERVER_METRIC_COLUMNS), labelled
        with the cell whose window [t0, t1] holds the sample (``cells``: the run's cell windows)."""
        if not self.poller:
            return []
        kind = {m: "counter" for m in M.SRV_COUNTERS} | {m: "gauge" for m in M.SRV_GAUGES}
        out = []
        for snap in sorted(self.poller.snapshots, key=lambda s: s.ts):
            if not snap.ok:
                continue
            cell = next((c for c in cells if c["t0"] <= snap.ts <= c["t1"]), None)
            for (model, metric, pos), value in snap.values.items():
                out.append({M.REQ_RUN_ID: run_id, "ts": snap.ts, "engine": self.poller.engine,
                            "model": model, "metric": metric,
                            "kind": kind.get(metric) or ("created" if metric.endswith(CREATED_SUFFIX)
                                                         else "start" if metric == PROCESS_START else None),
                            "position": None if pos == NO_POSITION else pos, "value": value,
                            M.REQ_STRATEGY: cell and cell["strategy"], M.REQ_TIER: cell and cell["tier"],
                            M.REQ_OUTPUT_CLASS: cell and cell["output_class"],
                            M.REQ_USERS: cell and cell.get("users"), M.REQ_REPEAT: cell and cell.get("repeat", 0)})
        return out
