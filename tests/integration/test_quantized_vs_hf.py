"""Quantized checkpoints give HF `generate`'s greedy tokens on the dequantized weights (weight-only
semantics, fp32, CPU): compressed-tensors pack-quantized INT4/INT8 (per channel, per group, a
group size that does not divide the rows, asymmetric), float-quantized FP8 per channel,
DeepSeek/Qwen-style FP8 with block scales, GPTQ (4/8 bits, act order) and AWQ (GEMM), for Llama,
Qwen3, Qwen3-MoE and DeepSeek-V3; on the C kernels
(decode stack and per-layer), and on the torch path. Where HF loads the quantized checkpoint
itself (compressed-tensors, symmetric), against that too."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from batchgen_data import LLM, SamplingParams
from batchgen_data.worker.fast_paths.cpu_decode_stack import CpuDecodeStack
from quant_checkpoints import write_quantized
from test_deepseek_vs_hf import build_deepseek_model
from test_moe_vs_hf import build_moe_model

pytest.importorskip("compressed_tensors")

CASES = {
    "int4_g32": dict(method="pack", bits=4, group=32),
    "int8_channel": dict(method="pack", bits=8),
    "int4_g24_asym": dict(method="pack", bits=4, group=24, symmetric=False),
    "int8_g48_asym": dict(method="pack", bits=8, group=48, symmetric=False),
    "fp8_channel": dict(method="float"),
    "fp8_block": dict(method="fp8", block=(16, 32)),
    "gptq4_g32": dict(method="gptq", bits=4, group=32),
    "gptq4_g16_act_order": dict(method="gptq", bits=4, group=16, act_order=True),
    "gptq8_channel_asym": dict(method="gptq", bits=8, symmetric=False),
    "awq_g32": dict(method="awq", bits=4, group=32, symmetric=False),
}
PROMPTS = ["The quick brown fox", "What is the capital of France?", "def add(a, b):",
           "Write a short poem about the sea"]
MAX_TOKENS = 12


def _greedy_hf(model, tok, prompts: list[str]) -> list[list[int]]:
    out = []
    for p in prompts:
        ids = tok(p).input_ids
        # EOS does not stop HF either: ours runs with ignore_eos, and a random model may draw
        # its EOS id within MAX_TOKENS
        gen = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
        out.append(gen[0, len(ids):].tolist())
        assert len(out[-1]) == MAX_TOKENS  # no early stop
    return out


def _greedy_ours(path: Path, **kw) -> list[list[int]]:
    llm = LLM(str(path), max_model_len=256, **kw)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                                                ignore_eos=True), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def quantized(tiny_model_dir, tmp_path_factory):  # type: ignore[no-untyped-def]
    """Factory: (arch, case) -> (quantized dir, dequantized dir), written once."""
    cache: dict[tuple[str, str], tuple[Path, Path]] = {}

    def make(arch: str, case: str) -> tuple[Path, Path]:
        if (arch, case) not in cache:
            if arch in ("qwen3_moe", "deepseek_v3"):
                src = tmp_path_factory.mktemp(f"{arch}-src")
                llama = tiny_model_dir("llama")
                for f in llama.iterdir():
                    if "token" in f.name or f.name == "special_tokens_map.json":
                        (src / f.name).write_bytes(f.read_bytes())
                from transformers import AutoTokenizer
                vocab = len(AutoTokenizer.from_pretrained(llama))
                if arch == "qwen3_moe":
                    build_moe_model("qwen3_moe", src, vocab)
                else:
                    build_deepseek_model("q_lora", src, vocab)
            else:
                src = tiny_model_dir(arch)
            base = tmp_path_factory.mktemp(f"{arch}-{case}")
            cache[arch, case] = write_quantized(src, base / "q", base / "deq", **CASES[case])
        return cache[arch, case]

    return make


def _check(quantized, arch: str, case: str, **kw) -> list[list[int]]:  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    qdir, ddir = quantized(arch, case)
    hf = AutoModelForCausalLM.from_pretrained(ddir, dtype="float32").eval()
    want = _greedy_hf(hf, AutoTokenizer.from_pretrained(ddir), PROMPTS)
    got = _greedy_ours(qdir, **kw)
    assert got == want
    return got


@pytest.mark.parametrize("case", sorted(CASES))
def test_llama_matches_hf_on_dequantized_weights(quantized, case: str) -> None:  # type: ignore[no-untyped-def]
    _check(quantized, "llama", case)


@pytest.mark.parametrize("case", ["int4_g32", "int8_g48_asym", "fp8_block", "fp8_channel",
                                  "gptq4_g16_act_order", "awq_g32"])
def test_qwen3_matches_hf_on_dequantized_weights(quantized, case: str) -> None:  # type: ignore[no-untyped-def]
    _check(quantized, "qwen3", case)


@pytest.mark.parametrize("case", ["int4_g32", "int8_channel", "int4_g24_asym", "fp8_block",
                                  "gptq4_g32", "awq_g32"])
def test_qwen3_moe_matches_hf_on_dequantized_weights(quantized, case: str) -> None:  # type: ignore[no-untyped-def]
    _check(quantized, "qwen3_moe", case)


@pytest.mark.parametrize("case", ["fp8_block", "int8_channel"])
def test_deepseek_v3_matches_hf_on_dequantized_weights(quantized, case: str) -> None:  # type: ignore[no-untyped-def]
    # MLA's kv_b_proj has no quantized form here: it is dequantized once at load
    _check(quantized, "deepseek_v3", case)


@pytest.mark.cpu_kind
@pytest.mark.parametrize("case", ["int4_g32", "fp8_block"])
def test_torch_path_and_per_layer_path_give_the_same_tokens(quantized, case: str,  # type: ignore[no-untyped-def]
                                                           monkeypatch) -> None:
    stacked = _check(quantized, "llama", case)
    qdir, _ = quantized("llama", case)
    assert _greedy_ours(qdir, cpu_kernels=False) == stacked
    monkeypatch.setattr(CpuDecodeStack, "build", classmethod(lambda cls, *a: None))
    assert _greedy_ours(qdir) == stacked


@pytest.mark.parametrize("case", ["int4_g32", "int8_channel", "fp8_channel"])
def test_hf_loading_the_compressed_tensors_checkpoint_agrees(quantized, case: str) -> None:  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    qdir, _ = quantized("llama", case)
    hf = AutoModelForCausalLM.from_pretrained(qdir, dtype="float32").eval()
    assert _greedy_ours(qdir) == _greedy_hf(hf, AutoTokenizer.from_pretrained(qdir), PROMPTS)


def test_quantized_layers_hold_the_stored_bytes_only(quantized) -> None:  # type: ignore[no-untyped-def]
    qdir, ddir = quantized("llama", "int4_g32")
    q, d = LLM(str(qdir), max_model_len=256), LLM(str(ddir), max_model_len=256)
    qkv_q = q.engine.runner.model.layers[0].self_attn.qkv_proj
    assert qkv_q.weight is None and qkv_q.qweight.dtype == torch.uint8
    assert qkv_q.qweight.shape == (qkv_q.out_features, qkv_q.in_features // 2)

    def proj_bytes(llm: LLM) -> int:  # every tensor of the linear layers, in its layout
        from batchgen_data.layers.linear import Linear
        return sum(t.numel() * t.element_size()
                   for m in llm.engine.runner.model.layers.modules() if isinstance(m, Linear)
                   for t in (*m.parameters(recurse=False), *m.buffers(recurse=False))
                   if t is not None and not t.is_mkldnn)
    # 4 bits a weight plus one fp32 scale per 32 (5 bits) against 32 bits
    assert proj_bytes(q) * 6 < proj_bytes(d)


def test_offload_streams_the_quantized_layers(quantized) -> None:  # type: ignore[no-untyped-def]
    import re

    from batchgen_data.worker.offload.store import layer_bytes

    qdir, _ = quantized("llama", "int4_g32")
    want = _greedy_ours(qdir)
    with pytest.raises(ValueError, match="needs at least") as err:
        LLM(str(qdir), max_model_len=256, weight_memory_bytes=1)
    budget = int(re.search(r"needs at least (\d+)", str(err.value)).group(1))
    llm = LLM(str(qdir), max_model_len=256, weight_memory_bytes=budget)
    # a streamed layer's slot holds its stored (4-bit) bytes, not a dequantized copy
    qkv = llm.engine.runner.model.layers[0].self_attn.qkv_proj
    assert qkv.scheme is not None and qkv.weight is None
    assert max(layer_bytes(llm.engine.runner.model, aligned=False)) < 64 * 64 * 4 * 3
    assert _greedy_ours(qdir, weight_memory_bytes=budget) == want


@pytest.mark.parametrize("case", ["int4_g24_asym", "fp8_block"])
def test_triton_path_gives_the_same_tokens(quantized, case: str, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The Triton backend (forced onto CPU tensors, under the interpreter) multiplies the
    stored form with the weight-only Triton kernel and gives the C path's tokens."""
    pytest.importorskip("triton")
    import batchgen_data.kernels as kernels
    from engine_seams import triton_llm

    calls = []
    real = kernels.quant_linear
    monkeypatch.setattr(kernels, "quant_linear", lambda *a: calls.append(1) or real(*a))
    want = _check(quantized, "llama", case)
    qdir, _ = quantized("llama", case)
    llm = triton_llm(str(qdir), max_model_len=256)
    outs = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=4, temperature=0,
                                                    ignore_eos=True), use_tqdm=False)
    assert calls and [list(o.outputs[0].token_ids) for o in outs] == [w[:4] for w in want[:2]]
