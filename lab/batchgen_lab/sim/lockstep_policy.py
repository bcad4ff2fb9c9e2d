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
* `+early` (lockstep_tiers.py): any group, at any time, re-partitions to the width the model
  says steps fastest for what it holds (wider or back to narrower).
* `+pin`: a sequence that moved between groups may not move between groups again for
  `EPMode.pin_s`: without it the oldest sequences ping-pong between short groups every tick,
  each hop costing a KV transfer and the steps missed while it is in flight.
* `+tiers` (lockstep_tiers.py): more light groups as the job drains.
A moved sequence's KV travels at `EPPreset.link_bytes_per_s`; until it lands it makes no
progress. A re-partition pauses the group for `reshard_s` plus the time to lay the sequences'
KV out on their new ranks. A result still returns through the group that received the row.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from batchgen_lab.sim.lockstep import Group
    from batchgen_lab.sim.lockstep_run import EPCluster

MAX_RANK_MOVES = 8  # per group per tick
MAX_GROUP_MOVES = 64  # per receiver per tick
SLOWER = 1.25  # a donor's step must be this much slower than the receiver's


def _ship(c: "EPCluster", grp: "Group", s: int, dst: "Group", rank: int, now: float,
          kind: str) -> None:
    row, ctx, left, gen = grp.take(s)
    ready = max(now, grp.busy_until) + ctx * c.p.kv_bytes_per_token / c.p.link_bytes_per_s
    dst.arrivals.append((ready, row, ctx, left, gen, rank))
    if kind != "rank":
        c.moved_at[row] = now
    if c.trace:
        c.trace.ship(row, now, ready, kind != "rank")
    c.moved[kind] += 1
    c._wake(dst.gid, ready)


def movable(c: "EPCluster", grp: "Group", seats: np.ndarray, now: float) -> np.ndarray:
    """The seats whose sequences may move between groups now (+pin: not moved lately)."""
    if not c.mode.has("pin"):
        return seats
    return seats[now - c.moved_at[grp.row[seats]] >= c.mode.pin_s]


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
    short = sorted((i for i, g in enumerate(c.groups) if i not in c.light_set
                    and active[i] < c.mode.starve_fraction * cap and not c._has_queued(g)),
                   key=lambda i: (times[i], i))
    tiers = c.mode.has("tiers")  # light groups keep the oldest: they are no donors
    gave: set[int] = set()
    for dst in short:
        donors = [i for i in range(len(c.groups)) if i != dst and i not in gave
                  and active[i] > 0 and not (tiers and i in c.light_set)]
        if not donors:
            return
        src = max(donors, key=lambda i: (times[i], i))
        if times[src] <= SLOWER * max(times[dst], 1e-9) and active[dst]:
            continue
        grp = c.groups[src]
        on = movable(c, grp, np.flatnonzero((grp.row >= 0) & ~grp.fresh
                                            & (grp.gen >= c.mode.min_age)), now)
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
        reshard(c, grp, best_tp, now)


def reshard(c: "EPCluster", grp: "Group", tp: int, now: float) -> None:
    """Re-partition `grp` into ranks `tp` wide: a pause for the communicators and graphs, and
    for every rank to receive its sequences' KV (each GPU of a rank holds the rank's KV)."""
    old_tp = grp.tp
    grp.repack(tp)
    kv = grp.loads()[2]
    pause = c.p.reshard_pause(old_tp, tp, float(kv.max()))
    grp.busy_until = max(now, grp.busy_until) + pause
    c.reshards += 1
    if c.trace:
        c.trace.reshard_s += pause


def _fill_light(c: "EPCluster", now: float) -> None:
    """The oldest sequences of the other groups move into the light groups' room (the tail
    group's, and with +tiers the others'), oldest first, the first light group first."""
    rooms = [(g, min(MAX_GROUP_MOVES, c.mode.tail_seats - c.groups[g].active()
                     - len(c.groups[g].arrivals))) for g in c.light]
    total = sum(max(0, r) for _, r in rooms)
    if total <= 0:
        return
    cands: list[tuple[int, int, int]] = []  # (-generated, group, seat)
    for grp in c.groups:
        if grp.gid in c.light_set:
            continue
        on = movable(c, grp, np.flatnonzero((grp.row >= 0) & ~grp.fresh
                                            & (grp.gen >= c.mode.tail_age)), now)
        cands.extend((-int(grp.gen[s]), grp.gid, int(s)) for s in on)
    picked = iter(sorted(cands)[:total])
    for dst, room in rooms:
        for _ in range(max(0, room)):
            nxt = next(picked, None)
            if nxt is None:
                return
            _ship(c, c.groups[nxt[1]], nxt[2], c.groups[dst], -1, now, "tail")


def rebalance(c: "EPCluster", now: float) -> None:
    from batchgen_lab.sim.lockstep_tiers import repartition_early, update_light

    if c.mode.has("tiers") and c.tail_group is not None:
        update_light(c, now)
    if c.light:
        _fill_light(c, now)
    for grp in c.groups:
        if grp.active() > 1:
            _balance_ranks(c, grp, now)
    if c.next_batch >= c.num_batches:  # every row bound: the tail spreads between groups
        _feed_short_groups(c, now)
    if c.mode.has("early"):
        for grp in c.groups:
            repartition_early(c, grp, now)
    elif c.mode.base == "migrate-repartition" and c.next_batch >= c.num_batches:
        for grp in c.groups:
            _repartition(c, grp, now)
