"""One simulated experiment as a value: cluster, engine, workload, seeds, stragglers, skew.

`evaluate(SimConfig(...))` runs every mode on every seed and returns the report the command
line prints with `--json`: per-mode BCT (median over seeds, spread, per seed), the ratios to
`static-tuned` and `continuous` (median over seeds of the per-seed ratio), and the packing
bound. Each seed draws its own workload, its own stragglers and its own start-up delays, and
every mode of that seed sees exactly the same ones, so a ratio compares schedules, not luck.

The helpers `straggler_factors` and `startup_delays` are public so that an emulated Ray run
(`lab/batchgen_lab/ray_emulated.py`) can build the very same cluster for a seed.
"""
from __future__ import annotations

import multiprocessing
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, Callable

import numpy as np

from batchgen_lab.sim import compare
from batchgen_lab.sim.actor import EngineShape
from batchgen_lab.sim.costmodel import DEFAULT_PRESET, CostModel, get_preset
from batchgen_lab.sim.ep_preset import EP_PRESETS, EPPreset
from batchgen_lab.sim.ep_bounds import packing_floor_s, work_bound_s
from batchgen_lab.sim.lockstep import EP_MODES, EPMode, EPResult
from batchgen_lab.sim.lockstep_run import EPCluster
from batchgen_lab.sim.modes import MODES, mode_config
from batchgen_lab.sim.result import solo_times
from batchgen_lab.sim.workload import Workload, make_workload


def parse_stragglers(spec: str | None) -> tuple[float, float]:
    """"FRAC:FACTOR" (e.g. "0.125:1.5": an eighth of the actors 1.5x slower) -> (frac, factor)."""
    if not spec:
        return 0.0, 1.0
    try:
        frac_s, factor_s = spec.split(":")
        frac, factor = float(frac_s), float(factor_s)
    except ValueError:
        raise ValueError(f"stragglers={spec!r}: expected FRAC:FACTOR, e.g. 0.125:1.5") from None
    if not 0.0 <= frac <= 1.0 or factor <= 0:
        raise ValueError(f"stragglers={spec!r}: FRAC must be in [0, 1] and FACTOR > 0")
    return frac, factor


def straggler_factors(actors: int, frac: float, factor: float, seed: int) -> list[float]:
    """Step-time factor per actor: round(frac x actors) of them, drawn by `seed`, get `factor`."""
    k = int(round(frac * actors))
    slow = np.random.default_rng([seed, 1]).choice(actors, size=k, replace=False)
    out = [1.0] * actors
    for i in slow.tolist():
        out[i] = factor
    return out


def startup_delays(actors: int, skew_s: float, seed: int) -> list[float]:
    """Seconds each actor takes to start (load its model): uniform in [0, skew_s]."""
    if skew_s < 0:
        raise ValueError(f"startup_skew_s={skew_s!r}: must be >= 0")
    if skew_s == 0:
        return [0.0] * actors
    return np.random.default_rng([seed, 2]).uniform(0.0, skew_s, actors).tolist()


def _ep_mode_ok(name: str) -> bool:
    try:
        EPMode(name)
    except ValueError:
        return False
    return True


@dataclass(frozen=True, slots=True)
class SimConfig:
    actors: int
    rows: int
    workload: str = "reasoning"
    seed: int = 0  # the first seed; seeds seed .. seed + seeds - 1 run
    seeds: int = 1
    modes: tuple[str, ...] = MODES
    preset: str = DEFAULT_PRESET  # a preset name or a calibrate .json file
    overlap: bool = False  # roofline step time
    max_num_seqs: int | None = None  # None: the preset's vLLM default
    max_num_batched_tokens: int | None = None
    max_finishes: int | None = None
    batch_size: int = 32
    max_concurrent_batches: int = 8  # `static`; `static-tuned` raises it to fill the seats
    max_tasks_in_flight: int | None = None
    ray_tasks: bool = False  # streaming modes fed by Ray tasks, as the connector does
    tick_s: float = 0.25
    stragglers: str | None = None  # "FRAC:FACTOR"
    startup_skew_s: float = 0.0
    order: str = "random"  # or "longest-first" (an oracle)

    def __post_init__(self) -> None:
        if self.seeds < 1:
            raise ValueError(f"seeds={self.seeds!r}: must be >= 1")
        if self.order not in ("random", "longest-first"):
            raise ValueError(f"order={self.order!r}: must be 'random' or 'longest-first'")
        valid = EP_MODES if self.expert_parallel else MODES
        bad = [m for m in self.modes if m not in valid]
        if self.expert_parallel:  # migrate modes may add remedies: "migrate+pin"
            bad = [m for m in bad if not _ep_mode_ok(m)]
        if bad or not self.modes:
            raise ValueError(f"modes={self.modes!r}: valid: {valid}")
        parse_stragglers(self.stragglers)
        if self.expert_parallel and self.startup_skew_s:
            raise ValueError("startup_skew_s: not modelled for expert-parallel presets")

    @property
    def expert_parallel(self) -> bool:
        """An expert-parallel MoE preset: `actors` counts GPUs, cut into lockstep groups."""
        return self.preset in EP_PRESETS

    def ep_mode(self, name: str) -> EPMode:
        """An expert-parallel mode as this configuration runs it."""
        return EPMode(name, tick_s=self.tick_s)

    def cost(self) -> CostModel:
        cost = get_preset(self.preset)
        return replace(cost, name=cost.name + "+overlap", overlap=True) if self.overlap else cost

    def shape(self, cost: CostModel) -> EngineShape:
        return EngineShape.for_cost(cost, self.max_num_seqs, self.max_num_batched_tokens,
                                    max_finishes=self.max_finishes)

    def workload_for(self, seed: int) -> Workload:
        wl = make_workload(self.workload, self.rows, seed)
        return wl.longest_first() if self.order == "longest-first" else wl


