"""Qwen3-VL: the Qwen3 decoder (q/k RMSNorm) with interleaved M-RoPE, and the Qwen3-VL vision
tower (`models/qwen3_vision.py`), whose DeepStack features are added to the hidden states of
the decoder's first layers at the image's tokens.

Mirrors HF's `Qwen3VLForConditionalGeneration`. It shares Qwen2.5-VL's prompt layout (the
image's placeholders, the M-RoPE positions of an image) and its engine interface; what differs
is the tower, the rotary layout, and that an image token's embedding row carries its DeepStack
features after the main embedding: `embed` gives text rows zeros there, so adding a layer's
slice to every row adds to the image rows alone, as HF adds it at the visual positions.
"""
from __future__ import annotations

from typing import Any

import torch

from batchgen_data.layers.attention import AttentionMetadata
from batchgen_data.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
from batchgen_data.models.qwen3_vision import Qwen3VisionTower


class Qwen3VLForConditionalGeneration(Qwen2_5_VLForConditionalGeneration):
    qkv_bias = False
    qk_norm = True
    tower: Any = Qwen3VisionTower
    interleaved_mrope = True

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.num_deepstack = len(config.vision_config.deepstack_visual_indexes)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                attn_metadata: AttentionMetadata,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """`inputs_embeds` [T, hidden * (1 + deepstack)]: each row's embedding, then the
        DeepStack features layer i adds to its output (zeros on text rows)."""
        hidden = self.shape.hidden
        if inputs_embeds is None:
            inputs_embeds = self.embed(input_ids)
        x = inputs_embeds[:, :hidden]
        residual = None
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            x, residual = layer(x, residual, positions, kv_cache, attn_metadata)
            if i < self.num_deepstack:  # the layer's output is x + residual: add to x
                x = x + inputs_embeds[:, hidden * (i + 1):hidden * (i + 2)]
        x, _ = self.norm(x, residual)
        return x

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] -> [T, hidden * (1 + deepstack)]: the token embeddings, zeros after them."""
        x = self.embed_tokens(input_ids)
        pad = x.new_zeros(x.shape[0], self.shape.hidden * self.num_deepstack)
        return torch.cat([x, pad], dim=-1)
