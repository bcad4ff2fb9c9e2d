"""Ray Data connector end to end on a local 2-CPU Ray with a tiny random Llama.

Every good row must equal the offline `LLM.generate` output for the same prompt and seed; bad
rows must carry an error; no row may be lost or duplicated; input columns pass through.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest

ray = pytest.importorskip("ray")

from batchgen_data import LLM, SamplingParams  # noqa: E402
from batchgen_data.connectors.ray_data import (  # noqa: E402
    BatchGenPredictor, BatchGenProcessorConfig, build_processor)

pytestmark = pytest.mark.timeout(300)

ENGINE = {"max_model_len": 64, "max_num_seqs": 64}
DEFAULTS = {"temperature": 0.0, "max_tokens": 8}
NO_OVERRIDE = {"max_tokens": None, "temperature": None, "seed": None, "temprature": None}


@pytest.fixture(scope="module")
def model(tiny_model_dir: Callable[..., Path]) -> str:
    return str(tiny_model_dir("llama"))


@pytest.fixture(scope="module")
def llm(model: str) -> LLM:
    return LLM(model, **ENGINE)


def _override(**kw: Any) -> dict[str, Any]:
    # every row has the same struct fields (Arrow needs one type); None means "not set"
    return {**NO_OVERRIDE, **kw}


def good_rows() -> list[dict[str, Any]]:
    rows = []
    for i in range(20):
        params = (_override(max_tokens=16, temperature=0.8, seed=100 + i) if i % 3 == 0
                  else _override(max_tokens=2 + i % 5) if i % 3 == 1 else None)
        rows.append({"id": i, "tag": f"t{i}", "prompt": f"The quick brown fox {i} jumps over",
                     "messages": None, "sampling_params": params})
    for i in range(20, 24):
        rows.append({"id": i, "tag": f"t{i}", "prompt": None, "sampling_params": None,
                     "messages": [{"role": "user", "content": f"Classify review {i}"}]})
    return rows


def bad_rows() -> list[dict[str, Any]]:
    base = {"tag": "bad", "messages": None, "sampling_params": None}
    return [
        {**base, "id": 100, "prompt": None},
        {**base, "id": 101, "prompt": ""},
        {**base, "id": 102, "prompt": "word " * 200},  # longer than max_model_len=64
        {**base, "id": 103, "prompt": None, "messages": [{"role": "user", "content": None}]},
        {**base, "id": 104, "prompt": "fine prompt", "sampling_params": _override(temprature=0.5)},
        {**base, "id": 105, "prompt": "fine prompt", "sampling_params": _override(max_tokens=0)},
    ]


def expected(llm: LLM, rows: list[dict[str, Any]]) -> dict[int, Any]:
    """Offline outputs for the good rows, keyed by id."""
    out = {}
    for row in rows:
        overrides = {k: v for k, v in (row["sampling_params"] or {}).items() if v is not None}
        params = SamplingParams(**{**DEFAULTS, **overrides})
        prompt = row["prompt"]
        if prompt is None:
            out[row["id"]] = llm.chat([row["messages"]], params, use_tqdm=False)[0]
        else:
            out[row["id"]] = llm.generate([prompt], params, use_tqdm=False)[0]
    return out


def run(model: str, rows: list[dict[str, Any]], **kw: Any) -> list[dict[str, Any]]:
    ds = ray.data.from_items(rows)
    out = ds.map_batches(
        BatchGenPredictor, batch_size=8, batch_format="pyarrow",
        fn_constructor_kwargs=dict(model=model, sampling_params=DEFAULTS, **ENGINE, **kw),
        compute=ray.data.ActorPoolStrategy(size=2, max_concurrent_calls_per_actor=3),
        num_cpus=0.5)
    return out.take_all()


@pytest.mark.parametrize("stream", [True, False])
def test_rows_match_offline_and_bad_rows_error(ray_local: None, model: str, llm: LLM,
                                               stream: bool) -> None:
    good, bad = good_rows(), bad_rows()
    got = run(model, good + bad, stream=stream)

    ids = [r["id"] for r in got]
    assert sorted(ids) == sorted(r["id"] for r in good + bad)  # none lost, none twice
    by_id = {r["id"]: r for r in got}
    want = expected(llm, good)
    for row in good:
        out, ref = by_id[row["id"]], want[row["id"]]
        assert out["error"] is None, out["error"]
        assert out["tag"] == row["tag"] and out["prompt"] == row["prompt"]
        assert list(out["generated_token_ids"]) == ref.outputs[0].token_ids, row["id"]
        assert out["generated_text"] == ref.outputs[0].text
        assert out["finish_reason"] == ref.outputs[0].finish_reason
        assert out["num_prompt_tokens"] == len(ref.prompt_token_ids)
        assert out["num_generated_tokens"] == len(ref.outputs[0].token_ids)
    messages = {100: "prompt is null", 101: "prompt is empty", 102: "max_model_len",
                103: "needs string 'role' and 'content'", 104: "unknown sampling parameter",
                105: "max_tokens"}
    for rid, fragment in messages.items():
        out = by_id[rid]
        assert fragment in out["error"], (rid, out["error"])
        assert out["generated_text"] == "" and len(out["generated_token_ids"]) == 0
        assert out["finish_reason"] is None and out["tag"] == "bad"


def test_whole_batch_mode_keeps_input_order(ray_local: None, model: str) -> None:
    rows = good_rows()[:16]
    got = run(model, rows, stream=False)
    # two input batches of 8, each returned whole and in order; batches may interleave
    for batch_start in (0, 8):
        ids = [r["id"] for r in got if batch_start <= r["id"] < batch_start + 8]
        assert ids == list(range(batch_start, batch_start + 8))


def test_on_error_raise_fails_the_job(ray_local: None, model: str) -> None:
    rows = good_rows()[:4] + bad_rows()[:1]
    with pytest.raises(Exception, match="prompt is null"):
        run(model, rows, on_error="raise")


def test_token_id_rows_and_build_processor(ray_local: None, model: str, llm: LLM) -> None:
    ids = llm.tokenizer.encode("Summarise paragraph 3")
    config = BatchGenProcessorConfig(model_source=model, concurrency=1, batch_size=4,
                                     engine_kwargs=ENGINE, sampling_params=DEFAULTS)
    processor = build_processor(
        config,
        preprocess=lambda row: {"id": row["id"], "prompt_token_ids": ids[: row["n"]]},
        postprocess=lambda row: {"id": row["id"], "answer": row["generated_text"],
                                 "error": row["error"]})
    got = sorted(processor(ray.data.from_items([{"id": i, "n": n} for i, n in
                                                enumerate([len(ids), 2, 1])])).take_all(),
                 key=lambda r: r["id"])
    for row, n in zip(got, [len(ids), 2, 1]):
        ref = llm.generate([{"prompt_token_ids": ids[:n]}], SamplingParams(**DEFAULTS),
                           use_tqdm=False)[0]
        assert set(row) == {"id", "answer", "error"} and row["error"] is None
        assert row["answer"] == ref.outputs[0].text


def test_processor_config_rejects_bad_values() -> None:
    with pytest.raises(TypeError, match="max_num_seq"):
        BatchGenProcessorConfig(engine_kwargs={"max_num_seq": 4})
    with pytest.raises(ValueError, match="concurrency"):
        BatchGenProcessorConfig(concurrency=(3, 2))
    with pytest.raises(TypeError, match="unknown sampling parameter"):
        BatchGenProcessorConfig(sampling_params={"temprature": 0.1})
