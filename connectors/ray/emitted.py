"""Completion order that stays exactly once: a record, outside the engine actors, of which rows
each task attempt has already emitted and in what order.

Ray runs a retried streaming-generator task again from its first output, and for every output
index the failed attempt had already reported it keeps the failed attempt's object; from the
first index it never got on, it takes the new attempt's (docs/guarantees.md has the detail and
how it was checked). A `BatchGenPredictor` in completion order yields rows in an order that
depends on timing, so a retry could put other rows at the indices Ray keeps from the first
attempt: those rows are lost, and the kept ones come back a second time later on.

So before each completion-order yield the predictor writes the yielded rows (their positions in
the input batch) to this job's `EmissionLog`, a small detached actor that outlives the engine
actors. A later attempt of the same call reads that record and goes through it first, in the
recorded order, one recorded yield at a time:

- a *settled* yield (Ray surely has the failed attempt's objects for it) becomes placeholder
  rows, as many as it had rows: Ray keeps the first attempt's objects at those indices and
  drops the placeholders, and those rows are never generated again;
- any other recorded yield (the last one, or one yielded less than `settle_s` before the
  attempt's last sign of life, or rows too large to travel inline to Ray's owner) is generated
  again and yielded with the same rows: equal to what Ray may already hold, and right if it
  holds nothing there;

then the rest of the batch follows in completion order, recorded in turn. Rows of one call are
keyed by the Ray task id (the same for every attempt of a task), a digest of the batch's rows,
and how many calls of that task with the same rows came before.

A yield is settled when its outputs were handed to Ray (the predictor wrote its next yield, or
finished the call) at least `settle_s` before the log last heard from that attempt's process
(each predictor beats every `beat_s`): Ray sends a report as soon as it is handed an output, so
one that old has reached the owner unless the whole node was cut off. A yield of the current
process (Ray Data retrying the UDF inside the task, `DataContext.retried_map_errors`) is always
settled: that retry skips exactly the outputs the process already handed over.
"""
from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

NAMESPACE = "batchgen_data"
PROCESS_TOKEN = uuid.uuid4().hex  # one per process: the attempt that writes an entry
# objects up to Ray's `max_direct_call_object_size` (100 KiB) travel inline to the owner and
# live in its memory, not in the object store of the node that made them
INLINE_BYTES = int(os.environ.get("RAY_max_direct_call_object_size", 100 * 1024))

# (rows: positions in the input batch, written_at on the log's clock, writer's token,
#  largest row in bytes)
Entry = tuple[tuple[int, ...], float, str, int]


def log_name(job_id: str | None, fingerprint: str) -> str:
    """Actor name shared by the engines of one job (as the migration coordinator's)."""
    if job_id is None:
        import ray

        job_id = ray.get_runtime_context().get_job_id()
        job_id = f"{job_id}-{hashlib.blake2b(fingerprint.encode(), digest_size=6).hexdigest()}"
    return f"batchgen-emitted-{job_id}"


class EmissionLog:
    """Per call key: its entries in output order, and when its last output was handed over."""

    def __init__(self, idle_exit_s: float = 300.0, keep_done_s: float = 3600.0) -> None:
        self.entries: dict[str, list[Entry]] = defaultdict(list)
        self.handed: dict[str, float] = {}  # key -> when its call finished (all handed over)
        self.done: dict[str, float] = {}  # key -> when the call finished
        self.alive: dict[str, float] = {}  # writer token -> when it was last heard from
        self.idle_exit_s = idle_exit_s
        self.keep_done_s = keep_done_s
        self.num_writes = 0
        self._last_call = time.monotonic()
        threading.Thread(target=self._exit_when_idle, daemon=True).start()

    def open(self, key: str, token: str) -> tuple[list[Entry], dict[str, float], float]:
        """What earlier attempts wrote for `key`: entries, each writer's last sign of life,
        and when the last entry's outputs were handed over (0.0: not known)."""
        now = self._heard(token)
        self._prune(now)
        entries = list(self.entries.get(key, ()))
        return entries, {t: self.alive[t] for t in {e[2] for e in entries}}, \
            self.handed.get(key, 0.0)

    def add(self, key: str, token: str, rows: tuple[int, ...], row_bytes: int) -> None:
        """Written before the predictor yields `rows` (so the entries before it are handed
        over by now)."""
        now = self._heard(token)
        self.entries[key].append((tuple(rows), now, token, int(row_bytes)))
        self.num_writes += 1

    def finish(self, key: str, token: str) -> None:
        now = self._heard(token)
        if self.entries.get(key):
            self.handed[key] = self.done[key] = now

    def beat(self, token: str) -> None:
        self._heard(token)

    def stats(self) -> dict[str, int]:
        return {"calls": len(self.entries), "writes": self.num_writes,
                "rows": sum(len(e[0]) for es in self.entries.values() for e in es)}

    def _heard(self, token: str) -> float:
        now = time.monotonic()
        self.alive[token] = now
        self._last_call = now
        return now

    def _prune(self, now: float) -> None:
        for key in [k for k, t in self.done.items() if now - t > self.keep_done_s]:
            self.entries.pop(key, None)
            self.handed.pop(key, None)
            self.done.pop(key, None)

    def _exit_when_idle(self) -> None:
        while True:
            time.sleep(min(10.0, self.idle_exit_s))
            if time.monotonic() - self._last_call > self.idle_exit_s:
                os._exit(0)  # detached actor: nobody else would ever end it