def run_seed(cfg: SimConfig, seed: int, jobs: int = 1) -> tuple[dict[str, Any], float]:
    """Every mode on one seed's workload and cluster; also that seed's packing bound (s)."""
    if cfg.expert_parallel:
        return run_seed_ep(cfg, seed, jobs)
    cost = cfg.cost()
    wl = cfg.workload_for(seed)
    frac, factor = parse_stragglers(cfg.stragglers)
    slowdown = straggler_factors(cfg.actors, frac, factor, seed)
    start_at = startup_delays(cfg.actors, cfg.startup_skew_s, seed)
    results = compare(wl, cfg.actors, cost, cfg.shape(cost), cfg.modes, jobs=jobs,
                      slowdown=slowdown, start_at=start_at, batch_size=cfg.batch_size,
                      max_concurrent_batches=cfg.max_concurrent_batches, tick_s=cfg.tick_s,
                      max_tasks_in_flight=cfg.max_tasks_in_flight, ray_tasks=cfg.ray_tasks)
    # no schedule splits a row across engines: the longest row alone on the fastest actor,
    # started when the first actor is up, is a floor for every mode
    bound = min(start_at) + float(np.max(solo_times(wl, cost)))
    return results, bound


def _ep_one(wl: Workload, gpus: int, preset: str, mode: EPMode,
            factors: list[float]) -> EPResult:
    return EPCluster(wl, gpus, EP_PRESETS[preset], mode, factors).run()


def run_seed_ep(cfg: SimConfig, seed: int, jobs: int = 1) -> tuple[dict[str, Any], float]:
    """The expert-parallel lockstep cluster (lockstep.py): `cfg.actors` GPUs, one seed."""
    wl = cfg.workload_for(seed)
    frac, factor = parse_stragglers(cfg.stragglers)
    factors = straggler_factors(cfg.actors, frac, factor, seed)
    args = [(wl, cfg.actors, cfg.preset, cfg.ep_mode(m), factors) for m in cfg.modes]
    if jobs <= 1 or len(args) <= 1:
        results = {m: _ep_one(*a) for m, a in zip(cfg.modes, args)}
    else:
        ctx = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
        with ProcessPoolExecutor(min(jobs, len(args)), mp_context=ctx) as pool:
            futs = [pool.submit(_ep_one, *a) for a in args]
            results = {m: f.result() for m, f in zip(cfg.modes, futs)}
    return results, ep_packing_bound(wl, EP_PRESETS[cfg.preset], factors)


def ep_packing_bound(wl: Workload, p: EPPreset,
                     gpu_factors: list[float] | None = None) -> float:
    """The packing floor of `ep_bounds` (the longest row alone in the fastest group)."""
    return packing_floor_s(wl, p, None if gpu_factors is None else np.asarray(gpu_factors))


def _median_ratio(bct: dict[str, list[float]], base: str) -> dict[str, float] | None:
    if base not in bct:
        return None
    return {m: round(statistics.median(v / b for v, b in zip(vals, bct[base])), 4)
            for m, vals in bct.items()}


def _over_seeds(cfg: SimConfig, run: Callable[[SimConfig, int, int], tuple[dict[str, Any], float]],
                jobs: int) -> tuple[list[int], dict[str, list[float]], list[float], dict[str, Any]]:
    """Every seed's run: the seeds, BCTs per mode, packing bounds, and the first seed's results."""
    seeds = list(range(cfg.seed, cfg.seed + cfg.seeds))
    bct: dict[str, list[float]] = {m: [] for m in cfg.modes}
    bounds: list[float] = []
    first: dict[str, Any] = {}
    for s in seeds:
        results, bound = run(cfg, s, jobs)
        first = first or results
        bounds.append(bound)
        for m, r in results.items():
            bct[m].append(r.bct_s)
    return seeds, bct, bounds, first


