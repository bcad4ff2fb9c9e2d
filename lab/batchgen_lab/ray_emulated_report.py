"""What `ray_emulated.py` makes of its runs: how Ray dispatched (a plan the simulator can
replay), the per-row trace, and the report: the table, the 10% agreement verdict per arm (valid
emulations counted apart) and the JSON summary line."""
from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

from batchgen_lab.bench import print_report
from batchgen_lab.ray_emulated_sim import agreement, per_actor_gap

MAX_OVERHEAD = 0.10  # engine time outside the emulated compute that a valid run may have
COLUMNS = ["stragglers", "seed", "arm", "bct_ray_s", "bct_sim_s", "ray_vs_sim", "agree",
           "valid", "actor_gap", "sim_waves_s", "sim_at0_s", "sim_credited_s", "sim_slots_s",
           "vs_tuned", "sim_vs_tuned", "packing_bound_s", "moves", "overhead", "wall_s"]


def ray_plan(batch_call: dict[int, tuple[float, int]],
             args: argparse.Namespace) -> list[list[int]] | None:
    """How Ray dispatched: per actor, the input batches (index = first row id / batch_size) it
    ran, in the order its calls began; None when Ray's blocks were not whole batches."""
    if any(first % args.batch_size for first in batch_call):
        return None
    plan: list[list[int]] = [[] for _ in range(args.actors)]
    for first, (_, owner) in sorted(batch_call.items(), key=lambda kv: kv[1][0]):
        plan[owner].append(first // args.batch_size)
    return plan


def load_records(path: str, args: argparse.Namespace) -> dict[tuple[str, int, str], dict[str, Any]]:
    """The Ray measurements of an earlier run (its printed `{"arm": ...}` lines), keyed by
    (stragglers, seed, arm), each with the dispatch plan rebuilt from its `--trace` file, for
    `--resim`: the simulator's figures recomputed against the same Ray runs."""
    sim_keys = {"bct_sim_s", "replayed", "sim_waves_s", "sim_at0_s", "sim_credited_s",
                "sim_slots_s", "sim_home_last_s", "packing_bound_s"}
    out: dict[tuple[str, int, str], dict[str, Any]] = {}
    with open(path) as f:
        for line in f:
            if not line.startswith('{"arm"'):
                continue
            rec = json.loads(line)
            if rec.get("bct_ray_s") is None:
                continue
            key = (rec.pop("stragglers"), rec.pop("seed"), rec["arm"])
            with open(f"{args.trace}.{rec['arm']}.s{key[1]}.json") as t:
                trace = json.load(t)
            batch_call = {batch: (called, owner) for _, owner, batch, called, _ in trace["rows"]}
            rec["_plan"] = ray_plan(batch_call, args)
            out[key] = {k: v for k, v in rec.items() if k not in sim_keys}
    return out


def save_trace(path: str, out: list[dict[str, Any]], t0: float, args: argparse.Namespace,
               factors: list[float]) -> None:
    """Per row, in modelled seconds from the barrier: its owner (ticket), its input batch (first
    id), when that batch's call began on the actor and when the row was yielded."""
    rel = lambda t: round((t - t0) / args.scale, 3)  # noqa: E731
    rows = sorted(([r["id"], r["bench_owner"], r["bench_batch"], rel(r["bench_called"]),
                    rel(r["bench_wall"])] for r in out))
    with open(path, "w") as f:
        json.dump({"scale": args.scale, "factors": factors, "columns":
                   ["id", "owner", "batch", "called_s", "yield_s"], "rows": rows}, f)


def report(records: list[dict[str, Any]], args: argparse.Namespace) -> list[dict[str, Any]]:
    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 3) if a is not None and b else None

    for rec in records:
        tuned = next((r for r in records if r["arm"] == "tuned"
                      and (r["seed"], r["stragglers"]) == (rec["seed"], rec["stragglers"])), {})
        rec["vs_tuned"] = ratio(rec["bct_ray_s"], tuned.get("bct_ray_s"))
        rec["sim_vs_tuned"] = ratio(rec["bct_sim_s"], tuned.get("bct_sim_s"))
    for rec in records:
        rec["ray_vs_sim"] = ratio(rec["bct_ray_s"], rec["bct_sim_s"])
        rec["agree"] = agreement(rec["bct_ray_s"], rec["bct_sim_s"])
        # a valid emulation: the engines spent at most MAX_OVERHEAD of their time outside the
        # emulated compute (else Ray's BCT is stretched by Python/Ray work, not the schedule)
        rec["valid"] = None if rec["overhead"] is None else rec["overhead"] <= MAX_OVERHEAD
        rec["actor_gap"] = (per_actor_gap(rec["last_yield_by_actor"], rec["sim_home_last_s"],
                                          by_rank=not rec.get("replayed"))
                            if rec.get("last_yield_by_actor") and rec["sim_home_last_s"]
                            else None)
        for col, digits in (("bct_ray_s", 1), ("bct_sim_s", 1), ("sim_slots_s", 1),
                            ("sim_at0_s", 1), ("sim_waves_s", 1),
                            ("sim_credited_s", 1),
                            ("overhead", 3)):
            rec[col] = round(rec[col], digits) if rec[col] is not None else None
    print_report(records, COLUMNS)
    summary: dict[str, Any] = {"compute": "emulated", "actors": args.actors, "rows": args.rows,
                               "seeds": args.seeds, "preset": args.preset,
                               "tokens_per_step": args.tokens_per_step, "scale": args.scale,
                               "max_num_seqs": args.max_num_seqs, "batch_size": args.batch_size}
    for setting in dict.fromkeys(r["stragglers"] for r in records):
        rs = [r for r in records if r["stragglers"] == setting]
        key = "" if setting == (args.stragglers or "none") else f"_{setting}"

        def median_of(col: str, arm: str | None = None) -> float | None:
            vals = [r[col] for r in rs if r[col] is not None and arm in (None, r["arm"])]
            return round(statistics.median(vals), 3) if vals else None

        summary[f"bct_ratio_migration_vs_tuned_static{key}"] = median_of("vs_tuned", "migrate")
        summary[f"sim_ratio_migration_vs_tuned_static{key}"] = median_of("sim_vs_tuned",
                                                                         "migrate")
        summary[f"packing_bound_s{key}"] = median_of("packing_bound_s")
        seeds = len({r["seed"] for r in rs if r["arm"] == "migrate"})
        if seeds:  # issue 21: the packing bound printed next to the ratio
            print(f"stragglers {setting}: migration / tuned static, median of {seeds} seeds: "
                  f"Ray {summary[f'bct_ratio_migration_vs_tuned_static{key}']}, simulator "
                  f"{summary[f'sim_ratio_migration_vs_tuned_static{key}']}; packing bound "
                  f"(longest row alone) {summary[f'packing_bound_s{key}']} s")
        for arm in dict.fromkeys(r["arm"] for r in rs):
            summary[f"bct_s{key}_{arm}"] = {"ray": median_of("bct_ray_s", arm),
                                            "sim": median_of("bct_sim_s", arm),
                                            "sim_credited": median_of("sim_credited_s", arm),
                                            "sim_slots": median_of("sim_slots_s", arm)}
            verdicts = [r["agree"] for r in rs if r["arm"] == arm and r["agree"]]
            summary[f"agreement{key}_{arm}"] = (None if not verdicts else "PASS"
                                                if all(v == "PASS" for v in verdicts) else "FAIL")
        summary[f"max_overhead{key}"] = max((r["overhead"] for r in rs
                                             if r["overhead"] is not None), default=None)
    summary["stragglers"] = args.stragglers or "none"
    verdicts = [r["agree"] for r in records if r["agree"]]
    if verdicts:  # every arm, seed and setting within 10% of the simulator
        summary["sim_agrees_within_10pct"] = ("PASS" if all(v == "PASS" for v in verdicts)
                                              else "FAIL")
        valid = [r["agree"] for r in records if r["agree"] and r["valid"]]
        summary["sim_agrees_within_10pct_valid_runs"] = (
            None if not valid else "PASS" if all(v == "PASS" for v in valid) else "FAIL")
        print(f"simulator vs Ray, 10% BCT rule: {summary['sim_agrees_within_10pct']} "
              f"({verdicts.count('PASS')}/{len(verdicts)} arm runs within 10%; "
              f"{len(valid)} valid emulations (overhead <= {MAX_OVERHEAD}), "
              f"{valid.count('PASS')} of them within 10%)")
    print(json.dumps(summary))
    return records

