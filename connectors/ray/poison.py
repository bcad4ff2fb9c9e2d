"""Ray's poison-row record: the deaths each call saw, kept outside the engine actors.

An actor whose engine died exits, Ray starts another and retries the call with the same rows
(docs/row-errors.md). Before it exits, the predictor writes to this job's `PoisonLog` (a small
detached actor, like the emitted-rows record `ray_emitted`) the rows of each of its live calls
that the death names as suspects; a retry of a call reads its deaths first and turns them into
a `poison.Verdict`: rows to run alone, rows not to run again. A call is keyed as in the emitted
record (task id, digest of its rows, how many calls of that task with those rows came before),
so every attempt of one call shares an entry whatever its stream mode.
"""
from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections import defaultdict
from typing import Any

from batchgen_data.connectors.poison import PoisonBook, Verdict
from batchgen_data.connectors.ray.emitted import NAMESPACE, call_identity

log = logging.getLogger(__name__)


class PoisonLog:
    """Per call key: one (rows, alone) entry per engine death that named rows of the call."""

    def __init__(self, idle_exit_s: float = 300.0) -> None:
        self.deaths: dict[str, list[tuple[tuple[int, ...], bool]]] = defaultdict(list)
        self.idle_exit_s = idle_exit_s
        self._last_call = time.monotonic()
        threading.Thread(target=self._exit_when_idle, daemon=True).start()

    def add(self, key: str, rows: tuple[int, ...], alone: bool) -> None:
        self._last_call = time.monotonic()
        self.deaths[key].append((tuple(rows), bool(alone)))

    def read(self, key: str) -> list[tuple[tuple[int, ...], bool]]:
        self._last_call = time.monotonic()
        return list(self.deaths.get(key, ()))

    def _exit_when_idle(self) -> None:
        while True:
            time.sleep(min(10.0, self.idle_exit_s))
            if time.monotonic() - self._last_call > self.idle_exit_s:
                os._exit(0)  # detached actor: nobody else would ever end it


class PoisonCall:
    """One `__call__`'s view: its verdict, read once, and the request id of each row sent."""

    def __init__(self, client: "PoisonClient", seen_key: tuple[str, str], key: str) -> None:
        self.client, self.seen_key, self.key = client, seen_key, key
        self.verdict = Verdict()
        self.rows_of: dict[str, int] = {}  # request id -> row of the batch

    def read(self) -> Verdict:
        try:
            deaths = self.client.get(self.client.handle.read.remote(self.key))
        except Exception as e:  # noqa: BLE001 - no record: the rows run as before
            log.error("batchgen: cannot read the poison-row record (%r)", e)
            deaths = []
        book = PoisonBook()
        for rows, alone in deaths:
            book.record(rows, alone)
        self.verdict = book.verdict()
        if self.verdict.blamed or self.verdict.quarantined:
            log.warning("batchgen: a retried call: rows %s run alone, rows %s are not run again "
                        "(poison-row record)", sorted(self.verdict.quarantined),
                        sorted(self.verdict.blamed))
        return self.verdict

    def sent(self, rid: str | None, row: int) -> None:
        if rid is not None:
            self.rows_of[rid] = row

    def died(self, suspects: set[str]) -> None:
        """An engine death named `suspects`: this call's rows among them go to the record
        (synchronously: the actor exits next)."""
        rows = tuple(sorted(self.rows_of[r] for r in suspects if r in self.rows_of))
        if not rows:
            return
        try:
            self.client.get(self.client.handle.add.remote(self.key, rows, len(suspects) == 1))
        except Exception as e:  # noqa: BLE001 - the retry then runs them as before
            log.error("batchgen: cannot write the poison-row record (%r)", e)

    def finish(self) -> None:
        with self.client.lock:
            self.client.seen[self.seen_key] += 1


class PoisonClient:
    def __init__(self, handle: Any, rpc_timeout_s: float = 30.0) -> None:
        self.handle, self.rpc_timeout_s = handle, rpc_timeout_s
        self.seen: dict[tuple[str, str], int] = defaultdict(int)  # finished calls per key
        self.lock = threading.Lock()

    def call(self, rows: list[dict[str, Any]]) -> PoisonCall:
        seen_key = call_identity(rows)
        with self.lock:
            nth = self.seen[seen_key]
        return PoisonCall(self, seen_key, f"{seen_key[0]}:{seen_key[1]}:{nth}")

    def get(self, ref: Any) -> Any:
        import ray

        return ray.get(ref, timeout=self.rpc_timeout_s)


def start_poison(fingerprint: str, job_id: str | None) -> PoisonClient | None:
    """Join (or create) the job's poison-row record; None, logged, when Ray cannot give one."""
    try:
        import ray

        if job_id is None:
            job_id = ray.get_runtime_context().get_job_id()
            job_id = f"{job_id}-{hashlib.blake2b(fingerprint.encode(), digest_size=6).hexdigest()}"
        opts: dict[str, Any] = dict(name=f"batchgen-poison-{job_id}", namespace=NAMESPACE,
                                    get_if_exists=True, lifetime="detached", num_cpus=0,
                                    max_restarts=0, max_concurrency=1)
        if ray.cluster_resources().get("node:__internal_head__"):
            opts["resources"] = {"node:__internal_head__": 0.001}
        return PoisonClient(ray.remote(PoisonLog).options(**opts).remote())
    except Exception as e:  # noqa: BLE001 - no record: a retry runs its rows as before
        log.warning("batchgen: no poison-row record (%r); a retried call runs every row again",
                    e)
        return None
