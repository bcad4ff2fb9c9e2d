"""A row's images to what the engine takes: `ImagePrompt` (expanded token ids + `ImageInput`s).

What runs where: `ImagePreparer.submit_*` returns at once; the row's work runs on its own pool
of `image_workers` threads, never on the engine's step thread. Each row's URLs are fetched on
the `Fetcher`'s bounded pool (all of a row's images at once, each under the fetch timeout),
then each image is decoded and checked (`image_decode`), hashed by its pixels, and resized and
normalised by the model's HF image processor (loaded from the model directory:
`hf_processor.py`) unless that hash was processed before (a repeated image costs a dictionary lookup).
The rendered prompt's image tokens are expanded with the processor's own replacement text
(`replace_image_token`, as the HF processor's call expands them), then tokenized; the runs of
the image token give each image's placeholder offset and length.

Bad input raises ValueError with the reason (the row's error): more images than
`limit_mm_per_prompt`, an unreachable or slow URL, corrupt, truncated or unsupported data, an
image over the pixel cap, a template or text whose image tokens do not match the images.
"""
from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from batchgen_data.inputs.chat import check_template_kwargs
from batchgen_data.inputs.hf_processor import load_processor
from batchgen_data.inputs.image_cache import HashLRU, tensor_bytes
from batchgen_data.inputs.image_fetch import Fetcher, describe
from batchgen_data.inputs.image_input import ImageInput, ImagePrompt
from batchgen_data.inputs.image_options import ImageOptions
from batchgen_data.inputs.image_parts import fill_sources, split_messages

if TYPE_CHECKING:
    from PIL import Image

_PROCESSED_CACHE_BYTES = 256 << 20  # processor outputs of repeated images kept per front door


