"""Which model directories load: Mistral runs like HF (a windowed one: tests/integration/
test_sliding_window_vs_hf.py); a directory whose weights are only pickle-based `.bin` files is
refused with a message that says why."""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from batchgen_data import LLM, SamplingParams

PROMPTS = [[5, 17, 42, 9, 33, 21], [100, 3, 77]]


def test_mistral_greedy_matches_hf(tiny_model_dir: Callable[..., Path],
                                   hf_model: Callable[[Path], Any]) -> None:
    path = tiny_model_dir("mistral")
    hf = hf_model(path)
    assert type(hf).__name__ == "MistralForCausalLM"
    outs = LLM(str(path)).generate([{"prompt_token_ids": p} for p in PROMPTS],
                                   SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                                   use_tqdm=False)
    for p, o in zip(PROMPTS, outs):
        ids = torch.tensor([p])
        want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10,
                           do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(p):]
        assert o.outputs[0].token_ids == want.tolist()


def test_a_bin_only_model_directory_is_refused(tiny_model_dir: Callable[..., Path],
                                               tmp_path: Path) -> None:
    from safetensors.torch import load_file

    src = tiny_model_dir("llama")
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, tmp_path / f.name)
    weights: dict[str, torch.Tensor] = {}
    for f in src.glob("*.safetensors"):
        weights.update(load_file(f))
    torch.save(weights, tmp_path / "pytorch_model.bin")  # pickle: never loaded by the engine
    with pytest.raises(ValueError, match="safetensors"):
        LLM(str(tmp_path))
