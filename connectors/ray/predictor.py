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

Rows go through `rows.RowLifecycle`, shared with the Spark connector: a bad row becomes an error
row, a dead engine ends the actor so that Ray restarts it and retries its tasks
(docs/row-errors.md).

With `stream=True` (the default) rows leave in completion order, and stay exactly once when an
actor dies and Ray retries its tasks: before each yield the rows it carries are written to the
job's record (`ray_emitted`, a small detached actor), and a retried call goes through that record
first, yielding placeholders where Ray keeps the dead attempt's outputs (or the same rows again
where it may not), then the rest as they finish (docs/guarantees.md). With `stream="ordered"`
rows leave one at a time in input order (the n-th output of a task is its n-th row, no record
needed); with `stream=False` each input batch comes back whole, in input order, as
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
import threading
import uuid
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any, Iterator

import pyarrow as pa

from batchgen_data.connectors.ray import blocks as ray_blocks, placement as ray_placement
from batchgen_data.connectors.common import RequestBuilder, attach_outputs, error_row, to_arrow
from batchgen_data.connectors.ray.metrics import start_stats_export
from batchgen_data.connectors.pooling_rows import PoolingRows, check_task
from batchgen_data.connectors.programs import attach_program_outputs, program_error_row
from batchgen_data.connectors.ray.emitted import NO_RECORD, start_emitted
from batchgen_data.connectors.ray.poison import PoisonCall, start_poison
from batchgen_data.connectors.migration_options import MigrationOptions
from batchgen_data.connectors.ray.migration import start_migration
from batchgen_data.connectors.rows import RowLifecycle, check_on_error
from batchgen_data.worker.devices import pick_device
from batchgen_data import env
from batchgen_data.sampling_params import SamplingParams

log = logging.getLogger(__name__)
# the driver imports this module to name BatchGenPredictor in `map_batches`: that is where Ray
# Data plans the job, so the row-streaming rule goes in here (it touches only operators of a
# streaming predictor, ray_blocks); a process without Ray Data skips it silently
ray_blocks.install(quiet_without_ray=True)
# True: completion order; False: each batch whole; "ordered": one row per output, input order
STREAM_MODES = (True, False, "ordered")
DEFAULT_STREAM = True
PLACEHOLDER = "batchgen: placeholder for a row an earlier attempt of this task already emitted"


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
    if getattr(driver, "dead", None) is not None:
        log.error("batchgen: engine loop died (%r); exiting the actor so Ray restarts it",
                  driver.dead)
        for handler in logging.getLogger().handlers:
            handler.flush()  # os._exit skips the usual flush
        os._exit(1)


