"""A mixed-adapter batch on the Triton path (kernels forced on for CPU tensors, run by the
interpreter) gives the CPU path's greedy tokens, and the LoRA launchers are what runs: the
layers call them with the step's segments (decodes and a chunked prefill under different
adapters, rows of the base model among them)."""
from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

from batchgen_data import LLM, LoRARequest, SamplingParams
from engine_seams import triton_llm

pytest.importorskip("triton")
pytest.importorskip("peft")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from lora_adapters import write_adapter  # noqa: E402


def test_lora_triton_path_matches_torch_path(tiny_model_dir, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    torch.set_num_threads(1)
    path = tiny_model_dir("llama")
    loras = [LoRARequest(f"a{i}", i + 1, str(write_adapter(path, tmp_path / f"a{i}", seed=i,
                                                           rank=4 * (i + 1))))
             for i in range(3)]
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randint(2, 14))] for _ in range(6)]
    which = [loras[0], loras[1], None, loras[2], loras[0], None]
    sp = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    kw = dict(enable_lora=True, max_loras=3, block_size=4, max_num_batched_tokens=12,
              dtype="float32")

    import batchgen_data.kernels as kernels

    calls = {"lora_shrink": 0, "lora_expand": 0}
    for name in calls:
        real = getattr(kernels, name)

        def counted(*a, _real=real, _name=name, **k):  # type: ignore[no-untyped-def]
            calls[_name] += 1
            return _real(*a, **k)

        monkeypatch.setattr(kernels, name, counted)
    got = {}
    for forced in (False, True):
        llm = triton_llm(str(path), **kw) if forced else LLM(str(path), **kw)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False,
                            lora_request=which)
        got[forced] = [o.outputs[0].token_ids for o in outs]
    assert got[True] == got[False]
    # per decoder layer 4 shrinks (q|k|v, o, gate|up, down) and one expand per shard: 3 + 1 + 2 + 1
    assert calls["lora_shrink"] > 0 and 4 * calls["lora_expand"] == 7 * calls["lora_shrink"]
