"""gpt-oss (`GptOssForCausalLM`) loaded from an MXFP4 checkpoint (expert blocks and E8M0 scales
as released) gives the greedy tokens of HF `generate` running on the dequantized weights (fp32,
CPU): attention sinks, 8-token windows on alternate layers crossed several times by long
prompts, biased q/k/v/o, YaRN with an unrounded correction range, the biased top-4 router and
the clamped SwiGLU experts; small prefill chunks, forced preemption and prefix-cache hits."""
from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from batchgen_data import LLM
from batchgen_data.kernels import reference
from batchgen_data.layers import mxfp4
from test_moe_vs_hf import CASES, greedy, hf_greedy

WINDOW = 8


def build_gpt_oss(path: Path, vocab: int) -> Any:
    """Writes an MXFP4 checkpoint of a tiny random gpt-oss to `path`; returns HF's model holding
    the same weights dequantized."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, GptOssConfig

    torch.manual_seed(50)
    config = GptOssConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8,
        num_experts_per_tok=4, sliding_window=WINDOW, max_position_embeddings=512,
        rope_parameters=dict(rope_type="yarn", factor=4.0, beta_fast=32.0, beta_slow=1.0,
                             truncate=False, original_max_position_embeddings=128,
                             rope_theta=150000.0),
        swiglu_limit=3.0, eos_token_id=2, bos_token_id=0, pad_token_id=0,
        tie_word_embeddings=False)
    hf = AutoModelForCausalLM.from_config(config).eval()
    tensors: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.25)  # wide enough logits that greedy ties are rare
            elif name.endswith("norm.weight"):
                p.fill_(1.0)
            else:  # biases, sinks
                p.normal_(0, 0.3)
        for name, p in hf.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                rows = p.transpose(1, 2)  # [E, out, in]: the checkpoint's rows
                blocks, scales = mxfp4.quantize(rows)
                p.copy_(reference.mxfp4_dequantize(blocks, scales).transpose(1, 2))
                e, n, k = rows.shape
                tensors[f"{name}_blocks"] = blocks.view(e, n, k // 32, 16).contiguous()
                tensors[f"{name}_scales"] = scales.contiguous()
            else:
                tensors[name] = p.detach().clone().contiguous()
    save_file(tensors, str(path / "model.safetensors"))
    config.save_pretrained(path)
    raw = json.loads((path / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "mxfp4",
                                  "modules_to_not_convert": ["model.layers.*.self_attn",
                                                             "model.layers.*.mlp.router",
                                                             "model.embed_tokens", "lm_head"]}
    (path / "config.json").write_text(json.dumps(raw))
    return hf


@pytest.fixture(scope="module")
def gpt_oss(tiny_model_dir, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    path = tmp_path_factory.mktemp("tiny-gpt-oss")
    for f in tiny_model_dir("llama").glob("*token*"):  # the session's tiny tokenizer
        shutil.copy(f, path / f.name)
    return path, build_gpt_oss(path, vocab=300)


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(3, 300) for _ in range(13)]
    mixed = [[rng.randrange(3, 300) for _ in range(rng.randint(1, 5 * WINDOW))] for _ in range(4)]
    return mixed + [system + [rng.randrange(3, 300) for _ in range(rng.randint(1, 6))]
                    for _ in range(2)]


def test_checkpoint_keeps_the_experts_in_mxfp4(gpt_oss) -> None:  # type: ignore[no-untyped-def]
    path, _ = gpt_oss
    llm = LLM(str(path), block_size=4)
    model = llm.engine.runner.model
    assert type(model).__name__ == "GptOssForCausalLM"
    ex = model.layers[0].mlp.experts
    assert ex.gate_up_proj_blocks.dtype == torch.uint8 and ex.gate_up_proj_blocks.shape == (8, 128, 32)
    windows = [layer.self_attn.attn.sliding_window for layer in model.layers]
    assert windows == [WINDOW, None, WINDOW]  # HF's layer_types: sliding on even layers
    assert all(layer.self_attn.attn.sinks is not None for layer in model.layers)


@pytest.mark.parametrize("case", ["tiny_chunks", "preemption"])
def test_greedy_matches_hf(case: str, gpt_oss) -> None:  # type: ignore[no-untyped-def]
    path, hf = gpt_oss
    llm = LLM(str(path), **CASES[case])
    prompts = _prompts(len(case))
    max_tokens = [random.Random(i).randint(4, 16) for i in range(len(prompts))]
    first = llm.generate([{"prompt_token_ids": p} for p in prompts[:5]],
                         [greedy(m) for m in max_tokens[:5]], use_tqdm=False)
    hits = llm.engine.pool.hits
    last = llm.generate([{"prompt_token_ids": prompts[5]}], [greedy(max_tokens[5])],
                        use_tqdm=False)
    got = [o.outputs[0].token_ids for o in first + last]
    assert got == [hf_greedy(hf, p, m) for p, m in zip(prompts, max_tokens)]
    if case == "preemption":
        assert llm.engine.stats.num_preemptions > 0
    else:  # (preemption's 14 blocks may have evicted the shared prefix)
        assert llm.engine.pool.hits > hits
    stats = llm.engine.stats.as_dict()["tokens_per_expert"]
    assert stats["layer_steps"] > 0


def test_dense_checkpoint_is_refused_by_name(gpt_oss, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A dequantized copy (no quantization_config) is refused naming what is missing."""
    path, _ = gpt_oss
    for f in path.glob("*token*"):
        shutil.copy(f, tmp_path / f.name)
    raw = json.loads((path / "config.json").read_text())
    del raw["quantization_config"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    shutil.copy(path / "model.safetensors", tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="only the MXFP4 checkpoints"):
        LLM(str(tmp_path))
