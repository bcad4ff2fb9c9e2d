"""Batch completion time (BCT) of a Ray Data job with and without cross-actor migration.

Local Ray, a pool of 2 `BatchGenPredictor` actors, each on one core (torch threads = 1,
`num_cpus` fractional so Ray Data's own tasks still run). Rows draw their output length from a
lognormal ("reasoning"-shaped, scaled down) capped at `--cap` tokens, generated exactly
(`ignore_eos`, per-row `max_tokens`), in random order: no hand-placed long rows. `max_num_seqs`
is small, so seats are the bottleneck the long tail clogs, as KV memory is on a real GPU.

The two modes run interleaved (the box is shared and noisy) and the report takes medians. Both
modes must return every row exactly once with identical tokens; the script fails otherwise.

    python benchmarks/ray_migration.py                      # tiny random model, ~1-3 min/run
    python benchmarks/ray_migration.py --model default --rows 48 --cap 256
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

COLUMNS = ["mode", "rows", "out_tokens", "bct_s", "bct_s_all", "moves", "vs_off"]


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


def run_once(rows: list[dict[str, Any]], model: str | None, args: argparse.Namespace,
             migration: bool) -> tuple[float, dict[int, list[int]], int]:
    import ray

    from batchgen_data.connectors.ray_coordinator import NAMESPACE, coordinator_name
    from batchgen_data.connectors.ray_data import BatchGenPredictor

    job = f"bench-{uuid.uuid4().hex[:12]}"
    opts = {"job_id": job, "interval_s": 0.1,
            "placement": {"min_running_age": args.min_age, "min_kv_gain_tokens": args.min_gain}}
    engine = {"max_num_seqs": args.max_num_seqs, "max_model_len": 1024, "num_threads": 1,
              "device": "cpu"}
    ds = ray.data.from_items(rows).repartition(target_num_rows_per_block=args.batch_size)
    ds = ds.map_batches(
        BatchGenPredictor, batch_size=args.batch_size, batch_format="pyarrow",
        fn_constructor_kwargs=dict(model=model, migration=migration, migration_options=opts,
                                   **engine),
        compute=ray.data.ActorPoolStrategy(size=2, max_concurrent_calls_per_actor=2,
                                           max_tasks_in_flight_per_actor=2,
                                           enable_true_multi_threading=True),
        num_cpus=0.5)
    t0 = time.perf_counter()
    out = ds.take_all()
    bct = time.perf_counter() - t0
    ids = [r["id"] for r in out]
    assert sorted(ids) == sorted(r["id"] for r in rows), "a row was lost or duplicated"
    assert all(r["error"] is None for r in out)
    moves = 0
    if migration:
        try:
            coord = ray.get_actor(coordinator_name(job, ""), namespace=NAMESPACE)
            moves = ray.get(coord.stats.remote())["num_moves"]
        except ValueError:
            moves = -1
    return bct, {r["id"]: list(r["generated_token_ids"]) for r in out}, moves


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny", help="tiny | default | a model path")
    ap.add_argument("--rows", type=int, default=96)
    ap.add_argument("--median", type=int, default=48, help="lognormal median output length")
    ap.add_argument("--sigma", type=float, default=1.0)
    ap.add_argument("--cap", type=int, default=768)
    ap.add_argument("--max-num-seqs", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--min-age", type=int, default=16, help="placement.min_running_age")
    ap.add_argument("--min-gain", type=int, default=32, help="placement.min_kv_gain_tokens")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    import ray

    model = {"tiny": tiny_model(), "default": None}.get(args.model, args.model)
    rows = workload(args.rows, args.median, args.sigma, args.cap, args.seed)
    lengths = sorted(r["sampling_params"]["max_tokens"] for r in rows)
    print(f"output lengths: n={len(lengths)} sum={sum(lengths)} median={lengths[len(lengths)//2]}"
          f" p90={lengths[int(0.9 * len(lengths))]} max={lengths[-1]}", flush=True)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    times: dict[str, list[float]] = {"off": [], "on": []}
    moves: list[int] = []
    reference: dict[int, list[int]] | None = None
    for rep in range(args.repeats):
        order = ("off", "on") if rep % 2 == 0 else ("on", "off")  # interleaved, alternating
        for mode in order:
            bct, tokens, n_moves = run_once(rows, model, args, migration=mode == "on")
            reference = reference or tokens
            assert tokens == reference, f"{mode}: tokens differ from the first run"
            times[mode].append(bct)
            if mode == "on":
                moves.append(n_moves)
            print(f"rep {rep} {mode}: bct {bct:.1f}s", flush=True)
    off = statistics.median(times["off"])
    records = []
    for mode in ("off", "on"):
        med = statistics.median(times[mode])
        records.append({"mode": mode, "rows": len(rows), "out_tokens": sum(lengths),
                        "bct_s": round(med, 2), "bct_s_all": [round(t, 1) for t in times[mode]],
                        "moves": moves if mode == "on" else None,
                        "vs_off": round(med / off, 3)})
    print_report(records, COLUMNS)
    print(json.dumps({"distribution": {"kind": "lognormal", "median": args.median,
                                       "sigma": args.sigma, "cap": args.cap},
                      "max_num_seqs": args.max_num_seqs, "batch_size": args.batch_size}))
    ray.shutdown()


if __name__ == "__main__":
    main()
