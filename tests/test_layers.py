"""The import graph points one way: each layer imports only itself and the layers below.

Layers, lowest first (docs/design.md, "Architecture"): configuration and names; the
offline text sources; the engine core; the drafter networks; the proposers
(one per strategy); the Ray Serve layer; the engine's command line; bring-up (whatever
starts a service goes through it); training; the analysis library; the load generator;
the campaigns and the analysis commands (they start the service and drive load); the
benchmarks. Every ``import`` statement is read, including those inside functions, so a
lazy import cannot hide an edge; so are the module strings that start or load code at run
time: ``"-m", "pkg.mod"`` in a subprocess argument list (``-m pkg`` runs ``pkg/__main__.py``)
and ``importlib.import_module("pkg.mod")`` / ``__import__("pkg.mod")`` with a literal name.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# (module prefix, layer); the longest matching prefix wins.
LAYERS = [
    ("configs", 0),
    ("corpus", 1),
    ("actors.engine", 2),
    ("actors.drafters", 3),
    ("actors.proposers", 4),
    ("actors.serve", 5),
    ("actors", 6),          # the engine's command line: generate
    ("cluster", 6.5),       # bring-up: cluster up/down, launch (for other commands), a vLLM server
    ("train", 7),
    # analysis along its data flow: results and per-cell metrics -> the step-cost and
    # capacity model -> decisions (recommendation, plan, validation figures) -> the report
    ("analysis.data", 8.0),
    ("analysis.model", 8.1),
    ("analysis.decide", 8.2),
    ("analysis.report", 8.3),
    # loadgen: sending traffic -> writing results -> the run's CLI phases -> tools
    ("loadgen.run", 9.0),
    ("loadgen.results", 9.1),
    ("loadgen.cli", 9.2),
    ("loadgen.tools", 9.3),
    ("loadgen", 9.4),       # __main__
    # on top: what starts the service and drives load (plan / policy validation), then the
    # analysis commands that run them (cli, policy_cli, backtest_cli, __main__)
    ("analysis.campaigns", 10.0),
    ("analysis", 10.1),
    ("bench", 11),          # benchmarks: engine, serving, step cost, vs vLLM, the load generator
]
PACKAGES = sorted({p.split(".")[0] for p, _ in LAYERS})


def layer_of(module: str) -> float | None:
    best = None
    for prefix, layer in LAYERS:
        if module == prefix or module.startswith(prefix + "."):
            if best is None or len(prefix) > len(best[0]):
                best = (prefix, layer)
    return None if best is None else best[1]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _literal(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def dash_m_modules(tree: ast.AST) -> set[str]:
    """Modules started as ``"-m", "pkg.mod"`` in a list or tuple (a subprocess argument list)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.List, ast.Tuple)):
            names = [_literal(e) for e in node.elts]
            out.update(b for a, b in zip(names, names[1:]) if a == "-m" and b)
    return out


