"""The coordinator's late binding by prefix: rows not yet started go where their prefix is.

Each engine's report carries its prefix summary whenever the summary changed
(`Report.prefixes`, from `Engine.prefix_summary`) and the prefix keys of its waiting rows
(`RequestSummary.prefix`). Every planning round, `PrefixPlanner.plan` asks the pure policy
(`batchgen_data.placement.affinity`) where each waiting row should run and orders the moves of
those placed elsewhere, as waiting-row migrations through the usual path (owner exports, the
receiver imports and mails the result back): exactly once as any other move, and a moved row
is a guest there, which never moves again.

Bounded load counts each engine's rows (`EngineLoad.num_active`) plus the rows ordered to it
that it has not reported yet (in flight for at most `inflight_s`), so consecutive rounds
between two reports do not pile onto one engine.
"""
from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

from batchgen_data.placement import (AffinityConfig, EngineLoad, Move, RequestSummary, Ring,
                                     affinity_moves)

if TYPE_CHECKING:
    from batchgen_data.engine.engine import Engine


class Report(Protocol):
    """What the planner reads of an engine's report (`coordinator.Report`, which imports this
    module, so it is named here by its shape)."""

    @property
    def load(self) -> EngineLoad: ...
    @property
    def movable(self) -> Sequence[RequestSummary]: ...
    @property
    def accepting(self) -> bool: ...
    @property
    def guests(self) -> Sequence[str]: ...
    @property
    def prefixes(self) -> frozenset[int] | None: ...


class PrefixPlanner:
    """The engines' latest prefix summaries, the affinity moves in flight, the next moves."""

    def __init__(self, cfg: AffinityConfig, inflight_s: float = 5.0) -> None:
        self.cfg = cfg
        self.inflight_s = inflight_s
        self.held: dict[str, frozenset[int]] = {}
        self.inflight: dict[str, tuple[str, float]] = {}  # row -> (receiver, when ordered)
        self.num_moves = 0
        self._ring: tuple[frozenset[str], Ring] | None = None  # rebuilt when engines change

    def note(self, engine_id: str, report: Report) -> None:
        """Take in one engine's report: its summary when sent, its guests (arrived rows)."""
        if report.prefixes is not None:
            self.held[engine_id] = report.prefixes
        for rid in report.guests:
            self.inflight.pop(rid, None)

    def forget(self, engine_id: str) -> None:
        self.held.pop(engine_id, None)

    def plan(self, now: float, reports: Mapping[str, Report],
             sources: Collection[str]) -> list[Move]:
        """Moves of the waiting rows of `sources` (engines whose reports are current) among the
        engines of `reports` that take work (`Report.accepting`)."""
        self.inflight = {rid: v for rid, v in self.inflight.items()
                         if now - v[1] < self.inflight_s and v[0] in reports}
        coming: dict[str, int] = {}
        for dst, _ in self.inflight.values():
            coming[dst] = coming.get(dst, 0) + 1
        active = {e: rep.load.num_active + coming.get(e, 0) for e, rep in reports.items()
                  if rep.accepting}
        waiting = {e: [r for r in reports[e].movable
                       if r.kind == "waiting" and r.prefix and r.request_id not in self.inflight]
                   for e in sources if e in active}
        if self._ring is None or self._ring[0] != set(active):
            self._ring = (frozenset(active), Ring(active, self.cfg.vnodes))
        moves = affinity_moves(waiting, active, self.held, self.cfg, self._ring[1])
        for mv in moves:
            for rid in mv.request_ids:
                self.inflight[rid] = (mv.dst, now)
            self.num_moves += len(mv.request_ids)
        return moves


def changed_prefixes(engine: Engine, engine_id: str, last_version: int,
                     on: bool) -> tuple[frozenset[int] | None, int]:
    """Engine thread: the engine's prefix keys for its next report when its summary changed
    since `last_version` (None otherwise, or when affinity is off) and the version now sent."""
    if not on:
        return None, last_version
    summary = engine.prefix_summary(engine_id)
    if summary.version == last_version:
        return None, last_version
    return summary.keys, summary.version
