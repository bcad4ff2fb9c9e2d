"""docs/ENGINE_API.md against the code: every method, parameter, default, attribute, field and
file it names exists, and every public method and dataclass field is named there."""
from __future__ import annotations

import ast
import inspect
import re
from dataclasses import fields
from pathlib import Path

import pytest

from batchgen_data.engine.driver import EngineDriver
from batchgen_data.engine.engine import Engine
from batchgen_data.engine.stats import EngineStats, StepShape
from batchgen_data.placement import EngineLoad, PrefixSummary, RequestSummary

ROOT = Path(__file__).resolve().parents[3]
DOC = (ROOT / "docs" / "ENGINE_API.md").read_text()
OWNERS = {"engine": Engine, "Engine": Engine, "driver": EngineDriver, "EngineDriver": EngineDriver}
CALL = re.compile(r"^(?:\w+ = )?(?P<obj>engine|Engine|driver|EngineDriver)(?:\.(?P<meth>\w+))?"
                  r"\((?P<args>.*?)\)(?:\s*->\s*(?P<ret>[^#]*?))?\s*(?:#.*)?$")


def section(title: str) -> str:
    parts = re.split(r"^## (\w+)\s*$", DOC, flags=re.M)
    named = dict(zip(parts[1::2], parts[2::2]))
    assert title in named, f"ENGINE_API.md has no '## {title}' section"
    return named[title]


def table_names(text: str) -> list[str]:
    return re.findall(r"^\| `(\w+)` \|", text, flags=re.M)


def documented_calls(title: str) -> list[re.Match[str]]:
    blocks = re.findall(r"```python\n(.*?)```", section(title), flags=re.S)
    lines = [ln.strip() for b in blocks for ln in b.splitlines()]
    lines = [ln for ln in lines if ln and not ln.startswith(("from ", "import ", "#"))]
    calls = [CALL.match(ln) for ln in lines]
    assert all(calls), [ln for ln, c in zip(lines, calls) if c is None]
    return calls  # type: ignore[return-value]


@pytest.mark.parametrize("cls", [EngineLoad, RequestSummary, PrefixSummary, EngineStats,
                                 StepShape])
def test_field_tables_match_the_dataclasses(cls: type) -> None:
    documented = table_names(section(cls.__name__))
    assert len(documented) == len(set(documented))
    assert set(documented) == {f.name for f in fields(cls)}


def test_derived_load_values_exist() -> None:
    derived = re.search(r"Derived: (.*?)\n\n", section("EngineLoad"), flags=re.S)
    assert derived is not None
    for name in re.findall(r"`(\w+)`", derived.group(1)):
        assert isinstance(getattr(EngineLoad, name), property), name


@pytest.mark.parametrize("title", ["Engine", "EngineDriver"])
def test_calls_match_the_signatures(title: str) -> None:
    seen = set()
    for call in documented_calls(title):
        cls = OWNERS[call["obj"]]
        name = call["meth"] or "__init__"
        seen.add(name)
        sig = inspect.signature(getattr(cls, name))
        params = [p for p in sig.parameters.values() if p.name != "self"]
        args = [a.strip() for a in call["args"].split(",") if a.strip()]
        assert [a.split("=")[0].lstrip("*") for a in args] == [p.name for p in params], name
        for arg, p in zip(args, params):
            if "=" in arg:
                assert p.default == ast.literal_eval(arg.split("=", 1)[1]), (name, p.name)
            elif p.kind is not p.VAR_KEYWORD:
                assert p.default is p.empty, f"{name}: {p.name} has a default the doc omits"
        if call["ret"]:
            ann = str(sig.return_annotation).strip("'\"")
            assert call["ret"] in (ann, ann.split("[")[0]), (name, ann)
    cls = OWNERS[title]
    attrs = set(table_names(section(title)))
    public = {n for n, _ in inspect.getmembers(cls) if not n.startswith("_")}
    assert public <= seen | attrs, f"undocumented: {sorted(public - seen - attrs)}"


@pytest.mark.parametrize("cls", [Engine, EngineDriver])
def test_documented_attributes_exist(cls: type) -> None:
    init = inspect.getsource(cls.__init__)  # type: ignore[misc]
    for name in table_names(section(cls.__name__)):
        assert f"self.{name} =" in init or f"self.{name}: " in init or hasattr(cls, name), name


def test_files_named_exist_in_the_repo() -> None:
    named = set(re.findall(r"`([\w./-]+(?:\.py|\.md|/))`", DOC))
    assert named, "the pattern finds nothing: fix the test"
    for path in named:
        assert (ROOT / path).exists(), f"ENGINE_API.md names {path}, which is not in the repo"
