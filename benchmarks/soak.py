"""Soak: many rows through local Ray Data on a tiny model, watching for leaks and slowdowns.

Rows of a few tokens each go through `BatchGenPredictor` (row streaming on, migration on). Every
`--interval` seconds the driver records rows done, rows/s, each engine actor's RSS and its KV
block pool, and the object store's use (the shared memory the raylet's plasma store has
touched). At the end it checks that every row came back exactly once and that each engine's
block pool is empty again, fits each actor's RSS slope over the second half of the run (a leak
shows as a slope; start-up and the allocator's warm-up do not), states how steady throughput
was (median rows/s over the intervals and their spread, warm-up and the last partial interval
left out), writes a PNG, and prints a table plus one JSON line.

    python benchmarks/soak.py --rows 5000                          # a check (minutes)
    python benchmarks/soak.py --rows 100000 --plot docs/img/soak.png   # the soak

`--model` takes a model directory; without it a tiny random Llama (the tests' builder) is made
in a temporary directory, so the run measures the connector and Ray, not the model.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import psutil
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import format_table  # noqa: E402

from batchgen_data.connectors.ray_data import BatchGenPredictor, enable_row_streaming  # noqa: E402

COLUMNS = ["t_s", "rows", "rows_per_s", "actors", "rss_mib_max", "pool_used_max",
           "object_store_mib"]


class SoakPredictor(BatchGenPredictor):
    """Writes its RSS and block-pool use to `stats_dir/<pid>.json` after every input batch."""

    def __init__(self, stats_dir: str, **kw: Any) -> None:
        super().__init__(**kw)
        self.stats_file = Path(stats_dir) / f"{os.getpid()}.json"
        self.calls_in_flight = 0
        self.lock = threading.Lock()

    def __call__(self, batch: Any) -> Iterator[Any]:
        with self.lock:
            self.calls_in_flight += 1
        try:
            for table in super().__call__(batch):
                # which engine made each row: the driver counts rows per actor
                yield table.append_column("engine_pid", pa.array([os.getpid()] * table.num_rows,
                                                                  pa.int64()))
        finally:
            with self.lock:
                self.calls_in_flight -= 1
                self._report()

    def _report(self) -> None:
        pool = self.driver.engine.pool
        stats = {"pid": os.getpid(), "t": time.time(), "rss": psutil.Process().memory_info().rss,
                 "pool_used": pool.num_blocks - pool.num_free, "pool_blocks": pool.num_blocks,
                 "calls_in_flight": self.calls_in_flight}
        tmp = self.stats_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(stats))
        tmp.replace(self.stats_file)  # readers never see half a file


def raylet_pid() -> int | None:
    """The raylet of this driver's local Ray: it hosts the object store (plasma)."""
    import ray._private.worker

    node = ray._private.worker._global_node
    for name, process in (node.live_processes() if node is not None else []):
        if name == "raylet":
            return process.pid
    return None


