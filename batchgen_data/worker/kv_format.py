"""What an engine's KV bytes mean, and KV copies moved between engines whose caches differ.

A KV copy (`held_kv.KVCopy`: per layer k, v [tokens, Hkv, D]) holds exactly the cache's
elements: the model's dtype, or e4m3 codes of an FP8 cache (`kv_cache_dtype="fp8"`,
`layers/kv_quant.py`), which mean something only with their layer's scales. So an export with
KV names its format (`KVFormat.to_state`: the dtype and, for FP8, every layer's k/v scales), and
an import adopts the copy into its own cache's format (`adopt`):

* the same format (FP8 with the same scales, or the same float dtype): the bytes as they are,
  so the sequence continues exactly as it would have where it was;
* FP8 into a float cache: dequantized (code * scale) to the cache's dtype;
* a float copy into an FP8 cache, or FP8 with other scales: (dequantized, then) quantized with
  this engine's scales, the rounding a write here would do;
* FP8 codes without their scales (a state from before formats were written): refused.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from batchgen_data.core.kv.held_kv import KVCopy
from batchgen_data.layers import kv_quant
from batchgen_data.layers.attention import Attention

_DTYPES = {str(d).removeprefix("torch."): d for d in
           (torch.float32, torch.float16, torch.bfloat16, kv_quant.FP8)}


@dataclass(frozen=True)
class KVFormat:
    dtype: torch.dtype  # the cache's element type
    scales: tuple[kv_quant.KVScales, ...] = ()  # per layer, FP8 only

    @property
    def fp8(self) -> bool:
        return kv_quant.is_fp8(self.dtype)

    def to_state(self) -> dict[str, Any]:
        """Plain data for an export (dtype name, per-layer [k_scale, v_scale] when FP8)."""
        out: dict[str, Any] = {"dtype": str(self.dtype).removeprefix("torch.")}
        if self.fp8:
            out["scales"] = [[s.k, s.v] for s in self.scales]
        return out

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> "KVFormat":
        name = state.get("dtype")
        if name not in _DTYPES:
            raise ValueError(f"exported KV has dtype {name!r}; known: {sorted(_DTYPES)}")
        dtype = _DTYPES[name]
        scales = tuple(kv_quant.KVScales(k, v) for k, v in state.get("scales") or ())
        if kv_quant.is_fp8(dtype) and not scales:
            raise ValueError("exported FP8 KV without its scales cannot be read")
        return cls(dtype, scales)


def of(runner: Any) -> KVFormat | None:
    """The format of `runner`'s cache (None for a runner without one: an injected runner)."""
    kv, model = getattr(runner, "kv", None), getattr(runner, "model", None)
    if not isinstance(kv, torch.Tensor) or model is None:
        return None
    scales = tuple(m.kv_scales for m in model.modules() if isinstance(m, Attention))
    return KVFormat(kv.dtype, scales if kv_quant.is_fp8(kv.dtype) else ())


def state_of(runner: Any) -> dict[str, Any] | None:
    fmt = of(runner)
    return None if fmt is None else fmt.to_state()


def adopt(kv: KVCopy, state: dict[str, Any] | None, runner: Any) -> KVCopy:
    """An exported copy `kv` (its format's `state`, None for a state without one) in the
    format of `runner`'s cache (see the module doc)."""
    dst = of(runner)
    fp8_in = kv_quant.is_fp8(kv[0][0]) if kv else False
    if state is None:
        if fp8_in:
            raise ValueError("exported KV holds FP8 codes but no kv_format (their scales): "
                             "export it again from an engine that writes one")
        src = KVFormat(kv[0][0].dtype if kv else torch.float32)
    else:
        src = KVFormat.from_state(state)
    if dst is None or not (src.fp8 or dst.fp8):
        return kv  # float to float: the cache write converts the dtype
    if src.fp8 and dst.fp8 and src.scales == dst.scales:
        return kv
    for side, fmt in (("exported KV's format", src), ("this engine's cache", dst)):
        if fmt.fp8 and len(fmt.scales) != len(kv):
            raise ValueError(f"exported KV has {len(kv)} layers; {side} has FP8 scales for "
                             f"{len(fmt.scales)}")
    out: KVCopy = []
    for i, (k, v) in enumerate(kv):
        if src.fp8:  # the values the codes stand for
            s = src.scales[i]
            k, v = kv_quant.dequantize(k, s.k, torch.float32), kv_quant.dequantize(
                v, s.v, torch.float32)
        if dst.fp8:
            s = dst.scales[i]
            k, v = kv_quant.quantize(k, s.inv_k), kv_quant.quantize(v, s.inv_v)
        else:
            k, v = k.to(dst.dtype), v.to(dst.dtype)
        out.append((k, v))
    return out
