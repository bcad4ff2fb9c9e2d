"""Engine side of cross-actor migration: report load, export on order, import, deliver back.

A `MigrationClient` lives next to each `BatchGenPredictor`'s `EngineDriver` and runs one thread
that calls the job's coordinator (`ray/coordinator.py`) every `interval_s`. Ownership never
moves:

* the **owner** (the engine whose Ray task received the row) keeps the row's Future. On an
  export order it takes the request out of its engine (`Engine.export`: waiting rows as they
  are, running ones through hold + export), keeps the exported state, and mails it to the
  receiver;
* the **importer** (`ray/guests.py`) continues the request (`Engine.import_`; KV recomputed
  unless the policy chose to ship it) and mails the finished `RequestOutput` back. A state that
  carries KV does not travel through the coordinator: the owner `ray.put`s it and mails only
  the `ObjectRef`, which the importer resolves from the object store (point to point, timed and
  counted);
* the owner resolves the Future with it, so the owner's task yields the row, exactly once.

If the importer stops reporting (dead), the coordinator reports the row lost (no live engine
holds it as a guest and no mail carries it) for `lost_after_s`, or the result does not come
back within `timeout_s`, the owner imports its kept state into its own engine; a late result is
then dropped. If the coordinator fails, every engine logs once, takes its rows back, drops its
guests, and runs without migration. Exported state is greedy/seeded-exact, so a row's tokens
never depend on where it ran.
"""
from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from batchgen_data.connectors.migration_options import (  # noqa: F401 - re-exported
    DEFAULT_PLACEMENT, SPEED_RULES, MigrationOptions)
from batchgen_data.connectors.ray.affinity import changed_prefixes
from batchgen_data.connectors.ray.coordinator import Message, Reply, Report
from batchgen_data.connectors.ray.guests import Guests, pack

if TYPE_CHECKING:
    from batchgen_data.engine.driver import EngineDriver
    from batchgen_data.engine.engine import Engine

log = logging.getLogger(__name__)

_CLIENTS: "weakref.WeakSet[MigrationClient]" = weakref.WeakSet()


@atexit.register
def _stop_clients() -> None:
    """At process exit, stop every client's thread and wait for it (briefly), so that none is
    inside a `ray.get` while Ray tears its core worker down: seen once as a SIGSEGV in Ray's
    task counter at the end of a job. Ray runs its own shutdown from an atexit hook registered
    when the worker connected, before this module was imported, so this one runs first."""
    clients = list(_CLIENTS)
    for c in clients:
        c.stop()
    for c in clients:
        c._thread.join(timeout=2.0)


@dataclass
class _Away:
    state: dict[str, Any]
    future: Future
    dst: str
    since: float
    # what the import message carried; an ObjectRef is kept here so the shipped state stays
    # in the object store until the row is home, however Ray counts the importer's borrow
    parcel: Any = None


