"""A Ray Data job that `test_resume_ray.py` runs in its own process (and SIGKILLs).

    python resume_ray_job.py MODEL OUT_DIR CHECKPOINT_DIR SEEN_DIR ROWS

Reads ROWS rows (`ray.data.range`, so the plan starts with a Read, which Ray's checkpoint
filter needs), runs them through `build_processor` with `resume_from=CHECKPOINT_DIR` and writes
Parquet to OUT_DIR. Every input batch an engine actor receives is logged, one id a
line, under SEEN_DIR: that is how the test counts what the engine was asked to generate.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Iterator

import ray

from batchgen_data.connectors.ray_data import BatchGenPredictor, BatchGenProcessorConfig
from batchgen_data.connectors.ray_data import build_processor

ENGINE = {"max_model_len": 96, "max_num_seqs": 8}
BATCH = 4


class LogsSubmissions(BatchGenPredictor):
    """Appends the ids of every input batch to SEEN_DIR/<pid>.txt before generating them."""

    def __init__(self, seen_dir: str, **kw: Any) -> None:
        super().__init__(**kw)
        self.log = Path(seen_dir) / f"{os.getpid()}.txt"

    def __call__(self, batch: Any) -> Iterator[Any]:
        with self.log.open("a") as f:
            f.write("".join(f"{i}\n" for i in batch.column("id").to_pylist()))
        yield from super().__call__(batch)


def prompt_of(row: dict[str, Any]) -> dict[str, Any]:
    return {"id": row["id"], "prompt": f"Row {row['id']}: the tide and the {row['id'] % 7} winds"}


def main(model: str, out: str, checkpoint: str, seen_dir: str, rows: int) -> None:
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    config = BatchGenProcessorConfig(model_source=model, batch_size=BATCH, concurrency=1,
                                     engine_kwargs=ENGINE, id_column="id",
                                     resume_from=checkpoint,
                                     sampling_params={"max_tokens": 8, "temperature": 0.0})
    processor = build_processor(config, preprocess=prompt_of)
    processor.predictor = LogsSubmissions
    processor.predictor_kwargs = {"seen_dir": seen_dir}
    # one block per input batch, so Parquet files (and checkpoints) land as batches finish
    processor(ray.data.range(rows, override_num_blocks=rows // BATCH)).write_parquet(
        out, min_rows_per_file=BATCH)
    ray.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))
