"""The one-call CPU decode step (`worker/fast_paths/cpu_decode_stack.py`,
`kernels/cpu/csrc/decode_stack.c`) against the per-layer path it stands in for, on tiny Llama /
Qwen2 / Qwen3 models, with and without LoRA adapters."""
from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

from batchgen_data import LLM, LoRARequest, SamplingParams
from batchgen_data.worker.fast_paths.cpu_decode_stack import CpuDecodeStack
from batchgen_data.kernels.cpu import linear as cpu_linear
from engine_seams import schedule_decode, step_until_decode

pytestmark = [pytest.mark.cpu_kind,
              pytest.mark.skipif(not cpu_linear.panel_gemm_available(),
                                 reason="no C kernels with AVX-512 here")]


def _engine_at_decode(path, rows: int, **kw):  # type: ignore[no-untyped-def]
    """An engine whose next step is a pure decode of `rows` sequences of different lengths."""
    llm = LLM(str(path), max_num_seqs=max(rows, 1), **kw)
    eng = llm.engine
    rng = random.Random(rows)
    vocab = eng.vocab_size
    for i in range(rows):
        prompt = [rng.randrange(3, vocab) for _ in range(3 + 7 * i)]
        eng.submit(prompt, SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
    step_until_decode(eng)
    eng.step()  # one decode step more
    return eng


def _both_paths(eng):  # type: ignore[no-untyped-def]
    runner = eng.runner
    inp = runner.prepare(schedule_decode(eng))
    kv0 = runner.kv.clone()
    with torch.inference_mode():
        assert runner.cpu_stack.applies(inp)
        got = runner.cpu_stack.run(inp)
        kv_got = runner.kv.clone()
        runner.kv.copy_(kv0)
        want = runner.model(inp.input_ids, inp.positions, runner.kv_caches, inp.meta)
    return inp, got, want, kv_got, runner.kv


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("rows", [1, 5, 8, 9, 14])
def test_stack_matches_the_per_layer_path(arch: str, rows: int, tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    eng = _engine_at_decode(tiny_model_dir(arch), rows, block_size=4)
    stack = eng.runner.cpu_stack
    assert stack is not None and stack.max_rows == cpu_linear.PANEL_MAX_ROWS
    assert eng.runner.fast_paths == [stack]
    served = stack.steps
    assert served > 0  # the engine's own decode steps went through it
    inp, got, want, kv_got, kv_want = _both_paths(eng)
    assert inp.meta.num_decodes == rows and got is not None and stack.steps == served + 1
    # the same kernels in the same order on the same rows: bit for bit the per-layer result
    assert torch.equal(got, want)
    assert torch.equal(kv_got, kv_want)  # every layer wrote this step's k and v, same slots
    logits_got = eng.runner.model.compute_logits(got)
    assert torch.equal(logits_got.argmax(-1), eng.runner.model.compute_logits(want).argmax(-1))


def test_stack_declines_steps_it_does_not_serve(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    eng = _engine_at_decode(tiny_model_dir("llama"), 3)
    runner, stack = eng.runner, eng.runner.cpu_stack
    inp = runner.prepare(schedule_decode(eng))
    # a step with a prefill chunk in it
    inp.meta.num_decodes -= 1
    assert not stack.applies(inp)
    inp.meta.num_decodes += 1
    stack.max_rows = 2  # more rows than it takes
    assert not stack.applies(inp)
    stack.max_rows = 8
    assert stack.applies(inp) and stack.run(inp).shape[0] == 3


def test_stack_rejects_out_of_range_positions(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    eng = _engine_at_decode(tiny_model_dir("llama"), 2)
    runner = eng.runner
    inp = runner.prepare(schedule_decode(eng))
    kv0 = runner.kv.clone()
    bad = inp.positions.clone()
    bad[1] = runner.model.rotary.cos_sin_cache.shape[0]
    good, inp.positions = inp.positions, bad
    with pytest.raises(ValueError, match="out of range"):
        runner.cpu_stack.run(inp)
    inp.positions = good
    slots = inp.meta.slot_mapping.clone()
    inp.meta.slot_mapping = slots.clone().fill_(runner.kv.shape[2] * runner.kv.shape[3])
    with pytest.raises(ValueError, match="out of range"):
        runner.cpu_stack.run(inp)
    assert torch.equal(runner.kv, kv0)  # nothing was written


@pytest.mark.parametrize("without", ["cpu_kernels", "panels"])
def test_without_the_stack_decode_matches_hf(without: str, monkeypatch: pytest.MonkeyPatch,
                                             tiny_model_dir, hf_model) -> None:  # type: ignore[no-untyped-def]
    kw = {}
    if without == "cpu_kernels":  # the engine setting
        kw["cpu_kernels"] = False
    else:  # a CPU without the panel kernel the stack runs on
        monkeypatch.setattr(cpu_linear, "panel_gemm_available", lambda: False)
    llm = LLM(str(tiny_model_dir("qwen2")), **kw)
    assert llm.engine.runner.cpu_stack is None
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}],
                       SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)
    # the fallback path gives HF's greedy tokens, not just four of them
    hf = hf_model(tiny_model_dir("qwen2"))
    ids = torch.tensor([[5, 6, 7]])
    want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4,
                       do_sample=False, eos_token_id=None, pad_token_id=0)[0, 3:].tolist()
    assert out[0].outputs[0].token_ids == want


