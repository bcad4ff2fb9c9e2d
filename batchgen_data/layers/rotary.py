"""Rotary position embedding (NeoX / Llama "rotate half" layout) with the scaling variants
used by Llama 3.x, Qwen2, Qwen3 and Phi-3 configs: default, linear, dynamic-free llama3, yarn,
longrope (`long_rope.py`). Partial rotation (`partial_rotary_factor`) is `partial_rotary.py`.

The implementation is chosen when the layer is built: the Triton kernel on CUDA, an in-place C
rotation on an fp32 CPU, torch elsewhere. When q and k are adjacent heads of one fused qkv row
(the usual case) the C and torch paths rotate both in one pass.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from batchgen_data.layers import long_rope
from batchgen_data.layers.backend import current


def rope_parameters(config: Any) -> dict[str, Any]:
    """Normalise transformers 4.x (`rope_theta` + `rope_scaling`) and 5.x (`rope_parameters`)."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    scaling = getattr(config, "rope_scaling", None) or {}
    for k, v in scaling.items():
        params.setdefault(k, v)
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default")) or "default"
    return params


def inv_frequencies(config: Any, head_dim: int, positions: int | None = None
                    ) -> tuple[torch.Tensor, float]:
    """[head_dim // 2] inverse frequencies and the attention scaling factor (LongRoPE's depend
    on the `positions` the table serves, `layers/long_rope.py`)."""
    p = rope_parameters(config)
    base = float(p["rope_theta"])
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    kind = p["rope_type"]
    if kind == "default":
        return inv.float(), 1.0
    if kind == "linear":
        return (inv / float(p["factor"])).float(), 1.0
    if kind == "llama3":
        factor = float(p["factor"])
        low, high = float(p["low_freq_factor"]), float(p["high_freq_factor"])
        old_len = float(p["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        low_wl, high_wl = old_len / low, old_len / high
        smooth = (old_len / wavelen - low) / (high - low)
        mid = (1 - smooth) * inv / factor + smooth * inv
        out = torch.where(wavelen > low_wl, inv / factor, inv)
        is_mid = (wavelen <= low_wl) & (wavelen >= high_wl)
        return torch.where(is_mid, mid, out).float(), 1.0
    if kind == "yarn":
        return _yarn(p, head_dim, base, config)
    if kind == "longrope":
        return long_rope.inv_frequencies(p, config, head_dim, base,
                                         positions or config.max_position_embeddings)
    raise ValueError(f"rope_type={kind!r} is not supported (default, linear, llama3, yarn, "
                     "longrope)")


def _yarn(p: dict[str, Any], dim: int, base: float, config: Any) -> tuple[torch.Tensor, float]:
    factor = float(p["factor"])
    old_len = float(p.get("original_max_position_embeddings")
                    or config.max_position_embeddings / factor)
    beta_fast, beta_slow = float(p.get("beta_fast", 32)), float(p.get("beta_slow", 1))
    mscale = p.get("attention_factor") or (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)

    def corr_dim(rot: float) -> float:
        return dim * math.log(old_len / (rot * 2 * math.pi)) / (2 * math.log(base))

    lo, hi = corr_dim(beta_fast), corr_dim(beta_slow)
    if p.get("truncate", True):  # gpt-oss keeps the correction range unrounded
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - lo) / (hi - lo)).clamp(0, 1)
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    extrapolation = 1 - ramp
    inv = inv / factor * (1 - extrapolation) + inv * extrapolation
    return inv.float(), float(mscale)


