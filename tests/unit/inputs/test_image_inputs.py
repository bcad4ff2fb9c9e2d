"""inputs/images.py: a row's images to expanded token ids and ImageInputs, against the HF
processor's own call (the oracle: `processor(text=, images=)` on the same rendered text), with
every source a row can carry and every bad image a ValueError with its reason."""
from __future__ import annotations

import base64
import struct
import zlib
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pytest
import torch

from batchgen_data.inputs.image_options import ImageOptions
from batchgen_data.inputs.hf_processor import load_processor
from batchgen_data.inputs.images import ImagePreparer, LazyPreparer
from vlm_inputs import build_vl_processor, encoded, http_server, picture


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_vl_processor(tmp_path_factory.mktemp("tiny-vl-proc"))


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("media")


@pytest.fixture(scope="module")
def prep(vl_dir: Path, media_dir: Path) -> ImagePreparer:
    p = ImagePreparer.for_model(str(vl_dir), ImageOptions(
        limit_mm_per_prompt={"image": 3}, allowed_local_media_path=str(media_dir)))
    assert p is not None
    yield p
    p.close()


def data_url(img: Any, fmt: str = "PNG") -> str:
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(encoded(img, fmt)).decode()


def chat(*sources: Any, text: str = "What colour is the square?") -> list[dict[str, Any]]:
    parts = [{"type": "image_url", "image_url": {"url": s}} for s in sources]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def test_matches_the_hf_processor_call(prep: ImagePreparer, vl_dir: Path) -> None:
    """Two images of different sizes: token ids, pixel values and grids are the HF processor's
    for the same rendered text; each image's offset/num_tokens is its run of image tokens."""
    a, b = picture(1, (56, 56)), picture(2, (84, 56))
    out = prep.prepare_chat(chat(data_url(a), data_url(b)))
    proc = load_processor(str(vl_dir))
    text = proc.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "image"},
                                      {"type": "text", "text": "What colour is the square?"}]}],
        tokenize=False, add_generation_prompt=True)
    ref = proc(text=[text], images=[a, b], return_tensors="pt")
    assert out.prompt_token_ids == ref["input_ids"][0].tolist()
    assert torch.equal(torch.cat([i.pixel_values for i in out.images]), ref["pixel_values"])
    assert [i.grid_thw for i in out.images] == [tuple(g) for g in ref["image_grid_thw"].tolist()]
    pad = proc.image_token_id
    for img in out.images:
        run = out.prompt_token_ids[img.offset:img.offset + img.num_tokens]
        assert run == [pad] * img.num_tokens
        assert out.prompt_token_ids[img.offset - 1] != pad
        assert img.num_tokens == np.prod(img.grid_thw) // 4  # merge_size 2
    assert out.images[0].hash != out.images[1].hash


def test_every_source_of_one_picture_is_one_image(prep: ImagePreparer, media_dir: Path) -> None:
    """data: URL, path, file://, memory:// (fsspec), bytes, a HWC array (ray.data.read_images),
    HF datasets' and Spark binaryFile's structs, Spark's image struct (BGR), a PIL image, a
    JPEG-free RGBA PNG over white: the same pixels, the same hash and pixel values."""
    img = picture(3)
    png = encoded(img)
    (media_dir / "a.png").write_bytes(png)
    with fsspec.open("memory://imgs/a.png", "wb") as f:
        f.write(png)
    arr = np.asarray(img)
    spark_image = {"origin": "x", "height": 56, "width": 56, "nChannels": 3, "mode": 16,
                   "data": arr[:, :, ::-1].tobytes()}
    rgba = img.convert("RGBA")  # opaque: over white it is the same picture
    sources = [data_url(img), str(media_dir / "a.png"), f"file://{media_dir / 'a.png'}",
               "memory://imgs/a.png", png, arr, {"bytes": png, "path": None},
               {"content": png, "path": "a.png"}, spark_image, img, encoded(rgba)]
    outs = [prep.prepare_chat([{"role": "user", "content": [{"type": "image", "image": s}]}])
            for s in sources]
    first = outs[0].images[0]
    for s, o in zip(sources, outs):
        assert o.images[0].hash == first.hash, type(s)
        assert torch.equal(o.images[0].pixel_values, first.pixel_values)
    assert prep.processed.stats.hits >= len(sources) - 1


