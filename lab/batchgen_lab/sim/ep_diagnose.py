"""`--diagnose` for expert-parallel presets: each mode's loss against the work bound, by phase.

Runs the first seed's modes again with an `EPTrace` (ep_trace.py) and reports, per mode, the
group-seconds of each phase split into ideal work / straggler / lockstep / underfill, the idle
and re-partition time, and the life of the row that finished last.
"""
from __future__ import annotations

import multiprocessing
import sys
from concurrent.futures import ProcessPoolExecutor
from typing import TYPE_CHECKING, Any

from batchgen_lab.sim.ep_preset import EP_PRESETS
from batchgen_lab.sim.lockstep_run import EPCluster

if TYPE_CHECKING:
    from batchgen_lab.sim.scenario import SimConfig


def _traced(cfg: "SimConfig", mode: str) -> dict[str, Any]:
    from batchgen_lab.sim.scenario import parse_stragglers, straggler_factors

    frac, factor = parse_stragglers(cfg.stragglers)
    factors = straggler_factors(cfg.actors, frac, factor, cfg.seed)
    c = EPCluster(cfg.workload_for(cfg.seed), cfg.actors, EP_PRESETS[cfg.preset],
                  cfg.ep_mode(mode), factors, trace=True)
    res = c.run()
    assert c.trace is not None
    return c.trace.report(res.finish_time)


def diagnose_ep(cfg: "SimConfig", jobs: int = 1) -> dict[str, dict[str, Any]]:
    """Every mode of `cfg` on its first seed, traced: {mode: EPTrace.report}."""
    if jobs <= 1 or len(cfg.modes) <= 1:
        return {m: _traced(cfg, m) for m in cfg.modes}
    ctx = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
    with ProcessPoolExecutor(min(jobs, len(cfg.modes)), mp_context=ctx) as pool:
        futs = [pool.submit(_traced, cfg, m) for m in cfg.modes]
        return {m: f.result() for m, f in zip(cfg.modes, futs)}


def diagnosis_table(diag: dict[str, dict[str, Any]]) -> str:
    """Per mode and phase: group-seconds and their split; then the last row's life."""
    lines = [f"{'mode':<22} {'phase':<7} {'span s':>13} {'group-s':>8} {'ideal':>7} "
             f"{'strag':>7} {'lockst':>7} {'underf':>7}"]
    for m, d in diag.items():
        for ph in ("ramp", "steady", "tail"):
            x = d[ph]
            span = "-" if x["span_s"][0] is None else f"{x['span_s'][0]:.0f}..{x['span_s'][1]:.0f}"
            lines.append(f"{m:<22} {ph:<7} {span:>13} {x['group_s']:>8.1f} {x['ideal']:>7.1f} "
                         f"{x['straggler']:>7.1f} {x['lockstep']:>7.1f} {x['underfill']:>7.1f}")
        lr = d["last_row"]
        lines.append(f"{m:<22} idle {d['idle_group_s']} group-s, reshard "
                     f"{d['reshard_group_s']} group-s; last row {lr['row']}: bound "
                     f"{lr['bound_s']} s, first step {lr['first_step_s']} s, finish "
                     f"{lr['finish_s']} s, KV in transit {lr['kv_transit_s']} s over "
                     f"{lr['hops']} hops")
        lines.append(f"{'':<22}   its steps by sequences in its group: " + ", ".join(
            f"{k} {v['s']} s / {v['steps']} steps" for k, v in lr["by_group_fill"].items()))
        for st in lr["stays"]:  # the first five and the last three
            lines.append(f"{'':<22}   group {st['group']} {st['from_s']:.0f}..{st['to_s']:.0f} s: "
                         f"{st['steps']} steps of {st['mean_step_ms']} ms, "
                         f"{st['mean_seqs_in_group']} sequences in the group")
    return "\n".join(lines)
