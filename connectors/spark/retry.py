"""Spark: a task's rows sent again on a rebuilt engine when an engine dies naming suspects.

Spark retries a failed task from its first row, on any executor (`spark.task.maxFailures`; 1 in
`local[n]`, so there a dead engine fails the job), and nothing a failed attempt knew reaches the
next one. So the poison-row record (connectors/poison.py) lives in the task: when its engine dies
and the death names suspects (the requests of a step the engine could not run, and could not
blame on one of them), the task notes which of its rows those were, builds a new engine, and
sends its unfinished rows again — the suspects alone (`Engine.submit(alone=True)`), rows blamed
by the record not at all (a row error). A death with no suspects, or the `max_deaths`-th one,
fails the task as before: nothing here tells a row from the device then.

`RetryingRows` hands out one Future per row (a "proxy") that stays pending across engines and
resolves with the finished Future of the engine that ran the row, and the `RowHandler` that
made it, for `RowHandler.outcome`.
"""
from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, wait
from typing import Any

from batchgen_data.connectors.handler import RowHandler, failed_future
from batchgen_data.connectors.poison import PoisonBook, Verdict, death_suspects

log = logging.getLogger(__name__)


class RetryingRows:
    def __init__(self, make: Callable[[], RowHandler], discard: Callable[[Any], None],
                 max_deaths: int = 3) -> None:
        """`make` opens the rows' handler over this worker's engine (a new one once `discard`
        dropped a dead driver); `max_deaths`: engine deaths one task lives through."""
        self._make, self._discard, self.max_deaths = make, discard, max_deaths
        self.rows = make()
        self.book = PoisonBook()
        self.verdict = Verdict()
        self.deaths = 0
        self._lock = threading.Lock()
        self._serial = itertools.count()
        self._args: dict[Future, tuple[int, Mapping[str, Any], Any]] = {}  # proxy -> row
        self._inner: dict[Future, Future] = {}  # proxy -> its Future on the current engine
        self._of_rid: dict[str, int] = {}  # request id on the current engine -> row serial
        self._waiting: list[Future] = []  # proxies whose engine died, for the next engine
        self._reviving = False

    def submit(self, row: Mapping[str, Any], key: Any) -> Future:
        proxy: Future = Future()
        self._args[proxy] = (next(self._serial), row, key)
        self._send(proxy, self.rows)
        return proxy

    def resolved(self, rows: RowHandler, fut: Future) -> Future:
        """A proxy already holding `fut` (a row error made before the engine saw the row)."""
        proxy: Future = Future()
        proxy.set_result((fut, rows))
        return proxy

    def abandon(self, proxies: Iterable[Future]) -> None:
        with self._lock:
            mine = [self._inner.pop(p) for p in proxies if p in self._inner]
            gone = set(proxies)
            self._waiting = [p for p in self._waiting if p not in gone]
        self.rows.abandon(mine)

    def _send(self, proxy: Future, rows: RowHandler) -> None:
        serial, row, key = self._args[proxy]
        if serial in self.verdict.blamed:  # it killed engines before: a row error, not run
            proxy.set_result((rows.reject(self.verdict.blamed[serial]), rows))
            return
        try:
            fut = rows.submit(row, key, alone=serial in self.verdict.quarantined)
        except Exception as e:  # noqa: BLE001 - a dead engine is sorted out as it lands
            if not rows.is_engine_dead(e):
                raise
            fut = failed_future(e)
        rid = rows.request_id(fut)
        with self._lock:
            self._inner[proxy] = fut
            if rid is not None:
                self._of_rid[rid] = serial
        fut.add_done_callback(lambda f: self._landed(proxy, f, rows))

    def _landed(self, proxy: Future, fut: Future, rows: RowHandler) -> None:
        exc = fut.exception()
        dead = rows.is_engine_dead(exc)
        suspects = death_suspects(exc, rows.driver) if dead else ()
        if not suspects or self.deaths >= self.max_deaths:
            proxy.set_result((fut, rows))  # an outcome: a row, a row error, or the task fails
            return
        with self._lock:
            self._waiting.append(proxy)
            if self._reviving or rows is not self.rows:
                return
            self._reviving = True
        threading.Thread(target=self._revive, args=(rows, set(suspects)), daemon=True,
                         name="batchgen-spark-revive").start()

    def _revive(self, dead: RowHandler, suspects: set[str]) -> None:
        """Every row of the dead engine has landed: note the death, build a new engine, send
        the rows it left again."""
        with self._lock:
            inner = list(self._inner.values())
        wait(inner)  # the dead driver fails all of them at once
        with self._lock:
            serials = [s for rid, s in self._of_rid.items() if rid in suspects]
            self.book.record(serials, alone=len(suspects) == 1)
            self.verdict = self.book.verdict()
            self.deaths += 1
            self._of_rid.clear()
            todo, self._waiting = self._waiting, []
        log.warning("batchgen: the engine died (%d of %d deaths this task lives through); its "
                    "rows are sent again to a new engine, %d suspect(s) alone, %d not at all "
                    "(poison-row record)", self.deaths, self.max_deaths,
                    len(self.verdict.quarantined), len(self.verdict.blamed))
        self._discard(dead.driver)
        try:
            self.rows = self._make()
        except BaseException as e:  # noqa: BLE001 - no new engine: the rows fail the task
            for proxy in todo:
                proxy.set_result((failed_future(e), dead))
            return
        finally:
            with self._lock:
                self._reviving = False
        for proxy in todo:
            self._send(proxy, self.rows)

