"""Windowing over input batches: order, bounds, and that the engine sees many rows at once."""
from __future__ import annotations

import random
import threading
from concurrent.futures import Future

import pytest

from batchgen_data.connectors.handler import failed_future
from batchgen_data.connectors.spark.streaming import (
    BatchSizeProbe, in_completion_order, in_input_order)


class SlowEngine:
    """Finishes each submitted item after a random delay; records the peak number outstanding."""

    def __init__(self, seed: int = 0) -> None:
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.outstanding = 0
        self.peak = 0

    def submit(self, batch: list[int]) -> list[Future]:
        futures = []
        for x in batch:
            if x < 0:
                futures.append(failed_future(ValueError(f"bad row {x}")))
                continue
            fut: Future = Future()
            with self.lock:
                self.outstanding += 1
                self.peak = max(self.peak, self.outstanding)
            threading.Timer(self.rng.uniform(0, 0.01), self._finish, (fut, x)).start()
            futures.append(fut)
        return futures

    def _finish(self, fut: Future, x: int) -> None:
        with self.lock:
            self.outstanding -= 1
        fut.set_result(x * 10)


def batches(n_rows: int, size: int, bad: set[int] = frozenset()) -> list[list[int]]:
    rows = [-x if x in bad else x for x in range(n_rows)]
    return [rows[i:i + size] for i in range(0, n_rows, size)]


def test_input_order_keeps_order_and_fills_window() -> None:
    eng = SlowEngine()
    pulled = 0

    def source():
        nonlocal pulled
        for b in batches(200, 4, bad={7}):
            pulled += len(b)
            yield b

    out, yielded = [], 0
    for chunk in in_input_order(source(), eng.submit, max_in_flight=32):
        yielded += len(chunk)
        assert yielded <= pulled  # Spark's fail-fast rule for iterator UDFs
        assert pulled - yielded <= 32
        out += chunk
    assert [f.result() for f in out[:7]] == [x * 10 for x in range(7)]
    assert isinstance(out[7].exception(), ValueError)
    assert [f.result() for f in out[8:]] == [x * 10 for x in range(8, 200)]
    assert eng.peak > 4  # more than one input batch was in flight at once


def test_completion_order_covers_every_row_once() -> None:
    eng = SlowEngine(seed=1)
    seen = []
    for group in in_completion_order(batches(100, 3), eng.submit, max_in_flight=16):
        assert group
        for batch, i, fut in group:
            assert fut.done()
            seen.append(batch[i])
            assert fut.result() == batch[i] * 10
    assert sorted(seen) == list(range(100))
    assert 3 < eng.peak <= 16 + 3


def test_early_close_abandons_unfinished_rows() -> None:
    held: list[Future] = []
    abandoned: list[Future] = []

    def submit(batch: list[int]) -> list[Future]:
        futs = [Future() for _ in batch]
        futs[0].set_result(0)
        held.extend(futs)
        return futs

    gen = in_completion_order(iter([[1, 2, 3]]), submit, 100, abandon=abandoned.extend)
    assert len(next(gen)) == 1
    gen.close()  # e.g. df.limit(1): Spark stops reading
    assert abandoned == held[1:]

    pending = [Future(), Future()]
    threading.Timer(0.05, pending[0].set_result, (1,)).start()
    ordered = in_input_order(iter([[0], [1]]), lambda b: [pending[b[0]]], 2,
                             abandon=abandoned.extend)
    assert next(ordered) == pending[:1]  # window full: waited for the head
    ordered.close()
    assert abandoned[-1] is pending[1]
    assert not any(f.cancelled() for f in held + pending)


def test_rejects_empty_window() -> None:
    with pytest.raises(ValueError, match="max_in_flight"):
        next(in_input_order(iter([[1]]), lambda b: [], max_in_flight=0))


def test_batch_size_probe_ignores_earlier_tasks() -> None:
    class Stats:
        batch_seqs_hist = {64: 3, 2: 1}

    class Eng:
        stats = Stats()

    probe = BatchSizeProbe(Eng())
    assert probe.max_batch_seqs() == 0
    Eng.stats.batch_seqs_hist = {64: 3, 2: 2, 9: 1}
    assert probe.max_batch_seqs() == 9
