"""Model families for `cpu_throughput.py --family`: a small random model of each architecture
(the SmolLM2 vocabulary, so the same tokenizer and workloads serve every family), written once
per seed.

Each family's shape keeps SmolLM2-135M's width (576, 9 heads of 64, 3 KV heads) with fewer
layers where it is a mixture of experts, so a run stays minutes on two cores. gpt-oss is written
twice: its experts in MXFP4 as released (what our engine loads) and, for HF's baselines, the
same weights dequantized (HF's MXFP4 path wants a GPU); every other family is one directory.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

VOCAB = 49152
HF_DENSE = "hf_dense"  # gpt-oss: the subfolder HF's baselines load

_WIDTH: dict[str, Any] = dict(vocab_size=VOCAB, hidden_size=576, num_attention_heads=9,
                              num_key_value_heads=3, head_dim=64, tie_word_embeddings=False,
                              eos_token_id=2, bos_token_id=1)


def family_config(name: str) -> Any:
    """The HF config of family `name` (FAMILIES)."""
    import transformers as tf

    if name == "phi3":  # Phi-4-mini's recipe: LongRoPE over 3/4 of each head
        rot = int(64 * 0.75) // 2
        return tf.Phi3Config(**_WIDTH, intermediate_size=1536, num_hidden_layers=30,
                             max_position_embeddings=16384,
                             original_max_position_embeddings=4096, partial_rotary_factor=0.75,
                             rope_parameters=dict(rope_type="longrope", rope_theta=10000.0,
                                                  partial_rotary_factor=0.75,
                                                  short_factor=[1.0] * rot,
                                                  long_factor=[4.0] * rot))
    if name == "glm4_moe":  # GLM-4.5-Air's recipe: a dense first layer, 1 shared + top-4 of 16
        return tf.Glm4MoeConfig(**_WIDTH, intermediate_size=1536, moe_intermediate_size=256,
                                num_hidden_layers=12, n_routed_experts=16,
                                num_experts_per_tok=4, n_shared_experts=1, n_group=1,
                                topk_group=1, first_k_dense_replace=1, attention_bias=True,
                                partial_rotary_factor=0.5, max_position_embeddings=8192)
    if name == "gpt_oss":  # top-4 of 16, windows of 128 on alternate layers, sinks
        return tf.GptOssConfig(**_WIDTH, intermediate_size=576, num_hidden_layers=12,
                               num_local_experts=16, num_experts_per_tok=4,
                               sliding_window=128, max_position_embeddings=8192)
    if name == "gemma3":  # Gemma 3's recipe: five local layers (windows of 512) to one global
        return tf.Gemma3TextConfig(**_WIDTH, intermediate_size=1536, num_hidden_layers=30,
                                   sliding_window=512, query_pre_attn_scalar=64,
                                   max_position_embeddings=8192)
    if name == "gemma2":  # local and global alternating, attention and final soft-capping
        return tf.Gemma2Config(**_WIDTH, intermediate_size=1536, num_hidden_layers=30,
                               sliding_window=512, query_pre_attn_scalar=64,
                               max_position_embeddings=8192)
    if name == "mistral_window":  # Mistral v0.1's recipe: every layer windowed (KV freed early)
        return tf.MistralConfig(**_WIDTH, intermediate_size=1536, num_hidden_layers=30,
                                sliding_window=256, max_position_embeddings=8192)
    raise ValueError(f"family={name!r}: one of {FAMILIES}")


FAMILIES = ("phi3", "glm4_moe", "gpt_oss", "gemma2", "gemma3", "mistral_window")


def write_family(name: str, dest: Path, seed: int) -> None:
    """Random weights of family `name` saved to `dest` (gpt-oss: MXFP4 experts there and the
    dequantized model in dest / HF_DENSE)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(family_config(name)).to(torch.float32).eval()
    if name != "gpt_oss":
        model.save_pretrained(str(dest), safe_serialization=True)
        return
    from safetensors.torch import save_file

    from batchgen_data.kernels import reference
    from batchgen_data.layers import mxfp4

    tensors: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("sinks") or pname.endswith("_bias") or pname.endswith(".bias"):
                p.normal_(0, 0.02)  # HF leaves some of them uninitialised
            if pname.endswith(("experts.gate_up_proj", "experts.down_proj")):
                rows = p.transpose(1, 2)  # [E, out, in]: the checkpoint's rows
                blocks, scales = mxfp4.quantize(rows)
                p.copy_(reference.mxfp4_dequantize(blocks, scales).transpose(1, 2))
                e, n, k = rows.shape
                tensors[f"{pname}_blocks"] = blocks.view(e, n, k // 32, 16).contiguous()
                tensors[f"{pname}_scales"] = scales.contiguous()
            else:
                tensors[pname] = p.detach().clone().contiguous()
    dest.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(dest / "model.safetensors"))
    model.config.save_pretrained(str(dest))
    raw = json.loads((dest / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "mxfp4"}
    (dest / "config.json").write_text(json.dumps(raw))
    model.save_pretrained(str(dest / HF_DENSE), safe_serialization=True)


def hf_dir(model_dir: Path) -> Path:
    """Where HF's baselines load the model from."""
    dense = model_dir / HF_DENSE
    return dense if dense.is_dir() else model_dir