def test_stack_needs_fp32(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    llm = LLM(str(tiny_model_dir("llama")), dtype="bfloat16")
    assert llm.engine.runner.cpu_stack is None
    runner = llm.engine.runner
    assert CpuDecodeStack.build(runner.model, runner.kv_caches, runner.backend) is None


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_lora_step_matches_the_per_layer_path(arch: str, tiny_model_dir, tmp_path: Path
                                              ) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("peft")
    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "integration"))
    from lora_adapters import write_adapter

    path = tiny_model_dir(arch)
    loras = [LoRARequest(f"a{i}", i + 1, str(write_adapter(path, tmp_path / f"a{i}", seed=i,
                                                           rank=4 * (i + 1))))
             for i in range(2)]
    llm = LLM(str(path), enable_lora=True, max_loras=2, max_lora_rank=8, max_num_seqs=6,
              block_size=4)
    eng = llm.engine
    rng = random.Random(0)
    which = [loras[0], None, loras[1], loras[0], None, loras[1]]  # adapters and base rows
    for i, lr in enumerate(which):
        prompt = [rng.randrange(3, eng.vocab_size) for _ in range(3 + 5 * i)]
        eng.submit(prompt, SamplingParams(max_tokens=50, temperature=0, ignore_eos=True),
                   lora_request=lr)
    step_until_decode(eng)
    eng.step()
    runner, stack = eng.runner, eng.runner.cpu_stack
    assert stack.lora_steps > 0  # the engine's own LoRA decode steps went through it
    inp = runner.prepare(schedule_decode(eng))
    assert inp.lora is not None and stack.applies(inp)
    kv0 = runner.kv.clone()
    with torch.inference_mode():
        got = stack.run(inp)
        kv_got = runner.kv.clone()
        runner.kv.copy_(kv0)
        runner.lora.ctx.batch = inp.lora
        want = runner.model(inp.input_ids, inp.positions, runner.kv_caches, inp.meta)
        runner.lora.ctx.batch = None
        kv_want = runner.kv.clone()
        runner.kv.copy_(kv0)
        base = runner.model(inp.input_ids, inp.positions, runner.kv_caches, inp.meta)
    # the same kernels (the C LoRA kernel after each linear) on the same rows: bit for bit
    assert torch.equal(got, want)
    assert torch.equal(kv_got, kv_want)  # k and v come out of the adapted q|k|v
    adapted = torch.zeros(got.shape[0], dtype=torch.bool)
    adapted[inp.lora.token_idx] = True
    assert not adapted.all() and adapted.any()
    assert torch.equal(got[~adapted], base[~adapted])  # base rows: the base model's states
    assert not torch.equal(got[adapted], base[adapted])  # the deltas were added