def _png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height, with one tiny compressed row."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr)
            + chunk(b"IDAT", zlib.compress(b"\x00" * 16)) + chunk(b"IEND", b""))


@pytest.mark.parametrize("source, reason", [
    (b"not an image at all", "not an image in a supported format"),
    (encoded(picture(4))[:200], "truncated"),
    (encoded(picture(4), "PPM"), "not an image in a supported format"),
    (_png_header_only(200_000, 200_000), "pixel"),  # a decompression bomb, by its header
    ("data:image/png;base64,@@@", "not valid base64"),
    ("/no/such/file.png", "not below allowed_local_media_path"),
    ("memory://no/such.png", "could not fetch"),
    ("http://127.0.0.1:1/x.png", "could not fetch"),  # nothing listens on port 1
    (np.zeros((4, 4, 2), np.uint8), "HxWxC"),
])
def test_bad_images_are_errors_with_a_reason(prep: ImagePreparer, source: Any,
                                             reason: str) -> None:
    with pytest.raises(ValueError, match=reason) as e:
        prep.prepare_chat([{"role": "user", "content": [{"type": "image", "image": source}]}])
    assert "image 1 of 1" in str(e.value)


def test_pixel_cap_and_limit(vl_dir: Path) -> None:
    """Over `max_image_pixels` from the header; more images than `limit_mm_per_prompt` is
    refused at submit, before anything is fetched."""
    small = ImagePreparer.for_model(str(vl_dir), ImageOptions(max_image_pixels=1000,
                                                             limit_mm_per_prompt={"image": 1}))
    try:
        with pytest.raises(ValueError, match="over max_image_pixels=1000"):
            small.prepare_chat(chat(data_url(picture(5))))
        with pytest.raises(ValueError, match=r"2 images, over the limit of 1"):
            small.submit_chat(chat("http://127.0.0.1:1/a.png", "http://127.0.0.1:1/b.png"))
    finally:
        small.close()


def test_slow_url_times_out_and_fetches_are_bounded(vl_dir: Path) -> None:
    """A URL slower than image_fetch_timeout_s is the row's error; a row's URLs are fetched at
    most image_fetch_concurrency at a time."""
    png = encoded(picture(6))
    routes = {"/slow.png": (3.0, png), **{f"/{i}.png": (0.2, png) for i in range(3)}}
    with http_server(routes) as (base, counts):
        opts = ImageOptions(image_fetch_timeout_s=0.5, image_fetch_concurrency=2)
        p = ImagePreparer(load_processor(str(vl_dir)), opts)
        try:
            out = p.prepare_chat(chat(*(f"{base}/{i}.png" for i in range(3))))
            assert len(out.images) == 3 and counts["served"] == 3
            assert counts["peak"] == 2
            with pytest.raises(ValueError, match=r"timed out after 0.5s"):
                p.prepare_chat(chat(f"{base}/slow.png"))
        finally:
            p.close()


def test_column_images_and_template_mismatches(prep: ImagePreparer) -> None:
    """Image parts without a source take the row's image column in order; a count that does
    not match, or a text that smuggles in an image token, is refused."""
    a, b = picture(7), picture(8)
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "x"},
                                         {"type": "image"}]}]
    out = prep.prepare_chat(msgs, images=[a, b])
    direct = prep.prepare_chat(chat(data_url(a), data_url(b), text="x"))
    assert [i.hash for i in out.images] == [i.hash for i in direct.images]
    with pytest.raises(ValueError, match="2 image part.*holds 1 image"):
        prep.submit_chat(msgs, images=[a])
    with pytest.raises(ValueError, match="2 image token"):
        prep.prepare_chat(chat(data_url(a), text="<|image_pad|>"))
    with pytest.raises(ValueError, match="type 'input_audio' is not supported"):
        prep.submit_chat([{"role": "user", "content": [{"type": "input_audio"}]}])


def test_text_only_model_has_no_preparer(tiny_model_dir: Any) -> None:
    """A text model's directory has no image processor: no pipeline (the front doors then
    refuse image parts by name)."""
    tok = type("Tok", (), {"name_or_path": str(tiny_model_dir("llama"))})()
    assert LazyPreparer(tok)() is None
