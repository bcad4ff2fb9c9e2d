"""A prompt's images as the engine keeps them: plain data on the request's sequences.

Each image arrives from the inputs pipeline (`batchgen_data/inputs/images.py`) as an item with
a content hash (`hash`), its processed pixels (`pixel_values`), its patch grid (`grid_thw`) and
the placeholder tokens it takes in the prompt (`num_tokens`, from `offset`); the prompt's token
ids already hold those placeholders, image after image. `MultiModalPrompt` records where each run
starts, the M-RoPE positions of the prompt when the model rotates by three coordinates, and the
prompt as the prefix cache sees it: the placeholders of an image keyed by its hash, so that two
prompts share KV only where their text and their images agree.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np


class ImageItem(Protocol):
    """What the engine reads of an image (`inputs/images.py`'s `ImageInput`)."""

    hash: str
    pixel_values: Any  # torch.Tensor [patches, C * T * P * P]
    grid_thw: tuple[int, int, int]
    num_tokens: int
    offset: int  # its first placeholder token in the prompt


def placeholder_key(content_hash: str) -> int:
    """The prefix cache's stand-in for every placeholder token of an image: negative, so it
    never equals a token id."""
    return -1 - (hash(("image", content_hash)) & ((1 << 62) - 1))


@dataclass(eq=False)
class MultiModalPrompt:
    items: list[Any]  # ImageItem, in prompt order
    offsets: list[int]  # the first placeholder of each item in the prompt
    cache_keys: list[int]  # the prompt's token ids, placeholders replaced by their image's key
    positions: np.ndarray | None = None  # [3, prompt_len] M-RoPE positions (None: 1-D)
    delta: int = 0  # a generated token at index p sits at position p + delta (M-RoPE)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.cache_keys)

    def keys(self, token_ids: list[int]) -> list[int]:
        """`token_ids` (prompt + output) as the prefix cache keys them."""
        return self.cache_keys + token_ids[len(self.cache_keys):]

    def overlapping(self, start: int, end: int) -> list[int]:
        """Indexes of the items whose placeholders meet token range [start, end)."""
        return [i for i, (a, it) in enumerate(zip(self.offsets, self.items))
                if a < end and a + it.num_tokens > start]


def check_placeholders(prompt_ids: list[int], token_id: int, items: list[Any]) -> list[int]:
    """Each item's first placeholder (`offset`), checked: its `num_tokens` tokens from there
    are the image token, the items come in prompt order without overlapping, and no image
    token is left over. ValueError naming `mm_inputs` otherwise."""
    ids = np.asarray(prompt_ids, dtype=np.int64)
    total = int((ids == token_id).sum())
    if total != sum(it.num_tokens for it in items):
        raise ValueError(f"mm_inputs: {len(items)} image(s) of "
                         f"{sum(it.num_tokens for it in items)} tokens but the prompt holds "
                         f"{total} image tokens ({token_id})")
    end = 0
    for i, it in enumerate(items):
        a, n = int(it.offset), int(it.num_tokens)
        if a < end or not (ids[a:a + n] == token_id).all() or a + n > len(ids):
            raise ValueError(f"mm_inputs[{i}]: offset={a}, num_tokens={n} is not a run of "
                             f"image tokens after the previous image's")
        end = a + n
    return [int(it.offset) for it in items]


def cache_keys(prompt_ids: list[int], offsets: list[int], items: list[Any]) -> list[int]:
    keys = list(prompt_ids)
    for a, it in zip(offsets, items):
        keys[a:a + it.num_tokens] = [placeholder_key(it.hash)] * it.num_tokens
    return keys
