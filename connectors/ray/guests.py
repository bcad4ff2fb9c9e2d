"""The importer's side of cross-actor migration: rows other engines moved here.

An import message carries a row's exported state, or, when the state holds KV, an `ObjectRef`
its owner put into Ray's object store (`pack`), so the coordinator relays a handle and the bytes
go point to point. The importer fetches it (`unpack`), continues the request as a guest
(`Engine.import_`) and mails the finished `RequestOutput` back to the owner; a state it cannot
fetch or import is mailed back as failed, and the owner runs the row at home.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from batchgen_data.connectors.ray.coordinator import Message, kv_nbytes

if TYPE_CHECKING:
    from batchgen_data.engine.driver import EngineDriver
    from batchgen_data.engine.engine import Engine

log = logging.getLogger(__name__)


def pack(state: dict[str, Any], counts: dict[str, Any]) -> Any:
    """What the import message carries: a queued row's state as it is (token ids and params,
    small), a state with KV as an `ObjectRef` (`counts`: the bytes put and the time it took)."""
    nbytes = kv_nbytes(state)
    if nbytes == 0:
        return state
    import ray

    t0 = time.perf_counter()
    ref = ray.put(state)
    counts["kv_put_s"] += time.perf_counter() - t0
    counts["kv_bytes_sent"] += nbytes
    return ref


def unpack(parcel: Any, counts: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """The exported state of an import message, fetched from the object store if need be."""
    if isinstance(parcel, dict):
        return parcel
    import ray

    t0 = time.perf_counter()
    state = ray.get(parcel, timeout=timeout_s)
    counts["kv_get_s"] += time.perf_counter() - t0
    counts["kv_bytes_received"] += kv_nbytes(state)
    return state


class Guests:
    """The rows this engine runs for other engines, by request id, with their owners."""

    def __init__(self, driver: EngineDriver, post: Callable[[str, Message], None],
                 counts: dict[str, Any], changed: threading.Condition, rpc_timeout_s: float,
                 disabled: Callable[[], bool]) -> None:
        """`post(dst, msg)`: mail to another engine; `changed` is notified as a guest leaves;
        `disabled()`: migration stopped, so results are no longer mailed."""
        self.driver, self._post, self.counts = driver, post, counts
        self._changed, self._timeout_s, self._disabled = changed, rpc_timeout_s, disabled
        self.owners: dict[str, str] = {}  # imported rid -> owner; only the engine thread

    def add(self, owner: str, parcel: Any, rid: str) -> None:
        """Import `rid` from `owner`; its result goes back when it finishes."""
        try:
            state = unpack(parcel, self.counts, self._timeout_s)
        except Exception as e:  # noqa: BLE001 - object lost or owner gone: it runs at home
            log.warning("batchgen migration: cannot fetch row %s from %s (%r)", rid, owner, e)
            self._post(owner, ("failed", rid))
            return
        fut: Future = Future()

        def add(engine: Engine) -> None:
            try:
                engine.import_(state)
            except Exception:  # noqa: BLE001 - the owner runs it instead
                self._post(owner, ("failed", rid))
                raise
            self.owners[rid] = owner
            self.driver.adopt(rid, fut)
            self.counts["kv_imported_tokens"] += sum(
                r.num_computed_tokens for r in engine.movable() if r.request_id == rid)

        def done(f: Future) -> None:
            with self._changed:
                self.owners.pop(rid, None)
                self._changed.notify_all()
            out = None if f.exception() else f.result()
            if out is not None and not self._disabled() and \
                    out.outputs[0].finish_reason != "abort":
                self._post(owner, ("deliver", rid, out))

        fut.add_done_callback(done)
        self.driver.call(add)
        self.counts["imported"] += 1

    def drop_all(self) -> None:
        """Abort every guest (migration stopped: their owners run them at home)."""

        def drop(engine: Engine) -> None:
            for rid in list(self.owners):
                engine.abort(rid)

        self.driver.call(drop)
