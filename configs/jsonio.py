"""Strict JSON for every file specload writes: no bare ``NaN`` / ``Infinity``.

Python's ``json`` writes ``NaN`` by default, which is not JSON (RFC 8259):
``JSON.parse`` in a browser, ``jq`` and most other readers reject it. Every
JSON file (run manifest, recommendation, plan, benchmark and training cards,
state files) goes through ``dumps`` / ``write_json``: an undefined number
(NaN, +-inf) becomes ``null``, numpy scalars and arrays become plain numbers
and lists, paths become strings, and ``allow_nan=False`` guarantees the
output parses with a strict reader.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path, PurePath
from typing import Any


def jsonable(obj: Any) -> Any:
    """A copy of ``obj`` made of dict / list / str / int / float / bool / None only.

    NaN and +-inf -> None (undefined); numpy scalars -> Python numbers (via
    ``.item()``), numpy arrays / tuples / sets -> lists; dataclasses -> dicts;
    paths -> str; pydantic models -> ``model_dump()``; anything else -> ``str``.
    Dict keys become strings (JSON object keys are strings).
    """
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, PurePath):
        return str(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return jsonable(dataclasses.asdict(obj))
    if hasattr(obj, "model_dump"):
        return jsonable(obj.model_dump())
    if hasattr(obj, "tolist"):          # numpy arrays and scalars
        return jsonable(obj.tolist())
    if hasattr(obj, "item"):
        return jsonable(obj.item())
    return str(obj)


def dumps(obj: Any, **kwargs: Any) -> str:
    """``json.dumps(jsonable(obj), allow_nan=False, ...)``: strict JSON text."""
    return json.dumps(jsonable(obj), allow_nan=False, **kwargs)


def write_json(path: str | os.PathLike, obj: Any, indent: int | None = 2, **kwargs: Any) -> Path:
    """Write ``obj`` as strict JSON atomically (temp file + ``os.replace``); returns the path.

    A reader never sees half a file, even after Ctrl-C mid-write. Missing parent
    directories are created (a benchmark's ``--out`` in a new folder keeps its results).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(dumps(obj, indent=indent, **kwargs) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-JSON constant {name!r}")


def loads_strict(text: str) -> Any:
    """Parse JSON, raising ValueError on ``NaN`` / ``Infinity`` (what strict readers do)."""
    return json.loads(text, parse_constant=_reject_constant)


STDIN = "-"


class SourceError(ValueError):
    """A ``--prompts`` / ``--dataset`` source that cannot be read (message names it)."""


def read_text_source(spec: str) -> tuple[str, str]:
    """``(name, text)`` of a text source given on a command line, as Unix tools read one.

    ``-`` is standard input (name ``"stdin"``). Any other value is a path that is read
    as a stream, so ``/dev/stdin``, a named pipe and a shell's ``<(...)`` (``/dev/fd/N``)
    work like a regular file (checking ``is_file()`` first would refuse them). Raises
    SourceError when the path does not exist, is a directory, or cannot be read.
    """
    if spec == STDIN:
        import sys

        return "stdin", sys.stdin.read()
    path = Path(spec)
    if path.is_dir():
        raise SourceError(f"{spec} is a directory; expected a JSON-lines file, or - for stdin")
    if not path.exists():
        raise SourceError(f"{spec} does not exist; expected a JSON-lines file, or - for stdin")
    try:
        with open(path, encoding="utf-8") as f:
            return path.stem, f.read()
    except (OSError, UnicodeDecodeError) as err:
        raise SourceError(f"{spec} cannot be read ({err})") from None
