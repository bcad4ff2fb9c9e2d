"""Batch completion time (BCT) of a Ray Data job with and without cross-actor migration.

Local Ray, `build_processor` with a pool of 2 actors, each on one core (torch threads = 1,
`num_cpus` fractional so Ray Data's own tasks still run), the embedded default model by
default. Rows draw their output length from a lognormal ("reasoning"-shaped, scaled down:
median 48, sigma 1.2, capped at 400) and are generated exactly (`ignore_eos`, per-row
`max_tokens`), in random order: no hand-placed long rows. `max_num_seqs` is small, so seats are
the bottleneck the long tail clogs, as KV memory is on a real GPU.

The switch under test is the processor's `migration` flag, which also turns late binding off
(Ray's default queue of 2 x max_concurrent_batches input batches per actor). Each repeat draws a
new shuffle and runs both modes back to back, alternating which goes first (the box is shared
and noisy); the report gives each repeat's ratio and the medians. Both modes must return every
row exactly once with identical tokens; the script fails otherwise. To show how Ray bound the
rows, the predictor is `BatchGenPredictor` plus bench_* output columns (the pid of the actor
whose task yields the row, i.e. the row's owner, also for a moved row, and its engine's
counters): `off_split` / `on_split` are the output tokens owned by each actor, largest first.

    python benchmarks/ray_migration.py                  # default model, ~4 min per repeat
    python benchmarks/ray_migration.py --model tiny     # tiny random model (startup-dominated)
"""
from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from _common import print_report  # noqa: E402

COLUMNS = ["rep", "seed", "out_tokens", "max_len", "bct_off_s", "bct_on_s", "moves", "exchanges",
           "coord_cpu_s", "off_split", "on_split", "on_vs_off"]


