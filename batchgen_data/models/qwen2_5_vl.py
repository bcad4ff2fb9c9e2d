"""Qwen2.5-VL: the Qwen2 decoder with M-RoPE positions, and a vision tower
(`models/qwen_vision.py`) whose merged patches take the places of a prompt's image tokens.

Mirrors HF's `Qwen2_5_VLForConditionalGeneration`. The language model is the project's decoder
stack (q/k/v biased like Qwen2) with `MRotaryEmbedding`; the engine asks the model three
things beyond a decoder's: `encode_images` (pixels of a step's images -> their token
embeddings, one tower call for all of them), `multimodal_prompt` (where a prompt's images sit,
their M-RoPE positions) and `embed` (the token embeddings the runner writes image rows into
before `forward(..., inputs_embeds=)`).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from batchgen_data.core.multimodal import MultiModalPrompt, cache_keys, check_placeholders
from batchgen_data.layers.attention import AttentionMetadata
from batchgen_data.layers.rotary import MRotaryEmbedding
from batchgen_data.models.llama import DecoderForCausalLM
from batchgen_data.models.qwen_vision import Grid, Qwen2_5_VisionTower


class Qwen2_5_VLForConditionalGeneration(DecoderForCausalLM):
    qkv_bias = True
    takes_images = True
    tower: Any = Qwen2_5_VisionTower
    interleaved_mrope = False  # Qwen3-VL interleaves the three axes' frequencies

    def __init__(self, config: Any) -> None:
        text = config.text_config
        # the composite config decides (HF ties when either says so)
        text.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        super().__init__(text)
        s = self.shape
        self.rotary = MRotaryEmbedding(text, s.head_dim, s.max_positions,
                                       interleaved=self.interleaved_mrope)
        for layer in self.layers:
            layer.self_attn.rotary_emb = self.rotary
        self.vl_config = config
        self.image_token_id = int(config.image_token_id)
        self.merge = int(config.vision_config.spatial_merge_size)
        self.visual = self.tower(config.vision_config)

    @staticmethod
    def checkpoint_name(name: str) -> str:
        """HF 5.x nests the decoder as `model.language_model.*`; older checkpoints keep it at
        `model.*`: both land on the decoder stack at the top of this module."""
        prefix = "language_model."
        return name[len(prefix):] if name.startswith(prefix) else name

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                attn_metadata: AttentionMetadata,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states [T, hidden]; `positions` [3, T] (M-RoPE); `inputs_embeds` [T, hidden]:
        the step's embeddings with image rows written in (None: the tokens' own)."""
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, positions, kv_cache, attn_metadata)
        x, _ = self.norm(x, residual)
        return x

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] token ids -> [T, hidden], a new tensor the caller may write into."""
        return self.embed_tokens(input_ids).clone()

    def encode_images(self, pixel_values: torch.Tensor, grid_thw: list[Grid]) -> torch.Tensor:
        """The patches of several images, concatenated in order, and each image's grid ->
        [sum of num_tokens, hidden] embeddings, image after image."""
        w = self.visual.patch_embed.proj.weight
        return self.visual(pixel_values.to(w.device, w.dtype),
                           [tuple(int(v) for v in g) for g in grid_thw])

    def num_image_tokens(self, grid_thw: Grid) -> int:
        t, h, w = grid_thw
        return t * h * w // self.merge ** 2

    def multimodal_prompt(self, prompt_ids: list[int], items: list[Any]) -> MultiModalPrompt:
        """Where each image's placeholders are (checked against `items`) and the M-RoPE
        positions of the prompt: text tokens count up by one on all three axes; an image's
        tokens take (t, row, column) of its merged grid from where the text stopped, and the
        text after it goes on from one past the image's largest side."""
        for i, it in enumerate(items):
            want = self.num_image_tokens(tuple(it.grid_thw))
            if it.num_tokens != want:
                raise ValueError(f"mm_inputs[{i}]: num_tokens={it.num_tokens} but grid_thw="
                                 f"{tuple(it.grid_thw)} gives {want} tokens")
        offsets = check_placeholders(prompt_ids, self.image_token_id, items)
        n = len(prompt_ids)
        pos = np.empty((3, n), dtype=np.int64)
        cur = at = 0
        for a, it in zip(offsets, items):
            pos[:, at:a] = cur + np.arange(a - at)
            cur += a - at
            t, h, w = (int(v) for v in it.grid_thw)
            gh, gw = h // self.merge, w // self.merge
            tt, hh, ww = np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")
            pos[:, a:a + it.num_tokens] = np.stack([tt.ravel(), hh.ravel(), ww.ravel()]) + cur
            cur += max(gh, gw)
            at = a + it.num_tokens
        pos[:, at:] = cur + np.arange(n - at)
        delta = int(pos.max()) + 1 - n if n else 0
        return MultiModalPrompt(list(items), offsets, cache_keys(prompt_ids, offsets, items),
                                pos, delta)
