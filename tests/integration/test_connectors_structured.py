"""Structured output, logprobs, n > 1 and chat-template options through both connectors, as
per-row fields and as defaults, on a tiny random Llama. Each row must equal the offline `LLM`
call with the same parameters, and constrained rows must validate."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any, Callable

import pytest

from batchgen_data import LLM, SamplingParams

pytest.importorskip("xgrammar")
pytestmark = pytest.mark.timeout(300)

ENGINE = {"max_model_len": 96, "max_num_seqs": 64}
SCHEMA = {"type": "object", "required": ["ok", "n"],
          "properties": {"ok": {"type": "boolean"},
                         "n": {"type": "integer", "minimum": 0, "maximum": 99}}}
RF = {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}}
REGEX = r"[a-c]{2,5}-\d\d"
TEMPLATE = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}{% if shout %}!{% endif %}"
# (response_format, structured_outputs, sampling_params) per row, JSON text: one Arrow type
ROWS = [
    # a random model loves JSON whitespace: this seed ends its object within 60 tokens
    (json.dumps(RF), None, {"temperature": 0.8, "seed": 4, "max_tokens": 60}),
    (None, json.dumps({"regex": REGEX}), {"temperature": 0.0, "max_tokens": 40}),
    (None, None, {"temperature": 0.8, "seed": 2, "max_tokens": 6, "logprobs": 2, "n": 2}),
    ('{"type": "text"}', None, {"temperature": 0.0, "max_tokens": 6}),
]


@pytest.fixture(scope="module")
def model(tiny_model_dir: Callable[..., Path]) -> str:
    return str(tiny_model_dir("llama"))


@pytest.fixture(scope="module")
def expected(model: str) -> list[Any]:
    llm = LLM(model, **ENGINE)
    params = [SamplingParams(**{**sp, **({"structured_outputs": {"json": SCHEMA}} if i == 0 else
                                         {"structured_outputs": {"regex": REGEX}} if i == 1
                                         else {})})
              for i, (_, _, sp) in enumerate(ROWS)]
    return llm.chat([[{"role": "user", "content": f"Extract row {i}"}] for i in range(len(ROWS))],
                    params, use_tqdm=False, chat_template=TEMPLATE,
                    chat_template_kwargs={"shout": True})


def rows() -> list[dict[str, Any]]:
    return [{"id": i, "prompt": f"Extract row {i}", "response_format": rf,
             "structured_outputs": so, "sampling_params": json.dumps(sp)}
            for i, (rf, so, sp) in enumerate(ROWS)]


def check(got: dict[int, dict[str, Any]], expected: list[Any]) -> None:
    for i, ref in enumerate(expected):
        row, c = got[i], ref.outputs[0]
        assert row["error"] is None and row["generated_text"] == c.text, (i, row)
        assert row["num_prompt_tokens"] == len(ref.prompt_token_ids)  # the custom template
    json_row, regex_row, sampled = got[0], got[1], got[2]
    assert json_row["finish_reason"] == "stop" and json.loads(json_row["generated_text"])["n"] < 100
    assert re.fullmatch(REGEX, regex_row["generated_text"])
    assert [s["text"] for s in sampled["samples"]] == [c.text for c in expected[2].outputs]
    assert len(sampled["logprobs"]) == sampled["num_generated_tokens"]
    first = expected[2].outputs[0]
    assert sampled["logprobs"] == pytest.approx([d[t] for t, d in zip(first.token_ids,
                                                                      first.logprobs)], abs=1e-5)
    assert all(2 <= len(top) <= 3 for top in sampled["top_logprobs"])
    assert got[3]["samples"] is None and got[3]["logprobs"] is None


def test_ray_per_row_fields(ray_local: None, model: str, expected: list[Any]) -> None:
    ray = pytest.importorskip("ray")
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    from batchgen_data.connectors.ray_data import BatchGenProcessorConfig, build_processor

    config = BatchGenProcessorConfig(model_source=model, concurrency=1, batch_size=4,
                                     engine_kwargs=ENGINE, chat_template=TEMPLATE,
                                     chat_template_kwargs={"shout": True})
    out = build_processor(config)(ray.data.from_items(rows())).take_all()
    check({r["id"]: r for r in out}, expected)


def test_spark_per_row_fields(spark: Any, model: str, expected: list[Any]) -> None:
    from batchgen_data.connectors.spark import generate_df

    df = spark.createDataFrame(rows(), "id long, prompt string, response_format string, "
                                       "structured_outputs string, sampling_params string")
    out = generate_df(df, id_col="id", model=model, chat_template=TEMPLATE,
                      chat_template_kwargs={"shout": True}, **ENGINE).collect()
    check({r.id: r.asDict(recursive=True) for r in out}, expected)


def test_spark_udf_default_constraint(spark: Any, model: str) -> None:
    from batchgen_data.connectors.spark import batchgen_udf

    compact = {"json": SCHEMA, "disable_any_whitespace": True}
    udf = batchgen_udf(model, {"temperature": 0.0, "max_tokens": 40, "logprobs": 1,
                               "structured_outputs": compact}, **ENGINE)
    df = spark.createDataFrame([(i, f"Extract row {i}") for i in range(3)], "id long, prompt string")
    out = df.select("id", udf("prompt").alias("o")).select("id", "o.*").collect()
    for r in out:
        assert r.finish_reason == "stop" and set(json.loads(r.generated_text)) == {"ok", "n"}
        assert len(r.top_logprobs) == r.num_generated_tokens == len(r.logprobs)