def get_log(name: str) -> Any:
    """The job's log handle, created on first use, on the head node when there is one (where
    the driver, the owner of the outputs, usually runs)."""
    import ray

    opts: dict[str, Any] = dict(name=name, namespace=NAMESPACE, get_if_exists=True,
                                lifetime="detached", num_cpus=0, max_restarts=0,
                                max_concurrency=1)
    if ray.cluster_resources().get("node:__internal_head__"):
        opts["resources"] = {"node:__internal_head__": 0.001}
    return ray.remote(EmissionLog).options(**opts).remote()


@dataclass
class Replay:
    """One recorded yield for a later attempt: placeholders, or its rows generated again."""

    rows: tuple[int, ...]
    placeholder: bool


def plan_replay(entries: list[Entry], alive: dict[str, float], handed_last: float,
                token: str, settle_s: float, inline_bytes: int = INLINE_BYTES) -> list[Replay]:
    """The recorded yields in order, each marked placeholder (settled) or not."""
    plan = []
    for j, (rows, _at, writer, row_bytes) in enumerate(entries):
        # outputs of entry j were handed to Ray by the time the next entry was written (or the
        # call ended): `handed` is then the latest time they can have been sent
        handed = entries[j + 1][1] if j + 1 < len(entries) else handed_last
        if writer == token:
            settled = True  # this process is alive: what it handed over, Ray has
        else:
            settled = handed > 0.0 and alive.get(writer, 0.0) - handed >= settle_s
        settled = settled and row_bytes < inline_bytes // 2  # serialization overhead: margin
        plan.append(Replay(rows, settled))
    return plan


def call_identity(rows: list[dict[str, Any]]) -> tuple[str, str]:
    """(Ray task id, digest of the rows): the same for every attempt of a call; the number of
    calls of that task with the same rows before it completes the key."""
    import ray

    task_id = ray.get_runtime_context().get_task_id() or "no-task"
    return task_id, hashlib.blake2b(repr(rows).encode(), digest_size=12).hexdigest()


class EmittedClient:
    """One predictor's view of the job's log: a call's record, and a heartbeat."""

    def __init__(self, handle: Any, settle_s: float = 1.0, beat_s: float = 0.25,
                 rpc_timeout_s: float = 30.0) -> None:
        self.handle = handle
        self.settle_s = settle_s
        self.rpc_timeout_s = rpc_timeout_s
        self._seen: dict[tuple[str, str], int] = defaultdict(int)  # finished calls per key
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._beat_s = beat_s
        threading.Thread(target=self._beat, daemon=True, name="batchgen-emitted-beat").start()

    def call(self, rows: list[dict[str, Any]]) -> "CallRecord":
        task_id, digest = call_identity(rows)
        with self._lock:
            nth = self._seen[(task_id, digest)]
        return CallRecord(self, (task_id, digest), f"{task_id}:{digest}:{nth}")

    def _get(self, ref: Any) -> Any:
        import ray

        return ray.get(ref, timeout=self.rpc_timeout_s)

    def _beat(self) -> None:
        while not self._stop.wait(self._beat_s):
            try:
                self.handle.beat.remote(PROCESS_TOKEN)  # fire and forget
            except Exception:  # noqa: BLE001 - Ray shutting down
                return

    def stop(self) -> None:
        self._stop.set()


class CallRecord:
    """The record of one `__call__`: read once at the start, then one write per yield."""

    def __init__(self, client: EmittedClient, seen_key: tuple[str, str], key: str) -> None:
        self.client, self.seen_key, self.key = client, seen_key, key
        self.broken = False

    def replay(self) -> list[Replay]:
        """Earlier attempts' yields of this call (empty on a first attempt, or on failure)."""
        try:
            entries, alive, handed = self.client._get(
                self.client.handle.open.remote(self.key, PROCESS_TOKEN))
        except Exception as e:  # noqa: BLE001 - the log is gone: nothing known
            self._fail("read", e)
            return []
        return plan_replay(entries, alive, handed, PROCESS_TOKEN, self.client.settle_s)

    def add(self, rows: list[int], row_bytes: int) -> None:
        """Before the yield of `rows`: returns once the log has it."""
        if self.broken:
            return
        try:
            self.client._get(self.client.handle.add.remote(self.key, PROCESS_TOKEN,
                                                           tuple(rows), row_bytes))
        except Exception as e:  # noqa: BLE001
            self._fail("write", e)

    def finish(self) -> None:
        """The call ended normally: the next call of this task with the same rows is a new
        call, not a retry of this one."""
        with self.client._lock:
            self.client._seen[self.seen_key] += 1
        if not self.broken:
            try:
                self.client.handle.finish.remote(self.key, PROCESS_TOKEN)
            except Exception:  # noqa: BLE001 - only costs placeholders on a retry
                pass

    def _fail(self, what: str, e: BaseException) -> None:
        self.broken = True
        log.error("batchgen: cannot %s the emitted-rows record (%r); if this task is retried, "
                  "its rows may be lost or repeated (docs/guarantees.md)", what, e)


class _NoRecord:
    """Completion order with nothing recorded (no Ray job: no task is retried): both the
    client and each call's record."""

    def call(self, rows: list[dict[str, Any]]) -> "_NoRecord":
        return self

    def replay(self) -> list[Replay]:
        return []

    def add(self, rows: list[int], row_bytes: int) -> None:
        pass

    def finish(self) -> None:
        pass


NO_RECORD = _NoRecord()


def start_emitted(fingerprint: str, job_id: str | None, **kw: Any) -> EmittedClient | None:
    """Join (or create) the job's log; None, logged, when Ray cannot provide one."""
    try:
        return EmittedClient(get_log(log_name(job_id, fingerprint)), **kw)
    except Exception as e:  # noqa: BLE001 - no Ray: completion order falls back to input order
        log.warning("batchgen: no emitted-rows record (%r); rows leave in input order "
                    "(stream='ordered') instead", e)
        return None
