"""The Qwen2.5-VL vision tower: a ViT over 14-pixel patches of an image at its own resolution,
attending within windows in most blocks and over the whole image in a few, whose output
patches are merged 2x2 into one language-model token each.

Mirrors HF's `Qwen2_5_VisionTransformerPretrainedModel` over the project's linear and norm
layers. The tower runs packed: the patches of all the step's images in one tensor, each
attention block attending within its segments (a window, or a whole image) so that images
never see each other. The patch order inside an image is the HF processor's: merge-unit
major (the 2x2 patches that become one token are adjacent).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from batchgen_data.layers.activation import SiluAndMul
from batchgen_data.layers.linear import Linear, MergedLinear
from batchgen_data.layers.norm import RMSNorm

Grid = tuple[int, int, int]  # (temporal, height, width) in patches


def merge_unit_order(h: int, w: int, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column of each patch of an h x w grid in the processor's order: merge unit
    after merge unit (row-major), row-major inside each."""
    shape = (h // merge, merge, w // merge, merge)
    rows = torch.arange(h).view(h // merge, merge, 1, 1).expand(shape)
    cols = torch.arange(w).view(1, 1, w // merge, merge).expand(shape)
    return rows.permute(0, 2, 1, 3).reshape(-1), cols.permute(0, 2, 1, 3).reshape(-1)


class PatchEmbed(nn.Module):
    """A Conv3d whose stride is its kernel: each flattened patch [C * T * P * P] to a vector."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.shape = (config.in_channels, config.temporal_patch_size, config.patch_size,
                      config.patch_size)
        self.proj = nn.Module()
        self.proj.weight = nn.Parameter(torch.empty(config.hidden_size, *self.shape))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """[N, C * T * P * P] -> [N, hidden]."""
        w = self.proj.weight
        x = pixels.to(w.dtype).view(-1, *self.shape)
        return F.conv3d(x, w, stride=self.shape[1:]).view(x.shape[0], -1)


class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = Linear(dim, 3 * dim, bias=True)
        self.proj = Linear(dim, dim, bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                segments: list[int]) -> torch.Tensor:
        """x [N, dim]; each run of `segments` rows attends within itself only."""
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)  # [N, H, D]
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        outs = []
        for qs, ks, vs in zip(*(t.transpose(0, 1).split(segments, dim=1) for t in (q, k, v))):
            outs.append(F.scaled_dot_product_attention(qs, ks, vs))  # [H, n_i, D]
        o = torch.cat(outs, dim=1).transpose(0, 1).reshape(n, -1)
        return self.proj(o)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary in fp32; cos / sin [N, D] span the whole head."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (xf * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)).to(x.dtype)


class VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        if act != "silu":
            raise ValueError(f"vision hidden_act={act!r} is not supported (silu)")
        self.gate_up_proj = MergedLinear(dim, [hidden, hidden], bias=True)
        self.down_proj = Linear(hidden, dim, bias=True)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class VisionBlock(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        dim = config.hidden_size
        self.norm1 = RMSNorm(dim, 1e-6)
        self.norm2 = RMSNorm(dim, 1e-6)
        self.attn = VisionAttention(dim, config.num_heads)
        self.mlp = VisionMLP(dim, config.intermediate_size, config.hidden_act)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                segments: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, segments)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Each merge unit (merge_size ** 2 adjacent patches) to one language-model token."""

    def __init__(self, out_dim: int, dim: int, merge_size: int) -> None:
        super().__init__()
        self.width = dim * merge_size ** 2
        self.ln_q = RMSNorm(dim, 1e-6)
        self.mlp = nn.Sequential(Linear(self.width, self.width, bias=True), nn.GELU(),
                                 Linear(self.width, out_dim, bias=True))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))


class Qwen2_5_VisionTower(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.merge = config.spatial_merge_size
        self.unit = self.merge ** 2
        self.patch_size = config.patch_size
        self.window_size = config.window_size
        self.full_blocks = set(config.fullatt_block_indexes)
        head_dim = config.hidden_size // config.num_heads
        params = getattr(config, "rope_parameters", None) or {}
        theta = float(params.get("rope_theta", 10000.0))
        quarter = head_dim // 2
        inv = 1.0 / (theta ** (torch.arange(0, quarter, 2, dtype=torch.float) / quarter))
        self.register_buffer("inv_freq", inv, persistent=False)  # [head_dim / 4]
        self.patch_embed = PatchEmbed(config)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.depth))
        self.merger = PatchMerger(config.out_hidden_size, config.hidden_size, self.merge)

    def forward(self, pixels: torch.Tensor, grids: list[Grid]) -> torch.Tensor:
        """Patches of every image [N, C * T * P * P] (in the processor's order) and each
        image's grid -> merged tokens [N / merge ** 2, out_hidden]."""
        order, windows = self._windows(grids)
        frames = [h * w for t, h, w in grids for _ in range(t)]  # full attention: per frame
        x = self.patch_embed(pixels)
        n = x.shape[0]
        x = x.view(n // self.unit, self.unit, -1)[order].reshape(n, -1)
        angles = self._angles(grids)  # [N, head_dim / 2]
        angles = angles.view(n // self.unit, self.unit, -1)[order].reshape(n, -1)
        emb = torch.cat([angles, angles], dim=-1)
        cos, sin = emb.cos(), emb.sin()
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, frames if i in self.full_blocks else windows)
        merged = self.merger(x)
        return merged[torch.argsort(order)]

    def _angles(self, grids: list[Grid]) -> torch.Tensor:
        """Each patch's (row, column) rotary angles, merge-unit major like the patches."""
        pos = torch.cat([torch.stack(merge_unit_order(h, w, self.merge), dim=-1).repeat(t, 1)
                         for t, h, w in grids]).to(self.inv_freq.device)  # [N, 2]
        freqs = pos.unsqueeze(-1).float() * self.inv_freq  # [N, 2, head_dim / 4]
        return freqs.flatten(1)  # [N, head_dim / 2]: the row's angles, then the column's

    def _windows(self, grids: list[Grid]) -> tuple[torch.Tensor, list[int]]:
        """The merge units reordered window by window (window_size pixels square), and the
        windows' lengths in patches."""
        win = self.window_size // self.merge // self.patch_size  # in merged tokens
        order, lengths, base = [], [], 0
        for t, h, w in grids:
            gh, gw = h // self.merge, w // self.merge
            idx = torch.arange(t * gh * gw).view(t, gh, gw)
            nh, nw = -(-gh // win), -(-gw // win)
            for f in range(t):
                for a in range(nh):
                    for b in range(nw):
                        cell = idx[f, a * win:(a + 1) * win, b * win:(b + 1) * win].reshape(-1)
                        order.append(cell + base)
                        lengths.append(cell.numel() * self.unit)
            base += t * gh * gw
        return torch.cat(order).to(self.inv_freq.device), lengths
