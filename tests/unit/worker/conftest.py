"""Tiny models for the engine-level offload tests (weights streamed, KV host tier)."""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable

import pytest
import torch

NUM_LAYERS = 12  # with wider MLPs: the layers outweigh the embeddings, as in real models


def _save_model(base: Path, path: Path, model: torch.nn.Module) -> Path:
    for f in base.iterdir():  # the tokenizer of the conftest's tiny models
        if f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, path / f.name)
    with torch.no_grad():  # widen the logits: greedy ties vanishingly rare (as in conftest)
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(4.0)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def deep_llama(tiny_model_dir: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
               ) -> Path:
    """A tiny Llama with enough layers that most of its weights can stream."""
    import transformers as tf

    base = tiny_model_dir("llama")
    cfg = tf.LlamaConfig.from_pretrained(base)
    cfg.num_hidden_layers = NUM_LAYERS
    cfg.intermediate_size = 256
    torch.manual_seed(7)
    model = tf.LlamaForCausalLM(cfg).eval()
    return _save_model(base, tmp_path_factory.mktemp("deep-llama"), model)


@pytest.fixture(scope="session")
def deep_qwen3_moe(tiny_model_dir: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
                   ) -> Path:
    from batchgen_data.models.registry import supported_architectures

    if "Qwen3MoeForCausalLM" not in supported_architectures():
        pytest.skip("the qwen3_moe model is not registered in this build")
    import transformers as tf

    base = tiny_model_dir("qwen3")
    vocab = tf.AutoConfig.from_pretrained(base).vocab_size
    cfg = tf.Qwen3MoeConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                            moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2,
                            norm_topk_prob=True, num_hidden_layers=10, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                            eos_token_id=2, bos_token_id=0, pad_token_id=0,
                            tie_word_embeddings=False)
    torch.manual_seed(11)
    model = tf.Qwen3MoeForCausalLM(cfg).eval()
    return _save_model(base, tmp_path_factory.mktemp("deep-qwen3-moe"), model)
