"""Row streaming vs whole-batch return through Ray Data, on a long-tail workload.

Most rows are short, a few are very long, input batches hold 32 rows. For each mode we measure,
from the moment the first input batch reaches an actor:

- first_rows_s:      when the first finished rows reach the consumer (`iter_batches`),
- first_batch_last_s: when the slowest row of that first input batch reaches it,
- median_row_s:      median time from a row's batch reaching an actor to the row reaching the
                     consumer,
- total_s:           when the last row arrives (and wall_s, including actor start-up).

`stream` is `BatchGenPredictor` as shipped; `whole` is the same job with `stream=False`, which
returns each input batch whole, as `ray.data.llm` does; `stream_raybuf` streams from the UDF but
without the `ray_blocks` rule, i.e. with Ray's default output buffering (the trap it fixes). `--engine fake` replaces the engine
with one whose requests finish after `max_tokens * --seconds-per-token` (infinite batch
capacity), which isolates what the connector and Ray add; `--engine default` runs the embedded
default model on CPU.

`--case long-first` is the issue-40 check of the one-line usage: one input batch of 24 rows whose
first row is the long one (16,000 output tokens: long enough in time to dominate the job, whose
engine start-up is ~8 s on a 2-core box) among 23 short rows, a tiny random Llama, one actor,
`ds.map_batches(BatchGenPredictor, fn_constructor_kwargs=..., concurrency=1, batch_size=24,
num_cpus=0.5)` as written (no subclass, no extra call) then `iter_batches`. Arms,
alternating within one run: `completion` (the defaults: completion order) and `ordered`
(`stream="ordered"`). For each it reports when the first row and the median row reached the
consumer as a fraction of the job (from `iter_batches` to the last row, engine start-up
included), how long after the row before it the last row arrived, a table and one JSON line.
The consumer reads with `prefetch_batches=0` (`--prefetch-batches`): Ray's default prefetch
holds each block until the next one arrives, so a row is timed by its successor and the last row
by the end of the job (measured: a row yielded, then 3 s to the task's end, reached
`iter_batches` 3 s late with prefetch 1 and 0.1 s late with 0).

    python benchmarks/ray_streaming.py --engine fake
    python benchmarks/ray_streaming.py --engine default --rows 96 --long-tokens 96
    python benchmarks/ray_streaming.py --case long-first --repeats 3
"""
from __future__ import annotations

import argparse
import heapq
import json
import tempfile
import random
import statistics
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Iterator

import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import print_report  # noqa: E402

from batchgen_data.config import EngineConfig  # noqa: E402
from batchgen_data.connectors.ray_data import BatchGenPredictor  # noqa: E402
from batchgen_data.outputs import CompletionOutput, RequestOutput  # noqa: E402

COLUMNS = ["mode", "engine", "rows", "first_rows_s", "first_batch_last_s", "median_row_s",
           "total_s", "wall_s", "gen_tok_s"]


class FakeTokenizer:
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [3 + ord(c) % 250 for c in text]

    def apply_chat_template(self, messages: Any, tokenize: bool = False,
                            add_generation_prompt: bool = True) -> str:
        return "".join(m["content"] for m in messages)


class FakeEngine:
    tokenizer = FakeTokenizer()
    max_model_len = 4096
    config = EngineConfig()

    def check_request(self, prompt_token_ids: list[int], params: Any) -> None:
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(prompt_token_ids)} tokens")

    def lora_names(self) -> None:  # no enable_lora
        return None

    def check_lora(self, lora: Any) -> None:
        pass

    def abort(self, request_id: str) -> bool:
        return False


class FakeDriver:
    """`EngineDriver`'s surface: each request finishes `max_tokens * seconds_per_token` later."""

    dead = None  # it never dies

    def __init__(self, seconds_per_token: float) -> None:
        self.engine = FakeEngine()
        self.spt = seconds_per_token
        self._heap: list[tuple[float, int, Future, RequestOutput]] = []
        self._cv = threading.Condition()
        self._seq = 0
        self._stop = False
        threading.Thread(target=self._loop, daemon=True).start()

    def submit(self, prompt_token_ids: list[int], params: Any, request_id: str | None = None,
               prompt: str | None = None) -> Future:
        n = params.max_tokens
        out = RequestOutput(request_id or "r", prompt, prompt_token_ids,
                            [CompletionOutput(0, "x" * n, [7] * n, "length")])
        fut: Future = Future()
        with self._cv:
            self._seq += 1
            heapq.heappush(self._heap, (time.monotonic() + n * self.spt, self._seq, fut, out))
            self._cv.notify()
        return fut

    def call(self, fn: Any) -> Future:
        fut: Future = Future()
        fut.set_result(fn(self.engine))
        return fut

    def shutdown(self, timeout: float = 1.0) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()

    def _loop(self) -> None:
        with self._cv:
            while not self._stop:
                now = time.monotonic()
                while self._heap and self._heap[0][0] <= now:
                    _, _, fut, out = heapq.heappop(self._heap)
                    if not fut.cancelled():
                        fut.set_result(out)
                self._cv.wait(self._heap[0][0] - now if self._heap else None)