class MigrationClient:
    """Moves this engine's surplus out and other engines' surplus in, as the coordinator says."""

    def __init__(self, driver: EngineDriver, coordinator: Any, engine_id: str,
                 options: MigrationOptions) -> None:
        self.driver = driver
        self.coordinator = coordinator
        self.engine_id = engine_id
        self.options = options
        self.away: dict[str, _Away] = {}  # owned rows running elsewhere; only this thread
        self.outbox: list[tuple[str, Message]] = []
        # kv_shipped: exported sequences that carried their KV; kv_imported_tokens: tokens of
        # KV an import kept (the receiver computes only the rest)
        # kv_bytes_sent / kv_put_s: KV the owner put into the object store and the time that
        # took; kv_bytes_received / kv_get_s: the importer's side of the same transfer
        self.counts = {"exported": 0, "imported": 0, "delivered": 0, "reclaimed": 0,
                       "kv_shipped": 0, "kv_imported_tokens": 0, "kv_bytes_sent": 0,
                       "kv_put_s": 0.0, "kv_bytes_received": 0, "kv_get_s": 0.0}
        self.disabled = False
        self._prefix_version = -1  # the prefix summary last sent (engine thread only)
        self._lost_since: dict[str, float] = {}  # away rows the coordinator reports lost
        # another live engine still owns unfinished rows (`Reply.others_busy`), as the reply to
        # a report sent while lingering says; unknown (True) until then, so a last call that ends
        # before the coordinator has heard of this engine's linger still waits for its verdict
        self.others_busy = True
        # the last call waits in `leave_call`; each such wait is a new stretch (`_linger_stretch`
        # counts them), and only a reply to a report sent in the current one is its verdict
        self.lingering = False
        self._linger_stretch = 0
        self.active_calls = 0  # the predictor's __call__s now running
        self._guests_done = threading.Condition()
        self.guests = Guests(driver, self._post, self.counts, self._guests_done,
                             options.rpc_timeout_s, lambda: self.disabled)
        self._stop = threading.Event()
        self._lock = threading.Lock()  # outbox: engine-thread callbacks append, we drain
        self._thread = threading.Thread(target=self._run, name="batchgen-migration", daemon=True)
        self._thread.start()
        _CLIENTS.add(self)

    def stop(self) -> None:
        self._stop.set()
        with self._guests_done:
            self._guests_done.notify_all()

    def enter_call(self) -> None:
        with self._guests_done:
            self.active_calls += 1

    def leave_call(self) -> None:
        """End of a `__call__`: the last one stays while this engine is still useful.

        Ray Data releases an actor with no task in flight as soon as every input has been
        dispatched, i.e. at the start of the long tail. One that dies holding guests makes
        their owners wait `dead_after_s` and redo the work, and one that is gone cannot take
        the tail. Engines with no call in flight are therefore never sent work (`accepting`
        in the report), and the last call stays until the guests are home and, with
        `linger`, until no other engine owns unfinished rows (or `timeout_s`).
        """
        with self._guests_done:
            if self.active_calls == 1:
                linger = self.options.linger
                if linger and self._thread.is_alive():
                    self._linger_stretch += 1
                    self.lingering, self.others_busy = True, True
                self._guests_done.wait_for(
                    lambda: self.disabled or self._stop.is_set() or (
                        not self.guests.owners and not (linger and self.others_busy)),
                    timeout=self.options.timeout_s)
                self.lingering = False
            self.active_calls -= 1

    # ---- the loop -----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.wait(self.options.interval_s):
                if self.driver.dead is not None:
                    return
                try:
                    self._tick()
                except Exception as e:  # noqa: BLE001 - coordinator lost (or a bug): run alone
                    self._degrade(e)
                    return
        finally:  # nobody updates `others_busy` any more: a lingering call must not wait on it
            with self._guests_done:
                self.others_busy = False
                self._guests_done.notify_all()

    def _tick(self) -> None:
        stretch = self._linger_stretch if self.lingering else -1
        reply = self._exchange(lingering=stretch >= 0)
        with self._guests_done:
            if stretch == self._linger_stretch and self.lingering:
                self.others_busy = reply.others_busy
                self._guests_done.notify_all()
        for msg in reply.inbox:
            self._receive(msg)
        for move in reply.orders:
            self._export(move.dst, move.request_ids, move.ship_kv)
        self._reclaim_lost(set(reply.live), reply.lost)

    def _exchange(self, lingering: bool = False) -> Reply:
        import ray

        # no timeout here: a slow step is not a coordinator failure (a dead engine fails it)
        report = self.driver.call(self._snapshot).result()
        with self._lock:
            outbox, self.outbox = self.outbox, []
        c = self.counts
        report = replace(report, accepting=self.active_calls > 0, lingering=lingering,
                         owned=report.owned + len(self.away), away=tuple(self.away),
                         kv_bytes_received=c["kv_bytes_received"],
                         kv_transfer_s=c["kv_put_s"] + c["kv_get_s"])
        ref = self.coordinator.exchange.remote(report, outbox)
        return ray.get(ref, timeout=self.options.rpc_timeout_s)

    def _snapshot(self, engine: Engine) -> Report:
        """Engine thread: load report plus the owned requests that may move (guests never move
        on)."""
        opts = self.options
        guests = self.guests.owners
        movable = [r for r in engine.movable(exclude=guests)
                   if (opts.move_queued if r.kind == "waiting" else opts.move_started)]
        prefixes, self._prefix_version = changed_prefixes(
            engine, self.engine_id, self._prefix_version, opts.prefix_affinity and opts.move_queued)
        return Report(engine.load(self.engine_id), tuple(movable),
                      owned=engine.num_unfinished(exclude=guests), guests=tuple(guests),
                      prefixes=prefixes)

    # ---- owner side ---------------------------------------------------------------------
    def _export(self, dst: str, rids: tuple[str, ...], ship_kv: bool) -> None:
        def take(engine: Engine) -> list[tuple[str, dict[str, Any], Future]]:
            out = []
            for rid in rids:
                if not engine.is_live(rid) or rid in self.guests.owners:
                    continue  # finished (or moved) since the report
                fut = self.driver.release(rid)
                if fut is None or fut.done():
                    continue
                out.append((rid, engine.export(rid, include_kv=ship_kv), fut))
            return out

        now = time.monotonic()
        for rid, state, fut in self.driver.call(take).result():
            parcel = pack(state, self.counts)
            self.away[rid] = _Away(state, fut, dst, now, parcel)
            self._post(dst, ("import", self.engine_id, parcel, rid))
            self.counts["exported"] += 1
            self.counts["kv_shipped"] += sum(s.get("kv") is not None for s in state["seqs"])

    def _reclaim_lost(self, live: set[str], reported_lost: tuple[str, ...] = ()) -> None:
        """Run at home the away rows whose receiver is gone, that are out too long, or that
        the coordinator has reported lost for `lost_after_s`."""
        now = time.monotonic()
        since = {rid: self._lost_since.get(rid, now) for rid in reported_lost if rid in self.away}
        self._lost_since = since
        lost = [rid for rid, a in self.away.items()
                if a.dst not in live or now - a.since > self.options.timeout_s
                or now - since.get(rid, now) > self.options.lost_after_s]
        for rid in lost:
            if rid in since:
                log.warning("batchgen migration: row %s was lost on its way to or from %s; "
                            "running it here", rid, self.away[rid].dst)
            self._reclaim(rid)

    def _reclaim(self, rid: str) -> None:
        away = self.away.pop(rid)
        if away.future.done():
            return

        def run_here(engine: Engine) -> None:
            engine.import_(away.state)
            self.driver.adopt(rid, away.future)

        self.driver.call(run_here)
        self.counts["reclaimed"] += 1
        log.info("batchgen migration: row %s did not come back from %s; running it here",
                 rid, away.dst)

    def _degrade(self, err: BaseException) -> None:
        with self._guests_done:
            self.disabled = True
            self._guests_done.notify_all()
        log.warning("batchgen migration: stopped (%r); this engine runs its own rows from now "
                    "on", err)
        for rid in list(self.away):
            self._reclaim(rid)
        self.guests.drop_all()  # their owners reclaim them too

    def _receive(self, msg: Message) -> None:
        kind = msg[0]
        if kind == "import":
            self.guests.add(msg[1], msg[2], msg[3])
        elif kind in ("deliver", "failed"):
            away = self.away.pop(msg[1], None)
            if away is None:
                return  # reclaimed meanwhile: the local run resolves the Future
            if kind == "failed":
                self.away[msg[1]] = away
                self._reclaim(msg[1])
            elif not away.future.done():
                away.future.set_result(msg[2])
                self.counts["delivered"] += 1

    def _post(self, dst: str, msg: Message) -> None:
        with self._lock:
            self.outbox.append((dst, msg))


def start_migration(driver: EngineDriver, fingerprint: str,
                    options: MigrationOptions) -> MigrationClient | None:
    """Join (or create) the job's coordinator; None, logged, when Ray cannot provide one."""
    import uuid

    from batchgen_data.connectors.ray.coordinator import coordinator_name, get_coordinator

    try:
        name = coordinator_name(options.job_id, fingerprint)
        coordinator = get_coordinator(name, placement={**DEFAULT_PLACEMENT, **options.placement},
                                      dead_after_s=options.dead_after_s,
                                      ship_kv=options.ship_kv,
                                      link_bytes_per_s=options.link_bytes_per_s,
                                      pcie_bytes_per_s=options.pcie_bytes_per_s,
                                      cooldown_s=4 * options.interval_s, affinity=options.affinity,
                                      prefix_affinity=options.prefix_affinity)
    except Exception as e:  # noqa: BLE001 - no Ray, no cluster: the job runs unmigrated
        log.warning("batchgen migration: no coordinator (%r); running without migration", e)
        return None
    return MigrationClient(driver, coordinator, uuid.uuid4().hex[:12], options)
