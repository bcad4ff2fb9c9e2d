"""`BatchGenPredictor`: one engine per Ray Data actor, rows streamed out as they finish.

    ds.map_batches(BatchGenPredictor, batch_size=32, batch_format="pyarrow",
                   fn_constructor_kwargs=dict(model=None, sampling_params={"max_tokens": 64}),
                   compute=ray.data.ActorPoolStrategy(size=2), num_cpus=0.5,
                   max_concurrency=4)   # input batches in flight per actor

Each actor builds one engine and an `EngineDriver` that steps it on a background thread. The
actor must be threaded (`max_concurrency` > 1): Ray then runs several `__call__`s at once, and
all of their rows feed the one scheduler, so the engine's batch stays full while a batch waits
for its slowest row. `__call__` is a plain generator on purpose: Ray Data 2.60 drains an
`async def` generator UDF into a list before passing anything on (`_generate_transform_fn_for_
async_map`), so only a sync generator can hand rows over as they finish; `ray_blocks` makes Ray
ship each yield at once instead of buffering it to 128 MiB.

With `stream=False` each input batch comes back whole, in input order, as `ray.data.llm` does.

With `migration=True` (the default) the actors of one job share a coordinator actor that moves
waiting and long-running requests from busy engines to idle ones; results still come back
through the task that received the row (`ray_migration`, docs/ray_data.md).
"""
from __future__ import annotations

import itertools
import logging
import os
import threading
import uuid
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any, Iterator

import pyarrow as pa

from batchgen_data.connectors import ray_blocks
from batchgen_data.connectors.common import (
    RequestBuilder, RowError, attach_outputs, error_row, result_row, seeded, to_arrow)
from batchgen_data.connectors.ray_migration import MigrationOptions, start_migration
from batchgen_data.sampling_params import SamplingParams

log = logging.getLogger(__name__)
ON_ERROR = ("row", "raise")

ray_blocks.install()  # in the driver, where Ray Data plans the job


def default_device_kwargs(engine_kwargs: dict[str, Any]) -> dict[str, Any]:
    """GPU when Ray gave this actor one, else CPU with as many threads as CPUs it was given."""
    kw = dict(engine_kwargs)
    try:
        import ray

        gpus = ray.get_gpu_ids() if ray.is_initialized() else []
        cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 1.0) \
            if ray.is_initialized() else 1.0
    except ImportError:
        gpus, cpus = [], 1.0
    kw.setdefault("device", "cuda" if gpus else "cpu")
    if kw["device"] == "cpu":
        kw.setdefault("num_threads", max(1, int(cpus)))
    return kw


def exit_if_engine_dead(driver: Any) -> None:
    """A dead engine never recovers: end the actor so Ray restarts it and retries its tasks
    (Ray Data's actor pools run with max_restarts=-1, max_task_retries=-1)."""
    if getattr(driver, "dead", None) is not None:
        log.error("batchgen: engine loop died (%r); exiting the actor so Ray restarts it",
                  driver.dead)
        for handler in logging.getLogger().handlers:
            handler.flush()  # os._exit skips the usual flush
        os._exit(1)