class TimedPredictor(BatchGenPredictor):
    """Adds `call_id`/`call_start` so the consumer can time rows against their input batch."""

    def __init__(self, fake_seconds_per_token: float | None = None, **kw: Any) -> None:
        self.fake_spt = fake_seconds_per_token
        super().__init__(**kw)

    def start_driver(self, model: str | None, engine_kwargs: dict[str, Any]) -> Any:
        if self.fake_spt is not None:
            return FakeDriver(self.fake_spt)
        return super().start_driver(model, engine_kwargs)

    def __call__(self, batch: Any) -> Iterator[pa.Table]:
        start, call_id = time.time(), random.getrandbits(48)
        for table in super().__call__(batch):
            yield (table.append_column("call_id", pa.array([call_id] * table.num_rows, pa.int64()))
                   .append_column("call_start", pa.array([start] * table.num_rows, pa.float64())))


class UnpatchedPredictor(TimedPredictor):
    streams_rows = False  # the ray_blocks rule leaves this operator at Ray's default


def workload(rows: int, batch_size: int, long_per_batch: int, short_tokens: int,
             long_tokens: int, seed: int) -> list[dict[str, Any]]:
    """Input rows; each batch of `batch_size` holds `long_per_batch` long rows at random places."""
    rng = random.Random(seed)
    out = []
    for start in range(0, rows, batch_size):
        size = min(batch_size, rows - start)
        longs = set(rng.sample(range(size), min(long_per_batch, size)))
        for j in range(size):
            n = long_tokens if j in longs else short_tokens
            out.append({"id": start + j, "prompt": f"Row {start + j}: write about topic {j}.",
                        "sampling_params": {"max_tokens": n}})
    return out


