"""MoE checkpoints: both expert layouts load into the stacked weights, a missing expert is named,
the sparse/dense layer rule follows HF, and the registry knows the three architectures."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from batchgen_data.layers.moe import FusedMoE
from batchgen_data.models import loader
from batchgen_data.models.llama import LlamaMLP
from batchgen_data.models.registry import resolve_architecture


def tiny_qwen3_moe(path: Path, **overrides) -> Path:  # type: ignore[no-untyped-def]
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = dict(vocab_size=50, hidden_size=16, intermediate_size=24, moe_intermediate_size=8,
               num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
               num_experts=4, num_experts_per_tok=2, max_position_embeddings=64)
    cfg.update(overrides)
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(Qwen3MoeConfig(**cfg)).save_pretrained(path)
    return path


def load(path: Path) -> torch.nn.Module:
    config = loader.load_config(path, trust_remote_code=False)
    model = loader.build_model(config, torch.float32, torch.device("cpu"))
    loader.load_weights(model, path)
    return model


def test_per_expert_and_stacked_checkpoints_load_the_same_weights(tmp_path: Path) -> None:
    per_expert = tiny_qwen3_moe(tmp_path / "a")
    tensors = load_file(str(per_expert / "model.safetensors"))
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in tensors  # what transformers writes
    stacked = {k: v for k, v in tensors.items() if ".experts." not in k}
    for i in range(4):
        pre = f"model.layers.{i}.mlp.experts"
        gate_up = [torch.cat([tensors[f"{pre}.{e}.gate_proj.weight"],
                              tensors[f"{pre}.{e}.up_proj.weight"]]) for e in range(4)]
        stacked[f"{pre}.gate_up_proj"] = torch.stack(gate_up)  # [E, 2I, H]
        stacked[f"{pre}.down_proj"] = torch.stack(
            [tensors[f"{pre}.{e}.down_proj.weight"] for e in range(4)])  # [E, H, I]
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "config.json").write_text((per_expert / "config.json").read_text())
    save_file(stacked, str(tmp_path / "b" / "model.safetensors"))
    a, b = load(per_expert), load(tmp_path / "b")
    moe = a.layers[2].mlp
    assert isinstance(moe, FusedMoE)
    want_up = tensors["model.layers.2.mlp.experts.1.up_proj.weight"]
    assert torch.equal(moe.w13[1, 8:], want_up)  # rows I..2I-1 of expert 1 are its up_proj
    for (name, pa), (_, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(pa, pb), name


def test_a_missing_expert_is_named(tmp_path: Path) -> None:
    path = tiny_qwen3_moe(tmp_path)
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.1.mlp.experts.2.down_proj.weight"]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.w2#2\.0"):
        load(path)


def test_sparse_step_and_mlp_only_layers_keep_dense_layers(tmp_path: Path) -> None:
    model = load(tiny_qwen3_moe(tmp_path, decoder_sparse_step=2, mlp_only_layers=[3]))
    kinds = [type(layer.mlp) for layer in model.layers]
    assert kinds == [LlamaMLP, FusedMoE, LlamaMLP, LlamaMLP]  # sparse: (i+1) % 2 == 0, not 3
    assert model.take_expert_tokens().shape == (1, 4)


def test_registry_resolves_the_moe_architectures() -> None:
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    for cfg, name in ((Qwen3MoeConfig(), "Qwen3MoeForCausalLM"),
                      (Qwen2MoeConfig(), "Qwen2MoeForCausalLM"),
                      (MixtralConfig(), "MixtralForCausalLM")):
        assert resolve_architecture(cfg).__name__ == name
    # a windowed Mixtral loads (every layer windowed: models/llama.layer_windows)
    assert resolve_architecture(MixtralConfig(sliding_window=4096)).__name__ == "MixtralForCausalLM"
