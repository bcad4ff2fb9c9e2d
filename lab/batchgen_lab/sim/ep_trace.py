"""Where an expert-parallel lockstep run loses time against the work bound (`--diagnose`).

Every group step's wall time is split, exactly, into four parts (group-seconds):

* `ideal`: the step's work (decode tokens, prefill tokens, KV reads) at the work bound's cost
  per unit on un-slowed GPUs (`ep_bounds`): what the step would cost in a perfectly balanced,
  always-full cluster;
* `straggler`: what the group's slow GPUs add (its ranks' own work and the routed experts, which
  wait for the group's slowest GPU);
* `lockstep`: the slowest rank's time above the mean rank's: unequal ranks and dummy steps;
* `underfill`: the rest: fixed per-step costs (weights, expert streaming, all-to-all latency)
  spread over fewer sequences than the seats, prefill-heavy steps, the TP all-reduce.

Steps are grouped into phases: `ramp` (before the group first holds 95% of the most it ever
holds), `steady` (after that, while rows remain that no group has taken) and `tail` (every row
taken). `idle` is the time groups spent with nothing to step before the last row finished,
`reshard` the re-partition pauses. The row that finished last is followed through its life: when
it was bound, when it first ran, each group it ran in (steps, mean step time, mean sequences in
the group) and how long its KV was in transit.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np

from batchgen_lab.sim.ep_bounds import group_unit_costs
from batchgen_lab.sim.ep_preset import EPPreset

PARTS = ("ideal", "straggler", "lockstep", "underfill")
FILL = (0, 16, 64, 1024)  # buckets of the sequences a group holds, for the last row's life


class EPTrace:
    def __init__(self, p: EPPreset, groups: int) -> None:
        self.p = p
        self.groups = groups
        self.unit = group_unit_costs(p, np.ones(p.group_gpus))  # [3] decode, prefill, KV read
        # (group, start, dt, steps, sequences, rows unbound, ideal, straggler, lockstep, underfill)
        self.steps: list[tuple[float, ...]] = []
        self.seated: dict[int, list[tuple[float, int]]] = defaultdict(list)
        self.transit: dict[int, float] = defaultdict(float)
        self.group_moves: dict[int, list[float]] = defaultdict(list)  # when each row left a group
        self.bound_at: dict[int, float] = {}
        self.reshard_s = 0.0

    def bind(self, rows: range, t: float) -> None:
        for r in rows:
            self.bound_at[r] = t

    def seat(self, row: int, gid: int, t: float) -> None:
        self.seated[row].append((t, gid))

    def ship(self, row: int, t: float, ready: float, between_groups: bool) -> None:
        self.transit[row] += ready - t
        if between_groups:
            self.group_moves[row].append(t)

    def step(self, gid: int, t: float, dt: float, active: int, unbound: bool, b: np.ndarray,
             new: np.ndarray, kv: np.ndarray, f: np.ndarray, tp: int, k: int) -> None:
        """One run of k identical-shape steps (KV growing by b a rank a step), dt long in all."""
        p = self.p
        j = np.arange(k)[:, None]
        ranks = p.rank_times(b, new, kv + j * b, f, tp)  # [k, ranks]
        ranks_f1 = ranks / f
        n, mx = float(new.sum()), float(new.max())
        shared = p.shared_time(n, mx, float(f.max()), tp)
        shared_f1 = p.shared_time(n, mx, 1.0, tp)
        work = np.array([k * b.sum(), float((new - b).sum()), float((kv.sum() * k
                                                                     + b.sum() * k * (k - 1) / 2))])
        ideal = float(work @ self.unit)
        straggler = float(ranks.mean(axis=1).sum() - ranks_f1.mean(axis=1).sum()) + k * (
            shared - shared_f1)
        lockstep = float((ranks.max(axis=1) - ranks.mean(axis=1)).sum())
        underfill = dt - ideal - straggler - lockstep
        self.steps.append((gid, t, dt, k, active, float(unbound), ideal, straggler, lockstep,
                           underfill))

    def report(self, finish: np.ndarray) -> dict[str, Any]:
        bct = float(np.max(finish))
        rec = np.array(self.steps)  # [runs, 10]
        gid, t, dt, k, active = rec[:, 0].astype(int), rec[:, 1], rec[:, 2], rec[:, 3], rec[:, 4]
        unbound = rec[:, 5] > 0
        phase = np.where(unbound, 1, 2)  # 0 ramp, 1 steady, 2 tail
        for g in range(self.groups):
            mine = np.flatnonzero(gid == g)
            if len(mine):
                full = mine[active[mine] >= 0.95 * active[mine].max()]
                phase[mine[mine < full[0]]] = 0
        out: dict[str, Any] = {"bct_s": round(bct, 3)}
        for i, name in enumerate(("ramp", "steady", "tail")):
            sel = phase == i
            out[name] = {"group_s": round(float(dt[sel].sum()), 1),
                         "span_s": [round(float(t[sel].min()), 1) if sel.any() else None,
                                    round(float((t + dt)[sel].max()), 1) if sel.any() else None],
                         **{part: round(float(rec[sel, 6 + m].sum()), 1)
                            for m, part in enumerate(PARTS)}}
        out["idle_group_s"] = round(self.groups * bct - float(dt.sum()) - self.reshard_s, 1)
        out["reshard_group_s"] = round(self.reshard_s, 1)
        out["last_row"] = self._follow(int(np.argmax(finish)), bct, gid, t, dt, k, active)
        return out

    def _follow(self, row: int, end: float, gid: np.ndarray, t: np.ndarray, dt: np.ndarray,
                k: np.ndarray, active: np.ndarray) -> dict[str, Any]:
        seg = self.seated[row]
        stays = []
        by_fill = np.zeros((len(FILL), 2))  # [bucket] (seconds, steps)
        for i, (t0, g) in enumerate(seg):
            t1 = seg[i + 1][0] if i + 1 < len(seg) else end
            sel = (gid == g) & (t >= t0) & (t < t1)
            if not sel.any():
                continue
            bucket = np.searchsorted(FILL, active[sel], side="right") - 1
            np.add.at(by_fill[:, 0], bucket, dt[sel])
            np.add.at(by_fill[:, 1], bucket, k[sel])
            w = dt[sel] / dt[sel].sum()  # sequences in the group, weighted by time
            stays.append({"group": g, "from_s": round(t0, 1), "to_s": round(t1, 1),
                          "steps": int(k[sel].sum()),
                          "mean_step_ms": round(1e3 * float(dt[sel].sum() / k[sel].sum()), 2),
                          "mean_seqs_in_group": round(float(w @ active[sel]), 1)})
        fill = {f">={lo}": {"s": round(float(x[0]), 1), "steps": int(x[1]),
                            "mean_step_ms": round(1e3 * float(x[0] / x[1]), 2) if x[1] else None}
                for lo, x in zip(FILL, by_fill)}
        return {"row": row, "bound_s": round(self.bound_at.get(row, 0.0), 1),
                "first_step_s": round(seg[0][0], 1) if seg else None,
                "finish_s": round(end, 1), "kv_transit_s": round(self.transit[row], 2),
                "hops": max(0, len(seg) - 1), "by_group_fill": fill,
                # the first and last stays; a row that hops every tick has hundreds
                "stays": stays if len(stays) <= 8 else stays[:5] + stays[-3:]}
