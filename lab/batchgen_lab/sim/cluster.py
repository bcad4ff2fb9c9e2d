"""Discrete-event cluster simulation: actors, the input dispatcher and the coordinator.

Time advances event by event: the next event is the end of some actor's span (one real
scheduler step plus an extrapolated decode run, see `actor.py`), a moved sequence arriving at
its new actor, or a coordinator tick. At the end of a span the actor's finished rows are
credited to the input batch (and home actor) they came from, queued exports leave, the
dispatcher binds new input batches where the mode allows, and the actor starts its next span.

Rows are accounted once: a row finishes on whichever actor ran its last token, but it always
counts against the batch and home actor that received it, like a migrated request whose result
returns through the task that received the row.
"""
from __future__ import annotations

import heapq
import math
import time
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from batchgen_data.placement import find_receivers, pick_donors, plan_moves, rows_wanted
from batchgen_data.sampling_params import SamplingParams
from batchgen_lab.sim.actor import EngineShape, SimActor, Span
from batchgen_lab.sim.costmodel import CostModel, scaled
from batchgen_lab.sim.modes import ModeConfig
from batchgen_lab.sim.result import SimResult
from batchgen_lab.sim.workload import Workload

_END, _ARRIVE, _TICK, _UP, _DELIVER = 0, 1, 2, 3, 4


