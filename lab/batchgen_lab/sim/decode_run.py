"""A run of identical decode steps on one simulated actor, planned in closed form.

During the run every running sequence decodes one token per step, so step j (1-based) reads
S + (j - 1) * n KV tokens, with n the sequences still running and S their KV length at the
run's first step. A sequence leaves after the step that produces its last token; between two
finishes the step cost is (piecewise) linear in j, so the run's time and each finish time are
summed exactly (`CostModel.decode_steps_time`), one segment per finish, without visiting steps.

The run is planned when it starts and applied (`commit`) when it ends — or earlier, when the
cluster interrupts it at a step boundary because work arrives or must leave (`steps_by`).
"""
from __future__ import annotations

import bisect
import heapq
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from batchgen_data.core.scheduler import Scheduler
    from batchgen_lab.sim.actor import SimActor

ZEROS = memoryview(bytes(1 << 15))  # prompts and token runs are zero-copy slices of this


def next_is_pure_decode(sched: "Scheduler") -> bool:
    """Would the scheduler's next `schedule()` compute one token for every running sequence
    and admit nobody? Whether the running ones have the blocks to grow is left to the caller
    (`DecodeRun` checks it exactly)."""
    run = sched.running
    if not run or len(run) > sched.token_budget:
        return False
    if any(s.num_pending_tokens != 1 for s in run):
        return False
    queue = sched.held or sched.waiting
    if not queue or len(run) >= sched.config.max_num_seqs:
        return True
    head = queue[0]
    n = min(head.num_pending_tokens, sched.token_budget - len(run))
    # free blocks only shrink while the running ones decode: a head that does not fit now
    # does not fit at any step of the run
    return not sched.admits(head, n)


class DecodeRun:
    def __init__(self, actor: "SimActor", t0: float, cut: Callable[[list[int]], int]) -> None:
        """Plan the run that starts at t0 with the actor's running sequences (no side effects)."""
        self.actor = actor
        self.t0 = t0
        self._cost = actor.cost
        self.seqs = run = actor.running_seqs()
        target = actor.target
        self.left = left = [target[q.seq_id] - (len(q.token_ids) - len(q.prompt_token_ids))
                            for q in run]  # steps until each sequence produces its last token
        first = heapq.nsmallest(actor.shape.finishes_per_run, range(len(run)), key=left.__getitem__)
        j = min(cut([run[i].seq_id for i in first]), len(first))
        # j < 1: a finish before the run must be acted on first (no run: k = 0)
        self.k = k = self._memory_limit(left[first[j - 1]]) if j >= 1 else 0
        ctx = [len(q.token_ids) for q in run]
        self.total = sum(ctx)
        self.fin = sorted((left[i], ctx[i], i) for i in range(len(run)) if left[i] <= k)
        self.fin_steps = [f[0] for f in self.fin]
        self.duration, self.fin_times = self._walk(len(run), self.total, self.fin, k)

    def time_at(self, m: int) -> float:
        """Seconds from t0 to the end of step m of the run."""
        return self._walk(len(self.seqs), self.total,
                          self.fin[:bisect.bisect_right(self.fin_steps, m)], m)[0]

    def steps_by(self, t: float) -> int:
        """The first step boundary at or after time t (the step in progress completes)."""
        lo, hi = 0, self.k
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (mid + 1, hi) if self.t0 + self.time_at(mid) < t else (lo, mid)
        return lo

    def running_at(self, t: float) -> int:
        return len(self.seqs) - bisect.bisect_right(self.fin_times, t - self.t0)

    def commit(self, m: int, finished: list[tuple[int, float]]) -> None:
        """Apply the first m steps: tokens, KV blocks, finishes (appended to `finished`)."""
        a = self.actor
        grow = a.grow_kv  # the scheduler's own block-growth rule
        bs = a.pool.block_size
        for q, lf in zip(self.seqs, self.left):
            s = m if lf > m else lf
            q.num_computed_tokens += s
            q.token_ids += ZEROS[:s]
            if s < lf and len(q.block_ids) * bs < q.num_computed_tokens:
                grow(q)
        alive = len(self.seqs)
        for (lf, _, i), tf in zip(self.fin, self.fin_times):
            if lf > m:
                break
            finished.append((self.seqs[i].seq_id, self.t0 + tf))
            a.retire(self.seqs[i])
            alive -= 1
            a.trace.append((self.t0 + tf, alive))

    def _walk(self, n: int, total: int, fin: list[tuple[int, int, int]],
              k: int) -> tuple[float, list[float]]:
        """Time of k steps and the end (from t0) of each finishing sequence's last step."""
        t, j0, times = 0.0, 1, []
        for lf, ci, _ in fin:
            if lf >= j0:
                t += self._segment(j0, lf, n, total)
                j0 = lf + 1
            times.append(t)
            n -= 1
            total -= ci
        if j0 <= k:
            t += self._segment(j0, k, n, total)
        return t, times

    def _segment(self, a: int, b: int, n: int, total: int) -> float:
        # `total` is these n sequences' KV at the run's first step
        return self._cost.decode_steps_time(n, total, a, b)

    def _memory_limit(self, k: int) -> int:
        """Largest m <= k such that m more decode steps never run out of free blocks."""
        pool = self.actor.pool
        bs, free = pool.block_size, pool.num_free
        if len(self.seqs) * -(-k // bs) <= free:  # a sequence needs at most ceil(k/bs) blocks
            return k
        computed = np.fromiter((q.num_computed_tokens for q in self.seqs), np.int64, len(self.seqs))
        have = np.fromiter((len(q.block_ids) for q in self.seqs), np.int64, len(self.seqs))

        def need(m: int) -> int:
            return int(np.maximum(0, -(-(computed + m) // bs) - have).sum())

        lo, hi = 0, k
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if need(mid) <= free else (lo, mid - 1)
        return lo
