"""Spark connector end to end on local[2] with a tiny random Llama (its tokenizer has a ChatML
template, so by default a plain prompt is sent as one user turn: the offline reference is
`LLM.chat`; with apply_chat_template=False it is `LLM.generate`).

All tests share one engine configuration, so each Python worker loads the model once and later
tests reuse it (as production jobs do). No test depends on another having run first: a failed
task (the on_error="raise" tests) retires its worker, and the next task simply loads the model
again (checked by running the fail-fast tests first).
"""
from __future__ import annotations

from typing import Any, Callable, Iterator

import pytest

pytest.importorskip("pyspark")

from batchgen_data import LLM, SamplingParams  # noqa: E402
from batchgen_data.connectors.common import derive_seed  # noqa: E402
from batchgen_data.connectors.spark import batchgen_udf, generate_df  # noqa: E402

pytestmark = pytest.mark.timeout(300)

ENGINE = {"max_model_len": 64, "max_num_seqs": 64}
GREEDY = {"temperature": 0.0, "max_tokens": 8}
SAMPLED = {"temperature": 0.9, "top_p": 0.95, "max_tokens": 8}
PROMPTS = [f"The quick brown fox {i} jumps over" if i % 2 else f"Summarise paragraph {i}"
           for i in range(24)]


@pytest.fixture
def arrow_batch_rows(spark: Any) -> Iterator[Callable[[int], None]]:
    key = "spark.sql.execution.arrow.maxRecordsPerBatch"
    old = spark.conf.get(key)
    yield lambda n: spark.conf.set(key, str(n))
    spark.conf.set(key, old)


def texts(outs: list) -> list[str]:
    return [o.outputs[0].text for o in outs]


def chat(llm: LLM, prompts: list[str], params: Any) -> list[Any]:
    """Offline reference for templated prompt rows: each prompt as one user turn."""
    return llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)


def prompt_df(spark: Any, prompts: list[Any], partitions: int = 2) -> Any:
    rows = [(i, p) for i, p in enumerate(prompts)]
    return spark.createDataFrame(rows, "id long, prompt string").repartition(partitions, "id")


def run_udf(df: Any, udf: Any, col: str = "prompt") -> list[Any]:
    return sorted(df.select("id", udf(col).alias("o")).select("id", "o.*").collect(),
                  key=lambda r: r.id)


def test_udf_matches_offline_generate(spark: Any, model: str, llm: LLM) -> None:
    df = prompt_df(spark, PROMPTS)
    greedy = run_udf(df, batchgen_udf(model, GREEDY, **ENGINE))
    expected = chat(llm, PROMPTS, SamplingParams(**GREEDY))
    assert [r.generated_text for r in greedy] == texts(expected)
    assert [r.generated_token_ids for r in greedy] == [o.outputs[0].token_ids for o in expected]
    assert all(r.error is None and r.finish_reason in ("stop", "length") for r in greedy)
    assert [r.num_prompt_tokens for r in greedy] == [len(o.prompt_token_ids) for o in expected]

    # no seed given: each row is seeded from its prompt, so offline runs can reproduce it
    sampled = run_udf(df, batchgen_udf(model, SAMPLED, **ENGINE))
    seeded = [SamplingParams(**SAMPLED, seed=derive_seed(0, p)) for p in PROMPTS]
    expected = texts(chat(llm, PROMPTS, seeded))
    assert [r.generated_text for r in sampled] == expected


def test_raw_prompts_without_the_chat_template(spark: Any, model: str, llm: LLM) -> None:
    df = prompt_df(spark, PROMPTS[:8])
    rows = run_udf(df, batchgen_udf(model, GREEDY, apply_chat_template=False, **ENGINE))
    raw = llm.generate(PROMPTS[:8], SamplingParams(**GREEDY), use_tqdm=False)
    assert [r.generated_token_ids for r in rows] == [o.outputs[0].token_ids for o in raw]
    assert [r.num_prompt_tokens for r in rows] == [len(o.prompt_token_ids) for o in raw]
    templated = chat(llm, PROMPTS[:8], SamplingParams(**GREEDY))
    assert [len(o.prompt_token_ids) for o in raw] != [len(o.prompt_token_ids) for o in templated]


def test_bad_rows_become_errors(spark: Any, model: str, llm: LLM) -> None:
    too_long = "the lazy dog " * 40
    prompts = ["The quick brown fox", None, "", too_long, "What is the capital of France?"]
    rows = run_udf(prompt_df(spark, prompts), batchgen_udf(model, GREEDY, **ENGINE))
    assert [r.error is None for r in rows] == [True, False, False, False, True]
    assert "null" in rows[1].error and "empty" in rows[2].error
    assert "max_model_len" in rows[3].error
    assert rows[3].generated_text == "" and rows[3].num_generated_tokens == 0
    good = chat(llm, [prompts[0], prompts[4]], SamplingParams(**GREEDY))
    assert [rows[0].generated_text, rows[4].generated_text] == texts(good)


