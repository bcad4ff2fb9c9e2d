from __future__ import annotations

import pytest

from batchgen_data import SamplingParams


@pytest.mark.parametrize("kw,field", [
    (dict(temperature=-0.1), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(min_p=1.5), "min_p"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(min_tokens=5, max_tokens=3), "min_tokens"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(presence_penalty=3.0), "presence_penalty"),
    (dict(frequency_penalty=-2.5), "frequency_penalty"),
    (dict(n=0), "n"),
    (dict(logprobs=-2), "logprobs"),
    (dict(stop=[""]), "stop"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
])
def test_invalid_values_name_the_field(kw: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw)


@pytest.mark.parametrize("kw", [dict(max_tokens="5"), dict(temperature="hot"), dict(seed=1.5),
                                dict(n=1.0)])
def test_wrong_types_raise_type_error(kw: dict) -> None:
    with pytest.raises(TypeError):
        SamplingParams(**kw)


def test_from_dict_and_overrides() -> None:
    sp = SamplingParams.from_dict({"temperature": 0, "max_tokens": 5, "stop": "END"})
    assert sp.stop == ["END"] and sp.greedy
    assert sp.merged({"max_tokens": 9}).max_tokens == 9 and sp.max_tokens == 5
    with pytest.raises(TypeError, match="unknown sampling parameter"):
        SamplingParams.from_dict({"temprature": 0})


@pytest.mark.parametrize("kw,field", [
    (dict(prompt_logprobs=-2), "prompt_logprobs"),
    (dict(logit_bias={"x": 1.0}), "logit_bias"),
    (dict(logit_bias={5: "big"}), "logit_bias"),
    (dict(logit_bias={-3: 1.0}), "logit_bias"),
    (dict(logit_bias=[1, 2]), "logit_bias"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(allowed_token_ids=[1, -2]), "allowed_token_ids"),
    (dict(bad_words=["ok", " "]), "bad_words"),
    (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
    (dict(truncate_prompt_tokens=-2), "truncate_prompt_tokens"),
    (dict(detokenize=False, stop=["x"]), "detokenize"),
    (dict(best_of=3), "best_of"),
    (dict(n=2, best_of=1), "best_of"),
    (dict(structured_outputs={"json": {}, "regex": "a"}), "structured_outputs"),
    (dict(structured_outputs={"choice": []}), "structured_outputs"),
    (dict(structured_outputs={"regex": "a+"}, min_tokens=2), "min_tokens"),
    (dict(structured_outputs={"regex": "a+"}, ignore_eos=True), "ignore_eos"),
    (dict(structured_outputs={"regex": "a+"}, allowed_token_ids=[1]), "allowed_token_ids"),
    (dict(extra_args=[1]), "extra_args"),
])
def test_invalid_new_fields_name_the_field(kw: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**kw)


def test_structured_outputs_round_trip_through_plain_data() -> None:
    from batchgen_data import StructuredOutputsParams

    sp = SamplingParams(structured_outputs={"regex": "a+", "json": None})
    assert sp.structured_outputs == StructuredOutputsParams(regex="a+")
    # export/import and connectors carry params as dicts (asdict fills every field)
    assert SamplingParams.from_dict(sp.to_dict()) == sp
    with pytest.raises(TypeError, match="unknown key"):
        SamplingParams(structured_outputs={"regexp": "a+"})


def test_new_fields_are_normalised() -> None:
    sp = SamplingParams(n=2, best_of=2, logit_bias={"7": 3, 9: -250.0}, bad_words="foo",
                        allowed_token_ids=(4, 5), prompt_logprobs=0, extra_args={"k": 1})
    assert sp.logit_bias == {7: 3.0, 9: -100.0}  # string keys (JSON) -> ids; clamped like vLLM
    assert sp.bad_words == ["foo"] and sp.allowed_token_ids == [4, 5] and sp.edits_logits
    assert not SamplingParams().edits_logits
    # an Arrow map column reads back as (key, value) pairs
    assert SamplingParams(logit_bias=[(1, 0.5), (2, -1.0)]).logit_bias == {1: 0.5, 2: -1.0}
    # ... and a struct column gives every row every key, null where the row had none
    assert SamplingParams(logit_bias={"3": 1.0, "4": None}).logit_bias == {3: 1.0}
    assert SamplingParams(bad_words=["a", "b", "a"]).bad_words == ["a", "b"]


def test_truncated_prompt_keeps_the_last_tokens() -> None:
    ids = list(range(10))
    assert SamplingParams(truncate_prompt_tokens=3).truncated_prompt(ids, 100) == [7, 8, 9]
    assert SamplingParams(truncate_prompt_tokens=30).truncated_prompt(ids, 100) == ids
    assert SamplingParams(truncate_prompt_tokens=-1).truncated_prompt(ids, 5) == [6, 7, 8, 9]
    assert SamplingParams().truncated_prompt(ids, 5) == ids  # too long: the engine rejects it


def test_check_vocab_names_the_field() -> None:
    ok = SamplingParams(allowed_token_ids=[0, 9], logit_bias={9: 1.0}, stop_token_ids=[9])
    ok.check_vocab(10)
    for kw, field in ((dict(allowed_token_ids=[3, 10]), "allowed_token_ids"),
                      (dict(logit_bias={12: 1.0}), "logit_bias"),
                      # vLLM (0.34) refuses a stop id outside the logits' columns too
                      (dict(stop_token_ids=[70]), "stop_token_ids")):
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kw).check_vocab(10)


def test_unsupported_vllm_fields_get_a_clear_error() -> None:
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams.from_dict({"output_kind": 2, "max_tokens": 3})
    with pytest.raises(ValueError, match="use structured_outputs"):
        SamplingParams.from_dict({"guided_decoding": {"regex": "a"}})


def test_connector_rows_carry_the_new_fields() -> None:
    pytest.importorskip("pyarrow")
    from batchgen_data.connectors.common import RequestBuilder
    from batchgen_data.connectors.handler import RowError

    builder = RequestBuilder(tokenizer=None, default_params={"max_tokens": 4})
    row = builder.params_for('{"logit_bias": {"5": 2.5}, "allowed_token_ids": [5, 6], '
                             '"bad_words": ["no"], "truncate_prompt_tokens": 8, '
                             '"prompt_logprobs": 1, "detokenize": false}')
    assert row.logit_bias == {5: 2.5} and row.allowed_token_ids == [5, 6]
    assert row.bad_words == ["no"] and row.truncate_prompt_tokens == 8
    assert row.prompt_logprobs == 1 and row.detokenize is False and row.max_tokens == 4
    with pytest.raises(RowError, match="allowed_token_ids"):
        builder.params_for({"allowed_token_ids": []})


def test_arrow_sampling_params_columns_carry_logit_bias() -> None:
    pa = pytest.importorskip("pyarrow")
    from batchgen_data.connectors.cells import batch_rows
    from batchgen_data.connectors.common import RequestBuilder

    structs = pa.table({"sampling_params": [{"logit_bias": {"5": 2.0}},
                                           {"logit_bias": {"7": -1.0}}]})
    maps = pa.table({"sampling_params": pa.array(
        [{"logit_bias": [(5, 2.0)]}, {"logit_bias": [(7, -1.0)]}],
        type=pa.struct([("logit_bias", pa.map_(pa.int64(), pa.float64()))]))})
    builder = RequestBuilder(tokenizer=None)
    for table in (structs, maps):
        got = [builder.params_for(r["sampling_params"]).logit_bias for r in batch_rows(table)]
        assert got == [{5: 2.0}, {7: -1.0}]
