"""DeepSeek-V3's rope settings: its yarn variant, and the softmax scale that goes with it.

The released DeepSeek-V3 config extends its 4k pre-training context with yarn (factor 40,
`mscale` = `mscale_all_dim` = 1). DeepSeek's yarn differs from the plain one
(`layers/rotary.py`) in two numbers, both as HF's `_compute_yarn_parameters` and
`DeepseekV3Attention` compute them:
  * the cos/sin scale (yarn's "attention factor") is mscale(factor, mscale) /
    mscale(factor, mscale_all_dim) when both are given, with mscale(s, m) = 0.1 m ln(s) + 1
    (so 1.0 for the released config, where plain yarn would use 0.1 ln(40) + 1 = 1.37);
  * the softmax scale qk_head_dim ** -0.5 is multiplied by mscale(factor, mscale_all_dim)^2.
The inverse frequencies themselves are plain yarn's. Other rope types have no DeepSeek
checkpoint to check against and are refused.
"""
from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

from batchgen_data.layers.rotary import rope_parameters


def _mscale(factor: float, m: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


def deepseek_rope(config: Any) -> tuple[Any, float]:
    """(a config view for `RotaryEmbedding`, the softmax scale) of a DeepSeek-V3 config."""
    p = rope_parameters(config)
    kind = p["rope_type"]
    qk_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
    scale = qk_head_dim ** -0.5
    if kind == "default":
        return config, scale
    if kind != "yarn":
        raise ValueError(f"DeepseekV3ForCausalLM: rope_type={kind!r} is not supported "
                         "(default or yarn)")
    if p.get("truncate", True) is False:
        raise ValueError("DeepseekV3ForCausalLM: yarn with truncate=False is not supported")
    original = p.get("original_max_position_embeddings")
    if not original:
        raise ValueError("DeepseekV3ForCausalLM: yarn needs original_max_position_embeddings "
                         "in rope_parameters")
    factor = float(p.get("factor") or config.max_position_embeddings / original)
    mscale, mscale_all_dim = p.get("mscale"), p.get("mscale_all_dim")
    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        attention_factor = (_mscale(factor, mscale) / _mscale(factor, mscale_all_dim)
                            if mscale and mscale_all_dim else _mscale(factor))
    if mscale_all_dim:
        scale *= _mscale(factor, mscale_all_dim) ** 2
    # `RotaryEmbedding` reads the rope numbers through `rope_parameters(config)`: hand it
    # plain yarn's with DeepSeek's attention factor filled in
    view = SimpleNamespace(
        rope_parameters={**p, "factor": factor, "attention_factor": attention_factor,
                         "beta_fast": p.get("beta_fast") or 32,
                         "beta_slow": p.get("beta_slow") or 1},
        max_position_embeddings=config.max_position_embeddings)
    return view, scale
