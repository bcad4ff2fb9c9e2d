"""The running sequences' block tables, kept across steps as one numpy array (vLLM v1's
`InputBatch` block table).

A sequence gets a row the first step it runs in and keeps it until a step runs without it. Its
row is written in full when it arrives and afterwards only where its block list grew (a decode
adds a block every `block_size` steps), so a step reads its sequences' tables with one gather
instead of rebuilding a padded [seqs, blocks] table from Python lists. The scheduler only ever
extends a sequence's block list in place or gives it a new list (released, then allocated or
matched again), so "the same list object, of the length copied" means the row is current.
"""
from __future__ import annotations

from collections.abc import Sequence as Seq
from operator import attrgetter

import numpy as np

from batchgen_data.core.sequence import Sequence


_SEQ_ID = attrgetter("seq_id")
_BLOCK_IDS = attrgetter("block_ids")


class BlockTables:
    def __init__(self, rows: int = 16, width: int = 16) -> None:
        self.table = np.zeros((rows, width), dtype=np.int32)  # [rows, blocks], zero-padded
        self.num_blocks = np.zeros(rows, dtype=np.int64)  # [rows]: blocks in each row
        # [rows]: id() of the block list each row mirrors (0: none); the list is kept alive in
        # `_lists`, so an equal id is that very list
        self._list_id = np.zeros(rows, dtype=np.uint64)
        self._lists: list[list[int] | None] = [None] * rows
        self._row_of: dict[int, int] = {}  # seq_id -> row
        self._free: list[int] = list(range(rows - 1, -1, -1))
        # the last call's sequence ids, and their rows as a list and an array (read-only)
        self._last: tuple[list[int], list[int], np.ndarray] = ([], [], np.zeros(0, np.int64))

    def rows(self, seqs: Seq[Sequence]) -> np.ndarray:
        """The rows of `seqs` [len(seqs)] int64, in order, with their blocks up to date. The rows
        of sequences that are not in `seqs` are given back (they left the running batch)."""
        n = len(seqs)
        row_of = self._row_of
        ids = list(map(_SEQ_ID, seqs))
        if ids == self._last[0]:  # the same sequences as the step before (most decode steps)
            rows, out = self._last[1], self._last[2]
        else:
            rows = list(map(row_of.get, ids))
            if None in rows:  # sequences that just joined
                for i in [i for i, r in enumerate(rows) if r is None]:
                    rows[i] = row_of[ids[i]] = self._new_row()
            if len(row_of) > n:  # every sequence of `seqs` has a row: some others left
                for seq_id in row_of.keys() - set(ids):
                    self._release(row_of.pop(seq_id))
            out = np.array(rows, dtype=np.int64)
            self._last = (ids, rows, out)
        lists = list(map(_BLOCK_IDS, seqs))
        lens = np.fromiter(map(len, lists), np.int64, n)
        had = self.num_blocks[out]
        same = self._list_id[out] == np.fromiter(map(id, lists), np.uint64, n)
        grew = same & (lens == had + 1)  # a decode's new block: one column each, at once
        if grew.any():
            g = np.flatnonzero(grew)
            if int(lens[g].max()) > self.table.shape[1]:
                self._widen(int(lens[g].max()))
            self.table[out[g], had[g]] = [lists[i][-1] for i in g.tolist()]
            self.num_blocks[out[g]] = lens[g]
        for i in np.flatnonzero(~grew & (~same | (lens != had))).tolist():  # new rows, new or
            self._write(rows[i], lists[i])  # otherwise changed lists
        return out

    def gather(self, rows: np.ndarray) -> np.ndarray:
        """[len(rows), widest of them] int32: a copy, so later steps never write into it."""
        width = int(self.num_blocks[rows].max()) if len(rows) else 0
        return self.table[rows, :width]

    def _new_row(self) -> int:
        if not self._free:
            old = self.table.shape[0]
            self.table = np.concatenate([self.table, np.zeros_like(self.table)])
            self.num_blocks = np.concatenate([self.num_blocks, np.zeros_like(self.num_blocks)])
            self._list_id = np.concatenate([self._list_id, np.zeros_like(self._list_id)])
            self._lists += [None] * old
            self._free = list(range(2 * old - 1, old - 1, -1))
        return self._free.pop()

    def _write(self, r: int, blocks: list[int]) -> None:
        n = len(blocks)
        if n > self.table.shape[1]:
            self._widen(n)
        done = int(self.num_blocks[r]) if self._lists[r] is blocks else 0
        self.table[r, done:n] = blocks[done:]
        self.table[r, n:self.num_blocks[r]] = 0  # a shorter new list: no stale tail
        self.num_blocks[r] = n
        self._lists[r], self._list_id[r] = blocks, id(blocks)

    def _widen(self, n: int) -> None:
        wider = np.zeros((self.table.shape[0], max(n, 2 * self.table.shape[1])), np.int32)
        wider[:, :self.table.shape[1]] = self.table
        self.table = wider

    def _release(self, r: int) -> None:
        self.table[r, :self.num_blocks[r]] = 0
        self.num_blocks[r] = 0
        self._lists[r], self._list_id[r] = None, 0
        self._free.append(r)
