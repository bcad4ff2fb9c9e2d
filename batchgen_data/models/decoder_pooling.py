"""Decoders as pooling models: embedding bases (Qwen3-Embedding, gte-Qwen2, e5-mistral) and
`*ForSequenceClassification` heads over the Llama-family stack of `models/llama.py`.

They run the same causal stack over the paged KV cache (so long inputs prefill in chunks and
shared prefixes come from the prefix cache); only the output side differs: no LM head, and for
classifiers HF's `score` projection of the last token's hidden state.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from batchgen_data.models.llama import LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM


def _without_lm_head(cls: type[LlamaForCausalLM]) -> type[LlamaForCausalLM]:
    class Embedding(cls):  # type: ignore[valid-type, misc]
        is_encoder = False

        def __init__(self, config: Any) -> None:
            super().__init__(config)
            self.lm_head = None  # a checkpoint's lm_head weight is skipped by the loader

        @property
        def max_model_len(self) -> int:
            return self.shape.max_positions

    Embedding.__name__ = Embedding.__qualname__ = cls.__name__.replace("ForCausalLM",
                                                                       "ForEmbedding")
    return Embedding


LlamaForEmbedding = _without_lm_head(LlamaForCausalLM)
Qwen2ForEmbedding = _without_lm_head(Qwen2ForCausalLM)
Qwen3ForEmbedding = _without_lm_head(Qwen3ForCausalLM)


def _classifier(cls: type[LlamaForCausalLM]) -> type[LlamaForCausalLM]:
    class Classifier(_without_lm_head(cls)):  # type: ignore[misc]
        """logits = score(hidden state of the last token), as HF's."""

        def __init__(self, config: Any) -> None:
            super().__init__(config)
            self.num_labels = config.num_labels
            self.score = nn.Linear(config.hidden_size, config.num_labels, bias=False)

        def classify(self, last_rows: torch.Tensor) -> torch.Tensor:
            return self.score(last_rows).float()

    Classifier.__name__ = Classifier.__qualname__ = cls.__name__.replace(
        "ForCausalLM", "ForSequenceClassification")
    return Classifier


LlamaForSequenceClassification = _classifier(LlamaForCausalLM)
Qwen2ForSequenceClassification = _classifier(Qwen2ForCausalLM)
Qwen3ForSequenceClassification = _classifier(Qwen3ForCausalLM)


class Qwen3ForReranking(Qwen3ForCausalLM):
    """Qwen3-Reranker: a causal LM read as a one-label classifier. The relevance of a
    (query, document) prompt is P(yes) against P(no) at its last token, i.e. the sigmoid of
    logit(yes) - logit(no) (vLLM's `classifier_from_token` with `is_original_qwen3_reranker`).
    The two token ids are set from the tokenizer once it is loaded."""

    is_encoder = False
    num_labels = 1

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.label_token_ids: tuple[int, int] | None = None  # (no, yes)

    @property
    def max_model_len(self) -> int:
        return self.shape.max_positions

    def classify(self, last_rows: torch.Tensor) -> torch.Tensor:
        assert self.label_token_ids is not None, "label tokens not set"
        logits = self.compute_logits(last_rows)[:, list(self.label_token_ids)]  # [N, 2]
        return (logits[:, 1] - logits[:, 0]).unsqueeze(1)
