"""`BatchGenPredictor`: one engine per Ray Data actor, rows streamed out as they finish.

    ds.map_batches(BatchGenPredictor, batch_size=32, batch_format="pyarrow",
                   fn_constructor_kwargs=dict(model=None, sampling_params={"max_tokens": 64}),
                   compute=ray.data.ActorPoolStrategy(size=2, max_concurrent_calls_per_actor=k),
                   num_cpus=0.5)  # k = window_batches(max_num_seqs, 32): batches per actor

Each actor builds one engine and an `EngineDriver` that steps it on a background thread. The
actor must be threaded (`max_concurrency` > 1): Ray then runs several `__call__`s at once, and
all of their rows feed the one scheduler, so the engine's batch stays full while a batch waits
for its slowest row. `__call__` is a plain generator on purpose: Ray Data 2.60 drains an
`async def` generator UDF into a list before passing anything on (`_generate_transform_fn_for_
async_map`), so only a sync generator can hand rows over as they finish; `ray_blocks` (installed
by `build_processor`, or `enable_row_streaming()` when calling `map_batches` by hand) makes Ray
ship each yield at once instead of buffering it to 128 MiB.

Rows go through `rows.RowLifecycle`, shared with the Spark connector: a bad row becomes an error
row, a dead engine ends the actor so that Ray restarts it and retries its tasks
(docs/row-errors.md).

With `stream="ordered"` (the default) rows leave one at a time in input order: the n-th output
of a task is always its n-th row, so a retried task repeats exactly what the dead attempt had
already sent. `stream=True` sends rows in completion order (lower latency per row), but a task
retried after its actor died can then lose some rows and repeat others: CI saw it happen
(docs/guarantees.md). With `stream=False` each input batch comes back whole, in input order, as
`ray.data.llm` does.

With `late_binding=True` the actors of one job share a coordinator actor that moves queued rows
(received, not yet scheduled by the engine: no KV) to engines with a free seat, so rows bound
early by a deep window still start wherever a seat frees first. `migration=True` (the default)
also moves started (running, held) sequences from busy engines to idle ones; `late_binding=None`
follows `migration`. Results still come back through the task that received the row
(`ray_migration`, docs/ray_data.md).

With `program=` (a `@batchgen_data.program`) each row runs that program instead of one
generation; its output dict becomes the columns (connectors/programs.py, docs/programs.md).
"""
from __future__ import annotations

import logging
import os
import uuid
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any, Iterator

import pyarrow as pa

from batchgen_data.connectors.common import RequestBuilder, attach_outputs, to_arrow
from batchgen_data.connectors.ray_metrics import start_stats_export
from batchgen_data.connectors.programs import attach_program_outputs
from batchgen_data.connectors.migration_options import MigrationOptions
from batchgen_data.connectors.ray_migration import start_migration
from batchgen_data.connectors.rows import RowLifecycle, check_on_error
from batchgen_data.devices import pick_device
from batchgen_data import env
from batchgen_data.sampling_params import SamplingParams

log = logging.getLogger(__name__)
# True: completion order; False: each batch whole; "ordered": one row per output, input order
STREAM_MODES = (True, False, "ordered")


def default_device_kwargs(engine_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The GPU Ray gave this actor, else CPU with as many threads as CPUs it was given."""
    kw = dict(engine_kwargs)
    try:
        import ray

        gpus = [str(g) for g in ray.get_gpu_ids()] if ray.is_initialized() else []
        cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 1.0) \
            if ray.is_initialized() else 1.0
    except ImportError:
        gpus, cpus = [], 1.0
    kw["device"] = pick_device(kw.get("device", "auto"), gpus, env.cuda_visible_devices())
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
                 on_error: str = "row", stream: bool | str = "ordered",
                 apply_chat_template: bool = True,
                 migration: bool = True, migration_options: dict[str, Any] | None = None,
                 late_binding: bool | None = None,
                 program: Any = None, chat_template: str | None = None,
                 chat_template_kwargs: dict[str, Any] | None = None,
                 **engine_kwargs: Any) -> None:
        check_on_error(on_error)
        if stream not in STREAM_MODES:
            raise ValueError(f"stream={stream!r}: use one of {STREAM_MODES}")
        self.stream = stream
        late_binding = migration if late_binding is None else late_binding
        # either one runs the coordinator; each decides which kind of work it may move
        options = MigrationOptions(**{**(migration_options or {}), "move_queued": late_binding,
                                      "move_started": migration})
        self.driver = self.start_driver(model, engine_kwargs)
        builder = RequestBuilder.from_engine(self.driver.engine, sampling_params,
                                             apply_chat_template, chat_template,
                                             chat_template_kwargs)
        self.rows = RowLifecycle(self.driver, builder, self.driver.engine.config.seed, on_error,
                                 request_prefix=uuid.uuid4().hex[:8],
                                 on_engine_dead=lambda _: exit_if_engine_dead(self.driver),
                                 program=program)
        # engines of one job share a coordinator: same Ray job and same predictor config
        fingerprint = repr((model, sampling_params, sorted(engine_kwargs.items()),
                            getattr(program, "name", None)))
        self.migration = (start_migration(self.driver, fingerprint, options)
                          if migration or late_binding else None)
        # engine statistics to ray.util.metrics, and to the job's run report if it keeps one
        self.stats_export = start_stats_export(self.driver, self.migration, options.job_id)

    def start_driver(self, model: str | None, engine_kwargs: dict[str, Any]) -> Any:
        """Build the engine and its driver (tests and benchmarks override this seam)."""
        from batchgen_data.engine.driver import EngineDriver
        from batchgen_data.engine.engine import Engine

        return EngineDriver(Engine.from_kwargs(model, **default_device_kwargs(engine_kwargs)))

    def __call__(self, batch: Any) -> Iterator[pa.Table]:
        table = to_arrow(batch)
        pending: dict[Future, int] = {}
        if self.migration is not None:
            self.migration.enter_call()
        try:
            for i, row in enumerate(table.to_pylist()):
                pending[self.rows.submit(row)] = i
            if not self.stream:
                wait(list(pending))
                yield self._finished(table, pending, list(pending))
                return
            if self.stream == "ordered":
                for fut in sorted(pending, key=pending.__getitem__):
                    wait([fut])
                    yield self._finished(table, pending, [fut])
                return
            while pending:
                done, _ = wait(list(pending), return_when=FIRST_COMPLETED)
                yield self._finished(table, pending, done)
        finally:
            self.rows.abandon(pending)  # task failed or was cancelled: stop its rows
            if self.migration is not None:
                self.migration.leave_call()

    def _finished(self, table: pa.Table, pending: dict[Future, int],
                  done: Any) -> pa.Table:
        """Finished rows, taken out of `pending`, in input order, with their outputs."""
        finished = sorted((pending.pop(f), f) for f in done)
        if self.rows.programs is not None:
            return attach_program_outputs(table, [i for i, _ in finished],
                                          [self.rows.outcome(f) for _, f in finished],
                                          self.rows.program_schema)
        return attach_outputs(table, [i for i, _ in finished],
                              [self.rows.outcome(f) for _, f in finished])

    def __del__(self) -> None:
        if getattr(self, "migration", None) is not None:
            self.migration.stop()
        if getattr(self, "stats_export", None) is not None:
            self.stats_export.stop()
        driver = getattr(self, "driver", None)
        if getattr(getattr(self, "rows", None), "programs", None) is not None:
            self.rows.programs.shutdown()
        if driver is not None:
            driver.shutdown(timeout=1.0)
