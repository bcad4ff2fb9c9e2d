"""M-RoPE against HF's Qwen2.5-VL rotary embedding: three position rows per token, the
frequency pairs cut into mrope_section runs; three equal rows are the plain rotary."""
from __future__ import annotations

import torch

from batchgen_data.layers.backend import LayerBackend, building
from batchgen_data.layers.rotary import MRotaryEmbedding, RotaryEmbedding


def _config():  # type: ignore[no-untyped-def]
    from transformers import Qwen2_5_VLTextConfig

    return Qwen2_5_VLTextConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                max_position_embeddings=256,
                                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                 "mrope_section": [2, 3, 3]})


def test_mrope_matches_hf() -> None:
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
        Qwen2_5_VLRotaryEmbedding, apply_rotary_pos_emb)

    cfg = _config()
    torch.manual_seed(0)
    t, h, hkv, d = 11, 4, 2, 16
    pos = torch.randint(0, 200, (3, t))
    q, k = torch.randn(t, h, d), torch.randn(t, hkv, d)
    hf = Qwen2_5_VLRotaryEmbedding(cfg)
    cos, sin = hf(q, pos[:, None, :])  # [3, 1, T] -> [1, T, D]
    want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                          cos, sin)
    with building(LayerBackend(torch.device("cpu"), torch.float32)):
        ours = MRotaryEmbedding(cfg, d, 256)
    got_q, got_k = ours(pos, q, k)
    torch.testing.assert_close(got_q, want_q[0].transpose(0, 1))
    torch.testing.assert_close(got_k, want_k[0].transpose(0, 1))


def test_equal_rows_are_the_plain_rotary() -> None:
    cfg = _config()
    with building(LayerBackend(torch.device("cpu"), torch.float32)):
        mrope, plain = MRotaryEmbedding(cfg, 16, 256), RotaryEmbedding(cfg, 16, 256)
    pos = torch.arange(7) * 9
    q, k = torch.randn(7, 4, 16), torch.randn(7, 2, 16)
    got = mrope(pos.expand(3, -1).clone(), q.clone(), k.clone())
    want = plain._torch(pos, q.clone(), k.clone())
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])
