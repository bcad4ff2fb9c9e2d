"""Phi-3 / Phi-4 (`Phi3ForCausalLM`) give HF `generate`'s greedy tokens (fp32, CPU): q|k|v and
gate|up loaded fused as the checkpoint stores them, mixed prompt lengths, small prefill chunks,
forced preemption and prefix-cache hits; LongRoPE with a partial rotation (Phi-4-mini's shape)
on both of its factor sets: an engine serving the original length (short factors, where HF too
uses them) and one whose max_model_len reaches past it (long factors, which HF uses for
prompts longer than the original length)."""
from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from batchgen_data import LLM
from test_moe_vs_hf import CASES, check_greedy_case, greedy, hf_greedy

_COMMON: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, eos_token_id=2, bos_token_id=0, pad_token_id=0,
    tie_word_embeddings=False)
ORIGINAL = 32  # the LongRoPE config's pretraining length
CONFIGS: dict[str, dict[str, Any]] = {
    # Phi-4's shape: plain rope over whole heads, GQA
    "phi4": dict(max_position_embeddings=512),
    # Phi-4-mini's: LongRoPE over 12 of 16 channels, 4x extension
    "longrope": dict(max_position_embeddings=4 * ORIGINAL,
                     original_max_position_embeddings=ORIGINAL, partial_rotary_factor=0.75,
                     rope_parameters=dict(
                         rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=0.75,
                         short_factor=[1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                         long_factor=[1.5, 2.5, 4.0, 6.0, 9.0, 14.0])),
}


def build_phi3_model(name: str, path: Path, vocab: int) -> Path:
    from transformers import AutoModelForCausalLM, Phi3Config

    torch.manual_seed(sorted(CONFIGS).index(name) + 30)
    model = AutoModelForCausalLM.from_config(
        Phi3Config(vocab_size=vocab, **_COMMON, **CONFIGS[name])).eval()
    with torch.no_grad():  # wider logits: greedy ties become vanishingly rare
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(4.0)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def phi3_model(tiny_model_dir, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """Factory: config name -> (model dir, HF model), built once per module."""
    from transformers import AutoModelForCausalLM

    cache: dict[str, tuple[Path, Any]] = {}

    def make(name: str) -> tuple[Path, Any]:
        if name not in cache:
            path = tmp_path_factory.mktemp(f"tiny-phi3-{name}")
            for f in tiny_model_dir("llama").glob("*token*"):  # the session's tiny tokenizer
                shutil.copy(f, path / f.name)
            build_phi3_model(name, path, vocab=300)
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            cache[name] = (path, hf)
        return cache[name]

    return make


def test_checkpoint_stores_fused_projections(phi3_model) -> None:  # type: ignore[no-untyped-def]
    from safetensors import safe_open

    path, _ = phi3_model("phi4")
    with safe_open(str(next(path.glob("*.safetensors"))), framework="pt") as f:
        keys = set(f.keys())
    assert "model.layers.0.self_attn.qkv_proj.weight" in keys
    assert "model.layers.0.mlp.gate_up_proj.weight" in keys
    assert not any(".q_proj." in k or ".gate_proj." in k for k in keys)


@pytest.mark.parametrize("case", ["tiny_chunks", "preemption"])
def test_greedy_matches_hf(case: str, phi3_model) -> None:  # type: ignore[no-untyped-def]
    path, hf = phi3_model("phi4")
    llm = LLM(str(path), **CASES[case])
    assert type(llm.engine.runner.model).__name__ == "Phi3ForCausalLM"
    check_greedy_case(llm, hf, case)


def _prompts(seed: int, lengths: tuple[int, int], n: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 300) for _ in range(rng.randint(*lengths))] for _ in range(n)]


def test_longrope_short_factors_within_the_original_length(phi3_model) -> None:  # type: ignore[no-untyped-def]
    """Without max_model_len the engine serves the original 32 positions with the short
    factors, as HF does while a sequence stays within them (prompts in chunks)."""
    path, hf = phi3_model("longrope")
    llm = LLM(str(path), block_size=4, max_num_batched_tokens=7)
    assert llm.engine.max_model_len == ORIGINAL
    prompts = _prompts(1, (2, 16), 5)
    got = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(12), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [hf_greedy(hf, p, 12) for p in prompts]


@pytest.mark.parametrize("chunks", [False, True])
def test_longrope_long_factors_past_the_original_length(phi3_model, chunks: bool) -> None:  # type: ignore[no-untyped-def]
    """max_model_len past the original length: the long factors at every position, which is
    what HF uses for a prompt longer than the original length (its whole prefill and every
    decode step); chunked prefill and the prefix cache keep them."""
    path, hf = phi3_model("longrope")
    llm = LLM(str(path), block_size=4, max_model_len=4 * ORIGINAL,
              max_num_batched_tokens=7 if chunks else 256)
    prompts = _prompts(2, (ORIGINAL + 1, 3 * ORIGINAL), 4)
    prompts.append(prompts[0][:ORIGINAL + 3] + [7, 8, 9])  # a prefix-cache hit
    got = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(10), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [hf_greedy(hf, p, 10) for p in prompts]


def test_longrope_refuses_a_length_past_the_model(phi3_model) -> None:  # type: ignore[no-untyped-def]
    path, _ = phi3_model("longrope")
    with pytest.raises(ValueError, match="max_model_len=129 exceeds"):
        LLM(str(path), max_model_len=4 * ORIGINAL + 1)


def test_torch_only_backend_with_partial_rotation(phi3_model) -> None:  # type: ignore[no-untyped-def]
    """The torch layers (no C kernels) rotate three quarters of each head as HF does."""
    path, hf = phi3_model("longrope")
    prompts = _prompts(3, (2, 14), 3)
    got = LLM(str(path), cpu_kernels=False).generate(
        [{"prompt_token_ids": p} for p in prompts], greedy(10), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [hf_greedy(hf, p, 10) for p in prompts]


def test_lora_on_the_fused_projections_matches_peft(phi3_model, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A PEFT adapter on Phi-3's own module names (qkv_proj, gate_up_proj: one A over the fused
    rows) runs as PEFT applies it, next to a row without an adapter."""
    from lora_adapters import hf_greedy as peft_greedy, hf_lora_model, write_adapter

    from batchgen_data import LoRARequest

    path, hf = phi3_model("phi4")
    adapter = write_adapter(path, tmp_path / "adapter", seed=5, rank=4,
                            targets=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"])
    peft = hf_lora_model(hf, adapter, merged=False)
    prompts = _prompts(6, (3, 20), 3)
    llm = LLM(str(path), enable_lora=True, max_loras=2, max_lora_rank=8, block_size=4)
    loras = [LoRARequest("phi", 1, str(adapter)), None, LoRARequest("phi", 1, str(adapter))]
    got = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(10), use_tqdm=False,
                       lora_request=loras)
    want = [peft_greedy(peft if lora else hf, p, 10) for p, lora in zip(prompts, loras)]
    assert [o.outputs[0].token_ids for o in got] == want
    assert want[0] != hf_greedy(hf, prompts[0], 10)  # the adapter changes the tokens
