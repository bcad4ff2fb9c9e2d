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
from batchgen_data.layers import backend

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
    with backend.force_triton(forced):  # the layers choose their kernels when built
        llm = LLM(path, **ENGINE_KW)
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
