"""LongRoPE (Phi-3 / Phi-4's `rope_type="longrope"`): per-frequency rescale factors, one set for
contexts up to the pretraining length and one for longer contexts.

The model was tuned with `short_factor` for sequences of at most
`original_max_position_embeddings` tokens and with `long_factor` beyond. HF switches the set per
forward by the longest position it sees, so a sequence that grows past the original length
keeps keys rotated with the short set in its cache while its new tokens use the long one. A
paged, prefix-cached engine cannot do that consistently (the same cached block would need two
rotations), so, as vLLM does, the set is chosen once per engine by the longest sequence it
serves: `max_model_len` above the original length takes the long factors for every position,
otherwise the short ones; without `max_model_len` a LongRoPE model serves its original length.
Both match HF token for token where HF's own choice is fixed: every sequence shorter than the
original length (short), every prompt longer than it (long).

The engine's `max_model_len` reaches the model's build through `context_length` (entered by
`engine/setup.py` around the build), the way the layer backend does (`layers/backend.py`).
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

import torch

_CONTEXT: ContextVar[int | None] = ContextVar("long_rope_context", default=None)


@contextlib.contextmanager
def context_length(max_model_len: int | None) -> Iterator[None]:
    """Models built within the block serve sequences of at most `max_model_len` tokens (None:
    the model's default)."""
    token = _CONTEXT.set(max_model_len)
    try:
        yield
    finally:
        _CONTEXT.reset(token)


def original_length(params: dict[str, Any], config: Any) -> int:
    """The pretraining context of a LongRoPE config (in its rope parameters or at top level)."""
    value = params.get("original_max_position_embeddings") or getattr(
        config, "original_max_position_embeddings", None)
    if not value:
        raise ValueError("rope_type='longrope' needs original_max_position_embeddings")
    return int(value)


def served_positions(params: dict[str, Any], config: Any) -> int:
    """The longest sequence a model built now serves (its position table's length): for
    LongRoPE the engine's `max_model_len` when given, else the original length; for every other
    rope `max_position_embeddings`."""
    if params.get("rope_type") != "longrope":
        return config.max_position_embeddings
    limit = int(config.max_position_embeddings)
    asked = _CONTEXT.get()
    if asked is None:
        return min(original_length(params, config), limit)
    if asked > limit:
        raise ValueError(f"max_model_len={asked} exceeds the model's "
                         f"max_position_embeddings={limit}")
    return asked


def inv_frequencies(params: dict[str, Any], config: Any, dim: int, base: float,
                    positions: int) -> tuple[torch.Tensor, float]:
    """[dim // 2] inverse frequencies and the cos/sin scale for a table of `positions` rows:
    the long factors when it reaches past the original length, else the short ones."""
    original = original_length(params, config)
    factor = params.get("factor") or config.max_position_embeddings / original
    scale = params.get("attention_factor")
    if scale is None:  # the LongRoPE paper's default, from the extension ratio
        scale = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    key = "long_factor" if positions > original else "short_factor"
    ext = [float(f) for f in params.get(key) or ()]
    if len(ext) != dim // 2:
        raise ValueError(f"rope {key} has {len(ext)} values; the rotary dimension {dim} needs "
                         f"{dim // 2}")
    # float32 throughout, as HF computes it, so both tables agree to the last bit
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv = 1.0 / (torch.tensor(ext, dtype=torch.float32) * base ** shape)
    return inv, float(scale)
