"""`--runner ray` (the default when Ray is installed): `build_processor` over a Ray Dataset.

`ray.init()` joins the cluster `RAY_ADDRESS` names, else starts a local Ray. Rows stream back
through `Dataset.iter_rows()` as the engines finish them, so output lines are written as they
come. Work items become rows as `dataset_rows.py` says (the same rows `--runner spark` runs);
`n > 1` samples and logprobs come back in the connectors' `samples`, `logprobs` and
`top_logprobs` columns.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from batchgen_data.cli.dataset_rows import KEY, dataset_row, load_tokenizer, top_count
from batchgen_data.cli.inputs import WorkItem
from batchgen_data.cli.outcome import Emit, outcome_from_row
from batchgen_data.report.record import RunRecord


class RayRunner:
    def __init__(self, model: str | None, engine_kwargs: dict[str, Any],
                 default_params: dict[str, Any], record: RunRecord | None = None,
                 actors: int = 1, batch_size: int = 16) -> None:
        import ray

        self.record = record if record is not None else RunRecord()
        self.model = model
        self.engine_kwargs = engine_kwargs
        self.default_params = default_params
        self.actors = actors
        self.batch_size = batch_size
        self.tokenizer = load_tokenizer(model, engine_kwargs)
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
            row = dataset_row(item, self.tokenizer, emit, "ray")
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
