"""Rows choose LoRA adapters through every front door: the shared row layer (what the Ray
predictor and Spark run), per-row programs, the command (an OpenAI Batch line's "model"), Ray's
`build_processor` in ray.data.llm's shape (`dynamic_lora_loading_path` + the row's `model`),
and Spark's `generate_df` with a `lora` column. Each row's tokens equal `LLM.generate` under the
same adapter; a row naming an unknown adapter or an unloadable directory is that row's error
and the others go on."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from batchgen_data import LLM, LoRARequest, SamplingParams, program, Generate
from batchgen_data.lora_request import stable_lora_id
from lora_adapters import write_adapter

GREEDY = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}
PROMPT = "The quick brown fox jumps over"


@pytest.fixture(scope="module")
def setup(tiny_model_dir, tmp_path_factory):  # type: ignore[no-untyped-def]
    base = tiny_model_dir("llama")
    root = tmp_path_factory.mktemp("adapters")
    for i, name in enumerate(("alpha", "beta")):
        write_adapter(base, root / name, seed=20 + i, rank=8)
    (root / "broken").mkdir()
    (root / "broken" / "adapter_config.json").write_text("{not json")
    kw = dict(enable_lora=True, max_loras=2, dynamic_lora_loading_path=str(root))
    llm = LLM(str(base), **kw)
    sp = SamplingParams(**GREEDY)
    want = {}
    for name in ("alpha", "beta", None):
        lr = None if name is None else LoRARequest(name, stable_lora_id(name), str(root / name))
        want[name] = llm.generate(PROMPT, sp, use_tqdm=False, lora_request=lr)[0].outputs[0].text
    assert len(set(want.values())) == 3  # each adapter changes the answer
    return base, root, kw, want


ROWS = [  # (row fields, the adapter its text must match, or the words of its error)
    ({"lora": "alpha"}, "alpha"),
    ({"model": "beta"}, "beta"),
    ({"model": "BASE"}, None),  # the base model's name
    ({}, None),
    ({"lora": "nope"}, "error:not a directory"),
    ({"lora": "broken"}, "error:adapter_config.json unreadable"),
    ({"model": "../alpha"}, "error:not a path"),
]


def rows_for(base: Path) -> list[dict]:
    rows = []
    for i, (fields, _) in enumerate(ROWS):
        fields = {k: (base.name if v == "BASE" else v) for k, v in fields.items()}
        rows.append({"id": i, "prompt": PROMPT, "sampling_params": GREEDY, **fields})
    return rows


def check(outs: dict[int, dict], want: dict) -> None:
    for i, (_, expect) in enumerate(ROWS):
        out = outs[i]
        if isinstance(expect, str) and expect.startswith("error:"):
            assert expect[6:] in (out["error"] or ""), (i, out["error"])
        else:
            assert out["error"] is None, (i, out["error"])
            assert out["generated_text"] == want[expect], i


def test_shared_row_layer(setup) -> None:  # type: ignore[no-untyped-def]
    from batchgen_data.connectors.common import RequestBuilder
    from batchgen_data.connectors.rows import GenerationRows
    from batchgen_data.engine.driver import EngineDriver
    from batchgen_data.engine.engine import Engine

    base, _, kw, want = setup
    driver = EngineDriver(Engine.from_kwargs(str(base), **kw))
    try:
        builder = RequestBuilder.from_engine(driver.engine, apply_chat_template=False)
        rows = GenerationRows(driver, builder, base_seed=0)
        futs = [rows.submit(r) for r in rows_for(base)]
        check({i: rows.outcome(f) for i, f in enumerate(futs)}, want)
    finally:
        driver.shutdown()


@program(schema={"text": "string"})
def one_step(row):  # type: ignore[no-untyped-def]
    r = yield Generate(prompt=row["prompt"], **GREEDY)
    return {"text": r.text}


def test_programs_run_under_the_rows_adapter(setup) -> None:  # type: ignore[no-untyped-def]
    base, _, kw, want = setup
    rows = [{"prompt": PROMPT, "lora": "alpha"}, {"prompt": PROMPT, "model": "beta"},
            {"prompt": PROMPT}, {"prompt": PROMPT, "lora": "nope"}]
    outs = LLM(str(base), **kw).run(rows, one_step, use_tqdm=False)
    assert [o.get("text") for o in outs[:3]] == [want["alpha"], want["beta"], want[None]]
    assert "not a directory" in outs[3]["error"]
    plain = LLM(str(base)).run([{"prompt": PROMPT, "lora": "alpha"}], one_step, use_tqdm=False)
    assert "enable_lora" in plain[0]["error"]


def test_command_model_field_names_the_adapter(setup, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from batchgen_data.cli.main import Job, build_parser

    base, _, kw, want = setup
    lines = []
    for i, (fields, _) in enumerate(ROWS):
        model = fields.get("model", fields.get("lora", "BASE"))
        body = {"model": base.name if model == "BASE" else model, "prompt": PROMPT,
                "max_tokens": 8, "temperature": 0}
        lines.append({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                      "body": body})
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    job = Job(build_parser().parse_args(["run", str(src), "-o", str(out), "--model", str(base),
                                         "--runner", "local", "--engine-kwargs",
                                         json.dumps(kw)]))
    job.run()
    got = {json.loads(t)["custom_id"]: json.loads(t) for t in out.read_text().splitlines()}
    for i, (fields, expect) in enumerate(ROWS):
        line = got[f"r{i}"]
        if isinstance(expect, str) and expect.startswith("error:"):
            assert expect[6:] in line["error"]["message"], (i, line["error"])
        else:
            assert line["error"] is None, (i, line["error"])
            # max_tokens without ignore_eos: the answer may stop early, never differ
            text = line["response"]["body"]["choices"][0]["text"]
            assert want[expect].startswith(text), i


def test_ray_build_processor_in_ray_data_llm_shape(setup, ray_local) -> None:  # type: ignore[no-untyped-def]
    import ray

    from batchgen_data.connectors.ray_data import BatchGenProcessorConfig, build_processor

    base, root, kw, want = setup
    config = BatchGenProcessorConfig(
        model_source=str(base), dynamic_lora_loading_path=str(root),
        engine_kwargs={"enable_lora": True, "max_loras": 2}, batch_size=4,
        apply_chat_template=False, sampling_params=GREEDY, migration=False)
    rows = rows_for(base)
    for r in rows:
        del r["sampling_params"]
        r.setdefault("lora", None)
        r.setdefault("model", None)
    out = build_processor(config)(ray.data.from_items(rows)).take_all()
    check({r["id"]: r for r in out}, want)


def test_spark_generate_df_with_a_lora_column(setup, spark) -> None:  # type: ignore[no-untyped-def]
    from batchgen_data.connectors.spark import generate_df

    base, _, kw, want = setup
    rows = [(i, PROMPT, r.get("lora"), r.get("model")) for i, r in enumerate(rows_for(base))]
    df = spark.createDataFrame(rows, "id long, prompt string, lora string, model string")
    out = generate_df(df, id_col="id", model=str(base), sampling_params=GREEDY,
                      apply_chat_template=False, **kw).collect()
    check({r["id"]: r.asDict() for r in out}, want)
