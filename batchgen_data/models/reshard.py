"""Re-shard a loaded model's weights in memory, both ways (a re-partition, engine/group/group.py).

`narrow_into(shard, full)`: a rank's model (built under `parallel.sharding`, its parameters
still plain and unfilled) takes its slice of every weight of the full model held in this
process, the same slice the loader would have cut from the checkpoint (`tp_shards.rank_slice`,
q|k|v and gate|up shard by shard); each full weight is dropped once copied, so what the
process holds goes from the full weights to its shard (at most one shard's worth above the
full weights on the way). `gather_into(full, shard, all_gather)`: the reverse, every rank
taking every rank's slice of each weight (one all-gather per parameter) and putting it back
where `rank_slice` took it from. Which entries rank r holds is found by applying `rank_slice`,
as rank r, to tensors of indices, so the reverse can never disagree with the forward cut: a
head replicated on several ranks is written once per copy (the same values), the vocabulary's
padding rows and the zero biases of ranks > 0 are skipped.

Weights packed for the CPU kernels (`layers/linear.py` "panels", "onednn") are read back in
their plain [out, in] form first, by their layer (`plain_weight()`); both models are
`finalize`d by the caller. A MoE block's stacked experts (`w13` [E, 2I, H], `w2` [E, H, I])
take the loader's stacked cut (`tp_shards.stacked_experts_slice`): a slice of every expert's
width under tensor parallelism, whole experts under expert parallelism; the router and a
shared expert follow the dense rules. Each attention layer's FP8 KV scales (`kv_scales`, one K
and one V scale a layer, the checkpoint's, the same on every rank) go along, so an FP8 cache
means the same values after the switch. Quantized weights are refused before a re-partition
starts.
"""
from __future__ import annotations

import copy
from collections.abc import Callable
from types import SimpleNamespace

import torch
from torch import nn

from batchgen_data.layers import parallel
from batchgen_data.models import tp_shards

_FUSED = ("qkv_proj", "gate_up_proj")
_EXPERTS = ("w13", "w2")


def plain_weight(module: nn.Module, leaf: str) -> torch.Tensor:
    """`module.<leaf>` in its plain form ([out, in] for a weight), whatever its layout: a
    layer that packs its weight (`Linear`, `VocabEmbedding`) reads it back itself."""
    if leaf == "weight" and hasattr(module, "plain_weight"):
        return module.plain_weight()
    return getattr(module, leaf).detach()


def _drop(module: nn.Module, leaf: str) -> None:
    if leaf == "weight" and hasattr(module, "release_weight"):
        module.release_weight()
    else:
        setattr(module, leaf, None)


def _pieces(full_module: nn.Module, name: str, tensor: torch.Tensor
            ) -> list[tuple[int, torch.Tensor]]:
    """(checkpoint shard index, full tensor piece) of a parameter: q, k, v (or gate, up) of a
    fused layer apart, anything else whole."""
    layer = name.rpartition(".")[0].rpartition(".")[2]
    if layer not in _FUSED:
        return [(0, tensor)]
    return list(enumerate(tensor.split(full_module.shard_sizes, dim=0)))


def _experts(module: nn.Module, leaf: str) -> bool:
    """`module.<leaf>` is a MoE block's stack of experts."""
    return leaf in _EXPERTS and hasattr(module, "num_experts") and hasattr(module, "w13")


def _copy_kv_scales(dst: nn.Module, src: nn.Module) -> None:
    for name, module in dst.named_modules():
        if hasattr(module, "kv_scales"):
            module.kv_scales = src.get_submodule(name).kv_scales


def narrow_into(shard: nn.Module, full: nn.Module) -> None:
    """Fill every parameter of `shard` with its slice of `full`'s (see the module docstring)."""
    _copy_kv_scales(shard, full)
    with torch.no_grad():
        for name, param in list(shard.named_parameters()):
            owner, _, leaf = name.rpartition(".")
            src_module = full.get_submodule(owner)
            src = plain_weight(src_module, leaf)
            if _experts(src_module, leaf):
                parts = [tp_shards.stacked_experts_slice(shard.get_submodule(owner), leaf, src)]
            else:
                parts = [tp_shards.rank_slice(shard, name, i, piece)
                         for i, piece in _pieces(src_module, name, src)]
            local = parts[0] if len(parts) == 1 else torch.cat(parts)
            assert local.shape == param.shape, (name, local.shape, param.shape)
            param.copy_(local)
            del src, parts, local
            _drop(src_module, leaf)


