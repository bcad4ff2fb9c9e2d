"""The per-job migration coordinator: one small named Ray actor that every engine talks to.

Each `BatchGenPredictor` engine calls `exchange` a few times a second with its load report
(`Engine.load()` plus summaries of the requests it owns) and the messages it wants delivered;
it gets back the moves it must make as a donor and the messages addressed to it. The
coordinator is a post office and a planner, nothing more: decisions come from
`batchgen_data.placement`, request state and results travel as plain data in the messages, and
rows always belong to the engine whose task received them. Losing the coordinator therefore
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
from typing import Any

from batchgen_data.placement import (
    EngineLoad, PlacementConfig, RequestSummary, TransferCost, find_receivers, pick_donors,
    plan_moves)

NAMESPACE = "batchgen_data"
Message = tuple[Any, ...]  # ("import", owner_id, state) | ("deliver", rid, output) | ("failed", rid)


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
                 link_bytes_per_s: float = 1.25e9, pcie_bytes_per_s: float = 16e9) -> None:
        self.cfg = PlacementConfig(**dict(placement or {}))
        # ship a moved sequence's KV or let the receiver recompute it: decided per sequence by
        # `TransferCost` from the engines' measured prefill rate, their KV bytes per token and
        # these bandwidths (10 GbE between nodes by default; PCIe for device <-> host)
        self.ship_kv = ship_kv
        self.link_bytes_per_s = link_bytes_per_s
        self.pcie_bytes_per_s = pcie_bytes_per_s
        self.kv_costs: dict[str, tuple[int, int]] = {}  # engine -> (KV bytes/token, prefill tok/s)
        self.dead_after_s = dead_after_s
        self.cooldown_s = cooldown_s  # a moved pair reports its new load before moving again
        self.idle_exit_s = idle_exit_s
        self.reports: dict[str, tuple[float, EngineLoad, list[RequestSummary]]] = {}
        self.mail: dict[str, list[Message]] = defaultdict(list)
        self.orders: dict[str, list[tuple[str, tuple[str, ...], bool]]] = defaultdict(list)
        self.busy_until: dict[str, float] = {}
        self.accepting: dict[str, bool] = {}
        self.owned: dict[str, int] = {}  # unfinished rows each engine's tasks wait for
        self.num_moves = 0
        self.num_exchanges = 0
        self._last_seen = time.monotonic()
        threading.Thread(target=self._exit_when_idle, daemon=True).start()

    def exchange(self, engine_id: str, report: Mapping[str, int], max_num_seqs: int,
                 block_size: int, summaries: list[tuple[str, str, int, int, int]],
                 outbox: list[tuple[str, Message]]) -> dict[str, Any]:
        """One engine's periodic call: its report and outgoing mail in, orders and mail out."""
        now = time.monotonic()
        self._last_seen = now
        self.num_exchanges += 1
        load = EngineLoad.from_report(engine_id, report, max_num_seqs, block_size)
        self.reports[engine_id] = (now, load, [RequestSummary(*s) for s in summaries])
        # an engine with no task in flight may be scaled down any moment: it owns nothing to
        # give and must take nothing (see MigrationClient.leave_call)
        self.accepting[engine_id] = bool(report.get("accepting", True))
        self.owned[engine_id] = int(report.get("owned", 0))
        self.kv_costs[engine_id] = (int(report.get("kv_bytes_per_token", 0)),
                                    int(report.get("prefill_tokens_per_s", 0)))
        live = self._live(now)
        for dst, msg in outbox:
            if dst in live:  # mail to a dead engine is dropped: its sender reclaims the row
                self.mail[dst].append(msg)
        self._plan(now, live)
        # an engine whose own rows are done keeps its last task open while this is True, so
        # Ray Data keeps it alive as a receiver for the others' tail
        others_busy = any(self.owned.get(e, 0) > 0 for e in live if e != engine_id)
        return {"orders": self.orders.pop(engine_id, []), "inbox": self.mail.pop(engine_id, []),
                "live": sorted(live), "others_busy": others_busy}

    def stats(self) -> dict[str, Any]:
        """Moves planned, exchanges served, and this process's CPU seconds so far (its start-up
        included)."""
        return {"num_moves": self.num_moves, "engines": sorted(self.reports),
                "num_exchanges": self.num_exchanges, "cpu_s": round(time.process_time(), 3)}

    def _live(self, now: float) -> set[str]:
        dead = [e for e, (t, _, _) in self.reports.items() if now - t > self.dead_after_s]
        for e in dead:
            del self.reports[e]
            self.mail.pop(e, None)
            self.orders.pop(e, None)
            self.owned.pop(e, None)
            self.kv_costs.pop(e, None)
        return set(self.reports)

    def _plan(self, now: float, live: set[str]) -> None:
        # engines with moves or imports still under way are left out: their reports are stale
        ready = [e for e in live if not self.orders.get(e) and not self.mail.get(e)
                 and self.busy_until.get(e, 0.0) <= now and self.accepting.get(e, True)]
        loads = [self.reports[e][1] for e in ready]
        if len(loads) < 2 or not find_receivers(loads, self.cfg):
            return
        cfg = self._with_transfer_cost(ready)
        summaries = {d.engine_id: self.reports[d.engine_id][2] for d in pick_donors(loads, cfg)}
        for mv in plan_moves(loads, summaries, cfg):
            self.orders[mv.src].append((mv.dst, mv.request_ids, mv.ship_kv))
            self.busy_until[mv.src] = self.busy_until[mv.dst] = now + self.cooldown_s
            self.num_moves += len(mv.request_ids)

    def _with_transfer_cost(self, engines: list[str]) -> PlacementConfig:
        """The placement config with a ship-or-recompute cost model from measured rates."""
        if not self.ship_kv or self.cfg.transfer is not None:
            return self.cfg
        costs = [self.kv_costs[e] for e in engines if e in self.kv_costs]
        rates = [r for _, r in costs if r > 0]
        per_token = max((b for b, _ in costs), default=0)
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
    """The job's coordinator handle, created on first use (`get_if_exists`)."""
    import ray

    actor = ray.remote(Coordinator).options(
        name=name, namespace=NAMESPACE, get_if_exists=True, lifetime="detached",
        num_cpus=0, max_restarts=0, max_concurrency=1)
    return actor.remote(**options)