class BatchGenPredictor:
    """Callable class for `Dataset.map_batches`: input rows in, rows with outputs out."""

    streams_rows = True  # read by ray_blocks: this UDF's operator gets per-yield blocks

    def __init__(self, model: str | None = None,
                 sampling_params: SamplingParams | dict[str, Any] | None = None,
                 on_error: str = "row", stream: bool = True, apply_chat_template: bool = True,
                 migration: bool = True, migration_options: dict[str, Any] | None = None,
                 **engine_kwargs: Any) -> None:
        if on_error not in ON_ERROR:
            raise ValueError(f"on_error={on_error!r}: use one of {ON_ERROR}")
        self.on_error = on_error
        self.stream = stream
        options = MigrationOptions(**(migration_options or {}))  # TypeError on unknown names
        self.driver = self.start_driver(model, engine_kwargs)
        self.builder = RequestBuilder.from_engine(self.driver.engine, sampling_params,
                                                  apply_chat_template)
        self.base_seed = self.driver.engine.config.seed
        # engines of one job share a coordinator: same Ray job and same predictor config
        fingerprint = repr((model, sampling_params, sorted(engine_kwargs.items())))
        self.migration = start_migration(self.driver, fingerprint, options) if migration else None
        self._prefix = uuid.uuid4().hex[:8]
        self._ids = itertools.count()  # next() is atomic: calls run on several threads
        # HF fast tokenizers can fail with "Already borrowed" when threads share one
        self._tokenize_lock = threading.Lock()

    def start_driver(self, model: str | None, engine_kwargs: dict[str, Any]) -> Any:
        """Build the engine and its driver (tests and benchmarks override this seam)."""
        from batchgen_data.engine.driver import EngineDriver
        from batchgen_data.engine.engine import Engine

        return EngineDriver(Engine.from_kwargs(model, **default_device_kwargs(engine_kwargs)))

    def __call__(self, batch: Any) -> Iterator[pa.Table]:
        table = to_arrow(batch)
        errors: list[tuple[int, dict[str, Any]]] = []
        pending: dict[Future, tuple[int, str]] = {}
        if self.migration is not None:
            self.migration.enter_call()
        try:
            for i, row in enumerate(table.to_pylist()):
                self._submit(i, row, pending, errors)
            if not self.stream:
                yield self._whole(table, pending, errors)
                return
            if errors:
                yield attach_outputs(table, [i for i, _ in errors], [r for _, r in errors])
            while pending:
                done, _ = wait(list(pending), return_when=FIRST_COMPLETED)
                finished = [(pending.pop(f)[0], self._outcome(f)) for f in done]
                finished.sort(key=lambda item: item[0])
                yield attach_outputs(table, [i for i, _ in finished], [r for _, r in finished])
        finally:
            self._abort(pending)  # task failed or was cancelled: stop generating its rows
            if self.migration is not None:
                self.migration.leave_call()

    def _submit(self, index: int, row: dict[str, Any], pending: dict[Future, tuple[int, str]],
                errors: list[tuple[int, dict[str, Any]]]) -> None:
        try:
            with self._tokenize_lock:
                req = self.builder.build(row)
            # unseeded sampling is seeded from the prompt: retried tasks and moved rows repeat it
            params = seeded(req.params, self.base_seed, req.prompt_token_ids)
            rid = f"{self._prefix}-{next(self._ids)}"
            fut = self.driver.submit(req.prompt_token_ids, params, request_id=rid,
                                     prompt=req.prompt)
        except RuntimeError:
            exit_if_engine_dead(self.driver)  # EngineDeadError: restart rather than fail rows
            raise
        except (RowError, ValueError) as e:
            if self.on_error == "raise":
                raise RowError(f"row {index}: {e}") from None
            errors.append((index, error_row(str(e))))
            return
        pending[fut] = (index, rid)

    def _outcome(self, fut: Future) -> dict[str, Any]:
        exc = fut.exception()
        if exc is None:
            return result_row(fut.result())
        exit_if_engine_dead(self.driver)
        if self.on_error == "raise" or not isinstance(exc, (RowError, ValueError)):
            raise exc  # engine failures are not row errors: let Ray retry the task
        return error_row(str(exc))

    def _whole(self, table: pa.Table, pending: dict[Future, tuple[int, str]],
               errors: list[tuple[int, dict[str, Any]]]) -> pa.Table:
        wait(list(pending))
        rows = dict(errors)
        for fut in list(pending):
            index, _ = pending.pop(fut)
            rows[index] = self._outcome(fut)
        order = sorted(rows)
        return attach_outputs(table, order, [rows[i] for i in order])

    def _abort(self, pending: dict[Future, tuple[int, str]]) -> None:
        if not pending:
            return
        rids = [rid for _, rid in pending.values()]
        for fut in pending:
            fut.cancel()

        def abort_all(engine: Any) -> None:
            for rid in rids:
                engine.abort(rid)  # False when it finished meanwhile

        self.driver.call(abort_all)

    def __del__(self) -> None:
        if getattr(self, "migration", None) is not None:
            self.migration.stop()
        driver = getattr(self, "driver", None)
        if driver is not None:
            driver.shutdown(timeout=1.0)


# Public path is `batchgen_data.connectors.ray_data`; the processor sits in its own module.
from batchgen_data.connectors.ray_processor import (  # noqa: E402
    BatchGenProcessorConfig, Processor, build_processor)

__all__ = ["BatchGenPredictor", "BatchGenProcessorConfig", "Processor", "build_processor"]