def _bct_summary(bct: dict[str, list[float]], bounds: list[float],
                 first: dict[str, Any]) -> dict[str, Any]:
    """The report keys both evaluations share: BCT per mode over seeds, ratios, packing bound."""
    return {
        "bct_s": {m: round(statistics.median(v), 3) for m, v in bct.items()},
        "bct_s_spread": {m: [round(min(v), 3), round(max(v), 3)] for m, v in bct.items()},
        "bct_s_by_seed": {m: [round(x, 3) for x in v] for m, v in bct.items()},
        "ratio_vs_tuned_static": _median_ratio(bct, "static-tuned"),
        "ratio_vs_continuous": _median_ratio(bct, "continuous"),
        "packing_bound_s": round(statistics.median(bounds), 3),
        "packing_bound_s_by_seed": [round(b, 3) for b in bounds],
        "modes": {m: r.summary() for m, r in first.items()},  # details of the first seed
    }


def evaluate(cfg: SimConfig, jobs: int = 1) -> dict[str, Any]:
    """Run the experiment; the report `python -m batchgen_lab.sim --json` prints."""
    if cfg.expert_parallel:
        return evaluate_ep(cfg, jobs)
    cost = cfg.cost()
    shape = cfg.shape(cost)
    seeds, bct, bounds, first = _over_seeds(cfg, run_seed, jobs)
    feeds = {m: mode_config(m, shape.max_num_seqs, cfg.batch_size, cfg.max_concurrent_batches,
                            max_tasks_in_flight=cfg.max_tasks_in_flight)
             for m in ("static", "static-tuned") if m in cfg.modes}
    return {
        "actors": cfg.actors, "rows": cfg.rows, "workload": cfg.workload, "seeds": seeds,
        "order": cfg.order, "preset": cost.name, "stragglers": cfg.stragglers,
        "startup_skew_s": cfg.startup_skew_s, "ray_tasks": cfg.ray_tasks,
        "engine": {"max_num_seqs": shape.max_num_seqs,
                   "max_num_batched_tokens": shape.max_num_batched_tokens,
                   "block_size": shape.block_size, "max_finishes": shape.finishes_per_run},
        "static_feed": {m: {"batch_size": f.batch_size,
                            "max_concurrent_batches": f.max_concurrent_batches,
                            "max_tasks_in_flight": f.tasks_in_flight} for m, f in feeds.items()},
        **_bct_summary(bct, bounds, first),
    }


GOAL_RATIO = 2.3  # issue 21: BCT >= 2.3x lower than tuned lockstep at 128 GPUs


def _ep_bounds(cfg: SimConfig, seeds: list[int], bct: dict[str, list[float]],
               packing: list[float]) -> dict[str, Any]:
    """Both floors of `ep_bounds` per seed (medians) and the best ratio a schedule could reach."""
    p = EP_PRESETS[cfg.preset]
    frac, factor = parse_stragglers(cfg.stragglers)
    work = [work_bound_s(cfg.workload_for(s), p,
                         np.asarray(straggler_factors(cfg.actors, frac, factor, s)))
            for s in seeds]
    out: dict[str, Any] = {"work_bound_s": round(statistics.median(work), 3),
                           "packing_floor_s": round(statistics.median(packing), 3)}
    if "static-tuned" in bct:
        best = statistics.median(t / max(w, k) for t, w, k in
                                 zip(bct["static-tuned"], work, packing))
        out["max_achievable_ratio"] = round(best, 3)
        out["goal_ratio"] = GOAL_RATIO
        out["goal_reachable_in_model"] = best >= GOAL_RATIO
    return out


def evaluate_ep(cfg: SimConfig, jobs: int = 1) -> dict[str, Any]:
    """`evaluate` for an expert-parallel preset: the same report keys, GPUs for actors."""
    seeds, bct, bounds, first = _over_seeds(cfg, run_seed_ep, jobs)
    p = EP_PRESETS[cfg.preset]
    return {
        "gpus": cfg.actors, "actors": cfg.actors, "rows": cfg.rows, "workload": cfg.workload,
        "seeds": seeds, "order": cfg.order, "preset": p.name, "stragglers": cfg.stragglers,
        "startup_skew_s": 0.0,
        "engine": {"group_gpus": p.group_gpus, "seats_per_rank": p.seats_per_rank,
                   "prefill_budget": p.prefill_budget,
                   "anchor_tokens_per_gpu_s": round(p.anchor_tokens_per_gpu_s(), 1)},
        **_bct_summary(bct, bounds, first),
        "bounds": _ep_bounds(cfg, seeds, bct, bounds),
    }
