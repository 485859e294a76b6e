"""Typed seams (issue 39, item 4): the engine Protocol both backends implement, the typed step
and request rows, one forward route chosen at load.

The Protocol check is structural and by class inspection (``inspect.signature``), so the vLLM
backend is checked without importing or starting vLLM; the embedded engine is also checked as
a live instance (``isinstance`` against the ``runtime_checkable`` Protocol).
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import typing

import pytest

from actors.engine.llm_engine import LLMEngine
from actors.engine.types import SyncEngine
from actors.engine.vllm_backend import VllmEngine
from configs import metric_names as M
from configs import results_schema as S


def _protocol_members(proto: type) -> dict[str, str]:
    """name -> "method" | "property" | "attribute" for every member the Protocol declares."""
    out = {}
    for name in typing.get_type_hints(proto):
        out[name] = "attribute"
    for name, value in vars(proto).items():
        if isinstance(value, property):
            out[name] = "property"
        elif inspect.isfunction(value) and not name.startswith("_"):
            out[name] = "method"
    return out


def _init_assigns(cls: type) -> set[str]:
    """Attribute names ``cls.__init__`` assigns on ``self`` (``self.x = ...``)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls.__init__)))
    return {t.attr for n in ast.walk(tree) if isinstance(n, (ast.Assign, ast.AnnAssign))
            for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}


def _params(fn) -> list[tuple[str, object]]:
    return [(p.name, p.kind) for p in inspect.signature(fn).parameters.values()]


def protocol_mismatches(cls: type, proto: type = SyncEngine) -> list[str]:
    """What ``cls`` lacks of ``proto``: missing members, a property that is not one, a method
    whose parameters (names, kinds, order) or resolved annotations differ."""
    problems = []
    hints_cls_mod = vars(inspect.getmodule(cls))
    for name, kind in _protocol_members(proto).items():
        if kind == "attribute":
            if not hasattr(cls, name) and name not in _init_assigns(cls):
                problems.append(f"{name}: attribute not set by __init__")
            continue
        got = inspect.getattr_static(cls, name, None)
        if got is None:
            problems.append(f"{name}: missing")
        elif kind == "property":
            if not isinstance(got, property):
                problems.append(f"{name}: not a property")
        else:
            want_fn = vars(proto)[name]
            if not inspect.isfunction(got):
                problems.append(f"{name}: not a method")
            elif _params(got) != _params(want_fn):
                problems.append(f"{name}: parameters {_params(got)} != {_params(want_fn)}")
            else:
                want = typing.get_type_hints(want_fn)
                have = typing.get_type_hints(got, globalns=hints_cls_mod)
                for arg, t in want.items():
                    if have.get(arg) != t:
                        problems.append(f"{name}: {arg} annotated {have.get(arg)!r}, not {t!r}")
    return problems


@pytest.mark.parametrize("cls", [LLMEngine, VllmEngine], ids=["embedded", "vllm"])
def test_both_backends_implement_the_engine_protocol(cls):
    assert protocol_mismatches(cls) == []


def test_protocol_check_catches_a_backend_that_drifts():
    class Drifted:
        max_model_len = 8
        on_step = None

        @property
        def num_waiting(self) -> int:
            return 0

        num_running = 0                       # not a property

        def has_unfinished_requests(self) -> bool:
            return False

        def add_request(self, rid: str, prompt: str | list[int], params) -> int:   # renamed
            return 0

        def abort_request(self, request_id: str) -> None:
            pass

        def memory(self) -> dict:
            return {}

        def reset_peak_memory(self) -> None:
            pass
                                              # step: missing
    got = protocol_mismatches(Drifted)
    assert any(p.startswith("step: missing") for p in got)
    assert any(p.startswith("num_running: not a property") for p in got)
    assert any(p.startswith("add_request: parameters") for p in got)
    assert any(p.startswith("memory: return annotated") for p in got)
    assert not isinstance(Drifted(), SyncEngine)


def test_embedded_engine_instance_is_a_sync_engine(make_engine):
    engine = make_engine("autoregressive")
    assert isinstance(engine, SyncEngine)


