"""Cluster simulator: the real scheduler and placement policy, a cost model instead of the GPU.

Each simulated actor runs the engine's own `Scheduler` over a real `BlockPool` and host tier;
the model runner is replaced by a step-time cost model (`costmodel.py`) and sampling by "stop at
the row's output length". The cluster compares ways of feeding actors that all get the same engine (`modes.py`):
ray.data.llm's static batches with its defaults and tuned as Ray's warning asks, streaming,
streaming with row-level late binding, and late binding plus the placement policy of
`batchgen_data.placement` moving started sequences. Stragglers, start-up skew and several seeds
are part of an experiment (`scenario.py`).

    python -m batchgen_lab.sim --actors 16 --rows 20000 --stragglers 0.125:1.5 --seeds 5 --json
"""
from __future__ import annotations

import multiprocessing
import sys
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from batchgen_lab.sim.actor import EngineShape
from batchgen_lab.sim.cluster import Cluster
from batchgen_lab.sim.costmodel import DEFAULT_PRESET, PRESETS, CostModel, get_preset
from batchgen_lab.sim.modes import MODES, ModeConfig, mode_config
from batchgen_lab.sim.result import SimResult
from batchgen_lab.sim.workload import Workload, make_workload


def simulate(wl: Workload, actors: int, cost: CostModel, mode: ModeConfig,
             shape: EngineShape | None = None, slowdown: Sequence[float] | None = None,
             start_at: Sequence[float] | None = None,
             plan: Sequence[Sequence[int]] | None = None) -> SimResult:
    """Run one mode to completion; without `shape`, the preset's vLLM-default engine shape.
    `slowdown` / `start_at` / `plan`: per-actor step-time factors, start times and replayed
    input batches (see `Cluster`)."""
    return Cluster(wl, actors, cost, shape or EngineShape.for_cost(cost), mode,
                   slowdown, start_at, plan).run()


def compare(wl: Workload, actors: int, cost: CostModel, shape: EngineShape | None = None,
            modes: tuple[str, ...] = MODES, jobs: int = 1,
            slowdown: Sequence[float] | None = None, start_at: Sequence[float] | None = None,
            plan: Sequence[Sequence[int]] | None = None,
            **mode_kwargs: Any) -> dict[str, SimResult]:
    """Run each mode on the same workload and cluster, `jobs` of them at once in worker
    processes; `mode_kwargs` go to `mode_config`; without `shape`, the preset's vLLM-default
    engine shape. Every mode gets the same engine shape, stragglers and start-up delays."""
    shape = shape or EngineShape.for_cost(cost)
    args = [(wl, actors, cost, mode_config(m, shape.max_num_seqs, **mode_kwargs), shape,
             slowdown, start_at, plan) for m in modes]
    if jobs <= 1 or len(modes) <= 1:
        return {m: simulate(*a) for m, a in zip(modes, args)}
    ctx = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
    with ProcessPoolExecutor(min(jobs, len(modes)), mp_context=ctx) as pool:
        futures = [pool.submit(simulate, *a) for a in args]
        return {m: f.result() for m, f in zip(modes, futures)}


# after `compare`, which scenario.py imports from this package
from batchgen_lab.sim.scenario import SimConfig, evaluate  # noqa: E402

__all__ = ["Cluster", "CostModel", "DEFAULT_PRESET", "EngineShape", "MODES", "ModeConfig",
           "PRESETS", "SimConfig", "SimResult", "Workload", "compare", "evaluate", "get_preset",
           "make_workload", "mode_config", "simulate"]
