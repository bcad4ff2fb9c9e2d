"""Quantized checkpoints at tensor_parallel_size=2 (gloo, two processes, one thread each): each
rank keeps its slice of the stored form (codes, scales, zeros: rows of a column-parallel layer,
whole scale groups of a row-parallel one), and greedy tokens equal HF `generate` on the
dequantized weights, as at one rank (test_quantized_vs_hf.py's oracle and checkpoints). A cut
that falls inside a scale group, or GPTQ's act order (columns stored out of order), is refused
by name before the engine serves."""
from __future__ import annotations

import pytest
import torch

from test_quantized_vs_hf import CASES, _check, quantized  # noqa: F401 (the fixture)

pytest.importorskip("compressed_tensors")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

TP = dict(tensor_parallel_size=2, device="cpu", num_threads=1, collective_timeout_s=60.0)
INT4_G16 = dict(method="pack", bits=4, group=16)  # the MoE's experts: 16 columns a rank


@pytest.mark.parametrize("arch,case", [
    ("llama", "int4_g32"), ("llama", "int8_channel"), ("llama", "fp8_block"),
    ("llama", "awq_g32"), ("llama", "gptq8_channel_asym"),
    ("qwen3_moe", "int8_channel"), ("qwen3_moe", "int4_g16")])
def test_tp2_quantized_matches_hf_on_dequantized_weights(quantized, arch: str,  # type: ignore[no-untyped-def]
                                                        case: str, monkeypatch) -> None:
    monkeypatch.setitem(CASES, "int4_g16", INT4_G16)
    torch.set_num_threads(1)
    _check(quantized, arch, case, **TP)


@pytest.mark.parametrize("case,words", [
    ("int8_g48_asym", r"group_size=48 does not divide the \d+ input columns"),
    ("gptq4_g16_act_order", "act order"),
])
def test_a_cut_the_stored_form_cannot_take_is_named(quantized, case: str,  # type: ignore[no-untyped-def]
                                                    words: str) -> None:
    from batchgen_data import LLM

    torch.set_num_threads(1)
    qdir, _ = quantized("llama", case)
    with pytest.raises(Exception, match=words):
        LLM(str(qdir), max_model_len=256, **TP)
