"""Build and cache the engine's C kernels (``attention_kernel``, ``linear_kernel``,
``layer_kernel``) as typed torch operators.

The kernels are plain C (``csrc/*.c``); ``csrc/ops.cpp`` includes them and defines one
operator per entry point with a typed schema (``TORCH_LIBRARY``; every tensor checked for
dtype, device, layout and size before its pointer is taken, a bad one a ValueError naming
the argument). ``load_ops`` builds that file at first use with
``torch.utils.cpp_extension`` (ninja and ``$CXX``, default ``c++``) into
``$SPECLOAD_KERNEL_CACHE`` (default ``~/.cache/specload/kernels``), named by a hash of
source, compiler, flags, CPU, torch version and cache directory, and loads it
(``torch.ops.load_library``): the operators are ``torch.ops.specload_k<hash>``. The three
kernels are one library. A kernel that cannot be built leaves its caller on the torch
form.

Every outcome is recorded: ``report()`` gives this process's (per kernel: built, loaded
from the cache, unavailable with the error and the fallback that runs instead, or
disabled by its environment switch), and each outcome is also written to
``status.json`` in the cache directory, which ``build_status()`` reads without torch or
a compiler (the run manifest's ``kernels``: what the engines on this machine last got).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

try:
    import fcntl
except ImportError:         # (not on Windows: builders there are not serialised)
    fcntl = None

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
    cxx = compiler()
    return {"kernels": kernels, "cache_dir": str(cache_dir()), "compiler": cxx,
            "compiler_found": shutil.which(cxx) is not None}


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


SOURCE = "ops.cpp"         # the operators' file (csrc/), which includes every kernel's C
# -O3 -march=native: the compiler vectorises the plain loops for this CPU and the
# intrinsics paths are picked by what it targets (AVX-512, AVX2 + FMA); vectorised
# reductions need reassociation; no -ffinite-math-only (the masks are indices, but a NaN
# from a bad input must stay a NaN)
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros",
         "-fno-trapping-math")
# (compile flags, link flags), the first that builds wins: OpenMP (the kernels honour
# torch_threads) and glibc's vector expf (libmvec, the softmax's exps), each dropped where
# the toolchain lacks it
VARIANTS = ((("-fopenmp", "-DSPECLOAD_SIMD_EXPF"), ("-fopenmp", "-lmvec", "-lm")),
            (("-fopenmp",), ("-fopenmp", "-lm")),
            (("-DSPECLOAD_SIMD_EXPF",), ("-lmvec", "-lm")),
            ((), ("-lm",)))


@dataclass
class Kernels:
    """The built kernels of this process: ``ops``, their operators (``torch.ops.<ns>``,
    ``csrc/ops.cpp``: typed schemas, every tensor checked before its pointer is taken),
    and what the build has: ``isa`` (512 AVX-512, 256 AVX2 + FMA, 0 plain C),
    ``interleaved`` (``linear_kernel.pack``'s AVX-512 layout), ``simd`` (the attention's
    AVX-512 code), ``openmp``; ``threads`` the count last handed to them
    (``sync_threads``); ``outcome`` the build's record (``record``)."""

    ops: Any
    ns: str
    isa: int
    interleaved: bool
    simd: bool
    openmp: bool
    outcome: dict
    threads: int = 1

    def sync_threads(self) -> None:
        """Hand ``torch.get_num_threads()`` to the kernels (the products' and the
        attention's OpenMP threads: they honour ``torch_threads``); an operator call only
        when the count changed."""
        import torch

        n = torch.get_num_threads()
        if n != self.threads:
            self.ops.set_threads(n)
            self.threads = n


_LOADED: dict[str, Kernels] = {}    # build key -> the kernels loaded from it (once a process)


def compiler() -> str:
    """The C++ compiler the kernels are built with: ``$CXX``, default ``c++`` (what
    ``torch.utils.cpp_extension`` runs)."""
    return os.environ.get("CXX", "c++")


