"""One results schema (configs/results_schema.py): the writer writes it, the reader reads
it, and step rows join request rows on the served model name."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from analysis.data.load import STEP_PROPOSER, ResultsError, load_results
from configs import metric_names as M
from configs import results_schema as S
from loadgen.cli.main import _label_steps
from loadgen.results.writer import RequestWriter, write_steps


def _request(model: str, i: int) -> dict:
    return {M.REQ_STRATEGY: model, M.REQ_TIER: "low", M.REQ_OUTPUT_CLASS: "short", M.REQ_USERS: 1,
            M.REQ_SENT_TS: 100.0 + i, M.REQ_SCHEDULED_TS: 100.0 + i, M.REQ_END_TS: 100.5 + i,
            M.REQ_TTFT_MS: 50.0, M.REQ_OUTPUT_TOKENS: 8, M.REQ_STATUS: M.STATUS_OK,
            M.NUM_DRAFTS: 2, M.NUM_ACCEPTED_TOKENS: 3, M.NUM_ACCEPTED_TOKENS_PER_POS: [2, 1],
            "not_in_schema": 1}


def _step(strategy: str, model: str, ts: float, emitted: int) -> dict:
    return {M.STEP_TS: ts, M.STEP_STRATEGY: strategy, M.STEP_MODEL: model, M.STEP_REPLICA: "r0",
            M.STEP_BATCH_SIZE: 1, M.STEP_EMITTED_TOKENS: emitted, M.STEP_MS: 5.0, "seq": 7}


def _write_run(run, models_of_cells, steps):
    run.mkdir()
    w = RequestWriter(run / "requests.parquet")
    for i, model in enumerate(models_of_cells):
        w.add(_request(model, i))
    w.close()
    cells = [{"strategy": m, "tier": "low", "output_class": "short", "users": 1, "t0": 99.0,
              "t1": 200.0} for m in sorted(set(models_of_cells))]
    write_steps(run / "steps.parquet", _label_steps(steps, "run1", cells))
    (run / "manifest.json").write_text(json.dumps({"run_id": "run1",
                                                   "schema_version": S.SCHEMA_VERSION}))


def test_engine_step_columns_match_the_step_log():
    """A column added to the engine's step row must be added to the schema (name, type, unit)."""
    assert S.names(S.ENGINE_STEP_COLUMNS) == M.STEP_LOG_COLUMNS
    ms = [c.name for c in S.REQUEST_COLUMNS + S.ENGINE_STEP_COLUMNS if c.name.endswith("_ms")]
    assert ms and all(S.units(S.REQUEST_COLUMNS + S.ENGINE_STEP_COLUMNS)[n] == "ms" for n in ms)


def test_files_carry_the_schema_and_its_version(tmp_path):
    run = tmp_path / "run1"
    _write_run(run, ["dflash"], [_step("dflash", "dflash", 101.0, 3)])
    for name, columns in (("requests.parquet", S.REQUEST_COLUMNS),
                          ("steps.parquet", S.STEP_COLUMNS)):
        schema = pq.read_schema(run / name)
        assert schema.names == list(S.names(columns))  # extra keys ("seq", ...) dropped
        assert S.file_version(schema.metadata) == S.SCHEMA_VERSION
    steps = pq.read_table(run / "steps.parquet").to_pylist()
    assert steps[0][M.REQ_TIER] == "low" and steps[0][M.STEP_MODEL] == "dflash"
    assert str(pq.read_schema(run / "requests.parquet").field(M.REQ_USERS).type) == "int32"


def test_a_deployment_named_apart_from_its_strategy_keeps_its_own_steps(tmp_path):
    """Two deployments of the same strategy (dflash) under two served names: each
    name's requests join its own step rows, none lands in the other's."""
    run = tmp_path / "run1"
    steps = [_step("dflash", "dflash", 101.0, 3), _step("dflash", "dflash-k4", 101.5, 5),
             _step("dflash", "dflash-k4", 102.0, 5)]
    _write_run(run, ["dflash", "dflash-k4", "dflash-k4"], steps)
    res = load_results(tmp_path)
    by_name = res.steps.groupby(M.STEP_STRATEGY)[M.STEP_EMITTED_TOKENS].sum().to_dict()
    assert by_name == {"dflash": 3, "dflash-k4": 10}
    assert set(res.steps[STEP_PROPOSER]) == {"dflash"}          # the engine's id is kept
    assert set(res.requests[M.REQ_STRATEGY]) == set(by_name)    # one key on both sides


def test_steps_are_labelled_with_the_cell_of_their_served_name():
    cells = [{"strategy": "dflash", "tier": "low", "output_class": "short", "users": 1,
              "t0": 0.0, "t1": 10.0},
             {"strategy": "dflash-k4", "tier": "mid", "output_class": "long", "users": 4,
              "t0": 0.0, "t1": 10.0}]
    rows = _label_steps([_step("dflash", "dflash-k4", 5.0, 1), _step("dflash", "dflash", 5.0, 1)],
                        "run1", cells)
    assert [(r[M.REQ_TIER], r[M.REQ_USERS]) for r in rows] == [("mid", 4), ("low", 1)]


def test_reader_refuses_a_newer_schema(tmp_path):
    run = tmp_path / "run1"
    _write_run(run, ["dflash"], [])
    (run / "manifest.json").write_text(json.dumps({"schema_version": S.SCHEMA_VERSION + 1}))
    with pytest.raises(ResultsError, match="newer"):
        load_results(tmp_path)


def test_old_step_logs_without_model_fall_back_to_the_strategy(tmp_path):
    run = tmp_path / "run1"
    _write_run(run, ["ngram"], [])
    import pandas as pd

    pd.DataFrame([{M.STEP_TS: 101.0, M.STEP_STRATEGY: "ngram", M.STEP_EMITTED_TOKENS: 2}]
                 ).to_parquet(run / "steps.parquet")
    res = load_results(tmp_path)
    assert list(res.steps[M.STEP_STRATEGY]) == ["ngram"]
    assert list(res.steps[STEP_PROPOSER]) == ["ngram"]


def test_a_row_without_a_defaulted_column_gets_its_default(tmp_path):
    """Rows from every path (sent, cancelled at the cell's end, never sent) carry the same
    columns: a column with a defined default (retries: 0) is never null, whoever built the row."""
    run = tmp_path / "run1"
    _write_run(run, ["dflash", "dflash"], [])
    rows = pq.read_table(run / "requests.parquet").to_pylist()
    assert [r[M.REQ_RETRIES] for r in rows] == [0, 0]            # _request() sets no retries
    assert rows[0][M.REQ_TTFT_MS] == 50.0 and rows[0][M.REQ_E2E_MS] is None  # no default: null
    defaulted = {c.name: c.default for c in S.REQUEST_COLUMNS if c.default is not None}
    assert defaulted == {M.REQ_RETRIES: 0}
    assert S.coerce_row(S.REQUEST_COLUMNS, {M.REQ_RETRIES: float("nan")})[M.REQ_RETRIES] == 0
