"""Gemma 2 and Gemma 3 (text) give HF `generate`'s greedy tokens (fp32, CPU) and its logprobs:
tiny random configs with local (windowed) and global layers alternating, prompts that cross the
window several times, small prefill chunks, prefix-cache hits, preemption, the C decode kernel
and the torch path. Gemma 2's soft-capping (attention and final) is set low enough to bend
the scores; Gemma 3 has two RoPE bases (and a linear scaling on the global one), q/k norms.
Norm weights are random, so the (1 + weight) scaling is exercised."""
from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from batchgen_data import LLM, SamplingParams
from tests.conftest import build_tokenizer

WINDOW = 8


def _config(arch: str, vocab: int) -> Any:
    import transformers as tf

    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  max_position_embeddings=512, sliding_window=WINDOW, query_pre_attn_scalar=24,
                  layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                  eos_token_id=2, bos_token_id=0, pad_token_id=0)
    if arch == "gemma2":
        return tf.Gemma2Config(attn_logit_softcapping=3.0, final_logit_softcapping=8.0,
                               **common), tf.Gemma2ForCausalLM
    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}}
    return tf.Gemma3TextConfig(rope_parameters=rope, **common), tf.Gemma3ForCausalLM


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    """arch -> (saved directory, the HF model in fp32)."""
    out = {}
    for i, arch in enumerate(("gemma2", "gemma3")):
        path = tmp_path_factory.mktemp(arch)
        cfg, cls = _config(arch, len(build_tokenizer(path)))
        cfg._attn_implementation = "eager"  # soft-capping: HF's eager attention applies it
        torch.manual_seed(20 + i)
        model = cls(cfg).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.dim() == 2:
                    p.mul_(4.0)
                elif "norm" in name:  # Gemma scales by 1 + weight; HF starts them at 0
                    p.copy_(torch.randn_like(p) * 0.5)
        model.save_pretrained(path)
        out[arch] = (path, model)
    return out


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 300) for _ in range(rng.randint(18, 40))] for _ in range(n)]


def _hf(model: Any, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                         do_sample=False, eos_token_id=None, pad_token_id=0,
                         output_scores=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    # the scores are the processed logits; greedy leaves them raw (soft-capped by the model)
    lps = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.scores, tokens)]
    return tokens, lps


CASES = {
    "plain": dict(block_size=4),
    "chunks_and_preemption": dict(block_size=4, max_num_batched_tokens=7, num_kv_blocks=20),
    "torch_path": dict(block_size=4, cpu_kernels=False),
}


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
@pytest.mark.parametrize("case", list(CASES))
def test_gemma_greedy_and_logprobs_match_hf(arch: str, case: str, gemma) -> None:  # type: ignore[no-untyped-def]
    path, hf = gemma[arch]
    prompts = _prompts(3, seed=len(case))
    llm = LLM(str(path), **CASES[case])
    sp = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    if case == "chunks_and_preemption":  # global layers keep every block: rows run out
        assert llm.engine.stats.num_preemptions > 0
    for p, o in zip(prompts, outs):
        want, want_lp = _hf(hf, p, 10)
        got = list(o.outputs[0].token_ids)
        assert got == want
        got_lp = [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, got)]
        torch.testing.assert_close(torch.tensor(got_lp), torch.tensor(want_lp),
                                   atol=1e-4, rtol=1e-4)


def test_gemma_prefix_cache_hits_keep_outputs_exact(gemma) -> None:  # type: ignore[no-untyped-def]
    path, hf = gemma["gemma3"]
    llm = LLM(str(path), block_size=4)
    system = _prompts(1, seed=7)[0][:26]
    prompts = [system + tail[:5] for tail in _prompts(3, seed=8)]
    sp = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    got = [list(o.outputs[0].token_ids) for o in
            llm.generate([{"prompt_token_ids": p} for p in prompts[:1]], sp, use_tqdm=False)
            + llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], sp, use_tqdm=False)]
    assert llm.engine.pool.hits >= 2 * 6
    assert got == [_hf(hf, p, 10)[0] for p in prompts]


@pytest.mark.slow
def test_gemma3_tp2_matches_hf(gemma) -> None:  # type: ignore[no-untyped-def]
    # two gloo ranks on the CPU: heads, KV heads and the MLP split, q/k norms replicated
    path, hf = gemma["gemma3"]
    prompts = _prompts(2, seed=3)
    llm = LLM(str(path), tensor_parallel_size=2, num_threads=1, device="cpu", block_size=4,
              max_num_batched_tokens=16, collective_timeout_s=60.0)
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == [_hf(hf, p, 8)[0] for p in prompts]


def test_gemma_lora_matches_peft(gemma, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    # a PEFT adapter on every projection (q/k/v/o, gate/up/down) beside base rows in one batch
    from batchgen_data import LoRARequest
    from lora_adapters import hf_greedy, hf_lora_model, write_adapter

    path, hf = gemma["gemma2"]
    adapter = write_adapter(path, tmp_path / "adapter", seed=1)
    prompts = _prompts(2, seed=9)
    llm = LLM(str(path), block_size=4, enable_lora=True, max_loras=1, max_lora_rank=8)
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    lora = LoRARequest("a", 1, str(adapter))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts * 2], sp, use_tqdm=False,
                        lora_request=[lora, lora, None, None])
    peft = hf_lora_model(hf, adapter, merged=False)
    want = [hf_greedy(peft, p, 8) for p in prompts] + [_hf(hf, p, 8)[0] for p in prompts]
    assert [list(o.outputs[0].token_ids) for o in outs] == want
    assert want[:2] != want[2:]  # the adapter changes the tokens


@pytest.mark.parametrize("method, extra", [("gptq", dict(bits=4, group=32)),
                                           ("fp8", dict(block=(16, 32)))])
def test_gemma_quantized_matches_hf_on_dequantized_weights(gemma, tmp_path: Path, method: str,
                                                           extra: dict) -> None:
    # a GPTQ 4-bit and an FP8-block checkpoint of the tiny Gemma 3 against HF on the weights
    # as the checkpoint dequantizes
    from transformers import AutoModelForCausalLM
    from quant_checkpoints import write_quantized

    qdir, ddir = write_quantized(gemma["gemma3"][0], tmp_path / "q", tmp_path / "deq", method,
                                 **extra)
    hf = AutoModelForCausalLM.from_pretrained(ddir, dtype="float32").eval()
    prompts = _prompts(2, seed=11)
    llm = LLM(str(qdir), block_size=4, max_num_batched_tokens=16)
    layers = llm.engine.runner.model.layers
    assert all(getattr(layer.mlp.down_proj, "scheme", None) is not None for layer in layers)
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == [_hf(hf, p, 8)[0] for p in prompts]
