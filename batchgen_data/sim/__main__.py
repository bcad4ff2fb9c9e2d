"""Command line: compare static / continuous / migrate on a simulated cluster.

    python -m batchgen_data.sim --actors 128 --rows 200000 --workload reasoning --json
    python -m batchgen_data.sim --sweep 8,32,128,512 --rows 200000 --json
    python -m batchgen_data.sim --actors 128 --rows 200000 --plot out.png
    python -m batchgen_data.sim calibrate --out cpu.json     # fit the cost model on this CPU
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace
from typing import Any

from batchgen_data.sim import (DEFAULT_PRESET, MODES, EngineShape, compare, get_preset,
                               make_workload, mode_config)
from batchgen_data.sim.workload import WORKLOADS


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m batchgen_data.sim", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", nargs="?", choices=("run", "calibrate"), default="run")
    p.add_argument("--actors", type=int, default=128)
    p.add_argument("--sweep", type=str, default=None, help="comma-separated actor counts")
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--workload", choices=WORKLOADS, default="reasoning")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--order", choices=("random", "longest-first"), default="random",
                   help="row order; longest-first is an oracle (it reads the output lengths) "
                        "that shows what knowing them in advance would give")
    p.add_argument("--preset", default=DEFAULT_PRESET, help="cost-model preset or .json file")
    p.add_argument("--overlap", action="store_true",
                   help="roofline step time (compute hides under memory); pair with --max-finishes 1")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-concurrent-batches", type=int, default=8)
    p.add_argument("--max-tasks-in-flight", type=int, default=None,
                   help="static: input batches bound per actor (Ray Data's default: 2 x "
                        "--max-concurrent-batches; equal to it = no queued batches)")
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
    p.add_argument("--plot", default=None,
                   help="PNG: running sequences per actor over time (with --sweep: the last count)")
    p.add_argument("--out", default=None, help="calibrate: write the fitted preset here")
    return p


def run_one(args: argparse.Namespace, actors: int) -> tuple[dict[str, Any], dict]:
    wl = make_workload(args.workload, args.rows, args.seed)
    if args.order == "longest-first":
        wl = wl.longest_first()
    cost = get_preset(args.preset)
    if args.overlap:
        cost = replace(cost, name=cost.name + "+overlap", overlap=True)
    shape = EngineShape.for_cost(cost, args.max_num_seqs, args.max_num_batched_tokens,
                                 max_finishes=args.max_finishes)
    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    results = compare(wl, actors, cost, shape, modes, jobs=args.jobs, batch_size=args.batch_size,
                      max_concurrent_batches=args.max_concurrent_batches, tick_s=args.tick,
                      max_tasks_in_flight=args.max_tasks_in_flight)
    static = mode_config("static", shape.max_num_seqs, batch_size=args.batch_size,
                         max_concurrent_batches=args.max_concurrent_batches,
                         max_tasks_in_flight=args.max_tasks_in_flight)
    report: dict[str, Any] = {
        "actors": actors, "rows": args.rows, "workload": args.workload, "seed": args.seed,
        "order": args.order,
        "preset": cost.name, "engine": {"max_num_seqs": shape.max_num_seqs,
                                        "max_num_batched_tokens": shape.max_num_batched_tokens,
                                        "block_size": shape.block_size,
                                        "max_finishes": shape.finishes_per_run},
        "static_feed": {"batch_size": static.batch_size,
                        "max_concurrent_batches": static.max_concurrent_batches,
                        "max_tasks_in_flight": static.tasks_in_flight},
        "modes": {m: r.summary() for m, r in results.items()},
    }
    bct = {m: r.bct_s for m, r in results.items()}
    if "static" in bct and "migrate" in bct:
        report["speedup_migrate_vs_static"] = round(bct["static"] / bct["migrate"], 3)
    if "continuous" in bct and "migrate" in bct:
        report["speedup_migrate_vs_continuous"] = round(bct["continuous"] / bct["migrate"], 3)
    if "static" in bct and "continuous" in bct:
        report["speedup_continuous_vs_static"] = round(bct["static"] / bct["continuous"], 3)
    return report, results


def _table(report: dict[str, Any]) -> str:
    lines = [f"actors={report['actors']} rows={report['rows']} workload={report['workload']} "
             f"preset={report['preset']}",
             f"{'mode':<11} {'BCT s':>9} {'idle GPU-s':>11} {'util':>6} {'moved':>7} {'sim s':>6}"]
    for m, s in report["modes"].items():
        moved = sum(v for k, v in s["moved"].items() if k != "kv_shipped")
        lines.append(f"{m:<11} {s['bct_s']:>9.1f} {s['idle_gpu_s']:>11.0f} "
                     f"{s['utilization']:>6.3f} {moved:>7} {s['sim_wall_s']:>6.1f}")
    for k in ("speedup_migrate_vs_static", "speedup_migrate_vs_continuous",
              "speedup_continuous_vs_static"):
        if k in report:
            lines.append(f"{k}: {report[k]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "calibrate":
        from batchgen_data.sim.calibrate import calibrate

        cm, diag = calibrate()
        if args.out:
            with open(args.out, "w") as f:
                f.write(cm.to_json())
        print(cm.to_json())
        print(json.dumps(diag))
        return 0
    counts = [int(x) for x in args.sweep.split(",")] if args.sweep else [args.actors]
    reports = []
    for n in counts:
        report, results = run_one(args, n)
        reports.append(report)
        if not args.json:
            print(_table(report), flush=True)
        if args.plot and n == counts[-1]:
            from batchgen_data.sim.plot import plot_active

            plot_active(results, args.plot, title=f"{n} actors, {args.rows} rows, {args.workload}")
    if args.json:
        print(json.dumps(reports if args.sweep else reports[0], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
