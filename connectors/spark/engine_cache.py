"""Spark: one engine per Python worker process, built lazily from plain configuration.

Spark ships only an `EngineSpec` (model name + engine kwargs) to executors. The first task that
needs an engine in a Python worker builds it; later tasks on the same, reused worker
(`spark.python.worker.reuse=true`, Spark's default) find it here instead of reloading weights.
The cache holds a single engine: a worker serves one device, and two models rarely fit on it.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from batchgen_data.config import make_engine_config
from batchgen_data.connectors.row_kinds import GENERATE, build_engine

log = logging.getLogger(__name__)


class DriverLike(Protocol):
    """What connectors need from `EngineDriver` (see docs/ENGINE_API.md)."""

    engine: Any

    @property
    def dead(self) -> BaseException | None: ...

    def submit(self, prompt_token_ids: list[int], params: Any, request_id: str | None = None,
               prompt: str | None = None) -> Any: ...

    def call(self, fn: Callable[[Any], Any]) -> Any: ...

    def shutdown(self) -> None: ...


@dataclass(frozen=True)
class EngineSpec:
    """Picklable recipe for an engine: what crosses from the Spark driver to executors.
    `task`: the rows it runs (a pooling task's engine is a pooling one, row_kinds.py).
    `factory`: a picklable `(model, **engine_kwargs) -> engine` the executors build it with
    instead (an engine around parts of one's own: `Engine(config, parts)`); None: the task's."""

    model: str | None = None
    engine_kwargs: tuple[tuple[str, Any], ...] = ()
    task: str = GENERATE
    factory: Callable[..., Any] | None = None

    @classmethod
    def create(cls, model: str | None, engine_kwargs: dict[str, Any],
               task: str = GENERATE, factory: Callable[..., Any] | None = None
               ) -> "EngineSpec":
        """Validate kwargs now (driver side) so a typo fails before any task starts."""
        make_engine_config(model, **engine_kwargs)
        if factory is not None and not callable(factory):
            raise TypeError(f"engine_factory must be callable, got {type(factory).__name__}")
        return cls(model, tuple(sorted(engine_kwargs.items())), task, factory)

    @property
    def kwargs(self) -> dict[str, Any]:
        return dict(self.engine_kwargs)

    @property
    def max_num_seqs(self) -> int:
        return make_engine_config(self.model, **self.kwargs).scheduler.max_num_seqs

    @property
    def base_seed(self) -> int:
        return make_engine_config(self.model, **self.kwargs).seed

    def resolved(self, device: str, num_threads: int | None,
                 rank_devices: list[int] | None = None) -> "EngineSpec":
        """Fill in device, the ranks' devices and CPU threads unless the user set them."""
        kw = self.kwargs
        if kw.get("device", "auto") == "auto":
            kw["device"] = device
            if rank_devices is not None and "rank_devices" not in kw:
                kw["rank_devices"] = tuple(rank_devices)
        if kw["device"] == "cpu" and num_threads and "num_threads" not in kw:
            kw["num_threads"] = num_threads
        return EngineSpec(self.model, tuple(sorted(kw.items())), self.task, self.factory)

    def key(self) -> str:
        # repr, not hash(): kwargs values may be lists, and the key must be stable in one process
        factory = None if self.factory is None else \
            f"{self.factory.__module__}.{getattr(self.factory, '__qualname__', '')}"
        return repr((self.model, self.engine_kwargs, self.task, factory))


def build_driver(spec: EngineSpec) -> DriverLike:
    """Load the real engine and start its stepping thread (imports torch: executor side only)."""
    from batchgen_data.engine.driver import EngineDriver

    if spec.factory is not None:
        return EngineDriver(spec.factory(spec.model, **spec.kwargs))
    return EngineDriver(build_engine(spec.task, spec.model, **spec.kwargs))


class EngineCache:
    """Process-wide holder of at most one driver; thread-safe."""

    def __init__(self, factory: Callable[[EngineSpec], DriverLike] = build_driver) -> None:
        self._factory = factory
        self._lock = threading.Lock()
        self._key: str | None = None
        self._driver: DriverLike | None = None

    def get(self, spec: EngineSpec) -> DriverLike:
        with self._lock:
            key = spec.key()
            if self._driver is not None and self._key != key:
                log.warning("batchgen: replacing cached engine %s with %s", self._key, key)
                self._driver.shutdown()
                self._driver, self._key = None, None
            if self._driver is None:
                self._driver = self._factory(spec)
                self._key = key
            return self._driver

    def discard(self, driver: DriverLike) -> None:
        """Forget `driver` if it is the cached one (its engine died): the next task rebuilds."""
        with self._lock:
            if self._driver is driver:
                self._driver, self._key = None, None

    def clear(self) -> None:
        with self._lock:
            if self._driver is not None:
                self._driver.shutdown()
            self._driver, self._key = None, None


ENGINES = EngineCache()
