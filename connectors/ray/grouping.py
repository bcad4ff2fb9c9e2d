"""Grouping rows by prefix before blocks are cut (`build_processor(..., prefix_grouping=True)`).

Ray Data hands each input batch to whichever engine actor is free, so the questions of one
document, shuffled through a dataset, reach every engine and each prefills the document again.
When the job knows its rows share prefixes, this pre-stage sorts them by a hash of their leading
text before `Processor` cuts one block per input batch: a document's rows then fill one batch
(or a few consecutive ones) and meet on one engine, whose prefix cache serves all but the first.
Late binding by prefix (ray/affinity.py) still places the batches' rows that did not meet.

A row's leading text is its prompt, or its messages' roles and contents in order (a content
given as parts contributes its text parts), or its token ids, cut at `prefix_chars` characters:
rows that agree on those are grouped. A chat template's own system prompt is the same for
every row and adds nothing; a long shared system prompt of the user's needs a `prefix_chars`
beyond it.
"""
from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import ray.data

PREFIX_COLUMN = "__batchgen_prefix"
DEFAULT_PREFIX_CHARS = 512


def leading_text(row: Mapping[str, Any], prefix_chars: int) -> str:
    """The first `prefix_chars` characters of a row's content (see the module docstring)."""
    if row.get("messages") is not None:
        parts: list[str] = []
        size = 0
        for msg in row["messages"]:
            content = msg.get("content")
            if not isinstance(content, str):  # OpenAI-style parts: their text only
                content = "".join(p.get("text") or "" for p in content or ()
                                  if isinstance(p, Mapping))
            parts.append(f"{msg.get('role', '')}\n{content}\n")
            size += len(parts[-1])
            if size >= prefix_chars:
                break
        return "".join(parts)[:prefix_chars]
    if row.get("prompt") is not None:
        return str(row["prompt"])[:prefix_chars]
    ids = row.get("prompt_token_ids", row.get("tokenized_prompt"))
    return " ".join(map(str, ids if ids is not None else ()))[:prefix_chars]


def prefix_hash(text: str) -> int:
    """A signed 64-bit digest (an Arrow int64) of a row's leading text."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little",
                          signed=True)


class AddPrefixKey:
    """`ds.map` function: the row with its prefix hash in `PREFIX_COLUMN`."""

    def __init__(self, prefix_chars: int) -> None:
        self.prefix_chars = prefix_chars

    def __call__(self, row: dict[str, Any]) -> dict[str, Any]:
        return {**row, PREFIX_COLUMN: prefix_hash(leading_text(row, self.prefix_chars))}


def check_prefix_chars(prefix_chars: Any) -> int:
    if isinstance(prefix_chars, bool) or not isinstance(prefix_chars, int) or prefix_chars < 1:
        raise ValueError(f"prefix_chars={prefix_chars!r}: must be an int >= 1")
    return prefix_chars


def group_by_prefix(ds: "ray.data.Dataset", prefix_chars: int = DEFAULT_PREFIX_CHARS,
                    map_kwargs: Mapping[str, Any] | None = None) -> "ray.data.Dataset":
    """`ds` with rows of one leading text next to each other (sorted by its hash): the order
    in which blocks are cut afterwards keeps them in the same or consecutive batches."""
    ds = ds.map(AddPrefixKey(check_prefix_chars(prefix_chars)), **dict(map_kwargs or {}))
    return ds.sort(PREFIX_COLUMN).drop_columns([PREFIX_COLUMN])
