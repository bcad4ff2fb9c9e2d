"""Tiny random Qwen2.5-VL and Qwen3-VL models through the engine: greedy tokens equal HF `generate` over the HF
processor's output (fp32, CPU) for prompts with one image, two images of other sizes, none, and
an image repeated across prompts; with prefill chunks that cut through an image's placeholders
and an encoder budget smaller than one image (each image then runs alone in its step's encoder
batch, the others suspended); and with the prefix cache, which shares KV between prompts with
the same image and text but never between prompts whose images differ."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from batchgen_data import SamplingParams
from batchgen_data.engine.engine import Engine

from vlm_models import (build_qwen2_5_vl, build_qwen3_vl, engine_images, image_prompt,
                        make_image, processor)

FAMILIES = {"qwen2_5_vl": (build_qwen2_5_vl, 28), "qwen3_vl": (build_qwen3_vl, 32)}
# (text, [(image seed, (width, height) in units of patch * merge pixels)]): 4x3 units are
# 8x6 patches, 12 tokens (Qwen2.5-VL: in 4 windows, two of them cut short)
PROMPTS = [
    ("Describe the picture.", [(1, (4, 3))]),
    ("Compare the two images.", [(2, (2, 2)), (3, (3, 4))]),
    ("What is the capital of France?", []),
    ("Extract the invoice number.", [(1, (4, 3))]),  # the first prompt's image again
]
MAX_TOKENS = [9, 6, 7, 8]


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def vl_dir(family: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return FAMILIES[family][0](tmp_path_factory.mktemp(f"tiny-{family}"))


@pytest.fixture(scope="module")
def cases(family: str, vl_dir: Path) -> list[tuple[dict, list, list[int]]]:
    """Per prompt: the processor's batch, the engine's images, HF's greedy tokens."""
    from transformers import AutoModelForImageTextToText

    proc = processor(vl_dir, family)
    hf = AutoModelForImageTextToText.from_pretrained(vl_dir, dtype="float32").eval()
    unit = FAMILIES[family][1]
    out = []
    for (text, images), m in zip(PROMPTS, MAX_TOKENS):
        pics = [make_image(seed, (w * unit, h * unit)) for seed, (w, h) in images]
        batch = proc(text=[image_prompt(text, len(pics))], images=pics or None,
                     return_tensors="pt")
        hf.model.rope_deltas = None  # HF keeps the last prompt's M-RoPE offset on the model
        with torch.no_grad():
            gen = hf.generate(**batch, max_new_tokens=m, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
        want = gen[0, batch["input_ids"].shape[1]:].tolist()
        mm = engine_images(batch, hf.config.image_token_id,
                           [f"img-{seed}-{size}" for seed, size in images]) if pics else None
        out.append((batch, mm, want))
    return out


def run(engine: Engine, cases: list, order: list[int] | None = None) -> dict[int, list[int]]:
    order = order if order is not None else list(range(len(cases)))
    for i in order:
        batch, mm, _ = cases[i]
        engine.submit(batch["input_ids"][0].tolist(),
                      SamplingParams(max_tokens=MAX_TOKENS[i], temperature=0, ignore_eos=True),
                      request_id=str(i), mm_inputs=mm)
    got: dict[int, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            got[int(o.request_id)] = o.outputs[0].token_ids
    return got


ENGINE = dict(dtype="float32", device="cpu")
CASES = {
    "plain": dict(),
    # chunks of 5 tokens cut through the placeholders; an encoder batch of 8 rows holds less
    # than the 12-token image, which then runs alone while the others wait
    "chunks": dict(max_num_batched_tokens=5, block_size=4, max_num_encoder_input_tokens=8),
    "async": dict(async_scheduling=True, max_num_seqs=2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_matches_hf(case: str, vl_dir: Path, cases: list) -> None:
    engine = Engine.from_kwargs(str(vl_dir), **ENGINE, **CASES[case])
    try:
        got = run(engine, cases)
    finally:
        engine.close()
    assert got == {i: c[2] for i, c in enumerate(cases)}
    cache = engine.encoder_cache
    assert cache is not None and cache.encoded == 3  # the repeated image encoded once
    assert cache.hits >= 1


def test_prefix_cache_keys_images(family: str, vl_dir: Path, cases: list) -> None:
    """Same text and image: the second prompt's KV comes from the first's blocks, image
    included; same text and another image of the same size: only the blocks before the image.
    The keys are the engine's, not the family's: one family checks them."""
    if family != "qwen2_5_vl":
        pytest.skip("family-independent: checked on qwen2_5_vl")
    engine = Engine.from_kwargs(str(vl_dir), **ENGINE, block_size=4)
    batch, mm, want = cases[0]
    ids = batch["input_ids"][0].tolist()
    other = [type(mm[0])("another-image", torch.rand_like(mm[0].pixel_values), mm[0].grid_thw,
                         mm[0].num_tokens, mm[0].offset)]
    params = SamplingParams(max_tokens=MAX_TOKENS[0], temperature=0, ignore_eos=True)
    try:
        outs = {}
        for rid, images in (("a", mm), ("b", mm), ("c", other)):
            engine.submit(ids, params, request_id=rid, mm_inputs=images)
            while engine.has_unfinished():
                for o in engine.step():
                    outs[o.request_id] = o
    finally:
        engine.close()
    assert outs["a"].outputs[0].token_ids == want == outs["b"].outputs[0].token_ids
    full_blocks = (len(ids) - 1) // 4 * 4
    assert outs["b"].num_cached_tokens == full_blocks  # the image's rows too
    before_image = mm[0].offset // 4 * 4
    assert outs["c"].num_cached_tokens == before_image < full_blocks
    assert outs["c"].outputs[0].token_ids != want  # another image: another answer


def test_images_refused_where_they_cannot_go(family: str, vl_dir: Path, cases: list,
                                             tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    if family != "qwen2_5_vl":
        pytest.skip("family-independent: checked on qwen2_5_vl")
    batch, mm, _ = cases[0]
    ids = batch["input_ids"][0].tolist()
    text_only = Engine.from_kwargs(str(tiny_model_dir("llama")), **ENGINE)
    with pytest.raises(ValueError, match="mm_inputs: this model takes no images"):
        text_only.submit([1, 2, 3], mm_inputs=mm)
    engine = Engine.from_kwargs(str(vl_dir), **ENGINE)
    with pytest.raises(ValueError, match="mm_inputs"):
        engine.submit(ids, mm_inputs=mm + mm)  # two images, one placeholder run
    bad = [type(mm[0])(mm[0].hash, mm[0].pixel_values, mm[0].grid_thw, mm[0].num_tokens,
                       mm[0].offset + 1)]
    with pytest.raises(ValueError, match=r"mm_inputs\[0\]"):
        engine.submit(ids, mm_inputs=bad)