def tiny_model() -> str:
    """A tiny random Llama built like the test fixture's (no download)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import build_tiny_model, build_tokenizer

    path = Path(tempfile.mkdtemp(prefix="bench-tiny-"))
    tok = build_tokenizer(path)
    build_tiny_model("llama", path, vocab_size=len(tok))
    return str(path)


def workload(n: int, median: int, sigma: float, cap: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        length = max(1, min(cap, int(rng.lognormvariate(math.log(median), sigma))))
        rows.append({"id": i, "prompt": f"Question {i}: reason step by step about case {rng.random():.4f}",
                     "sampling_params": {"max_tokens": length, "ignore_eos": True,
                                         "temperature": 0.0}})
    rng.shuffle(rows)
    return rows


def tagged_predictor() -> type:
    """`BatchGenPredictor` plus bench_* columns: the pid of the actor whose task yields the row
    (the row's owner: a moved row comes back to it), so the report can show how Ray bound the
    rows, and that actor's engine counters when it yielded. Defined here, not at import, so
    importing this module does not import Ray."""
    import os

    import pyarrow as pa

    from batchgen_data.connectors.ray_data import BatchGenPredictor

    class TaggedPredictor(BatchGenPredictor):  # type: ignore[misc, valid-type]
        def __call__(self, batch: Any):  # type: ignore[no-untyped-def]
            for table in super().__call__(batch):
                st = self.driver.engine.stats  # cumulative, read when the rows are yielded
                n = table.num_rows
                for name, value, typ in (
                        ("bench_owner_pid", os.getpid(), pa.int64()),
                        ("bench_steps", st.num_steps, pa.int64()),
                        ("bench_step_s", st.step_time_s, pa.float64()),
                        ("bench_seq_steps", sum(k * v for k, v in st.batch_seqs_hist.items()),
                         pa.int64()),
                        ("bench_wall", time.time(), pa.float64())):
                    table = table.append_column(name, pa.array([value] * n, typ))
                yield table

    return TaggedPredictor


def engines(out: list[dict[str, Any]], t0_wall: float) -> list[dict[str, Any]]:
    """Per owning actor, largest first: its engine's steps, time in `step()`, mean sequences
    per step and the time of its last yield (from the job's start), as of its last yield. An
    importer's work for guests after its own last row is not included."""
    last: dict[int, dict[str, Any]] = {}
    tokens: dict[int, int] = {}
    for r in out:
        pid = r["bench_owner_pid"]
        tokens[pid] = tokens.get(pid, 0) + len(r["generated_token_ids"])
        if pid not in last or r["bench_wall"] > last[pid]["bench_wall"]:
            last[pid] = r
    rep = []
    for pid in sorted(last, key=lambda p: -tokens[p]):
        r = last[pid]
        steps = max(r["bench_steps"], 1)
        rep.append({"tokens": tokens[pid], "steps": r["bench_steps"],
                    "busy_s": round(r["bench_step_s"], 1),
                    "step_ms": round(1e3 * r["bench_step_s"] / steps, 1),
                    "seqs_per_step": round(r["bench_seq_steps"] / steps, 2),
                    "last_yield_s": round(r["bench_wall"] - t0_wall, 1)})
    return rep


def run_once(rows: list[dict[str, Any]], model: str | None, args: argparse.Namespace,
             migration: bool) -> tuple[float, dict[int, list[int]], dict[str, Any]]:
    import ray

    from batchgen_data.connectors.ray.coordinator import NAMESPACE, coordinator_name

    from batchgen_data.connectors.ray.processor import BatchGenProcessorConfig, build_processor

    placement = {"min_running_age": args.min_age, "min_kv_gain_tokens": args.min_gain}
    config = BatchGenProcessorConfig(
        model_source=model, concurrency=2, batch_size=args.batch_size,
        max_concurrent_batches=args.concurrent_batches, num_cpus=0.5,
        engine_kwargs={"max_num_seqs": args.max_num_seqs, "max_model_len": 1024,
                       "num_threads": 1, "device": "cpu"},
        # the switch under test: False also turns late binding off (Ray's default queue depth)
        migration=migration, migration_options={"interval_s": args.interval, "placement": placement})
    processor = build_processor(config)
    job = processor.job_id
    processor.predictor = tagged_predictor()
    ds = processor(ray.data.from_items(rows))
    t0, t0_wall = time.perf_counter(), time.time()
    out = ds.take_all()
    bct = time.perf_counter() - t0
    ids = [r["id"] for r in out]
    assert sorted(ids) == sorted(r["id"] for r in rows), "a row was lost or duplicated"
    assert all(r["error"] is None for r in out)
    stats: dict[str, Any] = {"num_moves": 0, "num_exchanges": 0, "cpu_s": 0.0}
    per_engine = engines(out, t0_wall)
    bound = "/".join(str(e["tokens"]) for e in per_engine)  # how Ray bound the rows
    if migration:
        try:
            coord = ray.get_actor(coordinator_name(job, ""), namespace=NAMESPACE)
            stats = ray.get(coord.stats.remote())
        except ValueError:
            stats = {"num_moves": -1, "num_exchanges": -1, "cpu_s": -1.0}
    return bct, {r["id"]: list(r["generated_token_ids"]) for r in out}, {**stats, "split": bound,
                                                                 "engines": per_engine}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default", help="tiny | default | a model path")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--median", type=int, default=48, help="lognormal median output length")
    ap.add_argument("--sigma", type=float, default=1.2)
    ap.add_argument("--cap", type=int, default=400)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--concurrent-batches", type=int, default=2,
                    help="max_concurrent_batches (input batches one actor serves at once)")
    ap.add_argument("--min-age", type=int, default=16, help="placement.min_running_age")
    ap.add_argument("--min-gain", type=int, default=32, help="placement.min_kv_gain_tokens")
    ap.add_argument("--interval", type=float, default=0.1,
                    help="migration interval_s: how often each engine reports to the coordinator")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    import ray

    model = {"tiny": tiny_model(), "default": None}.get(args.model, args.model)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    records = []
    for rep in range(args.repeats):
        # a new random shuffle (and draw) per repeat: the ratio is not one lucky order
        rows = workload(args.rows, args.median, args.sigma, args.cap, args.seed + rep)
        lengths = sorted(r["sampling_params"]["max_tokens"] for r in rows)
        print(f"rep {rep}: output lengths n={len(lengths)} sum={sum(lengths)} "
              f"median={lengths[len(lengths) // 2]} p90={lengths[int(0.9 * len(lengths))]} "
              f"max={lengths[-1]}", flush=True)
        bct: dict[str, float] = {}
        reference: dict[int, list[int]] | None = None
        coord: dict[str, Any] = {}
        splits: dict[str, str] = {}
        per_engine: dict[str, list[dict[str, Any]]] = {}
        for mode in (("off", "on") if rep % 2 == 0 else ("on", "off")):  # alternating order
            bct[mode], tokens, moved = run_once(rows, model, args, migration=mode == "on")
            reference = reference or tokens
            assert tokens == reference, f"{mode}: tokens differ between the two modes"
            coord = moved if mode == "on" else coord
            splits[mode], per_engine[mode] = moved["split"], moved["engines"]
            print(f"rep {rep} {mode}: bct {bct[mode]:.1f}s, output tokens per owning actor "
                  f"{splits[mode]}, engines {json.dumps(per_engine[mode])}", flush=True)
        records.append({"rep": rep, "seed": args.seed + rep, "out_tokens": sum(lengths),
                        "max_len": lengths[-1], "bct_off_s": round(bct["off"], 1),
                        "bct_on_s": round(bct["on"], 1), "moves": coord["num_moves"],
                        "exchanges": coord["num_exchanges"], "coord_cpu_s": coord["cpu_s"],
                        "off_split": splits["off"], "on_split": splits["on"],
                        "engines": per_engine,
                        "on_vs_off": round(bct["on"] / bct["off"], 3)})
    ratios = [r["on_vs_off"] for r in records]
    records.append({"rep": "median", "bct_off_s": round(statistics.median(r["bct_off_s"] for r in records), 1),
                    "bct_on_s": round(statistics.median(r["bct_on_s"] for r in records), 1),
                    "on_vs_off": round(statistics.median(ratios), 3)})
    print_report(records, COLUMNS)
    print(json.dumps({"distribution": {"kind": "lognormal", "median": args.median,
                                       "sigma": args.sigma, "cap": args.cap},
                      "rows": args.rows, "model": args.model, "max_num_seqs": args.max_num_seqs,
                      "batch_size": args.batch_size,
                      "concurrent_batches": args.concurrent_batches,
                      "median_on_vs_off": round(statistics.median(ratios), 3)}))
    ray.shutdown()


if __name__ == "__main__":
    main()
