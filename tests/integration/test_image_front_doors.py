"""Images end to end through the front doors on a tiny random Qwen2.5-VL: `LLM.chat` with
OpenAI image parts (a `data:` URL, a file path, a repeated image) and a generation row with an
`image` bytes column through the connectors' row handler gives HF `generate`'s greedy tokens on
the HF processor's output for the same conversation (fp32, CPU)."""
from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import pytest
import torch

from batchgen_data import SamplingParams
from batchgen_data.connectors.row_kinds import RowKind
from batchgen_data.engine.driver import EngineDriver
from batchgen_data.inputs.hf_processor import load_processor
from batchgen_data.llm import LLM
from vlm_inputs import VL_TEMPLATE, encoded
from vlm_models import build_qwen2_5_vl, make_image

QUESTION = "Describe the picture."
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """54-A's tiny Qwen2.5-VL with a processor whose template renders image parts."""
    from transformers import AutoTokenizer

    path = build_qwen2_5_vl(tmp_path_factory.mktemp("tiny-vl-front"))
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = VL_TEMPLATE
    tok.save_pretrained(path)
    return path


def hf_greedy(vl_dir: Path, images: list[Any]) -> list[int]:
    from transformers import AutoModelForImageTextToText

    proc = load_processor(str(vl_dir))
    hf = AutoModelForImageTextToText.from_pretrained(vl_dir, dtype="float32").eval()
    text = proc.apply_chat_template(
        [{"role": "user", "content": [*({"type": "image"} for _ in images),
                                      {"type": "text", "text": QUESTION}]}],
        tokenize=False, add_generation_prompt=True)
    batch = proc(text=[text], images=images, return_tensors="pt")
    with torch.no_grad():
        gen = hf.generate(**batch, max_new_tokens=MAX_TOKENS, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    return gen[0, batch["input_ids"].shape[1]:].tolist()


def test_llm_chat_and_rows_give_hf_tokens(vl_dir: Path, tmp_path: Path) -> None:
    a, b = make_image(1, (112, 84)), make_image(2, (56, 56))
    (tmp_path / "b.png").write_bytes(encoded(b))
    url = "data:image/png;base64," + base64.b64encode(encoded(a)).decode()
    want_a, want_ab = hf_greedy(vl_dir, [a]), hf_greedy(vl_dir, [a, b])
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    llm = LLM(str(vl_dir), dtype="float32", device="cpu", limit_mm_per_prompt={"image": 2},
              allowed_local_media_path=str(tmp_path))  # the file path below
    try:
        def conv(*parts: Any) -> list[dict[str, Any]]:
            return [{"role": "user", "content": [*parts, {"type": "text", "text": QUESTION}]}]
        outs = llm.chat([conv({"type": "image_url", "image_url": {"url": url}}),
                         conv({"type": "image_url", "image_url": {"url": url}},
                              {"type": "image_url", "image_url": {"url": str(tmp_path / "b.png")}}),
                         conv({"type": "image_url", "image_url": {"url": url}})], sp,
                        use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == [want_a, want_ab, want_a]
        driver = EngineDriver(llm.engine)
        try:
            rows = RowKind.create(sampling_params={"max_tokens": MAX_TOKENS, "temperature": 0,
                                                   "ignore_eos": True}).open(driver, 0)
            fut = rows.submit({"prompt": QUESTION, "image": encoded(a)})
            fut.exception(timeout=120)
            out = rows.outcome(fut)
        finally:
            driver.shutdown()
        assert out["error"] is None and out["generated_token_ids"] == want_a
    finally:
        llm.close()
