"""Event loop of the lockstep expert-parallel cluster: dispatch, group steps, moves, reshards.

Groups keep their own clocks; the loop always advances the group whose next step starts first,
so moves between groups and rows bound by the dispatcher take effect at step boundaries, as in
a real engine. See lockstep.py for the model and the modes.
"""
from __future__ import annotations

import heapq
from collections import Counter

import numpy as np

from batchgen_lab.sim.ep_preset import EPPreset
from batchgen_lab.sim.ep_trace import EPTrace
from batchgen_lab.sim.lockstep import BATCH, EPMode, EPResult, Group
from batchgen_lab.sim.workload import Workload


class EPCluster:
    def __init__(self, wl: Workload, gpus: int, p: EPPreset, mode: EPMode,
                 gpu_factors: list[float] | None = None, trace: bool = False) -> None:
        if gpus < p.group_gpus or gpus % p.group_gpus:
            raise ValueError(f"gpus={gpus!r}: must be a multiple of {p.group_gpus}")
        f = np.asarray(gpu_factors if gpu_factors is not None else [1.0] * gpus, np.float64)
        if f.shape != (gpus,):
            raise ValueError("gpu_factors needs one entry per GPU")
        self.wl, self.p, self.mode = wl, p, mode
        n_groups = gpus // p.group_gpus
        self.groups = [Group(g, p, f[g * p.group_gpus:(g + 1) * p.group_gpus])
                       for g in range(n_groups)]
        self.inp, self.out = wl.input_lens.tolist(), wl.output_lens.tolist()
        seats = p.group_gpus * p.seats_per_rank
        concurrent = 8 if mode.name == "static" else -(-seats // BATCH)
        self.batches_max = 2 * concurrent  # Ray Data binds 2x max_concurrent_batches
        self.concurrent = concurrent
        self.window = 2 * seats if mode.name == "continuous" else seats + BATCH
        # migrate modes with 4+ groups: the group with the fastest slowest GPU (its measured
        # step speed) runs light and takes the cluster's oldest sequences (the long tail), so
        # their steps are not paced by a full group
        self.tail_group = int(np.argmin([g.gpu_f.max() for g in self.groups])) \
            if mode.name.startswith("migrate") and n_groups >= 4 and mode.tail_seats > 0 else None
        # light groups: the tail group, and with +tiers more as the job drains (lockstep_tiers)
        self.light = [self.tail_group] if self.tail_group is not None else []
        self.light_set = set(self.light)
        n = wl.num_rows
        self.moved_at = np.full(n, -np.inf)  # when each row last moved between groups (+pin)
        self.num_batches = -(-n // BATCH)
        self.batch_left = [min(BATCH, n - i * BATCH) for i in range(self.num_batches)]
        self.home = np.full(n, -1, np.int64)  # the group that received the row
        self.open = [0] * n_groups  # static: batches bound
        self.running = [0] * n_groups  # static: batches whose rows reached the engine
        self.task_queue: list[list[int]] = [[] for _ in range(n_groups)]
        self.in_flight = [0] * n_groups
        self.next_batch = 0
        self._now = 0.0  # when the dispatcher last ran (the trace's bind times)
        self.finish = np.full(n, np.nan)
        self.done = 0
        self.moved: Counter[str] = Counter()
        self.reshards = 0
        self.steps = 0
        self.busy = 0.0
        self.trace = EPTrace(p, n_groups) if trace else None  # --diagnose: see ep_trace.py
        self._heap: list[tuple[float, int, int]] = []  # (time, order, group id; -1 = tick)
        self._order = 0

    # ---- dispatch -----------------------------------------------------------------------
    def _wants(self, g: int) -> bool:
        if self.next_batch >= self.num_batches:
            return False
        if self.mode.name.startswith("static"):
            return self.open[g] < self.batches_max
        if g in self.light_set and self.mode.has("tiers"):
            return False  # a light group takes only the oldest sequences
        window = self.mode.tail_seats // 2 if g in self.light_set else self.window
        return self.in_flight[g] + BATCH <= window

    def _bind(self, g: int) -> None:
        b = self.next_batch
        self.next_batch += 1
        lo = b * BATCH
        self.home[lo:lo + self.batch_left[b]] = g
        self.in_flight[g] += self.batch_left[b]
        if self.trace:
            self.trace.bind(range(lo, lo + self.batch_left[b]), self._now)
        if self.mode.name.startswith("static"):
            self.open[g] += 1
            if self.running[g] >= self.concurrent:
                self.task_queue[g].append(b)
                return
            self.running[g] += 1
        self._release(g, b)

    def _release(self, g: int, b: int) -> None:
        """Batch b's rows reach group g's engine: a rank queue each, or the shared queue."""
        grp = self.groups[g]
        lo = b * BATCH
        rows = range(lo, lo + self.batch_left[b])
        if self.mode.late:
            grp.shared.extend(rows)
            return
        load = np.array([len(q) for q in grp.queues[:grp.ranks]], np.float64)
        load += np.bincount(grp.seat_rank[grp.row >= 0], minlength=grp.ranks)[:grp.ranks]
        for r in rows:  # vLLM's DP load balancer: the rank with the fewest requests
            k = int(np.argmin(load))
            grp.queues[k].append(r)
            load[k] += 1

    def _feed(self, g: int, now: float) -> None:
        self._now = now
        while self._wants(g):
            self._bind(g)
        self._wake(g, now)

    def _wake(self, g: int, now: float) -> None:
        grp = self.groups[g]
        if not grp.scheduled:
            grp.scheduled = True
            self._push(max(now, grp.busy_until), g)

    def _push(self, t: float, g: int) -> None:
        self._order += 1
        heapq.heappush(self._heap, (t, self._order, g))

    # ---- one group step -----------------------------------------------------------------
    def _admit(self, grp: Group, now: float) -> None:
        grp.fresh[:] = False
        keep = []
        for a in grp.arrivals:  # moved sequences first: their KV arrived
            ready, row, ctx, left, gen, rank = a
            free = grp.free_seats()
            k = rank if 0 <= rank < grp.ranks and free[rank] > 0 else int(np.argmax(free))
            if ready > now or not free.any() or not grp.seat(row, ctx, left, gen, k, False):
                keep.append(a)
            elif self.trace:
                self.trace.seat(row, grp.gid, now)
        grp.arrivals = keep
        budget = np.full(grp.ranks, self.p.prefill_budget)
        free = grp.free_seats()
        if self.mode.late and self.mode.has("align"):
            self._admit_round(grp, free, budget, now)
            return
        if self.mode.late:  # a waiting row takes the least loaded rank's free seat
            times = grp.rank_times()
            while grp.shared and free.any():
                cand = np.flatnonzero((free > 0) & (budget > 0))
                if not len(cand):
                    break
                k = int(cand[np.argmin(times[cand])])
                row = self._seat_new(grp, grp.shared.popleft(), k, free, budget, now)
                times[k] += self.p.c_kv * self.inp[row] + self.p.c_seq
            return
        for k in range(grp.ranks):
            q = grp.queues[k]
            while q and free[k] > 0 and budget[k] > 0:
                self._seat_new(grp, q.popleft(), k, free, budget, now)

    def _seat_new(self, grp: Group, row: int, k: int, free: np.ndarray, budget: np.ndarray,
                  now: float) -> int:
        """Seat waiting row `row` on rank k, where its prompt prefills this step; count its
        seat and prompt tokens against the rank's `free` and `budget`."""
        grp.seat(row, self.inp[row], self.out[row], 0, k, True)
        if self.trace:
            self.trace.seat(row, grp.gid, now)
        free[k] -= 1
        budget[k] -= self.inp[row]
        return row

    def _admit_round(self, grp: Group, free: np.ndarray, budget: np.ndarray,
                     now: float) -> None:
        """+align: seat waiting rows in rounds. In lockstep a step lasts as long as its slowest
        rank, so a prompt prefilled on one rank stalls all of them; admitting as seats free
        (one or two rows a step at steady state) pays that stall once per row. A round waits
        until the group has `align_seats` free seats per rank (or as many as rows wait, or a
        seat has waited `align_wait_s`, or nothing runs), then hands each next row to the rank with
        the fewest prompt tokens this round (ties: least loaded), so every rank prefills about
        the same and the stall is paid once for the round."""
        if not grp.shared or not free.any():
            grp.free_since = None
            return
        if grp.free_since is None:
            grp.free_since = now
        idle = not (grp.row >= 0).any()
        want = self.mode.align_seats * grp.ranks
        if not (idle or int(free.sum()) >= min(want, len(grp.shared))
                or now - grp.free_since >= self.mode.align_wait_s):
            return
        grp.free_since = None
        tokens = np.zeros(grp.ranks)
        times = grp.rank_times()
        while grp.shared:
            cand = np.flatnonzero((free > 0) & (budget > 0))
            if not len(cand):
                break
            k = int(cand[np.lexsort((times[cand], tokens[cand]))[0]])
            row = self._seat_new(grp, grp.shared.popleft(), k, free, budget, now)
            tokens[k] += self.inp[row]

    def _has_queued(self, grp: Group) -> bool:
        return bool(grp.shared) or any(grp.queues) or bool(grp.arrivals)

    def _step(self, g: int, now: float) -> None:
        grp = self.groups[g]
        grp.scheduled = False
        self._admit(grp, now)
        on = grp.row >= 0
        if not on.any():
            if grp.arrivals:  # wait for moved KV
                grp.scheduled = True
                self._push(min(a[0] for a in grp.arrivals), g)
            return
        b, new, kv = grp.loads()
        k = 1
        # +align: a round is being waited for, so free seats stay free until the next finish
        # (or the round's deadline) and the steps before it can be summed like any others
        pending = grp.free_since is not None and not grp.arrivals
        if not grp.fresh.any() and (pending or not (self._has_queued(grp)
                                                    and grp.free_seats().any())):
            k = int(grp.left[on].min())  # nothing changes before the next finish
            step = max(grp.step_time(), 1e-6)
            if self.mode.name.startswith("migrate"):
                k = max(1, min(k, int(self.mode.tick_s / step)))
            if pending:
                due = grp.free_since + self.mode.align_wait_s - now  # type: ignore[operator]
                k = max(1, min(k, int(due / step)))
        if k == 1:
            dt = grp.step_time()
        else:  # k steps whose KV grows by b per rank per step
            j = np.arange(k)[:, None]
            rank = self.p.rank_times(b, new, kv + j * b, grp.f, grp.tp).max(axis=1)
            dt = float(rank.sum()) + k * self.p.shared_time(
                float(new.sum()), float(new.max()), float(grp.f.max()), grp.tp)
        end = now + dt
        if self.trace:
            self.trace.step(g, now, dt, int(on.sum()), self.next_batch < self.num_batches,
                            b, new, kv, grp.f, grp.tp, k)
        self.steps += k
        self.busy += dt * self.p.group_gpus
        grp.ctx[on] += np.where(grp.fresh[on], 1, k)
        grp.left[on] -= k
        grp.gen[on] += k
        grp.fresh[:] = False
        fin = np.flatnonzero(on & (grp.left <= 0))
        homes = {g}
        for s in fin.tolist():
            row = int(grp.row[s])
            grp.row[s] = -1
            self.finish[row] = end
            self.done += 1
            h = int(self.home[row])
            self.in_flight[h] -= 1
            homes.add(h)
            b_id = row // BATCH
            self.batch_left[b_id] -= 1
            if self.batch_left[b_id] == 0 and self.mode.name.startswith("static"):
                self.open[h] -= 1
                self.running[h] -= 1
                if self.task_queue[h]:
                    self.running[h] += 1
                    self._release(h, self.task_queue[h].pop(0))
        grp.busy_until = end
        for h in sorted(homes):
            self._feed(h, end)
        if grp.active() or self._has_queued(grp):
            self._wake(g, end)

    # ---- coordinator (migrate modes) ----------------------------------------------------
    def _tick(self, now: float) -> None:
        from batchgen_lab.sim.lockstep_policy import rebalance

        rebalance(self, now)
        if self.done < self.wl.num_rows:
            self._push(now + self.mode.tick_s, -1)

    def run(self) -> EPResult:
        for g in range(len(self.groups)):
            self._feed(g, 0.0)
        if self.mode.name.startswith("migrate"):
            self._push(self.mode.tick_s, -1)
        while self._heap and self.done < self.wl.num_rows:
            now, _, g = heapq.heappop(self._heap)
            if g < 0:
                self._tick(now)
            elif now < self.groups[g].busy_until:  # paused (re-sharding): come back later
                self._push(self.groups[g].busy_until, g)
            else:
                self._step(g, now)
        if self.done != self.wl.num_rows:
            raise RuntimeError(f"lockstep simulation stalled: {self.done}/{self.wl.num_rows}")
        return EPResult(self.mode.name, float(np.max(self.finish)), self.finish,
                        dict(self.moved), self.reshards, self.steps, self.busy)
