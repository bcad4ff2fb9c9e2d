"""Pooling tasks through the other front doors give the offline results: Ray Data
(`BatchGenProcessorConfig(task_type=...)`, the predictor), the command (`/v1/embeddings`,
`/v1/score`, `/v1/rerank` OpenAI Batch lines) and Spark; bad rows become error rows."""
from __future__ import annotations

import base64
import json
import struct
from pathlib import Path

import pytest
import torch

from batchgen_data import LLM
from batchgen_data.cli.main import Job, build_parser
from batchgen_data.pooling_params import PoolingParams

from tests.integration.pooling_models import build_encoder, sentence_transformers_dir

TEXTS = ["the quick brown fox jumps over the lazy dog", "paris is the capital of france", "a",
         "write a short poem about the sea the wind and the evening light " * 2]
PAIRS = [("the quick brown fox", "jumps over the lazy dog"), ("paris is the capital", "a b c")]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pooling-doors")
    st = sentence_transformers_dir(build_encoder("bert", root / "bert"), root / "bert-st")
    cfg = json.loads((st / "config.json").read_text())
    (st / "config.json").write_text(json.dumps({**cfg, "is_matryoshka": True}))
    return {"embed": st, "classify": build_encoder("xlm-roberta", root / "xlmr-cls", classify=3),
            "cross": build_encoder("bert", root / "cross", classify=1)}


def _close(a: list[float], b: list[float]) -> bool:
    return torch.allclose(torch.tensor(list(a)), torch.tensor(list(b)), atol=1e-5)


# ---- Ray Data --------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_ray_embed_classify_score_equal_offline(ray_local: None, models: dict[str, Path]) -> None:
    import pyarrow as pa
    import ray

    from batchgen_data.connectors.ray_data import BatchGenProcessorConfig, build_processor

    def run(task: str, model: Path, rows: list[dict], **kw) -> list[dict]:  # type: ignore[no-untyped-def]
        config = BatchGenProcessorConfig(model_source=str(model), task_type=task, batch_size=2,
                                         concurrency=1, num_cpus=0.5,
                                         engine_kwargs={"max_model_len": 32}, **kw)
        ds = build_processor(config)(ray.data.from_items(rows))
        return sorted(ds.take_all(), key=lambda r: r["id"])

    rows = [{"id": i, "prompt": t} for i, t in enumerate(TEXTS)]
    bad = [{"id": 10, "prompt": ""}, {"id": 11, "prompt": None},
           {"id": 12, "prompt": "the sea " * 40}]
    offline = LLM(str(models["embed"]), max_model_len=32)
    want = offline.embed(TEXTS, use_tqdm=False)
    got = run("embed", models["embed"], rows + bad)
    assert [r["id"] for r in got] == [0, 1, 2, 3, 10, 11, 12]
    for r, w in zip(got, want):
        assert r["error"] is None and _close(r["embedding"], w.outputs.embedding)
        assert r["num_prompt_tokens"] == len(w.prompt_token_ids)
    errors = {r["id"]: r["error"] for r in got[4:]}
    assert "prompt is empty" in errors[10] and "no prompt" in errors[11]
    assert "the model takes at most 32" in errors[12]
    assert all(r["embedding"] is None for r in got[4:])

    half = run("embed", models["embed"], rows, pooling_params={"dimensions": 16})
    want16 = offline.embed(TEXTS, PoolingParams(dimensions=16), use_tqdm=False)
    assert all(_close(r["embedding"], w.outputs.embedding) for r, w in zip(half, want16))

    classify = run("classify", models["classify"], rows)
    want_p = LLM(str(models["classify"])).classify(TEXTS, use_tqdm=False)
    assert all(_close(r["probs"], w.outputs.probs) for r, w in zip(classify, want_p))

    pair_rows = [{"id": i, "text_1": a, "text_2": b} for i, (a, b) in enumerate(PAIRS)]
    scored = run("score", models["cross"], pair_rows + [{"id": 9, "text_1": "a", "text_2": None}])
    want_s = LLM(str(models["cross"])).score([a for a, _ in PAIRS], [b for _, b in PAIRS],
                                             use_tqdm=False)
    assert [r["score"] for r in scored[:2]] == pytest.approx([w.outputs.score for w in want_s],
                                                              abs=1e-6)
    assert "text_2" in scored[2]["error"]


def test_predictor_column_types_and_streaming(models: dict[str, Path]) -> None:
    import pyarrow as pa

    from batchgen_data.connectors.ray_data import BatchGenPredictor

    pred = BatchGenPredictor(model=str(models["embed"]), task="embed")
    table = pa.table({"id": list(range(4)), "prompt": TEXTS})
    outs = list(pred(table))
    assert sum(t.num_rows for t in outs) == 4
    merged = pa.concat_tables(outs)
    assert merged.schema.field("embedding").type == pa.list_(pa.float32(), 64)
    # a batch of nothing but bad rows has the same column type
    only_bad = pa.concat_tables(pred(pa.table({"id": [5], "prompt": [""]})))
    assert only_bad.schema.field("embedding").type == pa.list_(pa.float32(), 64)


# ---- the command -----------------------------------------------------------------------------
def _run(model: Path, lines: list[dict], tmp_path: Path) -> dict[str, dict]:
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    Job(build_parser().parse_args(["run", str(src), "-o", str(out), "--runner", "local",
                                   "--model", str(model)])).run()
    return {d["custom_id"]: d for d in map(json.loads, out.read_text().splitlines())}


def _line(cid: str, url: str, **body: object) -> dict:
    return {"custom_id": cid, "method": "POST", "url": url, "body": {"model": "m", **body}}


