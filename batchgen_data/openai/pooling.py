"""OpenAI Batch lines for the pooling endpoints: `/v1/embeddings` (OpenAI's), `/v1/score` and
`/v1/rerank` (vLLM's), parsed into engine inputs and answered with those APIs' bodies.

  {"custom_id": "e1", "method": "POST", "url": "/v1/embeddings",
   "body": {"model": "m", "input": ["a", "b"], "dimensions": 256, "encoding_format": "float"}}
  {"custom_id": "s1", "method": "POST", "url": "/v1/score",
   "body": {"model": "m", "queries": "query", "documents": ["doc a", "doc b"]}}
  {"custom_id": "r1", "method": "POST", "url": "/v1/rerank",
   "body": {"model": "m", "query": "query", "documents": ["doc a", "doc b"], "top_n": 1}}

The urls and request shapes are those vLLM's server and `run-batch` take: `/score` and
`/v1/score` with `queries` + `documents` (or `queries` + `items`, `data_1` + `data_2`, and the
older `text_1` + `text_2`); `/rerank`, `/v1/rerank` and `/v2/rerank`. `/v1/embeddings` answers
with OpenAI's `CreateEmbeddingResponse` (`object: "list"`, `data` of `{"object": "embedding",
"embedding": [...] | base64, "index": i}`, `model`, `usage`); base64 is the little-endian
float32 bytes, as OpenAI sends them. A score line answers with vLLM's `ScoreResponse`, a rerank
line with vLLM's `RerankResponse` (results by relevance, highest first, `top_n` of them).
"""
from __future__ import annotations

import base64
import struct
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

EMBEDDINGS_URL = "/v1/embeddings"
SCORE_URL = "/v1/score"
RERANK_URL = "/v1/rerank"
KIND_OF_URL = {EMBEDDINGS_URL: "embed", SCORE_URL: "score", "/score": "score",
               RERANK_URL: "rerank", "/rerank": "rerank", "/v2/rerank": "rerank"}
POOLING_URLS = tuple(KIND_OF_URL)
# fields that describe the call (vLLM's PoolingBasicRequestMixin): accepted, no effect
_IGNORED = ("model", "user", "metadata", "request_id")
# vLLM's names for one score request's two sides, in the order its server tries them
SCORE_SIDES = (("queries", "documents"), ("queries", "items"), ("data_1", "data_2"),
               ("text_1", "text_2"))
# vLLM's ClassifyRequestMixin: whether scores go through the activation (True by default)
_ACTIVATION = ("use_activation", "activation", "softmax")
_FIELDS = {"embed": ("input", "dimensions", "encoding_format", "truncate_prompt_tokens",
                     "normalize", "priority"),
           "score": (*{n for pair in SCORE_SIDES for n in pair}, "truncate_prompt_tokens",
                     "priority", "mm_processor_kwargs", *_ACTIVATION),
           "rerank": ("query", "documents", "top_n", "truncate_prompt_tokens", "priority",
                      "mm_processor_kwargs", *_ACTIVATION)}


@dataclass
class PoolingLine:
    """What one pooling line asks: the task, its inputs (texts, token lists or pairs) and the
    pooling parameters."""

    url: str
    task: str  # "embed" | "score"
    inputs: list[Any]  # str | list[int] for embed; (text_1, text_2) pairs for score
    params: dict[str, Any] = field(default_factory=dict)  # PoolingParams fields
    encoding_format: str = "float"
    top_n: int | None = None
    documents: list[str] | None = None

    @property
    def kind(self) -> str:
        """Which body answers the line: "embed", "score" or "rerank"."""
        return KIND_OF_URL[self.url]


def parse_pooling_body(url: str, body: dict[str, Any]) -> PoolingLine:
    """ValueError/TypeError naming the field for a body that cannot be served."""
    kind = KIND_OF_URL[url]
    unknown = sorted(set(body) - set(_FIELDS[kind]) - set(_IGNORED))
    if unknown:
        raise ValueError(f"unsupported body field(s) {unknown} for {url}")
    if body.get("priority") not in (None, 0):
        raise ValueError(f"priority={body['priority']!r}: this engine schedules pooling "
                         "requests in arrival order (only 0 is accepted)")
    if body.get("mm_processor_kwargs"):
        raise ValueError("mm_processor_kwargs: multimodal inputs are not supported")
    params = {k: body[k] for k in ("dimensions", "truncate_prompt_tokens", "normalize")
              if body.get(k) is not None}
    activation = next((body[k] for k in _ACTIVATION if body.get(k) is not None), None)
    if activation is not None:
        params["activation"] = activation
    if kind == "embed":
        fmt = body.get("encoding_format") or "float"
        if fmt not in ("float", "base64"):
            raise ValueError(f"encoding_format={fmt!r}: use float or base64")
        return PoolingLine(url, "embed", _inputs(body.get("input")), params, fmt)
    if kind == "score":
        return PoolingLine(url, "score", _score_pairs(body), params)
    query, docs = body.get("query"), body.get("documents")
    if not isinstance(query, str) or not isinstance(docs, list) or not docs \
            or not all(isinstance(d, str) for d in docs):
        raise ValueError("rerank needs a query string and a non-empty list of document strings")
    top_n = body.get("top_n")
    if top_n is not None and (not isinstance(top_n, int) or isinstance(top_n, bool) or top_n < 0):
        raise ValueError(f"top_n={top_n!r}: must be an int >= 0 (0: every document)")
    return PoolingLine(url, "score", [(query, d) for d in docs], params, top_n=top_n or None,
                       documents=docs)


