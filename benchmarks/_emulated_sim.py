"""The simulator's BCT for the configuration `ray_emulated.py` runs through Ray (same coarse
cost model, lengths, actors, seats, stragglers, coordinator period), one per arm."""
from __future__ import annotations

import argparse
import math

from batchgen_data.placement import PlacementConfig
from batchgen_data.sim import EngineShape, compare
from batchgen_data.sim.costmodel import CostModel
from batchgen_data.sim.workload import Workload

# ray_emulated arm -> simulator mode
SIM_MODES = {"tuned": "static", "stream": "continuous", "migrate": "migrate"}


def sim_bcts(wl: Workload, args: argparse.Namespace, cost: CostModel, num_slow: int,
             slowdown: float, seed: int) -> dict[str, float]:
    from ray_emulated import placement

    if num_slow:
        return {}  # this simulator has no stragglers
    shape = EngineShape(args.max_num_seqs, args.max_num_batched_tokens, block_size=16)
    arms = [a for a in args.arms.split(",") if a in SIM_MODES]
    res = compare(wl, args.actors, cost, shape, modes=tuple(SIM_MODES[a] for a in arms),
                  batch_size=args.batch_size,
                  max_concurrent_batches=math.ceil(args.max_num_seqs / args.batch_size),
                  tick_s=args.interval / args.scale,
                  placement=PlacementConfig(queue_depth=args.batch_size, **placement(args)))
    return {a: round(res[SIM_MODES[a]].bct_s, 1) for a in arms}