def test_command_embeddings_equal_offline_and_match_openai_types(models: dict[str, Path],
                                                                 tmp_path: Path) -> None:
    from openai.types import CreateEmbeddingResponse

    got = _run(models["embed"], [
        _line("one", "/v1/embeddings", input=TEXTS[0]),
        _line("many", "/v1/embeddings", input=TEXTS[:3]),
        _line("short", "/v1/embeddings", input=TEXTS[1], dimensions=16),
        _line("b64", "/v1/embeddings", input=TEXTS[2], encoding_format="base64"),
        _line("empty", "/v1/embeddings", input=["the sea", ""]),
        _line("toobig", "/v1/embeddings", input=TEXTS[0], dimensions=65),
    ], tmp_path)
    llm = LLM(str(models["embed"]))
    want = [o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)]
    for cid in ("one", "many", "short", "b64"):
        body = got[cid]["response"]["body"]
        assert set(body) == set(CreateEmbeddingResponse.model_fields)
        if cid == "b64":  # the SDK's type holds the decoded floats; the wire has the string
            assert isinstance(body["data"][0]["embedding"], str)
            continue
        parsed = CreateEmbeddingResponse.model_validate(body)
        assert set(body["data"][0]) == {"object", "embedding", "index"}
        assert parsed.object == "list" and parsed.usage.total_tokens > 0
    assert _close(got["one"]["response"]["body"]["data"][0]["embedding"], want[0])
    many = got["many"]["response"]["body"]["data"]
    assert [d["index"] for d in many] == [0, 1, 2]
    assert all(_close(d["embedding"], w) for d, w in zip(many, want))
    short = llm.embed(TEXTS[1], PoolingParams(dimensions=16), use_tqdm=False)[0]
    assert _close(got["short"]["response"]["body"]["data"][0]["embedding"],
                  short.outputs.embedding)
    raw = base64.b64decode(got["b64"]["response"]["body"]["data"][0]["embedding"])
    assert _close(list(struct.unpack(f"<{len(raw) // 4}f", raw)), want[2])
    assert "input[1]: prompt is empty" in got["empty"]["error"]["message"]
    assert "more than the model's embedding size" in got["toobig"]["error"]["message"]


def test_command_score_and_rerank_equal_offline(models: dict[str, Path], tmp_path: Path) -> None:
    got = _run(models["cross"], [
        _line("s", "/v1/score", text_1=PAIRS[0][0], text_2=[PAIRS[0][1], PAIRS[1][1]]),
        _line("r", "/v1/rerank", query=PAIRS[0][0], documents=[PAIRS[0][1], PAIRS[1][1]],
              top_n=1),
    ], tmp_path)
    llm = LLM(str(models["cross"]))
    want = [o.outputs.score for o in llm.score(PAIRS[0][0], [PAIRS[0][1], PAIRS[1][1]],
                                               use_tqdm=False)]
    data = got["s"]["response"]["body"]["data"]
    assert [d["score"] for d in data] == pytest.approx(want, abs=1e-6)
    results = got["r"]["response"]["body"]["results"]
    best = max(range(2), key=lambda i: want[i])
    assert len(results) == 1 and results[0]["index"] == best
    assert results[0]["relevance_score"] == pytest.approx(want[best], abs=1e-6)


# ---- Spark -----------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_spark_udf_and_generate_df_equal_offline(spark: object, models: dict[str, Path]) -> None:
    pytest.importorskip("pyspark")
    from pyspark.sql import functions as sf

    from batchgen_data.connectors.spark import batchgen_udf, generate_df

    rows = [(i, t) for i, t in enumerate(TEXTS)] + [(9, "")]
    df = spark.createDataFrame(rows, "id long, prompt string").repartition(2, "id")  # type: ignore[attr-defined]
    want = [o.outputs.embedding for o in LLM(str(models["embed"])).embed(TEXTS, use_tqdm=False)]
    out = sorted(generate_df(df, task="embed", model=str(models["embed"])).collect(),
                 key=lambda r: r["id"])
    assert all(r["prompt"] == dict(rows)[r["id"]] for r in out)  # input columns kept
    assert [r["id"] for r in out] == [0, 1, 2, 3, 9]
    assert all(_close(r["embedding"], w) for r, w in zip(out, want))
    assert out[-1]["embedding"] is None and "prompt is empty" in out[-1]["error"]

    udf = batchgen_udf(str(models["classify"]), task="classify")
    got = sorted(df.select("id", udf("prompt").alias("r")).collect(), key=lambda r: r["id"])
    want_p = LLM(str(models["classify"])).classify(TEXTS, use_tqdm=False)
    assert all(_close(r["r"]["probs"], w.outputs.probs) for r, w in zip(got, want_p))

    pairs = spark.createDataFrame([(i, a, b) for i, (a, b) in enumerate(PAIRS)],  # type: ignore[attr-defined]
                                  "id long, text_1 string, text_2 string")
    scored = sorted(generate_df(pairs, task="score", model=str(models["cross"])).collect(),
                    key=lambda r: r["id"])
    want_s = LLM(str(models["cross"])).score([a for a, _ in PAIRS], [b for _, b in PAIRS],
                                             use_tqdm=False)
    assert [r["score"] for r in scored] == pytest.approx([w.outputs.score for w in want_s],
                                                          abs=1e-6)
    udf_s = batchgen_udf(str(models["cross"]), task="score")
    got_s = pairs.select(udf_s(sf.struct("text_1", "text_2")).alias("r")).collect()
    assert sorted(r["r"]["score"] for r in got_s) == pytest.approx(
        sorted(w.outputs.score for w in want_s), abs=1e-6)
