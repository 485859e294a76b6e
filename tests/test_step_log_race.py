"""The step log is read while the engine writes it (issue 37, item 5).

A replica's engine thread (or its engine-core reader thread) appends a row per
step while an HTTP route reads the ring buffer; the app-wide ``StepLogStore`` is
appended to by every replica's push while ``GET /specload/step_log`` queries it,
and Ray Serve runs those sync methods on a thread pool. Reading a deque in a Python
loop while another thread appends to it raised ``RuntimeError: deque mutated during
iteration`` (an HTTP 500 and a cell's step rows lost). These tests read and write
from real threads at once and fail on the unguarded code.
"""

import sys
import threading

from actors.serve.async_engine import AsyncLLMEngine
from actors.serve.deployments import StepLogStore
from configs import metric_names as mn
from loadgen.run import service

DURATION_S = 1.5


def _hammer(write, read, duration_s: float = DURATION_S) -> tuple[list[BaseException], int]:
    """Run ``write()`` in a loop on one thread and ``read()`` on this one for
    ``duration_s``; returns the errors either raised and the number of reads done."""
    errors: list[BaseException] = []
    stop = threading.Event()

    def writer():
        try:
            while not stop.is_set():
                write()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)   # switch threads often: the race shows in a second
    t = threading.Thread(target=writer, daemon=True)
    t.start()
    reads = 0
    import time
    end = time.monotonic() + duration_s
    try:
        while time.monotonic() < end and not errors:
            try:
                read()
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)
                break
            reads += 1
    finally:
        stop.set()
        t.join(5)
        sys.setswitchinterval(old)
    return errors, reads


def test_step_log_store_query_while_replicas_append():
    store = StepLogStore.func_or_class(capacity=20_000)
    n = [0]

    def write():
        n[0] += 1
        store.append([{mn.STEP_MODEL: "ngram" if n[0] % 2 else "autoregressive",
                       mn.STEP_TS: float(n[0])} for _ in range(50)])

    store.append([{mn.STEP_MODEL: "ngram", mn.STEP_TS: 0.5}] * 20_000)
    errors, reads = _hammer(write, lambda: store.query(strategy="ngram", since=0.0))
    assert not errors, f"query raced append: {errors[0]!r}"
    assert reads > 0
    rows = store.query(strategy="ngram")
    assert rows and all(r[mn.STEP_MODEL] == "ngram" for r in rows)
    ts = [r[mn.STEP_TS] for r in rows]
    assert ts == sorted(ts)   # oldest first, one consistent snapshot


class _Engine:
    """Enough of an engine for AsyncLLMEngine's step-log side (no step loop)."""

    on_step = None
    max_model_len = 64
    num_waiting = num_running = 0

    def has_unfinished_requests(self):
        return False


def test_engine_step_log_read_while_engine_writes():
    eng = AsyncLLMEngine(_Engine(), step_log_capacity=20_000)
    try:
        for i in range(20_000):
            eng._on_step({mn.STEP_TS: float(i)})
        errors, reads = _hammer(lambda: eng._on_step({mn.STEP_TS: 1e9}),
                                lambda: eng.step_log(since_seq=10, since_ts=-1.0))
        assert not errors, f"step_log raced the engine's append: {errors[0]!r}"
        assert reads > 0
        seqs = [r["seq"] for r in eng.step_log()]
        assert seqs == sorted(seqs) and len(seqs) == 20_000
    finally:
        eng.shutdown(1.0)


# ------------------------------------------------------------ a lost step log names its cells
def _cell(strategy, t0, t1, repeat=0):
    return {"strategy": strategy, "tier": "low", "output_class": "short", "users": 1,
            "repeat": repeat, "sampling": "greedy", "t0": t0, "t1": t1}


def _row(strategy, ts, seq, replica="r1"):
    return {mn.STEP_MODEL: strategy, mn.STEP_TS: ts, "seq": seq, mn.STEP_REPLICA: replica}


def test_step_loss_names_the_cells_a_failed_fetch_and_a_seq_gap_hit():
    from loadgen.results.step_loss import step_log_losses

    cells = [_cell("ngram", 10, 20, 0), _cell("ngram", 30, 40, 1), _cell("ngram", 50, 60, 2),
             _cell("autoregressive", 10, 20)]
    steps = ([_row("ngram", 10 + i, 1 + i) for i in range(10)]            # cell 0: complete
             + [_row("ngram", 31, 100), _row("ngram", 39, 342)]          # cell 1: 241 skipped
             + [_row("autoregressive", 11 + i, 1 + i, "r2") for i in range(5)])
    errors = [{"strategy": "ngram", "since": 49.0, "error": "HTTP 500: RuntimeError: deque "
               "mutated during iteration", "recovered": False},
              {"strategy": "autoregressive", "since": 9.0, "error": "x", "recovered": True}]
    lost = step_log_losses(steps, cells, errors)
    assert [(e["repeat"], e["rows"], e["missing_rows"]) for e in lost] == [(1, 2, 241),
                                                                           (2, 0, None)]
    assert "seq" not in lost[0] and "skipped" in lost[0]["reasons"][0]
    assert "deque mutated" in lost[1]["reasons"][0]
    assert step_log_losses(steps[:10], cells[:1], []) == []


