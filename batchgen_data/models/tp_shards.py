"""Which slice of a checkpoint tensor a tensor-parallel rank keeps (`layers/parallel.py`).

The loader hands every dense checkpoint tensor through `rank_slice` before copying it into the
model: a model built for one rank has the narrower shapes, and this picks the rows (column-
parallel q|k|v, gate|up, the vocabulary of the embedding and head) or columns (row-parallel o,
down) that fill them. KV heads follow `parallel.kv_heads_of_rank` (split, or one replicated
head when there are fewer KV heads than ranks); the vocabulary's padding rows are zeros; a
row-parallel bias is added once, by rank 0 (the others keep zeros, so the all-reduce sums it
once). Norms and everything else are replicated.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from batchgen_data.layers import parallel
from batchgen_data.layers.quant import QuantWeight, pad_rows


def rank_slice(model: nn.Module, param: str, shard: int, tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of checkpoint `tensor` for our parameter `param` (e.g.
    "layers.0.self_attn.qkv_proj.weight"), shard `shard` of a fused layer (q, k, v / gate, up)."""
    shape = getattr(model, "shape", None)
    tp = getattr(shape, "tp", None)
    if tp is None or tp.size == 1:
        return tensor
    owner, _, leaf = param.rpartition(".")
    layer = owner.rpartition(".")[2]
    rank, size = tp.rank, tp.size
    if layer == "qkv_proj":
        d = shape.head_dim
        heads = (range(rank * shape.num_heads, (rank + 1) * shape.num_heads) if shard == 0
                 else parallel.kv_heads_of_rank(shape.total_kv_heads, size, rank))
        return _rows(tensor, heads.start * d, heads.stop * d)
    if layer == "gate_up_proj":  # (a dense MLP's or a shared expert's width)
        width = _n_rows(tensor) // size
        return _rows(tensor, rank * width, (rank + 1) * width)
    if layer in ("o_proj", "down_proj"):
        if leaf == "bias":
            return tensor if rank == 0 else torch.zeros_like(tensor)
        width = _n_cols(tensor) // size
        return _cols(tensor, rank * width, (rank + 1) * width, param)
    if param in ("embed_tokens.weight", "lm_head.weight"):
        per_rank = parallel.padded_vocab(shape.vocab, size) // size
        return _rows(tensor, rank * per_rank, (rank + 1) * per_rank, pad_to=per_rank)
    return tensor


def _n_rows(t: Any) -> int:
    return t.rows if isinstance(t, QuantWeight) else t.shape[0]


def _n_cols(t: Any) -> int:
    return t.k if isinstance(t, QuantWeight) else t.shape[1]


def _rows(t: Any, start: int, stop: int, pad_to: int | None = None) -> Any:
    """Rows [start, stop) of a checkpoint matrix, dense or quantized (its stored form), zero
    rows appended up to `pad_to` (the vocabulary's padding)."""
    if isinstance(t, QuantWeight):
        return t.take_rows(start, stop, pad_to)
    return pad_rows(t[start:stop], pad_to)


def _cols(t: Any, start: int, stop: int, name: str) -> Any:
    """Input columns [start, stop): a quantized matrix's whole groups (`take_cols`)."""
    return t.take_cols(start, stop, name) if isinstance(t, QuantWeight) else t[:, start:stop]


def local_expert(moe: nn.Module, expert: int) -> int | None:
    """Where checkpoint expert `expert` sits in this rank's MoE block: its own index, or under
    expert parallelism its index among the rank's experts (None: another rank's)."""
    first = getattr(moe, "first", 0)
    return expert - first if 0 <= expert - first < moe.num_experts else None


def expert_slice(moe: nn.Module, leaf: str, tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of one expert's matrix: under tensor parallelism gate or up [I, H] ->
    rows, down [H, I] -> columns (`layers/parallel.TensorParallelMoE`); whole otherwise."""
    tp = getattr(moe, "tp", None)
    if tp is None or not getattr(moe, "width_split", False):
        return tensor
    if leaf == "w13":
        width = _n_rows(tensor) // tp.size
        return _rows(tensor, tp.rank * width, (tp.rank + 1) * width)
    width = _n_cols(tensor) // tp.size
    return _cols(tensor, tp.rank * width, (tp.rank + 1) * width, f"expert {leaf}")


def stacked_experts_slice(moe: nn.Module, leaf: str, tensor: torch.Tensor) -> torch.Tensor:
    """The same for every expert at once: w13 [E, 2I, H] (gate rows then up rows), w2
    [E, H, I]; under expert parallelism the rank's experts."""
    tp = getattr(moe, "tp", None)
    if tp is None:
        return tensor
    if not getattr(moe, "width_split", False):
        first = getattr(moe, "first", 0)
        return tensor[first:first + moe.num_experts]
    if leaf == "w13":
        gate, up = tensor.chunk(2, dim=1)
        return torch.cat([expert_slice(moe, leaf, g.transpose(0, 1)).transpose(0, 1)
                          for g in (gate, up)], dim=1)
    return torch.stack([expert_slice(moe, leaf, e) for e in tensor])
