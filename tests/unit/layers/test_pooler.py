"""Pooling over packed chunks (layers/pooler.py) against plain per-sequence torch, and the
pooling config read from a sentence-transformers directory (models/pooling_config.py)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from batchgen_data.layers.pooler import (PoolingType, chunk_pools, finish_pool, matryoshka,
                                         varlen_attention)
from batchgen_data.models.pooling_config import read_pooler_config


def test_chunk_pools_add_up_across_chunks_to_one_pass() -> None:
    torch.manual_seed(0)
    seq = torch.randn(11, 8)
    # the same sequence in chunks of 4, 4, 3 (packed with another sequence of 5 rows)
    other = torch.randn(5, 8)
    step1 = chunk_pools(torch.cat([seq[:4], other]), [4, 5], want_sums=True)
    step2 = chunk_pools(seq[4:8], [4], want_sums=True)
    step3 = chunk_pools(seq[8:], [3], want_sums=True)
    total = step1.sums[0] + step2.sums[0] + step3.sums[0]
    mean = finish_pool(PoolingType.MEAN, total, 11, None, None)
    assert torch.allclose(mean, seq.mean(0), atol=1e-6)
    assert torch.equal(finish_pool(PoolingType.CLS, None, 0, step1.firsts[0], None), seq[0])
    assert torch.equal(finish_pool(PoolingType.LAST, None, 0, None, step3.lasts[0]), seq[-1])
    assert torch.allclose(step1.sums[1], other.sum(0), atol=1e-6)


def test_matryoshka_truncates_before_normalising() -> None:
    v = torch.tensor([[3.0, 4.0, 12.0]])
    assert torch.allclose(matryoshka(v, 2, True), torch.tensor([[0.6, 0.8]]))
    assert torch.equal(matryoshka(v, None, False), v)


def test_varlen_attention_is_per_sequence_and_bidirectional() -> None:
    torch.manual_seed(1)
    lens = [3, 5, 3, 1]
    q, k, v = (torch.randn(sum(lens), 2, 4) for _ in range(3))
    out = varlen_attention(q, k, v, lens, 0.5)
    a = 0
    for n in lens:
        ref = F.scaled_dot_product_attention(*(t[a:a + n].transpose(0, 1) for t in (q, k, v)),
                                             scale=0.5).transpose(0, 1)
        assert torch.allclose(out[a:a + n], ref, atol=1e-6)
        a += n


def _st_dir(tmp_path: Path, modules: list[str], pooling: dict) -> Path:  # type: ignore[type-arg]
    entries = [{"idx": i, "name": str(i), "path": "" if m == "Transformer" else f"{i}_{m}",
                "type": f"sentence_transformers.models.{m}"} for i, m in enumerate(modules)]
    (tmp_path / "modules.json").write_text(json.dumps(entries))
    for e, m in zip(entries, modules):
        if m == "Pooling":
            (tmp_path / e["path"]).mkdir()
            (tmp_path / e["path"] / "config.json").write_text(json.dumps(pooling))
    return tmp_path


def test_pooling_config_from_sentence_transformers_and_defaults(tmp_path: Path) -> None:
    assert read_pooler_config(tmp_path, is_encoder=True).pooling_type is PoolingType.CLS
    decoder = read_pooler_config(tmp_path, is_encoder=False)
    assert decoder.pooling_type is PoolingType.LAST and decoder.normalize
    (tmp_path / "a").mkdir()
    cfg = read_pooler_config(_st_dir(tmp_path / "a", ["Transformer", "Pooling", "Normalize"],
                                     {"pooling_mode_mean_tokens": True}), is_encoder=True)
    assert cfg.pooling_type is PoolingType.MEAN and cfg.normalize
    (tmp_path / "b").mkdir()
    unnormed = read_pooler_config(_st_dir(tmp_path / "b", ["Transformer", "Pooling"],
                                          {"pooling_mode": "lasttoken"}), is_encoder=False)
    assert unnormed.pooling_type is PoolingType.LAST and not unnormed.normalize
    (tmp_path / "c").mkdir()
    with pytest.raises(ValueError, match="Dense"):
        read_pooler_config(_st_dir(tmp_path / "c", ["Transformer", "Pooling", "Dense"],
                                   {"pooling_mode_cls_token": True}), is_encoder=True)
    (tmp_path / "d").mkdir()
    with pytest.raises(ValueError, match="pooling_mode_max_tokens"):
        read_pooler_config(_st_dir(tmp_path / "d", ["Transformer", "Pooling"],
                                   {"pooling_mode_max_tokens": True}), is_encoder=True)
