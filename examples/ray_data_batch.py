"""The main job: batch inference over a folder of JSONL prompts with Ray Data.

Reads every `examples/data/*.jsonl` file (rows of `id`, `prompt`, `task`; `bad_rows.jsonl` holds
prompts that are null, empty, too long or not strings at all), runs `BatchGenPredictor` with the
embedded default model on two engine actors, writes Parquet and prints a summary: rows, errors by
kind, empty generations, finish reasons, tokens, wall time and throughput (`batchgen_data.report`).

    python examples/ray_data_batch.py                      # all 330 rows, ./out/ray_data_batch
    python examples/ray_data_batch.py --limit 20 --max-tokens 32 --output /tmp/run1

Bad rows do not stop the job: each comes back with an `error` message and empty outputs.
The default model is an instruct model, so each prompt is sent as one user turn of a `messages`
column, which the connector renders with the model's chat template.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow.parquet as pq
import ray

from batchgen_data.connectors.cells import to_python
from batchgen_data.connectors.ray_data import BatchGenPredictor
from batchgen_data.report import summarize

DATA_DIR = Path(__file__).resolve().parent / "data"
ENGINE_MEMORY_BYTES = 5 << 29  # 2.5 GiB


def load_rows(data_dir: Path, limit: int | None) -> pd.DataFrame:
    """All JSONL files, at most `limit` rows from each.

    pandas rather than `ray.data.read_json`: the bad rows mix JSON types in `prompt` (null,
    numbers, lists, objects), which Arrow's JSON reader refuses; pandas keeps them as objects
    and the connector turns each one into an error row.
    """
    frames = [pd.read_json(path, lines=True, dtype=False).head(limit)
              for path in sorted(data_dir.glob("*.jsonl"))]
    if not frames:
        raise SystemExit(f"no *.jsonl files in {data_dir}")
    return pd.concat(frames, ignore_index=True)


def as_chat(batch: pd.DataFrame) -> pd.DataFrame:
    """A `messages` column holding each text prompt as one user turn.

    An instruct model sent a bare prompt often answers with its end-of-turn token at once (an
    empty row); through its chat template it answers. Rows whose prompt is not usable text get
    no messages, so the connector falls back to `prompt` and reports what is wrong with it.
    """
    batch["messages"] = [[{"role": "user", "content": p}] if isinstance(p, str) and p.strip()
                         else None for p in batch["prompt"].tolist()]
    return batch


def prompt_as_text(batch: pd.DataFrame) -> pd.DataFrame:
    """Non-string prompts (bad rows) as JSON text, so the Parquet column is a plain string."""
    values = [to_python(p) for p in batch["prompt"].tolist()]
    batch["prompt"] = [p if p is None or isinstance(p, str) else json.dumps(p) for p in values]
    return batch.drop(columns=["messages"])


def run(args: argparse.Namespace) -> dict[str, Any]:
    rows = load_rows(args.data, args.limit)
    # Blocks of one input batch each: Ray feeds a task's batches to the UDF one after another,
    # so a single big block would keep just one batch in the engine at a time.
    ds = ray.data.from_pandas(as_chat(rows)).repartition(target_num_rows_per_block=32, strict=True)
    ds = ds.map_batches(
        BatchGenPredictor, batch_size=32, batch_format="pyarrow",
        fn_constructor_kwargs=dict(
            model=args.model,  # None: the embedded default model
            sampling_params={"max_tokens": args.max_tokens, "temperature": 0.0},
            max_model_len=2048),
        # 2 engines; each serves 4 input batches at once so its scheduler always has work.
        # Half a CPU each leaves room for Ray's own tasks on small machines.
        compute=ray.data.ActorPoolStrategy(size=args.actors, max_concurrent_calls_per_actor=4),
        num_cpus=0.5, num_gpus=args.gpus_per_actor or None,
        # an actor's peak (~1.7 GB: the engine of the default model, 1.47 GiB by
        # benchmarks/engine_memory.py, plus the Ray worker) with the 25% headroom Ray Data's
        # memory check asks for: Ray places actors by it and the check stays quiet
        memory=ENGINE_MEMORY_BYTES)
    # Rows stream out of the engines one block each; this step also regroups them into
    # 128-row blocks, so the Parquet files are not one row each.
    ds = ds.map_batches(prompt_as_text, batch_size=128, batch_format="pandas", num_cpus=0.25)
    start = time.perf_counter()
    ds.write_parquet(str(args.output), min_rows_per_file=128, mode="overwrite")
    wall = time.perf_counter() - start

    report = summarize(pq.read_table(args.output), wall_s=wall)
    return {**report.to_dict(), "input_rows": len(rows), "output": str(args.output),
            "text": report.format()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", type=Path, default=DATA_DIR)
    ap.add_argument("--output", type=Path, default=Path("out/ray_data_batch"))
    ap.add_argument("--limit", type=int, default=None, help="at most this many rows per file")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--model", default=None, help="model dir or name (default: embedded model)")
    ap.add_argument("--actors", type=int, default=2)
    ap.add_argument("--gpus-per-actor", type=float, default=0.0)
    args = ap.parse_args(argv)

    ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False)
    # a live progress bar on a terminal; piped into a log, Ray Data would print a 14-line
    # progress report every 10 s instead, so it is off there
    ray.data.DataContext.get_current().enable_progress_bars = sys.stdout.isatty()
    try:
        summary = run(args)
    finally:
        ray.shutdown()
    print(summary.pop("text"))
    print(f"output          {summary['output']} (input {summary['input_rows']} rows; "
          "wall time includes engine start-up)")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
