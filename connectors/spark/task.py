"""Executor side of the Spark connector: what one Spark task does with its rows.

A task finds (or builds) its worker's engine and hands each row to the `handler.RowHandler` its
`RowKind` opens, as the Ray connector does (a bad row becomes an error row; a dead engine fails
the task so Spark retries it on a rebuilt engine: docs/row-errors.md); results come back as
Futures that the windows in `spark_streaming` hand back to Spark. pyspark is imported only in
`task_resources`, so everything else is testable without a JVM.
"""
from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from batchgen_data import env
from batchgen_data.connectors.handler import RowHandler, check_on_error
from batchgen_data.connectors.row_kinds import GENERATE, RowKind
from batchgen_data.connectors.spark import engine_cache as spark_engine_cache, metrics as spark_metrics
from batchgen_data.connectors.spark.engine_cache import EngineSpec
from batchgen_data.connectors.spark.retry import RetryingRows
from batchgen_data.inputs.image_options import ImageOptions
from batchgen_data.connectors.spark.streaming import BatchSizeProbe
from batchgen_data.worker.devices import cuda_indices, cuda_is_available, pick_device

DEBUG_FIELD = "engine_max_batch_seqs"
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TaskSettings:
    """Everything a task needs, pickled once with the UDF: configuration only, no engine."""

    spec: EngineSpec
    rows: RowKind
    on_error: str = "row"
    max_in_flight: int = 512
    debug_stats: bool = False
    stats: Any = None  # a spark_metrics.stats_accumulator: engine samples, added per task

    def __post_init__(self) -> None:
        check_on_error(self.on_error)
        if not isinstance(self.max_in_flight, int) or self.max_in_flight < 1:
            raise ValueError(f"max_in_flight={self.max_in_flight!r}: must be an int >= 1")

    @classmethod
    def create(cls, model: str | None, sampling_params: Any, on_error: str,
               max_in_flight: int | None, debug_stats: bool,
               engine_kwargs: dict[str, Any], apply_chat_template: bool = True,
               program: Any = None, chat_template: str | None = None,
               chat_template_kwargs: dict[str, Any] | None = None, task: str = GENERATE,
               pooling_params: Any = None, stats: Any = None,
               engine_factory: Any = None) -> "TaskSettings":
        rows = RowKind.create(task, sampling_params, program, pooling_params,
                              apply_chat_template, chat_template, chat_template_kwargs,
                              ImageOptions.of(engine_kwargs))
        spec = EngineSpec.create(model, engine_kwargs, task, engine_factory)
        # Two engine batches' worth: the engine stays full while the oldest rows drain.
        window = max_in_flight if max_in_flight is not None else 2 * spec.max_num_seqs
        # a pooling engine keeps no load or batch statistics: both are generation's
        if rows.pooling:
            debug_stats, stats = False, None
        return cls(spec, rows, on_error, window, debug_stats, stats)

    def output_schema(self) -> pa.Schema:
        """The columns a task appends (the debug column last, when asked for)."""
        schema = self.rows.declared_schema()
        return schema.append(pa.field(DEBUG_FIELD, pa.int32())) if self.debug_stats else schema


def task_resources() -> tuple[list[str], int | None]:
    """GPU addresses and CPU count Spark gave the running task (empty/None outside a task)."""
    from pyspark import TaskContext

    ctx = TaskContext.get()
    if ctx is None:
        return [], None
    gpu = ctx.resources().get("gpu")
    return (list(gpu.addresses) if gpu is not None else []), ctx.cpus()


def task_driver(settings: TaskSettings) -> spark_engine_cache.DriverLike:
    """This worker's driver for `settings.spec`, placed on the task's device."""
    gpus, cpus = task_resources()
    cuda = cuda_is_available()
    kwargs = settings.spec.kwargs
    requested = kwargs.get("device", "auto")
    device = pick_device(requested, gpus, env.cuda_visible_devices(), cuda)
    if device == "cpu" and cuda and requested == "auto":
        # concurrent tasks must not share one GPU unasked (each engine sizes its KV cache to it)
        log.warning("batchgen: CUDA is available but this Spark task was given no GPU; running "
                    "on the CPU. Set spark.task.resource.gpu.amount=1, or device='cuda'.")
    return spark_engine_cache.ENGINES.get(settings.spec.resolved(
        device, cpus, rank_gpus(kwargs, device, requested, gpus)))