class Cluster:
    def __init__(self, wl: Workload, num_actors: int, cost: CostModel, shape: EngineShape,
                 mode: ModeConfig, slowdown: Sequence[float] | None = None,
                 start_at: Sequence[float] | None = None,
                 plan: Sequence[Sequence[int]] | None = None) -> None:
        """`slowdown[i]` multiplies actor i's step times (stragglers); actor i takes no rows
        before `start_at[i]` seconds (start-up skew). Both default to a uniform cluster.
        `plan` (task modes): replay a dispatch that happened, e.g. in a Ray run: actor i gets
        exactly the input batches `plan[i]`, in that order, each when it has room."""
        if num_actors < 1:
            raise ValueError(f"actors={num_actors!r}: must be >= 1")
        self.wl, self.cost, self.shape, self.mode = wl, cost, shape, mode
        self.slowdown = list(slowdown) if slowdown is not None else [1.0] * num_actors
        self.start_at = list(start_at) if start_at is not None else [0.0] * num_actors
        if len(self.slowdown) != num_actors or len(self.start_at) != num_actors:
            raise ValueError("slowdown and start_at need one entry per actor")
        if min(self.slowdown) <= 0 or min(self.start_at) < 0:
            raise ValueError("slowdown must be > 0 and start_at >= 0")
        self.actors = [SimActor(i, scaled(cost, f), shape) for i, f in enumerate(self.slowdown)]
        self.started = [t <= 0.0 for t in self.start_at]
        self.params = SamplingParams(temperature=0.0, max_tokens=wl.max_output, ignore_eos=True)
        self.inp = wl.input_lens.tolist()
        self.out = wl.output_lens.tolist()
        n, b = wl.num_rows, mode.batch_size
        self.num_batches = -(-n // b)
        self.batch_left = [min(b, n - i * b) for i in range(self.num_batches)]
        self.batch_home = [-1] * self.num_batches
        self.batch_bound_at = np.full(self.num_batches, np.nan)
        self.next_batch = 0  # input batches bound so far (the next one, without a plan)
        self.plan = None if plan is None else [deque(p) for p in plan]
        if self.plan is not None and (not mode.by_task or len(self.plan) != num_actors or sorted(
                x for p in self.plan for x in p) != list(range(self.num_batches))):
            raise ValueError("plan: a task mode, one list per actor, every batch once")
        self.in_flight = [0] * num_actors  # unfinished rows each actor received
        self.batches_open = [0] * num_actors  # bound and not yet returned
        # static: bound batches beyond the running ones wait in the actor's task queue
        self.batches_running = [0] * num_actors
        self.task_queue: list[deque[int]] = [deque() for _ in range(num_actors)]
        self.span: list[Span | None] = [None] * num_actors  # the span each actor is in
        self.exports: list[list[tuple[int, int, bool]]] = [[] for _ in range(num_actors)]
        self.inbound = [0] * num_actors
        self.planned_at = [-math.inf] * num_actors  # last move each actor took part in
        self.finish = np.full(n, np.nan)
        self.finished_by = np.full(n, -1, dtype=np.int32)
        self.num_finished = 0
        self.moved: Counter[str] = Counter()
        self.shipped_bytes = 0
        self.transfer = cost.transfer()
        # the policy decides ship-or-recompute with this cluster's cost model unless told
        self.placement = mode.placement if mode.placement.transfer is not None else replace(
            mode.placement, transfer=self.transfer)
        self._events: list[tuple[float, int, int, object]] = []
        self._seq = 0

    # ---- dispatcher ---------------------------------------------------------------------
    def _wants(self, a: int) -> bool:
        """Row-window modes: actor `a` takes another input batch now."""
        if self.mode.by_task or self.next_batch >= self.num_batches or not self.started[a]:
            return False
        return rows_wanted(self.in_flight[a], self.shape.max_num_seqs, self.placement) > 0

    def _dispatch(self, now: float) -> set[int]:
        """Task modes: Ray's rule (modes.py, 2 and 5): each next input batch goes to the alive
        actor with the fewest batches in flight, while that is below the limit; ties go to the
        lowest index. Returns the actors that received batches."""
        fed: set[int] = set()
        limit = self.mode.tasks_in_flight
        if self.plan is not None:
            for a, todo in enumerate(self.plan):
                while todo and self.started[a] and self.batches_open[a] < limit:
                    self._bind(a, now, todo.popleft())
                    fed.add(a)
            return fed
        while self.next_batch < self.num_batches:
            open_ = [(n, i) for i, n in enumerate(self.batches_open)
                     if self.started[i] and n < limit]
            if not open_:
                break
            a = min(open_)[1]
            self._bind(a, now)
            fed.add(a)
        return fed

    def _bind(self, a: int, now: float, b: int | None = None) -> None:
        b = self.next_batch if b is None else b
        self.next_batch += 1
        self.batch_home[b] = a
        self.batch_bound_at[b] = now
        self.in_flight[a] += self.batch_left[b]
        self.batches_open[a] += 1
        if self.mode.by_task and self.batches_running[a] >= self.mode.max_concurrent_batches:
            self.task_queue[a].append(b)  # Ray Core runs it when a running call returns
        else:
            self._start_batch(a, b)

    def _start_batch(self, a: int, b: int) -> None:
        """The actor's UDF call for batch `b` begins: its rows reach the engine."""
        lo = b * self.mode.batch_size
        actor = self.actors[a]
        for r in range(lo, lo + self.batch_left[b]):
            actor.add_row(r, self.inp[r], self.out[r], self.params)
        self.batches_running[a] += 1

    def _cut(self, rows: list[int]) -> int:
        """How many upcoming finishes a span may include: in task modes, stop at the first
        one that completes an input batch (the actor then takes a new batch)."""
        if not self.mode.by_task:
            return len(rows)
        seen: dict[int, int] = {}
        for i, r in enumerate(rows):
            b = r // self.mode.batch_size
            seen[b] = seen.get(b, self.batch_left[b]) - 1
            if seen[b] == 0:
                return i + 1
        return len(rows)

    # ---- events -------------------------------------------------------------------------
    def _push(self, t: float, kind: int, data: object) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, self._seq, kind, data))

    def _start(self, a: int, now: float) -> None:
        span = self.actors[a].start_span(now, self._cut)
        self.span[a] = span
        if span is not None:
            self._push(span.end, _END, (a, span, span.version))

    def _interrupt(self, a: int, now: float) -> None:
        """Work arrives for or must leave a busy actor: end its span at the next step."""
        span = self.span[a]
        if span is not None and self.actors[a].interrupt(span, now):
            self._push(span.end, _END, (a, span, span.version))

    def _span_end(self, now: float, a: int, span: Span, version: int) -> None:
        if self.span[a] is not span or span.version != version:
            return  # superseded by an interrupt
        self.span[a] = None
        homes = {a}
        fed: set[int] = set()  # actors whose queued batch started: their engines get rows
        delay = self.mode.deliver_delay_s
        for row, t in self.actors[a].end_span(span):
            assert math.isnan(self.finish[row]), f"row {row} finished twice"
            home = self.batch_home[row // self.mode.batch_size]
            if home != a and delay > 0:  # a guest's result travels to its owner's task
                self.finished_by[row] = a
                self._push(t + delay, _DELIVER, row)
                continue
            self._credit(row, t, a, homes, fed)
        self._run_exports(a, now)
        self._feed(now, homes, fed, a)
        self._start(a, now)

    def _credit(self, row: int, t: float, a: int, homes: set[int], fed: set[int]) -> None:
        """Row `row` returned through its input batch's task at `t` (it ran last on `a`)."""
        self.finish[row] = t
        self.finished_by[row] = a
        self.num_finished += 1
        b = row // self.mode.batch_size
        home = self.batch_home[b]
        self.in_flight[home] -= 1
        self.batch_left[b] -= 1
        if self.batch_left[b] == 0:
            self.batches_open[home] -= 1
            self.batches_running[home] -= 1
            if self.task_queue[home]:
                self._start_batch(home, self.task_queue[home].popleft())
                fed.add(home)
        homes.add(home)

    def _feed(self, now: float, homes: set[int], fed: set[int], a: int = -1) -> None:
        """After rows returned: new input batches where the mode allows; actors other than
        `a` (whose next span its caller starts) take them now or at their next step."""
        if self.mode.by_task:
            fed |= self._dispatch(now)
        for h in sorted(homes | fed):
            if h != a and self.span[h] is not None:
                if h in fed or self._wants(h):
                    self._interrupt(h, now)  # it takes the new rows at its next step boundary
                continue
            while self._wants(h):
                self._bind(h, now)
            if h != a and self.actors[h].has_work():
                self._start(h, now)

    def _deliver(self, now: float, row: int) -> None:
        """A moved row's result reaches its owner (`ModeConfig.mailbox`)."""
        homes: set[int] = set()
        fed: set[int] = set()
        self._credit(row, now, int(self.finished_by[row]), homes, fed)
        self._feed(now, homes, fed)

    def _run_exports(self, a: int, now: float) -> None:
        for row, dst, ship in self.exports[a]:
            seq = self.actors[a].live.get(row)
            kind = "waiting" if seq is None else seq.status.name.lower()
            got = self.actors[a].export(row, ship)
            if got is None:  # finished before the move was carried out
                self.inbound[dst] -= 1
                continue
            seq, out_len, kv = got
            self.moved[kind] += 1
            if kv is not None:
                self.moved["kv_shipped"] += 1
                self.shipped_bytes += kv
                delay = self.transfer.ship_seconds(seq.num_computed_tokens)
            else:
                delay = self.mode.rpc_latency_s
            self._push(now + delay + self.mode.import_delay_s, _ARRIVE, (dst, seq, out_len, kv))
        self.exports[a] = []

    def _arrive(self, now: float, dst: int, seq, out_len: int, kv: int | None) -> None:  # type: ignore[no-untyped-def]
        self.inbound[dst] -= 1
        self.actors[dst].receive(seq, out_len, kv)
        if self.span[dst] is None:
            self._start(dst, now)
        else:
            self._interrupt(dst, now)

    def _up(self, now: float, a: int) -> None:
        """Actor `a` finished starting (model loaded): it binds rows and starts stepping. Every
        actor up by `now` wakes together, as Ray's pool sees actors alive in one pass and
        shares the queued batches among them (rule 2 of modes.py), not first come, all taken."""
        woke = [i for i, t in enumerate(self.start_at) if t <= now and not self.started[i]]
        for i in woke:
            self.started[i] = True
        fed = self._dispatch(now) if self.mode.by_task else set()
        for i in woke:
            while self._wants(i):
                self._bind(i, now)
        for h in sorted(fed | set(woke)):
            if self.span[h] is None:
                if self.actors[h].has_work():
                    self._start(h, now)
            else:
                self._interrupt(h, now)

    def _tick(self, now: float) -> None:
        pcfg = self.placement
        cool = now - self.mode.cooldown_s  # with a mailbox, a moved pair reports anew first
        loads = [act.load(now, self.span[i]) for i, act in enumerate(self.actors)
                 if not self.exports[i] and not self.inbound[i] and self.started[i]
                 and self.planned_at[i] <= cool]
        receivers = find_receivers(loads, pcfg)
        if receivers:
            donors = pick_donors(loads, pcfg)[:self.mode.max_donors]
            kinds = self.mode.movable  # late-bind: only rows no engine has started
            summaries = {d.engine_id: [q for q in self.actors[d.engine_id].summaries(
                pcfg.max_requests_per_receiver) if q.kind in kinds] for d in donors}
            for mv in plan_moves(loads, summaries, pcfg):
                self.planned_at[mv.src] = self.planned_at[mv.dst] = now
                for rid in mv.request_ids:
                    self.exports[mv.src].append((int(rid), mv.dst, mv.ship_kv))
                    self.inbound[mv.dst] += 1
            # the export request's trip to the donor
            reach = now + self.mode.rpc_latency_s + self.mode.order_delay_s
            for i, todo in enumerate(self.exports):
                if todo and self.span[i] is None:
                    self._run_exports(i, reach)
                elif todo:
                    self._interrupt(i, reach)
        if self.num_finished < self.wl.num_rows:
            self._push(now + self.mode.tick_s, _TICK, None)

    # ---- driver -------------------------------------------------------------------------
    def run(self) -> SimResult:
        wall = time.perf_counter()
        progress = not self.mode.by_task
        if self.mode.by_task:
            self._dispatch(0.0)
        while progress:  # row windows: round-robin initial binding, one batch per actor a pass
            progress = False
            for a in range(len(self.actors)):
                if self._wants(a):
                    self._bind(a, 0.0)
                    progress = True
        for a in range(len(self.actors)):
            if self.started[a]:
                self._start(a, 0.0)
            else:
                self._push(self.start_at[a], _UP, a)
        if self.mode.migrate:
            self._push(self.mode.tick_s, _TICK, None)
        while self._events and self.num_finished < self.wl.num_rows:
            now, _, kind, data = heapq.heappop(self._events)
            if kind == _END:
                self._span_end(now, *data)  # type: ignore[misc]
            elif kind == _ARRIVE:
                self._arrive(now, *data)  # type: ignore[misc]
            elif kind == _UP:
                self._up(now, data)  # type: ignore[arg-type]
            elif kind == _DELIVER:
                self._deliver(now, data)  # type: ignore[arg-type]
            else:
                self._tick(now)
        if self.num_finished != self.wl.num_rows:
            raise RuntimeError(f"simulation stalled: {self.num_finished}/{self.wl.num_rows} rows")
        return SimResult.collect(self, time.perf_counter() - wall)
