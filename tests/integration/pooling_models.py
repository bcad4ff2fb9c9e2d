"""Tiny random pooling models for the pooling tests: BERT (WordPiece tokenizer with token
types), XLM-RoBERTa (pad id 1, RoBERTa's `<s> a </s></s> b </s>` pairs, no token types),
their *ForSequenceClassification heads, a Qwen3 base and classifier, and a sentence-transformers
directory around any of them (modules.json + 1_Pooling, optional Normalize).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

WORDS = ("the quick brown fox jumps over lazy dog battery died after two days paris is capital "
         "of france classify sentiment this review summarise following paragraph in one "
         "sentence extract invoice number date and total amount as json write short poem about "
         "sea wind evening light judge whether answer correct explain why a b c d e f g").split()


def bert_tokenizer(path: Path):  # type: ignore[no-untyped-def]
    from transformers import BertTokenizerFast

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS, *(f"##{c}" for c in "sdy")]
    path.mkdir(parents=True, exist_ok=True)
    (path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    tok = BertTokenizerFast(vocab_file=str(path / "vocab.txt"))
    tok.save_pretrained(path)
    return tok


def roberta_tokenizer(path: Path):  # type: ignore[no-untyped-def]
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<s>", "<pad>", "</s>", "<unk>", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>",
        special_tokens=[("<s>", 0), ("</s>", 2)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", unk_token="<unk>", cls_token="<s>",
                                   sep_token="</s>", model_input_names=["input_ids",
                                                                        "attention_mask"])
    path.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(path)
    return fast


def _widen(model, seed: int) -> None:  # type: ignore[no-untyped-def]
    import torch

    torch.manual_seed(seed)
    with torch.no_grad():  # random LayerNorm/bias values, so every parameter matters
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)


def build_encoder(kind: str, path: Path, classify: int | None = None, **overrides) -> Path:  # type: ignore[no-untyped-def]
    """kind "bert" | "xlm-roberta"; `classify`: num_labels of a *ForSequenceClassification."""
    import torch
    import transformers as tf

    tok = bert_tokenizer(path) if kind == "bert" else roberta_tokenizer(path)
    common = dict(vocab_size=len(tok), hidden_size=64, num_hidden_layers=2,
                  num_attention_heads=4, intermediate_size=128, max_position_embeddings=130)
    common.update(overrides)
    if kind == "bert":
        cfg = tf.BertConfig(type_vocab_size=2, pad_token_id=0, **common)
        cls = tf.BertForSequenceClassification if classify else tf.BertModel
    else:
        cfg = tf.XLMRobertaConfig(type_vocab_size=1, pad_token_id=1, bos_token_id=0,
                                  eos_token_id=2, **common)
        cls = tf.XLMRobertaForSequenceClassification if classify else tf.XLMRobertaModel
    if classify:
        cfg.num_labels = classify
    torch.manual_seed(11 if kind == "bert" else 12)
    model = cls(cfg).eval()
    _widen(model, 13)
    model.save_pretrained(path)
    return path


def build_qwen3(path: Path, classify: int | None = None) -> Path:
    import torch
    import transformers as tf

    from tests.conftest import build_tokenizer

    tok = build_tokenizer(path)
    cfg = tf.Qwen3Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=32, max_position_embeddings=1024, pad_token_id=0,
                         tie_word_embeddings=False)
    torch.manual_seed(14)
    if classify:
        cfg.num_labels = classify
        model = tf.Qwen3ForSequenceClassification(cfg).eval()
    else:
        model = tf.Qwen3Model(cfg).eval()
    _widen(model, 15)
    model.save_pretrained(path)
    return path


def sentence_transformers_dir(src: Path, dst: Path, pooling: str = "mean",
                              normalize: bool = True) -> Path:
    """A copy of `src` laid out as a sentence-transformers model with that pooling."""
    shutil.copytree(src, dst, dirs_exist_ok=True)
    modules = [{"idx": 0, "name": "0", "path": "",
                "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
        (dst / "2_Normalize").mkdir(exist_ok=True)
    (dst / "modules.json").write_text(json.dumps(modules))
    (dst / "1_Pooling").mkdir(exist_ok=True)
    hidden = json.loads((src / "config.json").read_text())["hidden_size"]
    (dst / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": hidden,
        "pooling_mode_cls_token": pooling == "cls",
        "pooling_mode_mean_tokens": pooling == "mean",
        "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False,
        "pooling_mode_lasttoken": pooling == "last"}))
    (dst / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 128,
                                                               "do_lower_case": False}))
    return dst
