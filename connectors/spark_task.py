"""Executor side of the Spark connector: what one Spark task does with its rows.

A task finds (or builds) its worker's engine, turns each row into an engine request (or an error
message) through `connectors.common`, and submits it to the engine's driver thread; results come
back as Futures that the windows in `streaming` hand back to Spark. pyspark is imported only in
`task_resources`, so everything else is testable without a JVM.
"""
from __future__ import annotations

import itertools
import logging
import uuid
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from batchgen_data.connectors import common, engine_cache
from batchgen_data.connectors.common import RowError, seeded
from batchgen_data.connectors.engine_cache import EngineSpec
from batchgen_data.connectors.streaming import BatchSizeProbe, failed_future
from batchgen_data.sampling_params import SamplingParams

ON_ERROR = ("row", "raise")
DEBUG_FIELD = "engine_max_batch_seqs"
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TaskSettings:
    """Everything a task needs, pickled once with the UDF: configuration only, no engine."""

    spec: EngineSpec
    params: dict[str, Any]
    on_error: str = "row"
    max_in_flight: int = 512
    debug_stats: bool = False

    def __post_init__(self) -> None:
        if self.on_error not in ON_ERROR:
            raise ValueError(f"on_error={self.on_error!r}: use one of {ON_ERROR}")
        if not isinstance(self.max_in_flight, int) or self.max_in_flight < 1:
            raise ValueError(f"max_in_flight={self.max_in_flight!r}: must be an int >= 1")

    @classmethod
    def create(cls, model: str | None, sampling_params: Any, on_error: str,
               max_in_flight: int | None, debug_stats: bool,
               engine_kwargs: dict[str, Any]) -> "TaskSettings":
        spec = EngineSpec.create(model, engine_kwargs)
        params = SamplingParams.from_dict(sampling_params).to_dict()
        # Two engine batches' worth: the engine stays full while the oldest rows drain.
        window = max_in_flight if max_in_flight is not None else 2 * spec.max_num_seqs
        return cls(spec, params, on_error, window, debug_stats)


def task_resources() -> tuple[list[str], int | None]:
    """GPU addresses and CPU count Spark gave the running task (empty/None outside a task)."""
    from pyspark import TaskContext

    ctx = TaskContext.get()
    if ctx is None:
        return [], None
    gpu = ctx.resources().get("gpu")
    return (list(gpu.addresses) if gpu is not None else []), ctx.cpus()


def task_driver(settings: TaskSettings) -> engine_cache.DriverLike:
    """This worker's driver for `settings.spec`, placed on the task's device."""
    gpus, cpus = task_resources()
    import torch

    cuda = torch.cuda.is_available()
    device = engine_cache.pick_device(gpus, engine_cache.cuda_visible_devices(), cuda)
    if device == "cpu" and cuda and settings.spec.kwargs.get("device", "auto") == "auto":
        # concurrent tasks must not share one GPU unasked (each engine sizes its KV cache to it)
        log.warning("batchgen: CUDA is available but this Spark task was given no GPU; running "
                    "on the CPU. Set spark.task.resource.gpu.amount=1, or device='cuda'.")
    return engine_cache.ENGINES.get(settings.spec.resolved(device, cpus))


def value_row(value: Any) -> dict[str, Any]:
    """A UDF cell as a `common` row: chat messages, token ids, or (anything else) a prompt."""
    value = common.to_python(value)
    if isinstance(value, list) and value:
        return {"messages" if isinstance(value[0], dict) else "prompt_token_ids": value}
    return {"prompt": value}


def output_schema(debug_stats: bool = False) -> pa.Schema:
    schema = common.output_schema()
    return schema.append(pa.field(DEBUG_FIELD, pa.int32())) if debug_stats else schema


class TaskSession:
    """One Spark task's view of its worker's engine: rows in as Futures, results out as Arrow."""

    def __init__(self, settings: TaskSettings) -> None:
        self.settings = settings
        self._driver: engine_cache.DriverLike | None = None
        self._builder: common.RequestBuilder | None = None
        self._probe: BatchSizeProbe | None = None
        self._dead_error: type[BaseException] = RuntimeError
        self._request_ids: dict[Future, str] = {}  # in flight, for `abandon`
        self._ids = (f"spark-{uuid.uuid4().hex[:12]}-{i}" for i in itertools.count())

    def _start(self) -> tuple[engine_cache.DriverLike, common.RequestBuilder]:
        # on first use, so an empty partition never loads a model
        if self._driver is None or self._builder is None:
            from batchgen_data.engine.driver import EngineDeadError

            self._dead_error = EngineDeadError
            self._driver = task_driver(self.settings)
            self._builder = common.RequestBuilder.from_engine(self._driver.engine,
                                                              self.settings.params)
            if self.settings.debug_stats:
                self._probe = BatchSizeProbe(self._driver.engine)
        return self._driver, self._builder

    def submit(self, rows: list[dict[str, Any]], keys: list[Any]) -> list[Future]:
        """One Future per row; a rejected row gets a finished Future holding its RowError
        (or raises at once with on_error="raise"). `keys` seed unseeded sampling."""
        driver, builder = self._start()
        base_seed = self.settings.spec.base_seed
        futures = []
        for row, key in zip(rows, keys):
            try:
                req = builder.build(row)
                params = seeded(req.params, base_seed, key)
                rid = next(self._ids)
                fut = driver.submit(req.prompt_token_ids, params, request_id=rid,
                                    prompt=req.prompt)
                self._request_ids[fut] = rid
                futures.append(fut)
            except self._dead_error:
                self._forget_engine()
                raise
            except ValueError as e:  # RowError, or the engine refusing the request
                if self.settings.on_error == "raise":
                    raise RowError(str(e)) from None
                futures.append(failed_future(RowError(str(e))))
        return futures

    def output_rows(self, futures: list[Future]) -> list[dict[str, Any]]:
        """Finished Futures -> output column values, one dict per row, same order."""
        rows = [self._row(f) for f in futures]
        if self.settings.debug_stats:
            peak = self._probe.max_batch_seqs() if self._probe is not None else 0
            for row in rows:
                row[DEBUG_FIELD] = peak
        return rows

    def abandon(self, futures: list[Future]) -> None:
        """Abort rows nobody will read (Spark stopped early, e.g. `show()` or `limit`)."""
        rids = [self._request_ids.pop(f) for f in futures if f in self._request_ids]
        if rids and self._driver is not None:
            self._driver.call(lambda engine: [engine.abort(rid) for rid in rids])

    def _row(self, fut: Future) -> dict[str, Any]:
        self._request_ids.pop(fut, None)
        exc = fut.exception()
        if exc is None:
            return common.result_row(fut.result())
        if isinstance(exc, self._dead_error):
            self._forget_engine()  # not the row's fault: fail the task, Spark retries it
            raise exc
        if self.settings.on_error == "raise":
            raise exc
        return common.error_row(str(exc) if isinstance(exc, RowError)
                                else f"{type(exc).__name__}: {exc}")

    def _forget_engine(self) -> None:
        if self._driver is not None:
            engine_cache.ENGINES.discard(self._driver)