def _score_pairs(body: dict[str, Any]) -> list[tuple[str, str]]:
    """The (left, right) pairs of a score body: one left for every right, or as many of each."""
    given = [pair for pair in SCORE_SIDES if pair[0] in body and pair[1] in body]
    used = {n for pair in SCORE_SIDES for n in pair if n in body}
    if len(given) != 1 or used != set(given[0]):
        names = ", ".join(f"{a} + {b}" for a, b in SCORE_SIDES)
        raise ValueError(f"a score request takes one pair of fields ({names}); got "
                         f"{sorted(used)}")
    left_name, right_name = given[0]
    a, b = body[left_name], body[right_name]
    lefts = [a] if isinstance(a, str) else a
    rights = [b] if isinstance(b, str) else b
    if not isinstance(lefts, list) or not isinstance(rights, list) or not lefts or not rights \
            or not all(isinstance(t, str) for t in [*lefts, *rights]):
        raise ValueError(f"{left_name} and {right_name} must be strings or non-empty lists of "
                         "strings")
    if len(lefts) == 1:
        lefts = lefts * len(rights)
    if len(lefts) != len(rights):
        raise ValueError(f"{len(lefts)} {left_name} for {len(rights)} {right_name} (give one "
                         f"{left_name}, or as many as {right_name})")
    return list(zip(lefts, rights))


def _inputs(value: Any) -> list[Any]:
    """OpenAI's `input`: a string, a list of strings, a token list or a list of token lists."""
    def tokens(v: Any) -> bool:
        return isinstance(v, list) and bool(v) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in v)

    if isinstance(value, str) or tokens(value):
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, str) or tokens(v) for v in value):
        return list(value)
    raise ValueError("input must be a string, a list of strings, a list of token ids or a list "
                     "of token-id lists (non-empty)")


def _ids(prefix: str) -> tuple[str, str, str]:
    hex_ = uuid.uuid4().hex
    return f"batch_req_{hex_[:24]}", f"req_{hex_[8:32]}", f"{prefix}-{hex_[:24]}"


def encode_embedding(values: list[float], fmt: str) -> list[float] | str:
    if fmt == "base64":
        return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode("ascii")
    return values


def embedding_body(model: str, embeddings: list[list[float]], prompt_tokens: int,
                   fmt: str = "float") -> dict[str, Any]:
    """OpenAI's CreateEmbeddingResponse."""
    return {"object": "list",
            "data": [{"object": "embedding", "embedding": encode_embedding(e, fmt), "index": i}
                     for i, e in enumerate(embeddings)],
            "model": model,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}


def score_body(model: str, scores: list[float], prompt_tokens: int, rid: str) -> dict[str, Any]:
    """vLLM's ScoreResponse."""
    return {"id": rid, "object": "list", "created": int(time.time()), "model": model,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens,
                      "completion_tokens": 0, "prompt_tokens_details": None}}


def rerank_body(model: str, line: PoolingLine, scores: list[float], prompt_tokens: int,
                rid: str) -> dict[str, Any]:
    """vLLM's RerankResponse: documents by relevance, highest first, `top_n` of them."""
    assert line.documents is not None
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[:line.top_n or len(scores)]
    return {"id": rid, "model": model,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
            "results": [{"index": i, "document": {"text": line.documents[i]},
                         "relevance_score": scores[i]} for i in order]}


def pooling_success_line(custom_id: str, model: str, line: PoolingLine,
                         values: list[Any], prompt_tokens: int) -> dict[str, Any]:
    """The output line of a finished pooling request: embeddings or scores, one per input."""
    line_id, request_id, rid = _ids({"embed": "embd", "score": "score",
                                     "rerank": "rerank"}[line.kind])
    if line.kind == "embed":
        body = embedding_body(model, values, prompt_tokens, line.encoding_format)
    elif line.kind == "score":
        body = score_body(model, values, prompt_tokens, rid)
    else:
        body = rerank_body(model, line, values, prompt_tokens, rid)
    return {"id": line_id, "custom_id": custom_id,
            "response": {"status_code": 200, "request_id": request_id, "body": body},
            "error": None}
