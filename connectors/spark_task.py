"""Executor side of the Spark connector: what one Spark task does with its rows.

A task finds (or builds) its worker's engine, turns each row into an engine request (or an error
message), and submits it to the engine's driver thread; results come back as Futures that the
windows in `streaming` hand back to Spark. Nothing here imports pyspark at module level except
through `task_resources`, so the logic is testable without a JVM.
"""
from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any, Iterable

import pyarrow as pa

from batchgen_data.connectors import engine_cache
from batchgen_data.connectors.engine_cache import EngineSpec
from batchgen_data.connectors.streaming import BatchSizeProbe, failed_future
from batchgen_data.sampling_params import SamplingParams

ON_ERROR = ("row", "raise")


class RowError(ValueError):
    """A row the engine cannot take (or that failed in it); becomes the row's `error` value."""


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

    device = engine_cache.pick_device(gpus, engine_cache.cuda_visible_devices(),
                                      torch.cuda.is_available())
    return engine_cache.ENGINES.get(settings.spec.resolved(device, cpus))


def row_seed(settings: TaskSettings, key: str) -> SamplingParams:
    """Sampling params for one row, seeded from the row itself when the user gave no seed.

    A retried or speculative task then samples the same tokens for the same row.
    """
    params = SamplingParams.from_dict(settings.params)
    if params.seed is not None:
        return params
    return replace(params, seed=engine_cache.derive_seed(settings.spec.base_seed, key))


def submit_rows(driver: engine_cache.DriverLike, settings: TaskSettings,
                requests: Iterable[tuple[list[int], str | None, SamplingParams] | str]) -> list[Future]:
    """Submit prepared requests; an error message, or input the engine refuses, becomes a
    finished Future holding a `RowError` (or is raised at once when on_error="raise")."""
    futures = []
    for req in requests:
        if isinstance(req, str):
            futures.append(_reject(settings, req))
            continue
        ids, prompt, params = req
        try:
            futures.append(driver.submit(ids, params, prompt=prompt))
        except ValueError as e:
            futures.append(_reject(settings, str(e)))
    return futures


def _reject(settings: TaskSettings, message: str) -> Future:
    if settings.on_error == "raise":
        raise RowError(message)
    return failed_future(RowError(message))


def outcome(fut: Future, settings: TaskSettings) -> tuple[Any, str | None]:
    """(RequestOutput, None) or (None, error message); re-raises when on_error="raise"."""
    exc = fut.exception()
    if exc is None:
        return fut.result(), None
    if settings.on_error == "raise":
        raise exc
    return None, f"{type(exc).__name__}: {exc}" if not isinstance(exc, RowError) else str(exc)


DEBUG_FIELD = "engine_max_batch_seqs"


def output_schema(debug_stats: bool = False) -> pa.Schema:
    schema = _output_schema()
    return schema.append(pa.field(DEBUG_FIELD, pa.int32())) if debug_stats else schema


class TaskSession:
    """One Spark task's view of its worker's engine: rows in as Futures, results out as Arrow."""

    def __init__(self, settings: TaskSettings) -> None:
        self.settings = settings
        self._driver: engine_cache.DriverLike | None = None
        self._probe: BatchSizeProbe | None = None

    @property
    def driver(self) -> engine_cache.DriverLike:
        # built on first use, so an empty partition never loads a model
        if self._driver is None:
            self._driver = task_driver(self.settings)
            self._probe = BatchSizeProbe(self._driver.engine)
        return self._driver

    def submit(self, values: list[Any], keys: list[Any]) -> list[Future]:
        """One Future per input value; `keys` (prompts or ids) seed unseeded sampling."""
        tokenizer = self.driver.engine.tokenizer
        requests: list[tuple[list[int], str | None, SamplingParams] | str] = []
        for value, key in zip(values, keys):
            prepared = _prepare(value, tokenizer)
            if isinstance(prepared, str):
                requests.append(prepared)
            else:
                ids, prompt = prepared
                requests.append((ids, prompt, row_seed(self.settings, str(key))))
        return submit_rows(self.driver, self.settings, requests)

    def outputs(self, futures: list[Future]) -> pa.Table:
        """Finished Futures -> output columns (one row each, same order)."""
        rows = [_result_row(*outcome(f, self.settings)) for f in futures]
        if self.settings.debug_stats:
            peak = self._probe.max_batch_seqs() if self._probe is not None else 0
            for row in rows:
                row[DEBUG_FIELD] = peak
        return pa.Table.from_pylist(rows, schema=output_schema(self.settings.debug_stats))


# ---- stand-ins until connectors/common.py lands ------------------------------------------
def _output_schema() -> pa.Schema:
    return pa.schema([("generated_text", pa.string()), ("generated_token_ids", pa.list_(pa.int32())),
                      ("num_prompt_tokens", pa.int32()), ("num_generated_tokens", pa.int32()),
                      ("finish_reason", pa.string()), ("error", pa.string())])


def _prepare(value: Any, tokenizer: Any) -> tuple[list[int], str | None] | str:
    if value is None:
        return "prompt is null"
    if isinstance(value, str):
        return (tokenizer.encode(value), value) if value else "prompt is an empty string"
    if isinstance(value, list) and value and all(isinstance(m, dict) for m in value):
        text = tokenizer.apply_chat_template(value, tokenize=False, add_generation_prompt=True)
        return tokenizer.encode(text, add_special_tokens=False), text
    return f"prompt must be a string or chat messages, got {type(value).__name__}"


def _result_row(out: Any, error: str | None) -> dict[str, Any]:
    if out is None:
        return {"error": error}
    c = out.outputs[0]
    return {"generated_text": c.text, "generated_token_ids": list(c.token_ids),
            "num_prompt_tokens": len(out.prompt_token_ids), "num_generated_tokens": len(c.token_ids),
            "finish_reason": c.finish_reason, "error": None}
