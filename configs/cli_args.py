"""argparse ``type=`` checks shared by every specload command line.

Each factory returns a ``type=`` function that converts the text or raises
``argparse.ArgumentTypeError``; argparse then prints ``error: argument --flag:
<message>`` (the flag named once) and exits 2, before anything starts. Numbers
must be finite (``nan`` / ``inf`` are refused everywhere) and inside the stated
range; paths are checked for existence and kind. An empty string passes through
unchanged (the flag's "use the default" value).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Callable

PORT_MIN, PORT_MAX = 1, 65535


def number(kind: type = float, ge: float | None = None, gt: float | None = None,
           le: float | None = None) -> Callable[[str], float]:
    """A finite ``kind`` (int or float) with ``>= ge``, ``> gt``, ``<= le`` as given.

    Raises ArgumentTypeError with the expected range and the text received.
    """
    what = "an integer" if kind is int else "a number"
    bounds = [f">= {ge:g}" if ge is not None else "", f"> {gt:g}" if gt is not None else "",
              f"<= {le:g}" if le is not None else ""]
    expected = f"{what} {' and '.join(b for b in bounds if b)}".strip()

    def parse(text: str):
        try:
            value = kind(text)
        except (TypeError, ValueError):
            if kind is int:   # "8e3" / "4.0": an integer written as a float
                try:
                    f = float(text)
                except ValueError:
                    f = math.nan
                if math.isfinite(f) and f.is_integer():
                    value = int(f)
                else:
                    raise argparse.ArgumentTypeError(
                        f"expects {expected}, got {text!r}") from None
            else:
                raise argparse.ArgumentTypeError(f"expects {expected}, got {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number ({expected}), got {text!r}")
        if (ge is not None and not value >= ge) or (gt is not None and not value > gt) \
                or (le is not None and not value <= le):
            raise argparse.ArgumentTypeError(f"must be {expected}, got {text!r}")
        return value
    return parse


def number_list(kind: type = float, ge: float | None = None, gt: float | None = None,
                le: float | None = None) -> Callable[[str], list]:
    """Comma-separated ``number`` values (``2,4,7``), each checked as ``number`` checks one;
    duplicates are dropped, order kept. Raises ArgumentTypeError naming the bad item."""
    one = number(kind, ge, gt, le)

    def parse(text: str) -> list:
        items = [t.strip() for t in str(text).split(",") if t.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"expects a comma-separated list such as 2,4,7, got {text!r}")
        out: list = []
        for t in items:
            v = one(t)
            if v not in out:
                out.append(v)
        return out
    return parse


DURATION_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}


def duration_s(allow: tuple[str, ...] = ()) -> Callable[[str], float | str]:
    """A wall time: ``900`` or ``900s`` (seconds), ``15m``, ``1.5h``; ``0`` = off. Returns
    seconds (float >= 0); a word in ``allow`` (e.g. ``auto``) passes through unchanged.
    Raises ArgumentTypeError for anything else (negative, nan/inf, unknown unit)."""
    expected = "a duration such as 900s, 15m or 1h (0 = off)" + (
        f", or {' / '.join(allow)}" if allow else "")

    def parse(text: str) -> float | str:
        t = str(text).strip().lower()
        if t in allow:
            return t
        scale = DURATION_UNITS.get(t[-1:], None)
        num = t[:-1] if scale is not None else t
        try:
            value = float(num) * (scale or 1.0)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expects {expected}, got {text!r}") from None
        if not math.isfinite(value) or value < 0:
            raise argparse.ArgumentTypeError(f"must be {expected}, got {text!r}")
        return value
    return parse


def port() -> Callable[[str], int]:
    """A TCP port number, 1..65535."""
    return number(int, ge=PORT_MIN, le=PORT_MAX)


def existing_file() -> Callable[[str], str]:
    """A path to an existing regular file (not a directory)."""
    def parse(text: str) -> str:
        if not text:
            return text
        p = Path(text)
        if p.is_dir():
            raise argparse.ArgumentTypeError(f"expects a file, got the directory {text!r}")
        if not p.is_file():
            raise argparse.ArgumentTypeError(f"file {text!r} does not exist")
        return text
    return parse


def existing_path() -> Callable[[str], str]:
    """A path (file or directory) that exists."""
    def parse(text: str) -> str:
        if text and not Path(text).exists():
            raise argparse.ArgumentTypeError(f"{text!r} does not exist")
        return text
    return parse


def output_dir() -> Callable[[str], str]:
    """A directory to write into: an existing directory, or a path whose nearest
    existing ancestor is a directory (it is created later)."""
    def parse(text: str) -> str:
        if not text:
            return text
        p = Path(text)
        if p.exists() and not p.is_dir():
            raise argparse.ArgumentTypeError(f"expects a directory, got the file {text!r}")
        for up in p.absolute().parents:
            if up.exists():
                if not up.is_dir():
                    raise argparse.ArgumentTypeError(f"{str(up)!r} in {text!r} is a file, "
                                                     "not a directory")
                break
        return text
    return parse


def output_file(parent_must_exist: bool = True) -> Callable[[str], str]:
    """A file to write (``-`` = stdout passes): not a directory; its parent directory must
    exist, or with ``parent_must_exist=False`` be creatable (no ancestor is a file)."""
    def parse(text: str) -> str:
        if not text or text == "-":
            return text
        p = Path(text)
        if p.is_dir():
            raise argparse.ArgumentTypeError(f"expects a file path, got the directory {text!r}")
        parent = p.absolute().parent
        if not parent_must_exist:
            output_dir()(str(parent))
            return text
        if not parent.is_dir():
            raise argparse.ArgumentTypeError(f"directory {str(parent)!r} does not exist "
                                             "(create it first)")
        return text
    return parse


def path_component() -> Callable[[str], str]:
    """One directory name (no path separator, not ``.`` / ``..``), e.g. a run id."""
    def parse(text: str) -> str:
        if not text:
            return text
        if "/" in text or "\\" in text or text in (".", "..") or "\0" in text:
            raise argparse.ArgumentTypeError(f"must be a plain name (no '/', '\\' or '..'), "
                                             f"got {text!r}")
        return text
    return parse
