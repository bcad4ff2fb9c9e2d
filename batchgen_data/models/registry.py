"""Architecture registry: HF `architectures` / `model_type` names to our implementations."""
from __future__ import annotations

from typing import Any

from torch import nn

from batchgen_data.models.llama import LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM

_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}
_BY_MODEL_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                  "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def supported_architectures() -> list[str]:
    return sorted(_REGISTRY)


def resolve_architecture(config: Any) -> type[nn.Module]:
    names = list(getattr(config, "architectures", None) or [])
    model_type = getattr(config, "model_type", None)
    if model_type in _BY_MODEL_TYPE:
        names.append(_BY_MODEL_TYPE[model_type])
    for name in names:
        if name in _REGISTRY:
            if name == "MistralForCausalLM" and getattr(config, "sliding_window", None):
                raise ValueError("sliding-window attention (Mistral) is not supported")
            return _REGISTRY[name]
    raise ValueError(f"unsupported architecture {names or model_type!r}; "
                     f"supported: {supported_architectures()}")
