"""Work items as the rows of a Ray Dataset or a Spark DataFrame (`--runner ray` / `spark`).

The data-engine runners hand rows to the connectors, so a work item becomes a connector input
row here: every input column present (null where unused), so all blocks share one schema;
sampling overrides as JSON text, so rows with different fields (a JSON schema, say) need no
common struct type. A `/v1/completions` prompt is tokenized here, in the driver, and sent as
`prompt_token_ids`: the connectors template a plain prompt as a chat turn, and vLLM's completions
endpoint does not. `n > 1` together with `top_logprobs` is answered with an error line: only the
first sample's alternatives come back in the connectors' columns (`--runner local` has all).
"""
from __future__ import annotations

import json
from typing import Any

from batchgen_data.cli.inputs import WorkItem
from batchgen_data.cli.outcome import Emit, Outcome

KEY = "__key"  # the work item a row belongs to, carried through the job


def load_tokenizer(model: str | None, engine_kwargs: dict[str, Any]) -> Any:
    """The model's tokenizer, in the driver (no engine is built here)."""
    from batchgen_data.models.loader import load_tokenizer as load, resolve_model_path

    return load(resolve_model_path(engine_kwargs.get("tokenizer", model)),
                bool(engine_kwargs.get("trust_remote_code", False)))


def dataset_row(item: WorkItem, tokenizer: Any, emit: Emit, actor: str) -> dict[str, Any] | None:
    """The row of `item`, or None when it was answered here (an error line)."""
    src = item.row
    params = dict(src.get("sampling_params") or {}) if item.request is not None else None
    if params is not None and (params.get("n") or 1) > 1 and (params.get("logprobs") or 0) > 0:
        emit(Outcome(item, error=f"line {item.request.line}: n > 1 with top_logprobs is "
                                 "returned by --runner local only",
                     error_code="unsupported_field", actor=actor))
        return None
    row = {KEY: item.key, "prompt": src.get("prompt"), "messages": src.get("messages"),
           "prompt_token_ids": src.get("prompt_token_ids")}
    if item.request is not None and not item.request.is_chat and row["prompt"] is not None:
        row["prompt_token_ids"] = tokenizer.encode(row["prompt"])
    overrides = params if params is not None else src.get("sampling_params")
    row["sampling_params"] = (overrides if isinstance(overrides, str) or overrides is None
                              else json.dumps(overrides))
    if item.request is not None:  # a line's template kwargs (enable_thinking per line)
        ctk = src.get("chat_template_kwargs")
        row["chat_template_kwargs"] = None if ctk is None else json.dumps(ctk)
    if item.request is None:  # a table row keeps its other columns
        row.update({k: v for k, v in src.items() if k not in row})
    return row


def top_count(item: WorkItem) -> int:
    """How many top alternatives per token the item's request asked for (0: none)."""
    params = item.row.get("sampling_params")
    return int(params.get("logprobs") or 0) if isinstance(params, dict) else 0