def test_sql_registration(spark: Any, model: str, llm: LLM) -> None:
    spark.udf.register("batchgen_generate", batchgen_udf(model, GREEDY, **ENGINE))
    prompt_df(spark, PROMPTS[:6]).createOrReplaceTempView("prompts")
    rows = spark.sql("SELECT id, batchgen_generate(prompt).generated_text AS text "
                     "FROM prompts").collect()
    expected = chat(llm, PROMPTS[:6], SamplingParams(**GREEDY))
    assert [r.text for r in sorted(rows, key=lambda r: r.id)] == texts(expected)


def test_small_arrow_batches_still_fill_engine(spark: Any, model: str,
                                               arrow_batch_rows: Callable[[int], None]) -> None:
    arrow_batch_rows(4)
    prompts = [f"Extract the invoice number {i}" for i in range(32)]
    udf = batchgen_udf(model, GREEDY, debug_stats=True, **ENGINE)
    rows = run_udf(prompt_df(spark, prompts, partitions=1), udf)
    assert len(rows) == 32 and all(r.error is None for r in rows)
    # predict_batch_udf would cap the engine at 4 sequences here
    assert max(r.engine_max_batch_seqs for r in rows) > 4


def test_generate_df_completion_order_keeps_columns(spark: Any, model: str, llm: LLM) -> None:
    from pyspark.sql import functions as F

    prompts = PROMPTS[:12] + [None]
    overrides = F.when(F.col("id") == 0, F.lit('{"max_tokens": 2}')).when(
        F.col("id") == 1, F.lit('{"temperature": -1}'))  # per-row sampling_params (JSON)
    df = prompt_df(spark, prompts).withColumn("tag", F.lit("x")).withColumn(
        "sampling_params", overrides)
    out = generate_df(df, id_col="id", model=model, sampling_params=SAMPLED, **ENGINE).collect()
    assert sorted(r.id for r in out) == list(range(13))
    assert set(out[0].asDict()) >= {"id", "prompt", "tag", "generated_text", "error"}
    by_id = {r.id: r for r in out}
    assert "null" in by_id[12].error and by_id[12].tag == "x"
    assert "temperature" in by_id[1].error
    # seeded from the id column, not the prompt; row 0 with its own max_tokens
    seeded = [SamplingParams(**{**SAMPLED, "max_tokens": 2 if i == 0 else 8},
                             seed=derive_seed(0, str(i))) for i in range(12)]
    expected = texts(chat(llm, PROMPTS[:12], seeded))
    got = [by_id[i].generated_text for i in range(12)]
    assert got[0] == expected[0] and by_id[0].num_generated_tokens <= 2
    assert got[2:] == expected[2:]


def test_chat_messages_column(spark: Any, model: str, llm: LLM) -> None:
    convs = [[{"role": "user", "content": f"What is the capital of France {i}?"}] for i in range(4)]
    df = spark.createDataFrame([(i, c) for i, c in enumerate(convs)],
                               "id long, messages array<struct<role:string,content:string>>")
    rows = run_udf(df, batchgen_udf(model, GREEDY, **ENGINE), col="messages")
    assert [r.generated_text for r in rows] == texts(llm.chat(convs, SamplingParams(**GREEDY),
                                                             use_tqdm=False))


def test_on_error_raise_fails_the_job(spark: Any, model: str) -> None:
    df = prompt_df(spark, ["The quick brown fox", ""])
    with pytest.raises(Exception, match="empty"):
        run_udf(df, batchgen_udf(model, GREEDY, on_error="raise", **ENGINE))


def test_on_error_raise_fails_the_job_for_an_engine_side_error(spark: Any, model: str) -> None:
    # the row is well formed; only the engine knows it is longer than max_model_len
    df = prompt_df(spark, ["The quick brown fox", "jumps over the lazy dog " * 40])
    with pytest.raises(Exception, match="max_model_len"):
        run_udf(df, batchgen_udf(model, GREEDY, on_error="raise", apply_chat_template=False,
                                 **ENGINE))


def test_generate_df_on_error_raise_fails_the_job(spark: Any, model: str) -> None:
    from pyspark.sql import functions as F

    df = prompt_df(spark, PROMPTS[:4]).withColumn(
        "sampling_params", F.when(F.col("id") == 2, F.lit('{"temperature": -1}')))
    with pytest.raises(Exception, match="temperature"):
        generate_df(df, id_col="id", model=model, sampling_params=GREEDY, on_error="raise",
                    **ENGINE).collect()
    # the same rows with on_error="row": one error row, the job succeeds
    out = generate_df(df, id_col="id", model=model, sampling_params=GREEDY, **ENGINE).collect()
    assert sorted(r.id for r in out if r.error is not None) == [2]


@pytest.mark.slow
def test_a_tensor_parallel_engine_in_a_task(spark: Any, model: str, llm: LLM) -> None:
    """`tensor_parallel_size=2` through the UDF: the task's Python worker runs rank 0 and starts
    rank 1 as its own process (docs/parallel.md); its rows equal the one-device engine's."""
    prompts = PROMPTS[:8]
    rows = run_udf(prompt_df(spark, prompts, partitions=1),
                   batchgen_udf(model, GREEDY, tensor_parallel_size=2, **ENGINE))
    expected = chat(llm, prompts, SamplingParams(**GREEDY))
    assert all(r.error is None for r in rows), [r.error for r in rows]
    assert [r.generated_token_ids for r in rows] == [o.outputs[0].token_ids for o in expected]
