"""DeepSeek-V3 checkpoints: the registry resolves them, the layers are what the config says
(dense first layers, routed ones with an ungated shared expert, MLA attention with or without
the q low-rank path), multi-token-prediction weights are skipped, and rope scalings whose
DeepSeek variant is not implemented are refused."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from batchgen_data.layers.mla import MultiHeadLatentAttention
from batchgen_data.layers.moe import FusedMoE
from batchgen_data.models import loader
from batchgen_data.models.deepseek_v3 import DeepseekV3ForCausalLM
from batchgen_data.models.deepseek_v3_router import GroupedTopkRouter
from batchgen_data.models.llama import LlamaMLP
from batchgen_data.models.registry import resolve_architecture, supported_architectures


def tiny_config(**overrides):  # type: ignore[no-untyped-def]
    from transformers import DeepseekV3Config

    cfg = dict(vocab_size=50, hidden_size=16, intermediate_size=24, moe_intermediate_size=8,
               num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2,
               q_lora_rank=12, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4,
               v_head_dim=6, n_routed_experts=4, num_experts_per_tok=2, n_group=2,
               topk_group=1, n_shared_experts=1, first_k_dense_replace=1,
               max_position_embeddings=64)
    cfg.update(overrides)
    return DeepseekV3Config(**cfg)


def save_tiny(path: Path, **overrides) -> Path:  # type: ignore[no-untyped-def]
    from transformers import DeepseekV3ForCausalLM as HfDeepseekV3

    torch.manual_seed(0)
    HfDeepseekV3(tiny_config(**overrides)).save_pretrained(path)
    return path


def load(path: Path) -> torch.nn.Module:
    config = loader.load_config(path, trust_remote_code=False)
    model = loader.build_model(config, torch.float32, torch.device("cpu"))
    loader.load_weights(model, path)
    return model


def test_registry_knows_deepseek_v3() -> None:
    assert "DeepseekV3ForCausalLM" in supported_architectures()
    assert resolve_architecture(tiny_config()) is DeepseekV3ForCausalLM


@pytest.mark.parametrize("q_lora_rank", [12, None])
def test_layers_follow_the_config(tmp_path: Path, q_lora_rank: int | None) -> None:
    path = save_tiny(tmp_path, q_lora_rank=q_lora_rank)
    model = load(path)
    tensors = load_file(str(path / "model.safetensors"))
    assert isinstance(model.layers[0].mlp, LlamaMLP)  # first_k_dense_replace=1
    moe = model.layers[1].mlp
    assert isinstance(moe, FusedMoE) and isinstance(moe.gate, GroupedTopkRouter)
    assert moe.shared_expert_gate is None and moe.shared_expert is not None
    bias = tensors["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert torch.equal(moe.gate.e_score_correction_bias, bias)
    attn = model.layers[2].self_attn
    assert isinstance(attn, MultiHeadLatentAttention)
    assert hasattr(attn, "q_proj") == (q_lora_rank is None)
    assert torch.equal(attn.kv_b_proj.weight, tensors["model.layers.2.self_attn.kv_b_proj.weight"])
    # the cache is one latent head of kv_lora_rank + qk_rope_head_dim
    assert (model.shape.num_kv_heads, model.shape.head_dim) == (1, 8 + 4)


def test_multi_token_prediction_weights_are_skipped(tmp_path: Path) -> None:
    path = save_tiny(tmp_path / "a")
    tensors = load_file(str(path / "model.safetensors"))
    # the released checkpoints append the MTP module as layer num_hidden_layers
    extra = {k.replace("layers.2.", "layers.3.", 1): v.clone() for k, v in tensors.items()
             if k.startswith("model.layers.2.")}
    extra["model.layers.3.eh_proj.weight"] = torch.zeros(16, 32)
    save_file({**tensors, **extra}, str(path / "model.safetensors"))
    model = load(path)
    assert len(model.layers) == 3


def test_an_unknown_weight_is_still_refused(tmp_path: Path) -> None:
    path = save_tiny(tmp_path)
    tensors = load_file(str(path / "model.safetensors"))
    tensors["model.layers.1.self_attn.q_proj.weight"] = torch.zeros(16, 16)  # has q_a/q_b
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="unexpected weight"):
        load(path)


@pytest.mark.parametrize("rope, message", [
    (dict(rope_type="linear", factor=2.0), "rope_type='linear'"),
    (dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16, truncate=False),
     "truncate=False"),
])
def test_unsupported_rope_scaling_is_refused(rope: dict, message: str) -> None:  # type: ignore[type-arg]
    config = tiny_config(rope_parameters={**rope, "rope_theta": 1e4})
    with pytest.raises(ValueError, match=message):
        loader.build_model(config, torch.float32, torch.device("cpu"))


def test_yarn_scales_follow_deepseek() -> None:
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (DeepseekV3Attention,
                                                                      DeepseekV3RotaryEmbedding)

    config = tiny_config(rope_parameters=dict(rope_type="yarn", factor=40.0, rope_theta=1e4,
                                              original_max_position_embeddings=16,
                                              mscale=1.0, mscale_all_dim=0.7))
    model = loader.build_model(config, torch.float32, torch.device("cpu"))
    hf_rope = DeepseekV3RotaryEmbedding(config)
    cos, sin = hf_rope(torch.zeros(1), torch.arange(64)[None])
    ours = model.rotary.cos_sin_cache  # [positions, cos | sin] over the r/2 frequencies
    assert torch.allclose(ours[:, :2], cos[0, :, :2], atol=1e-5)
    assert torch.allclose(ours[:, 2:], sin[0, :, :2], atol=1e-5)
    hf_scale = DeepseekV3Attention(config, 0).scaling
    assert model.layers[0].self_attn.attn.scale == pytest.approx(hf_scale, rel=1e-6)
    assert hf_scale != pytest.approx((4 + 4) ** -0.5)  # mscale_all_dim moved it
