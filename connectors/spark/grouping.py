"""Spark's grouping by prefix: rows sharing a leading text in one partition, next to each other.

A Spark task runs one partition through one engine (spark/task.py), so rows of a document
spread over partitions are prefilled again by every task that gets one. Before `generate_df`
(`mapInArrow`) or a `batchgen_udf` select, `group_by_prefix` repartitions by a hash of each row's
first `prefix_chars` characters and sorts within each partition by it:

    from batchgen_data.connectors.spark import generate_df
    from batchgen_data.connectors.spark.grouping import group_by_prefix
    out = generate_df(group_by_prefix(df, "prompt"), "prompt", id_col="id")

Every row of one leading text lands in one partition (Spark's hash partitioning of the key), and
there consecutively, so the engine meets them together while the prefix is in its cache. The
key is Spark's own `xxhash64` over the text (a chat column: its JSON; token ids: their JSON), so
no Python runs before the task. Partitions hold whole groups: a document with many more rows
than the others makes its partition that much longer (Spark has no bounded-load partitioner;
`num_partitions` above the executors' task slots evens out what a task gets).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from batchgen_data.connectors.ray.grouping import DEFAULT_PREFIX_CHARS, check_prefix_chars

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame


def prefix_key(df: "DataFrame", prompt_col: str,
               prefix_chars: int = DEFAULT_PREFIX_CHARS) -> "Column":
    """The column expression `group_by_prefix` partitions by: xxhash64 of the leading text."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import StringType

    if prompt_col not in df.columns:
        raise ValueError(f"prompt_col={prompt_col!r}: not a column of the DataFrame "
                         f"({df.columns})")
    col = F.col(prompt_col)
    if not isinstance(df.schema[prompt_col].dataType, StringType):
        col = F.to_json(col)  # chat messages or token ids
    return F.xxhash64(F.substring(col, 1, check_prefix_chars(prefix_chars)))


def group_by_prefix(df: "DataFrame", prompt_col: str = "prompt",
                    num_partitions: int | None = None,
                    prefix_chars: int = DEFAULT_PREFIX_CHARS) -> "DataFrame":
    """`df` repartitioned by its rows' prefix key into `num_partitions` (None: as many as it
    has) and sorted by it within each partition."""
    if num_partitions is not None and (isinstance(num_partitions, bool)
                                       or not isinstance(num_partitions, int)
                                       or num_partitions < 1):
        raise ValueError(f"num_partitions={num_partitions!r}: must be an int >= 1 or None")
    key = prefix_key(df, prompt_col, prefix_chars)
    n = num_partitions or df.rdd.getNumPartitions()
    return df.repartition(n, key).sortWithinPartitions(key)
