"""Embedding throughput on the CPU: our pooling engine vs sentence-transformers and HF padded.

Passages with lognormal lengths (median ~60 tokens, a tail to 512) go through a random
BERT-base-shaped model (optionally a Qwen3-0.6B-shaped one), fp32, saved once as a
sentence-transformers directory (mean pooling, normalised) so all three systems load the same
weights:
  * ours: `LLM.embed` (packed varlen steps under max_num_batched_tokens, no padding);
  * sentence-transformers `encode` at its default batch size (it sorts by length);
  * HF `AutoModel` in batches of 32 in input order, padded to each batch's longest, mean
    pooling over the attention mask.
Each repeat runs the three in turn (so a neighbour's load falls on all of them); the table
shows medians with the spread (min-max) and the embeddings' agreement (min cosine), then one
JSON line.

    python benchmarks/embed_throughput.py --passages 400 --repeats 3
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from _common import format_table, wait_for_quiet  # noqa: E402

SHAPES = {
    "bert-base": dict(kind="bert", hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                      intermediate_size=3072, vocab_size=30522, max_position_embeddings=512),
    "qwen3-0.6b": dict(kind="qwen3", hidden_size=1024, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       intermediate_size=3072, vocab_size=151936, max_position_embeddings=4096),
    "tiny-bert": dict(kind="bert", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      intermediate_size=128, vocab_size=2000, max_position_embeddings=512),
}


def build_model(shape: str, root: Path) -> Path:
    """A random model of `shape` with a word-per-token tokenizer, as a sentence-transformers
    directory (mean pooling + Normalize)."""
    import transformers as tf

    spec = dict(SHAPES[shape])
    kind = spec.pop("kind")
    path = root / shape
    path.mkdir(parents=True)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab += [f"w{i}" for i in range(spec["vocab_size"] - len(vocab))]
    (path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    tok = tf.BertTokenizerFast(vocab_file=str(path / "vocab.txt"))
    if kind == "qwen3":
        # a decoder with the same word-level vocabulary; its last token is [SEP]
        tok.chat_template = None
    tok.save_pretrained(path)
    torch.manual_seed(0)
    if kind == "bert":
        model = tf.BertModel(tf.BertConfig(**spec), add_pooling_layer=False)
    else:
        model = tf.Qwen3Model(tf.Qwen3Config(pad_token_id=0, **spec))
    model.eval().save_pretrained(path)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir()
    (path / "2_Normalize").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": spec["hidden_size"], "pooling_mode_mean_tokens": True}))
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 512}))
    return path


def make_passages(n: int, vocab: int, seed: int, median: float = 60.0,
                  sigma: float = 0.7) -> list[str]:
    """Passages of lognormal token counts (two of them [CLS]/[SEP]), clipped to [4, 512]."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = int(min(512, max(4, round(rng.lognormvariate(math.log(median), sigma)))))
        out.append(" ".join(f"w{rng.randrange(vocab - 5)}" for _ in range(length - 2)))
    return out


def run_ours(path: Path, texts: list[str], budget: int) -> tuple[float, torch.Tensor, Any]:
    from batchgen_data import LLM

    llm = LLM(str(path), max_num_batched_tokens=budget, max_num_seqs=1024)
    t0 = time.perf_counter()
    outs = llm.embed(texts, use_tqdm=False)
    wall = time.perf_counter() - t0
    return wall, torch.tensor([o.outputs.embedding for o in outs]), llm.engine.stats


def run_st(path: Path, texts: list[str]) -> tuple[float, torch.Tensor]:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(path), device="cpu")
    t0 = time.perf_counter()
    emb = model.encode(texts, convert_to_tensor=True)
    return time.perf_counter() - t0, emb.float()


def run_hf_padded(path: Path, texts: list[str], batch: int = 32) -> tuple[float, torch.Tensor]:
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    rows = []
    t0 = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(texts), batch):
            enc = tok(texts[i:i + batch], padding=True, return_tensors="pt")
            h = model(**enc).last_hidden_state
            mask = enc["attention_mask"].unsqueeze(-1).float()
            rows.append(torch.nn.functional.normalize((h * mask).sum(1) / mask.sum(1), dim=-1))
    return time.perf_counter() - t0, torch.cat(rows)


def spread(xs: list[float]) -> str:
    return f"{min(xs):.1f}-{max(xs):.1f}"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="bert-base")
    ap.add_argument("--passages", type=int, default=10_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--budget", type=int, default=4096, help="max_num_batched_tokens")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--wait-quiet", type=float, default=0.0,
                    help="seconds to wait for the load average to fall under 3 first")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    load = wait_for_quiet(args.wait_quiet, below=3.0) if args.wait_quiet else os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        path = build_model(args.shape, Path(tmp))
        texts = make_passages(args.passages, SHAPES[args.shape]["vocab_size"], args.seed)
        lens = [len(t.split()) + 2 for t in texts]
        times: dict[str, list[float]] = {"ours": [], "sentence-transformers": [], "hf-padded": []}
        cos_st, cos_hf = 1.0, 1.0
        stats = None
        for _ in range(args.repeats):
            wall, ours, stats = run_ours(path, texts, args.budget)
            times["ours"].append(wall)
            wall, st = run_st(path, texts)
            times["sentence-transformers"].append(wall)
            wall, hf = run_hf_padded(path, texts)
            times["hf-padded"].append(wall)
            cos_st = min(cos_st, torch.nn.functional.cosine_similarity(ours, st).min().item())
            cos_hf = min(cos_hf, torch.nn.functional.cosine_similarity(ours, hf).min().item())
    med = {k: statistics.median(v) for k, v in times.items()}
    pps = {k: args.passages / v for k, v in med.items()}
    records = [{"system": k, "passages_s": round(pps[k], 2), "wall_s": round(med[k], 2),
                "wall_spread_s": spread(times[k]),
                "vs_st": round(pps[k] / pps["sentence-transformers"], 2),
                "vs_hf_padded": round(pps[k] / pps["hf-padded"], 2)} for k in times]
    print(f"{args.shape}, {args.passages} passages (tokens: median {statistics.median(lens)}, "
          f"max {max(lens)}, total {sum(lens)}), {args.repeats} repeats, "
          f"{torch.get_num_threads()} threads, load {load:.1f} at start")
    print(format_table(records, ["system", "passages_s", "wall_s", "wall_spread_s", "vs_st",
                                 "vs_hf_padded"]))
    print(f"embeddings agree: min cosine ours-vs-st {cos_st:.6f}, ours-vs-hf {cos_hf:.6f}")
    result = {"benchmark": "embed_throughput", "shape": args.shape, "passages": args.passages,
              "repeats": args.repeats, "budget": args.budget,
              "threads": torch.get_num_threads(), "load_at_start": round(load, 2),
              "tokens_total": sum(lens), "tokens_median": statistics.median(lens),
              "tokens_max": max(lens),
              "passages_s": {k: round(v, 2) for k, v in pps.items()},
              "wall_s_all": {k: [round(x, 2) for x in v] for k, v in times.items()},
              "ratio_vs_st": round(pps["ours"] / pps["sentence-transformers"], 2),
              "ratio_vs_hf_padded": round(pps["ours"] / pps["hf-padded"], 2),
              "min_cosine_vs_st": round(cos_st, 6), "min_cosine_vs_hf": round(cos_hf, 6),
              "ours_steps": stats.num_steps if stats else None,
              "ours_max_step_tokens": stats.max_step_tokens if stats else None}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
