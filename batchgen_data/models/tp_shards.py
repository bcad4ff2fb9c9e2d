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

import torch
from torch import nn

from batchgen_data.layers import parallel


def rank_slice(model: nn.Module, param: str, shard: int, tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of checkpoint `tensor` for our parameter `param` (e.g.
    "layers.0.self_attn.qkv_proj.weight"), shard `shard` of a fused layer (q, k, v / gate, up)."""
    shape = getattr(model, "shape", None)
    tp = getattr(shape, "tp", None)
    if tp is None or tp.size == 1:
        return tensor
    assert isinstance(tensor, torch.Tensor), "quantized checkpoints are refused with TP > 1"
    owner, _, leaf = param.rpartition(".")
    layer = owner.rpartition(".")[2]
    rank, size = tp.rank, tp.size
    if layer == "qkv_proj":
        d = shape.head_dim
        heads = (range(rank * shape.num_heads, (rank + 1) * shape.num_heads) if shard == 0
                 else parallel.kv_heads_of_rank(shape.total_kv_heads, size, rank))
        return tensor[heads.start * d:heads.stop * d]
    if layer == "gate_up_proj":  # (a dense MLP's or a shared expert's width)
        width = tensor.shape[0] // size
        return tensor[rank * width:(rank + 1) * width]
    if layer in ("o_proj", "down_proj"):
        if leaf == "bias":
            return tensor if rank == 0 else torch.zeros_like(tensor)
        width = tensor.shape[1] // size
        return tensor[:, rank * width:(rank + 1) * width]
    if param in ("embed_tokens.weight", "lm_head.weight"):
        per_rank = parallel.padded_vocab(shape.vocab, size) // size
        part = tensor[rank * per_rank:(rank + 1) * per_rank]
        if part.shape[0] < per_rank:  # the padding rows past the vocabulary
            part = torch.cat([part, part.new_zeros(per_rank - part.shape[0], *part.shape[1:])])
        return part
    return tensor


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
        width = tensor.shape[0] // tp.size
        return tensor[tp.rank * width:(tp.rank + 1) * width]
    width = tensor.shape[1] // tp.size
    return tensor[:, tp.rank * width:(tp.rank + 1) * width]


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
