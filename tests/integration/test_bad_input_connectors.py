"""The bad-input catalogue (bad_input_catalogue.py) through the Ray Data operator and through
Spark's `generate_df` and `batchgen_udf`: each bad row comes back with its catalogued `error`,
the good rows of the same batch match the offline run token for token, the job finishes, and
`on_error="raise"` fails the job with the same message.
"""
from __future__ import annotations

import re
from typing import Any

import pytest

from bad_input_catalogue import CATALOGUE, Bad
from batchgen_data import LLM, SamplingParams

pytestmark = pytest.mark.timeout(400)

ENGINE = {"max_model_len": 64, "max_num_seqs": 32}
DEFAULTS = {"temperature": 0.0, "max_tokens": 6}
GOOD = ["The quick brown fox jumps over", "Summarise paragraph 3", "What is the capital?"]
COLUMNS = ("prompt", "messages", "prompt_token_ids", "sampling_params")
NAN_KIND = next(b for b in CATALOGUE if b.kind == "temperature NaN")


def want(bad: Bad, llm: LLM) -> str:
    return bad.expected(llm.engine.vocab_size, llm.engine.max_model_len)


def chat_ids(llm: LLM, prompts: list[str]) -> list[list[int]]:
    """Offline tokens of plain prompts as the connectors send them (one user turn)."""
    outs = llm.chat([[{"role": "user", "content": p}] for p in prompts],
                    SamplingParams(**DEFAULTS), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def full_row(i: int, **cells: Any) -> dict[str, Any]:
    return {"id": i, **{c: None for c in COLUMNS}, **cells}


def check(got: list[dict[str, Any]], bad_by_id: dict[int, Bad], good_ids: dict[int, list[int]],
          llm: LLM) -> None:
    assert sorted(r["id"] for r in got) == sorted([*bad_by_id, *good_ids])  # once each
    for row in got:
        if row["id"] in bad_by_id:
            bad = bad_by_id[row["id"]]
            assert row["error"] == want(bad, llm), bad.kind
            assert row["generated_text"] == "" and row["finish_reason"] is None
        else:
            assert row["error"] is None
            assert list(row["generated_token_ids"]) == good_ids[row["id"]]


# ---- Ray ------------------------------------------------------------------------------------
def ray_run(model: str, rows: list[dict[str, Any]], **kw: Any) -> list[dict[str, Any]]:
    import ray

    from batchgen_data.connectors.ray_data import BatchGenPredictor

    # one input block: a column holding a string here and an int there becomes one Python-
    # object column; split over blocks, Ray Data could not concatenate string with int64 ones
    return ray.data.from_items(rows, override_num_blocks=1).map_batches(
        BatchGenPredictor, batch_size=8, batch_format="pyarrow",
        fn_constructor_kwargs=dict(model=model, sampling_params=DEFAULTS, migration=False,
                                   **ENGINE, **kw),
        compute=ray.data.ActorPoolStrategy(size=1, max_concurrent_calls_per_actor=2),
        num_cpus=0.5).take_all()


def test_ray_operator(ray_local: None, model: str, llm: LLM) -> None:
    good = {i: p for i, p in enumerate(GOOD)}
    bad_by_id = {100 + k: b for k, b in enumerate(CATALOGUE)}
    rows = [full_row(i, prompt=p) for i, p in good.items()]
    rows += [full_row(i, **b.row()) for i, b in bad_by_id.items()]
    got = ray_run(model, rows)
    check(got, bad_by_id, dict(zip(good, chat_ids(llm, GOOD))), llm)
    # a dataset without any input column: every row says so, the job still finishes
    got = ray_run(model, [{"id": i, "text": "hi"} for i in range(3)])
    assert [r["error"] for r in got] == [
        "row has none of the input columns ['prompt', 'messages', 'prompt_token_ids']"] * 3


def test_ray_on_error_raise(ray_local: None, model: str, llm: LLM) -> None:
    rows = [full_row(0, prompt=GOOD[0]), full_row(1, **NAN_KIND.row())]
    with pytest.raises(Exception, match=re.escape(want(NAN_KIND, llm))):
        ray_run(model, rows, on_error="raise")


# ---- Spark ----------------------------------------------------------------------------------
SPARK_TYPES = {"prompt": "string", "prompt_token_ids": "array<bigint>",
               "messages": "array<struct<role:string,content:string>>"}


def frame_kinds(column: str) -> list[Bad]:
    """Kinds a typed DataFrame with this prompt column holds next to good rows."""
    cols = (column, "sampling_params") if column == "prompt" else (column,)
    return [b for b in CATALOGUE if b.column in cols and b.spark_column]


def good_cells(llm: LLM, column: str) -> tuple[list[Any], list[list[int]]]:
    """Good values for a prompt column and their offline tokens."""
    if column == "prompt":
        return list(GOOD), chat_ids(llm, GOOD)
    if column == "messages":
        convs = [[{"role": "user", "content": p}] for p in GOOD]
        return convs, chat_ids(llm, GOOD)
    ids = [llm.tokenizer.encode(p) for p in GOOD]
    outs = llm.generate([{"prompt_token_ids": t} for t in ids], SamplingParams(**DEFAULTS),
                        use_tqdm=False)
    return ids, [o.outputs[0].token_ids for o in outs]


def spark_frame(spark: Any, llm: LLM, column: str) -> tuple[Any, dict[int, Bad], dict[int, Any]]:
    values, tokens = good_cells(llm, column)
    bad_by_id = {100 + k: b for k, b in enumerate(frame_kinds(column))}
    rows = [(i, v, None) for i, v in enumerate(values)]
    for i, b in bad_by_id.items():
        row = b.row()
        rows.append((i, row.get(column), row.get("sampling_params")))
    schema = f"id long, {column} {SPARK_TYPES[column]}, sampling_params string"
    df = spark.createDataFrame(rows, schema).repartition(2, "id")
    return df, bad_by_id, dict(enumerate(tokens))


@pytest.mark.parametrize("column", list(SPARK_TYPES))
def test_spark_generate_df_and_udf(spark: Any, model: str, llm: LLM, column: str) -> None:
    from batchgen_data.connectors.spark import batchgen_udf, generate_df

    df, bad_by_id, good = spark_frame(spark, llm, column)
    out = generate_df(df, prompt_col=column, id_col="id", model=model,
                      sampling_params=DEFAULTS, **ENGINE)
    check([r.asDict() for r in out.collect()], bad_by_id, good, llm)
    # the UDF sees only the prompt column: its kinds, not the sampling_params ones; it sees
    # cells without their column's name, so an empty list is neither ids nor messages there
    udf = batchgen_udf(model, DEFAULTS, **ENGINE)
    udf_bad = {i: b for i, b in bad_by_id.items() if b.column == column and b.value != []}
    rows = df.filter(df.id.isin(list(good) + list(udf_bad))).select(
        "id", udf(column).alias("o")).select("id", "o.*").collect()
    check([r.asDict() for r in rows], udf_bad, good, llm)


def test_spark_whole_columns_of_the_wrong_type(spark: Any, model: str, llm: LLM) -> None:
    """Kinds a typed column cannot hold next to good rows: a column of that type errs on
    every row with the catalogued message."""
    from batchgen_data.connectors.spark import batchgen_udf

    kinds = [b for b in CATALOGUE if not b.spark_column]
    types = {"prompt": "bigint", "prompt_token_ids": "array<string>",
             "messages": "array<struct<role:string,content:bigint>>"}
    udf = batchgen_udf(model, DEFAULTS, **ENGINE)
    for bad in kinds:
        df = spark.createDataFrame([(0, bad.value)], f"id long, c {types[bad.column]}")
        (row,) = df.select(udf("c").alias("o")).select("o.*").collect()
        assert row.error == want(bad, llm), bad.kind


def test_spark_ids_null_or_repeated(spark: Any, model: str, llm: LLM) -> None:
    from batchgen_data.connectors.spark import generate_df

    df = spark.createDataFrame([(7, GOOD[0]), (7, GOOD[1]), (None, GOOD[2])],
                               "id long, prompt string").coalesce(1)
    got = generate_df(df, id_col="id", model=model, sampling_params=DEFAULTS, **ENGINE).collect()
    errors = sorted(str(r.error) for r in got)
    assert errors == ["None", "id is null: id_col='id' needs an id in every row",
                      "id=7 appears more than once (id_col='id')"]
    with pytest.raises(ValueError, match="column 'nope' not in DataFrame columns"):
        generate_df(df, prompt_col="nope", model=model)


def test_spark_on_error_raise(spark: Any, model: str, llm: LLM) -> None:
    from batchgen_data.connectors.spark import generate_df

    df = spark.createDataFrame([(0, GOOD[0], None), (1, "fine prompt", NAN_KIND.value)],
                               "id long, prompt string, sampling_params string")
    out = generate_df(df, id_col="id", model=model, sampling_params=DEFAULTS,
                      on_error="raise", **ENGINE)
    with pytest.raises(Exception, match=re.escape(want(NAN_KIND, llm))):
        out.collect()
