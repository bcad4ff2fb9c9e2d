"""`--runner ray` (the default when Ray is installed): `build_processor` over a Ray Dataset.

`ray.init()` joins the cluster `RAY_ADDRESS` names, else starts a local Ray. Rows stream back
through `Dataset.iter_rows()` as the engines finish them, so output lines are written as they
come. A `/v1/completions` prompt is tokenized here, in the driver, and sent as
`prompt_token_ids`: the connectors template a plain prompt as a chat turn, and vLLM's
completions endpoint does not. `n > 1` samples and logprobs come back in the connectors'
`samples`, `logprobs` and `top_logprobs` columns; only the top alternatives of samples after the
first are not there, so `n > 1` together with `top_logprobs` is answered with an error line that
says to use `--runner local` for it.
"""
from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from batchgen_data.cli.inputs import WorkItem
from batchgen_data.cli.outcome import Emit, Outcome, outcome_from_row
from batchgen_data.report.record import RunRecord

KEY = "__key"


class RayRunner:
    def __init__(self, model: str | None, engine_kwargs: dict[str, Any],
                 default_params: dict[str, Any], record: RunRecord | None = None,
                 actors: int = 1, batch_size: int = 16) -> None:
        import ray

        from batchgen_data.models.loader import load_tokenizer, resolve_model_path

        self.record = record if record is not None else RunRecord()
        self.model = model
        self.engine_kwargs = engine_kwargs
        self.default_params = default_params
        self.actors = actors
        self.batch_size = batch_size
        self.tokenizer = load_tokenizer(resolve_model_path(engine_kwargs.get("tokenizer", model)),
                                        bool(engine_kwargs.get("trust_remote_code", False)))
        if not ray.is_initialized():
            ray.init(configure_logging=False, log_to_driver=False)
        ctx = ray.data.DataContext.get_current()
        ctx.enable_progress_bars = False  # the command prints its own progress line
        ctx.print_on_execution_start = False
        self.submitted = 0

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def run(self, items: Iterable[WorkItem], emit: Emit) -> None:
        import ray

        from batchgen_data.connectors.ray.metrics import RunCollector
        from batchgen_data.connectors.ray.processor import (BatchGenProcessorConfig,
                                                            build_processor)

        by_key: dict[str, WorkItem] = {}
        rows = []
        for item in items:
            row = self._row(item, emit)
            if row is not None:
                by_key[item.key] = item
                rows.append(row)
        if not rows:
            return
        config = BatchGenProcessorConfig(
            model_source=self.model, concurrency=self.actors,
            batch_size=max(1, min(self.batch_size, -(-len(rows) // self.actors))),
            engine_kwargs=self.engine_kwargs, sampling_params=self.default_params)
        processor = build_processor(config)
        collector = RunCollector.start(processor.job_id)
        self.submitted = len(rows)
        try:
            for out in processor(ray.data.from_items(rows)).iter_rows():
                item = by_key[out[KEY]]
                emit(outcome_from_row(item, out, actor="ray", num_top=top_count(item)))
        finally:
            self.record.merge(ray.get(collector.part.remote()))
            ray.kill(collector)

    def _row(self, item: WorkItem, emit: Emit) -> dict[str, Any] | None:
        """The Dataset row of an item: every input column present (null where unused), so
        all blocks share one schema; sampling overrides as JSON text, so rows with different
        fields (a JSON schema, say) need no common struct type."""
        src = item.row
        params = dict(src.get("sampling_params") or {}) if item.request is not None else None
        if params is not None and (params.get("n") or 1) > 1 and (params.get("logprobs") or 0) > 0:
            emit(Outcome(item, error=f"line {item.request.line}: n > 1 with top_logprobs is "
                                     "returned by --runner local only",
                         error_code="unsupported_field", actor="ray"))
            return None
        row = {KEY: item.key, "prompt": src.get("prompt"), "messages": src.get("messages"),
               "prompt_token_ids": src.get("prompt_token_ids")}
        if item.request is not None and not item.request.is_chat and row["prompt"] is not None:
            row["prompt_token_ids"] = self.tokenizer.encode(row["prompt"])
        overrides = params if params is not None else src.get("sampling_params")
        row["sampling_params"] = (overrides if isinstance(overrides, str) or overrides is None
                                  else json.dumps(overrides))
        if item.request is None:  # a table row keeps its other columns
            row.update({k: v for k, v in src.items() if k not in row})
        return row


def top_count(item: WorkItem) -> int:
    """How many top alternatives per token the item's request asked for (0: none)."""
    params = item.row.get("sampling_params")
    return int(params.get("logprobs") or 0) if isinstance(params, dict) else 0
