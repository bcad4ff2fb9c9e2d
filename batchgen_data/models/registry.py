"""Architecture registry: HF `architectures` / `model_type` names to our implementations."""
from __future__ import annotations

from typing import Any

from torch import nn

from batchgen_data.models.deepseek_v3 import DeepseekV3ForCausalLM
from batchgen_data.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from batchgen_data.models.glm4_moe import Glm4MoeForCausalLM
from batchgen_data.models.gpt_oss import GptOssForCausalLM
from batchgen_data.models.llama import LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM
from batchgen_data.models.moe import (MixtralForCausalLM, Qwen2MoeForCausalLM,
                                      Qwen3MoeForCausalLM)
from batchgen_data.models.phi3 import Phi3ForCausalLM
from batchgen_data.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
from batchgen_data.models.qwen3_vl import Qwen3VLForConditionalGeneration

_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Glm4MoeForCausalLM": Glm4MoeForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Qwen2_5_VLForConditionalGeneration": Qwen2_5_VLForConditionalGeneration,
    "Qwen3VLForConditionalGeneration": Qwen3VLForConditionalGeneration,
}
_BY_MODEL_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                  "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                  "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                  "mixtral": "MixtralForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
                  "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
                  "glm4_moe": "Glm4MoeForCausalLM", "phi3": "Phi3ForCausalLM",
                  "gpt_oss": "GptOssForCausalLM",
                  "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
                  "qwen3_vl": "Qwen3VLForConditionalGeneration"}


def supported_architectures() -> list[str]:
    return sorted(_REGISTRY)


def resolve_architecture(config: Any) -> type[nn.Module]:
    names = list(getattr(config, "architectures", None) or [])
    model_type = getattr(config, "model_type", None)
    if model_type in _BY_MODEL_TYPE:
        names.append(_BY_MODEL_TYPE[model_type])
    for name in names:
        if name in _REGISTRY:
            return _REGISTRY[name]
    raise ValueError(f"unsupported architecture {names or model_type!r}; "
                     f"supported: {supported_architectures()}")


# ---- pooling models (embed / classify / score: docs/pooling.md) ---------------------------
def pooling_architectures() -> dict[str, type[nn.Module]]:
    """HF architecture names served by the pooling runner. A generative architecture run
    with runner="pooling" embeds with its LM head dropped."""
    from batchgen_data.models import bert, decoder_pooling as dp, modernbert

    return {
        "BertModel": bert.BertModel, "BertForMaskedLM": bert.BertModel,
        "XLMRobertaModel": bert.XLMRobertaModel, "XLMRobertaForMaskedLM": bert.XLMRobertaModel,
        "RobertaModel": bert.XLMRobertaModel,
        "BertForSequenceClassification": bert.BertForSequenceClassification,
        "XLMRobertaForSequenceClassification": bert.XLMRobertaForSequenceClassification,
        "RobertaForSequenceClassification": bert.XLMRobertaForSequenceClassification,
        "ModernBertModel": modernbert.ModernBertModel,
        "ModernBertForMaskedLM": modernbert.ModernBertModel,
        "ModernBertForSequenceClassification": modernbert.ModernBertForSequenceClassification,
        "LlamaModel": dp.LlamaForEmbedding, "LlamaForCausalLM": dp.LlamaForEmbedding,
        "MistralModel": dp.LlamaForEmbedding, "MistralForCausalLM": dp.LlamaForEmbedding,
        "Qwen2Model": dp.Qwen2ForEmbedding, "Qwen2ForCausalLM": dp.Qwen2ForEmbedding,
        "Qwen3Model": dp.Qwen3ForEmbedding, "Qwen3ForCausalLM": dp.Qwen3ForEmbedding,
        "LlamaForSequenceClassification": dp.LlamaForSequenceClassification,
        "Qwen2ForSequenceClassification": dp.Qwen2ForSequenceClassification,
        "Qwen3ForSequenceClassification": dp.Qwen3ForSequenceClassification,
    }


def resolve_pooling_architecture(config: Any) -> type[nn.Module]:
    table = pooling_architectures()
    names = list(getattr(config, "architectures", None) or [])
    for name in names:
        if name in table:
            return table[name]
    raise ValueError(f"no pooling model for architectures {names!r}; supported: "
                     f"{sorted(table)}")


def is_pooling_only(config: Any) -> bool:
    """Whether the checkpoint can only pool (encoders, classifiers, headless bases)."""
    names = set(getattr(config, "architectures", None) or [])
    return bool(names) and not names & set(_REGISTRY) and bool(names & set(pooling_architectures()))
