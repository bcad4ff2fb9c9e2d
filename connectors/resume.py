"""Resume after a crash: rows already written are not generated again.

Both connectors use the same idea: every row carries a unique id, the output location (or a
record beside it) says which ids are done, and a rerun drops those rows before they reach an
engine. Nothing is kept in the driver, so a driver SIGKILLed mid-job loses at most the rows it
had not yet written.

Ray Data already has this (`ray.data.checkpoint`, Ray >= 2.50): with `DataContext.
checkpoint_config` set, a job of the shape read -> maps -> write records the ids of each block
as it is written (a pending record, the data file, then a rename: a block counts as written
only once its file is complete) and, when started again, filters the read's output through
the recorded ids and deletes data files left by blocks that never committed. The filter sits
right after the read, upstream of the engine actors, so a skipped row costs no engine time;
`checkpoint_config` is the one place this project sets it up.

Spark has no such record, so the output itself is the record: `skip_written` anti-joins the
input with the ids already at the output location. Spark commits a write job's files all at
once, at the end, so `spark_resume.write_generated` writes in parts, one Spark job each; a
crash loses only the part that was running.
"""
from __future__ import annotations

from typing import Any


def checkpoint_config(path: str, id_column: str) -> Any:
    """Ray Data's `CheckpointConfig` for resuming a job: ids recorded under `path`.

    The record is kept when the job succeeds, so running a finished job again generates
    nothing. `path` must not lie inside the output directory (Ray cleans up unfinished data
    files there by name, and the record's files would be read back as output).
    """
    if not isinstance(id_column, str) or not id_column:
        raise ValueError(f"id_column={id_column!r}: a resumed job needs a column of unique ids")
    if not isinstance(path, str) or not path:
        raise ValueError(f"resume_from={path!r}: must be a directory path or URI")
    from ray.data.checkpoint import CheckpointConfig

    return CheckpointConfig(id_column=id_column, checkpoint_path=path,
                            delete_checkpoint_on_success=False)


def skip_written(df: Any, output_path: str, id_col: str, fmt: str = "parquet") -> Any:
    """`df` without the rows whose `id_col` value is already at `output_path` (Spark).

    A missing or empty output location skips nothing. The ids are read, never the generated
    columns, so the anti-join costs one scan of one column.
    """
    if id_col not in df.columns:
        raise ValueError(f"id_col={id_col!r} not in DataFrame columns {df.columns}")
    written = _written_ids(df.sparkSession, output_path, id_col, fmt)
    if written is None:
        return df
    return df.join(written, on=id_col, how="left_anti")


def _written_ids(spark: Any, output_path: str, id_col: str, fmt: str) -> Any:
    from pyspark.errors import AnalysisException

    try:
        done = spark.read.format(fmt).load(output_path)
    except AnalysisException:  # nothing written yet (no directory, or no data files in it)
        return None
    if id_col not in done.columns:
        raise ValueError(f"output at {output_path!r} has no column {id_col!r} to resume by "
                         f"(columns: {done.columns})")
    return done.select(id_col).distinct()
