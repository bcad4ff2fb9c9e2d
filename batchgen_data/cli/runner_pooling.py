"""The command's pooling lines (`/v1/embeddings`, `/v1/score`, `/v1/rerank`): one pooling
engine in this process, each line's inputs submitted as requests, its output line written when
the last of them finishes (completion order across lines).

Inputs become engine requests as `LLM.embed` / `LLM.score` make them (`pooling_api`), so a
line's embeddings equal the offline ones. A line that cannot run (an empty input, a text over
the model's length, `dimensions` the model cannot give, a pair for a model that cannot score
pairs) becomes an error line naming its line and input; the other lines go on.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from batchgen_data.cli.inputs import WorkItem
from batchgen_data.openai.pooling import PoolingLine, pooling_success_line
from batchgen_data.openai.batch_output import error_line

EmitLine = Callable[[dict[str, Any], bool], None]  # (output line, failed)


@dataclass
class _Line:
    item: WorkItem
    line: PoolingLine
    request_ids: list[str] = field(default_factory=list)
    values: dict[str, Any] = field(default_factory=dict)
    prompt_tokens: int = 0


class PoolingRunner:
    def __init__(self, model: str | None, engine_kwargs: dict[str, Any],
                 model_name: str, max_in_flight: int | None = None) -> None:
        from batchgen_data.engine.pooling import PoolingEngine  # torch: only when a run starts

        self.engine = PoolingEngine.from_kwargs(model, **engine_kwargs)
        self.model_name = model_name
        self.max_in_flight = max_in_flight or 4 * self.engine.max_num_seqs
        self._ids = 0

    def run(self, items: Sequence[WorkItem], emit: EmitLine) -> None:
        live: dict[str, _Line] = {}  # request id -> its line
        source = iter(items)
        exhausted = False
        while live or not exhausted:
            while not exhausted and len(live) < self.max_in_flight:
                item = next(source, None)
                if item is None:
                    exhausted = True
                    break
                self._submit(item, live, emit)
            if not live:
                continue
            for out in self.engine.step():
                ln = live.pop(out.request_id)
                o = out.outputs
                ln.values[out.request_id] = o.embedding if ln.line.task == "embed" else o.score
                ln.prompt_tokens += len(out.prompt_token_ids)
                if len(ln.values) == len(ln.request_ids):
                    emit(self._success(ln), False)

    def _submit(self, item: WorkItem, live: dict[str, _Line], emit: EmitLine) -> None:
        from batchgen_data.engine import pooling_api
        from batchgen_data.pooling_params import PoolingParams

        assert item.request is not None and item.request.pooling is not None
        line = item.request.pooling
        engine = self.engine
        tok = engine.tokenizer
        try:
            params = PoolingParams.from_dict(line.params)
            if line.task == "score" and not engine.cross_encoder:
                raise ValueError("this model cannot score pairs (score and rerank need a "
                                 "cross-encoder: a *ForSequenceClassification with "
                                 "num_labels=1)")
            encoded = pooling_api.encode_all(
                (lambda a, b: pooling_api.encode_pair(tok, a, b)) if line.task == "score" else
                (lambda t: pooling_api.encode_text(tok, t if isinstance(t, str)
                                                   else {"prompt_token_ids": t})),
                line.inputs, "input")
            checked = []
            for i, (ids, types, _) in enumerate(encoded):
                try:
                    checked.append(engine.prepare(ids, params, line.task, types))
                except (TypeError, ValueError) as e:
                    raise type(e)(f"input[{i}]: {e}") from None
        except (TypeError, ValueError) as e:
            emit(error_line(item.request.custom_id, "invalid_request",
                            f"line {item.request.line}: {e}"), True)
            return
        ln = _Line(item, line)
        for ids, types in checked:
            self._ids += 1
            rid = f"cli-pool-{self._ids}"
            engine.submit(ids, params, line.task, request_id=rid, token_type_ids=types)
            ln.request_ids.append(rid)
            live[rid] = ln

    def _success(self, ln: _Line) -> dict[str, Any]:
        assert ln.item.request is not None
        values = [ln.values[r] for r in ln.request_ids]
        return pooling_success_line(ln.item.request.custom_id or ln.item.key,
                                    ln.item.request.model or self.model_name, ln.line, values,
                                    ln.prompt_tokens)
