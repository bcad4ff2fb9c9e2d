"""Images through every front door, against a fake engine at the submit seam: `LLM.chat` and
`LLM.generate` (vLLM's `multi_modal_data`), a Ray predictor's and a Spark task's rows (content
parts, an `image` bytes column, an `images` list column, Spark's image struct), and the
command's OpenAI Batch lines. The oracle is the HF processor's own call on the same text and
images: the engine must receive its token ids and pixel values, placeholders in place."""
from __future__ import annotations

import base64
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import torch

from batchgen_data.connectors.ray import predictor as ray_predictor
from batchgen_data.connectors.ray.predictor import BatchGenPredictor
from batchgen_data.connectors.spark import engine_cache as spark_engine_cache, task as spark_task
from batchgen_data.connectors.spark.engine_cache import EngineCache
from batchgen_data.connectors.spark.task import TaskSession, TaskSettings
from batchgen_data.inputs.hf_processor import load_processor
from batchgen_data.inputs.image_options import ImageOptions
from batchgen_data.inputs.images import ImagePreparer
from batchgen_data.llm import LLM
from batchgen_data.openai.batch import parse_line
from batchgen_data.outputs import CompletionOutput, RequestOutput
from vlm_inputs import build_vl_processor, encoded, picture

QUESTION = "What colour is the square?"


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_vl_processor(tmp_path_factory.mktemp("tiny-vl-rows"))


@pytest.fixture(scope="module")
def proc(vl_dir: Path) -> Any:
    return load_processor(str(vl_dir))


def reference(proc: Any, images: list[Any], question: str = QUESTION) -> Any:
    """The HF processor's call: one user turn, the images first, then the question."""
    text = proc.apply_chat_template(
        [{"role": "user", "content": [*({"type": "image"} for _ in images),
                                      {"type": "text", "text": question}]}],
        tokenize=False, add_generation_prompt=True)
    return proc(text=[text], images=images, return_tensors="pt")


def assert_is_reference(ids: list[int], mm: list[Any], ref: Any) -> None:
    assert ids == ref["input_ids"][0].tolist()
    assert torch.equal(torch.cat([m.pixel_values for m in mm]), ref["pixel_values"])
    assert [m.grid_thw for m in mm] == [tuple(g) for g in ref["image_grid_thw"].tolist()]


def data_url(img: Any) -> str:
    return "data:image/png;base64," + base64.b64encode(encoded(img)).decode()


class FakeEngine:
    """The engine's submit seam (what 54-A's `submit(..., mm_inputs=)` takes), answering "ok";
    also a connector's driver (submit returns a Future)."""

    def __init__(self, tokenizer: Any, futures: bool = False) -> None:
        self.engine, self.tokenizer, self.futures = self, tokenizer, futures
        self.config = SimpleNamespace(seed=0)
        self.dead: BaseException | None = None
        self.stats = SimpleNamespace(batch_seqs_hist={})
        self.got: list[tuple[list[int], list[Any] | None]] = []
        self._done: list[RequestOutput] = []

    def check_request(self, ids: list[int], params: Any) -> None:
        pass

    def lora_names(self) -> None:
        return None

    def check_lora(self, lora: Any) -> None:
        pass

    def submit(self, ids: list[int], params: Any, request_id: str | None = None,
               prompt: str | None = None, lora_request: Any = None,
               mm_inputs: list[Any] | None = None) -> Any:
        self.got.append((list(ids), mm_inputs))
        rid = request_id or f"r{len(self.got)}"
        out = RequestOutput(rid, prompt, ids, [CompletionOutput(0, "ok", [1], "stop")])
        if not self.futures:
            self._done.append(out)
            return rid
        fut: Future = Future()
        fut.set_result(out)
        return fut

    def has_unfinished(self) -> bool:
        return bool(self._done)

    def step(self) -> list[RequestOutput]:
        out, self._done = self._done, []
        return out

    def abort(self, request_id: str) -> bool:
        return True

    def call(self, fn: Any) -> None:
        fn(self)

    def shutdown(self, timeout: float = 1.0) -> None:
        pass


