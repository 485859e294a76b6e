"""The import graph points one way: each layer imports only itself and the layers below.

Layers, lowest first (docs/design.md, "Architecture"): configuration and names; the
offline text sources; the engine core; the drafter networks; the proposers
(one per strategy); the Ray Serve layer; the engine CLIs; training; the
analysis; the load generator; cluster bring-up. Every ``import`` statement is
read, including those inside functions, so a lazy import cannot hide an edge.
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
    ("actors", 6),          # CLIs: generate, bench, bench_serve, evaluate
    ("train", 7),
    # analysis along its data flow: results and per-cell metrics -> the step-cost and
    # capacity model -> decisions (recommendation, plan, validation) -> the report -> CLI
    ("analysis.data", 8.0),
    ("analysis.model", 8.1),
    ("analysis.decide", 8.2),
    ("analysis.report", 8.3),
    ("analysis", 8.4),      # cli, backtest_cli, __main__
    # loadgen: sending traffic -> writing results -> the run's CLI phases -> tools
    ("loadgen.run", 9.0),
    ("loadgen.results", 9.1),
    ("loadgen.cli", 9.2),
    ("loadgen.tools", 9.3),
    ("loadgen", 9.4),       # __main__
    ("cluster", 10),
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


def imports_of(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module)
            # `from analysis.model import capacity` imports the submodule analysis.model.capacity
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return {m for m in out if m.split(".")[0] in PACKAGES}


def graph() -> dict[str, set[str]]:
    files = [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")]
    mods = {module_name(p): p for p in files}
    g = {}
    for name, path in mods.items():
        # keep edges to real modules (drop `from pkg import function` names)
        g[name] = {m for m in imports_of(path) if m in mods and m != name}
    return g


def test_every_module_has_a_layer():
    assert [m for m in graph() if layer_of(m) is None] == []


def test_imports_point_down_only():
    upward = sorted(f"{a} (layer {layer_of(a)}) imports {b} (layer {layer_of(b)})"
                    for a, deps in graph().items() for b in deps if layer_of(b) > layer_of(a))
    assert upward == []


def test_no_import_cycles():
    g = graph()
    state: dict[str, int] = {}
    cycles = []

    def visit(n, stack):
        state[n] = 1
        for d in g[n]:
            if state.get(d) == 1:
                cycles.append(stack[stack.index(d):] + [d])
            elif d not in state:
                visit(d, stack + [d])
        state[n] = 2

    for n in sorted(g):
        if n not in state:
            visit(n, [n])
    assert cycles == []


@pytest.mark.parametrize("module,layer", [("actors.engine.model", 2), ("actors.proposers.dflash", 4),
                                          ("actors.bench", 6), ("loadgen.cli.main", 9.2),
                                          ("analysis.model.stepcost", 8.1), ("analysis.cli", 8.4)])
def test_layer_lookup(module, layer):
    assert layer_of(module) == layer