def runtime_imports(tree: ast.AST) -> set[str]:
    """Modules named by a literal in ``importlib.import_module("...")`` or ``__import__("...")``."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args and _literal(node.args[0]):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if name in ("import_module", "__import__"):
                out.add(_literal(node.args[0]))
    return out


def imports_in(source: str, filename: str = "<planted>") -> set[str]:
    """Every module of this project that ``source`` imports, starts with ``-m`` or loads by a
    literal name (``-m pkg`` counts as ``pkg`` and ``pkg.__main__``)."""
    tree = ast.parse(source, filename=filename)
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module)
            # `from analysis.model import capacity` imports the submodule analysis.model.capacity
            out.update(f"{node.module}.{a.name}" for a in node.names)
    started = dash_m_modules(tree)
    out |= started | {f"{m}.__main__" for m in started} | runtime_imports(tree)
    return {m for m in out if m.split(".")[0] in PACKAGES}


def imports_of(path: Path) -> set[str]:
    return imports_in(path.read_text(), str(path))


def graph(planted: dict[str, str] | None = None) -> dict[str, set[str]]:
    """Module -> the project modules it reaches (imports, ``-m``, literal ``import_module``).
    ``planted``: {module: source text} read instead of (or beside) the tree's files."""
    files = [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")]
    sources = {module_name(p): p for p in files}
    sources.update(planted or {})
    g = {}
    for name, src in sources.items():
        deps = imports_of(src) if isinstance(src, Path) else imports_in(src)
        # keep edges to real modules (drop `from pkg import function` names)
        g[name] = {m for m in deps if m in sources and m != name}
    return g


def upward(g: dict[str, set[str]]) -> list[str]:
    return sorted(f"{a} (layer {layer_of(a)}) reaches {b} (layer {layer_of(b)})"
                  for a, deps in g.items() for b in deps if layer_of(b) > layer_of(a))


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    state: dict[str, int] = {}
    found = []

    def visit(n, stack):
        state[n] = 1
        for d in sorted(g[n]):
            if state.get(d) == 1:
                found.append(stack[stack.index(d):] + [d])
            elif d not in state:
                visit(d, stack + [d])
        state[n] = 2

    for n in sorted(g):
        if n not in state:
            visit(n, [n])
    return found


def test_every_module_has_a_layer():
    assert [m for m in graph() if layer_of(m) is None] == []


def test_imports_point_down_only():
    assert upward(graph()) == []


def test_no_import_cycles():
    assert cycles(graph()) == []


def test_subprocess_and_importlib_strings_are_edges():
    """``-m`` argument lists and literal ``import_module`` names are read as edges: the real
    tree's bring-up (``cluster.launch`` starts ``python -m cluster``) and a planted module."""
    g = graph()
    assert {"cluster", "cluster.__main__"} <= g["cluster.launch"]
    assert "loadgen.run.ray_workers" in g["loadgen.run.locust_runner"]
    planted = ("import importlib, subprocess, sys\n"
               "def f():\n"
               "    importlib.import_module('analysis.data.load')\n"
               "    subprocess.run((sys.executable, '-m', 'loadgen.tools.fake_server', '--port', '1'))\n"
               "    subprocess.run([sys.executable, '-m', 'locust'])\n")
    deps = graph({"bench.planted": planted})["bench.planted"]
    assert deps == {"analysis.data.load", "loadgen.tools.fake_server"}


def test_layer_check_fails_on_a_planted_subprocess_loop():
    """The loop issue 39 found, planted again: the bring-up layer starting the load generator
    (``python -m loadgen``) while the load generator imports the bring-up layer. Invisible to
    an import-only reading; the layer check must see it climb and close a circle."""
    launch = (ROOT / "cluster" / "launch.py").read_text()
    looped = launch + ("\n\ndef _planted():\n    import subprocess, sys\n"
                       "    subprocess.run([sys.executable, '-m', 'loadgen', '--tier', 'low'])\n")
    g = graph({"cluster.launch": looped})
    assert "cluster.launch (layer 6.5) reaches loadgen.__main__ (layer 9.4)" in upward(g)
    loops = cycles(g)
    assert any("cluster.launch" in c and "loadgen.__main__" in c for c in loops), loops
    # the same text without the call is clean again
    assert upward(graph({"cluster.launch": launch})) == [] and cycles(graph()) == []


@pytest.mark.parametrize("module,layer", [("actors.engine.model", 2), ("actors.proposers.dflash", 4),
                                          ("actors.generate", 6), ("cluster.launch", 6.5),
                                          ("loadgen.cli.main", 9.2), ("analysis.model.stepcost", 8.1),
                                          ("analysis.campaigns.plan_validation", 10.0),
                                          ("analysis.cli", 10.1), ("bench.vs_vllm", 11)])
def test_layer_lookup(module, layer):
    assert layer_of(module) == layer


MAX_FUNCTION_LINES = 60   # issue 39: a function longer than a screen is split by what its parts do


def test_no_function_in_product_code_is_longer_than_a_screen():
    """Every function and method of the product packages (not tests/) has at most
    MAX_FUNCTION_LINES lines, decorators excluded, docstring included."""
    long = []
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    n = node.end_lineno - node.lineno + 1
                    if n > MAX_FUNCTION_LINES:
                        long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({n} lines)")
    assert not long, "\n".join(long)
