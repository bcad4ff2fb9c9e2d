"""`dtype="bfloat16"` works on every CPU kind the project has met: a tiny random Llama loaded in
bf16 generates greedy tokens that HF's fp32 model, fed the same tokens, rates as its best within
bf16's precision, whatever path the CPU kind gives the linear layers (oneDNN's packed bf16
weights, or plain bf16 weights widened to fp32 for prefill where oneDNN has no bf16 path).
`make test` runs the first test again under each emulated kind (docs/cpu.md); the second forces
oneDNN to an AVX2-only CPU's answer in a fresh process (oneDNN reads ONEDNN_MAX_CPU_ISA when it
starts), so the fallback and its message are checked on any box.

Why not HF's bf16 tokens exactly: this model's logits are ~2.5 at most, where bf16's spacing is
0.016, and its top two often differ by less (two of six prompts here tie in HF's own bf16
logits), so two correct bf16 implementations may pick either.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from batchgen_data import LLM, SamplingParams
from batchgen_data.kernels.cpu import capability

MAX_TOKENS = 12
# prefill chunks of up to 64 rows: past the "widen" layout's WIDEN_MIN_ROWS
ENGINE = dict(dtype="bfloat16", max_num_batched_tokens=64, block_size=4)
# the bf16 tolerance of the kernel tests (tests/kernels/kernel_test_utils.py), relative to the
# largest logit of the row
BF16_RTOL = 1.6e-2


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, 300) for _ in range(rng.randint(1, 40))] for _ in range(6)]


def assert_greedy_within_bf16(hf: Any, prompts: list[list[int]], got: list[list[int]]) -> None:
    """Teacher-forced on our tokens, HF's fp32 logits put each of them within `BF16_RTOL` of
    that position's best (a wrong weight, layout or kernel falls far outside)."""
    assert [len(t) for t in got] == [MAX_TOKENS] * len(prompts)
    for prompt, tokens in zip(prompts, got):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + tokens])).logits[0].float()
        rows = logits[len(prompt) - 1:len(prompt) - 1 + len(tokens)]  # [tokens, vocab]
        short = rows.max(-1).values - rows[torch.arange(len(tokens)), torch.tensor(tokens)]
        allowed = BF16_RTOL * rows.abs().max(-1).values
        assert bool((short <= allowed).all()), (prompt, tokens, short.tolist())


@pytest.mark.cpu_kind
def test_bf16_greedy_tokens_are_hfs_on_this_cpu_kind(tiny_model_dir: Callable[..., Path],
                                                      hf_model: Callable[[Path], Any]) -> None:
    path = tiny_model_dir("llama")
    llm = LLM(str(path), **ENGINE)
    want = ("onednn" if capability.onednn(torch.bfloat16).ok
            else "plain" if capability.half_matmul_fast(torch.bfloat16) else "widen")
    assert llm.engine.runner.backend.linear == want
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()],
                        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                        use_tqdm=False)
    assert_greedy_within_bf16(hf_model(path), _prompts(), [o.outputs[0].token_ids for o in outs])


CHILD = textwrap.dedent("""
    import json, sys
    import torch
    from batchgen_data import LLM, SamplingParams
    from batchgen_data.kernels.cpu import capability, linear

    model, out_path, prompts, engine = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), \\
        json.loads(sys.argv[4])
    report = {"onednn_bf16": capability.report()["onednn_bf16"]}
    try:
        linear.pack_onednn(torch.randn(8, 8, dtype=torch.bfloat16))
        report["refusal"] = None
    except ValueError as exc:
        report["refusal"] = str(exc)
    llm = LLM(model, **engine)
    report["layout"] = llm.engine.runner.backend.linear
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=int(sys.argv[5]),
                                       ignore_eos=True), use_tqdm=False)
    report["tokens"] = [o.outputs[0].token_ids for o in outs]
    with open(out_path, "w") as f:  # a file of its own, not stdout
        json.dump(report, f)
""")


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch")
@pytest.mark.timeout(300)
def test_bf16_without_onednns_bf16_path_widens_and_names_the_cpu_feature(
        tiny_model_dir: Callable[..., Path], hf_model: Callable[[Path], Any],
        tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"}  # oneDNN as on the AVX2-only EPYC
    proc = subprocess.run([sys.executable, "-c", CHILD, str(tiny_model_dir("llama")), str(out),
                           json.dumps(_prompts()), json.dumps(ENGINE), str(MAX_TOKENS)],
                          env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report: dict[str, Any] = json.loads(out.read_text())
    # oneDNN's own answer, passed on: the CPU features its bf16 path needs
    assert "avx512bw" in report["onednn_bf16"] and "avx_ne_convert" in report["onednn_bf16"]
    assert report["refusal"].startswith("pack_onednn: no packed torch.bfloat16 linear")
    assert "avx512bw" in report["refusal"]
    # the model still loads and runs, on the widened path, and says why once
    assert report["layout"] == "widen"
    warned = [ln for ln in proc.stderr.splitlines() if "dtype=bfloat16 on this CPU" in ln]
    assert len(warned) == 1 and "avx512bw" in warned[0] and "widen" in warned[0]
    assert_greedy_within_bf16(hf_model(tiny_model_dir("llama")), _prompts(), report["tokens"])