def test_a_failed_fetch_not_retried_is_named_in_the_manifest_and_the_report(tmp_path):
    import types

    from rich.console import Console

    from analysis.decide.questions import _step_log_loss
    from loadgen.cli import main as cli_main

    console = Console(record=True, width=300)
    st = types.SimpleNamespace(target="http://127.0.0.1:9", manifest={}, console=console,
                               fetched={}, cursors={}, step_totals={}, steps=[],
                               cell_windows=[_cell("ngram", 10, 20, 0), _cell("ngram", 30, 40, 1)])
    calls = iter([cli_main.service.StepLogError("GET /specload/step_log answered HTTP 500: "
                                                "deque mutated during iteration"),
                  service.StepPage([_row("ngram", 11, 1), _row("ngram", 12, 2)]),
                  cli_main.service.StepLogError("HTTP 500 again")])

    def fetch(*a, **k):
        v = next(calls)
        if isinstance(v, Exception):
            raise v
        return v

    orig = cli_main.service.fetch_step_page
    cli_main.service.fetch_step_page = fetch
    try:
        st.auth = types.SimpleNamespace(headers={}, insecure=False)
        cli_main._fetch_steps(st, "ngram", 9.0)     # cell 0 fails ...
        cli_main._fetch_steps(st, "ngram", 9.0)     # ... and is fetched again (recovered)
        cli_main._fetch_steps(st, "ngram", 29.0)    # cell 1 fails for good
    finally:
        cli_main.service.fetch_step_page = orig
    cli_main._record_step_loss(st)
    assert [e["recovered"] for e in st.manifest["step_log_errors"]] == [True, False]
    assert [(e["repeat"], e["rows"]) for e in st.manifest["step_log_loss"]] == [(1, 0)]
    assert "ngram/low/short users 1 repeat 1 is partial" in console.export_text()
    run = types.SimpleNamespace(run_id="run-1", manifest=st.manifest)
    out = {"flags": [], "tables": []}
    _step_log_loss(types.SimpleNamespace(runs=[run]), out)
    assert out["flags"] and "ngram/low/short/1/1" in out["flags"][0]
    assert out["tables"][0][2][0]["repeat"] == 1 and "HTTP 500 again" in out["tables"][0][2][0]["reason"]


def _paged(store, asked: list):
    """``service.fetch_step_page`` answered by a real ``StepLogStore`` as the route does."""
    def fetch(target, strategy, since, after=None, **k):
        asked.append((since, after))
        return service.StepPage(**store.page(strategy, None if after is not None else since, after))
    return fetch


def test_rows_pushed_after_a_cells_fetch_are_fetched_with_the_next_cell():
    """A replica pushes its step rows every STEP_FLUSH_S, so the rows of a cell's last steps
    can reach the store after the fetch that follows the cell; two replicas push on their
    own clocks, so a row of an earlier step can arrive after a later one. The fetches after
    the first follow the store's arrival cursor (the page's ``next``), not a ts: every late
    row lands in the run (round 28's suite lost the last 4 requests of a 3-s cell; a ts
    cursor at the newest row fetched would skip replica B's older row below). The store
    is the real one."""
    import types

    from loadgen.cli import main as cli_main

    store, asked = StepLogStore.func_or_class(), []
    store.append([_row("ngram", 5.0, 0)])                            # before the run: not taken
    store.append([_row("ngram", 11.0, 1), _row("ngram", 19.0, 2)])   # replica A, cell 1
    st = types.SimpleNamespace(target="http://127.0.0.1:9", manifest={}, fetched={}, cursors={},
                               step_totals={}, steps=[],
                               auth=types.SimpleNamespace(headers={}, insecure=False))
    orig = cli_main.service.fetch_step_page
    cli_main.service.fetch_step_page = _paged(store, asked)
    try:
        cli_main._fetch_steps(st, "ngram", cli_main._fetch_since(st, "ngram", 10.0))
        late_b = {**_row("ngram", 18.5, 1), mn.STEP_REPLICA: "b"}       # older than A's newest
        store.append([_row("ngram", 19.6, 3), late_b, _row("ngram", 31.0, 4)])
        cli_main._fetch_steps(st, "ngram", cli_main._fetch_since(st, "ngram", 30.0))
    finally:
        cli_main.service.fetch_step_page = orig
    assert asked == [(9.0, None), (19.0, 3)]
    assert [(r[mn.STEP_TS], r["seq"]) for r in st.steps] == [(11.0, 1), (19.0, 2), (19.6, 3),
                                                             (18.5, 1), (31.0, 4)]
    assert "step_log_errors" not in st.manifest


