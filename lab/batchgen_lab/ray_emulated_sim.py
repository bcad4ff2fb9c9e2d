"""The simulator's BCT for the configuration `ray_emulated.py` runs through Ray: the same coarse
cost model and lengths, actors, seats, token budget, straggler factors per actor, placement
thresholds and coordinator period (in modelled seconds).

Three simulator numbers per arm:
* `sim`: the arm as the connector runs it: Ray's task dispatch (sim/modes.py, rules 1-5) with
  the arm's concurrent calls and tasks in flight, and the arm's coordinator with the
  connector's report-to-report delays (`ModeConfig.mailbox`); this is the figure the Ray run
  must agree with (the 10% rule);
* `sim_credited`: the simulator mode the arm stands for, with its row-level window (what the
  simulator's headline credits that feeding with);
* `sim_slots`: the simulator's `static` mode with the connector's slots and no coordinator.
Plus `sim_home_last`: per actor, when the last row it received finished (Ray measures the same:
each actor's last yield), and `sim_bind_floor`: the `sim` run's critical path from its binding
(each row's batch bound, then the row alone on an idle engine; the longest such chain).
"""
from __future__ import annotations

import argparse
import math
from typing import Any, Sequence

from batchgen_data.placement import PlacementConfig
from batchgen_lab.sim import EngineShape, compare
from batchgen_lab.sim.costmodel import CostModel
from batchgen_lab.sim.workload import Workload

# ray_emulated arm -> simulator mode
SIM_MODES = {"tuned": "static-tuned", "stream": "continuous", "late": "late-bind",
             "migrate": "migrate"}
AGREEMENT = 0.10  # issue 21: the simulator agrees with Ray within 10% BCT


def sim_bcts(wl: Workload, args: argparse.Namespace, cost: CostModel,
             factors: Sequence[float], slots: dict[str, tuple[int, int | None]],
             placement: dict[str, Any], start_at: Sequence[float] | None = None,
             arms: Sequence[str] | None = None,
             plan: Sequence[Sequence[int]] | None = None,
             keep: bool = False) -> dict[str, dict[str, Any]]:
    """{arm: {"sim", "sim_credited", "sim_slots", "sim_home_last"}}; `slots`: arm -> (concurrent
    batches, tasks in flight) as the connector runs it; `start_at`: per actor, when it could
    first take work (None: all at 0); `arms`: default, those of `args.arms`; `plan`: replay
    the batches each actor ran in a Ray run (`sim` and `sim_slots` only; `sim_credited` has no
    tasks to replay); `keep`: each arm's `sim` run itself under "result" (its `SimResult`)."""
    shape = EngineShape(args.max_num_seqs, args.max_num_batched_tokens, block_size=16)
    arms = list(arms or args.arms.split(","))
    common: dict[str, Any] = dict(slowdown=list(factors), start_at=start_at,
                                  batch_size=args.batch_size,
                  tick_s=args.interval / args.scale,
                  placement=PlacementConfig(queue_depth=args.batch_size, **placement))
    credited = compare(wl, args.actors, cost, shape,
                       modes=tuple(SIM_MODES[a] for a in arms), **common)
    out: dict[str, dict[str, Any]] = {}
    for arm in arms:
        calls, in_flight = slots[arm]
        feed = dict(max_concurrent_batches=calls, max_tasks_in_flight=in_flight, plan=plan,
                    **common)
        ray_like = compare(wl, args.actors, cost, shape, modes=(SIM_MODES[arm],),
                           ray_tasks=True, window_calls=calls, mailbox=True,
                           **feed)[SIM_MODES[arm]]
        no_moves = compare(wl, args.actors, cost, shape, modes=("static",), **feed)["static"]
        out[arm] = {"sim": ray_like.bct_s, "sim_credited": credited[SIM_MODES[arm]].bct_s,
                    "sim_slots": no_moves.bct_s,
                    # the critical path this run's binding set: no schedule of the rows as
                    # bound finishes before max(a row's input batch bound + its solo time)
                    "sim_bind_floor": ray_like.tail_floor_s,
                    "sim_home_last": [None if math.isnan(t) else round(t, 2)
                                      for t in ray_like.home_last_s]}
        if keep:
            out[arm]["result"] = ray_like
    return out


def measured_start(first_call: Sequence[float | None], gap_s: float) -> list[float]:
    """Start-up as a Ray run had it, in modelled s after the barrier. Ray's pool notices its
    actors alive in waves and dispatches to each wave at once; an actor's first call lags its
    wave by the time Ray takes to submit the tasks before it, so first calls less than `gap_s`
    apart are one wave, up at the wave's first call. An actor that never got a task came up
    after all were bound: the last wave stands in for it."""
    known = sorted(t for t in first_call if t is not None)
    if not known:
        return [0.0] * len(first_call)
    wave_of: dict[float, float] = {}
    start = prev = known[0]
    for t in known:
        if t - prev > gap_s:
            start = t
        wave_of[t], prev = start, t
    return [max(0.0, wave_of[t] if t is not None else start) for t in first_call]


def agreement(ray_s: float | None, sim_s: float | None) -> str | None:
    """PASS when Ray's BCT is within `AGREEMENT` of the simulator's, else FAIL."""
    if ray_s is None or not sim_s:
        return None
    return "PASS" if abs(ray_s / sim_s - 1.0) <= AGREEMENT else "FAIL"


def per_actor_gap(ray_last: Sequence[float | None], sim_last: Sequence[float | None],
                  by_rank: bool = True) -> float | None:
    """How far apart the two runs' per-actor finish times are: the largest relative gap, Ray
    over simulator, between actor i of each (`by_rank=False`: a replay, where actor i ran the
    same batches in both) or between the i-th earliest finishes (which actor Ray gives which
    batches depends on the order its actors come up)."""
    pairs = [(a, b) for a, b in zip(ray_last, sim_last) if a is not None and b is not None]
    if by_rank:
        r = sorted(t for t in ray_last if t is not None)
        s = sorted(t for t in sim_last if t is not None)
        if len(r) != len(s):
            return None
        pairs = list(zip(r, s))
    gaps = [abs(a / b - 1.0) for a, b in pairs if b]
    return round(max(gaps), 3) if gaps else None
