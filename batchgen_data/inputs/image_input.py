"""What one image of a row is once prepared: the plain data the engine's encoder step takes.

`inputs/images.py` makes these off the engine's thread (fetched, decoded, resized and
normalised by the model's HF image processor); the engine takes them with
`submit(..., mm_inputs=[ImageInput, ...])`. An image is known by the hash of its decoded
pixels, so the same picture in many rows (a logo, a page template) is one encoder output in
the engine's encoder cache (`core/encoder_cache.py`) whatever file format carried it.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True, slots=True)
class ImageInput:
    """One image of a prompt, as the model's image processor left it.

    `offset` / `num_tokens`: where its placeholder tokens sit in the row's expanded
    `prompt_token_ids` (vLLM's PlaceholderRange); the encoder's output for this image has
    `num_tokens` rows that replace those tokens' embeddings.
    """

    hash: str  # blake2b of the decoded pixels (mode, size, bytes) and the processor's settings
    pixel_values: torch.Tensor  # Qwen-VL: [num_patches, C * temporal_patch * patch * patch]
    num_tokens: int
    offset: int = 0
    grid_thw: tuple[int, int, int] | None = None  # Qwen-VL families: the patch grid (t, h, w)
    # other outputs of the family's processor for this image (e.g. an attention mask)
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        assert self.num_tokens > 0 and self.offset >= 0, (self.num_tokens, self.offset)

    @property
    def nbytes(self) -> int:
        return self.pixel_values.numel() * self.pixel_values.element_size()


@dataclass(frozen=True, slots=True)
class ImagePrompt:
    """A row's prompt with its images: the token ids with every image's placeholder tokens
    expanded (as the HF processor expands them), its text, and the images in prompt order."""

    prompt_token_ids: list[int]
    prompt: str
    images: tuple[ImageInput, ...]

    def __post_init__(self) -> None:
        for img in self.images:
            assert img.offset + img.num_tokens <= len(self.prompt_token_ids), img
