"""EngineDriver: runs an engine's step loop on a background thread.

Connectors (Ray actors serving several input batches at once, Spark tasks) submit requests from
any thread and get a `concurrent.futures.Future` per request; all of them feed the one scheduler,
so the engine always has as many sequences to batch as are in flight. Work that must touch the
engine between steps (export/import for migration, load reports) goes through `call`.
"""
from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from typing import Any, TypeVar

from batchgen_data.engine.engine import Engine
# EngineDeadError lives beside the step's failure search (which lets it through untouched) and
# is named here, where the connectors have always imported it from
from batchgen_data.core.errors import EngineDeadError, RequestFailedError
from batchgen_data.engine.step_failure import request_error
from batchgen_data.lora_request import LoRARequest
from batchgen_data.outputs import RequestOutput
from batchgen_data.sampling_params import SamplingParams

T = TypeVar("T")


class EngineDriver:
    def __init__(self, engine: Engine, name: str = "batchgen-engine") -> None:
        self.engine = engine
        # (call, its Future, whether the call's return value settles that Future: a submit's
        # Future is settled by its request's end instead, or by the engine's death)
        self._inbox: deque[tuple[Callable[[Engine], Any], Future, bool]] = deque()
        self._inbox_lock = threading.Lock()  # a post never lands after the loop's death
        self._futures: dict[str, Future] = {}
        self._wake = threading.Event()
        self._stop = False
        self._dead: BaseException | None = None
        self.step_hooks: list[Callable[[Engine], None]] = []
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    # ---- client side (any thread) -----------------------------------------------------------
    def submit(self, prompt_token_ids: list[int], params: SamplingParams,
               request_id: str | None = None, prompt: str | None = None,
               lora_request: LoRARequest | None = None, pin: str | None = None,
               front: bool = False, alone: bool = False,
               mm_inputs: list[Any] | None = None) -> Future:
        """Queue one request; invalid input raises ValueError here, synchronously (an
        adapter is read from its directory here too, off the engine thread). `lora_request`,
        `pin`, `front`, `alone` and `mm_inputs` (the prompt's images) as in `Engine.submit`."""
        self.engine.check_request(prompt_token_ids, params)
        self.engine.check_lora(lora_request)
        fut: Future = Future()

        def add(engine: Engine) -> None:
            try:
                rid = engine.submit(prompt_token_ids, params, request_id=request_id, prompt=prompt,
                                    pin=pin, front=front, lora_request=lora_request,
                                    alone=alone, mm_inputs=mm_inputs)
            except Exception as e:  # e.g. a duplicate request id: fail this request only
                fut.set_exception(e)
                return
            self._futures[rid] = fut

        self._post(add, fut, settles=False)
        return fut

    def call(self, fn: Callable[[Engine], T]) -> "Future[T]":
        """Run `fn(engine)` on the engine thread between two steps."""
        fut: Future = Future()
        self._post(fn, fut)
        return fut

    def adopt(self, request_id: str, fut: Future) -> None:
        """Route the result of a request added through `call` (e.g. an import) to `fut`."""
        self._futures[request_id] = fut

    def release(self, request_id: str) -> Future | None:
        """Stop routing `request_id`'s result (it was exported); returns its Future, if any."""
        return self._futures.pop(request_id, None)

    @property
    def dead(self) -> BaseException | None:
        """Why the engine loop died, or None while it runs."""
        return self._dead

    def num_in_flight(self) -> int:
        return len(self._futures) + len(self._inbox)

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout)

    def _post(self, fn: Callable[[Engine], Any], fut: Future, settles: bool = True) -> None:
        with self._inbox_lock:
            if self._dead is not None:
                raise EngineDeadError(f"engine loop died: {self._dead!r}") from self._dead
            self._inbox.append((fn, fut, settles))
        self._wake.set()

    # ---- engine thread ------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self._stop:
                self._drain_inbox()
                if self.engine.has_unfinished():
                    for out in self.engine.step():
                        self._resolve(out)
                    for hook in self.step_hooks:
                        hook(self.engine)
                else:
                    self._wake.wait(0.5)
                    self._wake.clear()
        except BaseException as e:  # noqa: BLE001 - every waiter must learn the engine died
            err = EngineDeadError(f"engine loop died: {e!r}", getattr(e, "suspects", ()))
            with self._inbox_lock:  # from here no post lands in the inbox
                self._dead = e
            waiting = [*self._futures.values(), *(fut for _, fut, _ in self._inbox)]
            self._inbox.clear()
            for fut in waiting:
                _fail(fut, err)

    def _drain_inbox(self) -> None:
        while self._inbox:
            fn, fut, settles = self._inbox.popleft()
            try:
                result = fn(self.engine)
            except Exception as e:  # a bad call fails its caller, not the engine
                _fail(fut, e)
            else:
                if settles:
                    try:
                        fut.set_result(result)
                    except InvalidStateError:  # cancelled by its caller meanwhile
                        pass

    def _resolve(self, out: RequestOutput) -> None:
        fut = self._futures.pop(out.request_id, None)
        if fut is not None:
            error = request_error(out)
            try:
                if error is None:
                    fut.set_result(out)
                else:
                    fut.set_exception(RequestFailedError(error))
            except InvalidStateError:  # cancelled by its caller meanwhile: nobody is waiting
                pass


def _fail(fut: Future, exc: BaseException) -> None:
    """`fut` fails with `exc` unless it already ended (its caller cancelled it)."""
    try:
        fut.set_exception(exc)
    except InvalidStateError:
        pass
