"""The Qwen3-VL vision tower: a ViT over 16-pixel patches at the image's own resolution with a
learned position table resampled to each image's grid, full attention within each image
(frame), merged 2x2 patches as the language model's tokens, and "DeepStack" features: the
outputs of a few middle blocks, merged the same way, that the language model adds to its first
layers' hidden states at the image's tokens.

Mirrors HF's `Qwen3VLVisionModel` over the project's linear layers. `forward` returns each
image token's main embedding and its DeepStack features side by side in one row
([tokens, out_hidden * (1 + deepstack)]), so the encoder cache and the runner treat them as one
embedding; `models/qwen3_vl.py` splits them again.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from batchgen_data.layers.linear import Linear
from batchgen_data.models.qwen_vision import Grid, VisionAttention, merge_unit_order


class PatchEmbed(nn.Module):
    """A Conv3d (with bias) whose stride is its kernel."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.shape = (config.in_channels, config.temporal_patch_size, config.patch_size,
                      config.patch_size)
        self.proj = nn.Module()
        self.proj.weight = nn.Parameter(torch.empty(config.hidden_size, *self.shape))
        self.proj.bias = nn.Parameter(torch.empty(config.hidden_size))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        w = self.proj.weight
        x = pixels.to(w.dtype).view(-1, *self.shape)
        return F.conv3d(x, w, self.proj.bias, stride=self.shape[1:]).view(x.shape[0], -1)


class VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        approx = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}.get(act)
        if approx is None:
            raise ValueError(f"vision hidden_act={act!r} is not supported (gelu, "
                             "gelu_pytorch_tanh)")
        self.linear_fc1 = Linear(dim, hidden, bias=True)
        self.linear_fc2 = Linear(hidden, dim, bias=True)
        self.approximate = approx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate=self.approximate))


class VisionBlock(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        dim = config.hidden_size
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = VisionAttention(dim, config.num_heads)
        self.mlp = VisionMLP(dim, config.intermediate_size, config.hidden_act)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                segments: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, segments)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """merge_size ** 2 adjacent patches to one token; the DeepStack mergers normalise after
    joining the patches, the main one before."""

    def __init__(self, config: Any, after_join: bool) -> None:
        super().__init__()
        self.width = config.hidden_size * config.spatial_merge_size ** 2
        self.after_join = after_join
        self.norm = nn.LayerNorm(self.width if after_join else config.hidden_size, eps=1e-6)
        self.linear_fc1 = Linear(self.width, self.width, bias=True)
        self.linear_fc2 = Linear(self.width, config.out_hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.width)) if self.after_join else \
            self.norm(x).view(-1, self.width)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class Qwen3VisionTower(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.merge = config.spatial_merge_size
        self.side = int(config.num_position_embeddings ** 0.5)
        head_dim = config.hidden_size // config.num_heads
        params = getattr(config, "rope_parameters", None) or {}
        theta = float(params.get("rope_theta", 10000.0))
        quarter = head_dim // 2
        inv = 1.0 / (theta ** (torch.arange(0, quarter, 2, dtype=torch.float) / quarter))
        self.register_buffer("inv_freq", inv, persistent=False)
        self.patch_embed = PatchEmbed(config)
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.hidden_size)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.depth))
        self.merger = PatchMerger(config, after_join=False)
        self.deepstack_visual_indexes = list(config.deepstack_visual_indexes)
        self.deepstack_merger_list = nn.ModuleList(
            PatchMerger(config, after_join=True) for _ in self.deepstack_visual_indexes)

    def forward(self, pixels: torch.Tensor, grids: list[Grid]) -> torch.Tensor:
        """Patches [N, C * T * P * P] of every image and their grids -> [N / merge ** 2,
        out_hidden * (1 + deepstack)]: each token's embedding, then its DeepStack features."""
        x = self.patch_embed(pixels)
        x = x + self._positions(grids).to(x.dtype)
        emb = torch.cat([self._angles(grids)] * 2, dim=-1)
        cos, sin = emb.cos(), emb.sin()
        frames = [h * w for t, h, w in grids for _ in range(t)]
        deep = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, frames)
            if i in self.deepstack_visual_indexes:
                deep.append(self.deepstack_merger_list[self.deepstack_visual_indexes.index(i)](x))
        return torch.cat([self.merger(x), *deep], dim=-1)

    def _positions(self, grids: list[Grid]) -> torch.Tensor:
        """The learned side x side position table resampled (bilinear, corners aligned) to
        each image's grid, in the patches' merge-unit order: [N, hidden]."""
        table = self.pos_embed.weight.float().t().reshape(1, -1, self.side, self.side)
        rows = []
        for t, h, w in grids:
            grid = F.interpolate(table, size=(h, w), mode="bilinear", align_corners=True)
            grid = grid[0].permute(1, 2, 0)  # [h, w, hidden]
            rows.append(grid[merge_unit_order(h, w, self.merge)].repeat(t, 1))
        return torch.cat(rows)

    def _angles(self, grids: list[Grid]) -> torch.Tensor:
        pos = torch.cat([torch.stack(merge_unit_order(h, w, self.merge), dim=-1).repeat(t, 1)
                         for t, h, w in grids]).to(self.inv_freq.device)  # [N, 2]
        return (pos.unsqueeze(-1).float() * self.inv_freq).flatten(1)
