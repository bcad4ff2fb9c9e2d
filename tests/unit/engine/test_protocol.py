"""The engine and runner Protocols (engine/protocol.py, worker/runner.py) against their
implementations: each class is an instance of its Protocol (runtime_checkable isinstance) and
every Protocol method has the same parameters there (names, kinds, order, defaults; extra
parameters only with defaults), so a front door or a step can drive any of them alike."""
from __future__ import annotations

import inspect
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import pytest

from batchgen_data.engine.engine import Engine
from batchgen_data.engine.group.group import EngineGroup
from batchgen_data.engine.pooling import PoolingEngine
from batchgen_data.engine.protocol import EngineBase, GenerationEngine
from batchgen_data.worker.model_runner import ModelRunner
from batchgen_data.worker.runner import Runner, StepInput
from batchgen_data.worker.tp.runner import TPRunner


def members(proto: type) -> tuple[list[str], list[str]]:
    """(methods and properties, data attributes) a Protocol declares, its bases' included."""
    calls, data = [], []
    for cls in proto.__mro__:
        if cls in (object,) or not getattr(cls, "_is_protocol", False):
            continue
        data += [n for n in cls.__dict__.get("__annotations__", {}) if not n.startswith("_")]
        calls += [n for n, v in vars(cls).items()
                  if not n.startswith("_") and (callable(v) or isinstance(v, property))]
    return sorted(set(calls)), sorted(set(data) - set(calls))


def mismatches(impl: type, proto: type) -> list[str]:
    """Where `impl`'s methods differ from what `proto` declares."""
    found = []
    for name in members(proto)[0]:
        want = inspect.getattr_static(proto, name)
        got = inspect.getattr_static(impl, name, None)
        if got is None:
            found.append(f"{name}: missing")
            continue
        if isinstance(want, property):
            if not isinstance(got, (property, bool)):
                found.append(f"{name}: not a property or a flag")
            continue
        p = [x for x in inspect.signature(want).parameters.values() if x.name != "self"]
        i = [x for x in inspect.signature(got).parameters.values() if x.name != "self"]
        for k, w in enumerate(p):
            g = i[k] if k < len(i) else None
            if g is None or (g.name, g.kind) != (w.name, w.kind):
                found.append(f"{name}: parameter {k} is {g} where the Protocol has {w}")
            elif w.default is not w.empty and g.default != w.default:
                found.append(f"{name}({w.name}=...): default {g.default!r}, not {w.default!r}")
            elif w.default is w.empty and g.default is not g.empty:
                found.append(f"{name}({w.name}): a default the Protocol does not give")
        found += [f"{name}({x.name}): an extra parameter without a default" for x in i[len(p):]
                  if x.default is x.empty and x.kind not in (x.VAR_KEYWORD, x.VAR_POSITIONAL)]
    return found


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Callable[..., Path]) -> Engine:
    return Engine.from_kwargs(str(tiny_model_dir("llama")), max_model_len=64)


def bare(cls: type, **data: Any) -> Any:
    """An instance of `cls` with only the given instance data: what its Protocol reads of it
    besides the class's methods (engines that take processes or a pooling model to build)."""
    obj = cls.__new__(cls)
    for key, value in data.items():
        setattr(obj, key, value)
    return obj


def test_engines_satisfy_their_protocols(engine: Engine) -> None:
    assert isinstance(engine, GenerationEngine) and engine.kind == "generation engine"
    group = bare(EngineGroup, engine=SimpleNamespace(tokenizer=engine.tokenizer,
                                                     max_model_len=engine.max_model_len))
    assert isinstance(group, GenerationEngine) and group.kind == "engine group"
    pooling = bare(PoolingEngine, tokenizer=engine.tokenizer, max_model_len=64)
    assert isinstance(pooling, EngineBase) and not isinstance(pooling, GenerationEngine)
    assert pooling.kind == "pooling engine"
    for cls, proto in ((Engine, GenerationEngine), (EngineGroup, GenerationEngine),
                       (PoolingEngine, EngineBase)):
        assert mismatches(cls, proto) == [], cls.__name__


def test_runners_satisfy_the_runner_protocol(engine: Engine) -> None:
    runner = engine.runner
    assert isinstance(runner, ModelRunner) and isinstance(runner, Runner)
    assert runner.can_overlap  # one device, no adapters, no KV host tier
    tp = bare(TPRunner, lora=None)
    assert isinstance(tp, Runner) and not tp.can_overlap  # rank 0 broadcasts each step
    for cls in (ModelRunner, TPRunner):
        assert mismatches(cls, Runner) == [], cls.__name__
    out = engine.scheduler.schedule()  # nothing submitted: an empty step
    assert isinstance(runner.prepare(out), StepInput)


def test_a_changed_signature_is_caught() -> None:
    """The comparison can fail: a method with a renamed, reordered or new required parameter,
    or a Protocol method missing, is named."""
    class Renamed(Engine):
        def submit(self, token_ids: list[int], params: Any = None,  # type: ignore[override]
                   request_id: str | None = None, prompt: str | None = None,
                   lora_request: Any = None) -> str:
            return ""

    class Required(Engine):
        def abort(self, request_id: str, why: str) -> bool:  # type: ignore[override]
            return False

    class NoClose:
        kind, tokenizer, max_model_len = "x", None, 1

        def step(self) -> list[Any]:
            return []

    assert any("submit" in m for m in mismatches(Renamed, GenerationEngine))
    assert any("abort(why)" in m for m in mismatches(Required, GenerationEngine))
    assert any(m.startswith("close: missing") for m in mismatches(NoClose, EngineBase))
    assert not isinstance(NoClose(), EngineBase)
