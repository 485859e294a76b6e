"""Strict JSON (configs.jsonio): undefined numbers are null, the text parses with a strict reader."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from configs.jsonio import dumps, loads_strict, write_json


def test_nan_inf_numpy_become_strict_json(tmp_path):
    obj = {"tau": math.nan, "inf": math.inf, "np": np.float64("nan"), "n": np.int64(3),
           "arr": np.array([1.5, np.nan]), "t": (1, 2), 4: "int key"}
    text = dumps(obj)
    assert "NaN" not in text and "Infinity" not in text
    assert loads_strict(text) == {"tau": None, "inf": None, "np": None, "n": 3,
                                  "arr": [1.5, None], "t": [1, 2], "4": "int key"}
    p = write_json(tmp_path / "x.json", obj)
    assert loads_strict(p.read_text())["arr"] == [1.5, None]
    assert not list(tmp_path.glob("*.tmp"))


def test_loads_strict_rejects_bare_nan():
    assert json.loads('{"a": NaN}')["a"] != 0  # Python's reader accepts it ...
    with pytest.raises(ValueError, match="NaN"):
        loads_strict('{"a": NaN}')             # ... a strict one does not


def test_write_json_creates_missing_parent_directories(tmp_path):
    """A benchmark's ``--out`` in a folder that does not exist yet keeps its results."""
    p = write_json(tmp_path / "new" / "deeper" / "r.json", {"a": 1})
    assert p.read_text() == '{\n  "a": 1\n}\n'
