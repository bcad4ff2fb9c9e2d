"""One-plane KV caches (MLA's latent): the layer views alias one plane, a held copy of it is
counted once, and FP8 scales that would give K and V different codes are refused."""
from __future__ import annotations

import types

import pytest
import torch

from batchgen_data.core.kv.held_kv import kv_nbytes
from batchgen_data.core.kv.planes import check_one_plane_scales, kv_planes, layer_caches
from batchgen_data.layers.kv_quant import KVScales


def test_planes_and_views() -> None:
    assert kv_planes(types.SimpleNamespace()) == 2
    assert kv_planes(types.SimpleNamespace(kv_planes=1)) == 1
    two = torch.zeros(3, 2, 4, 2, 1, 8)
    k, v = layer_caches(two)[1]
    assert k.data_ptr() != v.data_ptr()
    one = torch.zeros(3, 1, 4, 2, 1, 8)
    k, v = layer_caches(one)[2]
    assert k is v or k.data_ptr() == v.data_ptr()


def test_a_one_plane_copy_counts_once() -> None:
    k = torch.zeros(5, 1, 8)
    assert kv_nbytes([(k, k)]) == k.numel() * 4
    assert kv_nbytes([(k, k.clone())]) == 2 * k.numel() * 4


def test_one_plane_needs_one_scale() -> None:
    model = torch.nn.Module()
    model.attn = torch.nn.Module()
    model.attn.kv_scales = KVScales(0.5, 0.25)
    check_one_plane_scales(model, planes=2)  # two planes: any scales
    with pytest.raises(ValueError, match="attn: k_scale=0.5 and v_scale=0.25 differ"):
        check_one_plane_scales(model, planes=1)
    model.attn.kv_scales = KVScales(0.5, 0.5)
    check_one_plane_scales(model, planes=1)
