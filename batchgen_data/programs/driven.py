"""Programs over an `EngineDriver`: what the Ray and Spark connectors run per row.

`submit(row)` returns a Future of the program's output dict. Programs start as the engine's
KV pool has room for them (`admission.ProgramAdmission`, as offline); the others wait in a
backlog and start as programs end. Each step's Generates go to the driver like any row's request (so they batch with every other row and program on the engine,
and Ray's migration can move them like any request; a started program's next step is queued
ahead of new programs' first steps); when a step's last result arrives, the program resumes on one small worker thread of its own: user code and chat-template rendering
never run on the engine thread, and a slow program delays nobody's tokens. A failed program
resolves its Future with a `ProgramError` (a row error); a dead engine with `EngineDeadError`.
"""
from __future__ import annotations

import itertools
import threading
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from batchgen_data.programs.admission import PoolState, ProgramAdmission
from batchgen_data.programs.api import GenerateResult, Program
from batchgen_data.programs.run import ProgramError, ProgramRun
from batchgen_data.programs.steps import StepRequest, render, result_of, seeded_step
from batchgen_data.sampling_params import SamplingParams

# (row key, step number, slot) -> seed for a step the program left unseeded, or None
SeedFor = Callable[[Any, int, int], "int | None"]


@dataclass(eq=False)
class _Live:
    pid: str
    run: ProgramRun
    row_future: Future
    key: Any
    requests: list[StepRequest] = field(default_factory=list)
    results: list[GenerateResult | None] = field(default_factory=list)
    in_flight: list[str] = field(default_factory=list)  # request ids of the pending step


