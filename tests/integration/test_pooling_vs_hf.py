"""Pooling run mode against HF: embeddings (AutoModel + the stated pooling), classification
probabilities (*ForSequenceClassification), cross-encoder scores, for BERT, XLM-RoBERTa and
Qwen3; with a sentence-transformers directory (mean pooling; sentence-transformers' own
`encode` as a second oracle) and without (vLLM's defaults); mixed lengths in one pack, a
chunked prefill of a long input, inputs sharing a prefix, and the bad-input errors."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from batchgen_data import LLM
from batchgen_data.pooling_params import PoolingParams

from tests.integration.pooling_models import (build_encoder, build_qwen3,
                                              sentence_transformers_dir)

TEXTS = ["the quick brown fox jumps over the lazy dog",
         "paris is the capital of france",
         "a",
         "write a short poem about the sea the wind and the evening light " * 3,
         "classify the sentiment of this review the battery died after two days"]
PAIRS = [("the quick brown fox", "jumps over the lazy dog"),
         ("paris is the capital of france", "the sea"),
         ("a", "b c d e f g")]
COS = 0.99999


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pooling")
    out = {"bert": build_encoder("bert", root / "bert"),
           "xlm-roberta": build_encoder("xlm-roberta", root / "xlmr"),
           "qwen3": build_qwen3(root / "qwen3"),
           "bert-cls": build_encoder("bert", root / "bert-cls", classify=3),
           "xlm-roberta-cls": build_encoder("xlm-roberta", root / "xlmr-cls", classify=3),
           "qwen3-cls": build_qwen3(root / "qwen3-cls", classify=2),
           "bert-cross": build_encoder("bert", root / "bert-cross", classify=1),
           "xlm-roberta-cross": build_encoder("xlm-roberta", root / "xlmr-cross", classify=1)}
    for k in ("bert", "xlm-roberta", "qwen3"):
        out[f"{k}-st"] = sentence_transformers_dir(out[k], root / f"{k}-st", pooling="mean")
    return out


def _hf_embed(path: Path, texts: list[str], pooling: str) -> torch.Tensor:
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    rows = []
    with torch.no_grad():
        for t in texts:  # one at a time: no padding in the oracle
            h = model(**tok(t, return_tensors="pt")).last_hidden_state[0]
            rows.append({"cls": h[0], "last": h[-1], "mean": h.mean(0)}[pooling])
    return F.normalize(torch.stack(rows), dim=-1)


def _cos(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.cosine_similarity(a, b, dim=-1)


@pytest.mark.parametrize("arch,pooling", [("bert", "cls"), ("xlm-roberta", "cls"),
                                          ("qwen3", "last")])
def test_embed_default_pooling_matches_hf(models: dict[str, Path], arch: str,
                                          pooling: str) -> None:
    llm = LLM(str(models[arch]), runner="pooling", max_num_batched_tokens=64)
    outs = llm.embed(TEXTS, use_tqdm=False)
    got = torch.tensor([o.outputs.embedding for o in outs])
    ref = _hf_embed(models[arch], TEXTS, pooling)
    assert got.shape == ref.shape
    assert _cos(got, ref).min() >= COS
    assert torch.allclose(got.norm(dim=-1), torch.ones(len(TEXTS)), atol=1e-5)  # normalised


@pytest.mark.parametrize("arch", ["bert", "xlm-roberta", "qwen3"])
def test_embed_sentence_transformers_dir_mean_pooling(models: dict[str, Path], arch: str) -> None:
    st_module = pytest.importorskip("sentence_transformers")
    path = models[f"{arch}-st"]
    llm = LLM(str(path), runner="pooling", max_num_batched_tokens=48)
    got = torch.tensor([o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)])
    ref = _hf_embed(path, TEXTS, "mean")
    assert _cos(got, ref).min() >= COS
    st = torch.from_numpy(st_module.SentenceTransformer(str(path), device="cpu").encode(TEXTS))
    assert _cos(got, st).min() >= COS


def test_chunked_prefill_and_shared_prefix_on_a_decoder(models: dict[str, Path]) -> None:
    prefix = "judge whether the answer is correct and explain why " * 4
    texts = [prefix + "paris", prefix + "the sea", TEXTS[3] * 4]
    # an 8-token budget: every input prefills in several chunks, packed with the others
    llm = LLM(str(models["qwen3"]), runner="pooling", max_num_batched_tokens=8, block_size=4)
    first = llm.embed(texts, use_tqdm=False)
    ref = _hf_embed(models["qwen3"], texts, "last")
    got = torch.tensor([o.outputs.embedding for o in first])
    assert _cos(got, ref).min() >= COS
    again = llm.embed(texts[:2], use_tqdm=False)  # the prefix now comes from the cache
    assert all(o.num_cached_tokens > 0 for o in again)
    assert _cos(torch.tensor([o.outputs.embedding for o in again]), ref[:2]).min() >= COS
    assert llm.engine.stats.max_step_tokens <= 8


@pytest.mark.parametrize("arch", ["bert-cls", "xlm-roberta-cls", "qwen3-cls"])
def test_classify_matches_hf(models: dict[str, Path], arch: str) -> None:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = models[arch]
    tok = AutoTokenizer.from_pretrained(path)
    hf = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.stack([hf(**tok(t, return_tensors="pt")).logits[0].softmax(-1)
                           for t in TEXTS])
    llm = LLM(str(path), max_num_batched_tokens=40)  # runner "auto": a classifier pools
    got = torch.tensor([o.outputs.probs for o in llm.classify(TEXTS, use_tqdm=False)])
    assert got.shape == ref.shape
    assert torch.allclose(got, ref, atol=1e-5)


@pytest.mark.parametrize("arch", ["bert-cross", "xlm-roberta-cross"])
def test_cross_encoder_score_matches_hf(models: dict[str, Path], arch: str) -> None:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = models[arch]
    tok = AutoTokenizer.from_pretrained(path)
    hf = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = [torch.sigmoid(hf(**tok(a, b, return_tensors="pt")).logits[0, 0]).item()
               for a, b in PAIRS]
    llm = LLM(str(path))
    outs = llm.score([a for a, _ in PAIRS], [b for _, b in PAIRS], use_tqdm=False)
    assert [o.outputs.score for o in outs] == pytest.approx(ref, abs=1e-6)
    one_to_many = llm.score(PAIRS[0][0], [b for _, b in PAIRS], use_tqdm=False)
    assert len(one_to_many) == len(PAIRS)


def test_bi_encoder_score_is_cosine(models: dict[str, Path]) -> None:
    llm = LLM(str(models["bert-st"]))
    outs = llm.score(["the quick brown fox"], ["paris is the capital of france"],
                     use_tqdm=False)
    ref = _hf_embed(models["bert-st"], ["the quick brown fox", "paris is the capital of france"],
                    "mean")
    assert outs[0].outputs.score == pytest.approx(float(ref[0] @ ref[1]), abs=1e-5)


def test_matryoshka_dimensions_and_bad_inputs(models: dict[str, Path], tmp_path: Path) -> None:
    import json
    import shutil

    path = tmp_path / "mat"
    shutil.copytree(models["bert"], path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "is_matryoshka": True}))
    llm = LLM(str(path), max_model_len=16)
    full = torch.tensor(llm.embed(TEXTS[0], PoolingParams(normalize=False),
                                  use_tqdm=False)[0].outputs.embedding)
    short = llm.embed(TEXTS[0], PoolingParams(dimensions=16), use_tqdm=False)[0]
    assert len(short.outputs.embedding) == 16
    assert torch.allclose(torch.tensor(short.outputs.embedding), F.normalize(full[:16], dim=0),
                          atol=1e-6)
    with pytest.raises(ValueError, match="more than the model's embedding size 64"):
        llm.embed(TEXTS[0], PoolingParams(dimensions=65), use_tqdm=False)
    with pytest.raises(ValueError, match="prompts\\[1\\]: input has 41 tokens; the model takes "
                                         "at most 16"):
        llm.embed([TEXTS[0], TEXTS[3]], use_tqdm=False)
    cut = llm.embed(TEXTS[3], PoolingParams(truncate_prompt_tokens=-1), use_tqdm=False)[0]
    assert len(cut.prompt_token_ids) == 16
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.embed([""], use_tqdm=False)
    plain = LLM(str(models["bert"]))
    with pytest.raises(ValueError, match="does not support Matryoshka"):
        plain.embed(TEXTS[0], PoolingParams(dimensions=16), use_tqdm=False)
    with pytest.raises(ValueError, match="no classification head"):
        plain.classify(TEXTS[0], use_tqdm=False)
    with pytest.raises(ValueError, match="runs as a pooling model"):
        plain.generate("the quick brown fox", use_tqdm=False)


def test_qwen3_reranker_scores_yes_against_no_as_hf(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny_model_dir("qwen3")
    tok = AutoTokenizer.from_pretrained(path)
    no, yes = tok.convert_ids_to_tokens([100, 101])  # two tokens stand in for no / yes
    ids = [100, 101]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    pairs = [("<Query>: capital of France", "<Document>: Paris is the capital of France."),
             ("<Query>: a poem", "<Document>: def add(a, b): return a + b")]
    with torch.no_grad():
        ref = []
        for q, d in pairs:
            enc = tok(q, d, return_tensors="pt")
            logits = hf(**enc).logits[0, -1, ids]
            ref.append(logits.softmax(-1)[1].item())
    overrides = {"architectures": ["Qwen3ForSequenceClassification"],
                 "classifier_from_token": [no, yes], "is_original_qwen3_reranker": True}
    llm = LLM(str(path), hf_overrides=overrides)
    outs = llm.score([q for q, _ in pairs], [d for _, d in pairs], use_tqdm=False)
    assert [o.outputs.score for o in outs] == pytest.approx(ref, abs=1e-5)
