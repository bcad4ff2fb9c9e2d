"""Triton GPU kernels for the engine, each behind a launcher that validates its arguments.

Importing this package never imports triton: the launchers are loaded on first attribute access
(PEP 562), so CPU-only installs can import it, call ``triton_available()`` and fall back to the
plain-torch versions in ``batchgen_data.kernels.reference``. Accessing a launcher without triton
installed raises ``ImportError``.

Launchers (all validate dtypes, shapes, strides and devices and raise ``ValueError``):
    paged_decode_attention, paged_prefill_attention   (attention.py)
    write_kv_cache                                     (kv_cache.py)
    rms_norm, fused_add_rms_norm                       (rmsnorm.py)
    apply_rotary                                       (rotary.py)
    silu_and_mul                                       (activation.py)
    moe_align_block_size                               (moe_align.py)
    fused_experts                                      (fused_moe.py)
    lora_shrink, lora_expand                           (lora.py)
    mxfp4_linear                                       (mxfp4.py)
"""

from __future__ import annotations

import importlib
from functools import lru_cache
from typing import Any

_LAUNCHERS = {
    "paged_decode_attention": "attention",
    "paged_prefill_attention": "attention",
    "write_kv_cache": "kv_cache",
    "rms_norm": "rmsnorm",
    "fused_add_rms_norm": "rmsnorm",
    "apply_rotary": "rotary",
    "silu_and_mul": "activation",
    "moe_align_block_size": "moe_align",
    "fused_experts": "fused_moe",
    "lora_shrink": "lora",
    "lora_expand": "lora",
    "quant_linear": "quant_matmul",
    "per_token_group_quant_fp8": "quant_matmul",
    "fp8_block_matmul": "quant_matmul",
    "fp8_block_matmul_quantized": "quant_matmul",
    "mxfp4_linear": "mxfp4",
}

__all__ = ["triton_available", *_LAUNCHERS]


@lru_cache(maxsize=1)
def triton_available() -> bool:
    """True when triton imports; never raises (a broken install counts as unavailable)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # a half-installed triton can fail with more than ImportError
        return False
    return True


def __getattr__(name: str) -> Any:
    module = _LAUNCHERS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
