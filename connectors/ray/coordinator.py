"""The per-job migration coordinator: one small named Ray actor that every engine talks to.

Each `BatchGenPredictor` engine calls `exchange` a few times a second with its `Report`
(`Engine.load()`, `Engine.movable()` of the requests it owns) and the messages it wants
delivered; it gets back a `Reply`: the moves it must make as a donor and the messages addressed
to it. Both are frozen dataclasses of plain values, pickled as they are across Ray. The
coordinator is a post office and a planner, nothing more: decisions come from
`batchgen_data.placement`, request state and results travel as plain data in the messages
(a state carrying KV as an `ObjectRef` only: the bytes go from the owner's object store to the
importer, never through this single-threaded actor; `kv_bytes_relayed` in `stats()` counts any
that did), and rows always belong to the engine whose task received them. Losing the coordinator therefore
loses no rows; engines see the failed call and fall back to running their own work.

The actor is detached (a predictor's death must not take it along) and ends itself once no
engine has reported for `idle_exit_s`, so a finished job leaves nothing behind.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import statistics
import threading
import time
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from batchgen_data.connectors.ray.affinity import PrefixPlanner
from batchgen_data.placement import (
    AffinityConfig, EngineLoad, Move, PlacementConfig, RequestSummary, TransferCost,
    find_receivers, pick_donors, plan_moves)

NAMESPACE = "batchgen_data"
# ("import", owner_id, state or ObjectRef of it, rid) | ("deliver", rid, output) | ("failed", rid)
Message = tuple[Any, ...]


@dataclass(frozen=True, slots=True)
class Report:
    """One engine's periodic report; `load.engine_id` names the engine."""

    load: EngineLoad
    movable: tuple[RequestSummary, ...] = ()  # requests it owns that could move
    # False when no task is in flight: the engine may be scaled down any moment, so it owns
    # nothing to give and must take nothing (see MigrationClient.leave_call)
    accepting: bool = True
    owned: int = 0  # unfinished rows its tasks wait for (those running elsewhere included)
    # KV this engine has fetched from the object store so far, and the seconds its puts and
    # gets took (totals: the coordinator sums the latest over engines)
    kv_bytes_received: int = 0
    kv_transfer_s: float = 0.0
    # rows this engine runs for other owners, and its own rows running elsewhere: the
    # coordinator tells an owner which of its rows no live engine holds and no mail carries
    guests: tuple[str, ...] = ()
    away: tuple[str, ...] = ()
    # its own rows are done and its last task stays open only to take others' tail (`linger`):
    # the reply's `others_busy` then weighs only what other engines reported since
    lingering: bool = False
    # its prefix summary's keys (`Engine.prefix_summary`), sent only when they changed
    # (None: as last sent); what late binding by prefix reads (ray/affinity.py)
    prefixes: frozenset[int] | None = None


@dataclass(frozen=True, slots=True)
class Reply:
    orders: tuple[Move, ...]  # exports this engine must make now (`Move.src` is this engine)
    inbox: tuple[Message, ...]  # mail from other engines
    live: tuple[str, ...]  # engines that reported within `dead_after_s`, sorted
    # another live engine still owns unfinished rows, or has not reported since this engine
    # began to linger (its last report may predate rows it got since): a finished engine keeps
    # its last task open while this is True, so Ray Data keeps it alive as a receiver for the
    # others' tail
    others_busy: bool
    # this engine's away rows that no live engine reports as a guest and no mail carries now
    # (lost in transit, or between a pickup and the receiver's next report: the owner waits
    # `MigrationOptions.lost_after_s` of such replies before running the row itself)
    lost: tuple[str, ...] = ()


def kv_nbytes(state: dict[str, Any]) -> int:
    """Bytes of KV an exported state carries (0 for a queued row or a recompute move)."""
    return sum(t.numel() * t.element_size()
               for seq in state.get("seqs", ()) for layer in seq.get("kv") or () for t in layer)


def coordinator_name(job_id: str | None, fingerprint: str) -> str:
    """Actor name shared by all engines of one job (`job_id`) or of one Ray job + config."""
    if job_id is None:
        import ray

        job_id = ray.get_runtime_context().get_job_id()
        job_id = f"{job_id}-{hashlib.blake2b(fingerprint.encode(), digest_size=6).hexdigest()}"
    return f"batchgen-coordinator-{job_id}"