def _ninja_on_path() -> None:
    """Put the ``ninja`` package's binary on PATH where no ``ninja`` is (cpp_extension
    runs ``ninja`` by name)."""
    import shutil

    if shutil.which("ninja"):
        return
    try:
        import ninja
    except ImportError:
        return
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def load_ops() -> Kernels:
    """The kernels' operators, built once per (source, compiler, flags, CPU, torch
    version, cache directory) with ``torch.utils.cpp_extension`` into ``cache_dir()``
    (``kernels-<key>.so``, named by that hash) and loaded (``torch.ops.load_library``);
    the first of ``VARIANTS`` that builds is used. Raises RuntimeError or OSError (the
    compiler's error at its end) when none builds or the library cannot be loaded."""
    import torch

    source = kernel_source(SOURCE)
    cxx = compiler()
    d = cache_dir()
    key = hashlib.sha256("\0".join((source, cxx, *FLAGS, *(sum(sum(VARIANTS, ()), ())),
                                    platform.machine(), cpu_id(), torch.__version__,
                                    str(d.resolve()))).encode()).hexdigest()[:16]
    if key in _LOADED:              # loaded by an earlier call: nothing built this time
        _LOADED[key].outcome["status"] = "cached"
        return _LOADED[key]
    ns = f"specload_k{key}"
    so = d / f"kernels-{key}.so"
    cached, variant = so.exists(), None
    if not cached:
        d.mkdir(parents=True, exist_ok=True)
        # one builder per key on this machine: processes that start together (a Serve
        # deployment's replicas, test workers) wait for it and then load its library; the
        # lock is released by the kernel when its holder exits, killed or not
        with open(d / f".kernels-{key}.lock", "w") as lock:
            if fcntl is not None:
                fcntl.flock(lock, fcntl.LOCK_EX)
            cached = so.exists()
            if not cached:
                variant = _build(ns, source, d, so)     # (built and loaded)
    if cached:
        torch.ops.load_library(str(so))
    ops = getattr(torch.ops, ns)
    isa, layout, simd, openmp, _ = ops.build_info()
    outcome = {"status": "cached" if cached else "built", "library": so.name, "compiler": cxx,
               "build": "torch.utils.cpp_extension", "flags": list(FLAGS),
               **({} if variant is None else {"variant": variant})}
    k = Kernels(ops=ops, ns=ns, isa=int(isa), interleaved=bool(layout), simd=bool(simd),
                openmp=bool(openmp), outcome=outcome)
    _LOADED[key] = k
    return k


def _build(ns: str, source: str, d: Path, so: Path) -> list[str]:
    """Build ``source`` (``csrc/ops.cpp`` with its includes inlined) into ``so`` with
    ``torch.utils.cpp_extension`` in a temporary directory of ``d``, the operators in the
    namespace ``ns``; the first of ``VARIANTS`` that builds wins. Returns its flags;
    raises the last variant's error when none builds."""
    from torch.utils import cpp_extension

    _ninja_on_path()
    errors: list[Exception] = []
    with tempfile.TemporaryDirectory(dir=d) as tmp:
        src = Path(tmp) / SOURCE
        src.write_text(source)
        for i, (cflags, ldflags) in enumerate(VARIANTS):
            out = Path(tmp) / f"v{i}"
            out.mkdir()
            try:
                # (cpp_extension.load also loads it: the caller's load_library is then a no-op)
                built = cpp_extension.load(ns, [str(src)], extra_cflags=[
                    *FLAGS, *cflags, f"-DSPECLOAD_NS={ns}"], extra_ldflags=list(ldflags),
                    build_directory=str(out), is_python_module=False, verbose=False)
            except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
                errors.append(exc)
                continue
            os.replace(built, so)      # atomic: a reader never sees half a file
            return [*cflags, *ldflags]
    raise errors[-1]


def load_kernels(name: str, fallback: str) -> Kernels | None:
    """``load_ops``'s kernels for the kernel ``name`` (its outcome recorded under that
    name), or None with a warning naming ``fallback`` (what runs instead) when they cannot
    be built or loaded."""
    try:
        k = load_ops()
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        logging.getLogger(__name__).warning("%s kernel unavailable (%s); %s", name,
                                            str(exc)[-800:], fallback)
        record(name, status="unavailable", error=str(exc)[-300:], compiler=compiler(),
               fallback=fallback)
        return None
    record(name, **k.outcome)
    return k


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