class RotaryEmbedding(nn.Module):
    def __init__(self, config: Any, head_dim: int, max_positions: int) -> None:
        super().__init__()
        inv, scale = inv_frequencies(config, head_dim, max_positions)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv)  # [max_pos, D/2]
        cache = torch.cat([freqs.cos() * scale, freqs.sin() * scale], dim=-1)
        self.register_buffer("cos_sin_cache", cache, persistent=False)  # [max_pos, D]
        # Every layer of one forward rotates at the same positions: the torch path looks the
        # cos/sin rows up once per positions tensor, not once per layer.
        self._memo: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        b = current()
        self._forward = self._triton if b.triton else self._c if b.c_ops else self._torch

    def _cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        memo = self._memo
        if memo is not None and memo[0] is positions:
            return memo[1], memo[2]
        cos, sin = self.cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)  # [T, 1, D/2]
        self._memo = (positions, cos, sin)
        return cos, sin

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, H, D] and k [T, Hkv, D] (views of one qkv row or not) rotated by position [T].
        The C path rotates in place and returns its inputs."""
        return self._forward(positions, q, k)

    def _triton(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        from batchgen_data.kernels import apply_rotary
        return apply_rotary(q, k, positions, self.cos_sin_cache)

    def _c(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
        from batchgen_data.kernels.cpu import ops
        joint = _joint_view(q, k)
        for x, heads in ([(joint, q.shape[1] + k.shape[1])] if joint is not None
                         else [(q.flatten(1), q.shape[1]), (k.flatten(1), k.shape[1])]):
            ops.rotate_(x, heads, q.shape[2], positions, self.cos_sin_cache)
        return q, k

    def _torch(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self._cos_sin(positions)
        joint = _joint_view(q, k)
        if joint is None:
            return _rotate(q, cos, sin), _rotate(k, cos, sin)
        qk = _rotate(joint.view(q.shape[0], -1, q.shape[2]), cos, sin)
        return qk.split([q.shape[1], k.shape[1]], dim=1)


def _joint_view(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """[T, (H + Hkv) * D] view over q and k when k's heads follow q's in every row of one
    tensor (both split off a fused qkv output), else None."""
    d = q.shape[-1]
    if (q.dim() != 3 or k.dim() != 3 or q.stride()[1:] != (d, 1) or k.stride() != q.stride()
            or q.untyped_storage().data_ptr() != k.untyped_storage().data_ptr()
            or k.data_ptr() != q.data_ptr() + q.shape[1] * d * q.element_size()):
        return None
    return q.as_strided((q.shape[0], (q.shape[1] + k.shape[1]) * d), (q.stride(0), 1))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class MRotaryEmbedding(RotaryEmbedding):
    """Multimodal rotary embedding (Qwen2-VL's M-RoPE): each position is three numbers
    (temporal, height, width) and the head's frequency pairs are cut into `mrope_section`
    runs, run i rotated by component i % 3. Text tokens carry three equal numbers, for which
    this is the plain rotary embedding. Rotates on the torch path: the C and Triton kernels
    take one position per token."""

    def __init__(self, config: Any, head_dim: int, max_positions: int,
                 interleaved: bool = False) -> None:
        super().__init__(config, head_dim, max_positions)
        sections = [int(s) for s in rope_parameters(config).get("mrope_section") or ()]
        if len(sections) != 3 or sum(sections) != head_dim // 2:
            raise ValueError(f"mrope_section={sections} must be three runs summing to "
                             f"head_dim // 2 = {head_dim // 2}")
        # which component rotates each frequency pair: in runs (Qwen2-VL, Qwen2.5-VL), or
        # interleaved t, h, w, t, h, w... over the first 3 * section pairs (Qwen3-VL)
        if interleaved:
            comp = torch.zeros(head_dim // 2, dtype=torch.long)
            for axis in (1, 2):
                comp[axis:3 * sections[axis]:3] = axis
        else:
            comp = torch.cat([torch.full((n,), i, dtype=torch.long)
                              for i, n in enumerate(sections)])
        self.register_buffer("_component", torch.cat([comp, comp]), persistent=False)  # [D]
        self.register_buffer("_columns", torch.arange(head_dim), persistent=False)  # [D]

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, H, D] and k [T, Hkv, D] rotated by positions [3, T] (or [T] for text)."""
        if positions.dim() == 1:
            return self._torch(positions, q, k)
        memo = self._memo
        if memo is not None and memo[0] is positions:
            cos, sin = memo[1], memo[2]
        else:
            rows = self.cos_sin_cache[positions]  # [3, T, D]
            picked = rows[self._component, :, self._columns].t()  # [T, D]
            cos, sin = picked.unsqueeze(1).chunk(2, dim=-1)  # [T, 1, D/2]
            self._memo = (positions, cos, sin)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)
