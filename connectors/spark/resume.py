"""Spark: generate into an output location in parts, so a killed job resumes where it stopped.

    write_generated(df, "s3://bucket/answers", id_col="id", parts=16,
                    sampling_params={"max_tokens": 64})   # run it again after a crash

A Spark write job makes its files visible only when the whole job commits, so a driver killed
at 90% of one big write leaves nothing behind. Here the input is cut into `parts` by a hash of
the id, and each part is generated and appended as its own write job: a crash loses the part in
flight and nothing before it. Each part first drops the ids already at the output location
(`resume.skip_written`), so a rerun, or a part retried after a failure, never generates a
written row again and never appends it twice.
"""
from __future__ import annotations

from typing import Any

from batchgen_data.connectors.resume import skip_written


def write_generated(df: Any, output_path: str, id_col: str, parts: int = 8,
                    fmt: str = "parquet", **generate_kwargs: Any) -> int:
    """Generate every row of `df` whose id is not yet at `output_path`, appending in parts.

    `generate_kwargs` go to `generate_df` (model, sampling_params, engine kwargs, ...). Ids
    must be unique in `df`. Returns the number of rows this call sent to the engines.
    """
    if not isinstance(parts, int) or parts < 1:
        raise ValueError(f"parts={parts!r}: must be an int >= 1")
    from pyspark.sql import functions as F

    from batchgen_data.connectors.spark import generate_df

    if id_col not in df.columns:
        raise ValueError(f"id_col={id_col!r} not in DataFrame columns {df.columns}")
    submitted = 0
    for part in range(parts):
        piece = df.where(F.pmod(F.xxhash64(F.col(id_col)), F.lit(parts)) == part)
        # read the output again before every part: the parts before it are now written
        todo = skip_written(piece, output_path, id_col, fmt).cache()
        count = todo.count()
        if count:
            out = generate_df(todo, id_col=id_col, **generate_kwargs)
            out.write.mode("append").format(fmt).save(output_path)
        todo.unpersist()
        submitted += count
    return submitted
