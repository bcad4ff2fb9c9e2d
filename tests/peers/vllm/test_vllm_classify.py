"""Port of vLLM's tests/entrypoints/llm/test_classify.py (jason9693/Qwen2.5-1.5B-apeach there,
a tiny random Qwen2ForSequenceClassification with two labels here): `PoolingParams(activation=
None)` means the default activation (softmax), like True; False gives the logits, whose softmax
is the default's output; vLLM 0.34's name `use_activation` the same; and `LLM.encode` without a
`pooling_task` is refused."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from batchgen_data import LLM, PoolingParams

PROMPTS = ["The chef prepared a delicious meal."]


@pytest.fixture(scope="module")
def classifier(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    import transformers as tf

    from tests.conftest import build_tokenizer

    path = tmp_path_factory.mktemp("tiny-qwen2-classifier")
    tok = build_tokenizer(path)
    cfg = tf.Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, pad_token_id=0, num_labels=2)
    torch.manual_seed(21)
    model = tf.Qwen2ForSequenceClassification(cfg).eval()
    with torch.no_grad():  # a random head gives near-equal logits: widen them
        model.score.weight.mul_(20.0)
    model.save_pretrained(path)
    return LLM(str(path), runner="pooling", seed=0)


def probs(llm: LLM, **kw: object) -> torch.Tensor:
    outputs = llm.classify(PROMPTS, pooling_params=PoolingParams(**kw), use_tqdm=False)
    return torch.tensor([x.outputs.probs for x in outputs])


# upstream: test_pooling_params
def test_pooling_params(classifier: LLM) -> None:
    default = probs(classifier, activation=None)
    w_activation = probs(classifier, activation=True)
    wo_activation = probs(classifier, activation=False)
    assert torch.allclose(default, w_activation, atol=1e-2), "Default should use activation."
    assert not torch.allclose(w_activation, wo_activation, atol=1e-2), \
        "wo_activation should not use activation."
    assert torch.allclose(wo_activation.softmax(-1), w_activation, atol=1e-2), \
        "w_activation should be close to activation(wo_activation)."
    # vLLM 0.34's name for the same switch
    assert torch.equal(probs(classifier, use_activation=None), w_activation)
    assert torch.equal(probs(classifier, use_activation=False), wo_activation)


# upstream: test_encode_api (vLLM 0.34's words: "pooling_task required for `LLM.encode`")
def test_encode_api(classifier: LLM) -> None:
    with pytest.raises(ValueError, match="pooling_task required"):
        classifier.encode(PROMPTS, use_tqdm=False)
    got = classifier.encode(PROMPTS, pooling_task="classify", use_tqdm=False)
    assert torch.allclose(torch.tensor([x.outputs.probs for x in got]), probs(classifier))
    with pytest.raises(ValueError, match="token_classify"):
        classifier.encode(PROMPTS, pooling_task="token_classify", use_tqdm=False)
