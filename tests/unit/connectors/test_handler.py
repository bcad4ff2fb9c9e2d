"""connectors/handler.py and row_kinds.py: every kind of row a connector runs (generation,
program, pooling) is a `RowHandler` with the Protocol's methods and signatures, opened from a
`RowKind`, and one rule decides what a row error is for all of them. Fakes only: no model."""
from __future__ import annotations

import inspect
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any, Callable

import pyarrow as pa
import pytest

from batchgen_data import Generate, program
from batchgen_data.connectors.handler import RowError, RowHandler, failed_future
from batchgen_data.connectors.pooling_rows import PoolingRows
from batchgen_data.connectors.programs import ProgramRows
from batchgen_data.connectors.row_kinds import RowKind
from batchgen_data.connectors.rows import GenerationRows
from batchgen_data.core.errors import EngineDeadError


@program(schema={"answer": "string"})
def echo(row):  # type: ignore[no-untyped-def]
    out = yield Generate(row["prompt"])
    return {"answer": out.text}


class FakeEngineDriver:
    """A driver that is its own engine: enough for each kind to open (nothing runs)."""

    dead: BaseException | None = None

    def __init__(self) -> None:
        self.engine = self
        self.tokenizer = SimpleNamespace(chat_template=None, encode=lambda t, **_: [1] * len(t))
        self.config = SimpleNamespace(seed=0)
        self.pool = SimpleNamespace(num_blocks=64, block_size=4)
        self.hidden_size = 3

    def check_request(self, ids: list[int], params: Any) -> None:
        pass

    def lora_names(self) -> None:  # an engine without enable_lora
        return None

    def check_lora(self, lora: Any) -> None:
        pass

    def submit(self, *args: Any, **kwargs: Any) -> Future:
        return Future()

    def call(self, fn: Callable[[Any], Any]) -> None:
        fn(self)

    def abort(self, request_id: str) -> bool:
        return True


KINDS = {"generate": RowKind.create(), "program": RowKind.create(program=echo),
         "embed": RowKind.create("embed")}
CLASSES = {"generate": GenerationRows, "program": ProgramRows, "embed": PoolingRows}


def open_kind(name: str, on_error: str = "row",
              on_engine_dead: Callable[[BaseException], None] | None = None) -> RowHandler:
    return KINDS[name].open(FakeEngineDriver(), 0, on_error, on_engine_dead=on_engine_dead)


def protocol_members() -> list[str]:
    return [n for n, v in vars(RowHandler).items()
            if callable(v) and not n.startswith("_")]


@pytest.mark.parametrize("name", KINDS)
def test_each_kind_satisfies_the_protocol(name: str) -> None:
    rows = open_kind(name)
    try:
        assert type(rows) is CLASSES[name]
        assert isinstance(rows, RowHandler)
        assert rows.driver is not None
        for member in protocol_members():
            want = inspect.signature(getattr(RowHandler, member))
            got = inspect.signature(getattr(type(rows), member))
            assert list(got.parameters) == list(want.parameters), member
            assert [p.default for p in got.parameters.values()] == \
                [p.default for p in want.parameters.values()], member
    finally:
        rows.close()


def test_the_protocol_lists_what_connectors_call() -> None:
    assert sorted(protocol_members()) == sorted([
        "submit", "reject", "outcome", "abandon", "request_id", "is_engine_dead",
        "output_schema", "attach", "placeholders", "close"])


@pytest.mark.parametrize("name", KINDS)
def test_one_rule_decides_a_row_error_for_every_kind(name: str) -> None:
    died: list[BaseException] = []
    rows = open_kind(name, on_engine_dead=died.append)
    try:
        out = rows.outcome(failed_future(KeyError("request vanished")))
        assert out["error"] == "KeyError: 'request vanished'"
        assert rows.outcome(rows.reject("id repeated"))["error"] == "id repeated"
        with pytest.raises(EngineDeadError):
            rows.outcome(failed_future(EngineDeadError("engine loop died")))
        assert len(died) == 1 and rows.is_engine_dead(died[0])
        assert not rows.is_engine_dead(KeyError("x")) and not rows.is_engine_dead(None)
    finally:
        rows.close()
    strict = open_kind(name, on_error="raise")
    try:
        with pytest.raises(RowError, match="KeyError"):
            strict.outcome(failed_future(KeyError("request vanished")))
        with pytest.raises(RowError, match="id repeated"):
            strict.reject("id repeated")
    finally:
        strict.close()


@pytest.mark.parametrize("name", KINDS)
def test_placeholders_have_the_output_shape(name: str) -> None:
    rows = open_kind(name)
    try:
        table = pa.table({"id": [7, 8], "prompt": ["a", "b"]})
        out = rows.placeholders(table, [1], "placeholder")
        assert out.column("id").to_pylist() == [8]
        assert out.column("error").to_pylist() == ["placeholder"]
        schema = rows.output_schema()
        if schema is not None:
            assert out.schema.names[2:] == schema.names
            assert out.schema.remove(0).remove(0) == schema
    finally:
        rows.close()


def test_declared_schema_is_known_before_an_engine() -> None:
    assert "generated_text" in KINDS["generate"].declared_schema().names
    assert KINDS["program"].declared_schema().names == ["answer", "error"]
    embed = KINDS["embed"].declared_schema()
    assert embed.field("embedding").type == pa.list_(pa.float32())  # size unknown yet
    assert KINDS["embed"].pooling and not KINDS["generate"].pooling


def test_row_of_reads_a_table_row_for_each_kind() -> None:
    record = {"id": 1, "text": "hi", "sampling_params": {"max_tokens": 2}, "other": 0}
    assert KINDS["generate"].row_of(record, "text") == (
        {"prompt": "hi", "sampling_params": {"max_tokens": 2}}, "hi")
    assert KINDS["program"].row_of(record, "text") == (record, None)
    assert KINDS["embed"].row_of(record, "text") == ({**record, "prompt": "hi"}, None)
    assert KINDS["embed"].input_columns("text") == ("text",)
    assert RowKind.create("score").input_columns("text") == ("text_1", "text_2")
    assert KINDS["program"].input_columns("text") == ()
