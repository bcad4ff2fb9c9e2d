"""ModernBERT on the pooling runner against HF's `ModernBertModel` /
`ModernBertForSequenceClassification` (fp32): embeddings with the default CLS pooling and with a
sentence-transformers directory (mean), a sliding window narrower than the inputs (so the local
layers' mask matters), the bias and LayerNorm-bias flags both ways, classification and
cross-encoder scores, and the refusal of mean classifier pooling."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from batchgen_data import LLM

from tests.integration.pooling_models import _widen, bert_tokenizer, sentence_transformers_dir

TEXTS = ["the quick brown fox jumps over the lazy dog",
         "paris is the capital of france",
         "a",
         "write a short poem about the sea the wind and the evening light " * 3,
         "classify the sentiment of this review the battery died after two days"]
PAIRS = [("the quick brown fox", "jumps over the lazy dog"), ("a", "b c d e f g")]
COS = 0.99999


def build_modernbert(path: Path, classify: int | None = None, biases: bool = False,
                     **overrides) -> Path:  # type: ignore[no-untyped-def]
    import transformers as tf

    tok = bert_tokenizer(path)
    cfg = tf.ModernBertConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, max_position_embeddings=256, pad_token_id=0, cls_token_id=2,
        sep_token_id=3, bos_token_id=2, eos_token_id=3, global_attn_every_n_layers=3,
        local_attention=8, attention_bias=biases, mlp_bias=biases, norm_bias=biases,
        classifier_bias=biases, global_rope_theta=160000.0, local_rope_theta=10000.0,
        **overrides)
    torch.manual_seed(21 + biases)
    if classify:
        cfg.num_labels = classify
        model = tf.ModernBertForSequenceClassification(cfg).eval()
    else:
        model = tf.ModernBertModel(cfg).eval()
    _widen(model, 22)
    with torch.no_grad():  # peaked attention: which tokens a layer sees then matters
        for name, p in model.named_parameters():
            if name.endswith("Wqkv.weight"):
                p.mul_(4.0)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("modernbert")
    out = {"base": build_modernbert(root / "base"),
           "biases": build_modernbert(root / "biases", biases=True),
           "cls": build_modernbert(root / "cls", classify=3, biases=True),
           "cross": build_modernbert(root / "cross", classify=1)}
    out["st"] = sentence_transformers_dir(out["base"], root / "st", pooling="mean")
    return out


def _hf_embed(path: Path, texts: list[str], pooling: str) -> torch.Tensor:
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path, dtype=torch.float32,
                                      attn_implementation="sdpa").eval()
    rows = []
    with torch.no_grad():
        for t in texts:  # one at a time: no padding in the oracle
            enc = tok(t, return_tensors="pt")
            h = model(input_ids=enc.input_ids).last_hidden_state[0]
            rows.append(h[0] if pooling == "cls" else h.mean(0))
    return F.normalize(torch.stack(rows), dim=-1)


@pytest.mark.parametrize("name", ["base", "biases"])
def test_embed_cls_matches_hf(models: dict[str, Path], name: str) -> None:
    # a 40-token budget packs several inputs per step; the long one is ~40 tokens, wider than
    # the 8-token local window
    llm = LLM(str(models[name]), runner="pooling", max_num_batched_tokens=64)
    got = torch.tensor([o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)])
    ref = _hf_embed(models[name], TEXTS, "cls")
    assert got.shape == ref.shape
    assert F.cosine_similarity(got, ref, dim=-1).min() >= COS


def _hidden(llm: LLM, ids: list[int]) -> torch.Tensor:
    """Every token's final hidden state from our model (one request, one pack)."""
    n = len(ids)
    with torch.no_grad():
        return llm.engine.model(torch.tensor(ids), torch.arange(n), torch.zeros(n, dtype=torch.long),
                                [n])


def test_hidden_states_match_hf_and_the_window_matters(models: dict[str, Path]) -> None:
    # token by token against HF on an input five times the local window; the same weights
    # with a window wider than the input (rotary theta unchanged) are far from HF, so the
    # comparison sees the window
    import json
    import shutil

    from transformers import AutoModel, AutoTokenizer

    path = models["biases"]
    ids = AutoTokenizer.from_pretrained(path)(TEXTS[3]).input_ids
    assert len(ids) > 5 * 8
    hf = AutoModel.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([ids])).last_hidden_state[0]
    got = _hidden(LLM(str(path), runner="pooling"), ids)
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)
    wide = path.parent / "biases-wide-window"
    shutil.copytree(path, wide, dirs_exist_ok=True)
    cfg = json.loads((wide / "config.json").read_text())
    cfg["local_attention"] = 512
    (wide / "config.json").write_text(json.dumps(cfg))
    other = _hidden(LLM(str(wide), runner="pooling"), ids)
    assert (other - want).abs().max() > 1e-2


def test_embed_sentence_transformers_dir_mean(models: dict[str, Path]) -> None:
    st_module = pytest.importorskip("sentence_transformers")
    path = models["st"]
    llm = LLM(str(path), runner="pooling", max_num_batched_tokens=48)
    got = torch.tensor([o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)])
    ref = _hf_embed(path, TEXTS, "mean")
    assert F.cosine_similarity(got, ref, dim=-1).min() >= COS
    st = torch.from_numpy(st_module.SentenceTransformer(str(path), device="cpu").encode(TEXTS))
    assert F.cosine_similarity(got, st, dim=-1).min() >= COS


def test_classify_and_cross_encoder_score_match_hf(models: dict[str, Path]) -> None:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = models["cls"]
    tok = AutoTokenizer.from_pretrained(path)
    hf = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.stack([hf(input_ids=tok(t, return_tensors="pt").input_ids).logits[0]
                           .softmax(-1) for t in TEXTS])
    got = torch.tensor([o.outputs.probs for o in
                        LLM(str(path), max_num_batched_tokens=40).classify(TEXTS, use_tqdm=False)])
    assert got.shape == ref.shape and torch.allclose(got, ref, atol=1e-5)

    path = models["cross"]
    tok = AutoTokenizer.from_pretrained(path)
    hf = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        want = [torch.sigmoid(hf(input_ids=tok(a, b, return_tensors="pt").input_ids)
                              .logits[0, 0]).item() for a, b in PAIRS]
    outs = LLM(str(path)).score([a for a, _ in PAIRS], [b for _, b in PAIRS], use_tqdm=False)
    assert [o.outputs.score for o in outs] == pytest.approx(want, abs=1e-5)


def test_mean_classifier_pooling_is_refused(tmp_path: Path) -> None:
    path = build_modernbert(tmp_path / "mean", classify=2, classifier_pooling="mean")
    with pytest.raises(ValueError, match="classifier_pooling='mean'"):
        LLM(str(path))
