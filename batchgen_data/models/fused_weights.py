"""Checkpoints that store q|k|v or gate|up already fused (Phi-3 / Phi-4's `qkv_proj` and
`gate_up_proj`), cut into the per-projection tensors the loader fills shard by shard.

Our fused layers are filled one checkpoint shard at a time (`loader._load_one`), because that is
where a tensor-parallel rank picks its heads of q, k and v apart (`tp_shards.rank_slice`). A
stored fused matrix is therefore cut back into its q, k, v (or gate, up) rows first, by the
whole model's sizes, and each piece goes the ordinary way: a rank's slice, a quantized stored
form (`QuantWeight.take_rows`), the completeness check by shard.
"""
from __future__ import annotations

import re
from typing import Any

from torch import nn

from batchgen_data.layers.quant import QuantWeight

_STORED = re.compile(r"^(.*)\.(qkv_proj|gate_up_proj)\.(weight|bias)$")
_PIECES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def split(model: nn.Module, name: str, key: str, tensor: Any) -> list[tuple[str, Any]] | None:
    """[(checkpoint key of a piece, its rows)] for a fused tensor `key` (our name `name`) whose
    layer the model builds fused; None for every other tensor."""
    m = _STORED.match(name)
    if m is None:
        return None
    try:
        layer = model.get_submodule(f"{m.group(1)}.{m.group(2)}")
    except AttributeError:
        return None
    if not hasattr(layer, "shard_sizes"):
        return None
    sizes = _checkpoint_sizes(model, m.group(2), _rows(tensor))
    if sum(sizes) != _rows(tensor):
        raise ValueError(f"checkpoint weight {key!r} has {_rows(tensor)} rows, expected "
                         f"{sum(sizes)} ({'+'.join(map(str, sizes))})")
    fused = f".{m.group(2)}."
    out, start = [], 0
    for piece, n in zip(_PIECES[m.group(2)], sizes):
        out.append((key.replace(fused, f".{piece}.", 1), _take(tensor, start, start + n)))
        start += n
    return out


def _checkpoint_sizes(model: nn.Module, kind: str, rows: int) -> list[int]:
    """The rows of each piece in the checkpoint (the whole model's, whatever this rank keeps)."""
    if kind == "gate_up_proj":
        return [rows // 2, rows - rows // 2]
    s = model.shape
    heads = getattr(s, "total_heads", s.num_heads)
    kv = getattr(s, "total_kv_heads", s.num_kv_heads)
    return [heads * s.head_dim, kv * s.head_dim, kv * s.head_dim]


def _rows(t: Any) -> int:
    return t.rows if isinstance(t, QuantWeight) else t.shape[0]


def _take(t: Any, start: int, stop: int) -> Any:
    return t.take_rows(start, stop) if isinstance(t, QuantWeight) else t[start:stop]
