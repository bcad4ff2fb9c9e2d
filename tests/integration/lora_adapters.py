"""PEFT LoRA adapters for the tiny test models, written with `peft` itself (a plain module the
LoRA tests share; conftest fixtures are not importable by name).

`write_adapter` makes a random adapter whose B is non-zero (PEFT's own init leaves B at zero,
which would make every adapter the base model), saves it with `save_pretrained` and returns its
directory. `hf_lora_greedy` is the oracle: HF `generate` under the adapter, applied as PEFT
applies it or merged into the weights.
"""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_adapter(base_dir: Path, out_dir: Path, seed: int, rank: int = 8, alpha: float = 16,
                  targets: list[str] | str | None = None, rslora: bool = False,
                  scale: float = 0.5, **extra: Any) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype="float32")
    cfg = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets or ALL_TARGETS,
                     use_rslora=rslora, init_lora_weights=False, lora_dropout=0.0, **extra)
    model = get_peft_model(base, cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * scale / p.shape[-1] ** 0.5)
    model.save_pretrained(out_dir)
    return out_dir


def hf_lora_model(base: Any, adapter_dir: Path, merged: bool) -> Any:
    from peft import PeftModel

    model = PeftModel.from_pretrained(copy.deepcopy(base), str(adapter_dir)).eval()
    return model.merge_and_unload().eval() if merged else model


def hf_greedy(model: Any, prompt: list[int], max_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                             max_new_tokens=max_tokens, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()
