"""Every kind of bad input in the catalogue (bad_input_catalogue.py, docs/row-errors.md) on the
offline API and on the row lifecycle both connectors share, with a real tiny engine.

The lifecycle runs each bad row next to good rows: the bad one's `error` is the catalogued
message, the good ones match the offline run token for token, and with on_error="raise" the
same message fails fast. The Ray and Spark paths are in test_bad_input_connectors.py.
"""
from __future__ import annotations

import json
from concurrent.futures import wait
from typing import Any

import pytest

from bad_input_catalogue import CATALOGUE, DOC, FINE, Bad, doc_table, render_table
from batchgen_data import LLM, SamplingParams
from batchgen_data.connectors.common import RequestBuilder
from batchgen_data.connectors.handler import RowError
from batchgen_data.connectors.rows import GenerationRows
from batchgen_data.engine.driver import EngineDriver
from batchgen_data.engine.engine import Engine

pytestmark = pytest.mark.timeout(300)

ENGINE = {"max_model_len": 64, "max_num_seqs": 32}
DEFAULTS = {"temperature": 0.0, "max_tokens": 6}
GOOD = ["The quick brown fox jumps over", "Summarise paragraph 3", "What is the capital?"]


@pytest.fixture(scope="module")
def driver(model: str) -> Any:
    d = EngineDriver(Engine.from_kwargs(model, **ENGINE))
    yield d
    d.shutdown()


def message(bad: Bad, llm: LLM) -> str:
    return bad.expected(llm.engine.vocab_size, llm.engine.max_model_len)


def test_catalogue_covers_the_issue() -> None:
    kinds = [b.kind for b in CATALOGUE]
    assert len(kinds) >= 15 and len(set(kinds)) == len(kinds)
    for bad in CATALOGUE:  # every message names its field: prompt..., messages, sampling...
        assert bad.column.split("_")[0] in bad.message.lower(), bad.kind


def test_docs_table_is_the_catalogue() -> None:
    assert doc_table(DOC.read_text()) == render_table(), \
        "docs/row-errors.md is stale: run python tests/integration/bad_input_catalogue.py"


@pytest.mark.parametrize("bad", [b for b in CATALOGUE if b.offline], ids=lambda b: b.kind)
def test_offline_api_raises_the_same_message(llm: LLM, bad: Bad) -> None:
    want = message(bad, llm)
    steps = llm.engine.stats.num_steps
    with pytest.raises((ValueError, TypeError)) as info:
        if bad.offline == "params":
            SamplingParams.from_dict(json.loads(bad.value))
        elif bad.offline == "chat":
            llm.chat([[{"role": "user", "content": GOOD[0]}], bad.value], use_tqdm=False)
        elif bad.column == "sampling_params":  # accepted by SamplingParams, refused by the engine
            params = [SamplingParams(**DEFAULTS), SamplingParams.from_dict(json.loads(bad.value))]
            llm.generate([GOOD[0], FINE], params, use_tqdm=False)
        else:
            prompt = bad.value if bad.column == "prompt" else {bad.column: bad.value}
            llm.generate([GOOD[0], prompt], SamplingParams(**DEFAULTS), use_tqdm=False)
    got = str(info.value)
    if bad.offline == "params":
        assert "bad sampling_params: " + got == want
    elif bad.offline == "chat":
        assert got == want
    else:
        assert got == f"prompts[1]: {want}"
    # nothing half-ran: a bad prompt is refused before any good one is scheduled
    assert llm.engine.stats.num_steps == steps and not llm.engine.has_unfinished()


def lifecycle(driver: Any, on_error: str) -> GenerationRows:
    builder = RequestBuilder.from_engine(driver.engine, DEFAULTS)
    return GenerationRows(driver, builder, driver.engine.config.seed, on_error)


def test_each_bad_row_is_its_own_error_next_to_good_rows(driver: Any, llm: LLM) -> None:
    rows = lifecycle(driver, "row")
    good = [{"prompt": p} for p in GOOD]
    mixed = [good[0], *[b.row() for b in CATALOGUE], *good[1:]]
    futures = [rows.submit(row) for row in mixed]
    assert not wait(futures, timeout=120).not_done
    outs = [rows.outcome(f) for f in futures]
    bad_outs = outs[1:1 + len(CATALOGUE)]
    for bad, out in zip(CATALOGUE, bad_outs):
        assert out["error"] == message(bad, llm), bad.kind
        assert out["generated_text"] == "" and out["generated_token_ids"] == []
        assert out["finish_reason"] is None
    want = llm.chat([[{"role": "user", "content": p}] for p in GOOD], SamplingParams(**DEFAULTS),
                    use_tqdm=False)
    good_outs = [outs[0], *outs[1 + len(CATALOGUE):]]
    for out, ref in zip(good_outs, want):
        assert out["error"] is None
        assert out["generated_token_ids"] == ref.outputs[0].token_ids


@pytest.mark.parametrize("bad", CATALOGUE, ids=lambda b: b.kind)
def test_on_error_raise_fails_fast_with_the_same_message(driver: Any, llm: LLM,
                                                         bad: Bad) -> None:
    rows = lifecycle(driver, "raise")
    fine = rows.submit({"prompt": GOOD[0]})
    with pytest.raises(RowError) as info:
        rows.submit(bad.row())
    assert str(info.value) == message(bad, llm)
    assert rows.outcome(fine)["error"] is None  # the good row before it was not disturbed