def object_store_mib(pid: int | None) -> float:
    """Shared memory the raylet has touched (`RssShmem`): the plasma store's pages in use, a
    high-water mark (freed objects leave their pages mapped), so a leak shows as growth that
    never stops. Unlike /dev/shm as a whole it counts this job's Ray only. Ray's own memory
    summary needs grpcio, which this environment lacks."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except (OSError, TypeError):
        return 0.0
    kib = next((int(line.split()[1]) for line in status.splitlines()
                if line.startswith("RssShmem:")), 0)
    return round(kib / 1024, 1)


def tiny_model(where: Path) -> str:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from conftest import build_tiny_model, build_tokenizer

    tok = build_tokenizer(where)
    build_tiny_model("llama", where, vocab_size=len(tok))
    return str(where)


def sample(stats_dir: Path, t0: float, done: int, last: tuple[float, int],
           store_pid: int | None) -> dict[str, Any]:
    actors = [json.loads(p.read_text()) for p in stats_dir.glob("*.json")]
    now = time.time()
    rate = (done - last[1]) / max(now - last[0], 1e-9)
    return {"t_s": round(now - t0, 1), "rows": done, "rows_per_s": round(rate, 1),
            "actors": len(actors),
            "rss_mib_max": round(max((a["rss"] for a in actors), default=0) / 2**20, 1),
            "pool_used_max": max((a["pool_used"] for a in actors), default=0),
            "object_store_mib": object_store_mib(store_pid),
            "rss_mib": {a["pid"]: round(a["rss"] / 2**20, 1) for a in actors}}


def slope(pts: list[tuple[float, float]]) -> float:
    """Least-squares slope of y over x (0.0 with fewer than two distinct x)."""
    if len(pts) < 2:
        return 0.0
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    var = sum((x - mx) ** 2 for x, _ in pts)
    return 0.0 if var == 0 else sum((x - mx) * (y - my) for x, y in pts) / var


def rss_slopes(series: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per actor, over the second half of the run: RSS slope in MiB/h and MiB per 10k rows."""
    half = series[len(series) // 2:]
    out = {}
    for pid in sorted({p for s in half for p in s["rss_mib"]}):
        pts = [(s["t_s"], s["rows"], s["rss_mib"][pid]) for s in half if pid in s["rss_mib"]]
        out[str(pid)] = {"mib_per_h": round(3600 * slope([(t, r) for t, _, r in pts]), 1),
                         "mib_per_10k_rows": round(1e4 * slope([(n, r) for _, n, r in pts]), 2)}
    return out


def steadiness(series: list[dict[str, Any]]) -> dict[str, float]:
    """Median rows/s over the intervals and its spread (p10, p90, coefficient of variation),
    without the first quarter of the samples (start-up, warm-up) and the last partial one."""
    rates = sorted(s["rows_per_s"] for s in series[len(series) // 4:-1])
    if not rates:
        return {"median": 0.0, "p10": 0.0, "p90": 0.0, "cv": 0.0}
    mean = sum(rates) / len(rates)
    sd = (sum((r - mean) ** 2 for r in rates) / len(rates)) ** 0.5
    pick = lambda q: rates[min(len(rates) - 1, int(q * len(rates)))]  # noqa: E731
    return {"median": pick(0.5), "p10": pick(0.1), "p90": pick(0.9),
            "cv": round(sd / mean, 3) if mean else 0.0}


def plot(series: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s["t_s"] for s in series]
    fig, axes = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    axes[0].plot(t, [s["rows_per_s"] for s in series])
    axes[0].set_ylabel("rows/s")
    for pid in sorted({p for s in series for p in s["rss_mib"]}):
        axes[1].plot(t, [s["rss_mib"].get(pid) for s in series], label=f"actor {pid}")
    axes[1].set_ylabel("RSS (MiB)")
    axes[1].legend(fontsize="small")
    axes[2].plot(t, [s["object_store_mib"] for s in series])
    axes[2].set_ylabel("object store (MiB)")
    axes[2].set_xlabel("seconds")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--actors", type=int, default=2)
    ap.add_argument("--model", default=None, help="model dir (default: a tiny random Llama)")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--interval", type=float, default=5.0)
    ap.add_argument("--plot", default="soak.png")
    args = ap.parse_args()

    import ray

    work = Path(tempfile.mkdtemp(prefix="batchgen-soak-"))
    model = args.model or tiny_model(work / "model")
    stats_dir = work / "stats"
    stats_dir.mkdir()
    # logical CPUs: every engine actor, its read and map tasks, and Ray Data's own actors get
    # a slot, so all `--actors` engines start even on a 2-core machine
    ray.init(num_cpus=args.actors + 2, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    store_pid = raylet_pid()
    ray.data.DataContext.get_current().enable_progress_bars = False
    enable_row_streaming()
    ds = ray.data.range(args.rows).map(
        lambda r: {"id": r["id"], "prompt": f"Row {r['id']}: the quick brown fox"})
    # one input batch per block, as build_processor does (docs/ray_data.md, "Blocks in"):
    # otherwise a task holds a whole block and one engine can take every row
    ds = ds.repartition(target_num_rows_per_block=args.batch_size)
    out = ds.map_batches(
        SoakPredictor, batch_size=args.batch_size, batch_format="pyarrow",
        fn_constructor_kwargs=dict(model=model, stats_dir=str(stats_dir),
                                   sampling_params={"max_tokens": args.max_tokens,
                                                    "temperature": 0.0},
                                   max_model_len=64, max_num_seqs=64),
        compute=ray.data.ActorPoolStrategy(size=args.actors, max_concurrent_calls_per_actor=4),
        num_cpus=0.5)  # half a CPU each: actors holding whole CPUs starve the read tasks

    load_start = os.getloadavg()
    t0 = time.time()
    series: list[dict[str, Any]] = []
    seen: set[int] = set()
    repeats = errors = 0
    rows_by_engine: dict[int, int] = {}
    last = (t0, 0)
    for batch in out.iter_batches(batch_format="pyarrow", batch_size=None):
        ids = batch.column("id").to_pylist()
        repeats += len(ids) - len(set(ids) - seen)
        seen.update(ids)
        errors += batch.num_rows - batch.column("error").null_count
        for pid in batch.column("engine_pid").to_pylist():
            rows_by_engine[pid] = rows_by_engine.get(pid, 0) + 1
        if time.time() - last[0] >= args.interval:
            series.append(sample(stats_dir, t0, len(seen), last, store_pid))
            last = (time.time(), len(seen))
    wall = time.time() - t0
    series.append(sample(stats_dir, t0, len(seen), last, store_pid))
    final = [json.loads(p.read_text()) for p in stats_dir.glob("*.json")]
    idle = [a for a in final if a["calls_in_flight"] == 0]
    plot(series, Path(args.plot))
    step = max(1, len(series) // 40)  # the table: about 40 rows; the PNG has them all
    print(format_table(series[::step] + ([series[-1]] if (len(series) - 1) % step else []),
                       COLUMNS))
    print(json.dumps({
        "rows": args.rows, "max_tokens": args.max_tokens, "actors_asked": args.actors,
        "rows_out": len(seen), "lost": args.rows - len(seen),
        "repeated": repeats, "errors": errors, "wall_s": round(wall, 1),
        "rows_per_s": round(len(seen) / wall, 1),
        "rows_by_engine_pid": rows_by_engine,
        "rows_per_s_intervals": steadiness(series),
        "rss_slope_second_half": rss_slopes(series),
        "rss_mib_end": {a["pid"]: round(a["rss"] / 2**20, 1) for a in final},
        "object_store_mib_peak": max(s["object_store_mib"] for s in series),
        "block_pool_empty_at_end": bool(idle) and all(a["pool_used"] == 0 for a in idle),
        "load_1m_start_end": [round(load_start[0], 2), round(os.getloadavg()[0], 2)],
        "plot": str(Path(args.plot).resolve())}))
    ray.shutdown()


if __name__ == "__main__":
    main()
