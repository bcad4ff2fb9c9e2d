"""The simulator's BCT for the configuration `ray_emulated.py` runs through Ray: the same coarse
cost model and lengths, actors, seats, token budget, straggler factors per actor, placement
thresholds and coordinator period (in modelled seconds).

Two simulator numbers per arm:
* `sim`: the simulator mode the arm stands for (what the simulator credits that feeding with);
* `sim_slots`: the simulator's `static` mode with the connector's actual slots (one Ray task per
  input batch, held until the batch's slowest row ends; `window_batches` slots, the in-flight
  queue Ray gets): how the connector's streaming arms feed their engines, with no moves.
"""
from __future__ import annotations

import argparse
from typing import Any, Sequence

from batchgen_data.placement import PlacementConfig
from batchgen_data.sim import EngineShape, compare
from batchgen_data.sim.costmodel import CostModel
from batchgen_data.sim.workload import Workload

# ray_emulated arm -> simulator mode
SIM_MODES = {"tuned": "static-tuned", "stream": "continuous", "late": "late-bind",
             "migrate": "migrate"}


def sim_bcts(wl: Workload, args: argparse.Namespace, cost: CostModel,
             factors: Sequence[float], slots: dict[str, tuple[int, int | None]],
             placement: dict[str, Any]) -> dict[str, dict[str, float]]:
    """{arm: {"sim": s, "sim_slots": s}}; `slots`: arm -> (concurrent batches, tasks in
    flight) as the connector runs it."""
    from batchgen_data.sim.result import SimResult

    shape = EngineShape(args.max_num_seqs, args.max_num_batched_tokens, block_size=16)
    arms = args.arms.split(",")
    common = dict(slowdown=list(factors), batch_size=args.batch_size,
                  tick_s=args.interval / args.scale,
                  placement=PlacementConfig(queue_depth=args.batch_size, **placement))
    credited: dict[str, SimResult] = compare(wl, args.actors, cost, shape,
                                             modes=tuple(SIM_MODES[a] for a in arms), **common)
    out = {a: {"sim": credited[SIM_MODES[a]].bct_s} for a in arms}
    for arm in arms:
        calls, in_flight = slots[arm]
        res = compare(wl, args.actors, cost, shape, modes=("static",),
                      max_concurrent_batches=calls, max_tasks_in_flight=in_flight, **common)
        out[arm]["sim_slots"] = res["static"].bct_s
    return out
