"""Where the command writes: lines appended (and flushed) as each request finishes.

A crash therefore loses nothing already written, and `--resume` reads back what was: the keys
(`custom_id`s, or table row positions) already answered are skipped. The last line of a killed
run may be torn (half written); it is cut off before appending, so the file stays valid JSONL.

OpenAI Batch input gets OpenAI Batch output lines in OUTPUT itself. Table input gets a table:
rows go first to `OUTPUT.partial.jsonl` as they finish and become OUTPUT (Parquet, JSONL or CSV,
by its suffix) in input order when the run ends; that side file is what `--resume` reads.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import IO, Any

import pyarrow as pa

from batchgen_data.cli.inputs import ROW_KEY

TABLE_SUFFIXES = (".parquet", ".jsonl", ".json", ".csv")


class LineLog:
    """An append-only JSONL file keyed by `key_of(line)`; `done` holds keys already in it."""

    def __init__(self, path: Path, resume: bool, key_of: Any) -> None:
        self.path = path
        self.key_of = key_of
        self.done: set[str] = set()
        path.parent.mkdir(parents=True, exist_ok=True)
        if resume and path.exists():
            self._read_back()
            self._file: IO[str] = path.open("a", encoding="utf-8")
        else:
            self._file = path.open("w", encoding="utf-8")

    def _read_back(self) -> None:
        data = self.path.read_bytes()
        end = data.rfind(b"\n") + 1  # everything after the last newline is a torn line
        if end < len(data):
            with self.path.open("r+b") as f:
                f.truncate(end)
        for text in data[:end].decode("utf-8", errors="replace").splitlines():
            try:
                key = self.key_of(json.loads(text))
            except (json.JSONDecodeError, TypeError, KeyError, AttributeError):
                continue  # a damaged line inside the file: its request is simply redone
            if key is not None:
                self.done.add(str(key))

    def write(self, line: dict[str, Any]) -> None:
        self._file.write(json.dumps(line, ensure_ascii=False, allow_nan=False, default=str) + "\n")
        self._file.flush()
        key = self.key_of(line)
        if key is not None:
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


class BatchOutput(LineLog):
    def __init__(self, path: Path, resume: bool) -> None:
        super().__init__(path, resume, batch_line_key)


class TableOutput(LineLog):
    """Rows to a side file as they finish; `finish()` writes OUTPUT in input order."""

    def __init__(self, path: Path, resume: bool) -> None:
        if path.suffix.lower() not in TABLE_SUFFIXES:
            raise ValueError(f"output {str(path)!r}: a table input is written as one of "
                             f"{TABLE_SUFFIXES}")
        self.final = path
        side = path.with_name(path.name + ".partial.jsonl")
        if resume and path.exists() and not side.exists():
            _unfinish(path, side)  # a finished run: its rows are the side file, in input order
        super().__init__(side, resume, lambda row: row.get(ROW_KEY))

    def finish(self) -> pa.Table:
        self.close()
        rows = [json.loads(t) for t in self.path.read_text(encoding="utf-8").splitlines() if t]
        rows.sort(key=lambda r: r[ROW_KEY])
        for r in rows:
            r.pop(ROW_KEY)
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
                for r in rows:
                    f.write(json.dumps(r, ensure_ascii=False) + "\n")
        os.remove(self.path)
        return table


def _unfinish(final: Path, side: Path) -> None:
    from batchgen_data.cli.inputs import read_table

    rows = read_table(final).to_pylist()
    with side.open("w", encoding="utf-8") as f:
        for i, row in enumerate(rows):
            f.write(json.dumps({**row, ROW_KEY: i}, ensure_ascii=False, default=str) + "\n")


def _flat_for_csv(table: pa.Table) -> pa.Table:
    """CSV has no lists or structs: such columns are written as JSON text."""
    cols = []
    for name, col in zip(table.column_names, table.columns):
        if pa.types.is_nested(col.type):
            col = pa.array([None if v is None else json.dumps(v) for v in col.to_pylist()],
                           pa.string())
        cols.append((name, col))
    return pa.table(dict(cols))
