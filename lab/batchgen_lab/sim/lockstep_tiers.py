"""Two remedies for the lockstep cluster's long tail: light tiers of groups, early re-partition.

* `+tiers`: a group holds at most `seats_per_rank x group_gpus` sequences, so once the rows not
  yet finished (running, in flight, or not yet bound) no longer fill every group, keeping them
  spread over all groups only makes every step slower for the oldest sequences. Each tick the
  number of light groups is set to the groups the remaining rows leave over (never fewer than
  the one tail group, never all): groups turn light one by one, fastest slowest GPU first, and
  stay light. A light group binds no new rows, hands its rows that have not started to the
  full group with the most free seats (no KV yet), sheds its youngest running sequences to full
  groups beyond `EPMode.tail_seats` (their KV is short: cheap moves), and takes the cluster's
  oldest sequences (lockstep_policy._fill_light). Age is the only signal used.
* `+early`: `migrate-repartition` re-partitions a group only once every row is bound and only
  when it holds at most half as many sequences as ranks. Here any group, at any time, takes the
  width (DP16, DP8 x TP2, DP4 x TP4, DP2 x TP8) that the step-time model says is fastest for
  the sequences it holds (and its queued rows), if that is 5% faster than now, the seats fit
  them, and the steps saved over the next `PAYBACK_S` seconds pay for the pause: wider as a
  light group empties, narrower again if it fills. Each change pays `lockstep_policy.reshard`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from batchgen_lab.sim.lockstep_policy import MAX_GROUP_MOVES, _ship, reshard

if TYPE_CHECKING:
    from batchgen_lab.sim.lockstep import Group
    from batchgen_lab.sim.lockstep_run import EPCluster

GAIN = 0.95  # a re-partition must make the step this much shorter
PAYBACK_S = 20.0  # ... and win back its pause within this many seconds of steps


def update_light(c: "EPCluster", now: float) -> None:
    p = c.p
    remaining = c.wl.num_rows - c.done
    full = -(-remaining // (p.group_gpus * p.seats_per_rank))
    want = min(len(c.groups) - 1, max(1, len(c.groups) - max(1, full)))
    order = sorted(range(len(c.groups)), key=lambda g: (c.groups[g].gpu_f.max(), g))
    for g in order:
        if len(c.light) >= want:
            break
        if g not in c.light_set:
            c.light.append(g)
            c.light_set.add(g)
    _shed(c, now)


def _shed(c: "EPCluster", now: float) -> None:
    bulk = [g for g in c.groups if g.gid not in c.light_set]
    free = {g.gid: int(g.free_seats().sum()) - len(g.arrivals) - len(g.shared) for g in bulk}
    for gid in c.light:
        grp = c.groups[gid]
        while grp.shared:  # not started: only the row moves
            dst = max(free, key=lambda g: (free[g], -g))
            c.groups[dst].shared.append(grp.shared.popleft())
            free[dst] -= 1
            c._wake(dst, now)
        extra = grp.active() + len(grp.arrivals) - c.mode.tail_seats
        if extra <= 0:
            continue
        on = np.flatnonzero((grp.row >= 0) & ~grp.fresh)
        for s in on[np.argsort(grp.gen[on], kind="stable")][:min(extra, MAX_GROUP_MOVES)]:
            dst = max(free, key=lambda g: (free[g], -g))
            if free[dst] <= 0:
                return
            _ship(c, grp, int(s), c.groups[dst], -1, now, "shed")
            free[dst] -= 1


def _model_step(c: "EPCluster", grp: "Group", tp: int, ctx: np.ndarray) -> float:
    """The step time `grp` would have at width tp with these sequences spread round-robin."""
    r = c.p.group_gpus // tp
    rank = np.arange(len(ctx)) % r
    b = np.bincount(rank, minlength=r).astype(np.float64)
    kv = np.bincount(rank, weights=ctx, minlength=r)
    return c.p.step_time(b, b, kv, grp.gpu_f.reshape(r, tp).max(axis=1), tp)


def repartition_early(c: "EPCluster", grp: "Group", now: float) -> None:
    n = grp.active() + len(grp.arrivals) + len(grp.shared)  # queued rows need seats too
    if n == 0 or any(grp.queues):
        return
    ctx = np.concatenate([grp.ctx[grp.row >= 0], [a[2] for a in grp.arrivals]]).astype(
        np.float64)
    ctx = np.sort(ctx)[::-1]
    now_t = _model_step(c, grp, grp.tp, ctx)
    best_tp, best_t = grp.tp, now_t
    for tp in (1, 2, 4, 8):
        if tp != grp.tp and n <= (c.p.group_gpus // tp) * c.p.seats_per_rank:
            t = _model_step(c, grp, tp, ctx)
            if t < best_t:
                best_tp, best_t = tp, t
    if best_tp == grp.tp or best_t >= GAIN * now_t:
        return
    # the pause: fixed, plus the busiest new rank's KV (ctx spread round-robin, as repack does)
    kv = np.bincount(np.arange(len(ctx)) % (c.p.group_gpus // best_tp), weights=ctx)
    pause = c.p.reshard_pause(grp.tp, best_tp, float(kv.max()))
    if (now_t - best_t) / best_t * PAYBACK_S >= pause:
        reshard(c, grp, best_tp, now)