class ImagePreparer:
    """One model's image pipeline, shared by a front door's rows (thread-safe)."""

    def __init__(self, processor: Any, options: ImageOptions | None = None) -> None:
        self.processor = processor
        self.options = options or ImageOptions()
        self.tokenizer = processor.tokenizer
        self.image_token: str = processor.image_token
        self.image_token_id = getattr(processor, "image_token_id", None)
        if self.image_token_id is None:
            self.image_token_id = self.tokenizer.convert_tokens_to_ids(self.image_token)
        self.fetcher = Fetcher(self.options)
        self._pool = ThreadPoolExecutor(self.options.image_workers,
                                        thread_name_prefix="image-prep")
        self.processed: HashLRU[tuple[Any, ...]] = HashLRU(_PROCESSED_CACHE_BYTES)
        self._salt = repr(sorted(self.options.mm_processor_kwargs.items()))
        self._tok_lock = threading.Lock()  # HF fast tokenizers refuse two threads at once
        self._busy_lock = threading.Lock()
        self.busy_s = 0.0  # seconds of row preparation, summed over the workers
        self.rows = 0

    @classmethod
    def for_model(cls, model: str, options: ImageOptions | None = None,
                  trust_remote_code: bool = False) -> "ImagePreparer | None":
        proc = load_processor(model, trust_remote_code)
        return None if proc is None else cls(proc, options)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.fetcher.close()

    # ---- entry points: a Future of the row's ImagePrompt ---------------------------------
    def submit_chat(self, messages: Any, images: Sequence[Any] = (),
                    add_generation_prompt: bool = True, chat_template: str | None = None,
                    chat_template_kwargs: Mapping[str, Any] | None = None) -> Future:
        """Chat messages with image parts; `images`: the row's image column, which fills the
        image parts without a source. Invalid messages raise ValueError here, at once."""
        split = split_messages(messages)
        sources = fill_sources(split.sources, list(images))
        self._check_limit(len(sources))
        extra = check_template_kwargs(dict(chat_template_kwargs) if chat_template_kwargs
                                      else None)
        template = chat_template or getattr(self.processor, "chat_template", None)
        if template is not None:
            extra["chat_template"] = template

        def render() -> str:
            try:
                with self._tok_lock:
                    return self.tokenizer.apply_chat_template(
                        split.messages, tokenize=False,
                        add_generation_prompt=add_generation_prompt, **extra)
            except Exception as e:  # noqa: BLE001 - a template may refuse a role order
                raise ValueError(f"chat template failed on messages: {e}") from None

        return self._pool.submit(self._timed, render, sources)

    def submit_prompt(self, prompt: str, images: Sequence[Any], as_chat: bool = True,
                      chat_template: str | None = None,
                      chat_template_kwargs: Mapping[str, Any] | None = None) -> Future:
        """A plain prompt with the row's images: as one user turn with the images before the
        text (`as_chat`), or sent raw, its text already holding one image token per image
        (vLLM's `multi_modal_data` prompts)."""
        if as_chat:
            content = [*({"type": "image", "image": img} for img in images),
                       {"type": "text", "text": prompt}]
            return self.submit_chat([{"role": "user", "content": content}], (), True,
                                    chat_template, chat_template_kwargs)
        self._check_limit(len(images))
        return self._pool.submit(self._timed, lambda: prompt, list(images))

    def prepare_chat(self, messages: Any, images: Sequence[Any] = (), **kwargs: Any
                     ) -> ImagePrompt:
        return self.submit_chat(messages, images, **kwargs).result()

    # ---- the work of one row, on a pool thread ------------------------------------------
    def _check_limit(self, n: int) -> None:
        limit = self.options.image_limit
        if n > limit:
            raise ValueError(f"the prompt holds {n} images, over the limit of {limit} "
                             f"(limit_mm_per_prompt={{'image': {limit}}})")

    def _timed(self, render: Any, sources: list[Any]) -> ImagePrompt:
        t0 = time.perf_counter()
        try:
            return self._prepare(render(), sources)
        finally:
            with self._busy_lock:
                self.busy_s += time.perf_counter() - t0
                self.rows += 1

    def _prepare(self, text: str, sources: list[Any]) -> ImagePrompt:
        found = text.count(self.image_token)
        if found != len(sources):
            raise ValueError(f"the prompt text holds {found} image token(s) "
                             f"({self.image_token!r}) for {len(sources)} image(s)")
        started = [self._start(i, s, len(sources)) for i, s in enumerate(sources)]
        try:
            done = [self._one(i, s, started[i], len(sources)) for i, s in enumerate(sources)]
        except BaseException:
            for f in started:  # the row failed: its other fetches need not finish
                if isinstance(f, Future):
                    f.cancel()
            raise
        expanded, _ = self.processor.get_text_with_replacements(
            [text], images_replacements=[d[3] for d in done])
        with self._tok_lock:
            ids = list(self.tokenizer(expanded[0], add_special_tokens=False)["input_ids"])
        runs = _runs(ids, self.image_token_id)
        if len(runs) != len(done):
            raise ValueError(f"the processor's expansion gave {len(runs)} image token runs for "
                             f"{len(done)} image(s): this processor's layout is not supported")
        images = tuple(ImageInput(h, pv, length, start, grid, extra)
                       for (h, pv, grid, _, extra), (start, length) in zip(done, runs))
        return ImagePrompt(ids, expanded[0], images)

    def _start(self, i: int, source: Any, n: int) -> Any:
        """The image's fetch begun (every URL of a row at once, on the fetcher's pool)."""
        try:
            return self.fetcher.start(source)
        except (ValueError, TypeError) as e:
            raise type(e)(f"image {i + 1} of {n} ({describe(source)}): {e}") from None

    def _one(self, i: int, source: Any, started: Any, n: int) -> tuple[Any, ...]:
        """(hash, pixel_values, grid_thw, replacement text, extra) of the row's image `i`."""
        from batchgen_data.inputs.image_decode import decode, pixel_hash  # PIL: images only

        try:
            img = decode(self.fetcher.result(started, source), self.options)
            key = pixel_hash(img, self._salt)
            hit = self.processed.get(key)
            if hit is not None:
                return hit
            t0 = time.perf_counter()
            value = (key, *self._process(img))
            self.processed.put(key, value, tensor_bytes(value[1]), time.perf_counter() - t0)
            return value
        except (ValueError, TypeError) as e:
            raise type(e)(f"image {i + 1} of {n} ({describe(source)}): {e}") from None

    def _process(self, img: "Image.Image") -> tuple[Any, ...]:
        """The image processor's output for one image: pixel values, grid, replacement text."""
        try:
            out = self.processor.image_processor(
                images=[img], return_tensors="pt", **self.options.mm_processor_kwargs)
            replacement = self.processor.replace_image_token(out, image_idx=0)
        except ValueError as e:  # e.g. an aspect ratio the resize cannot keep
            raise ValueError(f"the image processor refused it: {e}") from None
        grid = out.get("image_grid_thw")
        grid_thw = tuple(int(v) for v in grid[0]) if grid is not None else None
        extra = {k: v for k, v in out.items() if k not in ("pixel_values", "image_grid_thw")}
        return out["pixel_values"], grid_thw, replacement, extra


class LazyPreparer:
    """A model's preparer, loaded when a row first holds an image (a text-only job never
    loads a processor); the model directory is the tokenizer's (`name_or_path`)."""

    def __init__(self, tokenizer: Any, options: ImageOptions | None = None,
                 ready: ImagePreparer | None = None) -> None:
        path = getattr(tokenizer, "name_or_path", None)
        # a local directory only: a hub name is never fetched (nothing is downloaded)
        self._model = path if isinstance(path, str) and os.path.isdir(path) else None
        self._options = options or ImageOptions()
        self._prep, self._loaded = ready, ready is not None
        self._lock = threading.Lock()

    def __call__(self) -> ImagePreparer | None:
        with self._lock:
            if not self._loaded:
                self._loaded = True
                if self._model is not None:
                    self._prep = ImagePreparer.for_model(self._model, self._options)
            return self._prep


def _runs(ids: list[int], token: int) -> list[tuple[int, int]]:
    """(start, length) of each maximal run of `token` in `ids`."""
    runs: list[tuple[int, int]] = []
    start = None
    for pos, t in enumerate([*ids, None]):
        if t == token and start is None:
            start = pos
        elif t != token and start is not None:
            runs.append((start, pos - start))
            start = None
    return runs
