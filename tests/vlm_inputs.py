"""Helpers for the image-input tests: a tiny Qwen2.5-VL directory without weights (its config,
a small trained BPE tokenizer with Qwen's vision tokens and a ChatML template that renders
image parts as `<|vision_start|><|image_pad|><|vision_end|>`, HF's PIL image processor with a
small pixel range), PIL-made images, and a local HTTP server whose answers can be slow."""
from __future__ import annotations

import io
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
from PIL import Image

VL_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif p['type'] == 'text' %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
_CORPUS = ["Describe the picture in one sentence.", "What colour is the square?",
           "Read the invoice number from the scan.", "Compare the two photos."] * 20


def build_vl_processor(path: Path) -> Path:
    """A saved Qwen2.5-VL processor (tokenizer, image processor, template) at `path`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2_5_VLConfig
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil)

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *VISION_TOKENS]
    tok.train_from_iterator(_CORPUS, trainers.BpeTrainer(
        vocab_size=300, special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>")
    fast.chat_template = VL_TEMPLATE
    fast.save_pretrained(path)  # a checkpoint's tokenizer files, its chat template included
    Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=28 * 28 * 16).save_pretrained(path)
    Qwen2_5_VLConfig(text_config={"vocab_size": len(fast)}).save_pretrained(path)
    return path


def picture(seed: int, size: tuple[int, int] = (56, 56), mode: str = "RGB") -> Image.Image:
    """A random picture (different seeds: different pixels)."""
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    arr = rng.integers(0, 256, (size[1], size[0], channels), dtype=np.uint8)
    return Image.fromarray(arr[:, :, 0] if channels == 1 else arr, mode)


def encoded(img: Image.Image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


@contextmanager
def http_server(routes: dict[str, tuple[float, bytes]]) -> Iterator[tuple[str, dict[str, int]]]:
    """A local server answering `path -> (delay_s, body)`; yields its base URL and counters
    (`peak`: the most requests in progress at once)."""
    lock = threading.Lock()
    counts = {"now": 0, "peak": 0, "served": 0}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            with lock:
                counts["now"] += 1
                counts["peak"] = max(counts["peak"], counts["now"])
            try:
                delay, body = routes.get(self.path, (0.0, b""))
                if self.path not in routes:
                    self.send_error(404)
                    return
                time.sleep(delay)
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                counts["served"] += 1
            except (BrokenPipeError, ConnectionResetError):
                pass
            finally:
                with lock:
                    counts["now"] -= 1

        def log_message(self, *_: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", counts
    finally:
        server.shutdown()
        server.server_close()
