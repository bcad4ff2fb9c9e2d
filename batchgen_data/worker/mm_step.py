"""A step's images as the runner lays them out: the encoder batch, the prompt rows whose
embeddings come from it, and M-RoPE positions.

`ModelRunner.prepare` builds a `MultiModalStep` on the host (numpy only); `ModelRunner.run`
encodes the step's new images in one tower call (`encode`), stores them in the engine's encoder
cache by content hash, then writes each image's embedding rows over the placeholder rows of the
chunks that reach them (`embeddings`) before the model's forward takes `inputs_embeds`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from batchgen_data.core.encoder_cache import EncoderCache
from batchgen_data.core.sequence import Sequence


@dataclass
class MultiModalStep:
    encode: list[Any]  # images to encode first (core/multimodal.ImageItem), each once
    # (first row in the step, image, first and last placeholder index it covers, exclusive)
    rows: list[tuple[int, Any, int, int]] = field(default_factory=list)


def mrope_positions(seqs: list[Sequence], starts: list[int], q: np.ndarray, cu: np.ndarray,
                    pos: np.ndarray) -> np.ndarray:
    """[3, T] positions of the step's tokens: a prompt's own M-RoPE positions, p + delta past
    its prompt, the plain position on all three axes for a prompt without images."""
    out = np.broadcast_to(pos, (3, pos.shape[0])).copy()
    for i, seq in enumerate(seqs):
        mm = seq.mm
        if mm is None or mm.positions is None:
            continue
        a, n, r = starts[i], int(q[i]), int(cu[i])
        p = mm.num_prompt_tokens
        if a < p:  # prompt tokens: their table
            m = min(a + n, p) - a
            out[:, r:r + m] = mm.positions[:, a:a + m]
        if a + n > p:  # generated tokens: shifted by the prompt's delta
            first = r + max(0, p - a)
            out[:, first:r + n] += mm.delta
    return out


def image_rows(seqs: list[Sequence], starts: list[int], q: np.ndarray, cu: np.ndarray
               ) -> list[tuple[int, Any, int, int]]:
    """The step rows that are image placeholders: per chunk and image, where they start in
    the step and which of the image's embedding rows they take."""
    rows = []
    for i, seq in enumerate(seqs):
        mm = seq.mm
        if mm is None:
            continue
        a, n, r = starts[i], int(q[i]), int(cu[i])
        if a >= mm.num_prompt_tokens:
            continue
        for j in mm.overlapping(a, a + n):
            off, item = mm.offsets[j], mm.items[j]
            lo, hi = max(a, off), min(a + n, off + item.num_tokens)
            rows.append((r + lo - a, item, lo - off, hi - off))
    return rows


def encode(model: Any, cache: EncoderCache, items: list[Any],
           rows: list[tuple[int, Any, int, int]]) -> None:
    """The step's encoder batch: every new image through the tower at once, each image's
    rows stored under its hash. An image the step's rows read that the cache does not hold
    joins the batch too (a part of a failed step run again, whose batch went with the first
    run): the rows never read an image that is not there."""
    batch = {it.hash for it in items}
    for _, item, _, _ in rows:
        if item.hash not in batch and not cache.ready(item.hash):
            items = [*items, item]
            batch.add(item.hash)
    if not items:
        return
    pixels = torch.cat([torch.as_tensor(it.pixel_values) for it in items])
    out = model.encode_images(pixels, [tuple(it.grid_thw) for it in items])
    at = 0
    for it in items:
        cache.put(it.hash, out[at:at + it.num_tokens])
        at += it.num_tokens


def embeddings(model: Any, cache: EncoderCache, input_ids: torch.Tensor,
               rows: list[tuple[int, Any, int, int]]) -> torch.Tensor:
    """[T, hidden] embeddings of the step's tokens with the image rows written in."""
    x = model.embed(input_ids)
    for first, item, lo, hi in rows:
        x[first:first + hi - lo] = cache.get(item.hash)[lo:hi].to(x.device, x.dtype)
    return x