def _as_rank(shard: nn.Module, rank: int) -> SimpleNamespace:
    """What `rank_slice` reads of a model, as rank `rank` of the same group would have it."""
    shape = copy.copy(shard.shape)
    shape.tp = parallel.TensorParallel(rank, shape.tp.size)
    return SimpleNamespace(shape=shape)


def _where(view: object, name: str, i: int, shape: torch.Size
           ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """1-based indices into a full piece of `shape` of the rows (and columns) rank `view`
    keeps, 0 where its slice holds padding or zeros instead."""
    n0 = shape[0]
    rows = torch.arange(1, n0 + 1)
    if len(shape) == 1:
        return tp_shards.rank_slice(view, name, i, rows), None  # type: ignore[arg-type]
    assert len(shape) == 2, (name, shape)
    r = tp_shards.rank_slice(view, name, i, rows.view(n0, 1).expand(shape))  # type: ignore
    c = tp_shards.rank_slice(view, name, i,  # type: ignore[arg-type]
                             torch.arange(1, shape[1] + 1).view(1, -1).expand(shape))
    return r[:, 0], c[0] if c.numel() else c.new_zeros(0)


def _moe_as_rank(moe: nn.Module, rank: int) -> SimpleNamespace:
    """What `stacked_experts_slice` reads of a MoE block, as rank `rank` would have it."""
    tp = parallel.TensorParallel(rank, moe.tp.size)
    return SimpleNamespace(tp=tp, width_split=moe.width_split, num_experts=moe.num_experts,
                           first=rank * moe.num_experts)


def _expert_where(view: object, leaf: str, shape: torch.Size
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """0-based experts and width entries (w13: rows, w2: columns) of a full expert stack of
    `shape` that rank `view` keeps, found by cutting index probes (the hidden size left 1)."""
    e, a, b = shape
    dim = 1 if leaf == "w13" else 2
    probe = [e, a, 1] if leaf == "w13" else [e, 1, b]
    experts = torch.arange(1, e + 1).view(e, 1, 1).expand(probe)
    width = torch.arange(1, shape[dim] + 1).view([1, 1, 1][:dim] + [-1] + [1] * (2 - dim))
    cut = tp_shards.stacked_experts_slice
    e_idx = cut(view, leaf, experts)[:, 0, 0]  # type: ignore[arg-type]
    w_idx = cut(view, leaf, width.expand(probe))  # type: ignore[arg-type]
    w_idx = w_idx[0, :, 0] if dim == 1 else w_idx[0, 0, :]
    return e_idx - 1, w_idx - 1


def _put_experts(full: torch.Tensor, leaf: str, where: tuple[torch.Tensor, torch.Tensor],
                 got: torch.Tensor) -> None:
    experts, width = where
    if leaf == "w13":  # [E, 2I, H]: experts x rows, every column
        full[experts.view(-1, 1), width.view(1, -1)] = got
    else:  # [E, H, I]: experts x every row x columns
        rows = torch.arange(full.shape[1]).view(1, -1, 1)
        full[experts.view(-1, 1, 1), rows, width.view(1, 1, -1)] = got


def gather_into(full: nn.Module, shard: nn.Module,
                all_gather: Callable[[torch.Tensor], list[torch.Tensor]]) -> None:
    """Fill every parameter of `full` from every rank's `shard` (`all_gather(local)`: each
    rank's `local`, in rank order, on every rank)."""
    size = shard.shape.tp.size
    views = [_as_rank(shard, r) for r in range(size)]
    _copy_kv_scales(full, shard)
    with torch.no_grad():
        for name, param in list(full.named_parameters()):
            owner, _, leaf = name.rpartition(".")
            here = shard.get_submodule(owner)
            every = all_gather(plain_weight(here, leaf).contiguous())
            _drop(here, leaf)
            if _experts(here, leaf):
                for r in range(size):
                    _put_experts(param.data, leaf,
                                 _expert_where(_moe_as_rank(here, r), leaf, param.shape),
                                 every[r])
                del every
                continue
            pieces = _pieces(full.get_submodule(owner), name, param.data)
            for r in range(size):  # each rank's slice: its pieces one after the other
                start = 0
                for i, piece in pieces:
                    rows, cols = _where(views[r], name, i, piece.shape)
                    n = rows.numel()
                    got = every[r][start:start + n]
                    start += n
                    keep = rows > 0
                    if cols is None:
                        piece[rows[keep] - 1] = got[keep]
                    else:
                        ck = cols > 0
                        piece[(rows[keep] - 1).unsqueeze(1), cols[ck] - 1] = got[keep][:, ck]
            del every
