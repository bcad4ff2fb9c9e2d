"""BatchGen's remedies in a lockstep expert-parallel cluster, run every coordinator tick.

* Within a group: the rank whose own time gates every step hands sequences to the least loaded
  rank with a free seat, while that narrows the gap (the step is the slowest rank's time).
* With 4+ groups, the group whose slowest GPU is fastest is the tail group: it binds few rows of its own (half of
  `EPMode.tail_seats`) and takes, every tick, the oldest sequences of the other groups that have
  generated `tail_age` tokens, up to `tail_seats` in all. In lockstep a sequence's speed is set
  by its group's load, so the long tail runs in a light group instead of a full one; the price
  is the throughput that group does not deliver (age is the only signal: no output length is
  read).
* Between groups, once every row is bound: a group short of work takes the oldest sequences of
  the group with the slowest steps (the long tail), while the donor's step is clearly slower.
* `migrate-repartition`: a group left with at most half as many sequences as ranks, and nothing
  queued, re-partitions into half as many ranks twice as wide (DP16 -> DP8 x TP2, ... TP8) when
  the model gives a faster step, pausing `EPPreset.reshard_s`.
A moved sequence's KV travels at `EPPreset.link_bytes_per_s`; until it lands it makes no
progress. Its result still returns through the group that received the row.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from batchgen_data.sim.lockstep import Group
    from batchgen_data.sim.lockstep_run import EPCluster

MAX_RANK_MOVES = 8  # per group per tick
MAX_GROUP_MOVES = 64  # per receiver per tick
SLOWER = 1.25  # a donor's step must be this much slower than the receiver's


def _ship(c: "EPCluster", grp: "Group", s: int, dst: "Group", rank: int, now: float,
          kind: str) -> None:
    row, ctx, left, gen = grp.take(s)
    ready = max(now, grp.busy_until) + ctx * c.p.kv_bytes_per_token / c.p.link_bytes_per_s
    dst.arrivals.append((ready, row, ctx, left, gen, rank))
    c.moved[kind] += 1
    c._wake(dst.gid, ready)


def _balance_ranks(c: "EPCluster", grp: "Group", now: float) -> None:
    p = c.p
    for _ in range(MAX_RANK_MOVES):
        times = grp.rank_times()
        free = grp.free_seats()
        src = int(np.argmax(times))
        dsts = np.flatnonzero(free > 0)
        if not len(dsts):
            return
        dst = int(dsts[np.argmin(times[dsts])])
        on = np.flatnonzero((grp.row >= 0) & (grp.seat_rank == src) & ~grp.fresh)
        if src == dst or len(on) < 2:
            return
        cost = p.c_kv * grp.ctx[on] / grp.tp + p.c_tok / grp.tp + p.c_seq
        after = np.maximum(times[src] - grp.f[src] * cost, times[dst] + grp.f[dst] * cost)
        best = int(np.argmin(after))
        if after[best] >= times[src] * 0.98:  # not worth a move
            return
        _ship(c, grp, int(on[best]), grp, dst, now, "rank")


def _feed_short_groups(c: "EPCluster", now: float) -> None:
    cap = c.p.group_gpus * c.p.seats_per_rank
    active = [g.active() + len(g.arrivals) for g in c.groups]
    times = [g.step_time() if active[i] else 0.0 for i, g in enumerate(c.groups)]
    short = sorted((i for i, g in enumerate(c.groups) if i != c.tail_group
                    and active[i] < c.mode.starve_fraction * cap and not c._has_queued(g)),
                   key=lambda i: (times[i], i))
    gave: set[int] = set()
    for dst in short:
        donors = [i for i in range(len(c.groups))
                  if i != dst and i not in gave and active[i] > 0]
        if not donors:
            return
        src = max(donors, key=lambda i: (times[i], i))
        if times[src] <= SLOWER * max(times[dst], 1e-9) and active[dst]:
            continue
        grp = c.groups[src]
        on = np.flatnonzero((grp.row >= 0) & ~grp.fresh & (grp.gen >= c.mode.min_age))
        m = min(len(on), MAX_GROUP_MOVES, (active[src] - active[dst]) // 2,
                int(c.groups[dst].free_seats().sum()))
        if m <= 0:
            continue
        for s in on[np.argsort(-grp.gen[on], kind="stable")[:m]].tolist():
            _ship(c, grp, s, c.groups[dst], -1, now, "group")
        gave.add(src)


def _repartition(c: "EPCluster", grp: "Group", now: float) -> None:
    n = grp.active() + len(grp.arrivals)
    if n == 0 or grp.tp >= 8 or n > grp.ranks // 2 or c._has_queued(grp):
        return
    ctx = np.sort(grp.ctx[grp.row >= 0])[::-1].astype(np.float64)
    best_tp, best_t = grp.tp, grp.step_time()
    tp = grp.tp * 2
    while tp <= 8 and n <= c.p.group_gpus // tp:
        r = c.p.group_gpus // tp
        b = np.zeros(r)
        b[:n] = 1.0
        kv = np.zeros(r)
        kv[:n] = ctx
        f = grp.gpu_f.reshape(r, tp).max(axis=1)
        t = c.p.step_time(b, b, kv, f, tp)
        if t < 0.95 * best_t:
            best_tp, best_t = tp, t
        tp *= 2
    if best_tp != grp.tp:
        grp.repack(best_tp)
        grp.busy_until = max(now, grp.busy_until) + c.p.reshard_s
        c.reshards += 1


def _fill_tail_group(c: "EPCluster", now: float) -> None:
    """The oldest sequences elsewhere move into the tail group's room, oldest first."""
    tail = c.groups[c.tail_group]
    room = min(MAX_GROUP_MOVES, c.mode.tail_seats - tail.active() - len(tail.arrivals))
    if room <= 0:
        return
    cands: list[tuple[int, int, int]] = []  # (-generated, group, seat)
    for grp in c.groups:
        if grp is tail:
            continue
        on = np.flatnonzero((grp.row >= 0) & ~grp.fresh & (grp.gen >= c.mode.tail_age))
        cands.extend((-int(grp.gen[s]), grp.gid, int(s)) for s in on)
    for _, g, s in sorted(cands)[:room]:
        _ship(c, c.groups[g], s, tail, -1, now, "tail")


def rebalance(c: "EPCluster", now: float) -> None:
    if c.tail_group is not None:
        _fill_tail_group(c, now)
    for grp in c.groups:
        if grp.active() > 1:
            _balance_ranks(c, grp, now)
    if c.next_batch >= c.num_batches:  # every row bound: the tail spreads between groups
        _feed_short_groups(c, now)
        if c.mode.name == "migrate-repartition":
            for grp in c.groups:
                _repartition(c, grp, now)