def test_rows_the_store_evicted_before_their_fetch_are_counted_by_strategy():
    """The store keeps a bounded ring buffer; rows pushed past its capacity before the load
    generator fetched them are lost. A page's ``total`` (the strategy's rows ever stored)
    lets the reader count them, per strategy: the other strategy's evictions are not
    charged to this one."""
    import types

    from rich.console import Console

    from loadgen.cli import main as cli_main

    store, asked = StepLogStore.func_or_class(capacity=4), []
    store.append([_row("ngram", 11.0, 1)])
    st = types.SimpleNamespace(target="http://127.0.0.1:9", manifest={}, fetched={}, cursors={},
                               step_totals={}, steps=[], console=Console(record=True, width=200),
                               auth=types.SimpleNamespace(headers={}, insecure=False))
    orig = cli_main.service.fetch_step_page
    cli_main.service.fetch_step_page = _paged(store, asked)
    try:
        cli_main._fetch_steps(st, "ngram", 10.0)
        cli_main._fetch_steps(st, "dflash", 10.0)
        store.append([_row("ngram", 12.0 + i, 2 + i) for i in range(5)]     # 2 of them evicted
                     + [_row("dflash", 20.0, 1)])
        cli_main._fetch_steps(st, "ngram", 10.0)
        cli_main._fetch_steps(st, "dflash", 10.0)
    finally:
        cli_main.service.fetch_step_page = orig
    errors = st.manifest["step_log_errors"]
    assert [(e["strategy"], e["error"].split()[0]) for e in errors] == [("ngram", "2")]
    assert [r["seq"] for r in st.steps if r[mn.STEP_MODEL] == "ngram"] == [1, 4, 5, 6]
    assert [r["seq"] for r in st.steps if r[mn.STEP_MODEL] == "dflash"] == [1]


def test_the_run_waits_for_the_last_cells_late_rows():
    """After the last cell the rows of its last steps reach the store up to a flush period
    later (CI stop 53 lost dflash2's last 3-s cell's tail this way: 16 % of its prompt
    tokens). ``_fetch_tail`` fetches once two flush periods have passed since the cell's
    end, then each period until two fetches in a row bring nothing: a push that lands
    between fetches is taken, and the loop stops by itself."""
    import time
    import types

    from configs.serve_config import STEP_FLUSH_S
    from loadgen.cli import main as cli_main

    store, asked = StepLogStore.func_or_class(), []
    now = time.time()
    store.append([_row("ngram", now - 2.0, 1)])
    st = types.SimpleNamespace(target="http://127.0.0.1:9", manifest={"started_ts": now - 5},
                               fetched={}, cursors={}, step_totals={}, steps=[],
                               strategies=["ngram"], cell_windows=[{"t1": now}],
                               auth=types.SimpleNamespace(headers={}, insecure=False))
    paged = _paged(store, asked)

    def fetch(*a, **k):
        page = paged(*a, **k)
        if len(asked) == 1:                       # a replica's push lands after the 1st fetch
            store.append([_row("ngram", now - 0.01, 2)])
        return page

    orig = cli_main.service.fetch_step_page
    cli_main.service.fetch_step_page = fetch
    try:
        cli_main._fetch_tail(st)
    finally:
        cli_main.service.fetch_step_page = orig
    assert [r["seq"] for r in st.steps] == [1, 2]
    assert len(asked) == 4                         # the row, the late row, two quiet polls
    assert time.time() - now >= 2 * STEP_FLUSH_S + 3 * STEP_FLUSH_S - 0.05   # waited, not raced


def test_a_restarted_store_answers_an_old_cursor_with_every_row_it_holds():
    """Serve may replace the store's replica: the new store counts from 0, so a reader's
    cursor lies past its end. It gets every row the new store holds (not nothing, for the
    rest of the run), and the smaller ``total`` is no eviction."""
    import types

    from loadgen.cli import main as cli_main

    old, asked = StepLogStore.func_or_class(), []
    old.append([_row("ngram", 11.0 + i, 1 + i) for i in range(5)])
    st = types.SimpleNamespace(target="http://127.0.0.1:9", manifest={}, fetched={}, cursors={},
                               step_totals={}, steps=[],
                               auth=types.SimpleNamespace(headers={}, insecure=False))
    orig = cli_main.service.fetch_step_page
    try:
        cli_main.service.fetch_step_page = _paged(old, asked)
        cli_main._fetch_steps(st, "ngram", 10.0)
        new = StepLogStore.func_or_class()            # the replacement, after a restart
        new.append([_row("ngram", 30.0, 1, replica="r2"), _row("ngram", 31.0, 2, replica="r2")])
        cli_main.service.fetch_step_page = _paged(new, asked)
        cli_main._fetch_steps(st, "ngram", 10.0)
        new.append([_row("ngram", 32.0, 3, replica="r2")])
        cli_main._fetch_steps(st, "ngram", 10.0)
    finally:
        cli_main.service.fetch_step_page = orig
    assert asked == [(10.0, None), (10.0, 5), (10.0, 2)]
    assert [r[mn.STEP_TS] for r in st.steps] == [11.0, 12.0, 13.0, 14.0, 15.0, 30.0, 31.0, 32.0]
    assert "step_log_errors" not in st.manifest
