"""One cell or batch as plain Python or Arrow, whatever Ray or Spark handed over.

pandas and numpy batches hold lists as numpy object arrays and missing strings as NaN; row
validation, chat templates and programs want plain lists, dicts and None, and the output side
wants one Arrow table.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import pyarrow as pa


def to_python(value: Any) -> Any:
    """Plain Python for one cell: numpy arrays/scalars → lists/scalars, NaN/NA → None."""
    if value is None:
        return None
    if isinstance(value, float) and math.isnan(value):
        return None
    if type(value).__name__ in ("NAType", "NaTType"):
        return None
    if isinstance(value, dict):
        return {k: to_python(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_python(v) for v in value]
    if hasattr(value, "tolist") and hasattr(value, "dtype"):  # numpy array or scalar
        return to_python(value.tolist())
    return value


def to_arrow(batch: Any) -> pa.Table:
    """Any batch Ray or Spark hands over (Arrow table/record batch, pandas, dict of columns)."""
    if isinstance(batch, pa.Table):
        return batch
    if isinstance(batch, pa.RecordBatch):
        return pa.Table.from_batches([batch])
    if isinstance(batch, Mapping):
        return pa.table({k: pa.array(to_python(list(v))) for k, v in batch.items()})
    if hasattr(batch, "to_dict") and hasattr(batch, "columns"):  # pandas, imported lazily
        return pa.table({c: pa.array([to_python(v) for v in batch[c].tolist()])
                         for c in batch.columns})
    raise TypeError(f"unsupported batch type {type(batch).__name__}")


def batch_rows(batch: Any) -> list[dict[str, Any]]:
    """The rows of a batch as plain dicts (see `to_python`)."""
    return to_arrow(batch).to_pylist()


def with_outputs(table: pa.Table, indices: Sequence[int], outputs: pa.Table) -> pa.Table:
    """Input rows `indices` of `table`, all columns kept, with the columns of `outputs` (one
    row per index) appended; an input column named like an output column is replaced."""
    assert len(indices) == outputs.num_rows, (len(indices), outputs.num_rows)
    kept = table.take(pa.array(indices, type=pa.int64()))
    kept = kept.drop_columns([c for c in outputs.column_names if c in kept.column_names])
    for field, column in zip(outputs.schema, outputs.columns):
        kept = kept.append_column(field, column)
    return kept