class Coordinator:
    """Holds the latest report of each engine, plans moves, and forwards messages."""

    def __init__(self, placement: Mapping[str, Any] | None = None, dead_after_s: float = 10.0,
                 cooldown_s: float = 1.0, idle_exit_s: float = 300.0, ship_kv: bool = True,
                 link_bytes_per_s: float = 1.25e9, pcie_bytes_per_s: float = 16e9,
                 prefix_affinity: bool = True, affinity: Mapping[str, Any] | None = None) -> None:
        self.cfg = PlacementConfig(**dict(placement or {}))
        # late binding by prefix (ray/affinity.py); None: queued rows move by load alone
        self.prefix = (PrefixPlanner(AffinityConfig(**dict(affinity or {})))
                       if prefix_affinity else None)
        # ship a moved sequence's KV or let the receiver recompute it: decided per sequence by
        # `TransferCost` from the engines' measured prefill rate, their KV bytes per token and
        # these bandwidths (10 GbE between nodes by default; PCIe for device <-> host)
        self.ship_kv = ship_kv
        self.link_bytes_per_s = link_bytes_per_s
        self.pcie_bytes_per_s = pcie_bytes_per_s
        self.dead_after_s = dead_after_s
        self.cooldown_s = cooldown_s  # a moved pair reports its new load before moving again
        self.idle_exit_s = idle_exit_s
        self.reports: dict[str, tuple[float, Report]] = {}  # the latest, with its time
        self.mail: dict[str, list[Message]] = defaultdict(list)
        self.orders: dict[str, list[Move]] = defaultdict(list)
        self.busy_until: dict[str, float] = {}
        self.num_moves = 0
        self.num_exchanges = 0
        self.kv_bytes_relayed = 0  # KV that reached this actor inline in mail (should stay 0)
        # imports dropped because their receiver had gone silent (their senders reclaim them),
        # and engines pruned as silent for `dead_after_s`
        self.num_dropped_imports = 0
        self.num_pruned = 0
        # each engine's latest transfer totals, kept after it stops reporting
        self.transfers: dict[str, tuple[int, float]] = {}
        # when each lingering engine's current lingering stretch began (this actor's clock)
        self.linger_since: dict[str, float] = {}
        self._last_seen = time.monotonic()
        threading.Thread(target=self._exit_when_idle, daemon=True).start()

    def exchange(self, report: Report, outbox: list[tuple[str, Message]]) -> Reply:
        """One engine's periodic call: its report and outgoing mail in, orders and mail out."""
        now = time.monotonic()
        self._last_seen = now
        self.num_exchanges += 1
        engine_id = report.load.engine_id
        self.reports[engine_id] = (now, report)
        if self.prefix is not None:
            self.prefix.note(engine_id, report)
        self.transfers[engine_id] = (report.kv_bytes_received, report.kv_transfer_s)
        live = self._live(now)
        for dst, msg in outbox:
            if msg[0] == "import" and isinstance(msg[2], dict):
                self.kv_bytes_relayed += kv_nbytes(msg[2])
            if msg[0] == "import" and dst not in live:
                # its sender sees `dst` missing from `live` in this reply and runs the row
                self.num_dropped_imports += 1
                continue
            # a result is kept even for an owner that has gone silent: an engine whose reports
            # stalled for `dead_after_s` may come back, and nobody else would send it again
            # (if the owner is really gone, Ray retries its task and the mail is never read)
            self.mail[dst].append(msg)
        self._plan(now, live)
        others_busy = self._others_busy(engine_id, report.lingering, live, now)
        lost = self._lost(report.away, live)
        return Reply(tuple(self.orders.pop(engine_id, [])), tuple(self.mail.pop(engine_id, [])),
                     tuple(sorted(live)), others_busy, lost)

    def _others_busy(self, engine_id: str, lingering: bool, live: set[str], now: float) -> bool:
        """Whether another live engine owns unfinished rows. For a lingering engine, one not heard
        from since it began to linger counts as busy: its latest report may have been taken
        before it received rows (a report queued while the coordinator starts arrives a second
        late), and a receiver that left on it could not take that engine's tail."""
        if lingering:
            since = self.linger_since.setdefault(engine_id, now)
        else:
            since = None
            self.linger_since.pop(engine_id, None)
        for e in live:
            if e == engine_id:
                continue
            seen, other = self.reports[e]
            if other.owned > 0 or (since is not None and seen <= since):
                return True
        return False

    def _lost(self, away: tuple[str, ...], live: set[str]) -> tuple[str, ...]:
        """Rows of `away` that no live engine holds as a guest and no queued mail carries (an
        import on its way, or a result on its way home)."""
        if not away:
            return ()
        held = {rid for e in live for rid in self.reports[e][1].guests}
        for msgs in self.mail.values():
            held.update(m[3] if m[0] == "import" else m[1] for m in msgs)
        return tuple(rid for rid in away if rid not in held)

    def stats(self) -> dict[str, Any]:
        """Moves planned, exchanges served, this process's CPU seconds so far (its start-up
        included), and the KV moved between engines through the object store (bytes, and the
        put + get seconds engines spent on it); imports dropped for a silent receiver, and how
        many times an engine was pruned as silent. `engines`: those reporting now (a finished one
        is pruned once silent for `dead_after_s`); `engines_seen`: every engine that reported."""
        return {"num_moves": self.num_moves, "engines": sorted(self.reports),
                "engines_seen": sorted(self.transfers),
                "num_exchanges": self.num_exchanges, "cpu_s": round(time.process_time(), 3),
                "kv_bytes_moved": sum(b for b, _ in self.transfers.values()),
                "kv_transfer_s": round(sum(s for _, s in self.transfers.values()), 6),
                "kv_bytes_relayed": self.kv_bytes_relayed,
                "dropped_imports": self.num_dropped_imports, "pruned": self.num_pruned,
                "affinity_moves": 0 if self.prefix is None else self.prefix.num_moves}

    def _live(self, now: float) -> set[str]:
        dead = [e for e, (t, _) in self.reports.items() if now - t > self.dead_after_s]
        for e in dead:
            del self.reports[e]
            self.linger_since.pop(e, None)
            if self.prefix is not None:
                self.prefix.forget(e)
            self.num_pruned += 1
            # its orders are void (the plan is made anew); its mail stays: an engine whose
            # reports stalled may come back. Its owners reclaim the rows they sent it (they
            # see it gone from `live`), so an import read late runs a row twice and the second
            # result is ignored; a result read late is the only copy of it
            self.orders.pop(e, None)
        return set(self.reports)

    def _plan(self, now: float, live: set[str]) -> None:
        # late binding by prefix first: its sources are the engines with no orders still to
        # carry out (their reports show rows about to leave); queued rows carry no KV, so
        # neither side cools down, and the load pass below leaves this round's receivers be
        took: set[str] = set()
        if self.prefix is not None:
            current = [e for e in live if not self.orders.get(e)]
            for mv in self.prefix.plan(now, {e: self.reports[e][1] for e in live}, current):
                self.orders[mv.src].append(mv)
                took.add(mv.dst)
                self.num_moves += len(mv.request_ids)
        # engines with moves or imports still under way are left out: their reports are stale
        ready = [e for e in live if not self.orders.get(e) and not self.mail.get(e)
                 and e not in took and self.busy_until.get(e, 0.0) <= now
                 and self.reports[e][1].accepting]
        loads = [self.reports[e][1].load for e in ready]
        if len(loads) < 2 or not find_receivers(loads, self.cfg):
            return
        cfg = self._with_transfer_cost(loads)
        summaries = {d.engine_id: self.reports[d.engine_id][1].movable
                     for d in pick_donors(loads, cfg)}
        for mv in plan_moves(loads, summaries, cfg):
            self.orders[mv.src].append(mv)
            self.busy_until[mv.src] = self.busy_until[mv.dst] = now + self.cooldown_s
            self.num_moves += len(mv.request_ids)

    def _with_transfer_cost(self, loads: list[EngineLoad]) -> PlacementConfig:
        """The placement config with a ship-or-recompute cost model from measured rates."""
        if not self.ship_kv or self.cfg.transfer is not None:
            return self.cfg
        rates = [ld.prefill_tokens_per_s for ld in loads if ld.prefill_tokens_per_s > 0]
        per_token = max((ld.kv_bytes_per_token for ld in loads), default=0)
        if not rates or per_token <= 0:
            return self.cfg  # nothing measured yet: recompute
        return dataclasses.replace(self.cfg, transfer=TransferCost(
            per_token, self.link_bytes_per_s, self.pcie_bytes_per_s, statistics.median(rates)))

    def _exit_when_idle(self) -> None:
        while True:
            time.sleep(min(10.0, self.idle_exit_s))
            if time.monotonic() - self._last_seen > self.idle_exit_s:
                os._exit(0)  # detached actor: nobody else would ever end it


def get_coordinator(name: str, **options: Any) -> Any:
    """The job's coordinator handle, created on first use (`get_if_exists`), on the head node
    when there is one: a worker node lost mid-job must not take it along (engines would then
    run without migration until the job ends, tests/integration/test_ray_two_nodes.py)."""
    import ray

    opts: dict[str, Any] = dict(name=name, namespace=NAMESPACE, get_if_exists=True,
                                lifetime="detached", num_cpus=0, max_restarts=0,
                                max_concurrency=1)
    if ray.cluster_resources().get("node:__internal_head__"):
        opts["resources"] = {"node:__internal_head__": 0.001}
    return ray.remote(Coordinator).options(**opts).remote(**options)
