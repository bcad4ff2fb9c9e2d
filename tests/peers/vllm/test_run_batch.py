"""vLLM's `tests/entrypoints/openai/test_run_batch.py`, ported to `batchgen-data run`.

Same input files (the model names in the bodies kept as vLLM wrote them), same assertions, run
through the command's `main` with `--runner local` on tiny random models instead of vLLM's hub
models. `BatchRequestOutput` below restates vLLM's output-line schema
(`vllm.entrypoints.openai.run_batch.BatchRequestOutput`), which vLLM validates every line with.
Where this project differs on purpose the test says so and asserts what docs/cli.md promises:
a line without `custom_id` is an error line, not a failed run; a second use of a `custom_id`
is an error line. Tool calling, reasoning parsers and audio are not supported (tool lines are
error lines naming `tools`; the others have no port).
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from batchgen_data.cli.main import main

CHAT_MODEL_NAME = "hmellor/tiny-random-LlamaForCausalLM"
EMBEDDING_MODEL_NAME = "intfloat/multilingual-e5-small"
RERANKER_MODEL_NAME = "BAAI/bge-reranker-v2-m3"
SYSTEM = "You are a helpful assistant."
UNHELPFUL = "You are an unhelpful assistant."


class BatchResponseData(BaseModel):
    status_code: int = 200
    request_id: str
    body: Any = None


class BatchRequestOutput(BaseModel):
    id: str
    custom_id: str
    response: BatchResponseData | None
    error: Any = None


def _chat(custom_id: str, system: str, model: str = CHAT_MODEL_NAME, url: str =
          "/v1/chat/completions", **extra: Any) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": url,
            "body": {"model": model, "messages": [{"role": "system", "content": system},
                                                  {"role": "user", "content": "Hello world!"}],
                     "max_tokens": 1000, **extra}}


INPUT_BATCH = [_chat("request-1", SYSTEM), _chat("request-2", UNHELPFUL),
               _chat("request-3", UNHELPFUL, model="NonExistModel"),
               _chat("request-4", UNHELPFUL, url="/bad_url"),
               _chat("request-5", UNHELPFUL, stream="True")]
INVALID_INPUT_BATCH = [{k if k != "custom_id" else "invalid_field": v
                        for k, v in _chat("request-1", SYSTEM).items()},
                       _chat("request-2", UNHELPFUL)]
_DOCS = ["The capital of Brazil is Brasilia.", "The capital of France is Paris."]
_QUERY = "What is the capital of France?"


def _pool(custom_id: str, url: str, **body: Any) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


INPUT_EMBEDDING_BATCH = [
    _pool("request-1", "/v1/embeddings", model=EMBEDDING_MODEL_NAME, input=SYSTEM),
    _pool("request-2", "/v1/embeddings", model=EMBEDDING_MODEL_NAME, input=UNHELPFUL),
    _pool("request-3", "/v1/embeddings", model=EMBEDDING_MODEL_NAME, input="Hello world!"),
    _pool("request-4", "/v1/embeddings", model="NonExistModel", input="Hello world!")]
INPUT_SCORE_BATCH = [
    _pool("request-1", "/score", model=RERANKER_MODEL_NAME, queries=_QUERY, documents=_DOCS),
    _pool("request-2", "/v1/score", model=RERANKER_MODEL_NAME, queries=_QUERY, documents=_DOCS)]
INPUT_RERANK_BATCH = [
    _pool("request-1", "/rerank", model=RERANKER_MODEL_NAME, query=_QUERY, documents=_DOCS),
    _pool("request-2", "/v1/rerank", model=RERANKER_MODEL_NAME, query=_QUERY, documents=_DOCS),
    _pool("request-2", "/v2/rerank", model=RERANKER_MODEL_NAME, query=_QUERY, documents=_DOCS)]


def _run(tmp_path: Path, lines: list[dict[str, Any]] | str, model: Path | str,
         *extra: str) -> tuple[int, str]:
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(lines if isinstance(lines, str) else "\n".join(map(json.dumps, lines)))
    rc = main(["run", str(src), "-o", str(out), "--model", str(model), "--runner", "local",
               *extra])
    return rc, out.read_text() if out.exists() else ""


@pytest.fixture(scope="module")
def chat_model(tiny_model_dir: Any) -> Path:
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def pooling_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from tests.integration.pooling_models import build_encoder, sentence_transformers_dir

    root = tmp_path_factory.mktemp("run-batch-pooling")
    return {"embed": sentence_transformers_dir(build_encoder("bert", root / "bert"),
                                               root / "bert-st"),
            "rerank": build_encoder("bert", root / "cross", classify=1)}


def test_empty_file(tmp_path: Path) -> None:
    """vLLM test_empty_file: an empty input runs, rc 0, and the output is empty (no model is
    loaded for it: the model named here does not even exist)."""
    rc, contents = _run(tmp_path, "", tmp_path / "no-such-model")
    assert rc == 0
    assert contents.strip() == ""


def test_completions(tmp_path: Path, chat_model: Path) -> None:
    """vLLM test_completions: every output line validates as a Batch output line."""
    rc, contents = _run(tmp_path, INPUT_BATCH, chat_model)
    assert rc == 0
    lines = contents.strip().split("\n")
    for line in lines:
        BatchRequestOutput.model_validate_json(line)
    by_id = {json.loads(t)["custom_id"]: json.loads(t) for t in lines}
    assert len(by_id) == len(INPUT_BATCH)
    # ours: the body's model name is echoed, not checked; a bad url and a streamed request
    # are error lines naming the problem
    assert by_id["request-3"]["error"] is None
    assert by_id["request-4"]["error"]["code"] == "invalid_url"
    assert "stream" in by_id["request-5"]["error"]["message"]
    from openai.types.chat import ChatCompletion

    for key in ("request-1", "request-2"):
        ChatCompletion.model_validate(by_id[key]["response"]["body"])


def test_completions_invalid_input(tmp_path: Path, chat_model: Path) -> None:
    """vLLM test_completions_invalid_input: a first line without `custom_id`. vLLM's run-batch
    exits non-zero for the whole file; here (docs/cli.md) that line alone is an error line
    and the file is still read as a Batch file, not as a table."""
    rc, contents = _run(tmp_path, INVALID_INPUT_BATCH, chat_model)
    assert rc == 0
    first, second = (json.loads(t) for t in contents.strip().split("\n"))
    assert first["custom_id"] is None and first["error"]["code"] == "missing_custom_id"
    assert first["error"]["message"].startswith("line 1: ")
    assert second["custom_id"] == "request-2" and second["error"] is None


def test_embeddings(tmp_path: Path, pooling_models: dict[str, Path]) -> None:
    """vLLM test_embeddings."""
    rc, contents = _run(tmp_path, INPUT_EMBEDDING_BATCH, pooling_models["embed"])
    assert rc == 0
    for line in contents.strip().split("\n"):
        BatchRequestOutput.model_validate_json(line)
        assert json.loads(line)["error"] is None


@pytest.mark.parametrize("input_batch", [INPUT_SCORE_BATCH, INPUT_RERANK_BATCH],
                         ids=["score", "rerank"])
def test_score(tmp_path: Path, pooling_models: dict[str, Path],
               input_batch: list[dict[str, Any]]) -> None:
    """vLLM test_score: `/score` and `/v1/score` with `queries` + `documents`, and `/rerank`,
    `/v1/rerank`, `/v2/rerank`: no line is an error. vLLM's rerank file uses `request-2`
    twice; ids are unique here (docs/cli.md), so that line is run under its own id, and the
    file as vLLM wrote it is checked to answer the second use with `duplicate_custom_id`.
    Scores are checked against HF's own cross-encoder (sigmoid of its one logit)."""
    lines = [dict(line, custom_id=f"request-{i + 1}") for i, line in enumerate(input_batch)]
    rc, contents = _run(tmp_path, lines, pooling_models["rerank"])
    assert rc == 0
    want = _hf_scores(pooling_models["rerank"], _QUERY, _DOCS)
    for line in contents.strip().split("\n"):
        BatchRequestOutput.model_validate_json(line)
        line_dict = json.loads(line)
        assert isinstance(line_dict, dict)
        assert line_dict["error"] is None
        body = line_dict["response"]["body"]
        if "data" in body:
            assert [d["score"] for d in body["data"]] == pytest.approx(want, abs=1e-5)
        else:
            assert [r["index"] for r in body["results"]] == sorted(range(2),
                                                                   key=lambda i: -want[i])
            assert set(body["usage"]) == {"prompt_tokens", "total_tokens"}
    if input_batch is INPUT_RERANK_BATCH:
        rc, contents = _run(tmp_path, input_batch, pooling_models["rerank"])
        errors = [json.loads(t)["error"] for t in contents.strip().split("\n")]
        assert rc == 0 and [e["code"] for e in errors if e] == ["duplicate_custom_id"]
        assert [e["message"] for e in errors if e][0].startswith("line 3: ")


def test_tool_calling_is_an_error_line(tmp_path: Path, chat_model: Path) -> None:
    """vLLM test_tool_calling's input: tools are not supported here, so the line is an error
    line naming them, and the run still succeeds."""
    weather = {"type": "function", "function": {"name": "get_current_weather",
                                                "parameters": {"type": "object"}}}
    line = _chat("request-1", SYSTEM, tools=[weather], tool_choice="required")
    rc, contents = _run(tmp_path, [line], chat_model)
    out = json.loads(contents)
    assert rc == 0 and out["error"]["code"] == "unsupported_field"
    assert "tools" in out["error"]["message"]


def _hf_scores(model_dir: Path, query: str, docs: list[str]) -> list[float]:
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    with torch.no_grad():
        logits = model(**tok([query] * len(docs), docs, return_tensors="pt",
                             padding=True)).logits[:, 0]
    return [1 / (1 + math.exp(-float(x))) for x in logits]
