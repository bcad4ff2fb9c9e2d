"""Command line: compare the feeding modes (static, static-tuned, continuous, late-bind,
migrate) on a simulated cluster.

    python -m batchgen_lab.sim --actors 16 --rows 20000 --stragglers 0.125:1.5 --seeds 5 --json
    python -m batchgen_lab.sim --actors 128 --rows 200000 --workload reasoning --json
    python -m batchgen_lab.sim --sweep 8,32,128,512 --rows 200000 --json
    python -m batchgen_lab.sim --actors 128 --rows 200000 --plot out.png
    python -m batchgen_lab.sim --preset ep-moe-dsv3 --actors 128 --rows 50000 \
        --stragglers 0.125:1.5 --modes static-tuned,migrate-repartition+pin --diagnose
    python -m batchgen_lab.sim calibrate --out cpu.json     # fit the cost model on this CPU

`--json-out PATH` writes the JSON report to a file as well: a caller that reads it back (the
tests) never parses stdout, where a Ray driver in the same process may print cluster messages.

Expert-parallel presets print two floors (work bound, packing floor) and the largest ratio to
tuned lockstep that they allow; `--diagnose` adds where each mode loses time against them.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from batchgen_lab.sim import DEFAULT_PRESET, MODES, SimConfig, evaluate
from batchgen_lab.sim.ep_preset import EP_PRESETS
from batchgen_lab.sim.lockstep import EP_MODES
from batchgen_lab.sim.workload import WORKLOADS


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m batchgen_lab.sim", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", nargs="?", choices=("run", "calibrate"), default="run")
    p.add_argument("--actors", type=int, default=128)
    p.add_argument("--sweep", type=str, default=None, help="comma-separated actor counts")
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--workload", choices=WORKLOADS, default="reasoning")
    p.add_argument("--seed", type=int, default=0, help="the first seed")
    p.add_argument("--seeds", type=int, default=1,
                   help="seeds to run (seed .. seed+N-1): each draws its workload, stragglers "
                        "and start-up delays; BCT is reported as median and min..max")
    p.add_argument("--stragglers", default=None, metavar="FRAC:FACTOR",
                   help="slow round(FRAC x actors) actors (drawn per seed) by FACTOR, "
                        "e.g. 0.125:1.5")
    p.add_argument("--startup-skew", type=float, default=0.0, metavar="S",
                   help="actor i starts taking rows after a random delay in [0, S] seconds")
    p.add_argument("--order", choices=("random", "longest-first"), default="random",
                   help="row order; longest-first is an oracle (it reads the output lengths) "
                        "that shows what knowing them in advance would give")
    p.add_argument("--preset", default=DEFAULT_PRESET,
                   help="cost-model preset or .json file; ep-moe-dsv3 / qwen3-235b: an "
                        "expert-parallel MoE cluster of --actors GPUs in lockstep groups of 16")
    p.add_argument("--overlap", action="store_true",
                   help="roofline step time (compute hides under memory); pair with --max-finishes 1")
    p.add_argument("--modes", default=None,
                   help=f"comma-separated; default {','.join(MODES)} (expert-parallel presets: "
                        f"{','.join(EP_MODES)})")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-concurrent-batches", type=int, default=8,
                   help="static; static-tuned uses max(this, ceil(max_num_seqs / batch_size))")
    p.add_argument("--max-tasks-in-flight", type=int, default=None,
                   help="static: input batches bound per actor (Ray Data's default: 2 x "
                        "--max-concurrent-batches; equal to it = no queued batches)")
    p.add_argument("--ray-tasks", action="store_true",
                   help="streaming modes as the Ray connector feeds them: whole input batches "
                        "in Ray tasks (a 2 x max_num_seqs window, a slot held until the batch's "
                        "slowest row), not the row-level window (sim/modes.py)")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="engine seats (default: vLLM's default on the preset's device, "
                        "1024 for h200-llama8b, 256 for a100-qwen0.5b and cpu-smollm2)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget per step (default: the preset's, 16384 for h200-llama8b, "
                        "8192 for a100-qwen0.5b, 16384 for cpu-smollm2)")
    p.add_argument("--max-finishes", type=int, default=None,
                   help="finishes one extrapolated decode run may span (1 = exact admission; "
                        "default max_num_seqs // 16, capped)")
    p.add_argument("--tick", type=float, default=0.25, help="coordinator period, seconds")
    p.add_argument("--jobs", type=int, default=min(3, os.cpu_count() or 1),
                   help="modes simulated at once, in worker processes")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.add_argument("--json-out", default=None, metavar="PATH",
                   help="write the JSON report (as --json prints it) to this file too")
    p.add_argument("--diagnose", action="store_true",
                   help="expert-parallel presets: run the first seed's modes again, traced, and "
                        "report where each loses time against the work bound (ep_trace.py)")
    p.add_argument("--plot", default=None,
                   help="PNG: running sequences per actor over time (with --sweep: the last count)")
    p.add_argument("--out", default=None, help="calibrate: write the fitted preset here")
    return p


def config_from(args: argparse.Namespace, actors: int) -> SimConfig:
    return SimConfig(
        actors=actors, rows=args.rows, workload=args.workload, seed=args.seed, seeds=args.seeds,
        modes=tuple(m.strip() for m in args.modes.split(",") if m.strip()) if args.modes
        else (EP_MODES if args.preset in EP_PRESETS else MODES), preset=args.preset,
        overlap=args.overlap, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_finishes=args.max_finishes,
        batch_size=args.batch_size, max_concurrent_batches=args.max_concurrent_batches,
        max_tasks_in_flight=args.max_tasks_in_flight, ray_tasks=args.ray_tasks, tick_s=args.tick,
        stragglers=args.stragglers, startup_skew_s=args.startup_skew, order=args.order)


def run_one(args: argparse.Namespace, actors: int) -> dict[str, Any]:
    report = evaluate(config_from(args, actors), jobs=args.jobs)
    bct = report["bct_s"]
    for a, b in (("migrate", "static"), ("migrate", "continuous"), ("continuous", "static")):
        if a in bct and b in bct:  # the median BCTs' quotient (older reports' keys)
            report[f"speedup_{a}_vs_{b}"] = round(bct[b] / bct[a], 3)
    return report


def _table(report: dict[str, Any]) -> str:
    lines = [f"actors={report['actors']} rows={report['rows']} workload={report['workload']} "
             f"preset={report['preset']} seeds={report['seeds']} "
             f"stragglers={report['stragglers']} skew={report['startup_skew_s']}s",
             f"{'mode':<19} {'BCT s':>9} {'min..max':>17} {'/tuned':>7} {'/cont':>7} "
             f"{'util':>6} {'moved':>7}"]
    vs_tuned = report["ratio_vs_tuned_static"] or {}
    vs_cont = report["ratio_vs_continuous"] or {}
    for m, s in report["modes"].items():
        lo, hi = report["bct_s_spread"][m]
        moved = sum(v for k, v in s["moved"].items() if k != "kv_shipped")
        lines.append(f"{m:<19} {report['bct_s'][m]:>9.1f} {lo:>8.1f}..{hi:<8.1f} "
                     f"{vs_tuned.get(m, float('nan')):>7.3f} {vs_cont.get(m, float('nan')):>7.3f} "
                     f"{s.get('utilization', float('nan')):>6.3f} {moved:>7}")
    lines.append(f"packing bound (longest row alone): {report['packing_bound_s']} s")
    b = report.get("bounds")  # expert-parallel presets: both floors and what they allow
    if b:
        lines.append(f"work bound (perfect balance, lockstep + all-to-all charged): "
                     f"{b['work_bound_s']} s; packing floor: {b['packing_floor_s']} s")
        if "max_achievable_ratio" in b:
            verdict = "reachable in this model" if b["goal_reachable_in_model"] else \
                "UNREACHABLE in this model"
            lines.append(f"max achievable ratio (tuned BCT / max(bounds)): "
                         f"{b['max_achievable_ratio']}x; goal >= {b['goal_ratio']}x: {verdict}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "calibrate":
        from batchgen_lab.sim.calibrate import calibrate

        cm, diag = calibrate()
        if args.out:
            with open(args.out, "w") as f:
                f.write(cm.to_json())
        print(cm.to_json())
        print(json.dumps(diag))
        return 0
    if args.plot and args.preset in EP_PRESETS:
        _parser().error("--plot: not available for expert-parallel presets")
    if args.diagnose and args.preset not in EP_PRESETS:
        _parser().error("--diagnose: expert-parallel presets only")
    counts = [int(x) for x in args.sweep.split(",")] if args.sweep else [args.actors]
    reports = []
    for n in counts:
        report = run_one(args, n)
        reports.append(report)
        if args.diagnose:
            from batchgen_lab.sim.ep_diagnose import diagnose_ep, diagnosis_table

            report["diagnosis"] = diagnose_ep(config_from(args, n), args.jobs)
        if not args.json:
            print(_table(report), flush=True)
            if args.diagnose:
                print(diagnosis_table(report["diagnosis"]), flush=True)
        if args.plot and n == counts[-1]:  # the first seed's runs again, with their traces
            from batchgen_lab.sim.plot import plot_active
            from batchgen_lab.sim.scenario import run_seed

            results, _ = run_seed(config_from(args, n), args.seed, args.jobs)
            plot_active(results, args.plot, title=f"{n} actors, {args.rows} rows, {args.workload}")
    result = json.dumps(reports if args.sweep else reports[0])
    if args.json:  # one line
        print(result)
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
