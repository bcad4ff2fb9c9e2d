"""The whole model on the Triton path (kernels forced on for CPU tensors, run by the interpreter)
produces the same greedy tokens and nearly the same logprobs as the torch path.

Kernel tests check each launcher alone; this one checks how the layers call them: in-place
fused_add_rms_norm and apply_rotary on views of the fused qkv output, cu_seqlens offsets after
the decodes, slot dtypes, block tables of a cached prefix. The workload makes one step hold
decodes, a chunked prefill and a prefill that starts after prefix-cache hits.
"""
from __future__ import annotations

import random

import pytest
import torch

from batchgen_data import LLM, SamplingParams
from engine_seams import triton_llm

pytest.importorskip("triton")

ENGINE_KW = dict(block_size=4, max_num_batched_tokens=12, max_num_seqs=8, dtype="float32")
MAX_TOKENS = [3, 2, 3, 2, 3]


def _workload(vocab: int) -> tuple[list[list[int]], list[list[int]]]:
    """A warm-up prompt that seeds the prefix cache, then prompts that share its first blocks."""
    rng = random.Random(0)
    shared = [rng.randrange(3, vocab) for _ in range(9)]  # two full blocks are reused
    warm = [shared + [rng.randrange(3, vocab) for _ in range(3)]]
    tails = [2, 9, 1, 5, 14]  # longer than a step's token budget: chunked
    batch = [shared + [rng.randrange(3, vocab) for _ in range(t)] for t in tails]
    batch[3] = [rng.randrange(3, vocab) for _ in range(5)]  # one prompt with no cached prefix
    return warm, batch


def _run(path: str, forced: bool) -> tuple[list[list[int]], list[list[float]], int]:
    llm = triton_llm(path, **ENGINE_KW) if forced else LLM(path, **ENGINE_KW)
    assert llm.engine.runner.backend.triton == forced
    warm, batch = _workload(llm.engine.vocab_size)
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True, logprobs=0)
              for m in MAX_TOKENS]
    llm.generate([{"prompt_token_ids": p} for p in warm],
                 SamplingParams(max_tokens=2, temperature=0, ignore_eos=True), use_tqdm=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = [[lp[t] for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
                for o in outs]
    return tokens, logprobs, llm.engine.pool.hits


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_triton_path_matches_torch_path(arch: str, tiny_model_dir, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    torch.set_num_threads(1)
    path = str(tiny_model_dir(arch))
    import batchgen_data.kernels as kernels

    calls: dict[str, int] = {}
    for name in ("paged_decode_attention", "paged_prefill_attention", "apply_rotary",
                 "fused_add_rms_norm", "silu_and_mul"):
        real = getattr(kernels, name)

        def counting(*args, _real=real, _name=name, **kw):  # type: ignore[no-untyped-def]
            calls[_name] = calls.get(_name, 0) + 1
            return _real(*args, **kw)

        monkeypatch.setattr(kernels, name, counting)
    want_tokens, want_lp, want_hits = _run(path, forced=False)
    assert calls == {}
    got_tokens, got_lp, got_hits = _run(path, forced=True)
    assert len(calls) == 5, f"a Triton kernel was never called: {calls}"
    assert got_hits == want_hits > 0, "the workload must hit the prefix cache"
    assert got_tokens == want_tokens
    for got, want in zip(got_lp, want_lp):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def tiny_moe_dir(tiny_model_dir, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """A tiny Qwen3-MoE (8 experts, top-2, one dense layer) with the session's tokenizer."""
    import shutil

    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from batchgen_data.models.registry import supported_architectures

    if "Qwen3MoeForCausalLM" not in supported_architectures():
        pytest.skip("the engine has no Qwen3-MoE")
    path = tmp_path_factory.mktemp("tiny-qwen3-moe-triton")
    for f in tiny_model_dir("llama").glob("*token*"):
        shutil.copy(f, path / f.name)
    torch.manual_seed(3)
    cfg = Qwen3MoeConfig(vocab_size=300, hidden_size=64, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                         num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1],
                         max_position_embeddings=512, tie_word_embeddings=False)
    model = Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():  # widen near-flat random logits and router scores: no near-ties
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(4.0)
    model.save_pretrained(path)
    return path


def test_moe_triton_path_matches_torch_path(tiny_moe_dir, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # the MoE layer resolves fused_experts when it is built: count calls at the source
    from batchgen_data.kernels import fused_moe

    torch.set_num_threads(1)
    calls = [0]
    real = fused_moe.fused_experts

    def counting(*args, **kw):  # type: ignore[no-untyped-def]
        calls[0] += 1
        return real(*args, **kw)

    monkeypatch.setattr(fused_moe, "fused_experts", counting)
    want_tokens, want_lp, _ = _run(str(tiny_moe_dir), forced=False)
    assert calls[0] == 0
    got_tokens, got_lp, _ = _run(str(tiny_moe_dir), forced=True)
    assert calls[0] > 0, "the Triton MoE kernels were never called"
    assert got_tokens == want_tokens
    for got, want in zip(got_lp, want_lp):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-4, rtol=1e-4)
