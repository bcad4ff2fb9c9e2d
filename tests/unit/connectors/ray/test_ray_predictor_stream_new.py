"""`BatchGenPredictor(stream="ordered")`: output n of a task is always row n, however the rows
finish, which is what makes a retried Ray task repeat exactly what the dead attempt sent
(docs/guarantees.md). Runs without Ray over a fake engine whose rows finish in reverse order."""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any

import pyarrow as pa
import pytest

from batchgen_data.connectors.ray.predictor import BatchGenPredictor
from batchgen_data.outputs import CompletionOutput, RequestOutput
from batchgen_data.sampling_params import SamplingParams


class CharTokenizer:
    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) % 97 for c in text]


class ReversedDriver:
    """Finishes the submitted rows last-first, on another thread, once all are in."""

    def __init__(self, rows: int) -> None:
        self.engine = self
        self.tokenizer = CharTokenizer()
        self.config = SimpleNamespace(seed=0)
        self.dead = None
        self.expected = rows
        self.subs: list[tuple[Future, RequestOutput]] = []
        self.aborted: list[str] = []

    def check_request(self, ids: list[int], params: SamplingParams) -> None:
        pass

    def lora_names(self) -> None:  # an engine without enable_lora
        return None

    def check_lora(self, lora: Any) -> None:
        pass

    def submit(self, ids: list[int], params: SamplingParams, request_id: str | None = None,
               prompt: str | None = None) -> Future:
        fut: Future = Future()
        out = RequestOutput(request_id or "r", prompt, ids,
                            [CompletionOutput(0, f"re {prompt}", [1], "stop")])
        self.subs.append((fut, out))
        if len(self.subs) == self.expected:
            threading.Thread(target=self._finish, daemon=True).start()
        return fut

    def _finish(self) -> None:
        for fut, out in reversed(self.subs):
            time.sleep(0.01)
            fut.set_result(out)

    def call(self, fn: Any) -> None:
        fn(self)

    def abort(self, request_id: str) -> bool:
        self.aborted.append(request_id)
        return False

    def shutdown(self, timeout: float = 1.0) -> None:
        pass


class OnFake(BatchGenPredictor):
    """The predictor over a fake driver and stats export, given at its `start_*` seams."""

    def __init__(self, driver: ReversedDriver, stats: Any = None, **kw: Any) -> None:
        self.fake_driver, self.fake_stats = driver, stats
        super().__init__(**kw)

    def start_driver(self, model: str | None, engine_kwargs: dict[str, Any]) -> Any:
        return self.fake_driver

    def start_stats(self, migration: Any, job_id: str | None) -> Any:
        return self.fake_stats


def outputs(stream: Any, n: int = 5) -> list[list[str]]:
    pred = OnFake(ReversedDriver(n), stream=stream, migration=False, apply_chat_template=False)
    table = pa.table({"prompt": [f"p{i}" for i in range(n)]})
    return [t.column("prompt").to_pylist() for t in pred(table)]


def test_ordered_yields_one_row_at_a_time_in_input_order() -> None:
    assert outputs("ordered") == [[f"p{i}"] for i in range(5)]


def test_completion_order_differs_so_the_test_can_tell() -> None:
    got = outputs(True)
    assert sum(got, []) != [f"p{i}" for i in range(5)]  # the last row finished first
    assert sorted(sum(got, [])) == [f"p{i}" for i in range(5)]


def test_unknown_stream_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="stream='sorted'"):
        outputs("sorted")


class RecordingStats:
    """Stands in for `StatsExport`: records each flush and how many rows had left by then."""

    def __init__(self, seen: list[list[str]]) -> None:
        self.seen = seen
        self.flushes: list[tuple[int, bool]] = []

    def flush(self, wait: bool = False) -> None:
        self.flushes.append((len(self.seen), wait))

    def stop(self) -> None:
        pass


@pytest.mark.parametrize("stream", [True, "ordered", False])
def test_run_report_samples_are_shipped_before_each_yield(stream: Any) -> None:
    """The driver reads the job's collector once it holds every row: each yield must come after
    a waited flush, else a short job's report has no timeline."""
    seen: list[list[str]] = []
    stats = RecordingStats(seen)
    pred = OnFake(ReversedDriver(4), stats, stream=stream, migration=False,
                  apply_chat_template=False)
    for t in pred(pa.table({"prompt": [f"p{i}" for i in range(4)]})):
        seen.append(t.column("prompt").to_pylist())
    assert stats.flushes == [(k, True) for k in range(len(seen))]


def test_closing_the_call_stops_its_rows_at_once() -> None:
    driver = ReversedDriver(3)
    pred = OnFake(driver, stream="ordered", migration=False, apply_chat_template=False)
    call = pred(pa.table({"prompt": ["a", "b", "c"]}))
    next(call)
    call.close()  # Ray cancels the task: the rows still pending are abandoned now
    sent = [out.request_id for _, out in driver.subs]
    assert driver.aborted == sent[1:]  # every row but the one yielded
