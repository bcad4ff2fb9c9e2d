"""The persistent block tables match tables rebuilt from the sequences' block lists, step after
step, while sequences join, grow, leave and get their blocks released and given again."""
from __future__ import annotations

import random

import numpy as np

from batchgen_data.worker.block_tables import BlockTables
from batchgen_data.core.sequence import Sequence
from batchgen_data.sampling_params import SamplingParams


def _rebuilt(seqs: list[Sequence]) -> np.ndarray:
    """The oracle: a zero-padded table from the Python lists, as the runner built it before."""
    width = max(len(s.block_ids) for s in seqs)
    return np.array([s.block_ids + [0] * (width - len(s.block_ids)) for s in seqs],
                    dtype=np.int32)


def test_random_joins_growth_leaves_and_new_lists() -> None:
    rng = random.Random(0)
    params = SamplingParams()
    tables = BlockTables(rows=2, width=2)  # small: rows and width must grow on the way
    pool: list[Sequence] = []
    next_block = 1
    for step in range(300):
        if len(pool) < 40 and rng.random() < 0.5:  # join with some blocks (a prefix hit)
            seq = Sequence(step, f"r{step}", 0, [1], params, 0, 10)
            seq.block_ids = list(range(next_block, next_block + rng.randint(1, 5)))
            next_block += len(seq.block_ids)
            pool.append(seq)
        for seq in pool:
            roll = rng.random()
            if roll < 0.3:  # grows in place, as Scheduler.grow extends the list
                seq.block_ids.extend(range(next_block, next_block + rng.randint(1, 3)))
                next_block += 3
            elif roll < 0.33:  # released and given a new, shorter or longer list
                seq.block_ids = list(range(next_block, next_block + rng.randint(1, 8)))
                next_block += 8
        if pool and rng.random() < 0.2:  # leaves the running batch
            pool.pop(rng.randrange(len(pool)))
        step_seqs = [s for s in pool if rng.random() < 0.9]  # some sit a step out
        rng.shuffle(step_seqs)
        if not step_seqs:
            continue
        rows = tables.rows(step_seqs)
        assert len(set(rows.tolist())) == len(step_seqs)
        np.testing.assert_array_equal(tables.gather(rows), _rebuilt(step_seqs))


def test_gathered_table_is_a_copy() -> None:
    seq = Sequence(0, "r0", 0, [1], SamplingParams(), 0, 10)
    seq.block_ids = [4, 5]
    tables = BlockTables()
    got = tables.gather(tables.rows([seq]))
    seq.block_ids.append(6)
    tables.rows([seq])  # the next step writes the row
    assert got.tolist() == [[4, 5]]


def test_same_batch_step_after_step() -> None:
    """The same sequences in the same order (most decode steps: the rows are not looked up
    again), one new block for some (written as one column, past the table's width too), and
    lists replaced by new ones of the same length or one longer, which only the list's
    identity tells apart from an unchanged or grown one."""
    rng = random.Random(1)
    params = SamplingParams()
    seqs = [Sequence(i, f"r{i}", 0, [1], params, 0, 10) for i in range(12)]
    next_block = 1
    for seq in seqs:
        seq.block_ids = [next_block]
        next_block += 1
    tables = BlockTables(rows=4, width=2)
    for _ in range(200):
        for seq in seqs:
            roll = rng.random()
            if roll < 0.4:  # a decode's new block
                seq.block_ids.append(next_block)
                next_block += 1
            elif roll < 0.45:  # a new list, one longer
                seq.block_ids = list(range(next_block, next_block + len(seq.block_ids) + 1))
                next_block += len(seq.block_ids)
            elif roll < 0.5:  # a new list of the same length
                seq.block_ids = list(range(next_block, next_block + len(seq.block_ids)))
                next_block += len(seq.block_ids)
            elif roll < 0.52:  # released and started again short
                seq.block_ids = [next_block]
                next_block += 1
        rows = tables.rows(seqs)
        np.testing.assert_array_equal(tables.gather(rows), _rebuilt(seqs))
