"""Where the command writes: lines appended (and flushed) as each request finishes.

A crash therefore loses nothing already written, and `--resume` reads back what was: the keys
(`custom_id`s, or table row positions) already answered are skipped. The last line of a killed
run may be torn (half written); it is cut off before appending, so the file stays valid JSONL.

OpenAI Batch input gets OpenAI Batch output lines in OUTPUT itself. Table input gets a table:
rows go first to `OUTPUT.partial.jsonl` as they finish and become OUTPUT (Parquet, JSONL or CSV,
by its suffix) in input order when the run ends; that side file is what `--resume` reads.

A request that failed because the engine died is written (error code `engine_failed`, a table
row marked with `RETRY_KEY` in the side file) but never counted as done: `--resume` removes
those lines and runs their requests again. Every other error is the request's own answer.
"""
from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import pyarrow as pa

from batchgen_data.cli.inputs import ROW_KEY
from batchgen_data.cli.safe_files import open_nofollow, replace_lines

TABLE_SUFFIXES = (".parquet", ".jsonl", ".json", ".csv")
ENGINE_FAILED = "engine_failed"  # the error code of a request the dying engine took with it
RETRY_KEY = "__engine_failed"  # marks such a row in a table's side file


class LineLog:
    """An append-only JSONL file keyed by `key_of(line)`; `done` holds keys already in it.

    `retry_of(line)`: lines whose request must run again on `--resume` (removed from the file
    then). `own_file`: a file the command names itself (opened without following links).
    `allow_nan`: NaN and infinities kept as Python's JSON writes them (a side file read back by
    Python only); otherwise they are written as null, so every line is strict JSON."""

    def __init__(self, path: Path, resume: bool, key_of: Callable[[dict[str, Any]], Any],
                 retry_of: Callable[[dict[str, Any]], bool] = lambda line: False,
                 own_file: bool = False, allow_nan: bool = False) -> None:
        self.path = path
        self.key_of = key_of
        self.retry_of = retry_of
        self.own_file = own_file
        self.allow_nan = allow_nan
        self.done: set[str] = set()
        self.retried = 0  # lines removed by --resume for their requests to run again
        path.parent.mkdir(parents=True, exist_ok=True)
        if resume and path.exists():
            self._read_back()
            self._file: IO[str] = self._open("a")
        else:
            self._file = self._open("w")

    def _open(self, mode: str) -> IO[str]:
        return open_nofollow(self.path, mode) if self.own_file else self.path.open(
            mode, encoding="utf-8")

    def _read_back(self) -> None:
        with self._open("r") as f:
            data = f.buffer.read()
        end = data.rfind(b"\n") + 1  # everything after the last newline is a torn line
        kept: list[str] = []
        for text in data[:end].decode("utf-8", errors="replace").splitlines():
            try:
                line = json.loads(text)
                if self.retry_of(line):
                    self.retried += 1
                    continue
                key = self.key_of(line)
            except (json.JSONDecodeError, TypeError, KeyError, AttributeError):
                key = None  # a damaged line inside the file: its request is simply redone
            kept.append(text)
            if key is not None:
                self.done.add(str(key))
        if self.retried:
            replace_lines(self.path, kept)
        elif end < len(data):
            with self._open("r+") as f:
                f.truncate(end)

    def write(self, line: dict[str, Any]) -> None:
        try:
            text = json.dumps(line, ensure_ascii=False, allow_nan=self.allow_nan, default=str)
        except ValueError:  # a NaN or an infinity, in an input column or a value
            text = json.dumps(finite_json(line), ensure_ascii=False, default=str)
        self._file.write(text + "\n")
        self._file.flush()
        key = self.key_of(line)
        if key is not None and not self.retry_of(line):
            self.done.add(str(key))

    def close(self) -> None:
        self._file.close()


def batch_line_key(line: dict[str, Any]) -> str | None:
    """The key of an output line: its custom_id, or `line N` for an input line that had none
    (its error message starts with `line N:`)."""
    if line.get("custom_id") is not None:
        message = (line.get("error") or {}).get("message", "")
        if (line.get("error") or {}).get("code") == "duplicate_custom_id":
            return message.split(":", 1)[0]
        return line["custom_id"]
    message = (line.get("error") or {}).get("message", "")
    return message.split(":", 1)[0] if message.startswith("line ") else None


def engine_failed(line: dict[str, Any]) -> bool:
    """Whether an OpenAI Batch output line is a request the engine's death took with it
    (`generation_failed` lines naming EngineDeadError are the same, as written before the
    `engine_failed` code)."""
    error = line.get("error") or {}
    return error.get("code") == ENGINE_FAILED or (
        error.get("code") == "generation_failed" and "EngineDeadError" in error.get("message", ""))


def finite_json(value: Any) -> Any:
    """`value` with every NaN and infinity replaced by None (strict JSON has neither)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_json(v) for v in value]
    return value


class BatchOutput(LineLog):
    def __init__(self, path: Path, resume: bool) -> None:
        super().__init__(path, resume, batch_line_key, retry_of=engine_failed)


class TableOutput(LineLog):
    """Rows to a side file as they finish; `finish()` writes OUTPUT in input order."""

    def __init__(self, path: Path, resume: bool) -> None:
        if path.suffix.lower() not in TABLE_SUFFIXES:
            raise ValueError(f"output {str(path)!r}: a table input is written as one of "
                             f"{TABLE_SUFFIXES}")
        self.final = path
        side = side_file(path)
        if resume and path.exists() and not side.exists():
            _unfinish(path, side)  # a finished run: its rows are the side file, in input order
        super().__init__(side, resume, lambda row: row.get(ROW_KEY),
                         retry_of=lambda row: bool(row.get(RETRY_KEY)), own_file=True,
                         allow_nan=True)

    def finish(self) -> pa.Table:
        self.close()
        with self._open("r") as f:
            rows = [json.loads(t) for t in f.read().splitlines() if t]
        rows.sort(key=lambda r: r[ROW_KEY])
        for r in rows:
            r.pop(ROW_KEY)
            r.pop(RETRY_KEY, None)
        table = pa.Table.from_pylist(rows)
        suffix = self.final.suffix.lower()
        if suffix == ".parquet":
            import pyarrow.parquet as pq

            pq.write_table(table, self.final)
        elif suffix == ".csv":
            import pyarrow.csv as pcsv

            pcsv.write_csv(_flat_for_csv(table), self.final)
        else:
            with self.final.open("w", encoding="utf-8") as f:
                for r in rows:  # strict JSON: a NaN of an input column is written as null
                    f.write(json.dumps(finite_json(r), ensure_ascii=False) + "\n")
        os.remove(self.path)
        return table


def _unfinish(final: Path, side: Path) -> None:
    from batchgen_data.cli.inputs import read_table

    rows = read_table(final).to_pylist()
    with open_nofollow(side, "w") as f:
        for i, row in enumerate(rows):
            f.write(json.dumps({**row, ROW_KEY: i}, ensure_ascii=False, default=str) + "\n")


def side_file(output: Path) -> Path:
    """Where a table run keeps its rows until it ends (and `--resume` reads them)."""
    return output.with_name(output.name + ".partial.jsonl")


def _flat_for_csv(table: pa.Table) -> pa.Table:
    """CSV has no lists or structs: such columns are written as JSON text."""
    cols = []
    for name, col in zip(table.column_names, table.columns):
        if pa.types.is_nested(col.type):
            col = pa.array([None if v is None else json.dumps(v) for v in col.to_pylist()],
                           pa.string())
        cols.append((name, col))
    return pa.table(dict(cols))