def test_typed_rows_match_the_results_schema():
    assert tuple(S.StepRow.__annotations__) == S.names(S.ENGINE_STEP_COLUMNS) == M.STEP_LOG_COLUMNS
    assert S.StepRow.__required_keys__ == frozenset(M.STEP_LOG_COLUMNS)
    assert tuple(S.RequestRow.__annotations__) == S.names(S.REQUEST_COLUMNS)
    # the Python type follows the column type (int / float / str / list[int])
    py = {"string": str, "int32": int, "int64": int, "float64": float, "list<int64>": list[int]}
    for row, cols in ((S.StepRow, S.ENGINE_STEP_COLUMNS), (S.RequestRow, S.REQUEST_COLUMNS)):
        hints = typing.get_type_hints(row)
        for c in cols:
            t = hints[c.name]
            assert t == py[c.type] or t == py[c.type] | None, (c.name, t)


def test_engine_step_rows_are_step_rows(make_engine):
    from actors.engine.types import SamplingParams
    from actors.engine.llm_engine import run_requests

    engine = make_engine("ngram")
    rows: list = []
    keep, engine.on_step = engine.on_step, rows.append
    try:
        run_requests(engine, [("typed-0", "def add(a, b):", SamplingParams(max_tokens=6))])
    finally:
        engine.on_step = keep
    assert rows
    hints = typing.get_type_hints(S.StepRow)
    for row in rows:
        assert tuple(row) == M.STEP_LOG_COLUMNS
        for k, v in row.items():
            t = hints[k]
            ok = typing.get_args(t) or (t,)
            assert isinstance(v, tuple(x for x in ok if x is not type(None))) or v is None and type(None) in ok, (k, v)


def _bf16_model(seed: int = 0):
    """A random 2-layer qwen3 whose weights are bfloat16 values (packable: the stack call)."""
    import torch

    from actors.engine.model import CausalLM, ModelConfig

    torch.manual_seed(seed)
    cfg = ModelConfig(model_type="qwen3", vocab_size=192, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, max_position_embeddings=256, tie_word_embeddings=True)
    model = CausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    model.fuse()
    return model


def test_the_forward_route_is_chosen_at_load_not_per_step(monkeypatch):
    """``ModelRunner`` picks its route when the model loads; steps only look up their shape
    class: no ``stack()`` / ``select_route`` call while serving, the same route object, and
    the stack-sized, flat-sized, packed and padded batches each on their forward. A re-fuse
    of the weights (new packed copies) chooses again before the next forward."""
    from actors.engine.runner import ForwardRoute, ModelRunner, RowInput

    model = _bf16_model(seed=3)
    runner = ModelRunner(model, 4, 128)
    if runner.stack() is None or not runner.eager_flat:
        pytest.skip("the layer kernel or the C attention kernel did not build here")
    runner.STACK_MAX_TOKENS = 16                 # a route input: chosen again, here
    route = runner.route
    assert isinstance(route, ForwardRoute)
    assert (route.stack_tokens, route.flat_kind, route.flat_max_q) == (16, "eager", 16)
    runner.run([RowInput(s, 0, [(i % 90) + 1 for i in range(30)]) for s in range(4)],
               last_only=True)                   # prompts
    calls = []
    for name in ("_run_stack", "_run_flat_past_stack", "run_packed", "run_padded"):
        real = getattr(ModelRunner, name)
        monkeypatch.setattr(ModelRunner, name, lambda self, *a, _n=name, _f=real, **k:
                            calls.append(_n) or _f(self, *a, **k))
    monkeypatch.setattr(ModelRunner, "stack", lambda self: calls.append("stack"))
    monkeypatch.setattr(ModelRunner, "select_route", lambda self: calls.append("select"))
    # (the flat forward is the route's bound method, taken at load: the class patch does
    # not reach it, so that batch shows as an op-by-op forward and none of the others)
    cases = [([1] * 4, ["_run_stack"], "stack"),       # decodes: one C call
             ([9, 9], [], "ops"),                      # 18 tokens, short rows: eager flat
             ([20, 2], ["run_packed"], "ops"),         # a prompt chunk and a decode
             ([40], ["run_padded"], "ops")]            # one long row alone
    for lens, want, path in cases:
        calls.clear()
        runner.paths.clear()
        runner.run([RowInput(s, 30, [(i % 90) + 1 for i in range(n)])
                    for s, n in enumerate(lens)])
        assert (calls, list(runner.paths)) == (want, [path]), lens
    assert runner.route is route
    monkeypatch.undo()
    model.fuse()                                   # new packed weights: chosen again
    runner.paths.clear()
    runner.run([RowInput(0, 70, [5])])
    assert runner.route is not route and runner.route.weights_version == model.weights_version
    assert runner.route.stack_tokens == 16 and list(runner.paths) == ["stack"]
