"""Grouping rows by prefix before they reach the engines: Ray Data's pre-stage
(`build_processor(..., prefix_grouping=True)`, connectors/ray/grouping.py) and Spark's
`group_by_prefix` (connectors/spark/grouping.py). Oracle: the documents the rows were made from
(each document's rows must come out next to each other, and for Spark in one partition)."""
from __future__ import annotations

import random
from itertools import groupby
from typing import Any

import pytest

DOCS, QUESTIONS = 12, 5


def shuffled_rows(seed: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    rows = []
    for d in range(DOCS):
        text = " ".join(f"w{rng.randrange(10_000)}" for _ in range(120))  # ~700 characters
        rows += [{"id": d * 100 + q, "doc": d, "prompt": f"{text}\nQuestion {q}?"}
                 for q in range(QUESTIONS)]
    rng.shuffle(rows)
    return rows


def runs_per_doc(docs: list[int]) -> dict[int, int]:
    """How many separate runs of consecutive rows each document has (1: all together)."""
    out: dict[int, int] = {}
    for d, _ in groupby(docs):
        out[d] = out.get(d, 0) + 1
    return out


def test_ray_pre_stage_keeps_a_documents_rows_together(ray_local: None) -> None:
    import ray

    from batchgen_data.connectors.ray.grouping import group_by_prefix

    rows = shuffled_rows()
    assert max(runs_per_doc([r["doc"] for r in rows]).values()) > 1  # shuffled to begin with
    ds = ray.data.from_items(rows, override_num_blocks=4)
    out = group_by_prefix(ds, prefix_chars=512).take_all()
    assert sorted(r["id"] for r in out) == sorted(r["id"] for r in rows)
    assert set(out[0]) == {"id", "doc", "prompt"}  # the key column is gone
    assert runs_per_doc([r["doc"] for r in out]) == dict.fromkeys(range(DOCS), 1)


@pytest.mark.parametrize("column", ["prompt", "messages"])
def test_spark_repartition_by_prefix(spark: Any, column: str) -> None:
    from pyspark.sql import functions as F

    from batchgen_data.connectors.spark.grouping import group_by_prefix

    rows = shuffled_rows(1)
    if column == "messages":
        rows = [{"id": r["id"], "doc": r["doc"],
                 "messages": [{"role": "user", "content": r["prompt"]}]} for r in rows]
    df = spark.createDataFrame(rows).repartition(3)
    grouped = group_by_prefix(df, column, num_partitions=3, prefix_chars=512)
    got = grouped.withColumn("pid", F.spark_partition_id()).collect()
    assert sorted(r["id"] for r in got) == sorted(r["id"] for r in rows)
    parts: dict[int, set[int]] = {}
    for r in got:
        parts.setdefault(r["doc"], set()).add(r["pid"])
    assert all(len(p) == 1 for p in parts.values())  # one partition per document
    assert runs_per_doc([r["doc"] for r in got]) == dict.fromkeys(range(DOCS), 1)
    with pytest.raises(ValueError, match="prompt_col"):
        group_by_prefix(df, "nope")