def test_llm_chat_and_generate_send_the_processors_inputs(proc: Any) -> None:
    a, b = picture(11), picture(12, (84, 56))
    engine = FakeEngine(proc.tokenizer)
    llm = LLM._over(engine, images=ImagePreparer(proc))  # type: ignore[arg-type]
    parts = [{"type": "image_url", "image_url": {"url": data_url(a)}},
             {"type": "image_url", "image_url": data_url(b)},
             {"type": "text", "text": QUESTION}]
    outs = llm.chat([[{"role": "user", "content": parts}],
                     [{"role": "user", "content": QUESTION}]], use_tqdm=False)
    assert [o.outputs[0].text for o in outs] == ["ok", "ok"]
    assert_is_reference(*engine.got[0], reference(proc, [a, b]))
    assert engine.got[1][1] is None  # a text conversation carries no images
    # vLLM's raw prompt: its text holds the placeholders itself
    text = "<|vision_start|><|image_pad|><|vision_end|>" + QUESTION
    llm.generate({"prompt": text, "multi_modal_data": {"image": a}}, use_tqdm=False)
    ref = proc(text=[text], images=[a], return_tensors="pt")
    assert_is_reference(*engine.got[2], ref)
    with pytest.raises(ValueError, match=r"conversations\[0\]: image 1 of 1 .*not an image"):
        llm.chat([{"role": "user", "content": [{"type": "image", "image": b"junk"}]}],
                 use_tqdm=False)


def test_text_only_model_refuses_images_and_reads_text_parts(proc: Any) -> None:
    engine = FakeEngine(proc.tokenizer)
    llm = LLM._over(engine)  # type: ignore[arg-type]
    llm._images = lambda: None  # a text-only model: no image pipeline
    with pytest.raises(ValueError, match="text-only"):
        llm.chat([{"role": "user", "content": [{"type": "image_url",
                                                "image_url": {"url": data_url(picture(1))}}]}],
                 use_tqdm=False)
    llm.chat([{"role": "user", "content": [{"type": "text", "text": "a"},
                                           {"type": "text", "text": "b"}]}], use_tqdm=False)
    llm.chat([{"role": "user", "content": "ab"}], use_tqdm=False)
    assert engine.got[0] == engine.got[1]


def _rows(kind: str, proc: Any, rows: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch,
          **engine_kwargs: Any) -> tuple[list[dict[str, Any]], FakeEngine]:
    """`rows` through a Ray predictor or a Spark task over a fake driver whose tokenizer
    is the VL model's (its processor is loaded from the tokenizer's directory)."""
    engine_kwargs = {"limit_mm_per_prompt": {"image": 2}, **engine_kwargs}
    driver = FakeEngine(proc.tokenizer, futures=True)
    if kind == "ray":
        monkeypatch.setattr(ray_predictor.os, "_exit", lambda code: None)

        class OnFake(BatchGenPredictor):
            def start_driver(self, model: Any, engine_kwargs: Any) -> FakeEngine:
                return driver

        pred = OnFake(sampling_params={"max_tokens": 4}, migration=False, **engine_kwargs)
        out = [r for t in pred(pa.Table.from_pylist(rows)) for r in t.to_pylist()]
        return sorted(out, key=lambda r: r["id"]), driver
    monkeypatch.setattr(spark_engine_cache, "ENGINES", EngineCache(lambda spec: driver))
    monkeypatch.setattr(spark_task, "task_resources", lambda: ([], 1))
    session = TaskSession(TaskSettings.create(None, {"max_tokens": 4}, "row", None, False,
                                              engine_kwargs))
    return session.output_rows(session.submit(rows, [r["id"] for r in rows])), driver


