"""`--runner local`: one engine in this process, results streamed as they finish.

Requests are built exactly as the Python API builds them, so the same seed gives the same
text: a chat request is `LLM.chat`'s rendering, a `/v1/completions` prompt is `LLM.generate`'s
(sent as written), and a table row goes through the connectors' `RequestBuilder`. An unseeded
sampled request is seeded from its prompt tokens, as the connectors seed one, so the local and
the Ray runner agree. `n > 1` and logprobs come back in full here.

When the engine dies, every request in it is answered with the `engine_failed` code (the
command's `--resume` runs those again) and nothing more is submitted: the rest of the input is
left for the `--resume` too.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any

from batchgen_data.cli.inputs import WorkItem
from batchgen_data.cli.outcome import Emit, Outcome
from batchgen_data.cli.outputs import ENGINE_FAILED
from batchgen_data.connectors.common import RequestBuilder, encode_prompt, seeded
from batchgen_data.connectors.handler import RowError
from batchgen_data.connectors.image_rows import images_kwargs
from batchgen_data.inputs.image_options import ImageOptions
from batchgen_data.inputs.image_parts import has_parts
from batchgen_data.lora_request import LoRARequest
from batchgen_data.openai.batch_output import Choice
from batchgen_data.report.record import EngineSampler, RunRecord
from batchgen_data.sampling_params import SamplingParams

ACTOR = "local"


class LocalRunner:
    def __init__(self, model: str | None, engine_kwargs: dict[str, Any],
                 default_params: dict[str, Any] | None = None, record: RunRecord | None = None,
                 max_in_flight: int | None = None) -> None:
        from batchgen_data.engine.driver import EngineDriver  # torch: only when a run starts
        from batchgen_data.engine.engine import Engine

        self.record = record if record is not None else RunRecord()
        self.engine = Engine.from_kwargs(model, **engine_kwargs)
        self.driver = EngineDriver(self.engine)
        self.driver.step_hooks.append(EngineSampler(self.record, ACTOR))
        self.builder = RequestBuilder.from_engine(self.engine, default_params,
                                                  image_options=ImageOptions.of(engine_kwargs))
        # rows in the engine at once: enough to keep its batch full, few enough that a huge
        # input is read as it goes rather than queued whole
        self.max_in_flight = max_in_flight or 2 * self.engine.config.scheduler.max_num_seqs
        self.submitted = 0  # requests handed to the engine (tests count them)
        self.dead: BaseException | None = None  # why the engine died, once it has
        self._ids = 0

    def token_text(self, token_id: int) -> str:
        return self.engine.tokenizer.decode([token_id])

    def run(self, items: Iterable[WorkItem], emit: Emit) -> None:
        pending: dict[Future, WorkItem] = {}
        source: Iterator[WorkItem] = iter(items)
        exhausted = False
        try:
            while pending or not (exhausted or self.dead):
                while not (exhausted or self.dead) and len(pending) < self.max_in_flight:
                    item = next(source, None)
                    if item is None:
                        exhausted = True
                        break
                    fut = self._submit(item, emit)
                    if fut is not None:
                        pending[fut] = item
                if not pending:
                    continue
                # a timeout, not a blocking wait: a request queued for the engine as its loop
                # died may never be resolved, and must still be answered
                done, _ = wait(list(pending), timeout=1.0, return_when=FIRST_COMPLETED)
                if not done and self.driver.dead is not None:
                    self.dead = self.driver.dead
                    done = set(pending)
                for fut in done:
                    emit(self._outcome(pending.pop(fut), fut))
        finally:
            self.driver.shutdown()

    def _submit(self, item: WorkItem, emit: Emit) -> Future | None:
        from batchgen_data.engine.driver import EngineDeadError

        try:
            ids, params, text, lora, images = self._request(item)
            self._ids += 1
            fut = self.driver.submit(ids, params, request_id=f"cli-{self._ids}", prompt=text,
                                     lora_request=lora, **images_kwargs(images))
        except EngineDeadError as e:  # not this request's fault: it is left for --resume
            self.dead = e
            return None
        except (RowError, ValueError, TypeError) as e:
            emit(Outcome(item, error=_message(item, e), error_code="invalid_request", actor=ACTOR))
            return None
        self.submitted += 1
        return fut

    def _request(self, item: WorkItem) -> tuple[list[int], SamplingParams, str | None,
                                                LoRARequest | None, tuple[Any, ...]]:
        if item.request is None:  # a table row: the connectors' own rules
            req = self.builder.build(item.row)
            return req.prompt_token_ids, seeded(req.params, self.engine.config.seed,
                                                req.prompt_token_ids), req.prompt, req.lora, \
                req.images
        row = item.row
        column = next(c for c in ("messages", "prompt_token_ids", "prompt") if c in row)
        chat = {"chat_template_kwargs": row.get("chat_template_kwargs")}  # enable_thinking
        images: tuple[Any, ...] = ()
        if column == "messages" and has_parts(row[column]):  # image_url parts
            ids, text, images = self.builder.with_images(column, row[column], [], row)
        else:
            ids, text = encode_prompt(row[column], self.engine.tokenizer, column,
                                      as_chat=False, chat=chat)
        params = SamplingParams.from_dict(dict(row["sampling_params"]))
        self.engine.check_request(ids, params)
        # the line's "model" names a LoRA adapter (with enable_lora; connectors/lora_rows.py)
        lora = self.builder.lora_for(row)
        return ids, seeded(params, self.engine.config.seed, ids), text, lora, images

    def _outcome(self, item: WorkItem, fut: Future) -> Outcome:
        from batchgen_data.engine.driver import EngineDeadError

        if not fut.done():  # queued as the engine died: it never reached the engine
            return Outcome(item, error=_message(item, EngineDeadError(
                f"engine loop died: {self.dead!r}")), error_code=ENGINE_FAILED, actor=ACTOR)
        exc = fut.exception()
        if isinstance(exc, EngineDeadError):
            self.dead = self.dead or exc
            return Outcome(item, error=_message(item, exc), error_code=ENGINE_FAILED,
                           actor=ACTOR)
        if exc is not None:
            return Outcome(item, error=_message(item, exc), error_code="generation_failed",
                           actor=ACTOR)
        out = fut.result()
        num_top = int(item.row.get("sampling_params", {}).get("logprobs") or 0) \
            if isinstance(item.row.get("sampling_params"), dict) else 0
        choices = [Choice(c.text, list(c.token_ids), c.finish_reason, c.logprobs, num_top,
                          c.reasoning_text, c.num_reasoning_tokens, c.tool_calls)
                   for c in out.outputs]
        return Outcome(item, choices, len(out.prompt_token_ids), actor=ACTOR)


def _message(item: WorkItem, exc: BaseException) -> str:
    text = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
    line = item.request.line if item.request is not None else None
    return f"line {line}: {text}" if line is not None else text