def run_mode(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    import ray

    rows = workload(args.rows, args.batch_size, args.long_per_batch, args.short_tokens,
                    args.long_tokens, args.seed)
    # this measures streaming alone: cross-actor migration stays off (benchmarks/ray_migration.py)
    kw: dict[str, Any] = dict(model=args.model, stream=(mode != "whole"), migration=False,
                              sampling_params={"temperature": 0.0, "ignore_eos": True})
    if args.engine == "fake":
        kw["fake_seconds_per_token"] = args.seconds_per_token
    ds = ray.data.from_items(rows).map_batches(
        UnpatchedPredictor if mode == "stream_raybuf" else TimedPredictor, batch_size=args.batch_size, batch_format="pyarrow",
        fn_constructor_kwargs=kw, num_cpus=0.5,
        compute=ray.data.ActorPoolStrategy(size=args.actors,
                                           max_concurrent_calls_per_actor=args.max_batches))
    wall0 = time.time()
    arrivals: list[tuple[float, float, int, int]] = []  # (arrival, call_start, call_id, tokens)
    for b in ds.iter_batches(batch_size=None, batch_format="pyarrow"):
        now = time.time()
        for cs, cid, n in zip(b.column("call_start").to_pylist(), b.column("call_id").to_pylist(),
                              b.column("num_generated_tokens").to_pylist()):
            arrivals.append((now, cs, cid, n))
    wall = time.time() - wall0
    assert len(arrivals) == args.rows, (len(arrivals), args.rows)
    t0 = min(cs for _, cs, _, _ in arrivals)
    first_call = min(arrivals, key=lambda a: a[1])[2]
    total = max(a for a, _, _, _ in arrivals) - t0
    return {"mode": mode, "engine": args.engine, "rows": args.rows,
            "first_rows_s": round(min(a for a, _, _, _ in arrivals) - t0, 3),
            "first_batch_last_s": round(max(a for a, _, c, _ in arrivals if c == first_call) - t0, 3),
            "median_row_s": round(statistics.median(a - cs for a, cs, _, _ in arrivals), 3),
            "total_s": round(total, 3), "wall_s": round(wall, 3),
            "gen_tok_s": round(sum(n for *_, n in arrivals) / total, 1)}


LONG_FIRST_TOKENS = 16_000
LONG_FIRST_COLUMNS = ["repeat", "arm", "first_row_frac", "median_row_frac", "first_row_s",
                      "median_row_s", "job_s", "last_gap_s"]


def tiny_model(max_len: int) -> str:
    """A tiny random Llama built like the test fixture's (no download), long enough a context."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from conftest import build_tiny_model, build_tokenizer

    path = Path(tempfile.mkdtemp(prefix="bench-tiny-"))
    tok = build_tokenizer(path)
    build_tiny_model("llama", path, vocab_size=len(tok), max_position_embeddings=max_len)
    return str(path)


def run_long_first(arm: str, model: str, args: argparse.Namespace) -> dict[str, Any]:
    """One job of the one-line usage; arrival times relative to the start of `iter_batches`."""
    import ray

    rows = [{"id": j, "prompt": f"Row {j}: write about topic {j}.",
             "sampling_params": {"max_tokens": args.long_tokens if j == 0 else args.short_tokens}}
            for j in range(args.batch_size)]
    kw: dict[str, Any] = dict(model=model, max_model_len=args.max_model_len,
                              sampling_params={"temperature": 0.0, "ignore_eos": True})
    if arm == "ordered":
        kw["stream"] = "ordered"
    ds = ray.data.from_items(rows).map_batches(BatchGenPredictor, fn_constructor_kwargs=kw,
                                               concurrency=1, batch_size=args.batch_size,
                                               num_cpus=0.5)
    t0 = time.time()
    arrivals: list[float] = []
    for b in ds.iter_batches(batch_size=None, prefetch_batches=args.prefetch_batches):
        arrivals += [time.time() - t0] * len(b["id"])
    assert len(arrivals) == len(rows), (len(arrivals), len(rows))
    job = max(arrivals)
    first, median = min(arrivals), statistics.median(arrivals)
    return {"arm": arm, "first_row_frac": round(first / job, 3),
            "median_row_frac": round(median / job, 3), "first_row_s": round(first, 2),
            "median_row_s": round(median, 2), "job_s": round(job, 2),
            "last_gap_s": round(arrivals[-1] - arrivals[-2], 2)}


def main_long_first(args: argparse.Namespace) -> list[dict[str, Any]]:
    model = tiny_model(args.max_model_len)
    records = []
    for rep in range(args.repeats):
        arms = ["completion", "ordered"] if rep % 2 == 0 else ["ordered", "completion"]
        for arm in arms:
            records.append({"repeat": rep, **run_long_first(arm, model, args)})
    print_report(records, LONG_FIRST_COLUMNS)
    summary: dict[str, Any] = {"case": "long-first", "rows": args.batch_size,
                               "long_tokens": args.long_tokens,
                               "prefetch_batches": args.prefetch_batches,
                               "short_tokens": args.short_tokens, "repeats": args.repeats}
    for arm in ("completion", "ordered"):
        for col in ("first_row_frac", "median_row_frac", "job_s", "last_gap_s"):
            vals = [r[col] for r in records if r["arm"] == arm]
            summary[f"{arm}_{col}_median"] = statistics.median(vals)
            summary[f"{arm}_{col}_range"] = [min(vals), max(vals)]
    print(json.dumps(summary))
    return records


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--case", choices=["long-tail", "long-first"], default="long-tail")
    ap.add_argument("--repeats", type=int, default=3, help="--case long-first: runs per arm")
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="--case long-first (default: room for the long row)")
    ap.add_argument("--prefetch-batches", type=int, default=0,
                    help="--case long-first: iter_batches' prefetch (Ray's default, 1, holds "
                         "each block until the next one arrives, the last until the job ends)")
    ap.add_argument("--engine", choices=["fake", "default"], default="fake")
    ap.add_argument("--model", default=None, help="model dir for --engine default (None: embedded)")
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--long-per-batch", type=int, default=2)
    ap.add_argument("--short-tokens", type=int, default=8)
    ap.add_argument("--long-tokens", type=int, default=128)
    ap.add_argument("--seconds-per-token", type=float, default=0.02, help="--engine fake only")
    ap.add_argument("--actors", type=int, default=2)
    ap.add_argument("--max-batches", type=int, default=4, help="input batches in flight per actor")
    ap.add_argument("--modes", default="stream,whole,stream_raybuf")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    import ray
    from ray import cloudpickle

    args = parse_args(argv)
    if args.case == "long-first":  # its own defaults, unless given: one batch of 24
        given = set(argv if argv is not None else sys.argv[1:])
        if "--batch-size" not in given:
            args.batch_size = 24
        if "--long-tokens" not in given:
            args.long_tokens = LONG_FIRST_TOKENS
        if args.max_model_len is None:
            args.max_model_len = max(2048, args.long_tokens + 64)
        if "--short-tokens" not in given:
            args.short_tokens = 16
    if __name__ != "__main__":  # imported (tests): ship the classes by value to the actors
        cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        ctx = ray.data.DataContext.get_current()
        ctx.enable_progress_bars = False
        ctx.print_on_execution_start = False
        if args.case == "long-first":
            return main_long_first(args)
        records = [run_mode(mode, args) for mode in args.modes.split(",")]
    finally:
        ray.shutdown()
    print_report(records, COLUMNS)
    return records


if __name__ == "__main__":
    main()
