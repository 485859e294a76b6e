"""Build and cache the engine's C kernels (``attention_kernel``, ``linear_kernel``).

Each kernel is plain C compiled at first use with the machine's C compiler (``$CC``,
default ``cc``) into ``$SPECLOAD_KERNEL_CACHE`` (default ``~/.cache/specload/kernels``),
named by a hash of source, compiler, flags and CPU, and loaded with ctypes. A kernel that
cannot be built leaves its caller on the torch form.

Every outcome is recorded: ``report()`` gives this process's (per kernel: built, loaded
from the cache, unavailable with the error and the fallback that runs instead, or
disabled by its environment switch), and each outcome is also written to
``status.json`` in the cache directory, which ``build_status()`` reads without torch or
a compiler (the run manifest's ``kernels``: what the engines on this machine last got).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import platform
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

STATUS_FILE = "status.json"
_REPORT: dict[str, dict[str, Any]] = {}     # kernel name -> this process's outcome


def record(name: str, **outcome: Any) -> None:
    """Note ``name``'s build outcome (``status``: built | cached | unavailable | disabled,
    and details) for ``report()`` and in the cache's ``status.json`` (best effort: a
    read-only cache directory keeps it in this process only)."""
    outcome = {"ts": time.time(), **outcome}
    _REPORT[name] = outcome
    try:
        d = cache_dir()
        d.mkdir(parents=True, exist_ok=True)
        path = d / STATUS_FILE
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            data = {}
        data[name] = outcome
        tmp = d / f".{STATUS_FILE}.{os.getpid()}"
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        os.replace(tmp, path)     # atomic: engines of other processes may write too
    except OSError:
        pass


def load_kernel_outcome(name: str) -> dict[str, Any]:
    """``name``'s outcome recorded so far in this process, without its timestamp (for a
    caller that adds details to it), {} when none."""
    return {k: v for k, v in _REPORT.get(name, {}).items() if k != "ts"}


def report() -> dict[str, dict[str, Any]]:
    """This process's kernel outcomes so far, by kernel name (``record``)."""
    return {k: dict(v) for k, v in _REPORT.items()}


def build_status() -> dict[str, Any]:
    """The kernel outcomes last recorded on this machine (``status.json`` in
    ``cache_dir()``, written by every engine process's builds), plus the compiler that
    would build them; read without torch. ``{"kernels": {}, ...}`` when none was built yet."""
    import shutil

    try:
        kernels = json.loads((cache_dir() / STATUS_FILE).read_text())
    except (OSError, ValueError):
        kernels = {}
    cc = os.environ.get("CC", "cc")
    return {"kernels": kernels, "cache_dir": str(cache_dir()), "compiler": cc,
            "compiler_found": shutil.which(cc) is not None}


def cache_dir() -> Path:
    """Where compiled kernels are kept: ``$SPECLOAD_KERNEL_CACHE``, else
    ``$XDG_CACHE_HOME/specload/kernels`` (``~/.cache/specload/kernels``)."""
    env = os.environ.get("SPECLOAD_KERNEL_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "specload" / "kernels"


def cpu_id() -> str:
    """What ``-march=native`` compiles for: the CPU's model name and flags
    (``/proc/cpuinfo``), else ``platform.processor()``; part of the kernel's cache key, so
    a cache directory shared by nodes of different CPUs (a network home) never hands one
    node another's instructions."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            keep = [ln for ln in f if ln.startswith(("model name", "flags", "Features"))]
        if keep:
            return "".join(dict.fromkeys(keep))      # the first CPU's lines, once each
    except OSError:
        pass
    return platform.processor()


def build(name: str, source: str, flags: tuple[str, ...],
          variants: tuple[tuple[str, ...], ...] = ((),)) -> ctypes.CDLL:
    """The library ``name`` compiled from ``source`` with ``flags`` and the first of
    ``variants`` (extra arguments) that compiles; built once per (source, compiler, flags,
    CPU) and cached on disk. Raises OSError or subprocess.SubprocessError (stderr on the
    exception) when no variant compiles or the result cannot be loaded."""
    cc = os.environ.get("CC", "cc")
    key = hashlib.sha256("\0".join((source, cc, *flags, *sum(variants, ()), platform.machine(),
                                    cpu_id())).encode()).hexdigest()[:16]
    d = cache_dir()
    d.mkdir(parents=True, exist_ok=True)
    so = d / f"{name}-{key}.so"
    cached, variant = so.exists(), None
    if not cached:
        with tempfile.TemporaryDirectory(dir=d) as tmp:
            src = Path(tmp) / f"{name}.c"
            src.write_text(source)
            built = Path(tmp) / "k.so"
            for i, extra in enumerate(variants):
                try:
                    subprocess.run([cc, *flags, str(src), "-o", str(built), *extra],
                                   check=True, capture_output=True, timeout=120)
                    variant = list(extra)
                    break
                except subprocess.CalledProcessError:
                    if i == len(variants) - 1:
                        raise
            os.replace(built, so)      # atomic: another process may be building too
    lib = ctypes.CDLL(str(so))
    record(name, status="cached" if cached else "built", library=so.name, compiler=cc,
           flags=list(flags), **({} if variant is None else {"variant": variant}))
    return lib


_LIBS: list = []    # the op registrations: each must stay alive for its op to last


def register_op(name: str, schema: str, impl: Callable, fake: Callable) -> None:
    """Define the torch op ``specload::<name>`` (``schema``) with ``impl`` as its CPU
    implementation and ``fake`` (shapes only) for ``torch.compile``'s tracing, once a
    process: a second import of a kernel module (importlib.reload, a second copy on the
    path) keeps the first registration."""
    import torch

    try:
        getattr(torch.ops.specload, name)
        return
    except (AttributeError, RuntimeError):
        pass
    lib = torch.library.Library("specload", "FRAGMENT")
    lib.define(schema)
    lib.impl(name, impl, "CPU")
    torch.library.register_fake(f"specload::{name}")(fake)
    _LIBS.append(lib)


CSRC = Path(__file__).resolve().parent / "csrc"


def kernel_source(name: str) -> str:
    """The C source ``csrc/<name>`` with each ``#include "other.c"`` line replaced by that
    file's source (recursively, each file once), so the text handed to ``build`` (and its
    cache key) covers every file it compiles. Raises FileNotFoundError naming the file."""
    seen: set[str] = set()

    def expand(n: str) -> str:
        if n in seen:
            return ""
        seen.add(n)
        out = []
        for line in (CSRC / n).read_text().splitlines(keepends=True):
            inc = line.strip()
            if inc.startswith('#include "') and inc.endswith('.c"'):
                out.append(expand(inc[len('#include "'):-1]))
            else:
                out.append(line)
        return "".join(out)

    return expand(name)


def load_kernel(name: str, source: str, flags: tuple[str, ...], fn: str, argtypes: list,
                fallback: str, variants: tuple[tuple[str, ...], ...] = ((),)) -> ctypes.CDLL | None:
    """``build``'s library with its entry point ``fn`` typed (``argtypes``, an int result),
    or None with a warning naming ``fallback`` (what runs instead) when it cannot be built
    or loaded."""
    try:
        lib = build(name, source, flags, variants)
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        logging.getLogger(__name__).warning("%s kernel unavailable (%r %s); %s", name, exc,
                                            detail.decode(errors="replace")[-500:], fallback)
        record(name, status="unavailable", error=repr(exc)[:300], fallback=fallback)
        return None
    f = getattr(lib, fn)
    f.argtypes = argtypes
    f.restype = ctypes.c_int
    return lib
