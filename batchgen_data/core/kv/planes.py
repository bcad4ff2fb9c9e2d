"""How many planes a model's paged KV cache has, and each layer's (K, V) views of it.

A decoder's cache is [layers, 2, blocks, block_size, kv_heads, head_dim]: a K and a V plane. A
model whose attention reads its values from the key rows (MLA: `layers/mla.py` caches the latent
once, and the same rows serve as keys and values) declares `kv_planes = 1` on its shape and gets
one plane, which is both its K and its V: half the memory, so twice the tokens in the same bytes.
"""
from __future__ import annotations

import torch


def kv_planes(shape: object) -> int:
    """Planes of a model's KV cache: 2 (K and V), or 1 where its attention reads its values
    from the key rows (MLA caches the latent once: `layers/mla.py`)."""
    return int(getattr(shape, "kv_planes", 2))


def layer_caches(kv: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's (K, V) views of a [layers, planes, ...] cache; one plane is both."""
    last = kv.shape[1] - 1
    return [(kv[i, 0], kv[i, last]) for i in range(kv.shape[0])]


def check_one_plane_scales(model: torch.nn.Module, planes: int) -> None:
    """A one-plane FP8 cache holds one code per number for K and V alike: their scales must
    be one (ValueError naming the layer otherwise)."""
    if planes != 1:
        return
    for name, mod in model.named_modules():
        kvs = getattr(mod, "kv_scales", None)
        if kvs is not None and kvs.k != kvs.v:
            raise ValueError(f"{name}: k_scale={kvs.k} and v_scale={kvs.v} differ, but this "
                             "model's KV cache keeps its values in the key rows (one plane)")
