"""StructuredOutputsParams and from_response_format: plain data, validated at the entry point."""
from __future__ import annotations

import pytest

from batchgen_data.structured import StructuredOutputsParams, from_response_format

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


def test_exactly_one_constraint() -> None:
    for kw in ({}, {"regex": "a", "grammar": "root ::= \"a\""}, {"json_object": False}):
        with pytest.raises(ValueError, match="exactly one"):
            StructuredOutputsParams(**kw)
    assert StructuredOutputsParams(choice=("x", "y")).choice == ["x", "y"]


@pytest.mark.parametrize("kw,match", [
    ({"json": "[1"}, "json is not valid JSON"),
    ({"json": [1, 2]}, "JSON schema object"),
    ({"regex": "  "}, "regex must be a non-empty string"),
    ({"choice": ["a", ""]}, "choice must be"),
    ({"choice": "ab"}, "choice must be"),
    ({"json_object": "yes"}, "json_object"),
])
def test_bad_values_name_the_field(kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        StructuredOutputsParams(**kw)


def test_schema_text_and_dict_are_the_same_constraint() -> None:
    a = StructuredOutputsParams(json='{"type": "object", "properties": {"a": {"type": "integer"}}}')
    b = StructuredOutputsParams(json=SCHEMA)
    assert a.json == SCHEMA and a.key() == b.key()
    assert a.key() != StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True).key()
    assert b.to_dict() == {"json": SCHEMA}


def test_from_value_accepts_dicts_json_text_and_arrow_nulls() -> None:
    assert StructuredOutputsParams.from_value(None) is None
    assert StructuredOutputsParams.from_value('{"regex": "a+"}') == StructuredOutputsParams(regex="a+")
    # an Arrow struct column gives every row every field, null where unset
    row = {"json": None, "regex": None, "choice": ["a", "b"], "grammar": None,
           "json_object": None, "disable_any_whitespace": None}
    assert StructuredOutputsParams.from_value(row) == StructuredOutputsParams(choice=["a", "b"])
    assert StructuredOutputsParams.from_value({k: None for k in row}) is None
    with pytest.raises(TypeError, match="unknown key"):
        StructuredOutputsParams.from_value({"schema": SCHEMA})


def test_openai_response_format() -> None:
    assert from_response_format({"type": "text"}) is None
    assert from_response_format(None) is None
    assert from_response_format({"type": "json_object"}) == StructuredOutputsParams(json_object=True)
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}
    assert from_response_format(rf) == StructuredOutputsParams(json=SCHEMA)
    import json
    assert from_response_format(json.dumps(rf)) == StructuredOutputsParams(json=SCHEMA)
    with pytest.raises(ValueError, match="needs"):
        from_response_format({"type": "json_schema", "json_schema": {"name": "x"}})
    with pytest.raises(ValueError, match="response_format.type"):
        from_response_format({"type": "xml"})
