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
async_map`), so only a sync generator can hand rows over as they finish; `ray_blocks` (its rule
is added to Ray Data's optimizer when this module is imported) makes Ray ship each yield at once
instead of buffering it to 128 MiB.

Rows go through the `handler.RowHandler` their `row_kinds.RowKind` opens, as in the Spark
connector: a bad row becomes an error row, a dead engine ends the actor so that Ray restarts it
and retries its tasks (docs/row-errors.md).

With `stream=True` (the default) rows leave in completion order, and stay exactly once when an
actor dies and Ray retries its tasks: before each yield the rows it carries are written to the
job's record (`ray/emitted.py`, a small detached actor), and a retried call goes through that
record first (docs/guarantees.md). With `stream="ordered"` rows leave one at a time in input
order (the n-th output of a task is its n-th row, no record needed); with `stream=False` each
input batch comes back whole, in input order, as `ray.data.llm` does (`ray/call.py`).

With `late_binding=True` the actors of one job share a coordinator actor that moves queued rows
(received, not yet scheduled by the engine: no KV) to engines with a free seat, so rows bound
early by a deep window still start wherever a seat frees first. `migration=True` (the default)
also moves started (running, held) sequences from busy engines to idle ones; `late_binding=None`
follows `migration`. Results still come back through the task that received the row
(`ray_migration`, docs/ray_data.md).

With `program=` (a `@batchgen_data.program`) each row runs that program instead of one
generation; its output dict becomes the columns (connectors/programs.py, docs/programs.md). With
`task="embed"` / `"classify"` / `"score"` each row is a pooling request (docs/pooling.md).

The parts an actor starts each come from one method, so that a subclass can give others (the
lab's emulated engine, tests' fakes): `start_driver` (the engine), `start_record` (the
emitted-rows record), `start_stats` (the engine statistics export).
"""
from __future__ import annotations

import logging
import os
import threading
import uuid
from typing import Any, Iterator

import pyarrow as pa

from batchgen_data import env
from batchgen_data.connectors.cells import to_arrow
from batchgen_data.connectors.handler import RowHandler, check_on_error
from batchgen_data.connectors.migration_options import MigrationOptions
from batchgen_data.connectors.poison import death_suspects
from batchgen_data.connectors.ray import blocks as ray_blocks, placement as ray_placement
from batchgen_data.connectors.ray.call import Call
from batchgen_data.connectors.ray.emitted import NO_RECORD, EmittedClient, start_emitted
from batchgen_data.connectors.ray.metrics import StatsExport, start_stats_export
from batchgen_data.connectors.ray.migration import MigrationClient, start_migration
from batchgen_data.connectors.ray.poison import PoisonCall, PoisonClient, start_poison
from batchgen_data.connectors.row_kinds import RowKind, build_engine
from batchgen_data.inputs.image_options import ImageOptions
from batchgen_data.sampling_params import SamplingParams
from batchgen_data.worker.devices import pick_device

log = logging.getLogger(__name__)
# the driver imports this module to name BatchGenPredictor in `map_batches`: that is where Ray
# Data plans the job, so the row-streaming rule goes in here (it touches only operators of a
# streaming predictor, ray_blocks); a process without Ray Data skips it silently
ray_blocks.install(quiet_without_ray=True)
# True: completion order; False: each batch whole; "ordered": one row per output, input order
STREAM_MODES = (True, False, "ordered")
DEFAULT_STREAM = True


def _in_ray_job() -> bool:
    """Whether this process is a Ray worker (an actor or a task: where a task attempt can be
    retried); a driver, with or without `ray.init`, is not."""
    try:
        import ray
        from ray._private import worker
    except ImportError:
        return False
    return ray.is_initialized() and worker.global_worker.mode == worker.WORKER_MODE


def default_device_kwargs(engine_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The GPU Ray gave this actor, else CPU with as many threads as CPUs it was given."""
    kw = dict(engine_kwargs)
    try:
        import ray

        worker = _in_ray_job()  # a driver (even after ray.init) has no assigned resources
        gpus = [str(g) for g in ray.get_gpu_ids()] if worker else []
        cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 1.0) \
            if worker else 1.0
    except ImportError:
        gpus, cpus = [], 1.0
    kw["device"] = pick_device(kw.get("device", "auto"), gpus, env.cuda_visible_devices())
    if kw["device"] == "cpu":
        kw.setdefault("num_threads", max(1, int(cpus)))
    return kw


def exit_if_engine_dead(driver: Any) -> None:
    """A dead engine never recovers: end the actor so Ray restarts it and retries its tasks
    (Ray Data's actor pools run with max_restarts=-1, max_task_retries=-1)."""
    if driver.dead is not None:
        log.error("batchgen: engine loop died (%r); exiting the actor so Ray restarts it",
                  driver.dead)
        for handler in logging.getLogger().handlers:
            handler.flush()  # os._exit skips the usual flush
        os._exit(1)


class BatchGenPredictor:
    """Callable class for `Dataset.map_batches`: input rows in, rows with outputs out."""

    streams_rows = True  # read by ray_blocks: this UDF's operator gets per-yield blocks
    default_stream = DEFAULT_STREAM  # ... unless fn_constructor_kwargs say stream=False
    # what `__del__` stops, set once the constructor has started it
    driver: Any = None
    rows: RowHandler | None = None
    migration: MigrationClient | None = None
    emitted: EmittedClient | None = None
    stats_export: StatsExport | None = None

    def __init__(self, model: str | None = None,
                 sampling_params: SamplingParams | dict[str, Any] | None = None,
                 on_error: str = "row", stream: bool | str = DEFAULT_STREAM,
                 apply_chat_template: bool = True,
                 migration: bool = True, migration_options: dict[str, Any] | None = None,
                 late_binding: bool | None = None,
                 program: Any = None, chat_template: str | None = None,
                 chat_template_kwargs: dict[str, Any] | None = None,
                 task: str = "generate", pooling_params: dict[str, Any] | None = None,
                 **engine_kwargs: Any) -> None:
        check_on_error(on_error)
        self.kind = RowKind.create(task, sampling_params, program, pooling_params,
                                   apply_chat_template, chat_template, chat_template_kwargs,
                                   ImageOptions.of(engine_kwargs))
        if self.kind.pooling:  # one pass per request: nothing worth moving (docs/pooling.md)
            migration, late_binding = False, False
        if stream not in STREAM_MODES:
            raise ValueError(f"stream={stream!r}: use one of {STREAM_MODES}")
        late_binding = migration if late_binding is None else late_binding
        # either one runs the coordinator; each decides which kind of work it may move
        options = MigrationOptions(**{**(migration_options or {}), "move_queued": late_binding,
                                      "move_started": migration})
        self.driver = self.start_driver(model, engine_kwargs)
        if engine_kwargs.get("distributed_executor_backend") == "ray":
            ray_placement.claim_own_group()  # its group is removed once this actor is gone
        self.rows = self.kind.open(self.driver, self.driver.engine.config.seed, on_error,
                                   request_prefix=uuid.uuid4().hex[:8],
                                   on_engine_dead=self._engine_died)
        # engines of one job share a coordinator: same Ray job and same predictor config
        fingerprint = repr((model, sampling_params, sorted(engine_kwargs.items()),
                            None if program is None else program.name))
        self.migration = (start_migration(self.driver, fingerprint, options)
                          if migration or late_binding else None)
        # completion order: the job's record of which rows each task attempt already emitted
        # (outside a Ray job no task is retried: completion order needs no record there)
        in_ray = _in_ray_job()
        self.emitted = (self.start_record(fingerprint, options.job_id)
                        if stream is True and in_ray else None)
        # without a record completion order is not exactly once: rows then leave in input order
        self.order = "ordered" if stream is True and in_ray and self.emitted is None else stream
        # the job's poison-row record: what each call's rows had to do with engine deaths, so a
        # retried call never sends a row into the same death again (connectors/poison.py); a
        # generation row's request can run alone, a program's steps or a pooling pass cannot
        self.poison: PoisonClient | None = (
            start_poison(fingerprint, options.job_id)
            if in_ray and not self.kind.pooling and program is None else None)
        self._calls: dict[int, PoisonCall] = {}  # live calls' poison entries, by id(call)
        self._death_lock = threading.Lock()
        # engine statistics to ray.util.metrics, and to the job's run report if it keeps one
        self.stats_export = (None if self.kind.pooling else
                             self.start_stats(self.migration, options.job_id))

    def start_driver(self, model: str | None, engine_kwargs: dict[str, Any]) -> Any:
        """Build the engine these rows run on, and its driver."""
        from batchgen_data.engine.driver import EngineDriver

        return EngineDriver(build_engine(self.kind.task, model,
                                         **default_device_kwargs(engine_kwargs)))

    def start_record(self, fingerprint: str, job_id: str | None) -> EmittedClient | None:
        """Join the job's emitted-rows record (None: Ray cannot give one)."""
        return start_emitted(fingerprint, job_id)

    def start_stats(self, migration: MigrationClient | None,
                    job_id: str | None) -> StatsExport | None:
        """Export the engine's statistics (None: nothing to export to)."""
        return start_stats_export(self.driver, migration, job_id)

    def __call__(self, batch: Any) -> Iterator[pa.Table]:
        outputs = self._outputs(to_arrow(batch))
        try:
            for out in outputs:
                if self.stats_export is not None:  # the report's samples reach the job's
                    self.stats_export.flush(wait=True)  # collector before the rows they cover
                yield out
        finally:  # a cancelled task stops its rows now, not when the generator is collected
            outputs.close()

    def _outputs(self, table: pa.Table) -> Iterator[pa.Table]:
        assert self.rows is not None
        call = Call(self.rows, table, self._poison_call(table))
        if call.poison is not None:
            self._calls[id(call)] = call.poison
        if self.migration is not None:
            self.migration.enter_call()
        try:
            if self.order is True:
                yield from call.in_completion_order(self.emitted or NO_RECORD)
            elif self.order:
                yield from call.in_input_order()
            else:
                yield from call.whole()
            if call.poison is not None:  # ended normally: the next call with these rows is new
                call.poison.finish()
        finally:
            self._calls.pop(id(call), None)
            call.abandon()  # task failed or was cancelled: stop its rows
            if self.migration is not None:
                self.migration.leave_call()

    def _poison_call(self, table: pa.Table) -> PoisonCall | None:
        """This call's entry in the poison-row record, read (what earlier attempts' engine
        deaths say of its rows); None without a record."""
        if self.poison is None:
            return None
        call = self.poison.call(table.to_pylist())
        call.read()
        return call

    def _engine_died(self, exc: BaseException) -> None:
        """The engine died: each live call's rows it names as suspects go to the poison-row
        record, then the actor exits so that Ray restarts it and retries the calls."""
        with self._death_lock:
            suspects = set(death_suspects(exc, self.driver))
            if suspects:
                for call in list(self._calls.values()):
                    call.died(suspects)
                self._calls.clear()  # written once: other threads see the same death
            exit_if_engine_dead(self.driver)

    def __del__(self) -> None:
        for part in (self.emitted, self.migration, self.stats_export):
            if part is not None:
                part.stop()
        if self.rows is not None:
            self.rows.close()
        if self.driver is not None:
            self.driver.shutdown(timeout=1.0)
