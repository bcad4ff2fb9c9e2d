"""The pooling tasks' front door shared by `LLM.embed / classify / score` and the connectors:
which runner a model gets, prompts and pairs to token ids (with token types), and running a
list of requests through a `PoolingEngine` to results in input order.

`score(text_1, text_2)` follows vLLM: a cross-encoder (a classifier with one label) reads each
pair in one pass (`[CLS] a [SEP] b [SEP]`, token types 0/1 for BERT-style models) and gives
its sigmoid; any other model embeds both sides and gives their cosine similarity.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from batchgen_data.engine.pooling import PoolingEngine
from batchgen_data.models import loader
from batchgen_data.models.registry import is_pooling_only
from batchgen_data.pooling_params import PoolingParams, PoolingRequestOutput, ScoringOutput
from batchgen_data.inputs.prompt_checks import check_prompt_text, first_bad_token

RUNNERS = ("auto", "generate", "pooling")
Encoded = tuple[list[int], "list[int] | None", "str | None"]


def uses_pooling(model: str | None, runner: str, trust_remote_code: bool = False,
                 hf_overrides: dict[str, Any] | None = None) -> bool:
    """runner "pooling"/"generate" as asked; "auto": pooling for a checkpoint that can only
    pool (an encoder, a classifier, a headless base; `hf_overrides` may say so, as for
    Qwen3-Reranker) or a sentence-transformers directory."""
    if runner not in RUNNERS:
        raise ValueError(f"runner={runner!r}: must be one of {RUNNERS}")
    if runner != "auto" or model is None:
        return runner == "pooling"
    path = loader.resolve_model_path(model)
    if (Path(path) / "modules.json").exists():
        return True
    config = loader.load_config(path, trust_remote_code)
    for key, value in (hf_overrides or {}).items():
        setattr(config, key, value)
    return is_pooling_only(config)


def encode_text(tokenizer: Any, prompt: Any) -> Encoded:
    """A prompt (str, or {"prompt": str} / {"prompt_token_ids": [...]}) to (ids, types, text)."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            bad = first_bad_token(ids)
            if bad is not None:
                raise (ValueError if isinstance(ids, (list, tuple)) else TypeError)(bad)
            return list(ids), None, prompt.get("prompt")
        if "prompt" in prompt:
            return encode_text(tokenizer, prompt["prompt"])
        raise ValueError("dict prompts need 'prompt' or 'prompt_token_ids'")
    text = check_prompt_text(prompt)
    enc = tokenizer(text)
    return list(enc["input_ids"]), _types(enc), text


def encode_pair(tokenizer: Any, text_1: Any, text_2: Any) -> Encoded:
    a, b = check_prompt_text(text_1), check_prompt_text(text_2)
    enc = tokenizer(a, b)
    return list(enc["input_ids"]), _types(enc), None


def _types(enc: Any) -> list[int] | None:
    types = enc.get("token_type_ids")
    return None if types is None or not any(types) else list(types)


def run_requests(engine: PoolingEngine, items: Sequence[Encoded], params: Sequence[PoolingParams],
                 task: str, use_tqdm: bool = False, where: str = "prompts"
                 ) -> list[PoolingRequestOutput]:
    """Submit every item (all checked first: nothing half-runs) and step until all are done;
    results in input order."""
    checked = []
    for i, ((ids, types, _), p) in enumerate(zip(items, params)):
        try:
            checked.append(engine.prepare(ids, p, task, types))
        except (TypeError, ValueError) as e:
            raise type(e)(f"{where}[{i}]: {e}") from None
    order = {}
    for (ids, types), (_, _, text), p in zip(checked, items, params):
        order[engine.submit(ids, p, task, prompt=text, token_type_ids=types)] = len(order)
    results: list[PoolingRequestOutput | None] = [None] * len(order)
    bar = tqdm(total=len(order), desc=task, disable=not use_tqdm)
    try:
        while engine.has_unfinished():
            for out in engine.step():
                if out.request_id in order:
                    results[order[out.request_id]] = out
                    bar.update(1)
    finally:
        bar.close()
    return results  # type: ignore[return-value]


def params_list(params: PoolingParams | Sequence[PoolingParams] | None, n: int,
                truncate_prompt_tokens: int | None = None) -> list[PoolingParams]:
    if params is None:
        params = PoolingParams(truncate_prompt_tokens=truncate_prompt_tokens)
    if isinstance(params, PoolingParams):
        return [params] * n
    out = list(params)
    if len(out) != n:
        raise ValueError(f"pooling_params: got {len(out)} for {n} prompts")
    for i, p in enumerate(out):
        if not isinstance(p, PoolingParams):
            raise TypeError(f"pooling_params[{i}] must be PoolingParams")
    return out


def encode_all(encode: Callable[..., Encoded], rows: Sequence[Any], where: str) -> list[Encoded]:
    out = []
    for i, row in enumerate(rows):
        try:
            out.append(encode(*row) if isinstance(row, tuple) else encode(row))
        except (TypeError, ValueError) as e:
            raise type(e)(f"{where}[{i}]: {e}") from None
    return out


def score_pairs(engine: PoolingEngine, text_1: Any, text_2: Any,
                params: PoolingParams | None, use_tqdm: bool) -> list[PoolingRequestOutput]:
    """vLLM's pairing: one text_1 against many text_2, or pair by pair."""
    lefts = [text_1] if isinstance(text_1, (str, dict)) else list(text_1)
    rights = [text_2] if isinstance(text_2, (str, dict)) else list(text_2)
    if len(lefts) == 1 and len(rights) > 1:
        lefts = lefts * len(rights)
    if len(lefts) != len(rights):
        raise ValueError(f"score: {len(lefts)} text_1 for {len(rights)} text_2 (give one "
                         "text_1, or as many as text_2)")
    p = params or PoolingParams()
    tok = engine.tokenizer
    if engine.cross_encoder:
        items = encode_all(lambda a, b: encode_pair(tok, a, b), list(zip(lefts, rights)),
                           "pairs")
        return run_requests(engine, items, [p] * len(items), "score", use_tqdm, "pairs")
    both = encode_all(lambda t: encode_text(tok, t), lefts + rights, "texts")
    embp = PoolingParams(dimensions=p.dimensions, normalize=True,
                         truncate_prompt_tokens=p.truncate_prompt_tokens)
    outs = run_requests(engine, both, [embp] * len(both), "embed", use_tqdm, "texts")
    n = len(lefts)
    results = []
    for i in range(n):
        a, b = outs[i], outs[n + i]
        cos = torch.nn.functional.cosine_similarity(torch.tensor(a.outputs.embedding),
                                                    torch.tensor(b.outputs.embedding), dim=0)
        results.append(PoolingRequestOutput(f"score-{a.request_id}-{b.request_id}", None,
                                            a.prompt_token_ids + b.prompt_token_ids,
                                            ScoringOutput(float(cos))))
    return results