class DrivenPrograms:
    def __init__(self, driver: Any, program: Program, defaults: SamplingParams | None = None,
                 tokenizer_lock: Any = None, seed_for: SeedFor | None = None,
                 prefix: str = "program", is_engine_dead: Callable[[BaseException], bool]
                 = lambda e: False,
                 lora_for: Callable[[dict[str, Any]], Any] | None = None) -> None:
        """`lora_for(row)`: the LoRA adapter a row's steps run under (None: the base model);
        what it raises fails that row's program."""
        if not isinstance(program, Program):
            raise TypeError(f"program must be a @batchgen_data.program, got "
                            f"{type(program).__name__}")
        self.driver = driver
        self.program = program
        self.defaults = defaults or SamplingParams()
        self._lock = tokenizer_lock if tokenizer_lock is not None else threading.Lock()
        self._seed_for = seed_for
        self._is_dead = is_engine_dead
        self._lora_for = lora_for
        self._prefix = prefix
        self._ids = itertools.count()
        self._live: dict[Future, _Live] = {}
        # one thread: programs advance one at a time, in the order their steps finished; the
        # admission state and the backlog are only touched there
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="batchgen-programs")
        self.admission = ProgramAdmission.for_engine(driver.engine)
        self._backlog: deque[_Live] = deque()  # submitted, not started: no room yet

    def submit(self, row: dict[str, Any], key: Any = None) -> Future:
        fut: Future = Future()
        live = _Live(f"{self._prefix}-{next(self._ids)}", ProgramRun(self.program, row), fut, key)
        self._live[fut] = live
        self._worker.submit(self._guarded, live, self._queue, live)
        return fut

    def abandon(self, futures: Iterable[Future]) -> None:
        """Stop programs nobody will read: their in-flight steps aborted, their pins released."""
        gone = [self._live.pop(f) for f in list(futures) if f in self._live]
        if gone and self.driver.dead is None:
            self.driver.call(lambda engine: [self._drop(engine, live) for live in gone])
        if gone:
            self._later(self._left, gone)

    def shutdown(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)

    # ---- worker thread ----------------------------------------------------------------------
    def _guarded(self, live: _Live, fn: Callable[..., None], *args: Any) -> None:
        try:
            if live.row_future in self._live:
                fn(*args)
            elif fn == self._on_step and self.driver.dead is None:
                # abandoned while this step was being submitted: its pin went in after the
                # release, so release again (both calls are no-ops when nothing is left)
                self.driver.call(lambda engine: self._drop(engine, live))
        except BaseException as e:  # noqa: BLE001 - whatever breaks must reach the row's waiter
            self._finish(live, e)

    def _queue(self, live: _Live) -> None:
        self._backlog.append(live)
        self._fill()

    def _fill(self) -> None:
        """Start backlog programs while the KV pool has room for them (admission.py)."""
        if not self._backlog:
            return
        # read from this thread while the engine steps: an estimate a step stale at worst
        engine = self.driver.engine
        held = {live.pid: engine.kv_blocks_held(live.pid, live.in_flight)
                for live in list(self._live.values()) if live.pid in self.admission}
        state = PoolState.of(engine)
        while self._backlog and self.admission.may_start(state, held):
            live = self._backlog.popleft()
            if live.row_future in self._live:  # not abandoned meanwhile
                self._guarded(live, self._start, live)

    def _left(self, gone: list[_Live]) -> None:
        for live in gone:
            self.admission.end(live.pid, completed=False)
        self._fill()

    def _start(self, live: _Live) -> None:
        live.run.start()
        self._launch(live)

    def _launch(self, live: _Live) -> None:
        run = live.run
        if run.pending is not None:
            try:
                with self._lock:
                    reqs = [self._request(live, slot, g) for slot, g in enumerate(run.pending)]
            except (ValueError, TypeError) as e:
                run.fail(f"program {run.program.name!r} step {run.num_steps}: {e}")
            else:
                self._submit_step(live, reqs)
                return
        if run.error is not None:
            self._finish(live, ProgramError(run.error))
        else:
            self._finish(live, None)

    def _request(self, live: _Live, slot: int, step: Any) -> StepRequest:
        req = render(step, self.driver.engine.tokenizer, self.defaults,
                     self.driver.engine.check_request)
        seed = self._seed_for(live.key, live.run.num_steps, slot) if self._seed_for else None
        return seeded_step(req, seed)

    def _submit_step(self, live: _Live, reqs: list[StepRequest]) -> None:
        live.requests, live.results = reqs, [None] * len(reqs)
        live.in_flight = [f"{live.pid}-{live.run.num_steps}-{slot}" for slot in range(len(reqs))]
        engine = self.driver.engine
        lora = self._lora_for(live.run.row) if self._lora_for is not None else None
        rooms = [engine.max_model_len - len(r.prompt_token_ids) for r in reqs]
        limits = [min(r.params.max_tokens or room, room) for r, room in zip(reqs, rooms)]
        self.admission.reserve(live.pid, self.admission.step_blocks(
            [len(r.prompt_token_ids) for r in reqs], limits), self.admission.turn_blocks(limits))
        for slot, (req, rid) in enumerate(zip(reqs, live.in_flight)):
            # a started program's next step goes before new programs' first steps
            step_fut = self.driver.submit(req.prompt_token_ids, req.params, request_id=rid,
                                          prompt=req.prompt, pin=live.pid,
                                          front=bool(live.run.history),
                                          **({} if lora is None else {"lora_request": lora}))
            step_fut.add_done_callback(
                lambda f, s=slot: self._worker.submit(self._guarded, live, self._on_step, live,
                                                      s, f))

    def _on_step(self, live: _Live, slot: int, step_fut: Future) -> None:
        exc = step_fut.exception()
        if exc is not None:
            if not self._is_dead(exc):
                exc = ProgramError(f"program {self.program.name!r} step {live.run.num_steps}: "
                                   f"{type(exc).__name__}: {exc}")
            self._finish(live, exc)
            return
        live.results[slot] = result_of(live.requests[slot], step_fut.result())
        self.admission.step_done(len(live.results[slot].token_ids))  # type: ignore[union-attr]
        if all(r is not None for r in live.results):
            live.in_flight = []
            live.run.feed(live.results)  # type: ignore[arg-type]
            self._launch(live)
            self._fill()  # the guard may have lifted, or the pool has room again

    def _finish(self, live: _Live, exc: BaseException | None) -> None:
        if self._live.pop(live.row_future, None) is None:
            return  # abandoned, or already finished by an earlier failure
        self.admission.end(live.pid, completed=exc is None)
        if self.driver.dead is None:
            self.driver.call(lambda engine: self._drop(engine, live))
        if exc is not None:
            live.row_future.set_exception(exc)
        else:
            live.row_future.set_result(live.run.output)
        # its room goes to the backlog (later, on this thread: this may run inside `_fill`)
        self._later(self._fill)

    def _later(self, fn: Callable[..., None], *args: Any) -> None:
        try:
            self._worker.submit(fn, *args)
        except RuntimeError:  # shut down: nothing is left to start
            pass

    @staticmethod
    def _drop(engine: Any, live: _Live) -> None:
        for rid in live.in_flight:
            engine.abort(rid)  # False when it finished meanwhile
        engine.unpin(live.pid)
