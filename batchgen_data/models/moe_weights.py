"""Checkpoint names of MoE expert weights -> the stacked `FusedMoE.w13` / `FusedMoE.w2`.

What transformers 5.x writes with `save_pretrained` (checked by saving tiny random models): one
tensor per expert and projection, `mlp.experts.{e}.{gate_proj,up_proj,down_proj}.weight` for
Qwen2/Qwen3-MoE and `block_sparse_moe.experts.{e}.{w1,w3,w2}.weight` for Mixtral. Its in-memory
modules, and checkpoints written from them by other tools, hold the stacked form instead:
`mlp.experts.gate_up_proj` [E, 2I, H] and `mlp.experts.down_proj` [E, H, I]; both are read.

Each loaded piece is reported as a mark ("<param>#<expert>.<shard>"), so the loader can name any
expert the checkpoint lacks.
"""
from __future__ import annotations

import re

import torch
from torch import nn

from batchgen_data.layers.moe import FusedMoE
from batchgen_data.layers.quant import QuantWeight
from batchgen_data.models import tp_shards

_PER_EXPERT = re.compile(r"^(.*\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)"
                         r"\.weight$")
_STACKED = re.compile(r"^(.*\.mlp)\.experts\.(gate_up_proj|down_proj)$")
# projection -> (our parameter, shard: 0 gate rows, 1 up rows of w13; 0 for w2)
_PROJ = {"gate_proj": ("w13", 0), "w1": ("w13", 0), "up_proj": ("w13", 1), "w3": ("w13", 1),
         "down_proj": ("w2", 0), "w2": ("w2", 0)}


def rename(name: str) -> str:
    """Mixtral's block name -> the `mlp` our decoder layers use."""
    return name.replace(".block_sparse_moe.", ".mlp.", 1)


def expected_marks(model: nn.Module, param_name: str) -> set[str] | None:
    """The marks a complete checkpoint gives a `FusedMoE` parameter (None: not an expert one)."""
    owner, _, leaf = param_name.rpartition(".")
    if leaf not in ("w13", "w2") or not isinstance(model.get_submodule(owner), FusedMoE):
        return None
    shards = (0, 1) if leaf == "w13" else (0,)
    num_experts = model.get_submodule(owner).num_experts
    return {f"{param_name}#{e}.{s}" for e in range(num_experts) for s in shards}


def expert_block(name: str) -> str | None:
    """The MoE block (`layers.3.mlp`) of a per-expert checkpoint name, else None."""
    m = _PER_EXPERT.match(name)
    return m.group(1) if m else None


def load_expert_weight(model: nn.Module, params: dict[str, nn.Parameter], name: str,
                       tensor: torch.Tensor | QuantWeight) -> set[str] | None:
    """Copy an expert tensor into its stacked parameter (a quantized one into the block's
    stored form, `FusedMoE.load_quant_expert`); None when `name` is not one."""
    m = _PER_EXPERT.match(name)
    if m:
        block, e, proj = m.group(1), int(m.group(2)), m.group(3)
        leaf, shard = _PROJ[proj]
        param = _param(params, f"{block}.{leaf}", name)
        rows = param.shape[1] // 2 if leaf == "w13" else param.shape[1]
        moe = model.get_submodule(block)
        local = tp_shards.local_expert(moe, e)  # (expert parallel: this rank's index)
        if local is None:
            return set()  # another rank's expert
        e = local
        if isinstance(tensor, QuantWeight) and moe.scheme is not None:
            tensor = tp_shards.expert_slice(moe, leaf, tensor)  # this rank's part (TP)
            moe.load_quant_expert(leaf, e, shard * rows, tensor, name)
        elif moe.scheme is not None:
            raise ValueError(f"checkpoint weight {name!r} is not quantized but its MoE block "
                             f"{block!r} is")
        else:
            if isinstance(tensor, QuantWeight):
                tensor = tensor.dequantize()
            tensor = tp_shards.expert_slice(moe, leaf, tensor)  # this rank's part (TP)
            _copy(param.data[e, shard * rows:(shard + 1) * rows], tensor, name)
        return {f"{block}.{leaf}#{e}.{shard}"}
    m = _STACKED.match(name)
    if m:
        if isinstance(tensor, QuantWeight):
            raise ValueError(f"checkpoint weight {name!r}: quantized experts are read per "
                             "expert (mlp.experts.<e>.<proj>), not stacked")
        leaf = "w13" if m.group(2) == "gate_up_proj" else "w2"
        target = f"{m.group(1)}.{leaf}"
        param = _param(params, target, name)
        tensor = tp_shards.stacked_experts_slice(model.get_submodule(m.group(1)), leaf,
                                                 tensor)  # this rank's part (TP, EP)
        if tensor.shape != param.shape and tensor.transpose(1, 2).shape == param.shape:
            tensor = tensor.transpose(1, 2)  # some writers keep [E, in, out]
        _copy(param.data, tensor, name)
        shards = (0, 1) if leaf == "w13" else (0,)
        return {f"{target}#{e}.{s}" for e in range(param.shape[0]) for s in shards}
    return None


def _param(params: dict[str, nn.Parameter], target: str, name: str) -> nn.Parameter:
    if target not in params:
        raise ValueError(f"unexpected weight {name!r} in checkpoint (no MoE layer there)")
    return params[target]


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"checkpoint weight {name!r} has shape {tuple(src.shape)}, "
                         f"expected {tuple(dst.shape)}")
    dst.copy_(src)
