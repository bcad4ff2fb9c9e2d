"""The simulator's re-partition arm rerun with the switch costs the real engine measured (issue 36).

`benchmarks/repartition.py` times a real `EngineGroup` join (two TP=1 engines into one TP=2) and
split, phase by phase, and prints one JSON line: seconds per GB of weights re-sharded each way,
the KV exported and imported, the communicator's start. This script reads that line and runs
the expert-parallel preset's re-partition arm twice on the same workload, side by side with the
tuned lockstep baseline:
  * `assumed`: the preset as sourced (a re-partition pauses `reshard_s` = 2 s, plus the KV at
    the link's 25 GB/s);
  * `measured`: the same fixed pause (communicators and graphs on GPUs are not measured here;
    the CPU's gloo group start is printed beside it), plus the measured seconds per GB of
    weights times one GPU's non-expert weights (narrowed in place when ranks widen, gathered
    back when they narrow), and the KV re-laid at the measured export + import rate.
With `--collectives` (files holding `benchmarks/tp_step.py` JSON lines at two model depths) the
`measured` arm's per-step TP collective is re-based on the real engine's too: the count of
collectives a TP step runs (fitted: calls = a * layers + b) times the preset's sourced time of
one small NVLink all-reduce, in place of the preset's assumed 2 a layer.
The measured rates come from the CPU (two cores, gloo, fp32): far slower per byte than H200
memory and NVLink, so the `measured` arm is a pessimistic bound of what this engine's switch
would cost at the preset's scale, not a GPU figure. The policy sees the same pause it pays:
`+early` re-partitions only when the faster step pays the pause back.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/repartition.py --seqs 4 \\
        --prompt-len 256 --repeats 3 > /tmp/repartition.log
    PYTHONPATH=lab .venv/bin/python lab/scripts/repartition_sim.py --measured /tmp/repartition.log \\
        --rows 10000

Prints a table, then one JSON line.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "lab"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _common import format_table  # noqa: E402
from batchgen_lab.sim.ep_preset import EP_PRESETS, EPPreset  # noqa: E402
from batchgen_lab.sim.scenario import SimConfig, evaluate  # noqa: E402

ARM = "migrate-repartition+pin+early+align"


def read_measured(path: Path) -> dict[str, Any]:
    """The last `benchmarks/repartition.py` JSON line in `path`."""
    found = None
    for line in path.read_text().splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if rec.get("bench") == "repartition":
                found = rec
    if found is None:
        raise SystemExit(f"{path}: no JSON line of benchmarks/repartition.py")
    return found


def rates(measured: dict[str, Any]) -> dict[str, float]:
    """Per-byte rates of the measured switches: weights re-sharded each way, KV moved."""
    sw = {s["switch"]: s for s in measured["switches"]}
    join, split = sw["join"], sw["split"]
    kv_bytes = join["kv_bytes"] + split["kv_bytes"]
    kv_s = join["export_s"] + join["import_s"] + split["export_s"] + split["import_s"]
    return {"up_s_per_weight_gb": join["reshard_s_per_gb_weights"],
            "down_s_per_weight_gb": split["reshard_s_per_gb_weights"],
            "kv_bytes_per_s": kv_bytes / kv_s if kv_s > 0 else 0.0,
            "group_start_s": join["group_s"],
            "weights_gb_measured": measured["weights_bytes"] / 1e9,
            "switch_s_measured": measured["switch_s"]}


def measured_preset(p: EPPreset, r: dict[str, float], calls: tuple[float, float] | None = None
                    ) -> EPPreset:
    """`p` with the measured switch rates and, given `calls` (per layer, fixed), the TP step's
    collectives counted as the real engine runs them."""
    tp_allreduce = p.tp_allreduce if calls is None else (
        (calls[0] * p.layers + calls[1]) * p.collective_s)
    return dataclasses.replace(
        p, name=f"{p.name}@measured", reshard_s_per_weight_gb_up=r["up_s_per_weight_gb"],
        reshard_s_per_weight_gb_down=r["down_s_per_weight_gb"],
        reshard_kv_bytes_per_s=r["kv_bytes_per_s"] or None, tp_allreduce=tp_allreduce)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--measured", type=Path, required=True,
                    help="a file holding benchmarks/repartition.py's JSON line")
    ap.add_argument("--preset", default="ep-moe-dsv3", choices=sorted(EP_PRESETS))
    ap.add_argument("--actors", type=int, default=128, help="GPUs")
    ap.add_argument("--rows", type=int, default=10_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--stragglers", default="0.125:1.5")
    ap.add_argument("--mode", default=ARM)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--collectives", default="",
                    help="comma-separated files holding benchmarks/tp_step.py JSON lines (two "
                         "depths): the TP step's collectives as the engine runs them")
    args = ap.parse_args(argv)
    r = rates(read_measured(args.measured))
    base = EP_PRESETS[args.preset]
    calls = None
    if args.collectives:
        from batchgen_lab.tail_repartition import Collectives, _json_lines

        fit = Collectives.fit([rec for f in args.collectives.split(",")
                               for rec in _json_lines(Path(f), "tp_step")])
        calls = (fit.per_layer, fit.fixed)
    calibrated = measured_preset(base, r, calls)
    EP_PRESETS[calibrated.name] = calibrated  # worker processes fork after this
    runs: dict[str, dict[str, Any]] = {}
    for arm, preset, modes in (("assumed", base.name, ("static-tuned", args.mode)),
                               ("measured", calibrated.name, (args.mode,))):
        cfg = SimConfig(actors=args.actors, rows=args.rows, seed=args.seed, seeds=args.seeds,
                        modes=modes, preset=preset, stragglers=args.stragglers)
        runs[arm] = evaluate(cfg, jobs=args.jobs)
    tuned = runs["assumed"]["bct_s"]["static-tuned"]
    weights_gb = base.dense_weight_bytes / 1e9
    records = [{"arm": "static-tuned", "reshard_pause": "-", "bct_s": tuned, "vs_tuned": 1.0,
                "reshards": runs["assumed"]["modes"]["static-tuned"].get("reshards", 0)}]
    for arm, preset in (("assumed", base), ("measured", calibrated)):
        rep = runs[arm]
        bct = rep["bct_s"][args.mode]
        up = preset.reshard_pause(1, 2, 0.0)
        down = preset.reshard_pause(2, 1, 0.0)
        records.append({"arm": f"{args.mode} ({arm})",
                        "reshard_pause": f"{up:.1f} s up / {down:.1f} s down + KV",
                        "bct_s": bct, "vs_tuned": round(tuned / bct, 3),
                        "reshards": rep["modes"][args.mode].get("reshards", 0)})
    print(f"{args.preset}, {args.actors} GPUs, {args.rows} rows, seeds {args.seed}.."
          f"{args.seed + args.seeds - 1}, stragglers {args.stragglers} (simulated). Measured "
          f"on the CPU ({r['weights_gb_measured']:.2f} GB model, switches "
          f"{r['switch_s_measured']}): {r['up_s_per_weight_gb']} s/GB weights up, "
          f"{r['down_s_per_weight_gb']} s/GB down, KV at {r['kv_bytes_per_s'] / 1e9:.3f} GB/s, "
          f"gloo group start {r['group_start_s']} s; applied to {weights_gb:.0f} GB of "
          f"non-expert weights per GPU")
    print(format_table(records, list(records[0])))
    result = {"bench": "repartition_sim", "preset": args.preset, "gpus": args.actors,
              "rows": args.rows, "seed": args.seed, "seeds": args.seeds,
              "stragglers": args.stragglers, "mode": args.mode, "measured_rates": r,
              "dense_weight_gb_per_gpu": weights_gb,
              "tp_allreduce_s": {"assumed": base.tp_allreduce,
                                 "measured": calibrated.tp_allreduce},
              "collective_calls": calls,
              "bct_s": {rec["arm"]: rec["bct_s"] for rec in records},
              "ratio_vs_tuned": {rec["arm"]: rec["vs_tuned"] for rec in records},
              "bct_s_by_seed": {arm: runs[arm]["bct_s_by_seed"] for arm in runs}}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
