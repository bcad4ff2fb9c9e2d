"""The FP8 KV cache (`kv_cache_dtype="fp8"`, vLLM's name; docs/quantization.md).

The paged cache stores K and V as float8_e4m3fn with one scale per layer for K and one for V
(per tensor, as vLLM's `k_scale` / `v_scale`): a stored code is ``x / scale`` rounded to the
nearest e4m3 value (ties to even), clamped to +-448 first, and reads give ``code * scale``.
The scales come from the checkpoint when it has them (`self_attn.k_scale` / `v_scale`, the
older `kv_scale`, or `k_proj.output_scale` / `v_proj.output_scale`), else they are 1.0 (vLLM's
default without `calculate_kv_scales`); they are fixed for the engine's life, so every copy of
a block (prefix cache, held KV, the host tier, an export) means the same values, and two engines
of one checkpoint share them.

Every attention path reads K/V dequantized from the cache, the tokens of the step included (the
torch path rounds a fresh chunk's K/V through e4m3 before attending over it), so a token's
result does not depend on how its prompt was cut into chunks or found in the prefix cache.

Each implementation rounds the same way: torch's cast here, `kernels/kv_cache.py`'s integer
rounding in the Triton write kernel (bit for bit the same codes), and the reads widen codes
exactly (Triton and C through the fp16 bit layout, torch by its cast).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
# kv_cache_dtype values: the model's dtype, or e4m3 (vLLM's "fp8" is e4m3 too)
NAMES = {"auto": None, "fp8": FP8, "fp8_e4m3": FP8}


def cache_dtype(kv_cache_dtype: str | None, model_dtype: torch.dtype) -> torch.dtype:
    """The paged cache's dtype for `kv_cache_dtype` (config-checked) and the model's dtype."""
    return NAMES.get(kv_cache_dtype or "auto") or model_dtype


def is_fp8(t: torch.Tensor | torch.dtype) -> bool:
    return (t if isinstance(t, torch.dtype) else t.dtype) == FP8


def as_fp32(x: float) -> float:
    """`x` rounded to the nearest float32 (every kernel takes the scales in fp32)."""
    return float(torch.tensor(float(x), dtype=torch.float32))


@dataclass(frozen=True, slots=True)
class KVScales:
    """One layer's K and V scales (dequantized = code * scale)."""

    k: float = 1.0
    v: float = 1.0

    def __post_init__(self) -> None:
        for name, s in (("k_scale", self.k), ("v_scale", self.v)):
            if not (isinstance(s, (int, float)) and math.isfinite(s) and s > 0):
                raise ValueError(f"{name}={s!r}: an FP8 KV scale must be a finite number > 0")
        object.__setattr__(self, "k", as_fp32(self.k))
        object.__setattr__(self, "v", as_fp32(self.v))

    @property
    def inv_k(self) -> float:
        return as_fp32(1.0 / self.k)

    @property
    def inv_v(self) -> float:
        return as_fp32(1.0 / self.v)


def quantize(x: torch.Tensor, inv_scale: float) -> torch.Tensor:
    """x (any float dtype) -> e4m3 codes of ``x * inv_scale`` (fp32 product, clamped to +-448,
    rounded to nearest even). The multiply by the fp32 reciprocal is what every kernel does."""
    y = x.float()
    if inv_scale != 1.0:
        y = y * inv_scale
    return y.clamp_(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize(codes: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """e4m3 codes -> ``code * scale`` in `dtype` (the product in fp32, then rounded once)."""
    if scale == 1.0:
        return codes.to(dtype)
    return (codes.float() * scale).to(dtype)


def round_trip(x: torch.Tensor, s: float) -> torch.Tensor:
    """What a read gives back for `x` written with scale `s`, in x's dtype."""
    return dequantize(quantize(x, as_fp32(1.0 / s)), s, x.dtype)
