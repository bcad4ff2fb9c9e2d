"""Per-row programs on local Spark with a tiny random Llama: `generate_df(program=...)` and
`batchgen_udf(program=...)` over a struct column give each example's rows the outputs of its
steps run by hand with `LLM.chat`, with the program's declared schema; a broken row errors."""
from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("pyspark")

from batchgen_data import LLM  # noqa: E402
from batchgen_data.connectors.spark import batchgen_udf, generate_df  # noqa: E402

from program_refs import EXAMPLES, example, rows_for  # noqa: E402

pytestmark = pytest.mark.timeout(300)

ENGINE = {"max_model_len": 256, "max_num_seqs": 16, "block_size": 4}
DEFAULTS = {"max_tokens": 6}


def shipped(name: str) -> Any:
    """The example's program, its module pickled by value (executors cannot import it)."""
    from pyspark import cloudpickle

    mod = example(name)
    cloudpickle.register_pickle_by_value(mod)
    return getattr(mod, EXAMPLES[name][0])


@pytest.mark.parametrize("name", ["programs_revise", "programs_vote"])
def test_generate_df_runs_each_row_program(spark: Any, model: str, llm: LLM, name: str) -> None:
    prog, by_hand = shipped(name), EXAMPLES[name][1]
    rows = rows_for(name)
    ddl = "id long, question string" + (", samples int" if name == "programs_vote" else "")
    data = [(i, r["question"], *([r["samples"]] if "samples" in r else []))
            for i, r in enumerate(rows)]
    if name == "programs_revise":
        data.append((99, None))  # the program cannot read it: a row error
    df = spark.createDataFrame(data, ddl).repartition(2, "id")
    out = generate_df(df, id_col="id", model=model, sampling_params=DEFAULTS, program=prog,
                      **ENGINE)
    assert out.columns == df.columns + prog.schema.names + ["error"]
    got = {r["id"]: r.asDict() for r in out.collect()}
    for i, ref in enumerate(by_hand(llm, rows, DEFAULTS["max_tokens"])):
        assert got[i]["error"] is None, got[i]["error"]
        assert {c: got[i][c] for c in prog.schema.names} == ref
    if name == "programs_revise":
        assert "needs string 'role' and 'content'" in got[99]["error"]
        assert got[99]["answer"] is None


def test_udf_over_a_struct_column(spark: Any, model: str, llm: LLM) -> None:
    from pyspark.sql import functions as F

    name = "programs_judge"
    prog, by_hand = shipped(name), EXAMPLES[name][1]
    rows = rows_for(name)
    df = spark.createDataFrame([(i, r["question"], r["answer_a"], r["answer_b"])
                                for i, r in enumerate(rows)],
                               "id long, question string, answer_a string, answer_b string")
    judge = batchgen_udf(model=model, sampling_params=DEFAULTS, program=prog, **ENGINE)
    out = df.select("id", judge(F.struct("question", "answer_a", "answer_b")).alias("r"))
    got = {r["id"]: r["r"].asDict() for r in out.collect()}
    for i, ref in enumerate(by_hand(llm, rows, DEFAULTS["max_tokens"])):
        assert got[i].pop("error") is None
        assert got[i] == ref


def test_spark_needs_a_declared_schema(spark: Any, model: str) -> None:
    from batchgen_data import Generate, program

    @program
    def undeclared(row: dict[str, Any]) -> Any:
        yield Generate("x")
        return {}

    df = spark.createDataFrame([(1, "q")], "id long, question string")
    with pytest.raises(ValueError, match=r"@program\(schema="):
        generate_df(df, model=model, program=undeclared, **ENGINE)