@pytest.mark.parametrize("kind", ["ray", "spark"])
def test_connector_rows_with_image_columns(kind: str, proc: Any,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A bytes `image` column, an `images` list, content parts with a data: URL, and the bad
    rows (corrupt bytes, over the limit): each bad row is its own error, the job goes on."""
    a, b = picture(21), picture(22)
    png_a, png_b = encoded(a), encoded(b)
    msgs = [{"role": "user", "content": [{"type": "image_url",
                                          "image_url": {"url": data_url(a)}},
                                         {"type": "text", "text": QUESTION}]}]
    rows = [{"id": 0, "prompt": QUESTION, "image": png_a, "images": None},
            {"id": 1, "prompt": QUESTION, "image": None, "images": [png_a, png_b]},
            {"id": 2, "prompt": QUESTION, "image": b"corrupt", "images": None},
            {"id": 3, "prompt": QUESTION, "image": None, "images": [png_a] * 3}]
    out, driver = _rows(kind, proc, rows, monkeypatch)
    assert [r["error"] is None for r in out] == [True, True, False, False]
    assert "not an image" in out[2]["error"]
    assert "over the limit of 2" in out[3]["error"]
    got = {len(mm): (ids, mm) for ids, mm in driver.got}
    assert_is_reference(*got[1], reference(proc, [a]))
    assert_is_reference(*got[2], reference(proc, [a, b]))
    if kind == "spark":  # Spark's image source struct (BGR) and content parts in messages
        arr = np.asarray(a)
        struct = {"origin": "a", "height": 56, "width": 56, "nChannels": 3, "mode": 16,
                  "data": arr[:, :, ::-1].tobytes()}
        out, driver = _rows(kind, proc, [{"id": 0, "prompt": QUESTION, "image": struct},
                                         {"id": 1, "messages": msgs},
                                         {"id": 2, "prompt": QUESTION, "image": arr},
                                         {"id": 3, "prompt": QUESTION,
                                          "images": np.array([arr], dtype=np.uint8)}],
                            monkeypatch)
        assert [r["error"] for r in out] == [None] * 4  # HWC arrays: ray.data.read_images
        for ids, mm in driver.got:
            assert_is_reference(ids, mm, reference(proc, [a]))


@pytest.mark.parametrize("kind", ["ray", "spark"])
def test_local_image_paths_need_the_allowance(kind: str, proc: Any, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A path in an image column or a file:// part is a read of the worker's disk: a row error
    unless `allowed_local_media_path` (an engine kwarg, as in vLLM) holds the file; a path
    outside it, or a link out of it, stays a row error with the allowance."""
    a = picture(23)
    media = tmp_path / "media"
    media.mkdir()
    (media / "a.png").write_bytes(encoded(a))
    (tmp_path / "secret.png").write_bytes(encoded(picture(24)))
    (media / "out.png").symlink_to(tmp_path / "secret.png")
    part = [{"type": "image_url", "image_url": {"url": f"file://{media / 'a.png'}"}},
            {"type": "text", "text": QUESTION}]
    rows = [{"id": 0, "prompt": QUESTION, "image": str(media / "a.png"), "images": None},
            {"id": 1, "prompt": QUESTION, "image": str(tmp_path / "secret.png"), "images": None},
            {"id": 2, "prompt": QUESTION, "image": str(media / "out.png"), "images": None},
            {"id": 3, "prompt": QUESTION, "image": None, "images": [encoded(a)]}]  # bytes
    chats = [{"id": 0, "messages": [{"role": "user", "content": part}]}]
    out, _ = _rows(kind, proc, rows, monkeypatch)
    out += _rows(kind, proc, chats, monkeypatch)[0]
    assert [r["error"] is None for r in out] == [False, False, False, True, False]
    assert all("allowed_local_media_path" in out[i]["error"] for i in (0, 1, 2, 4))
    out, driver = _rows(kind, proc, rows, monkeypatch, allowed_local_media_path=str(media))
    out2, driver2 = _rows(kind, proc, chats, monkeypatch, allowed_local_media_path=str(media))
    assert [r["error"] is None for r in out + out2] == [True, False, False, True, True]
    assert all("not below allowed_local_media_path" in r["error"] for r in out[1:3])
    assert len(driver.got) == 2 and len(driver2.got) == 1
    for ids, mm in driver.got + driver2.got:
        assert_is_reference(ids, mm, reference(proc, [a]))


def test_llm_chat_refuses_a_local_path_without_the_allowance(proc: Any, tmp_path: Path) -> None:
    (tmp_path / "a.png").write_bytes(encoded(picture(25)))
    conv = [{"role": "user", "content": [{"type": "image", "image": str(tmp_path / "a.png")}]}]
    prep = ImagePreparer(proc)
    llm = LLM._over(FakeEngine(proc.tokenizer), images=prep)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"conversations\[0\]: image 1 of 1 .*"
                                         "allowed_local_media_path"):
        llm.chat(conv, use_tqdm=False)
    prep = ImagePreparer(proc, ImageOptions(allowed_local_media_path=str(tmp_path)))
    llm = LLM._over(FakeEngine(proc.tokenizer), images=prep)  # type: ignore[arg-type]
    assert llm.chat(conv, use_tqdm=False)[0].outputs[0].text == "ok"


def test_batch_line_with_image_url_keeps_its_parts() -> None:
    url = data_url(picture(3))
    line = ('{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": '
            '{"model": "m", "messages": [{"role": "user", "content": [{"type": "text", '
            f'"text": "hi"}}, {{"type": "image_url", "image_url": {{"url": "{url}"}}}}]}}]}}}}')
    req = parse_line(line, 1)
    assert req.error is None and req.messages[0]["content"][1]["image_url"]["url"] == url
    bad = parse_line(line.replace('"image_url", "image_url"', '"input_audio", "image_url"'), 1)
    assert "'input_audio' is not supported" in bad.error
