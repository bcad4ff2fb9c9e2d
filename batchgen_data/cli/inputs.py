"""What the command reads: an OpenAI Batch JSONL file, or a table (JSONL, Parquet, CSV).

Both become `WorkItem`s: a key that names the item in the output (its `custom_id`, or the row's
position in the table), the connector row to run, and how to report it. An OpenAI Batch line
that cannot run is a `WorkItem` with `error` set, written as an error line without running.
The kind of a `.jsonl` file is read from its first non-blank line: an OpenAI Batch line has a
`body` (and a `custom_id`, or it is answered with a `missing_custom_id` error line); a table row
has a prompt column. A file with no line at all is an OpenAI Batch file with no requests, as
vLLM's `run-batch` reads it: the output is empty and the run succeeds.
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from batchgen_data.openai.batch import BatchRequest, is_batch_line, parse_line

ROW_KEY = "__row"  # position of a table row in its input: how the output and --resume name it


@dataclass
class WorkItem:
    key: str  # custom_id, or the table row's position
    row: dict[str, Any]  # the connector row (prompt | messages | prompt_token_ids, overrides)
    request: BatchRequest | None = None  # set for OpenAI Batch input
    error_code: str | None = None
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class InputFile:
    path: Path
    is_batch: bool
    items: list[WorkItem]

    @property
    def total(self) -> int:
        return len(self.items)


def read_input(path: str | Path, default_max_tokens: int | None = None) -> InputFile:
    """All work items of one input file, in file order. `default_max_tokens` fills OpenAI
    Batch bodies without one (table rows get it from the runner's default sampling params)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"input {str(path)!r} does not exist")
    suffix = path.suffix.lower()
    if suffix in JSONL_SUFFIXES and _first_is_batch(path):
        return InputFile(path, True, list(_batch_items(path, default_max_tokens)))
    return InputFile(path, False, list(_table_items(read_table(path))))


JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")


def _first_is_batch(path: Path) -> bool:
    """Whether a JSONL file holds OpenAI Batch requests; True for a file with no lines."""
    with path.open(encoding="utf-8") as f:
        for text in f:
            if text.strip():
                try:
                    return is_batch_line(json.loads(text))
                except json.JSONDecodeError:
                    return True  # a table file is read by Arrow, which fails loudly; this is not
    return True


def _batch_items(path: Path, default_max_tokens: int | None) -> Iterator[WorkItem]:
    seen: dict[str, int] = {}
    with path.open(encoding="utf-8") as f:
        for number, text in enumerate(f, start=1):
            if not text.strip():
                continue
            req = parse_line(text, number, default_max_tokens)
            key = req.custom_id if req.custom_id is not None else f"line {number}"
            item = WorkItem(key, req.row() if req.error is None else {}, req,
                            req.error_code, req.error)
            if req.custom_id is not None and req.custom_id in seen:
                # a second line with an id already used: answering it would make the output
                # ambiguous, so it is reported once, under a key of its own
                item.key = f"line {number}"
                item.error_code = "duplicate_custom_id"
                item.error = (f"line {number}: custom_id {req.custom_id!r} was already used "
                              f"on line {seen[req.custom_id]}")
            elif req.custom_id is not None:
                seen[req.custom_id] = number
            yield item


def read_table(path: Path) -> pa.Table:
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path)
    if suffix == ".csv":
        import pyarrow.csv as pcsv

        # prompts are text whatever they look like: "42" or "nan" as a number would be a
        # prompt the engine cannot send (absent columns are ignored by Arrow)
        return pcsv.read_csv(path, convert_options=pcsv.ConvertOptions(
            column_types={"prompt": pa.string()}))
    if suffix in (".jsonl", ".json", ".ndjson"):
        import pyarrow.json as pjson

        return pjson.read_json(path)
    raise ValueError(f"input {str(path)!r}: use .jsonl (OpenAI Batch or a table), .parquet or "
                     ".csv")


def _table_items(table: pa.Table) -> Iterator[WorkItem]:
    if table.num_rows == 0:
        return  # nothing to run, as for an empty OpenAI Batch file
    if not {"prompt", "messages", "prompt_token_ids"} & set(table.column_names):
        raise ValueError(f"the input table needs a prompt, messages or prompt_token_ids column; "
                         f"it has {table.column_names}")
    for i, row in enumerate(table.to_pylist()):
        yield WorkItem(str(i), row, extra={ROW_KEY: i})