def rank_gpus(kwargs: dict[str, Any], device: str, requested: str,
              gpus: list[str]) -> list[int] | None:
    """The CUDA devices of a tensor-parallel engine's ranks: the GPUs this task holds, in
    order (None: one rank, a device the user named, or no GPU). A task that holds fewer GPUs
    than ranks is refused by name: its engine would take GPUs Spark gave to other tasks."""
    tp = int(kwargs.get("tensor_parallel_size", 1) or 1)
    if tp == 1 or requested != "auto" or not device.startswith("cuda") or not gpus:
        return None
    if len(gpus) < tp:
        raise ValueError(f"tensor_parallel_size={tp}: this Spark task holds {len(gpus)} GPU(s) "
                         f"({gpus}); set spark.task.resource.gpu.amount={tp} so each task "
                         "holds one GPU per rank")
    return cuda_indices(gpus[:tp], env.cuda_visible_devices())


class TaskSession:
    """One Spark task's view of its worker's engine: rows in as Futures, results out as rows."""

    def __init__(self, settings: TaskSettings) -> None:
        self.settings = settings
        self._retry: RetryingRows | None = None
        self._probe: BatchSizeProbe | None = None

    def _rows(self) -> RetryingRows:
        # on first use, so an empty partition never loads a model
        if self._retry is None:
            self._retry = RetryingRows(self._open, spark_engine_cache.ENGINES.discard)
        return self._retry

    def _open(self) -> RowHandler:
        """The rows' handler over this worker's engine (a new one after an engine death)."""
        driver = task_driver(self.settings)
        rows = self.settings.rows.open(
            driver, self.settings.spec.base_seed, self.settings.on_error,
            request_prefix=f"spark-{uuid.uuid4().hex[:12]}",
            # not the rows' fault: the next engine of this worker is a new one
            on_engine_dead=lambda _: spark_engine_cache.ENGINES.discard(driver),
            fixed_size=False)  # Spark declared its columns before the engine existed
        if self.settings.debug_stats and self._probe is None:
            self._probe = BatchSizeProbe(driver.engine)
        if self.settings.stats is not None:
            spark_metrics.watch(driver)
        return rows

    def finish(self) -> None:
        """The task's end: its engine's samples go to the job's accumulator, if it keeps one;
        threads its rows started end."""
        if self._retry is None:
            return
        if self.settings.stats is not None:
            self.settings.stats.add(spark_metrics.drain(self._retry.rows.driver))
        self._retry.rows.close()

    def submit(self, rows: list[dict[str, Any]], keys: list[Any]) -> list[Future]:
        """One Future per row (a row error is a finished Future holding it); `keys` seed
        unseeded sampling, so a retried task samples the same tokens. A row outlives an engine
        death that names suspects: it is sent again to a new engine (spark_retry.py)."""
        retry = self._rows()
        return [retry.submit(row, key) for row, key in zip(rows, keys)]

    def reject(self, message: str) -> Future:
        """A row error for a row that never reaches the engine (see `RowHandler.reject`)."""
        retry = self._rows()
        return retry.resolved(retry.rows, retry.rows.reject(message))

    def output_rows(self, futures: list[Future]) -> list[dict[str, Any]]:
        """Finished Futures -> output column values, one dict per row, same order."""
        rows = [handler.outcome(f) for f, handler in (p.result() for p in futures)]
        if self.settings.debug_stats:
            peak = self._probe.max_batch_seqs() if self._probe is not None else 0
            for row in rows:
                row[DEBUG_FIELD] = peak
        return rows

    def attach(self, table: pa.Table, indices: Sequence[int],
               rows: Sequence[Mapping[str, Any]]) -> pa.Table:
        """Input rows `indices` of `table` with their output columns (`output_rows`)."""
        out = self._rows().rows.attach(table, indices, rows)
        if self.settings.debug_stats:
            peaks = [r[DEBUG_FIELD] for r in rows]
            out = out.append_column(DEBUG_FIELD, pa.array(peaks, pa.int32()))
        return out

    def abandon(self, futures: list[Future]) -> None:
        """Abort rows nobody will read (Spark stopped early, e.g. `show()` or `limit`)."""
        if self._retry is not None:
            self._retry.abandon(futures)