class BatchGenPredictor:
    """Callable class for `Dataset.map_batches`: input rows in, rows with outputs out."""

    streams_rows = True  # read by ray_blocks: this UDF's operator gets per-yield blocks
    default_stream = DEFAULT_STREAM  # ... unless fn_constructor_kwargs say stream=False
    # completion order keeps its record of emitted rows (ray_emitted); False only to show in a
    # test what a retry does without it
    record_emitted = True
    emitted_settle_s = 1.0  # a yield this much older than its attempt's end is settled

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
        # embed / classify / score: a pooling engine, rows through `PoolingRows`; no migration
        # (pooling requests finish in one pass), docs/pooling.md
        self.task = task
        if task != "generate":
            check_task(task)
            migration, late_binding = False, False
        if stream not in STREAM_MODES:
            raise ValueError(f"stream={stream!r}: use one of {STREAM_MODES}")
        self.stream = stream
        late_binding = migration if late_binding is None else late_binding
        # either one runs the coordinator; each decides which kind of work it may move
        options = MigrationOptions(**{**(migration_options or {}), "move_queued": late_binding,
                                      "move_started": migration})
        self.driver = self.start_driver(model, engine_kwargs)
        if engine_kwargs.get("distributed_executor_backend") == "ray":
            ray_placement.claim_own_group()  # its group is removed once this actor is gone
        self.rows: Any
        if task != "generate":
            self.rows = PoolingRows(self.driver, task, pooling_params, on_error,
                                    request_prefix=uuid.uuid4().hex[:8],
                                    on_engine_dead=lambda _: exit_if_engine_dead(self.driver))
        else:
            builder = RequestBuilder.from_engine(self.driver.engine, sampling_params,
                                                 apply_chat_template, chat_template,
                                                 chat_template_kwargs)
            self.rows = RowLifecycle(self.driver, builder, self.driver.engine.config.seed,
                                     on_error, request_prefix=uuid.uuid4().hex[:8],
                                     on_engine_dead=self._engine_died, program=program)
        # engines of one job share a coordinator: same Ray job and same predictor config
        fingerprint = repr((model, sampling_params, sorted(engine_kwargs.items()),
                            getattr(program, "name", None)))
        self.migration = (start_migration(self.driver, fingerprint, options)
                          if migration or late_binding else None)
        # completion order: the job's record of which rows each task attempt already emitted
        # (outside a Ray job no task is retried: completion order needs no record there)
        in_ray = _in_ray_job()
        self.emitted = (start_emitted(fingerprint, options.job_id,
                                      settle_s=self.emitted_settle_s)
                        if stream is True and self.record_emitted and in_ray else None)
        # without a record completion order is not exactly once: rows then leave in input order
        self.order = "ordered" if (stream is True and self.record_emitted and in_ray
                                   and self.emitted is None) else stream
        # the job's poison-row record: what each call's rows had to do with engine deaths, so a
        # retried call never sends a row into the same death again (connectors/poison.py)
        self.poison = (start_poison(fingerprint, options.job_id)
                       if in_ray and task == "generate" and program is None else None)
        self._calls: dict[int, PoisonCall] = {}  # live calls by id(pending)
        self._death_lock = threading.Lock()
        # engine statistics to ray.util.metrics, and to the job's run report if it keeps one
        self.stats_export = (start_stats_export(self.driver, self.migration, options.job_id)
                             if task == "generate" else None)

    def start_driver(self, model: str | None, engine_kwargs: dict[str, Any]) -> Any:
        """Build the engine and its driver (tests and benchmarks override this seam)."""
        from batchgen_data.engine.driver import EngineDriver
        from batchgen_data.engine.engine import Engine

        if getattr(self, "task", "generate") != "generate":
            from batchgen_data.engine.pooling import PoolingEngine
            return EngineDriver(PoolingEngine.from_kwargs(  # type: ignore[arg-type]
                model, **default_device_kwargs(engine_kwargs)))
        return EngineDriver(Engine.from_kwargs(model, **default_device_kwargs(engine_kwargs)))

    def __call__(self, batch: Any) -> Iterator[pa.Table]:
        stats = getattr(self, "stats_export", None)
        outputs = self._outputs(to_arrow(batch))
        try:
            for out in outputs:
                if stats is not None:  # the report's samples reach the job's collector
                    stats.flush(wait=True)  # before the rows they cover
                yield out
        finally:  # a cancelled task stops its rows now, not when the generator is collected
            outputs.close()

    def _outputs(self, table: pa.Table) -> Iterator[pa.Table]:
        pending: dict[Future, int] = {}
        if self.migration is not None:
            self.migration.enter_call()
        call = self._poison_call(table, pending)
        try:
            yield from self._in_order(table, pending)
            if call is not None:  # ended normally: the next call with these rows is a new one
                call.finish()
        finally:
            self._calls.pop(id(pending), None)
            self.rows.abandon(pending)  # task failed or was cancelled: stop its rows
            if self.migration is not None:
                self.migration.leave_call()

    def _in_order(self, table: pa.Table, pending: dict[Future, int]) -> Iterator[pa.Table]:
        stream = self.order
        if stream is True:
            yield from self._completion_order(table, pending)
            return
        self._submit_rows(table.to_pylist(), set(), pending)
        if not stream:
            wait(list(pending))
            yield self._finished(table, pending, list(pending))
            return
        for fut in sorted(pending, key=pending.__getitem__):
            wait([fut])
            yield self._finished(table, pending, [fut])

    def _poison_call(self, table: pa.Table, pending: dict[Future, int]) -> PoisonCall | None:
        """This call's entry in the poison-row record, read (what earlier attempts' engine
        deaths say of its rows); None without a record."""
        if self.poison is None:
            return None
        call = self.poison.call(table.to_pylist())
        call.read()
        self._calls[id(pending)] = call
        return call

    def _completion_order(self, table: pa.Table, pending: dict[Future, int]
                          ) -> Iterator[pa.Table]:
        """Rows as they finish, each yield written to the job's record first; a later attempt
        of this call goes through the earlier attempts' yields first (`ray_emitted`)."""
        rows = table.to_pylist()
        record = self.emitted.call(rows) if self.emitted is not None else NO_RECORD
        self._submit_rows(rows, set(), pending)  # generating while the record is read
        replay = record.replay()
        fut_of = {i: f for f, i in pending.items()}
        settled = [fut_of.pop(i) for r in replay if r.placeholder for i in r.rows]
        for f in settled:  # Ray has these rows from an earlier attempt: stop generating them
            del pending[f]
        self.rows.abandon(settled)
        for r in replay:  # the earlier attempts' outputs, at the indices Ray has them
            if r.placeholder:
                yield self._placeholders(table, list(r.rows))
                continue
            futs = [fut_of[i] for i in r.rows]
            wait(futs)
            yield self._finished(table, pending, futs)
        while pending:
            done, _ = wait(list(pending), return_when=FIRST_COMPLETED)
            indices = sorted(pending[f] for f in done)
            out = self._finished(table, pending, done)
            record.add(indices, max(out.slice(k, 1).nbytes for k in range(out.num_rows)))
            yield out
        record.finish()

    def _submit_rows(self, rows: list[dict[str, Any]], skip: set[int],
                     pending: dict[Future, int]) -> None:
        """Rows of the batch to the engine, in input order, but for `skip` (tests override
        this seam to change what a retried attempt's engine sees)."""
        call = self._calls.get(id(pending))
        for i, row in enumerate(rows):
            if i in skip:
                continue
            if call is None:
                pending[self.rows.submit(row)] = i
            elif i in call.verdict.blamed:  # it killed engines before: a row error, not run
                pending[self.rows.reject(call.verdict.blamed[i])] = i
            else:
                fut = self.rows.submit(row, alone=i in call.verdict.quarantined)
                call.sent(self.rows.request_id(fut), i)
                pending[fut] = i

    def _engine_died(self, exc: BaseException) -> None:
        """The engine died: each live call's rows it names as suspects go to the poison-row
        record, then the actor exits so that Ray restarts it and retries the calls."""
        with self._death_lock:
            suspects = set(getattr(self.driver.dead, "suspects", ()) or ())
            if suspects:
                for call in list(self._calls.values()):
                    call.died(suspects)
                self._calls.clear()  # written once: other threads see the same death
            exit_if_engine_dead(self.driver)

    def _placeholders(self, table: pa.Table, indices: list[int]) -> pa.Table:
        """Rows of the right shape for outputs Ray already holds from an earlier attempt (it
        keeps those and drops these); flagged in `error` should one ever reach a consumer."""
        if self.task != "generate":
            return self.rows.attach(table, indices, [{"embedding": None, "probs": None,
                                                      "score": None, "num_prompt_tokens": 0,
                                                      "error": PLACEHOLDER}] * len(indices))
        if self.rows.programs is not None:
            return attach_program_outputs(table, indices,
                                          [program_error_row(PLACEHOLDER)] * len(indices),
                                          self.rows.program_schema)
        return attach_outputs(table, indices, [error_row(PLACEHOLDER)] * len(indices))

    def _finished(self, table: pa.Table, pending: dict[Future, int],
                  done: Any) -> pa.Table:
        """Finished rows, taken out of `pending`, in input order, with their outputs."""
        finished = sorted((pending.pop(f), f) for f in done)
        if self.task != "generate":
            return self.rows.attach(table, [i for i, _ in finished],
                                    [self.rows.outcome(f) for _, f in finished])
        if self.rows.programs is not None:
            return attach_program_outputs(table, [i for i, _ in finished],
                                          [self.rows.outcome(f) for _, f in finished],
                                          self.rows.program_schema)
        return attach_outputs(table, [i for i, _ in finished],
                              [self.rows.outcome(f) for _, f in finished])

    def __del__(self) -> None:
        if getattr(self, "emitted", None) is not None:
            self.emitted.stop()
        if getattr(self, "migration", None) is not None:
            self.migration.stop()
        if getattr(self, "stats_export", None) is not None:
            self.stats_export.stop()
        driver = getattr(self, "driver", None)
        if getattr(getattr(self, "rows", None), "programs", None) is not None:
            self.rows.programs.shutdown()
        if driver is not None:
            driver.shutdown(timeout=1.0)
